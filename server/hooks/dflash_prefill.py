"""The DFLASH worker's prefill step without waiting for the prefill: the drafter's KV write is queued behind it.

SGLang 0.5.17's worker (`DFlashWorkerV2.forward_batch_generation`, its extend branch), right after launching the
target's prefill, builds the prompt's lengths for the drafter's positions with `torch.tensor(list, device=...)`: a
copy from pageable memory, which blocks the host until the GPU has run everything queued, the prefill included.
Only then does it queue the drafter's KV write for the prompt and return, and only then can the scheduler plan and
launch the first decode step, whose launch streams the first token (server/hooks/multi_cycle.py). So the host
time of that write and of the next scheduler step came after the prefill's GPU time in every request's first
token (the traces in BENCHMARKS.md, 2026-12-06). Here the same lengths go up from pinned memory without blocking,
and the branch is otherwise SGLang's: the same calls with the same values, in the same stream order.
Retire when SGLang's DFLASH prefill builds these lengths without a blocking copy.
"""

from qflash.server.hooks import Hook


def _prefill_without_waiting(original, self, batch, on_publish=None, grammar_barrier=None):
    if not (batch.forward_mode.is_extend() or batch.is_extend_in_batch):
        return original(self, batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, compute_position

    self._validate_phase1_sampling_support(batch)
    out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
    out.new_seq_lens = batch.seq_lens
    if on_publish is not None:
        on_publish(out.new_seq_lens)
    tokens = out.next_token_ids
    # pinned, so the copy is queued on the stream instead of waiting for it; the caching host allocator keeps the
    # buffer until the copy has run
    lens = torch.tensor([batch.prefix_lens, batch.extend_lens], dtype=torch.int32, pin_memory=tokens.is_cuda)
    lens = lens.to(tokens.device, non_blocking=True)
    positions, _ = compute_position(self.model_runner.server_args.attention_backend, lens[0], lens[1],
                                    sum(batch.extend_lens))
    self._append_target_hidden_to_draft_kv_by_loc(target_hidden=out.logits_output.hidden_states,
                                                  cache_loc=batch.out_cache_loc, positions=positions)
    out.logits_output.hidden_states = None  # the scheduler would copy it to the host otherwise
    out.next_draft_input = self._make_next_draft_input_prefill(bonus_tokens=tokens, seq_lens=batch.seq_lens)
    return out


CHANGES = [
    # innermost of the step's hooks (plugin order): it stands in for SGLang's extend branch
    Hook("sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation", _prefill_without_waiting,
         "AROUND"),
]
