"""Every change qflash makes to a private SGLang symbol, each with the reason it exists.

They are written for SGLang 0.5.17 exactly and refuse to apply to any other version: a private
symbol can change meaning between releases without notice.
"""

import functools
import logging
import typing
from importlib.metadata import version
from types import SimpleNamespace

import torch

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from qflash.graphs.monitor import EagerSteps, capture_report

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


async def _check_openai_request(original, self, request, raw_request):
    # SGLang 0.5.17 answers an OpenAI request whatever model it names. An OpenAI server answers 404 for
    # a model it does not serve, so a client with a wrong model name hears so instead of getting ours.
    # It also serves a chat request with `max_tokens: 0` (an empty answer, 200); OpenAI rejects it, as
    # SGLang's own /v1/completions does.
    from sglang.srt.entrypoints.openai.protocol import DEFAULT_MODEL_NAME

    model = getattr(request, "model", None)
    served = self.tokenizer_manager.served_model_name
    if model is not None and model.split(":", 1)[0] not in (served, DEFAULT_MODEL_NAME):
        return self.create_error_response(
            f"The model '{model}' does not exist; this server serves '{served}'",
            err_type="NotFoundError", status_code=404,
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value < 1:
            return self.create_error_response(f"{field} must be at least 1, got {value}")
    return await original(self, request, raw_request)


def apply_openai_checks() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
        _check_openai_request, HookType.AROUND,
    )


REQUEST_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


async def _check_json_body(original, self):
    # SGLang 0.5.17's chat request model reads the body with `.get` in its "before" validators, so a body
    # that is not a JSON object (an array, a string, null), or a `response_format` that is not one, ends
    # in an AttributeError and a 500. Those are a client's wrong types: a 400, as for every other field.
    from fastapi import HTTPException

    body = await original(self)
    if self.url.path in REQUEST_PATHS:
        if not isinstance(body, dict):
            raise HTTPException(400, f"The request body must be a JSON object, got {type(body).__name__}")
        if body.get("response_format") and not isinstance(body["response_format"], dict):
            raise HTTPException(400, "response_format must be an object, e.g. {\"type\": \"json_object\"}")
    return body


@functools.cache
def _sampling_param_types() -> dict:
    from sglang.srt.sampling.sampling_params import SamplingParams

    return typing.get_type_hints(SamplingParams)


def check_sampling_params(obj) -> None:
    """Raise ValueError (SGLang answers 400) for sampling parameters SGLang 0.5.17 would fail on later.

    It builds `SamplingParams(**params)` without checking types, so an unknown name, a string
    temperature or a float `n` ends in a TypeError deep in the request path and a 500; and it takes any
    `n` below 1 as 1 (on /v1/chat/completions n = 0 then fails after generating). Each value is checked
    against SamplingParams' own type annotation, as msgspec (SGLang's struct library) converts it;
    None is SGLang's "default" for every field."""
    import msgspec

    types = _sampling_param_types()
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params or {}]:
        for name, value in p.items():
            if name not in types:
                raise ValueError(f"Unknown sampling parameter '{name}'")
            if value is not None:
                try:
                    msgspec.convert(value, types[name])
                except msgspec.ValidationError as exc:
                    raise ValueError(f"Sampling parameter '{name}': {exc}, got {value!r}") from None
        if p.get("n") is not None and p["n"] < 1:
            raise ValueError(f"n must be at least 1, got {p['n']}")


def check_input_ids(self, obj, input_ids) -> None:
    """Raise ValueError (400) for a prompt SGLang 0.5.17 would pass to the model: an empty one (it has no
    token to predict from) or token ids outside the vocabulary (an out-of-range embedding lookup, which
    on a GPU is a device-side assert that takes the whole server down). SGLang has the vocabulary
    check (`_validate_input_ids_in_vocab`) but 0.5.17 never calls it, and it misses negative ids."""
    if input_ids is None:  # input_embeds instead of tokens
        return
    if not input_ids:
        raise ValueError("The prompt is empty")
    vocab = self.model_config.vocab_size
    bad = [t for t in input_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"Token ids must be in [0, {vocab}); got {bad[:8]}")


