"""`qflash profile`: where a speculative cycle's time goes on the GPU, by kernel family.

Starts a system as `qflash bench` does (dummy model, SGLANG_SIMULATE_ACC_LEN), sends one warm-up request,
then streams one request of the given prompt length; a few cycles into its decoding (prefill done), SGLang's
own profiler (`/start_profile`, CPU + GPU activities) records a fixed number of forward steps, each one
DFlash draft + verify cycle. With `--prefill` the profiler starts before the request instead, so its first
steps are recorded: the prefill (target and draft) that the time to first token is made of, with its host spans and
stretches of GPU work listed in order from the request's arrival, what runs before the first cycle by kernel and by
the torch op that launched it, and how long the GPU idles before that cycle (with `--with-stack`, which Python
functions the host ran meanwhile); with `--cached N` too,
the profiled prompt starts with the warm-up's first N tokens, so its prefill is a chat turn's: new tokens over a
cached prefix (from the radix cache's last checkpoint at or below N, every 256 tokens on this hybrid model).
The trace's GPU kernels are summed by family per step and by launch: each CUDA-graph replay is one group
(named by what it holds: the draft graph picks tokens (an argmax, qflash's draft pick), the verify graph runs the
target's GEMMs and Gated-DeltaNet, a cycle graph, server/hooks/cycle_graphs.py, both; a prefill graph is one launched
inside a prefill's forward step), kernels launched one by one are "eager".
The window's wall time minus the busy time is the GPU waiting on the host (scheduler, Python, syncs between
kernels) and the gaps between kernels; the kernels per cycle count what each cycle launches on the GPU.
"""

import bisect
import gzip
import json
import re
import time
from pathlib import Path

import requests

from qflash.server.errors import UserError
from qflash.server.launcher import require_gpu
from qflash.server.preset import PREFIX_CACHE
from qflash.server.tools import floors
from qflash.server.tools.systems import (OUTPUT_LEN, SGLANG_SYSTEMS, add_speculation_args, make_prompt, positive_csv,
                                         positive_int, system_server)

# (family, kernel-name pattern): the first match wins; names are Triton / CUDA kernel symbols.
FAMILIES = [
    ("qflash W8A8 GEMM", r"_w8a8_gemm_kernel|_w8a8_tma_kernel"),
    ("qflash per-token quant", r"_per_token_quant_kernel"),
    ("qflash W8A16 lm_head", r"_w8a16_gemm_kernel"),
    ("qflash draft pick", r"_w4_scan_kernel|_w4_rescore_kernel|_w8a16_argmax_kernel"),
    ("stock int8 GEMM + quant", r"int8|_per_token_quant_int8|i8i8|s8"),
    ("attention", r"sdpa|flash_fprop"),  # cuDNN's prefill attention, named like its GEMMs (sm90_...)
    ("bf16 GEMM (cuBLAS / CUTLASS)", r"gemm|cutlass|nvjet|xmma|sm90_|ampere_|cublas"),
    # FLA's chunked prefill: its w/u recompute and q/k l2-norm are the rule's too
    ("Gated-DeltaNet", r"gated_delta|delta_rule|fused_recurrent|chunk_|gdn|conv1d|causal_conv|conv_update|mamba|fused_gdn"
                       r"|recompute_w_u|l2norm"),
    # norms before attention: flashinfer's norm kernels are named flashinfer::norm::...
    ("norms, rotary, activations", r"norm|rotary|rope|silu|sigmoid_mul|gelu|act_and_mul|elementwise|vectorized|unrolled"),
    ("attention", r"attention|attn|_fwd_kernel|decode_kernel|extend|flash|_prefix_split_kernel|_merge_block_kernel"),
    ("sampling, argmax, top-k", r"argmax|argmin|topk|sort|softmax|sampl|cumsum|gather|scatter|index"),
    ("copies and fills", r"memcpy|memset|copy|fill|cat"),
]


