"""A Gated-DeltaNet layer's input projections as one W8A8 GEMM that writes q|k|v, z, b and a apart.

SGLang 0.5.17 runs each GDN layer's in_proj_qkvz and in_proj_ba as two GEMMs (in a CUDA graph, the small one on a
side stream, joined before the next kernel), then a split kernel that copies their outputs into the contiguous
q|k|v, z, b and a the layer reads. One GEMM over both weights that writes each of the four into its own [M, width]
block (kernels/w8a8_gemm.py's output cuts) does the same in less time at decode sizes (BENCHMARKS.md, 2026-12-04,
twenty-ninth session). `merge`, called by qflash's model class as it is built, puts both layers'
int8 rows and scales into one weight and one scale vector that their parameters then view, so SGLang's loader
fills them in place; the hooks run the one GEMM in `_forward_input_proj` and hand its four blocks through SGLang's
split call.

In a target verify, the GEMM also runs the layer's causal-conv1d update of q|k|v in its epilogue: each tile holds a
request's whole 16-token block, so the conv needs no other tile (kernels/conv_update.py `conv_in_place`), and one
launch a layer goes (24 a cycle). The GEMM waits for the conv call: `_one_gemm` hands out the views of an output
not yet written and the conv call runs the GEMM (`conv_in_gemm`). In SGLang's verify the conv is the first reader of
the GEMM's outputs (gdn_backend `forward_extend`); a conv call qflash's kernel does not take runs the GEMM as it is
first, and a layer that ends with the GEMM not run refuses to go on.
Retire when SGLang fuses in_proj_qkvz and in_proj_ba into one linear layer whose output it splits without a copy, and
runs the conv update in that layer's epilogue.
"""

import torch

from qflash.kernels import conv_update, w8a8_gemm
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


class _Verify:
    """The GDN layer whose target-verify forward runs, its block length, and the input GEMM waiting for its conv."""

    layer = None
    block = 0
    gemm = None  # (run(conv or None), the output)


def verifying() -> bool:
    """Whether a GDN layer with the one input GEMM runs its target-verify forward now."""
    return _Verify.layer is not None


def _verify_window(original, self, hidden_states, forward_batch, *args, **kwargs):
    if not (forward_batch.forward_mode.is_target_verify() and getattr(self, MERGED, None) is not None):
        return original(self, hidden_states, forward_batch, *args, **kwargs)
    _Verify.layer, _Verify.block = self, forward_batch.spec_info.draft_token_num
    try:
        out = original(self, hidden_states, forward_batch, *args, **kwargs)
    finally:
        _Verify.layer, waiting, _Verify.gemm = None, _Verify.gemm, None
    if waiting is not None:
        raise RuntimeError(f"qflash: GDN layer {self.layer_id}'s input GEMM waited for a conv call that never came")
    return out


def conv_in_gemm(takes: bool, x: torch.Tensor, *args, **kwargs) -> bool:
    """Before a conv call on x: runs the input GEMM waiting for it, if any, with the call's conv update in its epilogue
    where qflash's kernel `takes` the call and x is the GEMM's q|k|v (returns True: x then holds the conv's output),
    else as it is."""
    waiting, _Verify.gemm = _Verify.gemm, None
    if waiting is None:
        return False
    run, y = waiting
    fused = takes and x.data_ptr() == y.data_ptr()
    run(conv_update.epilogue(x, *args, **kwargs) if fused else None)
    return fused


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
    config = w8a8_gemm.table_config(phase, x.shape[0], weight.shape[0], x.shape[1]) if _Verify.layer is self else None
    if (config is not None and not torch.compiler.is_compiling()
            and w8a8_gemm.conv_fits(config, x.shape[0], cuts, _Verify.block)):
        y = x.new_empty((x.shape[0] * weight.shape[0],))
        _Verify.gemm = (lambda conv: w8a8_gemm.launch(x, weight, scale, None, config, x_q, x_scale, cuts, conv, y)), y
    else:
        y = torch.ops.qflash.w8a8_gemm_segments(x, weight, scale, cuts, phase, x_q, x_scale)
    return w8a8_gemm.segments(y, x.shape[0], cuts, weight.shape[0]), None  # read by `_split`, in place of SGLang's two outputs


def _split(original, mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    if mixed_ba is not None:
        return original(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v)
    qkv, z, b, a = mixed_qkvz
    return qkv, z.view(-1, num_heads_v, head_v), b, a


CHANGES = [
    Hook("sglang.srt.models.qwen3_5.Qwen3_5GatedDeltaNet.forward", _verify_window, "AROUND"),
    Hook("sglang.srt.models.qwen3_5.Qwen3_5GatedDeltaNet._forward_input_proj", _one_gemm, "AROUND"),
    Hook("sglang.srt.models.qwen3_5.fused_qkvzba_split_reshape_cat_contiguous", _split, "AROUND"),
]
