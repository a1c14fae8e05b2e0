"""The Gated-DeltaNet verify of a speculative block, and its commit, on qflash's kernels.

qflash serves the GDN layers with SGLang's ReplaySSM spec-verify (`--enable-linear-replayssm-spec`,
preset.GDN_VERIFY_FLAGS): the verify keeps each draft step's raw inputs in rings instead of the full recurrent
state after every step, and the commit replays ("folds") the accepted steps into the state. 0.5.17 offers it to
EAGLE and NGRAM only; what qflash changes for DFLASH:
- the commit: DFLASH commits through `HybridLinearAttnBackend.update_mamba_state_after_mtp_verify`, which folds
  for KDA models only and for GDN would scatter the per-step states the flag no longer allocates; for GDN it
  makes the fold EAGLE's commit (spec_utils) makes, with the same arguments;
- the pool: 0.5.17's pool builder refuses the flag under DFLASH for a non-KDA model (for want of that commit);
  the algorithm's name is its guard's only reader, so the builder runs with the name hidden from it;
- the verify: SGLang's verify runs three kernels a layer: its causal-conv1d update (the block's tokens one after
  another), a split copying q, k and v out of the conv's output, and its recurrent kernel (one warp per 128 x 32
  state tile, one per SM). qflash's (kernels/gdn_verify.py) is one kernel that convolves the layer's input GEMM's
  rows and solves the 16-token block at once, writing the windows and rings SGLang's do. It takes the backend's
  verify calls that SGLang's fold path serves with its Triton kernel and whose conv it can follow (a chained block
  of 16 tokens per request, SiLU, a state of width - 1 inputs); any other call runs SGLang's code;
- the fold: the commit replays the accepted steps on narrower tiles than SGLang's, so several warps share each SM.
Retire when SGLang runs ReplaySSM under DFLASH with a block-solved verify that does its own conv and per-batch GDN
fold tiles.
"""

from qflash.server.hooks import Hook


def _fold_gdn_window_on_commit(original, self, **kwargs):
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
    args = self.server_args
    self.server_args = _ArgsWithoutAlgorithm(args)
    try:
        return original(self, **kwargs)
    finally:
        self.server_args = args


def _verify_from_conv_input(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    import torch

    from qflash.kernels import gdn_verify

    if not forward_batch.forward_mode.is_target_verify():
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    pool, meta = self.req_to_token_pool.mamba_pool, self.forward_metadata
    conv_state, width = cache.conv[0], layer.conv_weights.shape[-1]
    if not (cache.replayssm_rawv is not None and getattr(pool, "replayssm_spec_fold", False)  # SGLang's fold path ...
            and not getattr(pool, "replayssm_is_kda", False)
            and not (self.kernel_dispatcher.verify_kernel_is_flashinfer and cache.temporal.dtype == torch.bfloat16)
            and meta.retrieve_next_token is None and meta.retrieve_parent_token is None  # ... of a chained block
            and layer.activation in ("silu", "swish") and conv_state.dim() == 3 and conv_state.shape[-1] == width - 1
            and mixed_qkv.stride(-1) == 1 and gdn_verify.takes(mixed_qkv, meta.query_start_loc)):
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    requests = meta.query_start_loc.shape[0] - 1
    return gdn_verify.verify(
        mixed_qkv, layer.conv_weights, layer.bias, conv_state, cache.intermediate_conv_window[0],
        self.verify_intermediate_state_indices[:requests], layer.A_log, a, layer.dt_bias, b, cache.temporal,
        meta.mamba_cache_indices, meta.query_start_loc, cache.replayssm_rawv, cache.replayssm_rawk, cache.replayssm_g,
        cache.replayssm_beta)


def _fold_on_qflash_tiles(*args, **kwargs):
    from qflash.kernels import gdn_verify

    return gdn_verify.fold_all_layers(*args, **kwargs)


CHANGES = [
    Hook("sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
         _fold_gdn_window_on_commit, "AROUND"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool", _allow_gdn_fold_pool, "AROUND"),
    Hook("sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend", _verify_from_conv_input, "AROUND"),
    Hook("sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold.commit_gdn_replayssm_fold_all_layers",
         _fold_on_qflash_tiles, "REPLACE"),
]
