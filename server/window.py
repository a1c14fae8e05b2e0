"""Several speculative cycles per scheduler step (a "window"), so that SGLang's per-step host work runs once per
window instead of once per cycle.

SGLang 0.5.17 runs one DFLASH draft -> verify -> accept -> commit cycle per scheduler step, and each step costs
the scheduler's own Python (batch preparation, the overlap plumbing around the worker, result processing and
streaming) on top of the cycle's. A window runs its cycles back to back on the forward stream: everything one
cycle hands the next (bonus token, lengths, Gated-DeltaNet state, drafter KV) is already on the device, so
nothing waits for the host in between. The scheduler then receives one result row per request holding every
cycle's accepted tokens in order: the layout of a single cycle whose stride is the window's, which its result
processing (commit, finish checks, stop strings, streaming, radix bookkeeping) takes unchanged.

What the scheduler must see differently (server/hooks/multi_cycle.py): KV slots reserved for the cycles in flight
and the next window, and one verify counted per cycle. A window is planned when the scheduler prepares the
step, from what the host knows (lengths lag the device by the step in flight):
- as many cycles as configured, but no more than a request is expected to need before its max_new_tokens at its
  acceptance so far, so a request's last steps do not decode past its end;
- its KV slots and positions stay inside the context;
- one cycle for batches that need the host between cycles (grammar masks advance the host's FSM per cycle;
  logprobs are read from the step's one verify), and for the first decode step after a prefill
  (server/hooks/multi_cycle.py says why).
A request that stops inside a window (EOS, a stop string, max_tokens) is cut there by the scheduler's own
finish checks, as it cuts one cycle's run; the cycles after the stop are wasted, at most one window's.
"""

import math
import os

ENV = "QFLASH_WINDOW_CYCLES"  # the server's window length; `qflash serve --window-cycles` sets it
# The radix cache checkpoints the GDN state every 256 tokens and learns of a crossing one step late, so two
# consecutive steps must not both cross one: each commits at most cycles x 16 tokens, hence 2 x 8 x 16 <= 256.
MAX_CYCLES = 8
PLANNED = "qflash_window"  # on the step's DFlashDraftInputV2: the cycles the worker is to run
IN_FLIGHT = "qflash_window_in_flight"  # on the draft input a window returns: the cycles it ran
CYCLES = "qflash_cycles"  # on the GenerationBatchResult of a window


def configured_cycles() -> int:
    """The server's window length (its environment, else the preset's)."""
    from qflash.server.preset import WINDOW_CYCLES

    return int(os.environ.get(ENV, WINDOW_CYCLES))


def needs_host_between_cycles(batch) -> bool:
    """Grammar-constrained batches advance the host's grammar FSM over each cycle's tokens before the next
    cycle's mask; a logprob batch's step returns its one verify's logprobs (server/hooks/logprobs.py)."""
    return bool(batch.has_grammar or batch.return_logprob)


def tokens_per_cycle(req, block: int) -> float:
    """What a request has committed per cycle so far (the block size before its first cycle)."""
    cycles = req.spec_verify_ct
    return (req.spec_num_correct_drafts + cycles) / cycles if cycles else float(block)


def plan_cycles(reqs, *, limit: int, in_flight: int, block: int, context_len: int) -> int:
    """Cycles of the next step for these requests, `in_flight` cycles already launched and not yet seen: at most
    `limit`, at most what each request is expected to need until its max_new_tokens, and no KV slot or position
    past the context (every cycle writes a block ahead of its prefix)."""
    cycles = limit
    for req in reqs:
        tau = tokens_per_cycle(req, block)
        if req.sampling_params.max_new_tokens is not None:
            left = req.sampling_params.max_new_tokens - len(req.output_ids) - in_flight * tau
            cycles = min(cycles, math.ceil(left / tau))
        cycles = min(cycles, (context_len - req.kv_committed_len) // block - in_flight)
    return max(cycles, 1)


def run_window(cycle, worker, batch, cycles: int, on_publish=None, grammar_barrier=None):
    """Run `cycles` of SGLang's cycle (`cycle`: DFlashWorkerV2.forward_batch_generation's signature; qflash hands
    it through its cycle graph, server/hooks/cycle_graphs.py) on one decode batch and
    return one result: per request, the accepted tokens of all cycles packed from the row's start (stride
    cycles x block), their count as its accept length, the last cycle's bonus token and lengths. Only the last
    cycle publishes the new lengths to the scheduler's FutureMap, which the next step reads on the device."""
    import torch

    from qflash.kernels.window_pack import pack_cycle

    draft_input, bs, block = batch.spec_info, batch.batch_size(), int(worker.block_size)
    # fresh each step: the copy stream reads them while the next step runs (its D2H holds them alive)
    rows = torch.empty((bs, cycles * block), dtype=torch.int64, device=worker.device)
    filled = torch.zeros((bs,), dtype=torch.int32, device=worker.device)
    for k in range(cycles):
        last = k == cycles - 1
        result = cycle(worker, batch, on_publish=on_publish if last else None, grammar_barrier=grammar_barrier)
        pack_cycle(result.next_token_ids.view(bs, block), result.accept_lens, rows, filled)
        if not last:
            carry_to_next_cycle(batch=batch, draft_input=draft_input, bonus_tokens=result.next_draft_input.bonus_tokens,
                                seq_lens=result.new_seq_lens)
    result.next_token_ids, result.accept_lens = rows.view(-1), filled
    result.speculative_num_draft_tokens = cycles * block
    setattr(result, CYCLES, cycles)
    setattr(result.next_draft_input, IN_FLIGHT, cycles)
    return result


def carry_to_next_cycle(*, batch, draft_input, bonus_tokens, seq_lens) -> None:
    """The batch as the next cycle's decode expects it: its verify preparation left the verify input and mode in
    place; the next block starts at the committed lengths, with the bonus token at its first position."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch.forward_mode = ForwardMode.DECODE
    batch.seq_lens = seq_lens
    draft_input.bonus_tokens = bonus_tokens
    batch.spec_info = draft_input
