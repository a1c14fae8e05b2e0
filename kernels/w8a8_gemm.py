"""W8A8 GEMM: y = (x_q @ w_q^T) * x_scale[m] * w_scale[n] (+ bias) on int8 tensor cores, int32 accumulation.

x is bf16 [M, K]; w_q int8 [N, K] with fp32 per-output-channel scales. With QUANT_X the kernel quantizes
x per token itself (the rule of `per_token_quant`, bit for bit, fp fusion off as there): at small M that
saves a launch and the x_q round trip; at large M quantizing once beforehand wins. The table decides.
With SPLIT_K > 1 (small M, few output tiles: N = 2,560 gives 80 tiles of 32 columns for 132 SMs) each
tile's K range is split over SPLIT_K programs that add their int32 sums atomically into a workspace;
the last to arrive (per-tile counter) takes the total, resets workspace and counter to zero for the
next call, and writes the output. Integer addition is associative, so every config gives the same bits.
With output cuts (`w8a8_gemm_segments`) y's columns are written as consecutive [M, width] blocks, one per
segment between cuts: a projection whose output SGLang splits into contiguous tensors (Gated-DeltaNet's q|k|v, z,
b, a) then needs no split kernel.
A prefill of thousands of rows is bound by the int8 tensor cores, and the loads through registers cannot feed a
tile wider than 128 x 128 fast enough for them: with TMA (a config's TMA) the hardware copies x's int8 rows and w's
columns into shared memory, and a 128 x 256 tile runs faster (BENCHMARKS.md, 2026-12-06). The same int32 sums and
epilogue: the same bits.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qflash.kernels import config_table, conv_update, pdl
from qflash.kernels.per_token_quant import per_token_quant
from qflash.kernels.tiles import grouped_tile, tile_offsets


@triton.jit
def _x_tile(x_rows, k, offs_k, mask_m, k_hi, x_inv, QUANT_X: tl.constexpr):
    """x's int8 tile at K offset k (quantized here with QUANT_X)."""
    x = tl.load(x_rows + (k + offs_k)[None, :], mask=mask_m[:, None] & (k + offs_k < k_hi)[None, :], other=0)
    if QUANT_X:
        q = x.to(tl.float32) * x_inv[:, None]
        x = tl.where(q >= 0, q + 0.5, q - 0.5).to(tl.int8)
    return x


@triton.jit
def _y_offsets(offs_m, offs_n, M, N, cut1, cut2, cut3, SEGMENTED: tl.constexpr):
    """y[m, n]'s offset: row-major, or (SEGMENTED) in the [M, width] block of n's segment, cut at cut1 <= cut2 <= cut3."""
    if SEGMENTED:
        n = offs_n[None, :]
        start = tl.where(n < cut1, 0, tl.where(n < cut2, cut1, tl.where(n < cut3, cut2, cut3)))
        end = tl.where(n < cut1, cut1, tl.where(n < cut2, cut2, tl.where(n < cut3, cut3, N)))
        return M * start + offs_m[:, None] * (end - start) + (n - start)
    return offs_m[:, None] * N + offs_n[None, :]


