"""`qflash bench`: requests, stream timing, statistics, table and chart, CLI errors (no GPU needed)."""

import contextlib
import json
import statistics
from types import SimpleNamespace

import orjson
import pytest

from conftest import REPO
from qflash.server.tools import bench, systems
from qflash.server.cli import main

RECORDED = json.loads((REPO / "tests" / "data" / "bench-run.json").read_text())


def test_stock_systems_run_without_prefix_caching_as_the_protocol_does(dummy_dirs):
    from qflash.server.launcher import sglang_argv

    for system, (extra, _) in systems.SGLANG_SYSTEMS.items():
        argv = sglang_argv(*dummy_dirs, extra, stock=system != "qflash", prefix_cache=True)
        assert ("--disable-radix-cache" in argv) == (system != "qflash"), system
        assert ("extra_buffer" in argv) == (system == "qflash"), system


def test_qflash_prefix_caching_in_the_bench_is_as_served_unless_turned_off():
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args(["--out", "x"]).prefix_cache is True  # what `qflash serve` runs
    assert p.parse_args(["--out", "x", "--no-prefix-cache"]).prefix_cache is False
    assert p.parse_args(["--out", "x", "--profile-with-stack"]).profile_with_stack is True
    assert p.parse_args(["--out", "x", "--profile-prefill"]).profile_prefill is True


def test_prompts_are_fresh_random_ids_in_range():
    a, b, c = systems.make_prompt(2048, 1), systems.make_prompt(2048, 2), systems.make_prompt(64, 1)
    assert len(a) == 2048 and len(c) == 64
    assert all(systems.TOKEN_RANGE[0] <= t < systems.TOKEN_RANGE[1] for t in a + c)
    assert a != b and a[:64] != c and systems.make_prompt(2048, 1) == a
    assert len(set(a)) > 1900


def test_plan_is_one_warmup_then_timed_per_bucket():
    plan = bench.request_plan([64, 2048], timed=3)
    assert [(r["bucket"], r["warmup"]) for r in plan] == [(64, True), (64, False), (64, False), (64, False),
                                                         (2048, True), (2048, False), (2048, False), (2048, False)]
    assert len({tuple(r["input_ids"]) for r in plan}) == len(plan)


def test_payload_is_greedy_256_tokens_ignoring_eos():
    payload = bench.generate_payload([5, 6])
    assert payload == {"input_ids": [5, 6], "stream": True,
                       "sampling_params": {"max_new_tokens": 256, "temperature": 0.0, "ignore_eos": True}}


def sse(*chunks):
    return [b"data: " + orjson.dumps(c) for c in chunks] + [b"", b"data: [DONE]"]


def test_stream_timing_reads_first_and_last_chunk():
    ticks = iter([1.10, 2.00])  # read at the first chunk and when the stream ends
    lines = sse({"text": "a", "meta_info": {"completion_tokens": 2}},
                {"text": "ab", "meta_info": {"completion_tokens": 7}},
                {"text": "abc", "meta_info": {"completion_tokens": 256, "spec_accept_length": 6.4, "spec_verify_ct": 40}})
    got = bench.read_stream(lines, start=1.0, clock=lambda: next(ticks))
    assert got["ttft_ms"] == pytest.approx(100.0) and got["latency_ms"] == pytest.approx(1000.0)
    assert (got["output_tokens"], got["accept_len"], got["verify_steps"]) == (256, 6.4, 40)
    assert got["first_chunk_tokens"] == 2  # the prefill's token and one more arrived together


def test_stream_errors_are_raised():
    with pytest.raises(RuntimeError, match="too long"):
        bench.read_stream(sse({"error": {"message": "too long"}}), start=0.0)
    with pytest.raises(RuntimeError, match="empty"):
        bench.read_stream([b"data: [DONE]"], start=0.0)


@pytest.fixture(scope="module")
def rows():
    return bench.summarize(RECORDED["samples"])


def row(rows, system, bucket):
    return next(r for r in rows if r["system"] == system and r["bucket"] == bucket)