GEMMS = "|".join(pattern for name, pattern in FAMILIES if "GEMM" in name)
# SGLang's kernels in a stock DFLASH decode cycle that qflash's hooks replace (found by comparing the two systems'
# traces; patterns matched at the start of a kernel's name), with what runs instead: one still launched in qflash's
# cycle is a hook that did not route a served call.
REPLACED = {
    "_causal_conv1d_update_kernel": "the conv update in the GDN input GEMM's epilogue",
    "fused_sigmoid_gating_delta_rule_update_kernel": "_gdn_verify_kernel",
    "fused_qkvzba_split_reshape_cat_contiguous_kernel": "the GDN input GEMM's segments",
    "fused_qkv_split_gdn_prefill_kernel": "the GDN q|k|v split as views",
    "_layer_norm_fwd_1pass_kernel": "_gated_norm_quant_kernel",
    "act_and_mul_kernel": "_silu_mul_quant_kernel",
    "_fused_sigmoid_mul_kernel": "_sigmoid_mul_quant_kernel",
    "_fwd_kernel": "block attention",
    "store_kvcache": "block attention's KV store",
    "_fused_mamba_state_scatter_with_mask_kernel": "_gdn_fold_kernel",
    "create_flashinfer_kv_indices_triton": "_verify_metadata_kernel",
    # torch's, under SGLang's token embedding and the verify's pick
    "at::native::indexSelectSmallIndex": "_embedding_kernel",
    r"at::native::reduce_kernel<\d+, \d+, at::native::ReduceOp<float, at::native::ArgMaxOps": "_row_argmax_tile_kernel",
}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # torch profiler chrome-trace categories of GPU work
# Host spans summed per step: the scheduler's own annotations (one loop iteration is recv, get-next-batch, run,
# process-result), the model runner's forward steps inside run_batch, and the CUDA-graph launch calls.
HOST_SPANS = r"^scheduler\.|^step\[|^copy_result_to_cpu$|^cudaGraphLaunch$"
TOP_KERNELS = 40  # kernels listed by name: what each family is made of, e.g. torch's elementwise kernels
TOP_GEMM_LAUNCHES = 12  # W8A8 GEMM rows by grid and the kernel before: a cycle of one request holds ~10
TOP_GAPS, STEP_GAP_US = 12, 50  # idle gaps listed by the kernels around them; a longer one is the host between steps
PROFILER_STALL = "(the profiler: CUPTI's activity buffer requests)"  # idle_blame's line for profiler_stalls
TIMELINE_ROWS = 120  # a prefill profile's first host spans and stretches of GPU work, listed in order
SKIP_CHUNKS = 4  # streamed chunks (one per scheduler step) before profiling starts: prefill and first steps excluded
# tokens of the profiled request: room for the skipped steps and the recorded ones, a window of cycles each
PROFILED_LEN = 4 * OUTPUT_LEN


def family(kernel_name: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, kernel_name, re.I)), "other")


def short_name(kernel_name: str, width: int = 150) -> str:
    """A kernel's symbol without its return type and parameter list (template arguments kept: they name a torch
    kernel's functor), cut to `width` characters."""
    name, depth = re.sub(r"^void |\(anonymous namespace\)::", "", kernel_name), 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            name = name[:i].rstrip()
            break
    return name if len(name) <= width else name[:width - 3] + "..."


def graph_replays(events: list[dict], kernels: list[dict]) -> tuple[dict[str, list[list[dict]]], list[dict]]:
    """Kernels by the CUDA-graph replay that launched them (they share its runtime call's correlation id), each
    replay named by content (the draft graph picks tokens, by an argmax or qflash's draft pick; the verify graph
    runs the target's GEMMs and Gated-DeltaNet; a cycle graph both; the glue's graphs, graphs/glue.py, one or the
    other), or a prefill graph where it was launched inside a prefill's forward step (SGLang's `step[EXTEND ...]`
    span: a prefill's whole or breakable graph holds the target's body too, and is no cycle), and the kernels
    launched one at a time."""
    launches = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") == "cuda_runtime"
                and "GraphLaunch" in e.get("name", "") and "correlation" in e.get("args", {})}
    prefills = [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == "user_annotation" and e.get("name", "").startswith("step[EXTEND")]
    replays: dict[int, list[dict]] = {}
    eager = []
    for e in kernels:
        corr = e.get("args", {}).get("correlation")
        (replays.setdefault(corr, []) if corr in launches else eager).append(e)
    named: dict[str, list[list[dict]]] = {}
    for corr, group in replays.items():
        names = " ".join(e["name"] for e in group)
        target_body = re.search(dict(FAMILIES)["Gated-DeltaNet"], names, re.I) and re.search(GEMMS, names, re.I)
        picks = re.search(dict(FAMILIES)["qflash draft pick"] + r"|argmax", names, re.I)
        label = ("prefill graph" if any(lo <= launches[corr] <= hi for lo, hi in prefills) else
                 "cycle graph" if target_body and picks else "verify graph" if target_body else
                 "draft graph" if picks else "other graph")
        named.setdefault(label, []).append(group)
    return named, eager


