"""A Gated-DeltaNet layer's input projections as one W8A8 GEMM that writes q|k|v, z, b and a apart.

SGLang 0.5.17 runs each GDN layer's in_proj_qkvz and in_proj_ba as two GEMMs (in a CUDA graph, the small one on a
side stream, joined before the next kernel), then a split kernel that copies their outputs into the contiguous
q|k|v, z, b and a the layer reads. One GEMM over both weights that writes each of the four into its own [M, width]
block (kernels/w8a8_gemm.py's output cuts) does the same in less time at decode sizes (BENCHMARKS.md, 2026-12-04,
twenty-ninth session). `merge`, called by qflash's model class as it is built, puts both layers'
int8 rows and scales into one weight and one scale vector that their parameters then view, so SGLang's loader
fills them in place; the hooks run the one GEMM in `_forward_input_proj` and hand its four blocks through SGLang's
split call. Retire when SGLang fuses in_proj_qkvz and in_proj_ba into one linear layer whose output it splits
without a copy.
"""

import torch

from qflash.kernels import w8a8_gemm
from qflash.kernels.config_table import gemm_phase
from qflash.quant import handoff
from qflash.quant.method import runs_w8a8
from qflash.server.hooks import Hook

MERGED = "qflash_merged_input"  # on a GDN layer: (int8 weight [N, K], fp32 scales [N], the output's cuts)


def _mergeable(gdn: torch.nn.Module) -> bool:
    """Both projections W8A8 without bias, on one GPU, with a head ratio SGLang's forward splits by its kernel."""
    qkvz, ba = gdn.in_proj_qkvz, gdn.in_proj_ba
    return (runs_w8a8(qkvz) and runs_w8a8(ba) and qkvz.bias is None and ba.bias is None and gdn.attn_tp_size == 1
            and gdn.num_v_heads // gdn.num_k_heads in (1, 2, 4))


def merge(layers) -> int:
    """Give each GDN layer of `layers` one weight and scale vector for in_proj_qkvz and in_proj_ba (their parameters
    become row views of them, before loading); returns how many layers were merged."""
    merged = 0
    for layer in layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None or not _mergeable(gdn):
            continue
        qkvz, ba = gdn.in_proj_qkvz, gdn.in_proj_ba
        weight = torch.cat([qkvz.weight.data, ba.weight.data])
        scale = torch.cat([qkvz.weight_scale.data, ba.weight_scale.data])  # [N, 1], as SGLang's int8 method makes it
        rows = qkvz.weight.shape[0]
        for linear, part in ((qkvz, slice(0, rows)), (ba, slice(rows, None))):
            linear.weight.data = weight[part]
            linear.weight_scale.data = scale[part]
        # q|k|v (the conv's input), z (one value dim a value head), b and a (one a value head)
        cuts = [gdn.conv_dim, gdn.conv_dim + gdn.value_dim, gdn.conv_dim + gdn.value_dim + gdn.num_v_heads]
        setattr(gdn, MERGED, (weight, scale.view(-1), cuts))
        merged += 1
    return merged


def _still_viewed(gdn: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether both projections' parameters still view the merged tensors (a loader that replaced them with copies
    would leave the merged ones unloaded)."""
    rows = gdn.in_proj_qkvz.weight.shape[0]
    return (gdn.in_proj_qkvz.weight.data_ptr() == weight.data_ptr()
            and gdn.in_proj_ba.weight.data_ptr() == weight[rows:].data_ptr()
            and gdn.in_proj_qkvz.weight_scale.data_ptr() == scale.data_ptr()
            and gdn.in_proj_ba.weight_scale.data_ptr() == scale[rows:].data_ptr())


def _one_gemm(original, self, hidden_states):
    merged = getattr(self, MERGED, None)
    if merged is None or not isinstance(hidden_states, torch.Tensor):
        return original(self, hidden_states)
    weight, scale, cuts = merged
    if not torch.compiler.is_compiling() and not _still_viewed(self, weight, scale):  # traced: no memory to compare
        raise RuntimeError(f"qflash: GDN layer {self.layer_id}'s input projections no longer view their merged weight")
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    x_q, x_scale = handoff.take(x)
    phase = gemm_phase(self.in_proj_qkvz.quant_method.decode_phase, x.shape[0])
    y = torch.ops.qflash.w8a8_gemm_segments(x, weight, scale, cuts, phase, x_q, x_scale)
    return w8a8_gemm.segments(y, x.shape[0], cuts, weight.shape[0]), None  # read by `_split`, in place of SGLang's two outputs


def _split(original, mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    if mixed_ba is not None:
        return original(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v)
    qkv, z, b, a = mixed_qkvz
    return qkv, z.view(-1, num_heads_v, head_v), b, a


CHANGES = [
    Hook("sglang.srt.models.qwen3_5.Qwen3_5GatedDeltaNet._forward_input_proj", _one_gemm, "AROUND"),
    Hook("sglang.srt.models.qwen3_5.fused_qkvzba_split_reshape_cat_contiguous", _split, "AROUND"),
]
