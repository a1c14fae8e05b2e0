"""W8A16 GEMM: y = (x @ w_q^T) * w_scale[n]; bf16 activations, int8 weights dequantized in the kernel.

For the lm_head (N = 248,320, K = 2,560) and any layer where reading int8 weights with unquantized
activations wins at small M: the weight read is the whole cost there, and it is halved against bf16.
"""

import os

import torch
import triton
import triton.language as tl

from qflash.kernels import config_table, pdl
from qflash.kernels.tiles import grouped_tile, tile_offsets

# Triton's CPU interpreter multiplies bf16 operands as raw 16-bit integers: it gets fp32 operands.
DOT_DTYPE = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16


@triton.jit
def scaled_tile(x_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, offs_k, mask_m, mask_n, K, stride_xm, stride_wn,
                DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of x @ w_q^T * w_scale in fp32 (the fused argmax scores its tiles with it too)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :],
                    mask=mask_m[:, None] & (k + offs_k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k + offs_k)[:, None],
                    mask=mask_n[None, :] & (k + offs_k < K)[:, None], other=0)
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE))
    return acc * tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]


@triton.jit
def _w8a16_gemm_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, offs_k, mask_m, mask_n = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    y = scaled_tile(x_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, offs_k, mask_m, mask_n, K, stride_xm, stride_wn,
                    DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    # rounded to x's dtype first: an fp32 y holds the bits of the bf16 logits that SGLang copies into its fp32 buffer
    y = y.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptrs, y, mask=mask_m[:, None] & mask_n[None, :])


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: dict,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel with an explicit config (the tuner's entry); x [M, K] with unit stride in K. Writes `out`
    ([M, N], rows contiguous, x's dtype or fp32) when given."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if M:
        grid = (triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"]),)
        _w8a16_gemm_kernel[grid](x, w, w_scale, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                 DOT_DTYPE=DOT_DTYPE, **config, **pdl.options(x.device))
    return y


def _rows(x: torch.Tensor, w: torch.Tensor, phase: str) -> tuple[torch.Tensor, dict]:
    """x as [M, K] rows of unit stride, and the table's config for `phase` at that shape."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, config_table.lookup(CONFIGS, phase, x2.shape[0], w.shape[0], x2.shape[1], DEFAULT)


@torch.library.custom_op("qflash::w8a16_gemm", mutates_args=())
def w8a16_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, phase: str = "lm_head") -> torch.Tensor:
    """x bf16 [..., K], w int8 [N, K], w_scale fp32 [N] -> bf16 [..., N], config from the table for `phase`."""
    x2, config = _rows(x, w, phase)
    return launch(x2, w, w_scale, config).reshape(*x.shape[:-1], w.shape[0])


@w8a16_gemm.register_fake
def _(x, w, w_scale, phase="lm_head"):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("qflash::w8a16_gemm_into", mutates_args=("out",))
def w8a16_gemm_into(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                    phase: str = "lm_head") -> None:
    """`w8a16_gemm` into out fp32 [M, N] (rows of unit stride): each value rounded to x's dtype, then widened."""
    x2, config = _rows(x, w, phase)
    if out.shape != (x2.shape[0], w.shape[0]) or out.stride(-1) != 1:
        raise ValueError(f"the W8A16 GEMM writes [{x2.shape[0]}, {w.shape[0]}] rows of unit stride, "
                         f"not {tuple(out.shape)}")
    launch(x2, w, w_scale, config, out)


DEFAULT = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
# Tuned on NVIDIA H200 (sm90) by `qflash tune`: (phase, M bucket, N, K) -> launch config.
CONFIGS = {
    ('lm_head', 16, 248320, 2560): dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4),
    ('lm_head', 32, 248320, 2560): dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    ('lm_head', 64, 248320, 2560): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3),
    ('lm_head', 128, 248320, 2560): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3),
}
