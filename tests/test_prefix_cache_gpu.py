"""Prefix caching with DFLASH on the hybrid model, and prompts prefilled together, end to end through `./launch.sh`
(GPU only).

The radix cache checkpoints the Gated-DeltaNet state every 256 tokens (`extra_buffer`); a checkpoint
passed during decoding is written by a verify step whose committed tokens cross it, which is what
sglang#37817 broke and server/hooks/radix_cache.py fixes. Each case decodes across such a boundary, then sends a
request extending that output: its cache hit includes the decode-written checkpoint, and its greedy
output must equal, token for token, the same request on an empty cache (computed as with the radix cache
off: a full prefill). Real verification (SGLANG_SIMULATE_ACC_LEN unset: acceptance decides where steps end).
A batch's prefill packs its prompts for flash attention (kernels/flash_prefill.py); a cache hit's extend stays on
SGLang's kernel.
"""

import concurrent.futures
import random

import pytest
import torch

from conftest import API, SERVED as BASE
from fault_control import injected

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

INTERVAL = 256  # SGLang's mamba_track_interval
NEW = 96  # tokens the first request decodes: enough verify steps to cross the next checkpoint
# prompt lengths just below a checkpoint, so decoding crosses 256, 1024 and 2048
PROMPTS = [250, 1000, 2040]


@pytest.fixture(scope="module")
def server(served):
    """`./launch.sh` (conftest.served): prefix caching is on by default."""
    return served


