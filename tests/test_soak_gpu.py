"""Load: 64 concurrent requests of mixed lengths and APIs through `./launch.sh` (GPU only).

Prompts of 64 to 8,192 tokens, one third each through `/generate`, `/v1/chat/completions` and its
streaming form, all sent at once (the server runs 8 at a time and queues the rest). Every request must
complete, and give the same greedy output as the same request run alone on an empty cache. Then clients
that hang up mid-stream must leave no request behind, and the next requests must still run. Prints
the throughput for BENCHMARKS.md. Real verification (SGLANG_SIMULATE_ACC_LEN unset); prefix caching on, as served by default.
"""

import concurrent.futures
import json
import random
import time

import pytest
import torch

from conftest import API, SERVED as BASE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "Qwen3.5-4B"
REQUESTS, NEW = 64, 32
LENGTHS = (64, 300, 1000, 2048, 4096, 8192)
APIS = ("native", "chat", "stream")


@pytest.fixture(scope="module")
def server(served):
    """`./launch.sh` with no arguments (conftest.served), prefix caching on."""
    return served


def plan() -> list[dict]:
    """REQUESTS requests: the lengths and APIs mixed, each prompt its own random tokens (or words, for chat)."""
    rng = random.Random("soak")
    out = []
    for i in range(REQUESTS):
        length, api = LENGTHS[i % len(LENGTHS)], APIS[i % len(APIS)]
        ids = [rng.randrange(1000, 200000) for _ in range(length)]
        # about two tokens per random three-letter word with the dummy's byte-level tokenizer
        words = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3)) for _ in range(length // 2))
        out.append({"api": api, "length": length, "ids": ids, "text": words})
    return out


def run(req: dict, max_tokens: int = NEW, timeout: float = 600) -> tuple[str | list[int], int]:
    """(output, completion tokens) of one request through its API."""
    if req["api"] == "native":
        body = {"input_ids": req["ids"], "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        r = API.post(BASE + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text[:500]
        return r.json()["output_ids"], r.json()["meta_info"]["completion_tokens"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": req["text"]}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    if req["api"] == "chat":
        r = API.post(BASE + "/v1/chat/completions", json=body, timeout=timeout)
        assert r.status_code == 200, r.text[:500]
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["completion_tokens"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, tokens = [], 0
    with API.post(BASE + "/v1/chat/completions", json=body, timeout=timeout, stream=True) as r:
        assert r.status_code == 200, r.text[:500]
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += [c["delta"].get("content") or "" for c in chunk["choices"]]
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return "".join(text), tokens


def running_requests() -> int:
    return sum(r["num_reqs"] for r in API.get(BASE + "/get_load", timeout=30).json())


def flush() -> None:
    assert API.post(BASE + "/flush_cache", timeout=60).status_code == 200


def test_64_concurrent_mixed_requests_all_complete_and_match_their_runs_alone(server):
    reqs = plan()
    run(reqs[0])  # warm-up
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        together = list(pool.map(run, reqs))
    wall = time.monotonic() - start
    tokens = sum(n for _, n in together)
    prompt_tokens = sum(r["length"] for r in reqs)
    print(f"\nsoak: {REQUESTS} concurrent requests (prompts {min(LENGTHS)}-{max(LENGTHS)} tokens, {prompt_tokens} in all; "
          f"native / chat / chat streaming), {tokens} completion tokens in {wall:.1f} s: {tokens / wall:.0f} output tokens/s, "
          f"{(tokens + prompt_tokens) / wall:.0f} tokens/s with prompts")
    assert [n for _, n in together] == [NEW] * REQUESTS
    alone = []
    for req in reqs:
        flush()
        alone.append(run(req))
    differ = [(i, r["api"], r["length"]) for i, (r, a, b) in enumerate(zip(reqs, together, alone)) if a[0] != b[0]]
    assert not differ, f"{len(differ)} of {REQUESTS} outputs differ from the same request alone: {differ[:8]}"


def test_clients_hanging_up_mid_stream_leave_no_request_behind(server):
    reqs = [r for r in plan() if r["api"] == "stream"][:8]

    def hang_up(req):
        body = {"model": MODEL, "messages": [{"role": "user", "content": req["text"]}], "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with API.post(BASE + "/v1/chat/completions", json=body, timeout=300, stream=True) as r:
            lines = r.iter_lines()
            for _ in range(4):  # a few chunks, then close the connection
                next(lines)

    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        list(pool.map(hang_up, reqs))
    deadline = time.monotonic() + 60
    while running_requests() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert running_requests() == 0, "requests of clients that hung up are still running"
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        after = list(pool.map(run, plan()[:16]))
    assert [n for _, n in after] == [NEW] * 16