def own_times(kernels: list[dict]) -> dict[int, float]:
    """Each kernel's share (us, by id) of the GPU's busy time: an instant where several kernels run counts once, for
    the one that started first. A kernel launched with PDL starts while the one before it drains and waits for it
    (kernels/pdl.py), and a side stream's kernel overlaps the main stream's, so durations overlap; these shares add
    up to the busy time (the union of the kernels' intervals)."""
    own, reach = {}, min(e["ts"] for e in kernels)
    for e in sorted(kernels, key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        own[id(e)] = max(0.0, end - max(e["ts"], reach))
        reach = max(reach, end)
    return own


def gemm_launches(kernels: list[dict], own: dict[int, float], cycles: int) -> list[tuple]:
    """qflash's W8A8 GEMMs by launch: (grid, the kernel started just before it, launches per cycle, own us a launch, ms
    per cycle), the largest first. Every projection runs the one kernel, so its name says nothing of the shape; the
    grid names the table entry, and where several projections share a grid (the 2,560-wide outputs) the kernel before
    tells them apart (the down projection follows SiLU-and-multiply, out_proj the gated norm)."""
    rows, before, w8a8 = {}, None, re.compile(dict(FAMILIES)["qflash W8A8 GEMM"])
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if w8a8.search(e["name"]):
            grid = e.get("args", {}).get("grid")
            key = ("x".join(map(str, grid)) if grid else "?", short_name(before["name"], 60) if before else "")
            launches, us = rows.get(key, (0, 0.0))
            rows[key] = (launches + 1, us + own[id(e)])
        before = e
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])[:TOP_GEMM_LAUNCHES]
    return [(grid, after, n / cycles, us / n, us * 1e-3 / cycles) for (grid, after), (n, us) in ranked]


def _in_order(kernels: list[dict]):
    """The kernels by start, each with the GPU's idle time before it (None for the first, <= 0 where it overlaps
    what ran before), the kernel that ended last before it, and the end of all work up to and with it."""
    reach, last = None, None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        idle, before = None if reach is None else e["ts"] - reach, last
        if reach is None or e["ts"] + e["dur"] > reach:
            reach, last = e["ts"] + e["dur"], e
        yield e, idle, before, reach


def gaps(kernels: list[dict]) -> tuple[float, dict[tuple[str, str], tuple[int, float]]]:
    """The GPU's idle gaps shorter than STEP_GAP_US (inside a step: launch latency, a kernel that waits for the
    whole one before it, a copy-engine memcpy): their total (us) and, by (the kernel that ended last, the next
    kernel), their count and time. A kernel without PDL behind a kernel, or a copy between two, shows here."""
    by_pair, total = {}, 0.0
    for e, idle, before, _ in _in_order(kernels):
        if idle is not None and 0 < idle < STEP_GAP_US:
            pair = (short_name(before["name"], 60), short_name(e["name"], 60))
            count, us = by_pair.get(pair, (0, 0.0))
            by_pair[pair], total = (count + 1, us + idle), total + idle
    return total, by_pair


def _host_span(event: dict) -> bool:
    return (event.get("cat") in ("user_annotation", "cuda_runtime") and "dur" in event
            and re.search(HOST_SPANS, event.get("name", "")) is not None)


def _span_name(event: dict) -> str:
    return re.sub(r" bs=\d+", "", event["name"])


def arrival(spans: list[dict], kernels: list[dict]) -> float:
    """When a prefill profile's request reached the scheduler (us): the start of its last poll
    (`scheduler.recv_requests`) before the GPU's first work; the window's first event where it polled none. `spans`:
    the trace's host spans (`_host_span`)."""
    first = min(e["ts"] for e in kernels)
    polls = [e["ts"] for e in spans if e["name"] == "scheduler.recv_requests" and e["ts"] <= first]
    return max(polls) if polls else min([first, *(e["ts"] for e in spans)])


def timeline(spans: list[dict], kernels: list[dict], start: float) -> list[tuple[str, float, float]]:
    """The window in order, for a prefill, from the request's arrival at `start` (the idle scheduler's polls before it
    left out): each host span and each stretch of GPU work (kernels with no idle gap of STEP_GAP_US or more between
    them), as (what, ms from the arrival, ms); the first TIMELINE_ROWS. Where a time to first token goes: the
    scheduler's steps against the GPU's work."""
    rows = [(_span_name(e), e["ts"], e["dur"]) for e in spans if e["ts"] >= start]
    stretches = []
    for e, idle, _, reach in _in_order(kernels):
        if idle is None or idle >= STEP_GAP_US:
            stretches.append([e["ts"], 0, reach])  # [start, kernels, end]
        stretches[-1][1:] = stretches[-1][1] + 1, reach
    rows += [(f"GPU, {count} kernels", at, end - at) for at, count, end in stretches]
    rows.sort(key=lambda row: row[1])
    return [(what, (ts - start) * 1e-3, dur * 1e-3) for what, ts, dur in rows[:TIMELINE_ROWS]]


