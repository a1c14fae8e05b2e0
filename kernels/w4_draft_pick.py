"""The draft's greedy pick from a 4-bit copy of the int8 lm_head, its finalists scored on the int8 rows.

The fused W8A16 argmax reads the whole int8 vocabulary matrix (0.64 GB) for each cycle's draft pick and runs at its
byte floor. A draft only proposes tokens (the verify decides what is emitted), so its pick need not be exact. Here a
scan reads a 4-bit copy instead, half the bytes: per group of GROUP columns of each vocabulary row, the int8 values
rounded to multiples of the group's largest magnitude / 7, stored offset by 8 as nibbles (column j of a group in the
low nibble of byte j, column j + GROUP / 2 in the high one) with that magnitude as a byte, group-major. Each program
keeps the largest approximate logit of its tile and its first index. A second kernel takes, per row, the
FINALISTS tiles with the largest maxima and scores their tokens on the int8 rows: the pick is the int8 head's own
argmax whenever that token leads its tile and its tile is among the finalists under the 4-bit error, i.e. unless
another token comes within that error of it, where the draft is a near tie either way.
"""

import os

import torch
import triton
import triton.language as tl

from qflash.kernels import config_table, pdl
from qflash.kernels.w8a16_argmax import tiles
from qflash.kernels.w8a16_gemm import DOT_DTYPE

GROUP = 128  # columns that share one 4-bit step
ROW_TILE = 256  # the copy's rows are padded to a multiple of this (every BLOCK_N divides it): loads need no mask
FINALISTS = 4  # tiles whose leaders are scored on the int8 rows
# The draft blocks of up to two requests. At 120 rows (eight) the scan is bound by its tensor-core work, as the fused
# int8 argmax is, and its decoding makes it the slower of the two (BENCHMARKS.md, 2026-12-06): more rows take that one.
MAX_ROWS = 32
NIBBLE_ASM = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter runs no inline assembly


