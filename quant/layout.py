"""qflash's checkpoint format: the tensors of a Hugging Face Qwen3.5 checkpoint, which of them qflash quantizes,
and the config keys of a `qflash quantize` output.

Names are those of the published Qwen3.5-4B (`model.language_model.*`, `model.visual.*`, `mtp.*`); shapes
follow from a config, so a small config gives a small checkpoint of the same layout for tests. No torch at
import: `qflash serve` reads the format before anything heavy loads.
"""

METHOD_NAME = "qflash_w8a8"  # SGLang quantization method that serves the format (quant/method.py)
LM_HEAD = "lm_head.weight"
LM_HEAD_KEY = "qflash_lm_head"  # quantization_config key describing the int8 lm_head: marks a qflash checkpoint
SMOOTH_KEY = "qflash_smoothquant"  # quantization_config key: alpha and calibration size, when smoothed
WEIGHT_FILES = ("*.safetensors", "*.bin")  # what a folder with weights holds (a dummy folder holds none)

TEXT = "model.language_model."
DROPPED = ("model.visual.", "mtp.")  # vision tower and MTP head: not part of the text checkpoint
# Decoder-layer linears, quantized to int8 per output channel (W8A8 at run time).
LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
           "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def text_name(name: str) -> str | None:
    """A multimodal checkpoint tensor's name in the text model (`model.language_model.x` -> `model.x`), or None for
    the vision tower's and MTP head's tensors."""
    if name.startswith(DROPPED):
        return None
    return "model." + name[len(TEXT):] if name.startswith(TEXT) else name


def _decoder_layer(prefix: str, c: dict, full_attention: bool) -> list[tuple[str, tuple, str]]:
    h = c["hidden_size"]
    if full_attention:
        q, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        mixer = [("self_attn.q_proj.weight", (2 * q * hd, h), "bfloat16"), ("self_attn.k_proj.weight", (kv * hd, h), "bfloat16"),
                 ("self_attn.v_proj.weight", (kv * hd, h), "bfloat16"), ("self_attn.o_proj.weight", (h, q * hd), "bfloat16"),
                 ("self_attn.q_norm.weight", (hd,), "bfloat16"), ("self_attn.k_norm.weight", (hd,), "bfloat16")]
    else:
        key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        nv, value = c["linear_num_value_heads"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
        mixer = [("linear_attn.in_proj_qkv.weight", (2 * key + value, h), "bfloat16"),
                 ("linear_attn.in_proj_z.weight", (value, h), "bfloat16"),
                 ("linear_attn.in_proj_b.weight", (nv, h), "bfloat16"), ("linear_attn.in_proj_a.weight", (nv, h), "bfloat16"),
                 ("linear_attn.conv1d.weight", (2 * key + value, 1, c["linear_conv_kernel_dim"]), "bfloat16"),
                 ("linear_attn.A_log", (nv,), "float32"), ("linear_attn.dt_bias", (nv,), "bfloat16"),
                 ("linear_attn.norm.weight", (c["linear_value_head_dim"],), "float32"),
                 ("linear_attn.out_proj.weight", (h, value), "bfloat16")]
    mlp = [("mlp.gate_proj.weight", (c["intermediate_size"], h), "bfloat16"),
           ("mlp.up_proj.weight", (c["intermediate_size"], h), "bfloat16"),
           ("mlp.down_proj.weight", (h, c["intermediate_size"]), "bfloat16"),
           ("input_layernorm.weight", (h,), "bfloat16"), ("post_attention_layernorm.weight", (h,), "bfloat16")]
    return [(prefix + name, shape, dtype) for name, shape, dtype in mixer + mlp]


def _vision(v: dict) -> list[tuple[str, tuple, str]]:
    d, ffn, merged, p = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2, "model.visual."
    out = [(p + "patch_embed.proj.weight", (d, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])),
           (p + "patch_embed.proj.bias", (d,)), (p + "pos_embed.weight", (v["num_position_embeddings"], d))]
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        out += [(b + "norm1.weight", (d,)), (b + "norm1.bias", (d,)), (b + "norm2.weight", (d,)), (b + "norm2.bias", (d,)),
                (b + "attn.qkv.weight", (3 * d, d)), (b + "attn.qkv.bias", (3 * d,)), (b + "attn.proj.weight", (d, d)),
                (b + "attn.proj.bias", (d,)), (b + "mlp.linear_fc1.weight", (ffn, d)), (b + "mlp.linear_fc1.bias", (ffn,)),
                (b + "mlp.linear_fc2.weight", (d, ffn)), (b + "mlp.linear_fc2.bias", (d,))]
    out += [(p + "merger.norm.weight", (d,)), (p + "merger.norm.bias", (d,)), (p + "merger.linear_fc1.weight", (merged, merged)),
            (p + "merger.linear_fc1.bias", (merged,)), (p + "merger.linear_fc2.weight", (v["out_hidden_size"], merged)),
            (p + "merger.linear_fc2.bias", (v["out_hidden_size"],))]
    return [(name, shape, "bfloat16") for name, shape in out]


