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
- the kernels: SGLang's recurrent kernel steps through the block on one warp per 128 x 32 state tile, one per
  SM; qflash's verify (kernels/gdn_verify.py) solves the 16-token block at once, and its fold replays the accepted
  steps on narrower tiles, so several warps share each SM. The verify is replaced where SGLang's fold path calls
  it (ring-writing GDN calls of one 16-token block per request; decode, EAGLE's snapshot calls and other lengths
  reach SGLang's kernel, whose rings are the same), the fold as a whole;
- the causal-conv1d update before the verify: SGLang's kernel steps through the block's tokens one after another;
  qflash's (kernels/conv_update.py) computes the block at once, to the same bits, for the verify's calls
  (chained blocks saving per-step windows), in the epilogue of the input GEMM where that waits for the call
  (gdn_input_proj); any other call keeps SGLang's;
- the q | k | v split after the conv: SGLang copies each of the three out of the conv output's rows (one kernel a
  layer) for FLA's chunked prefill, which wants them contiguous; qflash's verify and short prefill
  (kernels/gdn_prefill.py, the prompts it `serves`) read rows through a token stride, so for those, where the conv
  output's rows are contiguous whole 16-token blocks, the split hands out views of them. A longer prefill keeps
  SGLang's split: FLA would copy views itself, one strided copy each, three launches a layer for the bytes of one
  (BENCHMARKS.md, 2026-12-06). gdn_backend binds the split on CUDA only; elsewhere the hook binds it first, so every
  platform installs the same hooks.
Retire when SGLang runs ReplaySSM under DFLASH with a block-solved verify, per-batch GDN fold tiles, a
block-at-once conv update and a split its verify kernels need not copy.
"""

from qflash.server.hooks import Hook, gdn_input_proj


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


RING_VERIFY_ONLY = ("use_qk_l2norm_in_kernel", "disable_state_update", "lower_bound", "retrieve_parent_token",
                    "intermediate_states_buffer", "intermediate_state_indices", "cache_steps")


def _verify_on_qflash_tiles(original, *, cache_ring: bool = False, is_kda: bool = False, **kwargs):
    from qflash.kernels import gdn_verify

    if not (cache_ring and not is_kda and kwargs.get("use_qk_l2norm_in_kernel") and kwargs.get("disable_state_update")
            and kwargs.get("cu_seqlens") is not None and kwargs.get("lower_bound") is None
            and kwargs.get("retrieve_parent_token") is None and kwargs.get("intermediate_states_buffer") is None
            and gdn_verify.takes(kwargs["k"], kwargs["cu_seqlens"])):
        return original(cache_ring=cache_ring, is_kda=is_kda, **kwargs)
    return gdn_verify.verify(**{k: v for k, v in kwargs.items() if k not in RING_VERIFY_ONLY})


def _fold_on_qflash_tiles(*args, **kwargs):
    from qflash.kernels import gdn_verify

    return gdn_verify.fold_all_layers(*args, **kwargs)


def _conv_update_on_qflash(original, *args, **kwargs):
    from qflash.kernels import conv_update

    takes = conv_update.takes(*args, **kwargs)
    if gdn_input_proj.conv_in_gemm(takes, *args, **kwargs):  # the conv ran in the epilogue of x's GEMM
        return args[0]
    return (conv_update.conv_update if takes else original)(*args, **kwargs)


def _verify_reads_conv_rows(original, mixed_qkv, num_q_heads, num_k_heads, num_v_heads, head_q, head_k, head_v):
    from qflash.kernels import gdn_prefill
    from qflash.kernels.gdn_verify import BLOCK_STEPS, head_views

    heads = ((num_q_heads, head_q), (num_k_heads, head_k), (num_v_heads, head_v))
    tokens = mixed_qkv.shape[0]
    # qflash's kernels read strided rows; FLA's chunks would copy them
    strided_reader = gdn_input_proj.verifying() or gdn_prefill.serves(tokens)
    if (not strided_reader or mixed_qkv.stride(-1) != 1 or tokens % BLOCK_STEPS
            or mixed_qkv.shape[-1] != sum(count * dim for count, dim in heads)):
        return original(mixed_qkv, num_q_heads, num_k_heads, num_v_heads, head_q, head_k, head_v)
    return head_views(mixed_qkv, heads)


class _SplitHook(Hook):
    """The split's hook, installed where gdn_backend did not bind the split (off CUDA) by binding it first."""

    def install(self):
        from sglang.kernels.ops.attention import triton_gdn_fused_proj
        from sglang.srt.layers.attention.linear import gdn_backend

        if not hasattr(gdn_backend, "fused_qkv_split_gdn_prefill"):
            gdn_backend.fused_qkv_split_gdn_prefill = triton_gdn_fused_proj.fused_qkv_split_gdn_prefill
        return super().install()


FLA = "sglang.kernels.ops.attention.fla."
CHANGES = [
    Hook("sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
         _fold_gdn_window_on_commit, "AROUND"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool", _allow_gdn_fold_pool, "AROUND"),
    Hook(FLA + "fused_sigmoid_gating_recurrent.fused_sigmoid_gating_delta_rule_update", _verify_on_qflash_tiles, "AROUND"),
    Hook(FLA + "gdn_replayssm_spec_fold.commit_gdn_replayssm_fold_all_layers", _fold_on_qflash_tiles, "REPLACE"),
    Hook("sglang.srt.layers.attention.linear.gdn_backend.causal_conv1d_update", _conv_update_on_qflash, "AROUND"),
    _SplitHook("sglang.srt.layers.attention.linear.gdn_backend.fused_qkv_split_gdn_prefill", _verify_reads_conv_rows,
               "AROUND"),
]