def apply_request_checks() -> None:
    check_version()
    HookRegistry.register("sglang.srt.entrypoints.http_server.ORJSONRequest.json", _check_json_body, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
        check_sampling_params, HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        check_input_ids, HookType.BEFORE,
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


def _report_capture(original, self, *args, **kwargs):
    # SGLang logs its own capture progress but not, per graph family, which shapes were captured, how long
    # it took and what memory it holds; qflash's graph policy (graphs/policy.py) is checked against this.
    import time

    torch.cuda.synchronize()
    free, start = torch.cuda.mem_get_info()[0], time.perf_counter()
    result = original(self, *args, **kwargs)
    torch.cuda.synchronize()
    seconds, held = time.perf_counter() - start, free - torch.cuda.mem_get_info()[0]
    role = "draft" if self.model_runner.is_draft_worker else "target"
    if hasattr(self, "capture_bs"):  # decode runner: verify or draft graphs of bs x K tokens
        report = capture_report(role, self.capture_forward_mode.name, list(self.capture_bs), self.captured_req_width, seconds, held)
    else:  # piecewise prefill runner: token buckets
        report = capture_report(role, "prefill", list(self.capture_num_tokens), 1, seconds, held)
    logger.info(report)
    return result


EAGER_STEPS = EagerSteps()  # per server process


def _count_eager_step(result, self, forward_batch, *args, **kwargs):
    # SGLang falls back to eager forwards silently; each one costs the launch overhead the graphs exist to
    # remove, so qflash counts them and logs each kind's 1st, 2nd, 4th, ... occurrence.
    if not result.can_run_graph and not forward_batch.forward_mode.is_idle():
        role = "draft" if self.is_draft_worker else "target"
        line = EAGER_STEPS.record(role, forward_batch.forward_mode.name, forward_batch.batch_size, int(forward_batch.input_ids.numel()))
        if line:
            logger.info(line)
    return result


def apply_graph_monitor() -> None:
    check_version()
    runners = "sglang.srt.model_executor.runner."
    HookRegistry.register(runners + "decode_cuda_graph_runner.DecodeCudaGraphRunner.capture", _report_capture, HookType.AROUND)
    HookRegistry.register(runners + "prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture", _report_capture, HookType.AROUND)
    HookRegistry.register("sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _count_eager_step, HookType.AFTER)


def _split_kv_block_attention(result, self, *args, **kwargs):
    # SGLang's Triton backend runs TARGET_VERIFY forwards (DFlash's verify and its draft block) through its
    # extend kernel, which walks the cached prefix serially, one program per (request, head): ~0.8 ms per
    # target layer at 8,192 tokens, 61% of a cycle. The backend has a hook for a split-KV verify kernel,
    # switched on for AMD gfx95 only; qflash plugs its own in there (kernels/block_attention.py: target and
    # drafter shapes, causal and bidirectional blocks, sliding windows), which declines what it does not serve.
    from qflash.kernels.block_attention import block_attention

    if self.page_size == 1:
        self.use_verify_splitkv = True
        self.verify_splitkv_fwd = torch.compiler.disable(block_attention)
    return result


def apply_block_attention() -> None:
    check_version()
    HookRegistry.register("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__",
                          _split_kv_block_attention, HookType.AFTER)


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


def _fold_gdn_window_on_commit(original, self, **kwargs):
    # SGLang's ReplaySSM spec-verify (`--enable-linear-replayssm-spec`, preset.GDN_VERIFY_FLAGS) has the GDN
    # verify keep each draft step's raw inputs instead of the full recurrent state after every step (16
    # states, 32 MB written per layer per cycle), and replays the accepted steps into the state on commit,
    # bit for bit what the snapshots held. EAGLE and NGRAM commit through spec_utils, which folds; 0.5.17's
    # DFLASH commits through this method, which folds only for KDA models and for GDN would scatter the
    # snapshots the flag no longer allocates. For GDN this makes the fold spec_utils makes, same arguments.
    from sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold import commit_gdn_replayssm_fold_after_verify

    linear = self.linear_attn_backend
    pool = linear.req_to_token_pool.mamba_pool
    if not getattr(pool, "replayssm_spec_fold", False) or pool.replayssm_is_kda:
        return original(self, **kwargs)
    last = kwargs["last_correct_step_indices"]
    commit_gdn_replayssm_fold_after_verify(
        spec_state=linear.req_to_token_pool.get_speculative_mamba2_params_all_layers(),
        state_batch_indices=linear.forward_metadata.mamba_cache_indices[: last.shape[0]],
        accept_lens=last + 1, last_correct_step_indices=last,
        mamba_track_indices=kwargs["mamba_track_indices"], mamba_steps_to_track=kwargs["mamba_steps_to_track"],
    )


class _ArgsWithoutAlgorithm:
    """Server arguments as they read with no speculative algorithm named; everything else as given."""

    def __init__(self, args):
        self._args = args

    def __getattr__(self, name):
        return None if name == "speculative_algorithm" else getattr(self._args, name)


def _allow_gdn_fold_pool(original, self, **kwargs):
    # 0.5.17's pool builder refuses the ReplaySSM spec-verify under DFLASH for a non-KDA model because its
    # DFLASH commit cannot fold GDN (it would scatter the snapshots the flag does not allocate); the hook
    # above does fold. That guard is the only reader of the algorithm's name in the builder, so the builder
    # runs with the name hidden from it.
    args = self.server_args
    self.server_args = _ArgsWithoutAlgorithm(args)
    try:
        return original(self, **kwargs)
    finally:
        self.server_args = args


def apply_gdn_fold_commit() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
        _fold_gdn_window_on_commit, HookType.AROUND,
    )
    HookRegistry.register("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool",
                          _allow_gdn_fold_pool, HookType.AROUND)


CONV_UPDATE_BLOCK_N = 64  # channels per program of SGLang's causal-conv1d update (SGLang's own launch: 256)


class _ChannelTiles:
    """SGLang's causal-conv1d update kernel, launched with `block_n` channels per program."""

    def __init__(self, kernel, block_n: int):
        self.kernel, self.block_n = kernel, block_n

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, "BLOCK_N": self.block_n})


