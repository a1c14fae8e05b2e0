"""Several DFLASH cycles per scheduler step (server/window.py): what SGLang's worker and scheduler must do for it.

- the worker's step runs a planned window of cycles instead of one (`forward_batch_generation`), each through its
  CUDA graph where it has one (server/hooks/cycle_graphs.py). The first decode step after a prefill runs one
  cycle: the scheduler streams the prefill's token once it has launched the next step, so a window there would
  hold the first token back by the host time of the whole window's launch. That cycle too replays its graph: run
  as SGLang's (its draft and verify forwards each building their batch and metadata, the glue between them
  eager) its launch held the first token back by several ms, and the GPU idled between its forwards. Other steps
  planned to one cycle (a request's last, the test plugin's `one_cycle_per_step` reference) run SGLang's own;
- KV slots: SGLang reserves each request's `committed + 2 x 16` slots ahead of the decode step (the step in flight,
  whose commits the host has not seen, and the next), inline in `DFlashDraftInputV2.prepare_for_decode`. A window
  needs `committed + 16 x (cycles in flight + cycles next)`: the window is planned there, and SGLang's reservation
  runs with each request's committed length raised by the difference for the call (the only use it makes of it
  besides the lengths it seeds, which are set back). Unused slots stay with the request, as SGLang's do, and are
  freed when it finishes;
- the memory check before a decode step (`get_alloc_reserve_per_decode`) and the request rows of `req_to_token`
  (`get_req_to_token_extra_context_len`, read when the pools are built) grow by the same reserve;
- a window's result counts as one verify in `_resolve_spec_v2_tokens`: the requests' verify counts (from which
  `meta_info.spec_accept_length` is computed), their correct-draft counts and the verify count behind the server
  log's accept length get the window's other cycles.
Retire when SGLang's speculative worker runs several cycles per step (its spec-v2 DFLASH work removes the host
syncs between draft and verify, but 0.5.17 has no multi-cycle step).
"""

import functools

from qflash.server import window
from qflash.server.hooks import Hook, cycle_graphs


def _window_step(original, self, batch, on_publish=None, grammar_barrier=None):
    cycles = getattr(batch.spec_info, window.PLANNED, 1)
    mode = batch.forward_mode
    if mode.is_extend() or mode.is_idle() or batch.is_extend_in_batch:
        return original(self, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
    after_prefill = getattr(batch.spec_info, window.IN_FLIGHT, None) is None  # what the last step left on its input
    if window.needs_host_between_cycles(batch) or cycles <= 1 and not after_prefill:
        result = original(self, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        setattr(result.next_draft_input, window.IN_FLIGHT, 1)  # a decode step in flight, not a prefill
        return result
    cycle = functools.partial(cycle_graphs.run_cycle, original)  # each cycle one graph replay, where it can be
    return window.run_window(cycle, self, batch, cycles, on_publish=on_publish, grammar_barrier=grammar_barrier)


def _reserve_for_the_window(original, self, batch):
    from sglang.srt.runtime_context import get_spec

    block = int(get_spec().speculative_num_draft_tokens)
    in_flight = getattr(self, window.IN_FLIGHT, None)  # None: a prefill's draft input
    if in_flight is None or window.needs_host_between_cycles(batch):
        cycles, in_flight = 1, 1
    else:
        cycles = window.plan_cycles(batch.reqs, limit=window.configured_cycles(), in_flight=in_flight, block=block,
                                    context_len=batch.model_config.context_len)
    setattr(self, window.PLANNED, cycles)
    extra = block * (in_flight + cycles - 2)  # beyond SGLang's committed + 2 blocks
    if extra <= 0 or not batch.reqs:
        return original(self, batch)
    for req in batch.reqs:
        req.kv_committed_len += extra
    try:
        original(self, batch)
    finally:
        for req in batch.reqs:
            req.kv_committed_len -= extra
    batch.seq_lens_cpu -= extra  # the committed lengths it seeded
    batch.seq_lens_sum -= extra * len(batch.reqs)


def window_reserve(block: int) -> int:
    """KV slots a decode step may reserve beyond a request's committed length: a full window in flight and the next."""
    return 2 * window.configured_cycles() * block


def _reserve_per_decode(original, server_args=None):
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_len_per_decode

    return max(original(server_args), window_reserve(get_alloc_len_per_decode(server_args)))


def _row_headroom(original, server_args):
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_len_per_decode

    block = get_alloc_len_per_decode(server_args)
    return original(server_args) + window_reserve(block) - 2 * block


def _count_each_cycle(original, self, result, batch):
    tokens = original(self, result, batch)
    extra = getattr(result, window.CYCLES, 1) - 1
    if extra:
        for req in batch.reqs:
            if not (req.is_retracted or req.finished()):
                req.spec_verify_ct += extra
                req.spec_num_correct_drafts -= extra
        self.metrics_reporter.spec_num_forward_ct += extra * len(batch.reqs)  # the log's accept length, per cycle
    return tokens


SIZING = "sglang.srt.mem_cache.allocation_sizing."
CHANGES = [
    Hook("sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation", _window_step, "AROUND"),
    Hook("sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode", _reserve_for_the_window, "AROUND"),
    Hook(SIZING + "get_alloc_reserve_per_decode", _reserve_per_decode, "AROUND"),
    Hook(SIZING + "get_req_to_token_extra_context_len", _row_headroom, "AROUND"),
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
         _count_each_cycle, "AROUND"),
]