@triton.jit
def _column_weights(w_scale_ptr, bias_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr):
    """The tile's column scales and bias (without one, the scales stand in, unread), loaded at the program's start:
    weights, which may come before the PDL wait; loaded after the K loop, their miss in HBM (L2 holds none of a
    layer's bytes a cycle later) would delay every program's epilogue."""
    w_scale = pdl.load_weights(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    bias = w_scale
    if HAS_BIAS:
        bias = pdl.load_weights(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    return w_scale, bias


@triton.jit
def _store_tile(acc, x_scale, w_scale, bias, offs_m, offs_n, mask_y, y_ptr, M, N, cut1, cut2, cut3,
                HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr):
    """y's tile: the int32 sums times the row and column scales (+ bias), in y's dtype."""
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += bias[None, :]
    tl.store(y_ptr + _y_offsets(offs_m, offs_n, M, N, cut1, cut2, cut3, SEGMENTED), y.to(y_ptr.dtype.element_ty),
             mask=mask_y)


@triton.jit
def _w8a8_gemm_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, ws_ptr, count_ptr, M, N, K,
                      stride_xm, stride_wn, cut1, cut2, cut3,
                      cw_ptr, cb_ptr, cs_ptr, slots_ptr, win_ptr, win_slots_ptr, stride_cwc, stride_cwj, stride_sb,
                      stride_sc, stride_sj, stride_gb, stride_gt, stride_gc, stride_gj,
                      QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                      EARLY_K: tl.constexpr, CONV_T: tl.constexpr, CONV_WIDTH: tl.constexpr,
                      CONV_BIAS: tl.constexpr, PDL: tl.constexpr):
    split = tl.program_id(0) % SPLIT_K
    pid = tl.program_id(0) // SPLIT_K
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, offs_k, mask_m, mask_n = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n[None, :] * stride_wn
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if EARLY_K:
        # The weights do not depend on the kernel before: the first EARLY_K rows of K leave before the wait, while the
        # kernel before runs (under PDL this one's programs sit resident meanwhile), instead of opening the launch.
        # First of what leaves before the wait: a warp issues in order, and the conv's prefetches wait on its slots.
        offs_e = tl.arange(0, EARLY_K)
        w_early = pdl.load_weights(w_cols + (k_lo + offs_e)[:, None], mask_n[None, :] & (k_lo + offs_e < k_hi)[:, None],
                                   0)
    w_scale, bias = _column_weights(w_scale_ptr, bias_ptr, offs_n, mask_n, HAS_BIAS)
    if CONV_T:
        conv_slot, conv_win_slot = conv_update.conv_prologue(
            offs_m, offs_n, M, cut1, cw_ptr, cb_ptr, cs_ptr, slots_ptr, win_slots_ptr, stride_cwc, stride_sb,
            stride_sc, stride_sj, CONV_T, CONV_WIDTH, CONV_BIAS, PDL)
    pdl.enter(PDL)

    if QUANT_X:
        absmax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k + offs_k)[None, :], mask=mask_m[:, None] & (k + offs_k < K)[None, :], other=0.0)
            absmax = tl.maximum(absmax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        absmax = tl.maximum(absmax, 1e-10)
        x_scale = tl.div_rn(absmax, tl.full([BLOCK_M], 127.0, tl.float32))
        x_inv = tl.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), absmax)
    else:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
        x_inv = x_scale  # unread without QUANT_X

    if EARLY_K:
        acc = tl.dot(_x_tile(x_rows, k_lo, offs_e, mask_m, k_hi, x_inv, QUANT_X), w_early, out_dtype=tl.int32)
        k_lo += EARLY_K
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(k_lo, k_hi, BLOCK_K):
        w = tl.load(w_cols + (k + offs_k)[:, None], mask=mask_n[None, :] & (k + offs_k < k_hi)[:, None], other=0)
        acc += tl.dot(_x_tile(x_rows, k, offs_k, mask_m, k_hi, x_inv, QUANT_X), w, out_dtype=tl.int32)

    mask_y = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws, acc, mask=mask_y, sem="relaxed")
        tl.debug_barrier()  # every thread's share is in before the tile's counter moves
        last = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.atomic_xchg(ws, tl.zeros_like(acc), mask=mask_y, sem="relaxed")
            tl.atomic_xchg(count_ptr + pid, 0)
        mask_y = mask_y & last

    _store_tile(acc, x_scale, w_scale, bias, offs_m, offs_n, mask_y, y_ptr, M, N, cut1, cut2, cut3, HAS_BIAS, SEGMENTED)
    if CONV_T:
        if pid_n * BLOCK_N < cut1:  # a tile of the first segment (BLOCK_N divides cut1): the conv's input
            conv_update.conv_in_place(y_ptr, offs_m, offs_n, M, cut1, conv_slot, conv_win_slot, cw_ptr, cb_ptr, cs_ptr,
                                      win_ptr, stride_cwc, stride_cwj, stride_sb, stride_sc, stride_sj, stride_gb,
                                      stride_gt, stride_gc, stride_gj, CONV_T, CONV_WIDTH, CONV_BIAS)


@triton.jit
def _w8a8_tma_kernel(x_desc, w_desc, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, cut1, cut2, cut3,
                     HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    # One output tile from TMA copies of x's int8 rows and w's rows (zero-filled past M, N and K), int32 sums.
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, _, mask_m, mask_n = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    w_scale, bias = _column_weights(w_scale_ptr, bias_ptr, offs_n, mask_n, HAS_BIAS)
    pdl.enter(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k]), w_desc.load([pid_n * BLOCK_N, k]).T, acc, out_dtype=tl.int32)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    _store_tile(acc, x_scale, w_scale, bias, offs_m, offs_n, mask_m[:, None] & mask_n[None, :], y_ptr, M, N, cut1,
                cut2, cut3, HAS_BIAS, SEGMENTED)


_split_k_buffers: dict = {}


