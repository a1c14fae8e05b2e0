"""The preset holds the published Qwen3.5-4B and Qwen3.5-4B-DFlash shapes (shared/reference facts)."""

from qflash.server import preset


def text_params(c: dict) -> int:
    """Parameters of the tied text model, counted from the config's shapes."""
    h, ffn, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    k_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    v_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv = 2 * k_dim + v_dim
    nv = c["linear_num_value_heads"]
    gdn = h * (conv + v_dim + 2 * nv) + v_dim * h + conv * c["linear_conv_kernel_dim"] + 2 * nv + c["linear_value_head_dim"]
    q, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    attn = h * 2 * q * hd + 2 * h * kv * hd + q * hd * h + 2 * hd
    common = 3 * h * ffn + 2 * h
    layers = sum((attn if t == "full_attention" else gdn) + common for t in c["layer_types"])
    return v * h + layers + h


def drafter_params(c: dict) -> int:
    h, ffn = c["hidden_size"], c["intermediate_size"]
    q, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    layer = h * q * hd + 2 * h * kv * hd + q * hd * h + 2 * hd + 3 * h * ffn + 2 * h
    taps = len(c["dflash_config"]["target_layer_ids"])
    return taps * h * h + h + h + c["num_hidden_layers"] * layer


def test_target_shapes_are_qwen35_4b():
    c = preset.TEXT_CONFIG
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (2560, 9216, 32)
    full = [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
    assert full == [3, 7, 11, 15, 19, 23, 27, 31]
    assert c["layer_types"].count("linear_attention") == 24
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["attn_output_gate"]) == (16, 4, 256, True)
    assert (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]) == (16, 32, 128, 128)
    assert c["vocab_size"] == 248320 and c["tie_word_embeddings"] and preset.TARGET_CONFIG["tie_word_embeddings"]
    assert c["rope_parameters"]["rope_theta"] == 10_000_000 and c["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert c["partial_rotary_factor"] == 0.25 and c["eos_token_id"] == 248044
    assert preset.TARGET_CONFIG["architectures"] == ["Qwen3_5ForConditionalGeneration"]


def test_target_parameter_count_matches_the_checkpoint():
    # 4,659,865,088 checkpoint params = 4,205,751,296 text (tied) + MTP + vision tower.
    assert text_params(preset.TEXT_CONFIG) == 4_205_751_296
    assert text_params(preset.TEXT_CONFIG) + 120_599_552 + 333_514_240 == 4_659_865_088


def test_drafter_is_z_lab_qwen35_4b_dflash():
    c = preset.DRAFTER_CONFIG
    assert c["architectures"] == ["DFlashDraftModel"] and c["num_hidden_layers"] == 6
    assert c["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] and c["sliding_window"] == 4096
    assert c["dflash_config"] == {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]}
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (32, 8, 128)
    assert drafter_params(c) == 634_425_856


def test_serving_flags_use_dflash_block_16():
    flags = preset.DFLASH_FLAGS
    assert flags[flags.index("--speculative-algorithm") + 1] == "DFLASH"
    assert flags[flags.index("--speculative-dflash-block-size") + 1] == "16"


def test_prefix_caching_is_on_with_gdn_state_checkpoints():
    assert preset.PREFIX_CACHE is True
    assert not {"--disable-radix-cache", "--mamba-radix-cache-strategy"} & set(preset.DFLASH_FLAGS)
    assert preset.PREFIX_CACHE_FLAGS == {True: ["--mamba-radix-cache-strategy", "extra_buffer"],
                                         False: ["--disable-radix-cache"]}