def checkpoint_tensors(config: dict) -> list[tuple[str, tuple, "torch.dtype"]]:  # noqa: F821
    """Every tensor of the published multimodal checkpoint for `config` (a Qwen3.5 config.json dict):
    (name, shape, torch dtype)."""
    import torch

    c, h = config["text_config"], config["text_config"]["hidden_size"]
    out = [(TEXT + "embed_tokens.weight", (c["vocab_size"], h), "bfloat16")]
    for i, kind in enumerate(c["layer_types"]):
        out += _decoder_layer(f"{TEXT}layers.{i}.", c, kind == "full_attention")
    out.append((TEXT + "norm.weight", (h,), "bfloat16"))
    if not config.get("tie_word_embeddings", True):
        out.append((LM_HEAD, (c["vocab_size"], h), "bfloat16"))
    out += [("mtp.fc.weight", (h, 2 * h), "bfloat16"), ("mtp.pre_fc_norm_embedding.weight", (h,), "bfloat16"),
            ("mtp.pre_fc_norm_hidden.weight", (h,), "bfloat16"), ("mtp.norm.weight", (h,), "bfloat16")]
    out += _decoder_layer("mtp.layers.0.", c, True) + _vision(config["vision_config"])
    return [(name, shape, getattr(torch, dtype)) for name, shape, dtype in out]


def is_quantized_linear(name: str) -> bool:
    """A decoder-layer linear weight of the text model (W8A8 in the quantized checkpoint)."""
    return name.startswith(TEXT + "layers.") and name.endswith(".weight") and name[:-len(".weight")].endswith(LINEARS)


def quantization_config(text_layers: int) -> dict:
    """The compressed-tensors `int-quantized` description of the body (what stock SGLang's W8A8 int8 scheme reads),
    with the int8 lm_head under qflash's own key, which stock methods ignore."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**int8, "strategy": "channel", "dynamic": False},
            "input_activations": {**int8, "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head"],
        LM_HEAD_KEY: {"format": "w8a16", "weights": {**int8, "strategy": "channel"}, "text_layers": text_layers},
    }


def quantized_config(config: dict, smoothing: dict | None = None) -> dict:
    """The config.json of `qflash quantize`'s output: untied lm_head, the quantization_config above (plus how it
    was smoothed, if it was)."""
    text = dict(config["text_config"], tie_word_embeddings=False)
    quant = quantization_config(text["num_hidden_layers"]) | ({SMOOTH_KEY: smoothing} if smoothing else {})
    return {**config, "text_config": text, "tie_word_embeddings": False, "quantization_config": quant}


def is_qflash_config(config: dict) -> bool:
    """True for the config.json of a `qflash quantize` output."""
    return LM_HEAD_KEY in (config.get("quantization_config") or {})