def test_statistics_from_a_recorded_run(rows):
    r = row(rows, "sglang-bf16", 64)
    assert (r["median_ms"], r["min_ms"], r["max_ms"], r["n"]) == (273, 270, 280, 3)  # the warm-up is left out
    assert r["cycle_ms"] == pytest.approx((273 - 25.0) / 40)
    assert r["speedup_vs_baseline"] == pytest.approx(10665 / 273)
    q = row(rows, "qflash", 64)
    assert q["speedup_vs_sglang_bf16"] == pytest.approx(273 / 130)
    base = row(rows, "baseline", 2048)
    assert base["accept_len"] is None and base["valid"] and base["cycle_ms"] == pytest.approx((10706 - 40.0) / 255)
    assert [r["system"] for r in rows] == ["baseline"] * 2 + ["sglang-bf16"] * 2 + ["qflash"] * 2


def test_acceptance_outside_the_protocol_window_is_invalid(rows):
    assert row(rows, "qflash", 64)["valid"] and row(rows, "sglang-bf16", 2048)["valid"]
    assert not row(rows, "qflash", 2048)["valid"]
    table = bench.render_table(rows, {})
    assert "1.00 INVALID" in table and "qflash (INVALID: accept length outside 6.2-6.8)" in table


def test_table_has_the_scoreboard_and_failures(rows):
    table = bench.render_table(rows, {"sglang-w8a8": "server exited with code 1"})
    line = next(l for l in table.splitlines() if l.startswith("| sglang-bf16 |") and "speedup" not in l and l.count("|") == 6)
    mean = statistics.fmean([10665 / 273, 10706 / 384])
    assert line == f"| sglang-bf16 | 273.0 | 384.0 | {mean:.1f}x | 1.00x |"
    assert "| sglang-w8a8 | failed: server exited with code 1 |" in table


def test_samples_take_their_requests_cycle_meter_lines():
    from qflash.server.hooks.cycle_meter import LINE

    log = "\n".join(["INFO something", LINE.format(rid="a1", steps=10, cycles=40, loop=180.0, wait=120.0,
                                                    stages="run_batch:40.000,graph_launch:20.000"),
                     LINE.format(rid="b2", steps=39, cycles=39, loop=273.0, wait=39.0, stages="")])
    got = bench.metered([{"rid": "b2", "x": 1}, {"rid": "a1"}, {"rid": "c3"}, {}], log)
    assert got[0] == {"rid": "b2", "x": 1, "meter_cycles": 39, "loop_cycle_ms": pytest.approx(7.0),
                      "host_cycle_ms": pytest.approx(6.0), "host_stages_ms": {}}
    assert (got[1]["meter_cycles"], got[1]["loop_cycle_ms"], got[1]["host_cycle_ms"]) == (40, 4.5, 1.5)
    assert got[1]["host_stages_ms"] == {"run_batch": pytest.approx(1.0), "graph_launch": pytest.approx(0.5)}
    assert got[2]["host_cycle_ms"] is None and got[3]["host_cycle_ms"] is None  # no line: not metered


def test_the_cycle_meter_sums_a_requests_steps_and_their_stages_from_its_second_step():
    from types import SimpleNamespace

    from qflash.server.hooks.cycle_meter import PATTERN, Meter, host_ms_per_cycle

    done = [False]
    req = SimpleNamespace(rid="r1", finished=lambda: done[0])
    meter = Meter()
    meter.add("run_batch", 0.001)
    assert meter.step([req], 4, start=0.0, waited=0.0) == []  # its first step: not counted, nor its stages
    meter.add("run_batch", 0.002)
    assert meter.step([req], 4, start=0.010, waited=0.004) == []
    done[0] = True
    meter.add("run_batch", 0.003)
    meter.add("graph_launch", 0.001)
    [line] = meter.step([req], 4, start=0.030, waited=0.001)
    cycles, loop, host, stages = host_ms_per_cycle(PATTERN.search(line))
    assert (cycles, loop, host) == (8, pytest.approx(30 / 8), pytest.approx(25 / 8))
    assert stages == {"run_batch": pytest.approx(5 / 8), "graph_launch": pytest.approx(1 / 8)}