def generate(ids: list[int], new: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    r = API.post(BASE + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    return r.json()


def flush() -> None:
    r = API.post(BASE + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(f"prefix-{length}-{seed}")
    return [rng.randrange(1000, 200000) for _ in range(length)]


@pytest.mark.parametrize("length", [1000, 980])
def test_repeat_requests_reuse_the_cache_and_answer_alike(server, length):
    """980: the repeat's 20 new tokens sit within the stable checkpoint's reach (33 places back) of the checkpoint,
    so a wrong state there changes its answer (BENCHMARKS.md, 2026-12-04, twenty-sixth session)."""
    flush()
    ids = prompt(length, 0)
    first, again = generate(ids, 32), generate(ids, 32)
    assert first["meta_info"]["cached_tokens"] == 0
    # the prefill checkpointed the state at 960 (64-token chunks); a decode past 1024 checkpoints there too
    assert again["meta_info"]["cached_tokens"] >= 960, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]


def checkpoint_after(length: int) -> int:
    """The last checkpoint the first request's decoding crosses."""
    return (length + NEW) // INTERVAL * INTERVAL


def cached_and_fresh(length: int) -> tuple[dict, dict, dict]:
    """(first request, follow-up on the cache it left, the same follow-up on an empty cache)."""
    flush()
    ids = prompt(length, 1)
    first = generate(ids, NEW)
    boundary = checkpoint_after(length)
    assert length < boundary, "the first request must decode across a checkpoint"
    follow = ids + first["output_ids"][: boundary - length + 8] + prompt(24, 2)  # past the checkpoint, then new text
    cached = generate(follow, 48)
    flush()
    return first, cached, generate(follow, 48)


@pytest.mark.parametrize("length", PROMPTS)
def test_a_prefix_checkpointed_during_verify_gives_the_same_output_as_no_cache(server, length):
    first, cached, fresh = cached_and_fresh(length)
    meta = cached["meta_info"]
    print(f"\nprompt {length}: first request accept length {first['meta_info']['spec_accept_length']:.2f}; follow-up "
          f"{meta['prompt_tokens']} tokens, {meta['cached_tokens']} from the cache, {len(set(fresh['output_ids']))} distinct output ids")
    assert meta["cached_tokens"] >= checkpoint_after(length), meta  # the hit includes the checkpoint written by a verify step
    assert fresh["meta_info"]["cached_tokens"] == 0
    mismatch = next((i for i, (a, b) in enumerate(zip(cached["output_ids"], fresh["output_ids"])) if a != b), None)
    assert cached["output_ids"] == fresh["output_ids"], f"first difference at output token {mismatch}"


def test_the_check_catches_a_stale_checkpoint(server, fault_file):
    """With the checkpoint copy after verify skipped (tests/faults), some follow-up must differ from fresh."""
    with injected(fault_file, "stale_cache_checkpoint"):
        found = [cached_and_fresh(length) for length in PROMPTS]
    flush()
    assert any(cached["output_ids"] != fresh["output_ids"] for _, cached, fresh in found)


BATCH = [700, 64, 1500]  # prompts of one request: one prefill, its requests packed one after another


def together_and_alone() -> tuple[list, list]:
    """(each prompt's output when BATCH's prompts are prefilled together, each one's alone), on an empty cache."""
    prompts = [prompt(length, 3) for length in BATCH]
    flush()
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    r = API.post(BASE + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    alone = []
    for ids in prompts:
        flush()
        alone.append(generate(ids, 32)["output_ids"])
    return [out["output_ids"] for out in r.json()], alone


def test_prompts_prefilled_together_answer_as_each_alone(server):
    together, alone = together_and_alone()
    assert together == alone


def test_the_batch_check_catches_merged_requests(server, fault_file):
    """With the packed requests attended as one sequence (tests/faults), some prompt's output must differ."""
    with injected(fault_file, "prefill_requests_merged"):
        together, alone = together_and_alone()
    flush()
    assert together != alone


# Prompts past their prefill's checkpoint (the last 64-token chunk boundary) by a few tokens: over the cached prefix
# the batch's new tokens together stay within qflash's recurrent GDN prefill (kernels/gdn_prefill.py, MAX_TOKENS),
# or, 63 past, exceed it. With the prompts prefilled by a whole fresh-prompt graph (server/hooks/fresh_prefill.py,
# before `checkpointed`), the short tails of 1, 3 and 10 tokens answered otherwise alone and together (2026-12-04).
SHORT_TAILS = [10, 45, 3, 40, 41, 52, 1, 44]
LONG_TAILS = [63] * 8


def concurrently(prompts: list[list[int]], new: int) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate(ids, new)["output_ids"], prompts))


def mismatches(outputs: list[list[int]], reference: list[list[int]]) -> dict[int, int]:
    """{request: its first differing output position}."""
    return {i: next(k for k, (a, b) in enumerate(zip(out, ref)) if a != b)
            for i, (out, ref) in enumerate(zip(outputs, reference)) if out != ref}


@pytest.mark.parametrize("tails", [SHORT_TAILS, LONG_TAILS], ids=["short-tails", "long-tails"])
def test_requests_over_cached_prefixes_answer_alone_and_together_as_uncached(server, tails):
    """Each prompt on an empty cache is the reference; then, with the cache holding every prompt's checkpoint, each
    alone and all at once (one prefill batch of cache hits, then batched verify)."""
    prompts = [prompt(64 * (1 + i % 4) + tail, 4) for i, tail in enumerate(tails)]
    reference = []
    for ids in prompts:
        flush()
        reference.append(generate(ids, 64)["output_ids"])
    flush()
    for ids in prompts:
        generate(ids, 64)  # leaves each prompt's checkpoint in the cache
    alone = [generate(ids, 64) for ids in prompts]
    assert all(out["meta_info"]["cached_tokens"] > 0 for out in alone[1:]), [o["meta_info"] for o in alone]
    together = concurrently(prompts, 64)
    flush()
    fresh_together = concurrently(prompts, 64)
    flush()
    print(f"\n{len(prompts)} prompts over cached prefixes, first differing position by request: alone "
          f"{mismatches([o['output_ids'] for o in alone], reference)}, together {mismatches(together, reference)}; "
          f"fresh together {mismatches(fresh_together, reference)}")
    assert [o["output_ids"] for o in alone] == reference
    assert together == reference
    assert fresh_together == reference
