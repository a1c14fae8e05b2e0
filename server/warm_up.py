"""Start-up warm-up: before `qflash serve` says ready, it sends the requests that reach the kernel variants a user's
first requests would otherwise compile (a Triton kernel compiled on first use costs its request hundreds of ms).

CUDA graphs already hold every batch size's draft and verify and the prefill buckets; what runs eagerly and
specializes per shape is the rest: batches of fresh prefills (1 to MAX_RUNNING_REQUESTS of mixed lengths, each batch
then decoding together for whole windows of cycles, whose packing kernel and cycle graphs are made on first use),
requests that arrive one after another and join a batch already decoding (more than it can run, so some queue; of
odd lengths and different output lengths, so batches grow and shrink and KV slots are handed out at odd offsets:
traffic like this reached a variant of SGLang's slot-assignment kernel, which Triton specializes on its pointers'
alignment and the batch size, that batches sent at once had not), a prompt too short for a prefill graph (SGLang
runs it eagerly, and Triton specializes the GEMMs' row count on being 1 or divisible by 16, so 1 token and a few are
two variants), two prompts in one request, so that they are prefilled together in one whole chunk (SGLang's
Gated-DeltaNet prefill kernel has a variant for more than 128 of its 64-token chunks, which a prompt of its own
never reaches: it is chunked at the chunked-prefill size, 128 chunks; two requests sent at once were prefilled
apart), extends over a cached prefix (radix-cache hits at its 256-token checkpoints, by lengths with and without a
16-divisible remainder), a logprob request and a grammar's first compile. The last request carries DONE_RID, which
ends start-up in the server's compile watch (server/hooks/compile_watch.py); the radix cache is flushed after, so
the warm-up's prompts hold no cache memory.
"""

import concurrent.futures
import time
import urllib.error
from typing import Callable

from qflash.server import window
from qflash.server.preset import BLOCK_SIZE, CHUNKED_PREFILL_SIZE, MAX_RUNNING_REQUESTS

DONE_RID = "qflash-warm-up-done"
WARM_UP_LOG = "qflash: warm-up: {count} requests in {seconds:.1f} s"
# After a prefill's token and the first decode step's one cycle, room for a full window even when every cycle
# accepts the whole block, then a shorter one.
WINDOW_TOKENS = (window.MAX_CYCLES + 2) * BLOCK_SIZE
ARRIVAL_GAP_S = 0.02  # between the arrivals of a staggered round: each lands while the ones before it decode
# SGLang prefills eagerly what its smallest graph bucket (one block) would pad to more than twice its length.
SHORT_PROMPT_TOKENS = 5


def prompt(length: int, seed: int) -> list[int]:
    """Token ids every Qwen3.5 vocabulary holds, distinct per seed."""
    return [1000 + (seed * 7919 + i * 104729) % 100000 for i in range(length)]


def body(ids: list[int] | list[list[int]], tokens: int = 8, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, **extra}


def rounds() -> list[tuple[float, list[dict]]]:
    """Request bodies by round, with the gap between a round's arrivals: a round of gap 0 is sent at once, so it
    batches; the rounds run one after another."""
    plan = [(0.0, [body(prompt(20 + 37 * i + 100 * width, 10 * width + i), WINDOW_TOKENS) for i in range(width)])
            for width in range(1, MAX_RUNNING_REQUESTS + 1)]
    plan += [(ARRIVAL_GAP_S, [body(prompt(33 + 128 * i, 100 + i), WINDOW_TOKENS - 7 * i)
                              for i in range(2 * MAX_RUNNING_REQUESTS)])]
    cached = prompt(600, 1)
    plan += [(0.0, [body(cached)])] + [(0.0, [body(cached + prompt(extra, 2 + n))]) for n, extra in enumerate((16, 45, 300))]
    plan += [(0.0, [body(prompt(SHORT_PROMPT_TOKENS, 8))]),
             (0.0, [body([prompt(CHUNKED_PREFILL_SIZE // 2 + extra, 200 + extra) for extra in (31, 33)])]),
             (0.0, [body(prompt(100, 6), return_logprob=True, top_logprobs_num=2)]),
             (0.0, [{"text": "0", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "regex": "[0-9]{1,4}"}}]),
             (0.0, [body(prompt(16, 7), 1, rid=DONE_RID)])]
    return plan


def run(post: Callable[..., None]) -> str:
    """Send every round through `post(route, payload, timeout)` (the server's `ServerProcess.post`), flush the radix
    cache; the log line of what it took. A request the server refuses is named in the line (a warm-up that cannot
    warm everything still leaves a server that serves); one it cannot answer at all raises."""
    start, sent, refused = time.monotonic(), 0, []

    def generate(payload: dict) -> None:
        try:
            post("/generate", payload, timeout=600)
        except urllib.error.HTTPError as exc:
            refused.append(f"{exc.code} {exc.read().decode(errors='replace')[:200]}")

    def arrive(gap_s: float, order: int, payload: dict) -> None:
        time.sleep(gap_s * order)
        generate(payload)

    with concurrent.futures.ThreadPoolExecutor(2 * MAX_RUNNING_REQUESTS) as pool:
        for gap_s, batch in rounds():
            list(pool.map(arrive, [gap_s] * len(batch), range(len(batch)), batch))
            sent += len(batch)
    line = WARM_UP_LOG.format(count=sent, seconds=time.monotonic() - start)
    if refused:
        line += f"; warning: {len(refused)} refused, e.g. {refused[0]}"
    try:
        post("/flush_cache")
    except urllib.error.HTTPError as exc:  # the server serves on; its cache just keeps the warm-up's prompts
        line += f" (radix cache not flushed: {exc})"
    return line
