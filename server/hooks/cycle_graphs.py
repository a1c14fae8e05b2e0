"""A window's cycles (server/window.py) replayed as one CUDA graph each: draft, verify and all the glue between.

Even with its eager glue in graphs, a DFLASH cycle cost SGLang 0.5.17's host 2.3-3.3 ms: each of its two forwards
builds a ForwardBatch and loads the graph runner's buffers and attention metadata in Python before its graph is
launched, and the accept, simulated acceptance and bookkeeping between them run eagerly. Inside a window the
cycles of a batch size all do the same GPU work at the same addresses, so a cycle is captured once per layout
(graphs/glue.py) and replayed after: a few copies and one graph launch on the host.
- The two forwards' graphs go into the cycle's graph as child nodes: SGLang's decode graphs are kept
  (`keep_graph`) when captured, and their replay inside a cycle's capture embeds them instead.
- The fresh inputs of a cycle (committed lengths, bonus tokens, request and track slots) are copied into buffers
  of the batch size's own; its outputs (tokens, accept and commit lengths, bonus, new lengths) are the graph's
  own tensors, not the worker's rotating buffers, so no earlier step's result is overwritten while it is copied
  to the host. Each replay hands back a new result and draft input holding them.
- What the cycle reads from the host stays out of the graph: the radix cache's track slots are rebuilt from the
  requests before it (a copy from a host list, which a capture would bake in); the simulated acceptance length
  (SGLANG_SIMULATE_ACC_LEN, benchmarks only) is drawn before it, with SGLang's own sampler, and keys the graph,
  as each value fills the cycle's tensors differently; the forwards' read-done event is recorded after it.
- Only greedy batches without penalties, logit bias or custom processors are captured: those change the
  verify's logits from host state per step.
- The verify's greedy pick, `torch.argmax` over its fp32 logits, runs qflash's row argmax (kernels/row_argmax.py,
  the same indices) in the cycles the graph holds: `VocabArgmax`, a dispatch mode around the cycle's graph step
  (its eager first run compiles the kernels outside the capture).
Retire when SGLang captures a whole speculative cycle (or several) in one graph.
"""

import copy
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qflash.graphs import glue
from qflash.kernels import row_argmax
from qflash.server.hooks import Hook, radix_cache
from qflash.server.hooks.glue_graphs import drafter_kv_buffers

CYCLE = glue.GlueGraphs("a whole DFLASH cycle")
_STATIC: dict = {}  # the fresh inputs' shapes and dtypes -> the buffers they are copied into
_drawn: list = []  # the simulated acceptance length drawn for the cycle running now, if any


