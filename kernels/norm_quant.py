"""RMSNorm (with its residual add) that also writes the int8 rows and per-token scales of its output.

The norm before a W8A8 projection is otherwise followed by a separate quantization launch that reads back
what the norm just wrote. Here one program per row adds the residual (in fp32, stored back as the
residual), normalises, rounds the output to its dtype and quantizes that rounded row by `quantize_row`,
so the int8 rows are bit for bit those `per_token_quant` would give for the written output. Given a tap, the row
it normalises (x + residual) is stored there too: DFlash's capture of a target layer's input
(server/hooks/dflash_taps.py) without a copy launch of its own. The norm itself follows SGLang's CUDA kernels
(flashinfer's: fp32 sum, y = x * rsqrt(mean(x^2) + eps) * (offset + w), the offset 1 for the target's Gemma norms,
0 for the drafter's plain ones), with its own reduction order: outputs may differ from them in the last bit.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.per_token_quant import launch_config, quantize_row


@triton.jit
def _rms_norm_quant_kernel(x_ptr, res_ptr, tap_ptr, w_ptr, y_ptr, q_ptr, scale_ptr, K, eps, weight_offset,
                             stride_x, stride_res, stride_tap, stride_y, stride_q, HAS_RESIDUAL: tl.constexpr,
                             HAS_TAP: tl.constexpr, WRITE_Y: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    # The norm's weights before the wait: after it, their miss in HBM would add to the latency of the rows' loads.
    w = pdl.load_weights(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl.enter(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_res + offs, x.to(res_ptr.dtype.element_ty), mask=mask)
    if HAS_TAP:
        tl.store(tap_ptr + row * stride_tap + offs, x.to(tap_ptr.dtype.element_ty), mask=mask)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    y = (x * rstd * (weight_offset + w)).to(y_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    q, scale = quantize_row(y.to(tl.float32))
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def rms_norm_quant(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
                   out: torch.Tensor, gemma: bool = True,
                   tap: Optional[torch.Tensor] = None, write_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """out = RMSNorm(x + residual) [M, K], Gemma's (1 + w) or plain w (residual, when given, becomes x + residual;
    out may be x; `tap` [M, K], unit stride in K, when given, gets x + residual too); returns its (int8 [M, K], fp32
    scales [M]). With `write_out` False out is left as it was: only the int8 rows of the norm are written."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        res = x if residual is None else residual
        tap_out = res if tap is None else tap
        _rms_norm_quant_kernel[(M,)](x, res, tap_out, weight, out, q, scale, K, eps, float(gemma), x.stride(0),
                                       res.stride(0), tap_out.stride(0), out.stride(0), q.stride(0),
                                       HAS_RESIDUAL=residual is not None, HAS_TAP=tap is not None, WRITE_Y=write_out,
                                       enable_fp_fusion=False, **launch_config(K), **pdl.options(x.device))
    return q, scale
