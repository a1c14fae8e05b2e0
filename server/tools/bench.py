"""`qflash bench`: the latency scoreboard of the benchmark protocol, every system measured in one run.

Each system is started by the bench itself, measured on the three prompt buckets (one request at a
time, a fresh random prompt each, 256 greedy tokens, `ignore_eos`, 1 warm-up + N timed), and stopped
before the next starts. Protocol: shared/reference/benchmark-protocol.md.
"""

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

import orjson
import requests
from tqdm import tqdm

from qflash.server.errors import UserError
from qflash.server.hooks import compile_watch, cycle_meter
from qflash.server.launcher import ServerDied, require_gpu
from qflash.server.preset import PREFIX_CACHE, PROMPT_BUCKETS
from qflash.server.tools import workloads
from qflash.server.tools.systems import (OUTPUT_LEN, SYSTEMS, add_speculation_args, csv, make_prompt,
                                         positive_csv, positive_int, replicas_server, system_server)

VALID_ACCEPT = (6.2, 6.8)
REFERENCE = "sglang-bf16"
HOST_BOUND = 1.15  # a cycle whose wall time exceeds its GPU busy time by more than this waited on the host
PROFILE_STEPS = 8  # scheduler steps profiled per bucket on each timed server, for the GPU busy time per cycle
PORT = 30010  # each system's server in turn (replicas: the router; theirs after it), clear of `qflash serve`'s


def request_plan(buckets: list[int], timed: int) -> list[dict]:
    """Per bucket: one warm-up request, then `timed` measured ones."""
    return [
        {"bucket": b, "index": i, "warmup": i == 0, "input_ids": make_prompt(b, i)}
        for b in buckets for i in range(1 + timed)
    ]


def generate_payload(input_ids: list[int]) -> dict:
    sampling = {"max_new_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": input_ids, "sampling_params": sampling, "stream": True}


def read_stream(lines, start: float, clock=time.perf_counter, with_ids: bool = False) -> dict:
    """Time one streamed /generate response: first chunk = first token (TTFT), last chunk = done. The first
    chunk's token count says whether the server sent the prefill's token alone or with a verify's tokens.
    `with_ids`: also the answer's token ids (the last chunk holds them all: SGLang streams them cumulatively)."""
    first, first_tokens, meta, ids = None, None, None, None
    for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"server error: {chunk['error']}")
        meta, ids = chunk["meta_info"], chunk.get("output_ids")
        if first is None:
            first, first_tokens = clock(), meta["completion_tokens"]
    end = clock()
    if meta is None:
        raise RuntimeError("empty response stream")
    sample = {
        "latency_ms": (end - start) * 1e3,
        "ttft_ms": (first - start) * 1e3,
        "first_chunk_tokens": first_tokens,
        "output_tokens": meta["completion_tokens"],
        "cached_tokens": meta.get("cached_tokens"),
        "accept_len": meta.get("spec_accept_length"),
        "verify_steps": meta.get("spec_verify_ct"),
        "rid": meta.get("id"),
    }
    return {**sample, "output_ids": list(ids or [])} if with_ids else sample


def time_request(base_url: str, input_ids: list[int], with_ids: bool = False) -> dict:
    start = time.perf_counter()
    with requests.post(base_url + "/generate", json=generate_payload(input_ids), stream=True, timeout=600) as resp:
        resp.raise_for_status()
        return read_stream(resp.iter_lines(), start, with_ids=with_ids)


def metered(samples: list[dict], log: str) -> list[dict]:
    """The samples with the server's cycle meter for each (server/hooks/cycle_meter.py): its loop time and host
    time per cycle, and that host time by stage, from the request's own decode steps."""
    found = {m[1]: cycle_meter.host_ms_per_cycle(m) for m in cycle_meter.PATTERN.finditer(log)}
    out = []
    for s in samples:
        cycles, loop, host, stages = found.get(s.get("rid"), (None, None, None, None))
        out.append({**s, "meter_cycles": cycles, "loop_cycle_ms": loop, "host_cycle_ms": host, "host_stages_ms": stages})
    return out


