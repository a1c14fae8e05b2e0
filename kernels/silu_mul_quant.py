"""SiLU-and-multiply that also writes the int8 rows and per-token scales of its output (the down projection's
input), so the down projection needs no quantization launch of its own.

One program per row: out = silu(gate) * up in fp32 (as SGLang's CUDA kernel: gate / (1 + exp(-gate)) * up),
rounded to the output dtype, then quantized from that rounded row by `quantize_row`, bit for bit what
`per_token_quant` gives for the written output. The exponential is Triton's, so outputs may differ from
SGLang's kernel in the last bit.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.per_token_quant import launch_config, quantize_row


@triton.jit
def _silu_mul_quant_kernel(x_ptr, y_ptr, q_ptr, scale_ptr, D, stride_x, stride_y, stride_q, WRITE_Y: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    q, scale = quantize_row(y.to(tl.float32))
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_mul_quant(x: torch.Tensor, write_out: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, 2D] (gate | up) -> (silu(gate) * up [M, D], its int8 [M, D], fp32 scales [M]); with `write_out` False
    the first is allocated, never written."""
    M, D = x.shape[0], x.shape[1] // 2
    y = torch.empty((M, D), dtype=x.dtype, device=x.device)
    q = torch.empty((M, D), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        _silu_mul_quant_kernel[(M,)](x, y, q, scale, D, x.stride(0), y.stride(0), q.stride(0), WRITE_Y=write_out,
                                     enable_fp_fusion=False, **launch_config(D), **pdl.options(x.device))
    return y, q, scale
