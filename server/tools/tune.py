"""`qflash tune`: time candidate launch configs on this GPU, write the fastest into the kernels' static tables.

Offline only: run once on the target GPU (sm90 for the H200) and commit the rewritten kernel files;
serving reads the tables and never tunes. Each candidate is timed on random data with no host overhead: a decode
W8A8 GEMM in a chain of calls over their own weight copies, as a cycle's layers run it (`timing.chain_us`; a GDN
layer's input GEMM in a verify with its conv update and the GDN verify that waits on it, as served), the others with an
L2 flush before each run (`timing.cold_us`); configs that do not fit the chip are skipped.
"""

import functools
import re
import time
from pathlib import Path

import torch

from qflash.kernels import conv_update, gdn_verify, w4_draft_pick, w8a16_argmax, w8a16_gemm, w8a8_gemm
from qflash.kernels.config_table import DECODE_M, DECODE_MAX_M, PHASES, PREFILL_M
from qflash.server.launcher import require_gpu
from qflash.server.preset import BLOCK_SIZE
from qflash.server.tools.shapes import (DRAFTER, GDN_CONV, GDN_CONV_WIDTH, GDN_HEADS, GDN_IN_PROJ_CUTS, GDN_VALUE,
                                        LM_HEAD, TARGET)
from qflash.server.tools.timing import chain_calls, chain_us, cold_us


def w8a8_candidates(m: int) -> list[dict]:
    """Configs to time for a W8A8 GEMM of m rows."""
    if m > DECODE_MAX_M:
        tiles = [(128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4),
                 (128, 128, 64, 4, 4), (64, 256, 128, 8, 3), (128, 128, 128, 4, 3), (256, 128, 64, 8, 3),
                 (128, 128, 128, 8, 4), (128, 256, 64, 8, 4)]
        tma_tiles = [(128, 256, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4)]
        return ([dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, QUANT_X=False, SPLIT_K=1, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in tiles]
                + [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=w,
                        num_stages=s) for bm, bn, bk, w, s in tma_tiles])
    bm = min(max(m, 16), 64)
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, QUANT_X=qx, SPLIT_K=sk, num_warps=4, num_stages=s)
            for bn in (16, 32, 64) for bk in (256, 512) for s in (3, 4)
            for qx, sk in ((True, 1), (False, 1), (False, 2), (False, 4), (False, 8))]


W8A8_GEMMS = tuple(name for name, _, _ in TARGET + DRAFTER)
# A W8A8 table entry stays unless a candidate beats it by more than this share: a retune then changes only the
# shapes it speeds up, not those whose best moved within the timing's noise, and each change is one to A/B.
KEEP_WITHIN = 0.02
EARLY_TILES = (0, 1, 2, 4)  # weight tiles a decode GEMM may load before the PDL wait: EARLY_K, a power of two


def w8a16_candidates(m: int, group: bool = True) -> list[dict]:
    # One row tile covers all decode M: a second one would read the whole lm_head again.
    bm = max(m, 16)
    extra = {"GROUP_M": 1} if group else {}
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra, num_warps=w, num_stages=s)
            for bn in (64, 128) for bk in (128, 256) for w, s in ((4, 4), (8, 3))]


def w4_candidates(m: int) -> list[dict]:
    return [dict(BLOCK_M=max(m, 16), BLOCK_N=bn, num_warps=w, num_stages=s)
            for bn in (128, 256) for w, s in ((4, 3), (4, 4), (8, 3), (8, 4))]


def time_if_runs(time_us, cfg: dict) -> float | None:
    """`time_us(cfg)`, or None for a config that does not fit the chip (skipped, and said so)."""
    try:
        return time_us(cfg)
    except Exception as exc:  # out of shared memory or registers: triton raises at compile or launch
        print(f"  skip {cfg}: {type(exc).__name__}")
        return None


