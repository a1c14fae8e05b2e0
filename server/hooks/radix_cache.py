"""Two DFLASH + hybrid-model radix-cache fixes that make prefix caching correct on Qwen3.5 (backports).

With the `extra_buffer` strategy the radix cache checkpoints each request's Gated-DeltaNet state every 256
tokens; a verify step whose accepted tokens cross that boundary must copy the state at the boundary into the
request's tracking slot.
- sglang#37817, fixed upstream by sglang#37818: 0.5.17 detects the crossing by comparing the pre-verify lengths
  with `batch.seq_lens`, which the scheduler has not advanced yet, so it never tracks; the radix cache then
  pairs that prefix's attention KV with a stale GDN state. #37818 compares with the committed post-verify
  lengths (pre-verify + commit_lens). qflash works out the commit's steps from those lengths in one launch
  (kernels/commit_steps.py, where 0.5.17's method runs some fifteen torch operations) and makes the backend call
  that method makes.
- sglang#31850 / #32052 (open upstream): EAGLE and NGRAM rebuild the batch's tracking slots from its requests
  right before every verify (`prepare_mamba_track_for_verify`); 0.5.17's DFLASH verify does not, so after a
  batch merge or filter the slots are None or the prefill's stale ones. The same call at the same point.
Retire on an SGLang release with #37818 and #32052.
"""

from qflash.graphs import glue
from qflash.server.hooks import Hook


def _commit_at_post_verify_lens(original, self, *, batch, seq_lens_pre_verify, commit_lens):
    from sglang.srt.runtime_context import get_exec

    from qflash.kernels.commit_steps import commit_steps

    backend = self.target_worker.model_runner.attn_backend
    if not (self._need_mamba_verify_commit and hasattr(backend, "update_mamba_state_after_mtp_verify")):
        return original(self, batch=batch, seq_lens_pre_verify=seq_lens_pre_verify, commit_lens=commit_lens)
    last, steps = commit_steps(seq_lens_pre_verify, commit_lens, get_exec().mamba.mamba_track_interval,
                               track=batch.mamba_track_indices is not None)
    backend.update_mamba_state_after_mtp_verify(
        last_correct_step_indices=last, mamba_track_indices=batch.mamba_track_indices, mamba_steps_to_track=steps,
        model=self.target_worker.model_runner.model, req_pool_indices=batch.req_pool_indices[: commit_lens.shape[0]])


def refresh_mamba_track(batch) -> None:
    """The batch's tracking slots rebuilt from its requests (a host list copied to the device)."""
    from sglang.srt.speculative.spec_utils import prepare_mamba_track_for_verify

    prepare_mamba_track_for_verify(batch)


def _refresh_mamba_track_before_verify(self, batch, target_worker):
    # inside a cycle's capture the copy would bake a host buffer into the graph: run_cycle refreshed them before
    if not batch.forward_mode.is_idle() and not glue.capturing():
        refresh_mamba_track(batch)


CHANGES = [
    Hook("sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._update_target_mamba_state_after_verify",
         _commit_at_post_verify_lens, "AROUND"),
    Hook("sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify", _refresh_mamba_track_before_verify, "BEFORE"),
]