@triton.jit
def _nibbles(packed, DOT_DTYPE: tl.constexpr, NIBBLE_ASM: tl.constexpr):
    """The (low, high) nibbles of uint8 bytes as the signed values they store (nibble - 8), in DOT_DTYPE.

    Triton's own conversion takes ~8 instructions a value, which would make the scan bound by them, not by its
    bytes. The assembly takes 1.5: four bytes' nibbles spread over the low bits of bf16 lanes whose upper bits are
    those of 128 (0x4300), so each lane reads 128 + nibble, then 136 off each pair (exact in bf16)."""
    if NIBBLE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, zero, offset;
            mov.b32 zero, 0;
            mov.b32 offset, 0x43084308;
            prmt.b32 t0, $4, zero, 0x4140;
            prmt.b32 t1, $4, zero, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t0, t0, 4;
            shr.u32 t1, t1, 4;
            lop3.b32 $2, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $3, t1, 0x000F000F, 0x43004300, 0xEA;
            sub.bf16x2 $0, $0, offset;
            sub.bf16x2 $1, $1, offset;
            sub.bf16x2 $2, $2, offset;
            sub.bf16x2 $3, $3, offset;
            }""",
            "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)
    bits = packed.to(tl.int32)
    return ((bits & 15) - 8).to(DOT_DTYPE), ((bits >> 4) - 8).to(DOT_DTYPE)


@triton.jit
def _w4_scan_kernel(x_ptr, w_ptr, amax_ptr, w_scale_ptr, max_ptr, idx_ptr, M, N, K, stride_xm, stride_wn, stride_amax,
                    num_tiles, DOT_DTYPE: tl.constexpr, NIBBLE_ASM: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    # One [BLOCK_M, BLOCK_N] tile of x @ w4^T (each group's nibbles times its step), its row maxima and first indices.
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, GROUP // 2)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_h[None, :]
    w_cols = w_ptr + offs_n[None, :] * stride_wn + offs_h[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):  # the copy's rows are padded (ROW_TILE): no mask on its loads
        x_lo = tl.load(x_rows + g * GROUP, mask=mask_m[:, None], other=0.0).to(DOT_DTYPE)
        x_hi = tl.load(x_rows + g * GROUP + GROUP // 2, mask=mask_m[:, None], other=0.0).to(DOT_DTYPE)
        lo, hi = _nibbles(tl.load(w_cols + g * (GROUP // 2)), DOT_DTYPE, NIBBLE_ASM)
        part = tl.dot(x_hi, hi, tl.dot(x_lo, lo))
        acc += part * tl.load(amax_ptr + g * stride_amax + offs_n).to(tl.float32)[None, :]
    step = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0) / 7.0  # a group's step: its magnitude / 7
    logits = tl.where(mask_n[None, :], acc * step[None, :], float("-inf"))
    tl.store(max_ptr + offs_m * num_tiles + pid_n, tl.max(logits, axis=1), mask=mask_m)
    tl.store(idx_ptr + offs_m * num_tiles + pid_n, tl.argmax(logits, axis=1, tie_break_left=True) + pid_n * BLOCK_N,
             mask=mask_m)


@triton.jit
def _w4_rescore_kernel(x_ptr, w_ptr, w_scale_ptr, max_ptr, idx_ptr, out_ptr, K, stride_xm, stride_wn, num_tiles,
                       FINALISTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # One program per row: the leaders of its FINALISTS best tiles, scored on the int8 rows; the best, ties to the
    # lower token. x was written two launches back (the scan between): its load may come before the wait.
    row = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    x = pdl.load_settled(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    pdl.enter(PDL)
    offs_t = tl.arange(0, BLOCK_T)
    tile_max = tl.load(max_ptr + row * num_tiles + offs_t, mask=offs_t < num_tiles, other=float("-inf"))
    best, best_score = num_tiles * 0 - 1, float("-inf")
    for _ in tl.static_range(FINALISTS):
        tile = tl.argmax(tile_max, axis=0, tie_break_left=True)
        tile_max = tl.where(offs_t == tile, float("-inf"), tile_max)
        token = tl.load(idx_ptr + row * num_tiles + tile)
        w = tl.load(w_ptr + token.to(tl.int64) * stride_wn + offs_k, mask=offs_k < K, other=0).to(tl.float32)
        score = tl.sum(x * w, axis=0) * tl.load(w_scale_ptr + token)
        better = (score > best_score) | ((score == best_score) & (token < best)) | (best < 0)
        best, best_score = tl.where(better, token, best), tl.where(better, score, best_score)
    tl.store(out_ptr + row, best.to(tl.int64))


def quantize(w: torch.Tensor, rows_per_step: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit copy of int8 rows w [N, K] (K a multiple of GROUP): (nibbles uint8 [rows, K / 2], each group's
    largest magnitude uint8 [K / GROUP, rows]), its rows N padded with zeros to a multiple of ROW_TILE; made a slice of
    rows at a time to bound the temporaries."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"the 4-bit draft pick needs rows of a multiple of {GROUP} columns, not {K}")
    rows = triton.cdiv(N, ROW_TILE) * ROW_TILE
    packed = torch.full((rows, K // 2), 0x88, dtype=torch.uint8, device=w.device)
    amax = torch.zeros((K // GROUP, rows), dtype=torch.uint8, device=w.device)
    for lo in range(0, N, rows_per_step):
        hi = min(lo + rows_per_step, N)
        groups = w[lo:hi].view(hi - lo, K // GROUP, GROUP).to(torch.float32)
        peak = groups.abs().amax(-1, keepdim=True)
        steps = torch.round(groups * 7 / peak.clamp(min=1)).to(torch.int32) + 8  # 1..15
        packed[lo:hi] = (steps[..., :GROUP // 2] | (steps[..., GROUP // 2:] << 4)).view(hi - lo, K // 2).to(torch.uint8)
        amax[:, lo:hi] = peak.view(hi - lo, K // GROUP).t().to(torch.uint8)
    return packed, amax


def scan(x: torch.Tensor, w4: torch.Tensor, amax: torch.Tensor, w_scale: torch.Tensor, n: int,
         config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan alone: x [M, K] with unit stride in K over the 4-bit copy (`quantize`) of n int8 rows with their fp32
    scales [n] -> each row's approximate maximum over each tile of BLOCK_N rows and its first index, [M, tiles]."""
    M, K = x.shape
    if w4.shape != (triton.cdiv(n, ROW_TILE) * ROW_TILE, K // 2) or K % GROUP or ROW_TILE % config["BLOCK_N"]:
        raise ValueError(f"not `quantize`'s copy of [{n}, {K}] int8 rows for BLOCK_N {config['BLOCK_N']}: "
                         f"{tuple(w4.shape)}")
    num_tiles = w4.shape[0] // config["BLOCK_N"]
    tile_max, tile_idx = tiles(M, num_tiles, x.device)
    if M:
        _w4_scan_kernel[(num_tiles, triton.cdiv(M, config["BLOCK_M"]))](
            x, w4, amax, w_scale, tile_max, tile_idx, M, n, K, x.stride(0), w4.stride(0), amax.stride(0), num_tiles,
            DOT_DTYPE=DOT_DTYPE, NIBBLE_ASM=NIBBLE_ASM, GROUP=GROUP, **config, **pdl.options(x.device))
    return tile_max, tile_idx


def launch(x: torch.Tensor, w4: torch.Tensor, amax: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           config: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run with an explicit config (the tuner's entry): x [M, K] with unit stride in K, the 4-bit copy (`quantize`)
    of w int8 [N, K] with its fp32 scales [N] -> int64 ids [M], written into `out` when given."""
    M, K = x.shape
    tile_max, tile_idx = scan(x, w4, amax, w_scale, w.shape[0], config)
    out = torch.empty((M,), dtype=torch.int64, device=x.device) if out is None else out
    if M:
        num_tiles = tile_max.shape[1]
        _w4_rescore_kernel[(M,)](x, w, w_scale, tile_max, tile_idx, out, K, x.stride(0), w.stride(0), num_tiles,
                                 FINALISTS=FINALISTS, BLOCK_T=triton.next_power_of_2(num_tiles),
                                 BLOCK_K=triton.next_power_of_2(K), num_warps=4, **pdl.options(x.device))
    return out


def pick(x: torch.Tensor, w4: torch.Tensor, amax: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [M, K] -> int64 [M]: each row's draft token (into `out`, when given: a CUDA graph's buffer), config
    from the table."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    return launch(x, w4, amax, w, w_scale, config_table.lookup(CONFIGS, "draft", M, w.shape[0], K, DEFAULT), out)


DEFAULT = dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=3)
# Tuned on NVIDIA H100 80GB HBM3 (sm90), 16 rows; 32 rows timed against that config (BENCHMARKS.md, 2026-12-06).
CONFIGS = {
    ('draft', 16, 248320, 2560): dict(BLOCK_M=16, BLOCK_N=128, num_warps=4, num_stages=3),
    ('draft', 32, 248320, 2560): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3),
}
