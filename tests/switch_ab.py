"""An A/B of the test plugin's run-time switches on one server (a diagnostic: `tests/run_gpu.sh` SWITCH_AB=...).

One system of `qflash bench` is started once with the test plugin (tests/faults) and the cycle meter; the
protocol's requests (fresh random prompts, 256 greedy tokens, simulated acceptance) are then timed with each
switch in turn and without, in alternating order per round, so the sides share the machine, the server and its
warm state. The server runs windows of up to 8 cycles; each switch names a side: `one_cycle_per_step` (SGLang's
one cycle per scheduler step after each request's first decode step), `window_2`, `window_4` (at most that many),
`plan_stream_off` / `plan_stream_on`.
Writes ab.json and ab.md in --out.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_control import fault_env, injected  # noqa: E402

from qflash.server import window  # noqa: E402
from qflash.server.hooks.cycle_meter import ENV as METER  # noqa: E402
from qflash.server.tools.bench import host_info, metered, time_request  # noqa: E402
from qflash.server.tools.systems import ACCEPT_LEN, SGLANG_SYSTEMS, make_prompt, positive_csv, system_server  # noqa: E402


def run(system: str, switches: list[str], out: Path, buckets: list[int], rounds: int, flags: list[str]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    switch_file = out / "switch"
    sides = ["default", *switches]
    samples = []
    env = {**fault_env(switch_file), METER: "1", window.ENV: str(window.MAX_CYCLES)}  # the switches lower it
    with system_server(system, out / f"{system}.log", 30040, ACCEPT_LEN, env=env, flags=flags) as server:
        for bucket in buckets:  # warm-up
            time_request(server.base_url, make_prompt(bucket, 0))
        for r in range(rounds):
            for k, side in enumerate(sides if r % 2 == 0 else sides[::-1]):
                with injected(switch_file, side) if side != "default" else contextlib.nullcontext():
                    for bucket in buckets:  # a fresh prompt each: no side reads another's cached prefix
                        got = time_request(server.base_url, make_prompt(bucket, 1000 + 100 * r + 10 * sides.index(side)))
                        samples.append({"side": side, "bucket": bucket, "round": r, **got})
        time.sleep(1)
        return metered(samples, server.log())


def table(samples: list[dict]) -> str:
    lines = ["| side | bucket | median ms | TTFT ms | cycle ms | host ms / cycle | accept len | n |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side in dict.fromkeys(s["side"] for s in samples):
        for bucket in sorted({s["bucket"] for s in samples}):
            group = [s for s in samples if s["side"] == side and s["bucket"] == bucket]
            med = statistics.median
            cycle = med((s["latency_ms"] - s["ttft_ms"]) / s["verify_steps"] for s in group)
            hosts = [s["host_cycle_ms"] for s in group if s.get("host_cycle_ms") is not None]
            lines.append(f"| {side} | {bucket} | {med(s['latency_ms'] for s in group):.1f} | {med(s['ttft_ms'] for s in group):.1f} "
                         f"| {cycle:.2f} | {med(hosts) if hosts else float('nan'):.2f} "
                         f"| {statistics.fmean(s['accept_len'] for s in group):.2f} | {len(group)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=list(SGLANG_SYSTEMS), default="qflash")
    p.add_argument("--switches", type=lambda t: t.split(","), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--buckets", type=positive_csv, default=[64, 2048, 8192])
    p.add_argument("--rounds", type=int, default=4)
    args, flags = p.parse_known_args()
    samples = run(args.system, args.switches, args.out, args.buckets, args.rounds, flags)
    head = f"`tests/switch_ab.py {' '.join(sys.argv[1:])}`, host {host_info()}\n\n"
    (args.out / "ab.json").write_text(json.dumps({"host": host_info(), "argv": sys.argv[1:], "samples": samples}, indent=1))
    (args.out / "ab.md").write_text(head + table(samples))
    print(head + table(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
