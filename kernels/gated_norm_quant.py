"""Gated-DeltaNet's output norm, RMSNorm(x) * w * silu(z) per head, that also writes the int8 rows and per-token
scales of its output, the input of the layer's W8A8 `out_proj`.

SGLang runs it on FLA's Triton kernel over rows of one head, and the projection then quantizes each token's row
of all heads in a launch of its own. Here one program per token holds that token's heads as a [heads, head_dim]
tile: each head's rstd as FLA computes it (fp32 sum of squares, y = x * rstd * w * (z * sigmoid(z))), the output
rounded to its dtype, then the whole tile quantized as one row by `quantize_row`, bit for bit what
`per_token_quant` gives for the written output. FLA's launch fuses multiply-adds where this one may not (the
quantization must not): outputs may differ from it in the last bit.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.per_token_quant import launch_config, quantize_row


@triton.jit
def _gated_norm_quant_kernel(x_ptr, z_ptr, w_ptr, y_ptr, q_ptr, scale_ptr, eps, stride_x, stride_z, stride_y,
                             stride_q, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_Y: tl.constexpr,
                             PDL: tl.constexpr):
    token = tl.program_id(0)
    head_rows = token * HEADS + tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HEAD_DIM)[None, :]
    w = pdl.load_weights(w_ptr + cols).to(tl.float32)  # before the wait, as the norms' (kernels/norm_quant.py)
    pdl.enter(PDL)
    x = tl.load(x_ptr + head_rows * stride_x + cols).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
    y = x * rstd[:, None] * w
    z = tl.load(z_ptr + head_rows * stride_z + cols).to(tl.float32)
    y = (y * (z * tl.sigmoid(z))).to(y_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(y_ptr + head_rows * stride_y + cols, y)
    q, scale = quantize_row(y.to(tl.float32))
    tl.store(q_ptr + token * stride_q + tl.arange(0, HEADS)[:, None] * HEAD_DIM + cols, q)
    tl.store(scale_ptr + token, scale)


def takes(x: torch.Tensor, z: torch.Tensor, row_width: int) -> bool:
    """Whether the kernel covers x and z [tokens * heads, head_dim] with a token's row `row_width` wide: unit
    strides, power-of-two heads and head_dim (one tile per token)."""
    head_dim = x.shape[-1]
    heads = row_width // head_dim
    return (x.dim() == 2 and x.shape == z.shape and x.stride(-1) == 1 and z.stride(-1) == 1
            and heads * head_dim == row_width and x.shape[0] % heads == 0
            and triton.next_power_of_2(heads) == heads and triton.next_power_of_2(head_dim) == head_dim)


def gated_norm_quant(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                     row_width: int, write_out: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, z [tokens * heads, head_dim] -> (RMSNorm(x) * weight * silu(z) of the same shape, its int8 rows
    [tokens, row_width], fp32 scales [tokens]); see `takes` for the shapes covered. With `write_out` False the first
    is allocated, never written."""
    head_dim = x.shape[-1]
    heads, tokens = row_width // head_dim, x.shape[0] * head_dim // row_width
    y = torch.empty_like(x)
    q = torch.empty((tokens, row_width), dtype=torch.int8, device=x.device)
    scale = torch.empty((tokens,), dtype=torch.float32, device=x.device)
    if tokens:
        _gated_norm_quant_kernel[(tokens,)](x, z, weight, y, q, scale, eps, x.stride(0), z.stride(0), y.stride(0),
                                            q.stride(0), HEADS=heads, HEAD_DIM=head_dim, WRITE_Y=write_out,
                                            enable_fp_fusion=False,
                                            num_warps=launch_config(row_width)["num_warps"], **pdl.options(x.device))
    return y, q, scale