def _idle(kernels: list[dict], start: float, end: float) -> list[tuple[float, float]]:
    """The GPU's idle intervals between `start` and `end` (us), in order."""
    idle, cursor = [], start
    for e, _, _, reach in _in_order(kernels):
        if e["ts"] > cursor and cursor < end:
            idle.append((cursor, min(e["ts"], end)))
        cursor = max(cursor, reach)
    if cursor < end:
        idle.append((cursor, end))
    return idle


def _own_intervals(spans: list[dict]):
    """Each span of one thread with the intervals it ran itself, its callees' left out (a thread's spans nest). A span
    ends by its caller's end at the latest: the profiler's Python tracer can leave a C function's span open past its
    caller's return."""
    done, stack = [], []  # [span, its end, its callees' (start, end)]
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][1] <= e["ts"]:
            done.append(stack.pop())
        end = e["ts"] + e["dur"]
        if stack:
            end = min(end, stack[-1][1])
            stack[-1][2].append((e["ts"], end))
        stack.append((e, end, []))
    for e, end, callees in done + stack:
        own, cursor = [], e["ts"]
        for a, b in callees:
            if a > cursor:
                own.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < end:
            own.append((cursor, end))
        yield e, own


def profiler_stalls(events: list[dict]) -> list[tuple[float, float]]:
    """The profiler's own stalls of the host (us, start and end): CUPTI's 'Activity Buffer Request', a few ms when a
    trace's first GPU activities fill its buffers, stops whichever Python call launched them. Counted as the profiler's,
    not as that call's or the server's."""
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "overhead" and "dur" in e)


def _overlap(a: float, b: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in intervals)


def _stalled_us(idle: list[tuple[float, float]], stalls: list[tuple[float, float]]) -> float:
    """The profiler's stalls inside the GPU's idle intervals (us)."""
    return sum(_overlap(lo, hi, stalls) for lo, hi in idle)


def idle_blame(events: list[dict], idle: list[tuple[float, float]], spans: list[dict]) -> list[tuple[str, float]]:
    """With Python stacks in the trace (`--with-stack`): each Python function's own time (us) inside the GPU's `idle`
    intervals, the most first: what the host ran while the GPU waited for it. Only the threads of the scheduler's
    `spans`: the server's other threads wait for work meanwhile. The profiler's stalls are a line of their own."""
    starts, stalls = [a for a, _ in idle], profiler_stalls(events)
    scheduler = {(e.get("pid"), e.get("tid")) for e in spans}
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") == "python_function" and "dur" in e and (e.get("pid"), e.get("tid")) in scheduler:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    blame: dict[str, float] = {}
    for thread in threads.values():
        for e, own in _own_intervals(thread):
            for a, b in own:
                for lo, hi in idle[max(bisect.bisect_right(starts, a) - 1, 0):bisect.bisect_left(starts, b)]:
                    x, y = max(a, lo), min(b, hi)
                    if y > x:
                        name = re.sub(r"^.*?(site-packages|dist-packages)/", "", e["name"])
                        blame[name] = blame.get(name, 0.0) + y - x - _overlap(x, y, stalls)
    if stalls and threads:
        blame[PROFILER_STALL] = _stalled_us(idle, stalls)
    return sorted(((name, us) for name, us in blame.items() if us > 0), key=lambda kv: -kv[1])


