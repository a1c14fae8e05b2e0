"""`qflash bench --workloads`: the chat and concurrency traffic, their statistics, and how the bench runs them
(servers and requests are stand-ins; the H200 run is in BENCHMARKS.md)."""

import contextlib
import json
import threading
from types import SimpleNamespace

import orjson
import pytest

from qflash.server.cli import main
from qflash.server.preset import MAX_RUNNING_REQUESTS
from qflash.server.tools import bench, workloads


def answer(ids, n=3):
    return {"latency_ms": 100.0 + len(ids) / 100, "ttft_ms": 20.0, "output_tokens": n, "cached_tokens": 0,
            "output_ids": [7] * n}


def test_each_chat_turn_extends_its_conversation_by_the_answer_and_a_user_message():
    sent = []

    def send(ids):
        sent.append(list(ids))
        return answer(ids, n=len(sent))  # answers of different lengths: the next prompt must carry this one

    samples = workloads.run_chat(send)
    convs = len(workloads.CHAT_FIRST_USER_LENS)
    assert len(sent) == convs * workloads.CHAT_TURNS
    system = sent[0][:workloads.CHAT_SYSTEM_LEN]
    assert all(p[:workloads.CHAT_SYSTEM_LEN] == system for p in sent)  # one system prompt for all
    for i in range(convs, len(sent)):  # rounds over the conversations: turn t of c follows turn t-1 of c
        before, answer_len = sent[i - convs], i - convs + 1
        assert sent[i][:len(before)] == before and sent[i][len(before):len(before) + answer_len] == [7] * answer_len
        assert len(sent[i]) == len(before) + answer_len + workloads.CHAT_USER_LEN
    assert max(map(len, sent)) <= 8192
    assert [s["kind"] for s in samples] == ["first turn"] * convs + ["later turns"] * (len(sent) - convs)
    assert "output_ids" not in samples[0] and samples[-1]["prompt_len"] == len(sent[-1])


def test_the_concurrency_sweep_keeps_each_level_in_flight():
    """Each level's requests wait at a barrier of that many parties: it only opens with all of them in flight (a
    pool of fewer threads breaks it at the timeout), and a counter shows no more than that many at once."""
    lock, in_flight, peak = threading.Lock(), [0], [0]
    for level in (1, 4):
        barrier = threading.Barrier(level, timeout=30)

        def send(ids):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            barrier.wait()
            with lock:
                in_flight[0] -= 1
            return answer(ids)

        samples = workloads.run_concurrency(send, levels=(level,))
        assert [s["kind"] for s in samples] == [level] * level * workloads.ROUNDS and peak[0] == level
    assert {s["prompt_len"] for s in samples} == set(workloads.MIXED_LENGTHS)


def test_rows_give_percentiles_ttft_and_tokens_per_second():
    samples = [{"system": "qflash", "workload": "concurrency", "kind": 2, "latency_ms": ms, "ttft_ms": 10.0 * i,
                "output_tokens": 256, "cached_tokens": 0, "level_wall_s": 2.0}
               for i, ms in enumerate([100, 200, 300, 1000])]
    samples += [{"system": "qflash", "workload": "chat", "kind": "later turns", "latency_ms": 500.0, "ttft_ms": 40.0,
                 "output_tokens": 256, "cached_tokens": 2000}] * 2
    rows = workloads.summarize(samples)
    chat, conc = rows
    assert (chat["workload"], conc["workload"]) == ("chat", "concurrency")  # report order
    assert (conc["p50_ms"], conc["p90_ms"], conc["max_ms"], conc["ttft_p50_ms"]) == (250.0, 1000, 1000, 15.0)
    assert conc["output_tokens_per_s"] == 4 * 256 / 2.0  # the level's tokens over its wall time
    assert chat["output_tokens_per_s"] == pytest.approx(512 / 1.0) and chat["cached_tokens"] == 2000
    assert conc["max_over_p50"] == 4.0
    table = workloads.render_table(rows)
    assert conc["requests_per_s"] == 2.0 and chat["requests_per_s"] is None
    assert "| concurrency | 2 | qflash | 4 | 250.0 | 1000.0 | 1000.0 (4.00) | 15.0 | 512 | 2.00 | 0 |" in table
    assert "| chat | later turns | qflash | 2 | 500.0 | 500.0 | 500.0 (1.00) | 40.0 | 512 | - | 2000 |" in table


