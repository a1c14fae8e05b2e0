"""Greedy token pick over a W8A16 lm_head without writing logits: argmax_n (x @ w_q^T * w_scale)[m, n].

Each program scores one [BLOCK_M, BLOCK_N] tile in fp32 and keeps its row maxima and their first
index; a tiny second kernel over the tiles' partials picks the first overall maximum, as torch.argmax
would over fp32 logits, and writes its token id where the caller wants it. Used for draft and verify token
picks ([M, 248320] logits never exist).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import config_table, pdl
from qflash.kernels.tiles import tile_offsets
from qflash.kernels.w8a16_gemm import DOT_DTYPE, scaled_tile


@triton.jit
def _w8a16_argmax_kernel(x_ptr, w_ptr, w_scale_ptr, max_ptr, idx_ptr, M, N, K, stride_xm, stride_wn,
                         num_tiles, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    offs_m, offs_n, offs_k, mask_m, mask_n = tile_offsets(tl.program_id(1), pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    logits = scaled_tile(x_ptr, w_ptr, w_scale_ptr, offs_m, offs_n, offs_k, mask_m, mask_n, K, stride_xm, stride_wn,
                         DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K)
    logits = tl.where(mask_n[None, :], logits, float("-inf"))
    tile_max = tl.max(logits, axis=1)
    tile_idx = tl.argmax(logits, axis=1) + pid_n * BLOCK_N
    tl.store(max_ptr + offs_m * num_tiles + pid_n, tile_max, mask=mask_m)
    tl.store(idx_ptr + offs_m * num_tiles + pid_n, tile_idx, mask=mask_m)


@triton.jit
def _argmax_pick_kernel(max_ptr, idx_ptr, out_ptr, num_tiles, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    # One program per row: the first tile holding the row's maximum (torch.argmax's rule for ties), its token.
    pdl.enter(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    tile_max = tl.load(max_ptr + row * num_tiles + offs, mask=offs < num_tiles, other=float("-inf"))
    best = tl.argmax(tile_max, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_tiles + best).to(tl.int64))


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: dict,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Run with an explicit config (the tuner's entry); x [M, K] with unit stride in K -> int64 ids [M], written
    into `out` when given."""
    M, K = x.shape
    N = w.shape[0]
    num_tiles = triton.cdiv(N, config["BLOCK_N"])
    tile_max, tile_idx = tiles(M, num_tiles, x.device)
    out = torch.empty((M,), dtype=torch.int64, device=x.device) if out is None else out
    if M:
        grid = (num_tiles, triton.cdiv(M, config["BLOCK_M"]))
        _w8a16_argmax_kernel[grid](x, w, w_scale, tile_max, tile_idx, M, N, K, x.stride(0), w.stride(0),
                                   num_tiles, DOT_DTYPE=DOT_DTYPE, **config, **pdl.options(x.device))
        pick_tiles(tile_max, tile_idx, out)
    return out


def tiles(rows: int, num_tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty buffers for each row's tile maxima (fp32) and their first indices (int32) [rows, tiles], as a tile
    kernel writes them and `pick_tiles` reads them."""
    return (torch.empty((rows, num_tiles), dtype=torch.float32, device=device),
            torch.empty((rows, num_tiles), dtype=torch.int32, device=device))


def pick_tiles(tile_max: torch.Tensor, tile_idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[m] = the index of row m's first maximum, from its tiles' maxima and their first indices [M, tiles]."""
    M, num_tiles = tile_max.shape
    _argmax_pick_kernel[(M,)](tile_max, tile_idx, out, num_tiles, BLOCK_T=triton.next_power_of_2(num_tiles),
                              **pdl.options(out.device))


def pick(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, phase: str = "lm_head",
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [M, K], w int8 [N, K], w_scale fp32 [N] -> int64 [M]: the greedy token of each row (into `out`, when
    given: a CUDA graph's buffer), config from the table for `phase`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    return launch(x, w, w_scale, config_table.lookup(CONFIGS, phase, M, w.shape[0], K, DEFAULT), out)


@torch.library.custom_op("qflash::w8a16_argmax", mutates_args=())
def w8a16_argmax(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, phase: str = "lm_head") -> torch.Tensor:
    """`pick` as a torch op."""
    return pick(x, w, w_scale, phase)


@w8a16_argmax.register_fake
def _(x, w, w_scale, phase="lm_head"):
    return x.new_empty((x.shape[0],), dtype=torch.long)


DEFAULT = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)
# Tuned on NVIDIA H200 (sm90) by `qflash tune`: (phase, M bucket, N, K) -> launch config.
CONFIGS = {
    ('lm_head', 16, 248320, 2560): dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
    ('lm_head', 32, 248320, 2560): dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
    ('lm_head', 64, 248320, 2560): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
    ('lm_head', 128, 248320, 2560): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
}
