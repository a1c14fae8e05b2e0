"""The first maximum of each row of a wide fp32 matrix: torch.argmax(x, dim=-1) over a verify's logits.

torch reduces a [16, 248,320] fp32 matrix to its argmaxes with one global reduction whose semaphores it clears
first: a memset, a gap, then 14 us of reading 16 MB on the H100. Here each program takes one slice of one row and
keeps its maximum and that maximum's first index; the tiles' pick (kernels/w8a16_argmax.py) takes the first tile
holding the row's maximum. The index is torch's for every row: ties go to the first, and a NaN counts as the
maximum (taken as +inf: a row holding both +inf and a later NaN is the one where the two differ).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.w8a16_argmax import pick_tiles, tiles


@triton.jit
def _row_argmax_tile_kernel(x_ptr, max_ptr, idx_ptr, N, stride_xm, num_tiles, BLOCK_N: tl.constexpr,
                            PDL: tl.constexpr):
    pdl.enter(PDL)
    tile, row = tl.program_id(0), tl.program_id(1)
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs, mask=offs < N, other=float("-inf"))
    x = tl.where(x != x, float("inf"), x)
    tl.store(max_ptr + row * num_tiles + tile, tl.max(x, axis=0))
    tl.store(idx_ptr + row * num_tiles + tile, tile * BLOCK_N + tl.argmax(x, axis=0, tie_break_left=True))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, N] with unit stride in N -> int64 [M]: torch.argmax(x, dim=-1)."""
    M, N = x.shape
    num_tiles = triton.cdiv(N, CONFIG["BLOCK_N"])
    tile_max, tile_idx = tiles(M, num_tiles, x.device)
    out = torch.empty((M,), dtype=torch.int64, device=x.device)
    if M:
        _row_argmax_tile_kernel[(num_tiles, M)](x, tile_max, tile_idx, N, x.stride(0), num_tiles, **CONFIG,
                                                **pdl.options(x.device))
        pick_tiles(tile_max, tile_idx, out)
    return out


# A 32 KB slice of a row a program (32 fp32 a thread): a verify's 16 rows of 248,320 logits in 496 programs.
CONFIG = dict(BLOCK_N=8192, num_warps=8)
