"""The tensors of a Hugging Face Qwen3.5 checkpoint: names, shapes, dtypes, and which ones qflash quantizes.

Names are those of the published Qwen3.5-4B (`model.language_model.*`, `model.visual.*`, `mtp.*`);
shapes follow from a config, so a small config gives a small checkpoint of the same layout for tests.
"""

import torch

TEXT = "model.language_model."
# Decoder-layer linears, quantized to int8 per output channel (W8A8 at run time).
LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
           "linear_attn.out_proj", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DROPPED = ("model.visual.", "mtp.")  # vision tower and MTP head: not part of the text checkpoint


def _decoder_layer(prefix: str, c: dict, full_attention: bool) -> list[tuple[str, tuple, torch.dtype]]:
    h, bf16, f32 = c["hidden_size"], torch.bfloat16, torch.float32
    if full_attention:
        q, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        mixer = [("self_attn.q_proj.weight", (2 * q * hd, h), bf16), ("self_attn.k_proj.weight", (kv * hd, h), bf16),
                 ("self_attn.v_proj.weight", (kv * hd, h), bf16), ("self_attn.o_proj.weight", (h, q * hd), bf16),
                 ("self_attn.q_norm.weight", (hd,), bf16), ("self_attn.k_norm.weight", (hd,), bf16)]
    else:
        key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        nv, value = c["linear_num_value_heads"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
        mixer = [("linear_attn.in_proj_qkv.weight", (2 * key + value, h), bf16), ("linear_attn.in_proj_z.weight", (value, h), bf16),
                 ("linear_attn.in_proj_b.weight", (nv, h), bf16), ("linear_attn.in_proj_a.weight", (nv, h), bf16),
                 ("linear_attn.conv1d.weight", (2 * key + value, 1, c["linear_conv_kernel_dim"]), bf16),
                 ("linear_attn.A_log", (nv,), f32), ("linear_attn.dt_bias", (nv,), bf16),
                 ("linear_attn.norm.weight", (c["linear_value_head_dim"],), f32), ("linear_attn.out_proj.weight", (h, value), bf16)]
    mlp = [("mlp.gate_proj.weight", (c["intermediate_size"], h), bf16), ("mlp.up_proj.weight", (c["intermediate_size"], h), bf16),
           ("mlp.down_proj.weight", (h, c["intermediate_size"]), bf16),
           ("input_layernorm.weight", (h,), bf16), ("post_attention_layernorm.weight", (h,), bf16)]
    return [(prefix + name, shape, dtype) for name, shape, dtype in mixer + mlp]


def _vision(v: dict) -> list[tuple[str, tuple, torch.dtype]]:
    d, ffn, bf16 = v["hidden_size"], v["intermediate_size"], torch.bfloat16
    merged = d * v["spatial_merge_size"] ** 2
    out = [("model.visual.patch_embed.proj.weight", (d, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"]), bf16),
           ("model.visual.patch_embed.proj.bias", (d,), bf16), ("model.visual.pos_embed.weight", (v["num_position_embeddings"], d), bf16)]
    for i in range(v["depth"]):
        p = f"model.visual.blocks.{i}."
        out += [(p + "norm1.weight", (d,), bf16), (p + "norm1.bias", (d,), bf16), (p + "norm2.weight", (d,), bf16),
                (p + "norm2.bias", (d,), bf16), (p + "attn.qkv.weight", (3 * d, d), bf16), (p + "attn.qkv.bias", (3 * d,), bf16),
                (p + "attn.proj.weight", (d, d), bf16), (p + "attn.proj.bias", (d,), bf16),
                (p + "mlp.linear_fc1.weight", (ffn, d), bf16), (p + "mlp.linear_fc1.bias", (ffn,), bf16),
                (p + "mlp.linear_fc2.weight", (d, ffn), bf16), (p + "mlp.linear_fc2.bias", (d,), bf16)]
    out += [("model.visual.merger.norm.weight", (d,), bf16), ("model.visual.merger.norm.bias", (d,), bf16),
            ("model.visual.merger.linear_fc1.weight", (merged, merged), bf16), ("model.visual.merger.linear_fc1.bias", (merged,), bf16),
            ("model.visual.merger.linear_fc2.weight", (v["out_hidden_size"], merged), bf16),
            ("model.visual.merger.linear_fc2.bias", (v["out_hidden_size"],), bf16)]
    return out


def checkpoint_tensors(config: dict) -> list[tuple[str, tuple, torch.dtype]]:
    """Every tensor of the published multimodal checkpoint for `config` (a Qwen3.5 config.json dict)."""
    c, h, bf16 = config["text_config"], config["text_config"]["hidden_size"], torch.bfloat16
    out = [(TEXT + "embed_tokens.weight", (c["vocab_size"], h), bf16)]
    for i, kind in enumerate(c["layer_types"]):
        out += _decoder_layer(f"{TEXT}layers.{i}.", c, kind == "full_attention")
    out.append((TEXT + "norm.weight", (h,), bf16))
    if not config.get("tie_word_embeddings", True):
        out.append(("lm_head.weight", (c["vocab_size"], h), bf16))
    out += [("mtp.fc.weight", (h, 2 * h), bf16), ("mtp.pre_fc_norm_embedding.weight", (h,), bf16),
            ("mtp.pre_fc_norm_hidden.weight", (h,), bf16), ("mtp.norm.weight", (h,), bf16)]
    out += _decoder_layer("mtp.layers.0.", c, True)
    return out + _vision(config["vision_config"])


def is_quantized_linear(name: str) -> bool:
    """A decoder-layer linear weight of the text model (W8A8 in the quantized checkpoint)."""
    return name.startswith(TEXT + "layers.") and name.endswith(".weight") and name[:-len(".weight")].endswith(LINEARS)
