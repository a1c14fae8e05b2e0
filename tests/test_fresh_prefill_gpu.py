"""A fresh prompt's prefill as one CUDA graph (graphs/fresh_prefill.py) prefills what SGLang's breakable graph
prefills (GPU only).

On the shared `./launch.sh` server (conftest.served: the stable-choice checkpoint, real verification, prefix
caching on). Its reference is the same server with the whole graphs off, switched at run time through the test
plugin (`fresh_prefill_off`: the breakable graph replays, its GDN and attention layers eager):
- prompts of 5 to 2,040 tokens (inside buckets and on their edges, on both GDN paths: the recurrent kernel up to
  256 tokens, FLA's chunks above): the same tokens, and the prompt's logprobs at every position within a small
  tolerance (every layer's output reaches them);
- the radix cache's checkpoint a whole graph writes during the prefill: a longer prompt that hits it decodes what
  it decodes on an empty cache;
- the server log says the buckets were captured whole, and none failed.
Times to first token of both sides are printed (a diagnostic: speed is the bench's).
"""

import time

import pytest
import torch

from conftest import API, SERVED as BASE, served_log
from fault_control import injected
from test_prefix_cache_gpu import flush, prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [5, 37, 64, 100, 250, 256, 300, 1000, 2040]
NEW = 48


def generate(ids: list[int], new: int = NEW, logprobs: bool = False) -> dict:
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": logprobs, "logprob_start_len": 0}
    r = API.post(BASE + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    return r.json()


def first_token_ms(ids: list[int]) -> float:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    assert API.post(BASE + "/generate", json=body, timeout=300).status_code == 200
    return (time.perf_counter() - start) * 1e3


def side() -> dict:
    out = {}
    for n in LENGTHS:
        flush()  # nothing cached: every prompt is a fresh one
        out[n] = generate(prompt(n, 7), logprobs=True)
    return out


def test_a_whole_graph_prefills_what_the_breakable_graph_prefills(served, fault_file):
    whole = side()
    with injected(fault_file, "fresh_prefill_off"):
        breakable = side()
    for n in LENGTHS:
        a, b = whole[n], breakable[n]
        assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == NEW, n
        la = [x[0] for x in a["meta_info"]["input_token_logprobs"][1:]]
        lb = [x[0] for x in b["meta_info"]["input_token_logprobs"][1:]]
        worst = max(abs(x - y) for x, y in zip(la, lb))
        print(f"\n{n} tokens: same {NEW} tokens, prompt logprobs within {worst:.4f} over {len(la)} positions")
        assert len(la) == len(lb) == n - 1 and worst < 0.05, n
    log = served_log()
    assert "qflash graphs: a fresh prompt's prefill captured whole for bucket 2048" in log
    assert "qflash graphs: a fresh prompt's prefill captured whole for bucket 16 " in log
    assert "cannot be captured whole" not in log
    for bucket in (16, 48, 64, 112, 256, 320, 1024, 2048):  # LENGTHS' buckets: each has been replayed whole
        assert f"qflash graphs: a fresh prompt's prefill replayed whole for bucket {bucket}\n" in log, bucket


@pytest.mark.parametrize("tail", [1, 10, 40])
@pytest.mark.parametrize("length", [100, 250, 1000, 2000])
def test_the_checkpoint_a_whole_graph_writes_serves_a_later_prompt(served, length, tail):
    """Short continuations too: on the stable checkpoint a stale state showed only within ~32 tokens of it
    (BENCHMARKS.md, 2026-12-04, twenty-sixth session)."""
    ids = prompt(length, 8)
    flush()
    generate(ids, 8)  # a fresh prompt: its prefill checkpoints the state at its last 64-token chunk boundary
    follow = ids + prompt(tail, 9)
    cached = generate(follow)
    flush()
    fresh = generate(follow)
    print(f"\n{length} tokens, then {length + tail}: {cached['meta_info']['cached_tokens']} cached")
    assert cached["meta_info"]["cached_tokens"] >= length // 64 * 64
    assert cached["output_ids"] == fresh["output_ids"]


def test_times_to_first_token_with_and_without_the_whole_graphs(served, fault_file):
    """A diagnostic on one server: the median of 5 one-token requests per length and side."""
    def median_ms(n: int) -> float:
        times = []
        for i in range(6):
            flush()
            times.append(first_token_ms(prompt(n, 20 + i)))
        return sorted(times[1:])[2]

    whole = {n: median_ms(n) for n in (64, 2040)}
    with injected(fault_file, "fresh_prefill_off"):
        breakable = {n: median_ms(n) for n in (64, 2040)}
    for n in whole:
        print(f"\nfirst token of {n} tokens: whole graph {whole[n]:.1f} ms, breakable graph {breakable[n]:.1f} ms")