def test_the_stream_gives_the_answers_ids_from_its_last_chunk():
    lines = [b"data: " + orjson.dumps(c) for c in (
        {"output_ids": [1], "meta_info": {"completion_tokens": 1, "cached_tokens": 30}},
        {"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3, "cached_tokens": 30}})] + [b"data: [DONE]"]
    got = bench.read_stream(lines, start=0.0, with_ids=True)
    assert got["output_ids"] == [1, 2, 3] and got["cached_tokens"] == 30
    assert "output_ids" not in bench.read_stream(lines, start=0.0)  # the scoreboard's samples stay small


def test_the_bench_runs_the_workloads_on_each_sglang_server_into_the_same_results(tmp_path, monkeypatch):
    @contextlib.contextmanager
    def server(system, *args, **kwargs):
        yield SimpleNamespace(base_url=f"http://{system}", log=lambda: "")

    sample = {"latency_ms": 300.0, "ttft_ms": 50.0, "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40}
    monkeypatch.setattr(bench, "system_server", server)
    monkeypatch.setattr(bench, "time_request", lambda url, ids, with_ids=False: {**sample, "output_ids": [5] * 4})
    original = workloads.RUNS["concurrency"]
    monkeypatch.setitem(workloads.RUNS, "concurrency", lambda send: original(send, levels=(1, 2)))
    assert bench.run_bench(["sglang-bf16", "qflash"], tmp_path, [64], timed=1, acc_len=6.5,
                           workload_names=["chat", "concurrency"]) == 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["workloads"] == ["chat", "concurrency"]
    per_system = {s: [w for w in run["workload_samples"] if w["system"] == s] for s in ("sglang-bf16", "qflash")}
    assert all(len(got) == 16 + 2 * (1 + 2) for got in per_system.values())
    md = (tmp_path / "results.md").read_text()
    assert "| chat | later turns | qflash | 12 |" in md and "| concurrency | 2 | sglang-bf16 | 4 |" in md
    assert (tmp_path / "workloads.png").read_bytes()[:4] == b"\x89PNG"


def test_the_throughput_workload_goes_past_one_server_s_running_requests():
    samples = workloads.RUNS["throughput"](answer)
    assert sorted({s["kind"] for s in samples}) == list(workloads.THROUGHPUT)
    assert {s["workload"] for s in samples} == {"throughput"} and max(workloads.THROUGHPUT) > MAX_RUNNING_REQUESTS


def test_the_bench_runs_the_workloads_on_replicas_as_their_own_row(tmp_path, monkeypatch):
    @contextlib.contextmanager
    def server(system, *args, **kwargs):
        yield SimpleNamespace(base_url=f"http://{system}", log=lambda: "")

    @contextlib.contextmanager
    def replicas(count, share_gpus, *args):
        started.append((count, share_gpus))
        yield SimpleNamespace(base_url="http://router")

    started, sent = [], []
    sample = {"latency_ms": 300.0, "ttft_ms": 50.0, "output_tokens": 256, "accept_len": 6.5, "verify_steps": 40}

    def time_request(url, ids, with_ids=False):
        sent.append(url)
        return {**sample, "output_ids": [5] * 4}

    monkeypatch.setattr(bench, "system_server", server)
    monkeypatch.setattr(bench, "replicas_server", replicas)
    monkeypatch.setattr(bench, "time_request", time_request)
    monkeypatch.setitem(workloads.RUNS, "throughput",
                        lambda send: workloads.run_concurrency(send, (2,), "throughput"))
    assert bench.run_bench(["qflash"], tmp_path, [64], timed=1, acc_len=6.5, workload_names=["throughput"],
                           replicas=2, share_gpus=True) == 0
    assert started == [(2, True)] and sent.count("http://router") == 2 * workloads.ROUNDS
    md = (tmp_path / "results.md").read_text()
    assert "| throughput | 2 | qflash | 4 |" in md and "| throughput | 2 | qflash x2 | 4 |" in md


def test_replicas_in_the_bench_need_workloads(capsys, monkeypatch):
    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    assert main(["bench", "--out", "x", "--replicas", "2"]) == 2
    assert capsys.readouterr().err == "qflash bench: --replicas runs the workloads on the replicas: name them with --workloads\n"


def test_an_unknown_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--out", "x", "--workloads", "chat,soak"])
    assert exit_info.value.code == 2 and "choose from chat, concurrency" in capsys.readouterr().err
