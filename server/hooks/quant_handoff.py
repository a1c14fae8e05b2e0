"""The norms and SiLU-and-multiply that feed qflash's W8A8 projections, on kernels that also quantize their output.

SGLang 0.5.17 runs GemmaRMSNorm (with its residual add) and SiluAndMul on its CUDA kernels, and qflash's W8A8
GEMM then quantizes each output per token in a launch of its own: 120 of a cycle's 170 quantizations follow one
of these. For a module qflash's model class marked (quant/handoff.py `mark`), the CUDA forward runs qflash's
kernel that writes the same output and its int8 rows in one launch, and hands the rows to the projections.
Unmarked modules (the final norm, the drafter's) and calls the fused kernels do not cover keep SGLang's path.
Hooked on the class's `forward_cuda`, which each instance binds as its forward when SGLang builds the model.
Retire when SGLang's norms and activations hand a quantized output to int8 W8A8 linears on CUDA, as its
fused allreduce-norm-quant path does for fp8 linears on ROCm (`_linear_accepts_fp8_tuple`).
"""

import torch

from qflash.quant import handoff
from qflash.server.hooks import Hook


def _norm_with_int8_output(original, self, x, residual=None, post_residual_addition=None):
    if post_residual_addition is not None or not handoff.wanted(self, x) or (residual is not None
                                                                           and residual.stride(-1) != 1):
        return original(self, x, residual, post_residual_addition)
    from qflash.kernels.norm_quant import gemma_norm_quant

    out = torch.empty_like(x) if residual is None else x  # SGLang's kernel: out of place alone, else in place
    x_q, x_scale = gemma_norm_quant(x, residual, self.weight.data, self.variance_epsilon, out)
    handoff.offer(out, x_q, x_scale)
    return out if residual is None else (out, residual)


def _silu_mul_with_int8_output(original, self, x):
    if not handoff.wanted(self, x):
        return original(self, x)
    from qflash.kernels.silu_mul_quant import silu_mul_quant

    out, x_q, x_scale = silu_mul_quant(x)
    handoff.offer(out, x_q, x_scale)
    return out


CHANGES = [
    Hook("sglang.srt.layers.layernorm.GemmaRMSNorm.forward_cuda", _norm_with_int8_output, "AROUND"),
    Hook("sglang.srt.layers.activation.SiluAndMul.forward_cuda", _silu_mul_with_int8_output, "AROUND"),
]