def prefill_step(events: list[dict], spans: list[dict], kernels: list[dict], start: float,
                 cycle_graphs: list[list[dict]]) -> dict | None:
    """A prefill profile's request up to its first cycle: the kernels launched before the first cycle begins on the
    host, at the first verify forward's span (`step[TARGET_VERIFY`) or the first whole-cycle graph's launch (the
    target's prefill, the drafter's context KV, the steps' glue), their GPU busy time, the spans from the request's
    `arrival` to their end and to the first cycle's first kernel (the GPU's idle time in it, and with `--with-stack`
    the Python functions the host ran meanwhile), their families, and the largest of them with the torch op that
    launched each (a kernel launched outside any op, a Triton kernel or a graph's, has none). `spans`: the host
    spans; `start`: the arrival; `cycle_graphs`: the whole-cycle graphs' replays (`graph_replays`). None where the
    window holds no cycle."""
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # Triton: driver
    verify = min([e["ts"] for e in spans if e["name"].startswith("step[TARGET_VERIFY")]
                 + [launched[group[0]["args"]["correlation"]] for group in cycle_graphs], default=None)
    if verify is None:
        return None
    ops = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    mine = [e for e in kernels if launched.get(e.get("args", {}).get("correlation"), e["ts"]) < verify]
    if not mine:
        return None
    own, families, per_kernel = own_times(mine), {}, {}
    for e in mine:
        name = family(e["name"])
        families[name] = families.get(name, 0.0) + own[id(e)]
        key = (short_name(e["name"]), ops.get(e.get("args", {}).get("External id"), ""))
        us, launches = per_kernel.get(key, (0.0, 0))
        per_kernel[key] = (us + own[id(e)], launches + 1)
    end = max(e["ts"] + e["dur"] for e in mine)
    ids = {id(e) for e in mine}
    cycle = min((e["ts"] for e in kernels if id(e) not in ids), default=end)  # the first cycle's GPU work begins
    idle = _idle(kernels, start, cycle)
    return {
        "arrival_to_end_ms": (end - start) * 1e-3, "gpu_busy_ms": sum(own.values()) * 1e-3, "kernels": len(mine),
        "arrival_to_first_kernel_ms": (min(e["ts"] for e in mine) - start) * 1e-3,
        "arrival_to_first_cycle_ms": (cycle - start) * 1e-3, "gpu_idle_ms": sum(b - a for a, b in idle) * 1e-3,
        "families": {f: us * 1e-3 for f, us in sorted(families.items(), key=lambda kv: -kv[1])},
        # (kernel, the op that launched it, launches, ms), the largest first
        "top_kernels": [(name, op, launches, us * 1e-3) for (name, op), (us, launches)
                        in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]],
        "idle_blame": [(name, us * 1e-3) for name, us in idle_blame(events, idle, spans)[:TOP_KERNELS]],
    }


def launch_groups(events: list[dict], kernels: list[dict], own: dict[int, float]) -> dict[str, float]:
    """GPU time (us) by launch: per kind of CUDA-graph replay, and the kernels launched one at a time as eager."""
    named, eager = graph_replays(events, kernels)
    totals = {"eager kernels": sum(own[id(e)] for e in eager)} if eager else {}
    for label, groups in named.items():
        totals[label] = sum(own[id(e)] for group in groups for e in group)
    return totals


def summarize(trace: dict, steps: int) -> dict:
    """GPU time per kernel family per step (each kernel's `own_times` share, so families add up to the busy time),
    the busy (any stream) and wall time of the window, the top 'other' kernels."""
    events = trace.get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not kernels:
        raise ValueError("the trace has no GPU kernel events (was the profiler run with GPU activities?)")
    start = min(e["ts"] for e in kernels)
    window_us = max(e["ts"] + e["dur"] for e in kernels) - start
    own = own_times(kernels)
    busy_us = sum(own.values())
    per_family, counts, other, per_kernel = {}, {}, {}, {}
    for e in kernels:
        name = family(e["name"])
        per_family[name] = per_family.get(name, 0.0) + own[id(e)]
        counts[name] = counts.get(name, 0) + 1
        if name == "other":
            other[e["name"]] = other.get(e["name"], 0.0) + own[id(e)]
        short = short_name(e["name"])
        us, launches, _ = per_kernel.get(short, (0.0, 0, name))
        per_kernel[short] = (us + own[id(e)], launches + 1, name)
    host, spans = {}, [e for e in events if _host_span(e)]
    for e in spans:
        host[_span_name(e)] = host.get(_span_name(e), 0.0) + e["dur"]
    arrived = arrival(spans, kernels)  # a prefill profile's request
    ms = 1e-3 / steps
    named = graph_replays(events, kernels)[0]
    cycles = len(named.get("verify graph", ())) + len(named.get("cycle graph", ())) or steps  # a window: several a step
    order = sorted(per_family, key=per_family.get, reverse=True)
    gap_us, gap_pairs = gaps(kernels)
    stalled_us = _stalled_us(_idle(kernels, start, start + window_us), profiler_stalls(events))
    device = (trace.get("deviceProperties") or [{}])[0].get("name", "")  # torch's profiler names the GPU
    return {
        "device": device, "steps": steps, "window_ms": window_us * ms, "gpu_busy_ms": busy_us * ms, "gpu_idle_ms": (window_us - busy_us) * ms,
        "profiler_stall_ms": stalled_us * ms,  # of the idle time: the profiler's own stalls of the host
        "cycles": cycles, "gpu_cycle_ms": busy_us * 1e-3 / cycles, "kernels_per_cycle": len(kernels) / cycles,
        "families": {f: per_family[f] * ms for f in order},
        "family_kernels_per_cycle": {f: counts[f] / cycles for f in order},
        "launches": {k: v * ms for k, v in sorted(launch_groups(events, kernels, own).items(), key=lambda kv: -kv[1])},
        "top_other": [(n, us * ms) for n, us in sorted(other.items(), key=lambda kv: -kv[1])[:10]],
        # (kernel, its family, launches per cycle, ms per cycle), the largest first
        "top_kernels": [(n, f, launches / cycles, us * 1e-3 / cycles)
                        for n, (us, launches, f) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]],
        "gemm_launches": gemm_launches(kernels, own, cycles),
        # (SGLang kernel that qflash replaces, launches per cycle, what qflash runs instead), of those in the trace
        "replaced": [(n, launches / cycles, instead) for n, (_, launches, _) in per_kernel.items()
                     for name, instead in REPLACED.items() if re.match(rf"{name}\b", n)],
        "host": {k: v * ms for k, v in sorted(host.items(), key=lambda kv: -kv[1])},
        "gap_cycle_us": gap_us / cycles,
        # (kernel before, kernel after, gaps per cycle, us per cycle), the largest first
        "top_gaps": [(before, after, count / cycles, us / cycles) for (before, after), (count, us)
                     in sorted(gap_pairs.items(), key=lambda kv: -kv[1][1])[:TOP_GAPS]],
        "timeline": timeline(spans, kernels, arrived),
        "prefill": prefill_step(events, spans, kernels, arrived, named.get("cycle graph", [])),
    }


