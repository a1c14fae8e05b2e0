"""What one qflash speculative cycle must move through HBM, by `qflash profile` kernel family: the time no kernel
can beat at M = 16, where every phase reads its weights and states once and its activations are kilobytes.

Per cycle: the W8A8 GEMMs read the int8 target body and the drafter's int8 layers; the W8A16 lm_head reads the
int8 vocabulary matrix for the verify's logits, and the draft's pick reads its 4-bit copy (kernels/w4_draft_pick.py);
the drafter's bf16 GEMMs read its fc over the target's hidden states and, for the context-KV write, the K|V rows of
its qkv_proj's bf16 weights (quant/method.py, DrafterQKVMethod); Gated-DeltaNet reads each layer's fp32 state in the
verify, reads and writes it in the commit's fold; attention reads the KV cache of the context (the target's
full-attention layers, the drafter's five sliding and one full layer). Norms, quantization, copies and sampling
move activations only: no floor to speak of.
"""

from qflash.kernels import w4_draft_pick
from qflash.server.preset import DRAFTER_CONFIG
from qflash.server.tools.shapes import (ATTENTION_HEADS, ATTENTION_LAYERS, DRAFTER, GDN_HEADS, GDN_LAYERS, HIDDEN,
                                        LM_HEAD, TARGET, TARGET_COUNT)

# Device-to-device copy rate (read + write, TB/s) measured on each card the device tool lends, by a word of its name
# (the H100's: BENCHMARKS.md, 2026-12-05, thirty-sixth session). Issue 23's targets are set on the H200.
COPY_TBPS = {"H200": 4.3, "H100": 3.0}
REFERENCE_CARD = "H200"  # the rate a card without a measured one is held to


def card_rate(device_name: str) -> tuple[str, float]:
    """(the card whose measured copy rate applies to `device_name`, that rate in TB/s)."""
    card = next((card for card in COPY_TBPS if card in device_name), REFERENCE_CARD)
    return card, COPY_TBPS[card]


def _bytes_per_cycle(context: int) -> dict[str, float]:
    d = DRAFTER_CONFIG
    drafter_layers = d["num_hidden_layers"]
    _, value_heads, head_dim = GDN_HEADS
    _, kv_heads, attention_dim = ATTENTION_HEADS
    drafter_kv_rows = 2 * d["num_key_value_heads"] * d["head_dim"] * HIDDEN
    drafter_fc = len(d["dflash_config"]["target_layer_ids"]) * HIDDEN * HIDDEN
    drafter_kv_token = 2 * d["num_key_value_heads"] * d["head_dim"] * 2  # bf16 K and V of one token, one layer
    drafter_context = sum(min(context, d["sliding_window"]) if kind == "sliding_attention" else context
                          for kind in d["layer_types"])
    return {
        "qflash W8A8 GEMM": sum(n * k * TARGET_COUNT[name] for name, n, k in TARGET)
                            + drafter_layers * sum(n * k for _, n, k in DRAFTER),
        "qflash W8A16 lm_head": LM_HEAD[1] * LM_HEAD[2],
        "qflash draft pick": LM_HEAD[1] * LM_HEAD[2] // 2 + LM_HEAD[1] * LM_HEAD[2] // w4_draft_pick.GROUP,
        "bf16 GEMM (cuBLAS / CUTLASS)": 2 * (drafter_layers * drafter_kv_rows + drafter_fc),
        "Gated-DeltaNet": 3 * GDN_LAYERS * value_heads * head_dim * head_dim * 4,
        "attention": ATTENTION_LAYERS * context * 2 * kv_heads * attention_dim * 2
                     + drafter_context * drafter_kv_token,
    }


def per_cycle_ms(context: int, device_name: str = REFERENCE_CARD) -> dict[str, float]:
    """Each family's floor in ms per cycle at `context` tokens of KV cache, at the card's copy rate."""
    tbps = card_rate(device_name)[1]
    return {family: size / (tbps * 1e9) for family, size in _bytes_per_cycle(context).items()}