def run_cycle(cycle, worker, batch, on_publish=None, grammar_barrier=None, graphed=True):
    """One of a window's cycles (`cycle`: SGLang's DFlashWorkerV2.forward_batch_generation) on a decode batch,
    through its graph when the batch allows one (`graphed=False`: eagerly, as SGLang runs it)."""
    from sglang.srt.speculative import dflash_worker_v2, spec_utils

    if not graphed or not plain_greedy(batch):
        return cycle(worker, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
    block, draft_input = int(worker.block_size), batch.spec_info
    length = None
    if dflash_worker_v2.SIMULATE_ACC_LEN > 0:
        length = spec_utils._sample_simulated_acc_len(dflash_worker_v2.SIMULATE_ACC_LEN,
                                                      dflash_worker_v2.SIMULATE_ACC_METHOD, block)
    radix_cache.refresh_mamba_track(batch)  # as the verify would, but outside the graph
    fresh = {"seq_lens": batch.seq_lens, "bonus": draft_input.bonus_tokens, "pool": batch.req_pool_indices,
             "track": batch.mamba_track_indices}
    s = glue.static_copies(_STATIC, "cycle", **fresh)
    key = (length, glue.layout(s.seq_lens, s.bonus, s.pool, s.track, worker._draft_block_ids_buf,
                               worker.model_runner.req_to_token_pool.req_to_token,
                               *drafter_kv_buffers(worker._fused_kv_helper)))
    batch.seq_lens, draft_input.bonus_tokens, batch.req_pool_indices, batch.mamba_track_indices = (
        s.seq_lens, s.bonus, s.pool, s.track)
    _drawn[:] = [] if length is None else [length]
    try:
        with VocabArgmax():  # the eager run compiles its kernels, the capture records them, a replay runs no op
            result, out_cache_loc = CYCLE.run(key=key, fn=functools.partial(_captured_cycle, cycle, worker, batch))
    finally:
        _drawn.clear()
        batch.seq_lens, draft_input.bonus_tokens, batch.req_pool_indices, batch.mamba_track_indices = fresh.values()
    batch.out_cache_loc = out_cache_loc
    result = copy.copy(result)  # the window rewrites its fields; the graph's stays as captured
    result.next_draft_input = worker._make_next_draft_input_decode(bonus_tokens=result.next_draft_input.bonus_tokens,
                                                                   new_seq_lens=result.new_seq_lens)
    _republish_read_done(worker)
    if on_publish is not None:
        on_publish(result.new_seq_lens)
    return result


VOCAB_WIDE = 65536  # an argmax over rows at least this wide is a pick over the vocabulary


class VocabArgmax(TorchDispatchMode):
    """torch.argmax(x, dim=-1) of an fp32 matrix as wide as a vocabulary, on qflash's row argmax; every other call
    as torch runs it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.argmax.default and _vocabulary_pick(*args, **kwargs):
            return row_argmax.argmax(args[0])
        return func(*args, **kwargs)


def _vocabulary_pick(x, dim=None, keepdim=False) -> bool:
    return (dim in (-1, 1) and not keepdim and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1
            and x.shape[1] >= VOCAB_WIDE)


def _captured_cycle(cycle, worker, batch):
    """The cycle as a graph holds it: outputs in fresh tensors (the graph's own, when captured), nothing published
    (run_cycle publishes after it); inside a capture, both forwards must have replayed their graphs."""
    if not glue.capturing():
        return cycle(worker, batch, on_publish=None, grammar_barrier=None), batch.out_cache_loc
    rotating = worker._next_accept_bonus_buffers  # SGLang's accept kernel writes every element of these
    worker._next_accept_bonus_buffers = lambda bs: tuple(torch.empty_like(t) for t in rotating(bs))
    try:
        result = cycle(worker, batch, on_publish=None, grammar_barrier=None)
    finally:
        del worker._next_accept_bonus_buffers  # the class's method again
    if glue.embedded() != 2:
        raise glue.NotCapturable(f"{glue.embedded()} of the draft and verify forwards replayed a graph")
    return result, batch.out_cache_loc


def plain_greedy(batch) -> bool:
    """Whether the verify's logits depend on nothing but the device state: greedy, without penalties, logit
    bias, custom logit processors or a grammar."""
    if batch.has_grammar:
        return False
    info = batch.sampling_info
    if info is None:
        return True
    penalties = info.penalizer_orchestrator
    return (info.is_all_greedy and not info.has_custom_logit_processor and info.logit_bias is None
            and info.grammar_mask is None and getattr(info, "acc_linear_penalties", None) is None
            and (penalties is None or not penalties.is_required))


def _republish_read_done(worker) -> None:
    """SGLang's forwards publish an event once their reads of the shared KV tables are done, which the scheduler
    waits on (the worker's `war_fastpath_runner`'s) before writing them again; a replayed cycle ran no Python to
    record one, and one recorded inside a capture cannot be waited on: record it after the cycle (later than
    needed, never too early)."""
    event = torch.cuda.Event()
    event.record()
    worker.war_fastpath_runner.war_fastpath_read_done_event = event


def _keep_decode_graphs(original, self, shape_key, *args, **kwargs):
    """SGLang's full CUDA graphs (the decode runners') captured with their graph kept, so that a cycle's capture
    can embed them."""
    plain = torch.cuda.CUDAGraph
    torch.cuda.CUDAGraph = functools.partial(plain, keep_graph=True)  # the backend builds it inside the call
    try:
        result = original(self, shape_key, *args, **kwargs)
    finally:
        torch.cuda.CUDAGraph = plain
    self._graphs[shape_key].instantiate()  # as a plain capture does at its end, not at the first replay
    glue.drop_all()  # a cycle graph holds a clone of the graph this one replaces (SGLang captures again): none stale
    return result


def _embed_inside_a_cycle_capture(original, self, shape_key, static_forward_batch, **kwargs):
    if not glue.capturing():
        return original(self, shape_key, static_forward_batch, **kwargs)
    glue.embed(self._graphs[shape_key])
    return self._outputs[shape_key]


def _drawn_length(original, *args, **kwargs):
    return _drawn[0] if _drawn else original(*args, **kwargs)


BACKEND = "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend."
CHANGES = [
    Hook(BACKEND + "capture_one", _keep_decode_graphs, "AROUND"),
    Hook(BACKEND + "replay", _embed_inside_a_cycle_capture, "AROUND"),
    Hook("sglang.srt.speculative.dflash_utils._sample_simulated_acc_len", _drawn_length, "AROUND"),
]