def render(summary: dict, title: str, family_floors: dict[str, float] | None = None, qflash: bool = False,
           in_order: bool = False) -> str:
    """The summary as markdown; with `family_floors` (floors.per_cycle_ms), each family's time per cycle against its
    floor; for a `qflash` cycle, which of the SGLang kernels it replaces were launched; `in_order`: the timeline."""
    window, family_floors = summary["window_ms"], family_floors or {}
    per_cycle = summary["steps"] / summary["cycles"]  # a family's ms per step -> per cycle
    card, tbps = floors.card_rate(summary["device"])
    lines = [title, "", f"Per step (mean of {summary['steps']}): window {window:.3f} ms, GPU busy "
             f"{summary['gpu_busy_ms']:.3f} ms, GPU idle (host, gaps) {summary['gpu_idle_ms']:.3f} ms"
             + (f" (the profiler's own stalls {summary['profiler_stall_ms']:.3f} ms of it)"
                if summary["profiler_stall_ms"] else "") + "; "
             f"{summary['cycles']} cycles, GPU busy {summary['gpu_cycle_ms']:.3f} ms and "
             f"{summary['kernels_per_cycle']:.0f} kernels per cycle."
             + (f" Byte floor {sum(family_floors.values()):.3f} ms per cycle "
                f"({summary['gpu_cycle_ms'] / sum(family_floors.values()):.1f}x) at the {card}'s {tbps:.1f} TB/s."
                if family_floors else ""), "",
             "| kernel family | ms per step | share of window | kernels per cycle | ms per cycle (floor, x floor) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    counts = summary["family_kernels_per_cycle"]
    for f, v in summary["families"].items():
        mine = v * per_cycle
        against = f" ({family_floors[f]:.3f}, {mine / family_floors[f]:.1f}x)" if family_floors.get(f) else ""
        lines.append(f"| {f} | {v:.3f} | {v / window:.0%} | {counts[f]:.1f} | {mine:.3f}{against} |")
    lines.append(f"| GPU idle | {summary['gpu_idle_ms']:.3f} | {summary['gpu_idle_ms'] / window:.0%} | | |")
    lines += ["", "| launched as | ms per step | share of window |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:.3f} | {v / window:.0%} |" for k, v in summary["launches"].items()]
    if summary["host"]:
        lines += ["", "| host span (CPU, inflated by the profiler) | ms per step |", "| --- | ---: |"]
        lines += [f"| `{k}` | {v:.3f} |" for k, v in summary["host"].items()]
    if summary["top_other"]:
        lines += ["", "Largest kernels outside the families: " + ", ".join(f"`{n}` {v:.3f} ms" for n, v in summary["top_other"])]
    if qflash:
        launched = ", ".join(f"`{n}` {per:.1f} a cycle (for {instead})" for n, per, instead in summary["replaced"])
        lines += ["", f"SGLang kernels that qflash's hooks replace, launched in the cycle: {launched or 'none'}"]
    lines += ["", "| kernel | family | launches per cycle | ms per cycle |", "| --- | --- | ---: | ---: |"]
    lines += [f"| `{n}` | {f} | {launches:.1f} | {ms:.4f} |" for n, f, launches, ms in summary["top_kernels"]]
    if summary["gemm_launches"]:
        lines += ["", "qflash's W8A8 GEMMs by grid and the kernel started before each (which names the projection "
                  "where grids repeat):", "", "| grid | after | launches per cycle | own us a launch | ms per cycle |",
                  "| --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {grid} | `{after}` | {n:.1f} | {us:.2f} | {ms:.4f} |"
                  for grid, after, n, us, ms in summary["gemm_launches"]]
    if summary["top_gaps"]:
        lines += ["", f"GPU idle inside a step (gaps under {STEP_GAP_US} us): {summary['gap_cycle_us']:.1f} us per "
                  "cycle; the largest by the kernels around them:", "",
                  "| idle after | before | gaps per cycle | us per cycle |", "| --- | --- | ---: | ---: |"]
        lines += [f"| `{a}` | `{b}` | {n:.1f} | {us:.2f} |" for a, b, n, us in summary["top_gaps"]]
    if in_order and summary.get("prefill"):
        pre = summary["prefill"]
        lines += ["", f"The request up to its first cycle (the {pre['kernels']} kernels launched before the first cycle's "
                  f"verify or graph): {pre['arrival_to_end_ms']:.3f} ms from its arrival at the scheduler to their end, the first of them "
                  f"{pre['arrival_to_first_kernel_ms']:.3f} ms after it; GPU busy {pre['gpu_busy_ms']:.3f} ms.", "",
                  "| kernel family | ms |", "| --- | ---: |"]
        lines += [f"| {f} | {ms:.3f} |" for f, ms in pre["families"].items()]
        lines += ["", "| kernel | launched by (torch op) | launches | ms |", "| --- | --- | ---: | ---: |"]
        lines += [f"| `{n}` | {op and f'`{op}`'} | {launches} | {ms:.4f} |" for n, op, launches, ms in pre["top_kernels"]]
        lines += ["", f"From the arrival to the first cycle's GPU work, {pre['arrival_to_first_cycle_ms']:.3f} ms, the GPU "
                  f"idled {pre['gpu_idle_ms']:.3f} ms" + (", while the host ran (Python functions' own time, "
                  "inflated by the profiler):" if pre["idle_blame"] else " (`--with-stack` names what the host ran).")]
        if pre["idle_blame"]:
            lines += ["", "| Python function | ms |", "| --- | ---: |"]
            lines += [f"| `{name}` | {ms:.3f} |" for name, ms in pre["idle_blame"]]
    if in_order:
        lines += ["", f"In order from the request's arrival (the first {TIMELINE_ROWS}): host spans, and stretches of GPU "
                  "work between idle gaps of "
                  f"{STEP_GAP_US} us or more:", "", "| at ms | ms | what |", "| ---: | ---: | --- |"]
        lines += [f"| {at:.3f} | {ms:.3f} | {what} |" for what, at, ms in summary["timeline"]]
    return "\n".join(lines) + "\n"


TRACE_SETTLE_S = 5  # after a trace file appears, time for SGLang's exporter to finish writing it


def _wait_for_trace(folder: Path, before: set[Path], timeout_s: float = 300) -> Path:
    """The trace SGLang's profiler writes into `folder`, not one of the `before` an earlier run left there (an --out
    used again)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        traces = sorted(set(folder.glob("*.trace.json.gz")) - before)
        if traces:
            time.sleep(TRACE_SETTLE_S)
            return traces[-1]
        time.sleep(2)
    raise TimeoutError(f"no new profiler trace in {folder} after {timeout_s:.0f} s")


def prompts(prompt_len: int, cached: int) -> tuple[list[int], list[int]]:
    """(warm-up prompt, profiled prompt): the profiled one starts with the warm-up's first `cached` tokens."""
    warm_up = make_prompt(prompt_len, 0)
    return warm_up, warm_up[:cached] + make_prompt(prompt_len, 1)[cached:]


def _profile_one(server, system: str, traces: Path, prompt_len: int, steps: int, prefill: bool = False,
                 with_stack: bool = False, cached: int = 0) -> Path:
    """Warm up at this length, then record `steps` forward steps of a second request: decode cycles from a
    few cycles in, or with `prefill` its first steps (the prefill and what follows); `with_stack` adds the Python
    call stacks (where the host time goes, at a further cost in host time); `cached` tokens of the second request's
    prompt are the warm-up's; returns the trace file."""
    sampling = {"max_new_tokens": PROFILED_LEN, "temperature": 0.0, "ignore_eos": True}
    profile = {"output_dir": str(traces), "num_steps": steps, "activities": ["CPU", "GPU"],
               "profile_prefix": system, "with_stack": with_stack, "record_shapes": False}
    traces.mkdir(parents=True, exist_ok=True)
    before = set(traces.glob("*.trace.json.gz"))
    for index, prompt in enumerate(prompts(prompt_len, cached)):  # a warm-up request, then the profiled one
        if index and prefill:
            requests.post(server.base_url + "/start_profile", json=profile, timeout=120).raise_for_status()
        body = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
        with requests.post(server.base_url + "/generate", json=body, stream=True, timeout=600) as resp:
            resp.raise_for_status()
            chunks = (line for line in resp.iter_lines() if line.startswith(b"data:"))
            for n, _ in enumerate(chunks):
                if index and not prefill and n == SKIP_CHUNKS:
                    requests.post(server.base_url + "/start_profile", json=profile, timeout=120).raise_for_status()
    return _wait_for_trace(traces, before)


def profile_buckets(server, system: str, out: Path, prompt_lens: list[int], steps: int, flags: list[str] = (),
                    prefill: bool = False, with_stack: bool = False, cached: int = 0) -> dict:
    """Profile `steps` cycles (or, with `prefill`, a request's first steps, over `cached` tokens of the warm-up's
    prompt) at each prompt length on a running server; one table per length in `out`."""
    out, kind = Path(out).resolve(), ("-prefill" if prefill else "") + (f"-cached{cached}" if cached else "")
    found = [(n, _profile_one(server, system, out / "traces" / f"{system}-{n}{kind}", n, steps, prefill, with_stack, cached))
             for n in prompt_lens]
    report = {}
    for prompt_len, trace_path in found:
        summary = summarize(json.loads(gzip.open(trace_path).read()), steps)
        extra = ((" --prefill" if prefill else "") + (f" --cached {cached}" if cached else "")
                 + (" --with-stack" if with_stack else "") + (f" {' '.join(flags)}" if flags else ""))
        title = f"`qflash profile --system {system} --prompt-len {prompt_len} --steps {steps}{extra}`: {trace_path.name}"
        decode = system == "qflash" and not prefill
        table = render(summary, title, floors.per_cycle_ms(prompt_len, summary["device"]) if decode else None, decode,
                       in_order=prefill)
        (out / f"{system}-{prompt_len}{kind}-profile.md").write_text(table)
        report[prompt_len] = summary
        print(table)
    (out / f"{system}{kind}-profile.json").write_text(json.dumps({"flags": list(flags), "by_prompt_len": report}, indent=2))
    return report


def run_profile(system: str, out: Path, prompt_lens: list[int], steps: int, acc_len: float,
                flags: list[str] = (), port: int = 30030, prefill: bool = False, with_stack: bool = False,
                prefix_cache: bool = PREFIX_CACHE, cached: int = 0) -> int:
    """Profile one server of `system` (plus extra SGLang `flags`) at each prompt length; one table per length."""
    out = Path(out).resolve()
    with system_server(system, out / f"{system}.log", port, acc_len, flags=list(flags), prefix_cache=prefix_cache) as server:
        profile_buckets(server, system, out, prompt_lens, steps, flags, prefill, with_stack, cached)
    return 0


PASSTHROUGH = True  # flags the profiler does not know go to the SGLang server


def add_arguments(p) -> None:
    p.add_argument("--system", choices=list(SGLANG_SYSTEMS), default="qflash", help="(default qflash)")
    p.add_argument("--prompt-len", type=positive_csv, default=[2048], help="comma list of prompt lengths, one server (default 2048)")
    p.add_argument("--steps", type=int, default=10, help="cycles to record (default 10)")
    p.add_argument("--prefill", action="store_true", help="record the request's first steps (its prefill) instead")
    p.add_argument("--cached", type=positive_int, default=0, metavar="TOKENS",
                   help="with --prefill: the prompt's first TOKENS tokens are the warm-up's (a prefill over a cached prefix)")
    p.add_argument("--with-stack", action="store_true",
                   help="also record Python call stacks (host time, inflated; with --prefill: what the host ran while the GPU idled)")
    add_speculation_args(p)
    p.add_argument("--out", type=Path, required=True, help="folder for the trace, profile.md and profile.json")


def run(args, extra) -> int:
    if args.cached and not (args.prefill and args.prefix_cache and args.system == "qflash"
                            and args.cached < min(args.prompt_len)):
        raise UserError("--cached needs --prefill, qflash with its prefix cache, and fewer tokens than each --prompt-len")
    require_gpu()
    return run_profile(args.system, args.out, args.prompt_len, args.steps, args.acc_len, extra, prefill=args.prefill,
                       with_stack=args.with_stack, prefix_cache=args.prefix_cache, cached=args.cached)