def best_config(time_us, candidates: list[dict]) -> tuple[dict, float]:
    """The fastest candidate that runs (`time_us(config)`); a config that does not fit the chip is skipped."""
    timed = [(us, cfg) for cfg in candidates if (us := time_if_runs(time_us, cfg)) is not None]
    if not timed:
        raise RuntimeError(f"no candidate config runs: {candidates}")
    us, cfg = min(timed, key=lambda t: t[0])
    return cfg, us


def int8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda"),
            torch.rand(n, device="cuda") / (127 * k ** 0.5) + 1e-6)


def gdn_input_verify(m: int, then_verify: bool = False):
    """`gemm(x, w, w_scale, bias, config)`: a GDN layer's input GEMM in a verify of m rows, as served
    (server/hooks/gdn_input_proj.py): the conv update of q|k|v in its epilogue where the config allows it, else the
    GEMM and then the conv kernel. Its conv inputs are made here, outside the timed graph. `then_verify`: the GDN
    verify (kernels/gdn_verify.py) runs after it on its outputs, as in a cycle, where it waits on the GEMM under PDL:
    a config that is faster alone but ends later behind its grid loses there (BENCHMARKS.md, sixtieth session)."""
    requests, cuts = m // BLOCK_SIZE, GDN_IN_PROJ_CUTS
    state = torch.zeros(requests, GDN_CONV, GDN_CONV_WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(requests, device="cuda", dtype=torch.int32)
    call = dict(conv_state_indices=slots, intermediate_state_indices=slots,
                intermediate_conv_window=state.new_zeros(requests, BLOCK_SIZE, GDN_CONV, GDN_CONV_WIDTH - 1))
    conv_weight = torch.ones(GDN_CONV, GDN_CONV_WIDTH, device="cuda", dtype=torch.bfloat16)
    verify_layers = {}  # each weight copy's layer: its own recurrent state and rings, cold as a cycle's are

    def verify(y, w):
        h, hv, dk = GDN_HEADS
        dv = GDN_VALUE // hv
        if w.data_ptr() not in verify_layers:
            verify_layers[w.data_ptr()] = dict(
                A_log=torch.zeros(hv, device="cuda"), dt_bias=torch.zeros(hv, device="cuda"), softplus_beta=1.0,
                softplus_threshold=20.0, initial_state_source=torch.zeros(requests, hv, dv, dk, device="cuda"),
                initial_state_indices=slots,
                cu_seqlens=torch.arange(0, m + 1, BLOCK_SIZE, device="cuda", dtype=torch.int32),
                replayssm_rawv=torch.zeros(requests, hv, BLOCK_SIZE, dv, device="cuda", dtype=torch.bfloat16),
                replayssm_rawk=torch.zeros(requests, h, BLOCK_SIZE, dk, device="cuda", dtype=torch.bfloat16),
                replayssm_g=torch.zeros(requests, hv, BLOCK_SIZE, device="cuda"),
                replayssm_beta=torch.zeros(requests, hv, BLOCK_SIZE, device="cuda"))
        qkv, _, b, a = w8a8_gemm.segments(y, m, list(cuts), w.shape[0])
        q, k, v = gdn_verify.head_views(qkv, ((h, dk), (h, dk), (hv, dv)))  # as the hooked split hands them over
        gdn_verify.verify(q=q, k=k, v=v, a=a, b=b, **verify_layers[w.data_ptr()])

    def gemm(x, w, w_scale, bias, config):
        y = torch.empty(m * w.shape[0], device="cuda", dtype=x.dtype)
        qkv = w8a8_gemm.segments(y, m, list(cuts), w.shape[0])[0].view(requests, BLOCK_SIZE, -1).transpose(1, 2)
        if w8a8_gemm.conv_fits(config, m, cuts, BLOCK_SIZE):
            w8a8_gemm.launch(x, w, w_scale, bias, config, cuts=cuts, y=y,
                             conv=conv_update.epilogue(qkv, state, conv_weight, None, "silu", **call))
        else:
            w8a8_gemm.launch(x, w, w_scale, bias, config, cuts=cuts, y=y)
            conv_update.conv_update(qkv, state, conv_weight, None, "silu", **call)
        if then_verify:
            verify(y, w)
    return gemm


def served_gemm(phase: str, name: str, m: int, then_verify: bool = False):
    """`gemm(x, w, w_scale, bias, config)`: the W8A8 GEMM `name` (shapes.py) of m rows in `phase` as the server runs
    it, so a config is timed in the kernel it configures: a verify's GDN input GEMM with its conv update (and, with
    `then_verify`, the GDN verify after it); else the plain GEMM."""
    if (phase, name) == ("verify", "gdn.in_proj_qkvzba"):
        return gdn_input_verify(m, then_verify)
    return w8a8_gemm.launch


def w8a8_timer(m: int, n: int, k: int, gemm=w8a8_gemm.launch):
    """`time_us(config)` of one W8A8 shape: at decode M in a chain over weight copies, as a cycle's layers run it;
    `gemm(x, w, w_scale, None, config)`: the call timed."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if m > DECODE_MAX_M:
        w, w_scale = int8_weight(n, k)
        return lambda c: cold_us(functools.partial(gemm, x, w, w_scale, None, c))
    weights = [int8_weight(n, k) for _ in range(chain_calls(n * k))]
    return lambda c: chain_us([functools.partial(gemm, x, w, w_scale, None, c) for w, w_scale in weights])


def tune_w8a8(rows: tuple, gemms: tuple = W8A8_GEMMS) -> dict:
    table = {}
    decode, prefill = [m for m in DECODE_M if m in rows], [m for m in PREFILL_M if m in rows]
    jobs = ([("verify", m, s) for m in decode for s in TARGET] + [("draft", m, s) for m in decode for s in DRAFTER]
            + [("prefill", m, s) for m in prefill for s in TARGET + DRAFTER])
    jobs = [(phase, m, shape) for phase, m, shape in jobs if shape[0] in gemms]
    for phase, m, (name, n, k) in jobs:
        gemm = served_gemm(phase, name, m, then_verify=True)
        time_us = w8a8_timer(m, n, k, gemm)
        cfg, us = best_config(time_us, w8a8_candidates(m))
        if m <= DECODE_MAX_M and not cfg.get("QUANT_X"):
            # Then the weight tiles it loads before the PDL wait: each chained call follows its quantization launch,
            # a small kernel, as most of a cycle's GEMMs follow a norm or an activation.
            cfg, us = best_config(time_us, [dict(cfg, EARLY_TILES=e) for e in EARLY_TILES])
        served = w8a8_gemm.CONFIGS.get((phase, m, n, k))  # the entry it would replace, timed again on this machine
        served_us = time_if_runs(time_us, served) if served else None  # None: it does not fit this chip, replaced
        if served_us is not None and served_us <= us * (1 + KEEP_WITHIN):
            cfg = served
        table[(phase, m, n, k)] = cfg
        was = f"  (table's {served_us:.1f} us{', kept' if cfg is served else ''})" if served_us is not None else ""
        rate = f"{n * k / us / 1e3:7.0f} GB/s" if gemm is w8a8_gemm.launch else "with the kernels after it"  # no rate
        print(f"w8a8 {phase:7} M={m:5} {name:20} {us:9.1f} us{was}  {rate}  {cfg}", flush=True)
    return table


def tune_head(module, phase: str, rows: tuple, candidates, launch, bytes_read: int) -> dict:
    """A kernel over the lm_head's shape: `launch(x, config)`, timed cold at each decode bucket in `rows`."""
    table = {}
    name, n, k = LM_HEAD
    for m in (m for m in DECODE_M if m in rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg, us = best_config(lambda c: cold_us(lambda: launch(x, c)), candidates(m))
        table[(phase, m, n, k)] = cfg
        print(f"{module.__name__.split('.')[-1]} M={m:4} {us:9.1f} us  {bytes_read / us / 1e3:7.0f} GB/s  {cfg}", flush=True)
    return table


def tune_draft_pick(rows: tuple, head: tuple) -> dict:
    """The 4-bit draft pick over the copy of `head` (int8 weights, scales), at the buckets it serves."""
    copy = w4_draft_pick.quantize(head[0])
    return tune_head(w4_draft_pick, "draft", tuple(m for m in rows if m <= w4_draft_pick.MAX_ROWS), w4_candidates,
                     lambda x, c: w4_draft_pick.launch(x, *copy, *head, c), copy[0].numel() + copy[1].numel())


def render(table: dict, tuned_on: str) -> str:
    """The `CONFIGS = {...}` source block, one sorted line per key."""
    lines = [f"# Tuned on {tuned_on} by `qflash tune`: (phase, M bucket, N, K) -> launch config.", "CONFIGS = {"]
    for key in sorted(table, key=lambda k: (PHASES.index(k[0]), *k[1:])):
        cfg = ", ".join(f"{name}={value!r}" for name, value in table[key].items())
        lines.append(f"    {key!r}: dict({cfg}),")
    return "\n".join(lines + ["}"]) + "\n"


def write(path: Path, table: dict, tuned_on: str) -> None:
    """Replace the table at the end of a kernel file (from its `# Tuned on` / `CONFIGS = {` line on)."""
    text = Path(path).read_text()
    match = re.search(r"^(# Tuned on .*\n)?CONFIGS = \{", text, flags=re.M)
    if match is None:
        raise ValueError(f"{path} has no CONFIGS table")
    Path(path).write_text(text[:match.start()] + render(table, tuned_on))


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, nargs="+", choices=sorted(set(DECODE_M + PREFILL_M)),
                   default=DECODE_M + PREFILL_M, metavar="M",
                   help=f"the row buckets to tune (decode {DECODE_M}, prefill {PREFILL_M}; default all); "
                        "the tables keep their other entries")
    p.add_argument("--gemms", nargs="+", choices=W8A8_GEMMS, default=W8A8_GEMMS, metavar="NAME",
                   help="only these W8A8 GEMMs (server/tools/shapes.py's names), and not the lm_head's kernels; "
                        "default all of them")


def run(args, extra) -> int:
    require_gpu()
    tuned_on = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    start = time.monotonic()
    rows, gemms = tuple(args.rows), tuple(args.gemms)
    some_gemms = set(gemms) != set(W8A8_GEMMS)
    if set(rows) != set(DECODE_M + PREFILL_M) or some_gemms:  # the header must not claim the entries this run kept
        of = f" of {', '.join(gemms)}" if some_gemms else ""
        tuned_on += f", the {'/'.join(map(str, rows))}-row buckets{of} only (the others: BENCHMARKS.md)"
    n, k = LM_HEAD[1:]
    head = int8_weight(n, k)
    modules = (
        (w8a8_gemm, lambda: tune_w8a8(rows, gemms)),
        (w8a16_gemm, lambda: tune_head(w8a16_gemm, "lm_head", rows, functools.partial(w8a16_candidates, group=True),
                                       lambda x, c: w8a16_gemm.launch(x, *head, c), n * k)),
        (w8a16_argmax, lambda: tune_head(w8a16_argmax, "lm_head", rows,
                                         functools.partial(w8a16_candidates, group=False),
                                         lambda x, c: w8a16_argmax.launch(x, *head, c), n * k)),
        (w4_draft_pick, lambda: tune_draft_pick(rows, head)))
    for module, tune in modules[:1] if some_gemms else modules:  # --gemms: the W8A8 table alone
        table = {**module.CONFIGS, **tune()}  # the buckets not tuned keep their entries
        write(module.__file__, table, tuned_on)  # each table as soon as it is done
        print(f"wrote {len(table)} configs to {module.__file__}", flush=True)
    print(f"tuned in {time.monotonic() - start:.0f} s")
    return 0
