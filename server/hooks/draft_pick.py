"""DFlash's draft pick over qflash's int8 lm_head.

SGLang picks each draft token by multiplying the drafter's hidden states with `lm_head.weight` directly: in the
draft CUDA graph (`_DflashDraftSampler`, which declines a non-float head) or eagerly
(`_greedy_sample_from_vocab_parallel_head`, which would run that matmul on int8 weights). For qflash's int8 head
neither writes the logits. The in-graph pick, every cycle's, scans a 4-bit copy of the head and scores its finalists
on the int8 rows (kernels/w4_draft_pick.py: half the bytes of the int8 head, the same pick but for near ties, which
move only what the verify accepts, never what it emits) for the blocks of one or two requests; it is folded into the
draft graph the way SGLang folds its own. Larger batches, and the eager pick for batches no graph holds, take the fused
W8A16 argmax over the int8 head (kernels/w8a16_argmax.py).
Retire when SGLang's DFlash draft pick goes through the lm_head's quantization method.
"""

import logging

import torch

from qflash.kernels import w4_draft_pick, w8a16_argmax
from qflash.server.hooks import Hook

logger = logging.getLogger(__name__)


class Int8HeadDraftSampler:
    """SGLang's `_DflashDraftSampler` interface: called in the draft graph with the block's hidden states
    [bs * K, hidden], writes the proposed ids of block positions 1..K-1 (position 0 is the bonus token) into `out`.
    Holds the 4-bit copy of the head's vocabulary rows that its pick scans (made once, here); a batch of more than
    w4_draft_pick.MAX_ROWS rows picks on the int8 head instead, where that is the faster."""

    def __init__(self, lm_head, block_size: int, max_bs: int):
        num_org = int(lm_head.shard_indices.num_org_elements)
        self.weight, self.scale = lm_head.weight[:num_org], lm_head.weight_scale[:num_org]
        self.w4, self.amax = w4_draft_pick.quantize(self.weight)
        self.block_size = int(block_size)
        self.out = torch.empty((max_bs * (self.block_size - 1),), dtype=torch.int64, device=lm_head.weight.device)

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        width = hidden_states.shape[-1]
        drafts = hidden_states.view(-1, self.block_size, width)[:, 1:, :].reshape(-1, width).to(torch.bfloat16)
        out = self.out[: drafts.shape[0]]
        if drafts.shape[0] <= w4_draft_pick.MAX_ROWS:
            w4_draft_pick.pick(drafts, self.w4, self.amax, self.weight, self.scale, out=out)
        else:
            w8a16_argmax.pick(drafts, self.weight, self.scale, "lm_head", out)


def _draft_sampler(original, self):
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.runtime_context import get_exec

    from qflash.quant.method import is_int8_lm_head

    lm_head = getattr(self._target_worker.model_runner.model, "lm_head", None)
    if not is_int8_lm_head(lm_head):
        return original(self)
    if get_tp_group().world_size != 1:
        raise NotImplementedError("qflash's int8 lm_head serves on one GPU (tensor parallel size 1)")
    logger.info("qflash: DFLASH draft pick in the draft graph scans a 4-bit copy of the int8 lm_head up to %d rows "
                "(its finalists scored on the int8 rows), the fused W8A16 argmax beyond", w4_draft_pick.MAX_ROWS)
    return Int8HeadDraftSampler(lm_head, self.block_size, max(get_exec().graph.cuda_graph_config.decode.bs))


def _eager_draft_pick(original, self, *, hidden_states, lm_head, **kwargs):
    from qflash.quant.method import greedy_ids, is_int8_lm_head

    if not is_int8_lm_head(lm_head):
        return original(self, hidden_states=hidden_states, lm_head=lm_head, **kwargs)
    return greedy_ids(lm_head, hidden_states, int(lm_head.shard_indices.num_org_elements))


WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2."
CHANGES = [
    Hook(WORKER + "_maybe_build_draft_sampler", _draft_sampler, "AROUND"),
    Hook(WORKER + "_greedy_sample_from_vocab_parallel_head", _eager_draft_pick, "AROUND"),
]
