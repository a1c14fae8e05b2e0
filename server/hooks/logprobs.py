"""Log-probabilities under DFLASH: `return_logprob`, `top_logprobs`, the OpenAI `logprobs` and so `sgl.select`.

SGLang 0.5.17 refuses every logprob request under DFLASH, twice: at admission (`validate_dflash_request`) and
in the worker's step (`forward_batch_generation` raises on `batch.return_logprob`). What it lacks is small:
- a prefill computes input and first-token logprobs in the target worker as without speculation; the worker's
  raise only has to let the batch through, and the target's forward must still see the flag;
- a verify step's fp32 logits (after the sampling adjustments and the grammar mask, as plain decoding's) cover
  every block position, and position j's committed token is the step's output token j (an accepted draft or the
  bonus). SGLang's spec-v2 helper `compute_spec_v2_logprobs` gathers them in the [requests, block] layout the
  scheduler's result processing reads (EAGLE and NGRAM call it; DFLASH does not). The target's forward runs
  without the flag, so the verify keeps its CUDA graph; requests without logprobs never reach this code.
A logprob batch runs one cycle per step (server/window.py), so a step's logits are its one verify's.
Retire on an SGLang release with logprobs for DFLASH (upstream sglang PR #33459 added them after 0.5.17).
"""

import functools

from qflash.server.hooks import Hook

HIDDEN = "qflash_logprobs_hidden"  # on a ScheduleBatch while its return_logprob is hidden from DFLASH's check


def _admit_logprobs(original, req, enable_overlap):
    wanted, req.return_logprob = req.return_logprob, False
    try:
        return original(req, enable_overlap)  # its other refusals stand
    finally:
        req.return_logprob = wanted


def _step_with_logprobs(original, self, batch, on_publish=None, grammar_barrier=None):
    step = functools.partial(original, self, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
    if not getattr(batch, "return_logprob", False):
        return step()
    mode = batch.forward_mode  # read first: the verify leaves the batch in TARGET_VERIFY, which counts as extend
    verify = not (mode.is_extend() or mode.is_idle() or batch.is_extend_in_batch)
    batch.return_logprob = False
    setattr(batch, HIDDEN, True)
    try:
        result = step()
    finally:
        delattr(batch, HIDDEN)
        batch.return_logprob = True
    if verify:
        verify_logprobs(batch, result)
    return result


def verify_logprobs(batch, result) -> None:
    """Fill the step's logits output with its committed tokens' logprobs (and top / asked-for ids' logprobs),
    [requests, block] as the scheduler reads a spec-v2 step's."""
    import torch
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    block = int(result.speculative_num_draft_tokens)
    bs = batch.batch_size()
    positions = torch.arange(bs * block, device=result.next_token_ids.device).view(bs, block)
    compute_spec_v2_logprobs(batch=batch, logits_output=result.logits_output, predict=result.next_token_ids,
                             accept_index=positions, speculative_num_steps=block - 1)


def _target_sees_logprobs(original, self, batch=None, *args, **kwargs):
    """The prefill's target forward (called with the hidden batch) computes the logprobs it was asked for."""
    if batch is None or not getattr(batch, HIDDEN, False):
        return original(self, batch, *args, **kwargs)
    batch.return_logprob = True
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        batch.return_logprob = False


CHANGES = [
    Hook("sglang.srt.managers.scheduler.validate_dflash_request", _admit_logprobs, "AROUND"),
    # inside the multi-cycle step's hook (plugin order): the window must see the flag to run one cycle
    Hook("sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation", _step_with_logprobs, "AROUND"),
    Hook("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", _target_sees_logprobs, "AROUND"),
]