def test_host_time_by_stage_is_the_median_per_stage_with_what_the_stages_leave_out():
    def sample(host, run_batch, draft):
        return {"system": "qflash", "bucket": 64, "warmup": False, "latency_ms": 290.0, "ttft_ms": 50.0,
                "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40, "host_cycle_ms": host,
                "host_stages_ms": {"run_batch": run_batch, "draft_forward": draft, "graph_launch": 0.3}}

    q = row(bench.summarize([sample(3.0, 2.0, 1.0), sample(4.0, 2.5, 1.0), sample(5.0, 3.5, 1.5)]), "qflash", 64)
    assert q["host_stages_ms"] == {"run_batch": 2.5, "draft_forward": 1.0, "graph_launch": 0.3,
                                   "scheduler": pytest.approx(1.5), "worker_rest": pytest.approx(1.5)}
    table = bench.render_table([q], {})
    assert "| qflash | 64 | 4.00 | 2.50 | 1.00 | 0.30 | 1.50 | 1.50 |" in table
    assert "Host ms per cycle by stage" not in bench.render_table([{**q, "host_stages_ms": None}], {})


def test_rows_put_the_gpu_time_per_cycle_beside_the_wall_time_and_mark_host_bound_ones():
    def sample(system, bucket, host):
        return {"system": system, "bucket": bucket, "warmup": False, "latency_ms": 290.0, "ttft_ms": 50.0,
                "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40, "host_cycle_ms": host}

    samples = [sample("qflash", 64, 2.0), sample("qflash", 64, 4.0), sample("qflash", 64, 3.0), sample("sglang-bf16", 64, None)]
    rows = bench.summarize(samples, gpu_cycle_ms={"qflash": {"64": 5.5}, "sglang-bf16": {"64": 6.2}})
    q, stock = row(rows, "qflash", 64), row(rows, "sglang-bf16", 64)
    assert q["cycle_ms"] == pytest.approx(6.0) and q["gpu_cycle_ms"] == 5.5 and q["host_cycle_ms"] == 3.0
    assert q["host_bound"] is False and stock["host_bound"] is False  # 6.0 <= 1.15 x 5.5
    q2 = row(bench.summarize(samples, gpu_cycle_ms={"qflash": {"64": 5.0}}), "qflash", 64)
    assert q2["host_bound"] is True  # 6.0 > 1.15 x 5.0
    assert row(bench.summarize(samples), "qflash", 64)["host_bound"] is None  # not profiled
    table = bench.render_table(bench.summarize(samples, gpu_cycle_ms={"qflash": {"64": 5.0}}), {})
    assert "| 6.00 host-bound | 5.00 | 3.00 |" in table and "| 6.00 | - | - |" in table


def test_chart_is_a_png(rows, tmp_path):
    bench.render_chart(rows, tmp_path / "latency.png")
    data = (tmp_path / "latency.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("args, message", [
    (["--systems", "baseline,vllm", "--out", "x"], "choose from baseline, sglang-bf16, sglang-w8a8, qflash"),
    (["--systems", "qflash"], "the following arguments are required: --out"),
    (["--out", "x", "--timed", "0"], "must be at least 1"),
    (["--out", "x", "--buckets", "64,-5"], "bucket sizes must be positive"),
])
def test_cli_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_bench_does_not_know_go_to_the_sglang_servers():
    from qflash.server.cli import parser

    args, extra = parser("bench").parse_known_args(["bench", "--out", "x", "--systems", "qflash", "--speculative-attention-mode", "decode"])
    assert args.passthrough and extra == ["--speculative-attention-mode", "decode"]
    assert args.profile_steps == bench.PROFILE_STEPS > 0  # every run records the GPU busy time per cycle
    assert parser("bench").parse_args(["bench", "--out", "x", "--profile-steps", "0"]).profile_steps == 0


def test_committed_h200_run_re_renders_from_its_samples():
    run = json.loads((REPO / "benchmarks" / "2026-11-30-h200.json").read_text())
    rows = bench.summarize(run["samples"])
    assert [{k: r[k] for k in recorded} for r, recorded in zip(rows, run["rows"])] == run["rows"]  # it predates the GPU columns
    assert all(r["valid"] for r in rows) and {r["system"] for r in rows} == set(bench.SYSTEMS)
    table = bench.render_table(rows, run["errors"])
    assert "| qflash | 270.9 | 384.6 | 752.7 | 27.3x | 1.02x |" in table