def apply_conv_update_tiles() -> None:
    # The GDN verify's causal-conv1d update (16 tokens of 8,192 channels per request, ~0.3 MB) is launched by
    # SGLang with 256 channels per program: 32 programs at batch 1, 14 us per layer, 0.34 ms per cycle on the
    # H200. Each channel is a depthwise convolution computed on its own, so the tile width changes how many
    # programs share the work and never a result bit; the launcher's grid divides by the BLOCK_N it launches.
    check_version()
    from sglang.kernels.ops.mamba import causal_conv1d_triton as conv

    conv._causal_conv1d_update_kernel = _ChannelTiles(conv._causal_conv1d_update_kernel, CONV_UPDATE_BLOCK_N)


def _tiled_fold_verify(original):
    from qflash.kernels import gdn_verify

    @functools.wraps(original)
    def verify(*, cache_ring: bool = False, is_kda: bool = False, **kwargs):
        if not (cache_ring and not is_kda and kwargs.get("use_qk_l2norm_in_kernel") and kwargs.get("disable_state_update")
                and kwargs.get("cu_seqlens") is not None and kwargs.get("lower_bound") is None
                and kwargs.get("retrieve_parent_token") is None and kwargs.get("intermediate_states_buffer") is None):
            return original(cache_ring=cache_ring, is_kda=is_kda, **kwargs)
        for done in ("use_qk_l2norm_in_kernel", "disable_state_update", "lower_bound", "retrieve_parent_token",
                     "intermediate_states_buffer", "intermediate_state_indices", "cache_steps"):
            kwargs.pop(done, None)
        return gdn_verify.verify(**kwargs)

    return verify


def apply_gdn_verify_tiles() -> None:
    # The GDN verify of the ReplaySSM fold (GDN_VERIFY_FLAGS) runs SGLang's recurrent kernel on one warp per
    # 128 x 32 state tile, one per SM: 0.72 ms per cycle on the H200. qflash's verify and fold
    # (kernels/gdn_verify.py) run a narrower tile; the fold must give the verify's bits, so both are replaced
    # together. SGLang's fold verify imports the verify from its module at each call and its commit calls the
    # fold through its module's global, so the module attributes are what is replaced. Verify calls without
    # the ring (decode, EAGLE's snapshots) still reach SGLang's kernel.
    check_version()
    from sglang.kernels.ops.attention.fla import fused_sigmoid_gating_recurrent as recurrent
    from sglang.kernels.ops.attention.fla import gdn_replayssm_spec_fold as fold

    from qflash.kernels import gdn_verify

    recurrent.fused_sigmoid_gating_delta_rule_update = _tiled_fold_verify(
        recurrent.fused_sigmoid_gating_delta_rule_update)
    fold.commit_gdn_replayssm_fold_all_layers = gdn_verify.fold_all_layers


def _short_gdn_prefill(original, self, q, k, v, g, beta, **kwargs):
    from qflash.kernels import gdn_prefill

    if q.shape[1] > gdn_prefill.MAX_TOKENS or kwargs.get("num_state_checkpoints"):
        return original(self, q, k, v, g, beta, **kwargs)
    return gdn_prefill.prefill(q, k, v, g, beta, kwargs["ssm_states"], kwargs["cache_indices"],
                               kwargs["query_start_loc"])


def apply_short_gdn_prefill() -> None:
    # SGLang prefills each GDN layer with FLA's chunked kernels, eagerly between the prefill graph's pieces:
    # 0.4-0.65 ms of host time per layer on the H200 whatever the prompt's length, so a 64-token prompt waits
    # 10-16 ms on launches. Prompts up to gdn_prefill.MAX_TOKENS take qflash's one-launch recurrent prefill,
    # which keeps the chunked path's contract (state in place, output, chunk states for the prefix cache).
    check_version()
    HookRegistry.register("sglang.srt.layers.attention.linear.kernels.gdn_triton.TritonGDNKernel.extend",
                          _short_gdn_prefill, HookType.AROUND)


def _flash_prefill_attention(result, self, *args, **kwargs):
    # SGLang's Triton extend kernel runs a long prompt's prefill attention at 139 TFLOP/s on the H200 (31 ms in
    # 8 layers at 8,192 tokens); a fresh single-request prefill goes to torch's SDPA instead (server/flash_prefill.py),
    # which hands everything else back. The backend keeps the kernel as an attribute, so that is what is wrapped.
    from qflash.server.flash_prefill import flash_prefill

    self.extend_attention_fwd = torch.compiler.disable(functools.partial(flash_prefill, self.extend_attention_fwd))
    return result


def apply_flash_prefill_attention() -> None:
    check_version()
    HookRegistry.register("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__",
                          _flash_prefill_attention, HookType.AFTER)
