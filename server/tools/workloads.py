"""`qflash bench --workloads chat,concurrency`: traffic beside the scoreboard, on the same servers, in the same run.

- chat: conversations that share one system prompt and grow turn by turn; each turn's prompt is the previous
  prompt, its answer (the ids the server returned) and a new user message. Turns go in rounds over the
  conversations, so a cache must hold every conversation's history to hit. Kinds: the first turn (only the
  system prompt is shared) and the later turns (the whole history is).
- concurrency: prompts of mixed lengths with 1, 2, 4, 8 and 16 requests in flight. Kind: the concurrency.
- throughput: the same at 8, 16 and 32 in flight, past one server's 8 running requests (what replicas are for).
Per kind: p50 / p90 / max latency, p50 time to first token, and output tokens per second (for concurrency and
throughput, all of a level's tokens over its wall time, and requests per second; for chat, per request).
"""

import concurrent.futures
import random
import statistics
import time

from qflash.server.tools.systems import TOKEN_RANGE

CHAT_SYSTEM_LEN = 1024
CHAT_FIRST_USER_LENS = (64, 512, 2048, 4096)  # one conversation each: first prompts of 1,088 to 5,120 tokens
CHAT_USER_LEN, CHAT_TURNS = 128, 4  # the longest conversation's last prompt: 6,272 tokens
CONCURRENCY = (1, 2, 4, 8, 16)
THROUGHPUT = (8, 16, 32)
MIXED_LENGTHS = (64, 512, 2048, 8192)
ROUNDS = 2  # requests per level = concurrency x ROUNDS


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def run_chat(send) -> list[dict]:
    """`send(input_ids)` -> a timed sample with the answer's `output_ids`; one sample per turn, in sending order."""
    rng = random.Random("qflash-chat")
    system = _ids(rng, CHAT_SYSTEM_LEN)
    prompts = [system + _ids(rng, n) for n in CHAT_FIRST_USER_LENS]
    samples = []
    for turn in range(CHAT_TURNS):
        for c, prompt in enumerate(prompts):
            got = send(prompt)
            answer = got.pop("output_ids")
            samples.append({"workload": "chat", "kind": "first turn" if turn == 0 else "later turns",
                            "conversation": c, "turn": turn, "prompt_len": len(prompt), **got})
            prompts[c] = prompt + answer + _ids(rng, CHAT_USER_LEN)
    return samples


def run_concurrency(send, levels=CONCURRENCY, workload: str = "concurrency") -> list[dict]:
    """At each level, concurrency x ROUNDS requests of mixed lengths, that many in flight at once."""
    samples = []
    for level in levels:
        rng = random.Random(f"qflash-{workload}-{level}")
        prompts = [_ids(rng, MIXED_LENGTHS[i % len(MIXED_LENGTHS)]) for i in range(level * ROUNDS)]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(level) as pool:
            got = list(pool.map(send, prompts))
        wall_s = time.perf_counter() - start
        for prompt, sample in zip(prompts, got):
            sample.pop("output_ids")
            samples.append({"workload": workload, "kind": level, "prompt_len": len(prompt), "level_wall_s": wall_s,
                            **sample})
    return samples


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(samples: list[dict]) -> list[dict]:
    """One row per (system, workload, kind)."""
    groups: dict[tuple, list[dict]] = {}
    for s in samples:
        groups.setdefault((s["system"], s["workload"], s["kind"]), []).append(s)
    rows = []
    for (system, workload, kind), group in groups.items():
        lat = [s["latency_ms"] for s in group]
        tokens = sum(s["output_tokens"] for s in group)
        level_s = group[0].get("level_wall_s")  # concurrency and throughput: the level's wall time
        tokens_per_s = tokens / level_s if level_s else tokens / (sum(lat) / 1e3)
        cached = [s["cached_tokens"] for s in group if s.get("cached_tokens") is not None]
        p50 = statistics.median(lat)
        rows.append({
            "system": system, "workload": workload, "kind": kind, "n": len(group),
            "p50_ms": p50, "p90_ms": _percentile(lat, 0.9), "max_ms": max(lat),
            "ttft_p50_ms": statistics.median(s["ttft_ms"] for s in group), "output_tokens_per_s": tokens_per_s,
            "requests_per_s": len(group) / level_s if level_s else None,
            "cached_tokens": statistics.fmean(cached) if cached else None,
            "max_over_p50": max(lat) / p50,
        })
    order = {w: i for i, w in enumerate(RUNS)}  # a workload's kinds are all of one type: names or concurrencies
    return sorted(rows, key=lambda r: (order[r["workload"]], r["kind"], r["system"]))


def render_table(rows: list[dict]) -> str:
    """Markdown: the workloads' rows, systems side by side per kind."""
    if not rows:
        return ""
    out = ["", "| workload | kind | system | requests | p50 ms | p90 ms | max ms (x p50) | TTFT p50 ms | output tok/s "
               "| requests/s | cached tokens |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cached = "-" if r["cached_tokens"] is None else f"{r['cached_tokens']:.0f}"
        per_s = "-" if r.get("requests_per_s") is None else f"{r['requests_per_s']:.2f}"
        out.append(f"| {r['workload']} | {r['kind']} | {r['system']} | {r['n']} | {r['p50_ms']:.1f} "
                   f"| {r['p90_ms']:.1f} "
                   f"| {r['max_ms']:.1f} ({r['max_over_p50']:.2f}) | {r['ttft_p50_ms']:.1f} "
                   f"| {r['output_tokens_per_s']:.0f} | {per_s} | {cached} |")
    return "\n".join(out) + "\n"


def render_chart(rows: list[dict], path) -> None:
    """Bars: p50 latency per workload kind, one bar per system, the p90 as a tick above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    kinds = list(dict.fromkeys((r["workload"], r["kind"]) for r in rows))
    width = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, system in enumerate(systems):
        mine = {(r["workload"], r["kind"]): r for r in rows if r["system"] == system}
        xs = [i + (k - (len(systems) - 1) / 2) * width for i, kind in enumerate(kinds) if kind in mine]
        bars = ax.bar(xs, [mine[kind]["p50_ms"] for kind in kinds if kind in mine], width, label=system)
        ax.scatter(xs, [mine[kind]["p90_ms"] for kind in kinds if kind in mine], marker="_",
                   color=bars.patches[0].get_facecolor())
    ax.set_xticks(range(len(kinds)), [f"{w}: {kind}" for w, kind in kinds], rotation=20, fontsize=8)
    ax.set_ylabel("p50 latency, ms (tick: p90)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


RUNS = {"chat": run_chat, "concurrency": run_concurrency,  # `qflash bench --workloads` names, in report order
        "throughput": lambda send: run_concurrency(send, THROUGHPUT, "throughput")}
