"""The output tile of a GEMM program, shared by qflash's GEMM kernels.

Programs walk the output in groups of GROUP_M row tiles per column sweep, so consecutive programs reuse the
same activation rows and weight columns from L2; a GEMM with a 2-D grid passes its two program ids directly.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row tile, column tile) of program `pid` of a 1-D grid."""
    num_m = tl.cdiv(M, BLOCK_M)
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row, column and K offsets of a tile, and which rows and columns exist."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N
