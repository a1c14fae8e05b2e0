"""Every change qflash makes to a private SGLang symbol, each with the reason it exists.

They are written for SGLang 0.5.17 exactly and refuse to apply to any other version: a private
symbol can change meaning between releases without notice.
"""

import logging
from importlib.metadata import version
from types import SimpleNamespace

import torch

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PINNED_SGLANG = "0.5.17"
logger = logging.getLogger(__name__)


def check_version() -> None:
    found = version("sglang")
    if found != PINNED_SGLANG:
        raise RuntimeError(f"qflash patches SGLang {PINNED_SGLANG} internals; found sglang {found}")


def _text_only_model_config(*args, **kwargs):
    # SGLang serves Qwen3_5ForConditionalGeneration as multimodal: ModelConfig then demands an image
    # processor, and `--enable-multimodal` can only turn multimodality on, never off. qflash serves the
    # text model only (server/models/qwen3_5_text.py), so every ModelConfig it builds is text-only.
    return args, {**kwargs, "enable_multimodal": False}


def apply_text_only() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.configs.model_config.ModelConfig.__init__", _text_only_model_config, HookType.BEFORE
    )


async def _reject_unknown_model(original, self, request, raw_request):
    # SGLang 0.5.17 answers an OpenAI request whatever model it names. An OpenAI server answers 404 for
    # a model it does not serve, so a client with a wrong model name hears so instead of getting ours.
    from sglang.srt.entrypoints.openai.protocol import DEFAULT_MODEL_NAME

    model = getattr(request, "model", None)
    served = self.tokenizer_manager.served_model_name
    if model is not None and model.split(":", 1)[0] not in (served, DEFAULT_MODEL_NAME):
        return self.create_error_response(
            f"The model '{model}' does not exist; this server serves '{served}'",
            err_type="NotFoundError", status_code=404,
        )
    return await original(self, request, raw_request)


def apply_openai_model_check() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
        _reject_unknown_model, HookType.AROUND,
    )


class Int8HeadDraftSampler:
    """The in-graph DFlash draft pick over qflash's int8 lm_head: fused W8A16 argmax, no logits (one GPU).

    Same interface as SGLang's `_DflashDraftSampler`: called in the draft CUDA graph with the block's
    hidden states, writes the proposed ids of block positions 1.. into `out`."""

    def __init__(self, lm_head, block_size: int, max_bs: int):
        from qflash.quant.method import greedy_ids

        self.greedy_ids, self.lm_head, self.block_size = greedy_ids, lm_head, int(block_size)
        self.num_org = int(lm_head.shard_indices.num_org_elements)
        self.out = torch.empty((max_bs * (self.block_size - 1),), dtype=torch.int64, device=lm_head.weight.device)

    def __call__(self, hidden_states: torch.Tensor, input_ids=None) -> None:
        hs = hidden_states.view(-1, self.block_size, hidden_states.shape[-1])[:, 1:, :].reshape(-1, hidden_states.shape[-1])
        self.out[: hs.shape[0]].copy_(self.greedy_ids(self.lm_head, hs, self.num_org))


def _draft_sampler(original, self):
    # SGLang's in-graph draft pick multiplies by lm_head.weight directly, so it declines a quantized
    # head and falls back to its eager pick, which would do the same int8 matmul. qflash's int8 head
    # gets the fused W8A16 argmax instead, folded into the draft graph the same way.
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.runtime_context import get_exec

    from qflash.quant.method import is_int8_lm_head

    lm_head = getattr(self._target_worker.model_runner.model, "lm_head", None)
    if not is_int8_lm_head(lm_head):
        return original(self)
    if get_tp_group().world_size != 1:
        raise NotImplementedError("qflash's int8 lm_head serves on one GPU (tensor parallel size 1)")
    logger.info("qflash: DFLASH draft pick in the draft graph is the fused W8A16 argmax over the int8 lm_head")
    return Int8HeadDraftSampler(lm_head, self.block_size, max(get_exec().graph.cuda_graph_config.decode.bs))


def _eager_draft_pick(original, self, *, hidden_states, lm_head, **kwargs):
    # The eager draft pick (batches without a draft graph): the same fused argmax for qflash's int8 head.
    from qflash.quant.method import greedy_ids, is_int8_lm_head

    if not is_int8_lm_head(lm_head):
        return original(self, hidden_states=hidden_states, lm_head=lm_head, **kwargs)
    return greedy_ids(lm_head, hidden_states, int(lm_head.shard_indices.num_org_elements))


def apply_int8_lm_head_draft_pick() -> None:
    check_version()
    worker = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2."
    HookRegistry.register(worker + "_maybe_build_draft_sampler", _draft_sampler, HookType.AROUND)
    HookRegistry.register(worker + "_greedy_sample_from_vocab_parallel_head", _eager_draft_pick, HookType.AROUND)


def _commit_mamba_state_at_post_verify_lens(original, self, *, batch, seq_lens_pre_verify, commit_lens):
    # sglang#37817, fixed upstream by sglang#37818 (after 0.5.17): with the radix cache's extra_buffer
    # strategy the GDN state is checkpointed every 256 tokens, and a verify step whose accepted tokens
    # cross that boundary must copy the state at the boundary into the tracking slot. 0.5.17 detects the
    # crossing by comparing the pre-verify lengths with `batch.seq_lens`, which the scheduler has not
    # advanced yet, so it never tracks; the scheduler still records the boundary, and the radix cache
    # then pairs that prefix's attention KV with a stale GDN state. #37818 compares with the committed
    # post-verify lengths (pre-verify + commit_lens); handing 0.5.17's code a view of the batch whose
    # seq_lens are those lengths makes it compute exactly that (it reads only these three fields).
    post_verify = SimpleNamespace(
        seq_lens=seq_lens_pre_verify + commit_lens.to(seq_lens_pre_verify.dtype),
        mamba_track_indices=batch.mamba_track_indices, req_pool_indices=batch.req_pool_indices,
    )
    return original(self, batch=post_verify, seq_lens_pre_verify=seq_lens_pre_verify, commit_lens=commit_lens)


def _refresh_mamba_track_before_verify(self, batch, target_worker):
    # sglang#31850 / #32052 (open upstream): EAGLE and NGRAM rebuild the batch's GDN tracking slots from
    # its requests right before every verify (spec_utils.prepare_mamba_track_for_verify); 0.5.17's DFLASH
    # verify does not, so the slots are None after any batch merge or filter, or the prefill's stale
    # ones, and the boundary state above would be written nowhere or into the wrong ping-pong slot.
    # This is the same call at the same point (before the verify ForwardBatch is built), as #32052 adds.
    from sglang.srt.speculative.spec_utils import prepare_mamba_track_for_verify

    if not batch.forward_mode.is_idle():
        prepare_mamba_track_for_verify(batch)


def apply_dflash_radix_cache_fixes() -> None:
    """The two DFLASH + hybrid-model radix-cache fixes that make prefix caching safe on Qwen3.5."""
    check_version()
    HookRegistry.register(
        "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._update_target_mamba_state_after_verify",
        _commit_mamba_state_at_post_verify_lens, HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify",
        _refresh_mamba_track_before_verify, HookType.BEFORE,
    )