def host_stages(group: list[dict]) -> dict[str, float] | None:
    """Median host ms per cycle of each stage over a group's metered samples, with what the stages leave out:
    `scheduler`, the loop's host time outside `run_batch`, and `worker_rest`, `run_batch`'s outside the model
    forwards and the worker calls the meter times (cycle_meter.IN_RUN_BATCH)."""
    metered_samples = [s for s in group if s.get("host_stages_ms")]
    if not metered_samples:
        return None
    names = list(dict.fromkeys(name for s in metered_samples for name in s["host_stages_ms"]))
    medians = {name: statistics.median(s["host_stages_ms"].get(name, 0.0) for s in metered_samples) for name in names}
    if "run_batch" in medians:
        medians["scheduler"] = statistics.median(s["host_cycle_ms"] - s["host_stages_ms"].get("run_batch", 0.0)
                                                 for s in metered_samples)
        medians["worker_rest"] = medians["run_batch"] - sum(medians.get(n, 0.0) for n in cycle_meter.IN_RUN_BATCH)
    return medians


def summarize(samples: list[dict], acc_range: tuple[float, float] = VALID_ACCEPT,
              gpu_cycle_ms: dict | None = None) -> list[dict]:
    """One row per (system, bucket) from the timed samples, with speedups where the baseline ran, and where
    profiled (`gpu_cycle_ms`: system -> bucket as a string, as JSON keeps it -> ms), the GPU busy time per cycle
    beside the wall time."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for s in samples:
        if not s["warmup"]:
            groups.setdefault((s["system"], s["bucket"]), []).append(s)
    rows = []
    for (system, bucket), group in groups.items():
        lat = [s["latency_ms"] for s in group]
        ttft = statistics.median(s["ttft_ms"] for s in group)
        accepts = [s["accept_len"] for s in group if s.get("accept_len") is not None]
        accept = statistics.fmean(accepts) if accepts else None
        # A baseline cycle is one decode step; a speculative cycle is one draft + verify step.
        steps = statistics.fmean(s.get("verify_steps") or s["output_tokens"] - 1 for s in group)
        median = statistics.median(lat)
        cycle = (median - ttft) / steps
        gpu = (gpu_cycle_ms or {}).get(system, {}).get(str(bucket))
        hosts = [s["host_cycle_ms"] for s in group if s.get("host_cycle_ms") is not None]
        rows.append({
            "system": system, "bucket": bucket, "median_ms": median, "min_ms": min(lat), "max_ms": max(lat),
            "ttft_ms": ttft, "accept_len": accept, "cycle_ms": cycle, "n": len(group),
            "gpu_cycle_ms": gpu, "host_cycle_ms": statistics.median(hosts) if hosts else None,
            "host_stages_ms": host_stages(group),
            "host_bound": None if gpu is None else cycle > HOST_BOUND * gpu,
            "valid": accept is None or acc_range[0] <= accept <= acc_range[1],
        })
    medians = {(r["system"], r["bucket"]): r["median_ms"] for r in rows}
    for r in rows:
        base, ref = medians.get(("baseline", r["bucket"])), medians.get((REFERENCE, r["bucket"]))
        r["speedup_vs_baseline"] = base / r["median_ms"] if base else None
        r["speedup_vs_sglang_bf16"] = ref / r["median_ms"] if ref else None
    return sorted(rows, key=lambda r: (SYSTEMS.index(r["system"]), r["bucket"]))


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def render_table(rows: list[dict], errors: dict[str, str]) -> str:
    """Markdown: a per-bucket detail table, then the scoreboard (median ms per bucket, mean speedups)."""
    out = ["| system | bucket | median ms | min ms | max ms | TTFT ms | accept len | cycle ms | GPU ms / cycle "
           "| host ms / cycle | vs baseline | vs sglang-bf16 |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        accept = _fmt(r["accept_len"], ".2f") + ("" if r["valid"] else " INVALID")
        bound = " host-bound" if r.get("host_bound") else ""
        out.append(
            f"| {r['system']} | {r['bucket']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} "
            f"| {r['ttft_ms']:.1f} | {accept} | {r['cycle_ms']:.2f}{bound} | {_fmt(r.get('gpu_cycle_ms'), '.2f')} "
            f"| {_fmt(r.get('host_cycle_ms'), '.2f')} | {_fmt(r['speedup_vs_baseline'], '.1f', 'x')} "
            f"| {_fmt(r['speedup_vs_sglang_bf16'], '.2f', 'x')} |"
        )
    buckets = sorted({r["bucket"] for r in rows})
    out += ["", "| system | " + " | ".join(f"{b} ms" for b in buckets) + " | mean speedup vs baseline | mean vs sglang-bf16 |",
            "| --- | " + " | ".join("---:" for _ in buckets) + " | ---: | ---: |"]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = {r["bucket"]: r for r in rows if r["system"] == system}
        cells = [_fmt(mine[b]["median_ms"], ".1f") if b in mine else "-" for b in buckets]
        invalid = "" if all(r["valid"] for r in mine.values()) else " (INVALID: accept length outside 6.2-6.8)"
        out.append(
            f"| {system}{invalid} | " + " | ".join(cells)
            + f" | {_fmt(_mean(r['speedup_vs_baseline'] for r in mine.values()), '.1f', 'x')}"
            + f" | {_fmt(_mean(r['speedup_vs_sglang_bf16'] for r in mine.values()), '.2f', 'x')} |"
        )
    out += [f"| {system} | failed: {error} |" for system, error in errors.items()]
    return "\n".join(out + render_host_stages(rows)) + "\n"


def render_host_stages(rows: list[dict]) -> list[str]:
    """Markdown lines: the host ms per cycle by stage for the rows the cycle meter split (none: no lines)."""
    rows = [r for r in rows if r.get("host_stages_ms")]
    if not rows:
        return []
    names = list(dict.fromkeys(name for r in rows for name in r["host_stages_ms"]))
    out = ["", "Host ms per cycle by stage (server/hooks/cycle_meter.py; `run_batch` holds the worker's stages, the "
               "forwards hold their graph launches; where the GPU is behind, a launch can block inside `run_batch`, "
               "which `scheduler` then reads below zero):", "",
           "| system | bucket | host | " + " | ".join(names) + " |", "| --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for r in rows:
        cells = [_fmt(r["host_stages_ms"].get(name), ".2f") for name in names]
        out.append(f"| {r['system']} | {r['bucket']} | {_fmt(r.get('host_cycle_ms'), '.2f')} | " + " | ".join(cells) + " |")
    return out


def render_compiles(compiles: dict[str, list[str] | None]) -> str:
    """One line: how many Triton compiles each server's requests waited for after its start-up and warm-up, and of
    which kernels (servers whose log does not tell them apart, None, left out)."""
    watched = {system: names for system, names in compiles.items() if names is not None}
    if not watched:
        return ""
    told = [f"{system} {len(names)}" + (f" ({', '.join(dict.fromkeys(names))})" if names else "")
            for system, names in watched.items()]
    return f"\nTriton compiles while serving (server/hooks/compile_watch.py): {'; '.join(told)}\n"


def render_chart(rows: list[dict], path: Path) -> None:
    """Grouped bars: median latency per bucket, one bar per system, log scale (the baseline is ~40x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    buckets = sorted({r["bucket"] for r in rows})
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, system in enumerate(systems):
        mine = {r["bucket"]: r["median_ms"] for r in rows if r["system"] == system}
        xs = [i + (k - (len(systems) - 1) / 2) * width for i, b in enumerate(buckets) if b in mine]
        ys = [mine[b] for b in buckets if b in mine]
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(buckets)), [f"{b} prompt tokens" for b in buckets])
    ax.set_yscale("log")
    ax.set_ylabel(f"median latency, ms ({OUTPUT_LEN} output tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gpu_name() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
        return names[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


HOST_PROBE = "sorted(str(i) for i in range(100_000))"  # pure Python, as a scheduler's per-cycle bookkeeping is


def host_info() -> dict:
    """The run's CPU and how fast it runs Python (best of 5 probes). The lent GPU machines differ in host speed,
    and qflash's decoding cycle is bound by the host on a slow one, so runs on two machines compare only with this."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    probe_ms = min(timeit.repeat(HOST_PROBE, number=1, repeat=5)) * 1e3
    return {"cpu": models[0] if models else "unknown", "cores": os.cpu_count(), "python_probe_ms": round(probe_ms, 2)}


def _run_baseline(plan: list[dict], out: Path, progress) -> list[dict]:
    requests_file = out / "baseline-requests.json"
    requests_file.write_bytes(orjson.dumps(plan))
    argv = [sys.executable, "-m", "qflash.server.tools.baseline", "--requests", str(requests_file), "--output-len", str(OUTPUT_LEN)]
    samples = []
    with open(out / "logs" / "baseline.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
        for line in proc.stdout:
            record = orjson.loads(line)
            if "bucket" in record:
                samples.append(record)
                progress.update(1)
        if proc.wait() != 0:
            raise ServerDied(f"baseline exited with code {proc.returncode}; log: {out / 'logs' / 'baseline.log'}")
    return samples


def _run_sglang(system: str, plan: list[dict], out: Path, port: int, acc_len: float, progress, flags: list[str],
                keep, profile_steps: int = 0, prefix_cache: bool = PREFIX_CACHE, profile_with_stack: bool = False,
                profile_prefill: bool = False, workload_names: list[str] = (), keep_workload=None) -> dict[str, float]:
    """Time the plan on one server of `system` (with the cycle meter) and `keep` the samples; then run the
    `workload_names` on it (`keep_workload` their samples); then, with `profile_steps`, profile that many
    scheduler steps per bucket on the same server (`qflash profile`'s tables, written to out/profiles) and return
    each bucket's GPU busy time per cycle."""
    with system_server(system, out / "logs" / f"{system}.log", port, acc_len, env={cycle_meter.ENV: "1"}, flags=flags,
                       prefix_cache=prefix_cache) as server:
        samples = []
        for req in plan:
            samples.append({"bucket": req["bucket"], "warmup": req["warmup"], **time_request(server.base_url, req["input_ids"])})
            progress.update(1)
        time.sleep(1)  # the meter's last line is printed after the response
        keep(metered(samples, server.log()))  # before profiling: a bench stopped while it profiles keeps its timed rows
        for name in workload_names:
            keep_workload(workloads.RUNS[name](lambda ids: time_request(server.base_url, ids, with_ids=True)))
        if not profile_steps:
            return {}
        from qflash.server.tools.profile import profile_buckets

        report = profile_buckets(server, system, out / "profiles", sorted({r["bucket"] for r in plan}), profile_steps,
                                 flags, prefill=profile_prefill, with_stack=profile_with_stack)
        return {} if profile_prefill else {str(bucket): summary["gpu_cycle_ms"] for bucket, summary in report.items()}


def _run_replicas(count: int, share_gpus: bool, out: Path, port: int, acc_len: float, flags: list[str],
                  prefix_cache: bool, workload_names: list[str], keep_workload) -> None:
    """The named workloads on `count` qflash replicas behind SGLang's router (`qflash serve --replicas`)."""
    with replicas_server(count, share_gpus, out / "logs", port, acc_len, flags, prefix_cache) as router:
        for name in workload_names:
            keep_workload(workloads.RUNS[name](lambda ids: time_request(router.base_url, ids, with_ids=True)))


def run_bench(systems: list[str], out: Path, buckets: list[int], timed: int, acc_len: float,
              flags: list[str] = (), port: int = PORT, profile_steps: int = 0, prefix_cache: bool = PREFIX_CACHE,
              profile_with_stack: bool = False, profile_prefill: bool = False, workload_names: list[str] = (),
              replicas: int = 1, share_gpus: bool = False) -> int:
    """Every system in turn on the same requests (and the named workloads, on the SGLang systems; with `replicas`
    above 1, also on that many qflash servers behind SGLang's router, the row `qflash xN`); extra SGLang `flags` go
    to every SGLang system (for trials)."""
    out = Path(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    plan = request_plan(buckets, timed)
    meta = {
        "date": datetime.date.today().isoformat(), "machine": _gpu_name(), "host": host_info(), "systems": systems,
        "command": "qflash bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "protocol": {"buckets": buckets, "output_len": OUTPUT_LEN, "timed": timed, "warmup": 1,
                     "acc_len": acc_len, "greedy": True, "ignore_eos": True},
        "qflash_prefix_cache": prefix_cache, "gpu_cycle_ms": {}, "workloads": list(workload_names),
        "replicas": replicas, "share_gpus": share_gpus, "compiles_while_serving": {},
    }
    replicated = [f"qflash x{replicas}"] if replicas > 1 else []
    samples, errors = [], {}
    meta["workload_samples"] = workload_samples = []

    def keep(system: str, got: list[dict], into: list = samples) -> None:
        into.extend({"system": system, **s} for s in got)
        write_results(out, meta, samples, errors)  # as each system's rows come, so a cut-short run keeps them

    with tqdm(total=len(systems) * len(plan), desc="qflash bench", unit="req") as progress:
        for system in [*systems, *replicated]:
            progress.set_postfix_str(system)
            try:
                if system == "baseline":
                    keep(system, _run_baseline(plan, out, progress))
                elif system in replicated:
                    _run_replicas(replicas, share_gpus, out, port, acc_len, list(flags), prefix_cache, workload_names,
                                  lambda got: keep(system, got, workload_samples))
                else:
                    meta["gpu_cycle_ms"][system] = _run_sglang(
                        system, plan, out, port, acc_len, progress, list(flags), lambda got: keep(system, got),
                        profile_steps, prefix_cache, profile_with_stack, profile_prefill, workload_names,
                        lambda got: keep(system, got, workload_samples))
            except (ServerDied, TimeoutError, RuntimeError, requests.RequestException) as exc:
                errors[system] = str(exc)
                tqdm.write(f"{system}: FAILED: {exc}")
            log = out / "logs" / f"{system}.log"
            if system != "baseline" and system not in replicated and log.exists():
                meta["compiles_while_serving"][system] = compile_watch.compiles_while_serving(log.read_text(errors="replace"))
            table = write_results(out, meta, samples, errors)
    print(table)
    return 1 if errors else 0


def write_results(out: Path, meta: dict, samples: list[dict], errors: dict[str, str]) -> str:
    """results.json (rows), run.json (meta + raw samples, the workloads' too), results.md (with the workloads'
    rows), latency.png and workloads.png; returns the table."""
    rows = summarize(samples, gpu_cycle_ms=meta.get("gpu_cycle_ms"))
    (out / "results.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    (out / "run.json").write_bytes(orjson.dumps({**meta, "errors": errors, "samples": samples}, option=orjson.OPT_INDENT_2))
    host = meta.get("host")
    on = f" (host: {host['cpu']}, {host['cores']} cores, Python probe {host['python_probe_ms']} ms)" if host else ""
    workload_rows = workloads.summarize(meta.get("workload_samples", []))
    table = (f"{meta['date']}, {meta['machine']}{on}: `{meta['command']}`\n\n" + render_table(rows, errors)
             + workloads.render_table(workload_rows) + render_compiles(meta.get("compiles_while_serving", {})))
    (out / "results.md").write_text(table)
    if rows:
        render_chart(rows, out / "latency.png")
    if workload_rows:
        workloads.render_chart(workload_rows, out / "workloads.png")
    return table


PASSTHROUGH = True  # flags the bench does not know go to every SGLang system (trials)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", type=csv(str, SYSTEMS), default=list(SYSTEMS),
                   help=f"comma list from {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md, latency.png, logs/")
    p.add_argument("--buckets", type=positive_csv, default=list(PROMPT_BUCKETS),
                   help=f"prompt lengths (default {','.join(map(str, PROMPT_BUCKETS))})")
    p.add_argument("--timed", type=positive_int, default=3, help="timed requests per bucket after 1 warm-up (default 3)")
    add_speculation_args(p)
    p.add_argument("--profile-steps", type=int, default=PROFILE_STEPS,
                   help="after timing, profile this many scheduler steps per bucket on each SGLang server, as `qflash profile` "
                        f"does, for the GPU busy time per cycle (default {PROFILE_STEPS}; 0: none)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="the profiles record each bucket's prefill and first cycles instead (time to first token)")
    p.add_argument("--profile-with-stack", action="store_true", help="the profiles also record Python call stacks")
    p.add_argument("--workloads", type=csv(str, tuple(workloads.RUNS)), default=[],
                   help=f"after the scoreboard, on each SGLang server: comma list from {','.join(workloads.RUNS)} "
                        "(multi-turn chat sharing prefixes; 1-16 requests in flight; 8-32), in the same results")
    p.add_argument("--replicas", type=positive_int, default=1,
                   help="with --workloads: also run them on N qflash replicas behind SGLang's router (the row `qflash "
                        "xN`), as `qflash serve --replicas N` serves (needs the scale extra)")
    p.add_argument("--share-gpus", action="store_true", help="with --replicas: as `qflash serve --share-gpus`")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    require_gpu()
    try:
        import matplotlib  # noqa: F401  the chart, checked before any server starts
    except ImportError:
        raise UserError("needs matplotlib for its chart: pip install 'qflash[bench]'", code=1) from None
    if args.replicas > 1:
        from qflash.server import replicas
        from qflash.server.launcher import gpu_count

        if not args.workloads:
            raise UserError("--replicas runs the workloads on the replicas: name them with --workloads")
        replicas.plan(args.replicas, replicas.visible_gpus(os.environ, gpu_count), args.share_gpus, PORT)
        replicas.require_router()
    return run_bench(args.systems, args.out, args.buckets, args.timed, args.acc_len, extra, profile_steps=args.profile_steps,
                     prefix_cache=args.prefix_cache, profile_with_stack=args.profile_with_stack,
                     profile_prefill=args.profile_prefill, workload_names=args.workloads, replicas=args.replicas,
                     share_gpus=args.share_gpus)
