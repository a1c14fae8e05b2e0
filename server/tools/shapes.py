"""The GEMMs of Qwen3.5-4B and its DFlash drafter as SGLang runs them (after its weight fusions), from the preset.

(name, N, K): y[M, N] = x[M, K] @ w[N, K]^T. M is 16 per request in verify and draft (block 16), the prompt
length in prefill. The tuner, `qflash bench-kernels` and the kernel tests read these. The drafter's qkv_proj
runs on its int8 copy (quant/method.py, DrafterQKVMethod); its fc is not here (a plain `nn.Linear` in SGLang's
DFlash model, which no quantization method reaches).
"""

from qflash.server.preset import DRAFTER_CONFIG, TEXT_CONFIG

_t, _d = TEXT_CONFIG, DRAFTER_CONFIG
HIDDEN = _t["hidden_size"]
# Gated-DeltaNet heads: key heads x key dim, value heads x value dim.
GDN_HEADS = (_t["linear_num_key_heads"], _t["linear_num_value_heads"], _t["linear_key_head_dim"])
GDN_KEY = _t["linear_num_key_heads"] * _t["linear_key_head_dim"]
GDN_VALUE = _t["linear_num_value_heads"] * _t["linear_value_head_dim"]
# The GDN input GEMM's output segments (server/hooks/gdn_input_proj.py's cuts): q|k|v, the causal conv's channels,
# then z, b and a; and the conv's width.
GDN_CONV = 2 * GDN_KEY + GDN_VALUE
GDN_IN_PROJ_CUTS = (GDN_CONV, GDN_CONV + GDN_VALUE, GDN_CONV + GDN_VALUE + _t["linear_num_value_heads"])
GDN_CONV_WIDTH = _t["linear_conv_kernel_dim"]
ATTENTION_HEADS = (_t["num_attention_heads"], _t["num_key_value_heads"], _t["head_dim"])  # query, KV heads, dim
_q, _kv, _hd = ATTENTION_HEADS

TARGET = [
    # in_proj_qkvz and in_proj_ba, run as one GEMM (server/models/qwen3_5_text.py, server/hooks/gdn_input_proj.py)
    ("gdn.in_proj_qkvzba", 2 * GDN_KEY + 2 * GDN_VALUE + 2 * _t["linear_num_value_heads"], HIDDEN),
    ("gdn.out_proj", HIDDEN, GDN_VALUE),
    ("attn.qkv_proj", 2 * _q * _hd + 2 * _kv * _hd, HIDDEN),  # the query doubled: attn_output_gate
    ("attn.o_proj", HIDDEN, _q * _hd),
    ("mlp.gate_up_proj", 2 * _t["intermediate_size"], HIDDEN),
    ("mlp.down_proj", HIDDEN, _t["intermediate_size"]),
]
DRAFTER = [
    ("draft.qkv_proj", (_d["num_attention_heads"] + 2 * _d["num_key_value_heads"]) * _d["head_dim"], _d["hidden_size"]),
    ("draft.o_proj", _d["hidden_size"], _d["num_attention_heads"] * _d["head_dim"]),
    ("draft.gate_up_proj", 2 * _d["intermediate_size"], _d["hidden_size"]),
    ("draft.down_proj", _d["hidden_size"], _d["intermediate_size"]),
]
LM_HEAD = ("lm_head", _t["vocab_size"], HIDDEN)

# How often each target GEMM runs in one forward, from the layer types.
GDN_LAYERS = sum(kind == "linear_attention" for kind in _t["layer_types"])
ATTENTION_LAYERS = _t["num_hidden_layers"] - GDN_LAYERS
TARGET_COUNT = {"gdn.in_proj_qkvzba": GDN_LAYERS, "gdn.out_proj": GDN_LAYERS,
                "attn.qkv_proj": ATTENTION_LAYERS, "attn.o_proj": ATTENTION_LAYERS,
                "mlp.gate_up_proj": _t["num_hidden_layers"], "mlp.down_proj": _t["num_hidden_layers"]}
