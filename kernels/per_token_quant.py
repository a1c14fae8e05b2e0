"""Per-token int8 quantization of activations: x_q = round(x * (127 / absmax)), scale s = absmax / 127.

Rounds half away from zero; the W8A8 GEMM's fused quantization uses the same rule, so both paths give
the same x_q bit for bit. The two divisions per row are IEEE (`div_rn`: Triton's `/` is approximate on
the GPU); each element costs one multiply, and launches pass `enable_fp_fusion=False` so that multiply
and the +-0.5 stay two roundings (an FMA would round once and differ from other paths).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def quantize_row(x):
    """One row held in fp32 (any tile shape: the row is all of it) -> (int8 row, fp32 scale): the rule every qflash
    producer of W8A8 input applies."""
    absmax = tl.maximum(tl.max(tl.abs(x)), 1e-10)
    scale = tl.div_rn(absmax, 127.0)
    x = x * tl.div_rn(127.0, absmax)
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8), scale


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # One program per row, the whole row in registers: one read of x, whose latency the row's absmax waits on once.
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    q, scale = quantize_row(x)
    tl.store(q_ptr + row * stride_q + offs, q, mask=offs < K)
    tl.store(scale_ptr + row, scale)


@torch.library.custom_op("qflash::per_token_quant", mutates_args=())
def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16/fp32 -> (x_q int8 [M, K], scale fp32 [M])."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        _per_token_quant_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), enable_fp_fusion=False,
                                      **launch_config(K), **pdl.options(x.device))
    return q, scale


@per_token_quant.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:1], dtype=torch.float32)


def launch_config(k: int) -> dict:
    """A row of K (up to 16,384 at ELEMENTS_PER_THREAD, more with register spills) in one block of warps."""
    block = triton.next_power_of_2(k)
    return {"BLOCK_K": block, "num_warps": min(max(block // (32 * ELEMENTS_PER_THREAD), 4), 32)}


ELEMENTS_PER_THREAD = 8  # 2,560 and 4,096 wide rows: 16 warps; 9,216: 32 warps (BENCHMARKS.md, 2026-12-05)