def test_a_bench_stopped_while_it_profiles_keeps_its_timed_rows(tmp_path, monkeypatch):
    # A GPU run's `timeout` stopped a bench while it profiled qflash, after its timed requests: their rows
    # were lost. The servers and requests are stand-ins here; what is checked is what the bench writes.
    @contextlib.contextmanager
    def server(system, *args, **kwargs):
        yield SimpleNamespace(base_url=f"http://{system}", log=lambda: "")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # what the bench makes of SIGTERM (launcher.unwind_on_sigterm)

    sample = {"latency_ms": 300.0, "ttft_ms": 50.0, "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40}
    monkeypatch.setattr(bench, "system_server", server)
    monkeypatch.setattr(bench, "time_request", lambda url, ids: dict(sample))
    monkeypatch.setattr("qflash.server.tools.profile.profile_buckets", stopped)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(["sglang-bf16", "qflash"], tmp_path, [64], timed=2, acc_len=6.5, profile_steps=8)
    run = json.loads((tmp_path / "run.json").read_text())
    assert [(s["system"], s["warmup"]) for s in run["samples"]] == [("sglang-bf16", True), ("sglang-bf16", False),
                                                                    ("sglang-bf16", False)]
    assert "| sglang-bf16 | 64 | 300.0 |" in (tmp_path / "results.md").read_text()
    host = run["host"]  # the host's speed goes with every run (the lent machines differ)
    assert host["python_probe_ms"] > 0 and host["cores"] >= 1
    assert f"(host: {host['cpu']}, {host['cores']} cores, Python probe {host['python_probe_ms']} ms)" in (tmp_path / "results.md").read_text()


def test_the_results_say_what_each_server_compiled_while_serving(tmp_path, monkeypatch):
    """A Triton compile after ready makes a user's request wait: each qflash run says how many and of which kernels
    (read from the lines of server/hooks/compile_watch.py; a stock server's log has none and is left out)."""
    from qflash.server.hooks.compile_watch import STARTUP, WHILE_SERVING

    logs = {"sglang-bf16": "[t] The server is fired up and ready to roll!\n",
            "qflash": "\n".join([STARTUP.format(count=112, seconds=1.2)] + [
                WHILE_SERVING.format(name=name, ms=2, count=n, variant="v") for n, name in
                enumerate(["qflash.kernels.window_pack._pack_cycle_kernel"] * 2 + ["sglang.srt.x.k"], 1)])}

    @contextlib.contextmanager
    def server(system, log_path, *args, **kwargs):
        log_path.write_text(logs[system])
        yield SimpleNamespace(base_url=f"http://{system}", log=lambda: logs[system])

    sample = {"latency_ms": 300.0, "ttft_ms": 50.0, "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40}
    monkeypatch.setattr(bench, "system_server", server)
    monkeypatch.setattr(bench, "time_request", lambda url, ids: dict(sample))
    assert bench.run_bench(["sglang-bf16", "qflash"], tmp_path, [64], timed=1, acc_len=6.5, profile_steps=0) == 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["compiles_while_serving"] == {"sglang-bf16": None, "qflash": [
        "qflash.kernels.window_pack._pack_cycle_kernel", "qflash.kernels.window_pack._pack_cycle_kernel", "sglang.srt.x.k"]}
    assert ("Triton compiles while serving (server/hooks/compile_watch.py): qflash 3 "
            "(qflash.kernels.window_pack._pack_cycle_kernel, sglang.srt.x.k)\n") in (tmp_path / "results.md").read_text()


def test_host_info_names_the_cpu_of_proc_cpuinfo():
    import os
    import re

    cpuinfo = open("/proc/cpuinfo").read()
    assert bench.host_info()["cpu"] == re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M).group(1).strip()
    assert bench.host_info()["cores"] == os.cpu_count()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown on a machine without a GPU")
@pytest.mark.parametrize("command", [["bench", "--systems", "qflash"], ["profile"], ["bench-kernels"], ["tune"]])
def test_gpu_commands_say_there_is_no_gpu_before_starting_or_writing_anything(command, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [*command, "--out", str(out)] if command[0] != "tune" else command
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qflash {command[0]}: no CUDA GPU is visible; qflash serves on an NVIDIA GPU (sm80 or newer)"]
    assert not out.exists()
