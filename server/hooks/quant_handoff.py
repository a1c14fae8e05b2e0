"""The norms, SiLU-and-multiply and attention output gate that feed qflash's W8A8 projections, on kernels that also
quantize their output.

SGLang 0.5.17 runs RMSNorm and GemmaRMSNorm (with their residual add) and SiluAndMul on its CUDA kernels, and
Gated-DeltaNet's gated output norm on FLA's Triton kernel; qflash's W8A8 GEMM then quantizes each output per token
in a launch of its own: 156 of a cycle's 170 quantizations follow one of these. For a module qflash's model classes
marked (quant/handoff.py `mark`), the forward runs qflash's kernel that writes the same output and its int8 rows in
one launch (only those rows where the projections are all that read it), and hands the rows to the projections.
Unmarked modules (the final norms) and calls the fused kernels do not cover keep SGLang's path. Hooked on each
class's `forward_cuda` (which each instance binds as its forward when SGLang builds the model), the gated norm's
`forward`. The target's attention output gate before o_proj is a function (`fused_sigmoid_mul`, in place), not a
module: the attention layer names itself around its `self_attention` (the layer is marked under "" in the model's
INT8_HANDOFFS), and the gate called inside a marked layer writes o_proj's int8 rows too. Retire when SGLang's norms,
activations and gates hand a quantized output to int8 W8A8 linears on CUDA, as its fused allreduce-norm-quant path
does for fp8 linears on ROCm (`_linear_accepts_fp8_tuple`).
"""

import torch

from qflash.quant import handoff
from qflash.server.hooks import Hook, dflash_taps


def _norm_variant(norm: torch.nn.Module) -> bool:
    """Whether an RMSNorm is built as one of the variants its CUDA forward treats apart (the kernel has none)."""
    return (getattr(norm, "variance_size_override", None) is not None or getattr(norm, "cast_x_before_out_mul", False)
            or getattr(norm, "fp32_residual", False))


def _rms_norm(gemma: bool):
    def with_int8_output(original, self, x, residual=None, post_residual_addition=None):
        if (post_residual_addition is not None or not handoff.wanted(self, x) or _norm_variant(self)
                or (residual is not None and residual.stride(-1) != 1)):
            return original(self, x, residual, post_residual_addition)
        from qflash.kernels.norm_quant import rms_norm_quant

        out = torch.empty_like(x) if residual is None else x  # SGLang's kernels: out of place alone, else in place
        tap, write = dflash_taps.take(self, x), not handoff.only_int8_read(self)
        x_q, x_scale = rms_norm_quant(x, residual, self.weight.data, self.variance_epsilon, out, gemma, tap, write)
        handoff.offer(out, x_q, x_scale, write)
        return out if residual is None else (out, residual)

    return with_int8_output


def _gated_norm_with_int8_output(original, self, x, z=None):
    from qflash.kernels import gated_norm_quant

    row_width = getattr(self, handoff.ROW_WIDTH, None)
    if (z is None or not handoff.wanted(self, x) or self.bias is not None or self.group_size is not None
            or not self.norm_before_gate or self.activation not in ("swish", "silu")
            or not gated_norm_quant.takes(x, z, row_width)):
        return original(self, x, z)
    write = not handoff.only_int8_read(self)
    out, x_q, x_scale = gated_norm_quant.gated_norm_quant(x, z, self.weight.data, self.eps, row_width, write)
    handoff.offer(out.view(x_q.shape), x_q, x_scale, write)  # as the projection reads it: a token's heads in one row
    return out


def _silu_mul_with_int8_output(original, self, x):
    if not handoff.wanted(self, x):
        return original(self, x)
    from qflash.kernels.silu_mul_quant import silu_mul_quant

    write = not handoff.only_int8_read(self)
    out, x_q, x_scale = silu_mul_quant(x, write)
    handoff.offer(out, x_q, x_scale, write)
    return out


_gated_layer = None  # the attention layer whose self_attention runs now (its output gate's caller)


def _name_the_gated_layer(original, self, *args, **kwargs):
    global _gated_layer
    if torch.compiler.is_compiling():  # a traced forward has no memory to hand over (quant/handoff.py `take`)
        return original(self, *args, **kwargs)
    _gated_layer = self
    try:
        return original(self, *args, **kwargs)
    finally:
        _gated_layer = None


def _gate_with_int8_output(original, attn_output, gate, inplace=False):
    from qflash.kernels import sigmoid_mul_quant

    if (not inplace or _gated_layer is None or not handoff.wanted(_gated_layer, attn_output)
            or not sigmoid_mul_quant.takes(attn_output, gate)):
        return original(attn_output, gate, inplace=inplace)
    write = not handoff.only_int8_read(_gated_layer)
    x_q, x_scale = sigmoid_mul_quant.sigmoid_mul_quant(attn_output, gate, write)
    handoff.offer(attn_output, x_q, x_scale, write)
    return attn_output


CHANGES = [
    Hook("sglang.srt.layers.layernorm.GemmaRMSNorm.forward_cuda", _rms_norm(gemma=True), "AROUND"),
    Hook("sglang.srt.layers.layernorm.RMSNorm.forward_cuda", _rms_norm(gemma=False), "AROUND"),
    Hook("sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward", _gated_norm_with_int8_output, "AROUND"),
    Hook("sglang.srt.layers.activation.SiluAndMul.forward_cuda", _silu_mul_with_int8_output, "AROUND"),
    Hook("sglang.srt.models.qwen3_5.Qwen3_5AttentionDecoderLayer.self_attention", _name_the_gated_layer, "AROUND"),
    Hook("sglang.srt.models.qwen3_5.fused_sigmoid_mul", _gate_with_int8_output, "AROUND"),
]