def split_k_buffers(device: torch.device, m: int, n: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed int32 workspace [M, N] and per-tile counters of one GEMM shape (kernels leave them zeroed).

    One pair per (device, N): GEMMs of different shapes may run at once on SGLang's side streams."""
    ws, counts = _split_k_buffers.get((device, n), (None, None))
    if ws is None or ws.numel() < m * n or counts.numel() < tiles:
        ws = torch.zeros(max(m, config_table.DECODE_MAX_M) * n, dtype=torch.int32, device=device)
        counts = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _split_k_buffers[(device, n)] = ws, counts
    return ws, counts


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
           config: dict, x_q: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None,
           cuts: tuple = (), conv: Optional[conv_update.Epilogue] = None,
           y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run the kernel with an explicit config (the tuner's entry); x [M, K] with unit stride in K. Given x's
    int8 rows and scales (x_q, x_scale, as its producer wrote them), the kernel reads those instead. With `cuts`
    (up to three ascending column indices) y is flat [M * N], one [M, width] block per segment (`segments`); with
    `conv` (where `conv_fits`) the first segment then gets that conv update in place. `y`: the output, if allocated.
    A config with TMA runs the TMA kernel, on x's int8 rows (quantized beforehand), with no split-K or conv."""
    M, K = x.shape
    N = w.shape[0]
    cfg = {"SPLIT_K": 1, **config}
    tma = cfg.pop("TMA", False)
    quant_x = cfg.pop("QUANT_X") and x_q is None
    if y is None:
        y = torch.empty((M * N,) if cuts else (M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    if x_q is not None:
        x = x_q
    elif quant_x:
        x_scale = w_scale
    else:
        x, x_scale = per_token_quant(x)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    cut_args = (*cuts, *(N,) * (3 - len(cuts)))  # the cuts not given sit at N: no segment after the last given
    if tma:
        if quant_x or cfg.pop("SPLIT_K") > 1 or conv is not None:
            raise ValueError(f"a TMA config reads x's int8 rows in one pass, with no conv epilogue: {config}")
        if any(t.stride(0) % 16 or t.data_ptr() % 16 for t in (x, w)):
            raise ValueError(f"TMA reads rows that start on 16 bytes: x {tuple(x.stride())}, w {tuple(w.stride())}")
        x_desc = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        w_desc = TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        _w8a8_tma_kernel[(tiles,)](
            x_desc, w_desc, x_scale, w_scale, w_scale if bias is None else bias, y, M, N, K, *cut_args,
            HAS_BIAS=bias is not None, SEGMENTED=bool(cuts), enable_fp_fusion=False, **pdl.options(x.device), **cfg)
        return y
    ws, counts = split_k_buffers(x.device, M, N, tiles) if cfg["SPLIT_K"] > 1 else (y, y)
    programs = tiles * cfg["SPLIT_K"]
    # By default the first tile goes early in a grid of one wave (one program an SM at most): in a larger one the next
    # grid's early programs load while this grid's last wave still streams (BENCHMARKS.md, 2026-12-04). After a small
    # kernel, as most GEMMs of a cycle run, the best count depends on the shape: the tuner sets it (EARLY_TILES, of
    # BLOCK_K rows of K each; a power of two, as EARLY_K is an arange's length).
    early = cfg.pop("EARLY_TILES", int(programs <= pdl.multiprocessors(x.device)))
    if conv is not None and not conv_fits(cfg, M, cuts, conv.block):
        raise ValueError(f"a conv epilogue needs whole blocks of {conv.block} rows a tile, no split-K: {cfg}")
    conv_args, conv_constants = (conv.arguments(), conv.constants()) if conv is not None else conv_update.no_epilogue(y)
    _w8a8_gemm_kernel[(programs,)](
        x, w, x_scale, w_scale, w_scale if bias is None else bias, y, ws, counts, M, N, K, x.stride(0), w.stride(0),
        *cut_args, *conv_args, QUANT_X=quant_x, HAS_BIAS=bias is not None, SEGMENTED=bool(cuts),
        EARLY_K=early * cfg["BLOCK_K"], enable_fp_fusion=False, **conv_constants, **pdl.options(x.device), **cfg)
    return y


def conv_fits(config: dict, m: int, cuts: tuple, block: int) -> bool:
    """Whether a GEMM of m rows in `config` can run a conv update over blocks of `block` rows in its epilogue: each
    tile holds whole blocks of whole rows of the first segment, no split-K program holds a partial sum, and the loads
    go through registers (the TMA kernel has no conv epilogue)."""
    return (bool(cuts) and config.get("SPLIT_K", 1) == 1 and not config.get("TMA") and m % block == 0
            and config["BLOCK_M"] % block == 0 and cuts[0] % config["BLOCK_N"] == 0)


def segments(y: torch.Tensor, rows: int, cuts: list[int], n: int) -> list[torch.Tensor]:
    """The [rows, width] blocks of a flat output of n columns written with `cuts`, one per segment, as views."""
    bounds = [0, *cuts, n]
    return [y[rows * a:rows * b].view(rows, b - a) for a, b in zip(bounds, bounds[1:])]


def table_config(phase: str, m: int, n: int, k: int) -> dict:
    return config_table.lookup(CONFIGS, phase, m, n, k, DEFAULT_DECODE if m <= config_table.DECODE_MAX_M else DEFAULT_PREFILL)


@torch.library.custom_op("qflash::w8a8_gemm", mutates_args=())
def w8a8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
              phase: str = "verify", x_q: Optional[torch.Tensor] = None,
              x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x bf16 [..., K], w int8 [N, K], w_scale fp32 [N] -> bf16 [..., N], config from the table for `phase`;
    x_q int8 [M, K] and x_scale fp32 [M]: x's rows already quantized (quant/handoff.py)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    return launch(x2, w, w_scale, bias, table_config(phase, M, N, K), x_q, x_scale).reshape(*x.shape[:-1], N)


@w8a8_gemm.register_fake
def _(x, w, w_scale, bias=None, phase="verify", x_q=None, x_scale=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("qflash::w8a8_gemm_segments", mutates_args=())
def w8a8_gemm_segments(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, cuts: list[int], phase: str,
                       x_q: Optional[torch.Tensor] = None, x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w8a8_gemm of x [M, K] (unit stride in K), its output cut into column segments: flat [M * N], one [M, width]
    block per segment (`segments` views them)."""
    M, K = x.shape
    return launch(x, w, w_scale, None, table_config(phase, M, w.shape[0], K), x_q, x_scale, tuple(cuts))


@w8a8_gemm_segments.register_fake
def _(x, w, w_scale, cuts, phase, x_q=None, x_scale=None):
    return x.new_empty((x.shape[0] * w.shape[0],))


DEFAULT_DECODE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=True, SPLIT_K=1, num_warps=4, num_stages=4)
DEFAULT_PREFILL = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=8, num_stages=3)
# Tuned on NVIDIA H200 (sm90) by `qflash tune`; the TMA rows, the decode rows' early tiles and the 16-row buckets on an H100 (BENCHMARKS.md): (phase, M bucket, N, K) -> launch config.
CONFIGS = {
    ('prefill', 64, 2560, 4096): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4),
    ('prefill', 64, 2560, 9216): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4),
    ('prefill', 64, 10240, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=3),
    ('prefill', 64, 12352, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=3),
    ('prefill', 64, 18432, 2560): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=3),
    ('prefill', 2048, 2560, 4096): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4),
    ('prefill', 2048, 2560, 9216): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=4, num_stages=4),
    ('prefill', 2048, 10240, 2560): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=8, num_stages=3),
    ('prefill', 2048, 12352, 2560): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=8, num_stages=3),
    ('prefill', 2048, 18432, 2560): dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=8, num_stages=3),
    ('prefill', 8192, 2560, 4096): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('prefill', 8192, 2560, 9216): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('prefill', 8192, 6144, 2560): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('prefill', 8192, 10240, 2560): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('prefill', 8192, 12352, 2560): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('prefill', 8192, 18432, 2560): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=8, num_stages=4),
    ('verify', 16, 2560, 4096): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 16, 2560, 9216): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=2, num_warps=4, num_stages=4),
    ('verify', 16, 10240, 2560): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=3, EARLY_TILES=0),
    ('verify', 16, 12352, 2560): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4, EARLY_TILES=1),
    ('verify', 16, 18432, 2560): dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=3, EARLY_TILES=1),
    ('verify', 32, 2560, 4096): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 32, 2560, 9216): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 32, 10240, 2560): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('verify', 32, 12352, 2560): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=4),
    ('verify', 32, 18432, 2560): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=3),
    ('verify', 64, 2560, 4096): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 64, 2560, 9216): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 64, 10240, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=3),
    ('verify', 64, 12352, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=3),
    ('verify', 64, 18432, 2560): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('verify', 128, 2560, 4096): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('verify', 128, 2560, 9216): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=3),
    ('verify', 128, 10240, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('verify', 128, 12352, 2560): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('verify', 128, 18432, 2560): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('draft', 16, 2560, 4096): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('draft', 16, 2560, 9216): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4, EARLY_TILES=0),
    ('draft', 16, 6144, 2560): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=4, EARLY_TILES=0),
    ('draft', 16, 18432, 2560): dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=2, num_warps=4, num_stages=3),
    ('draft', 32, 2560, 4096): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('draft', 32, 2560, 9216): dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('draft', 32, 18432, 2560): dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=3),
    ('draft', 64, 2560, 4096): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('draft', 64, 2560, 9216): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=4),
    ('draft', 64, 18432, 2560): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
    ('draft', 128, 2560, 4096): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=4),
    ('draft', 128, 2560, 9216): dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=1, num_warps=4, num_stages=4),
    ('draft', 128, 18432, 2560): dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, QUANT_X=False, SPLIT_K=1, EARLY_TILES=0, num_warps=4, num_stages=3),
}
