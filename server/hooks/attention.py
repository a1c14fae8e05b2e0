"""qflash's attention kernels behind SGLang's Triton attention backend.

- The speculative block (DFlash's verify and its draft block, TARGET_VERIFY forwards): SGLang's Triton backend
  runs it through its extend kernel, which walks the cached prefix serially with one program per (request,
  head), or through a split-KV verify kernel it switches on for AMD gfx95 only (`use_verify_splitkv`), handed
  `k.contiguous()` and `v.contiguous()`. The block's k and v are column slices of the qkv projection's output
  (the target's v, the drafter's k and v), so those are copies: 20 launches a cycle. qflash serves these
  forwards before that call: kernels/block_attention.py on the strided rows, which declines (returns False) what
  it does not serve; that, and every other forward, runs SGLang's `forward_extend`. Where the pool keeps plain
  rows by slot, the block attention's split kernel also writes the block's KV; in any other pool the backend's KV
  write runs first, as SGLang makes it.
- Fresh prefills (plain causal, nothing cached: a prompt, or a batch of them): the backend keeps its extend kernel
  as an attribute, `extend_attention_fwd`, which is wrapped by kernels/flash_prefill.py (torch's fused SDPA and
  flash attention) as each backend is built; every other extend (cached prefixes, masks, windows, caps, scaled
  KV, and batches while a CUDA graph is captured) reaches SGLang's kernel unchanged.
- The speculative block's metadata: before each TARGET_VERIFY forward the backend fills its CUDA-graph buffers in
  11 launches (the target's) or 18 (the drafter's, with its sliding window); kernels/verify_metadata.py fills the
  same buffers with the same values in one. A custom mask or a window translated into a separate SWA pool stays
  with SGLang's code.
Retire when SGLang's Triton backend has split-KV verify on CUDA, handed the block's k and v as they are and
writing them into the cache in that kernel, a flash prefill path of its own, and its verify metadata in one launch.
"""

import functools

import torch

from qflash.server.hooks import Hook


def _wrap_prefill_kernel(result, self, *args, **kwargs):
    from qflash.kernels.flash_prefill import flash_prefill

    self.extend_attention_fwd = torch.compiler.disable(functools.partial(flash_prefill, self.extend_attention_fwd))
    return result


def _causal(backend, layer) -> bool:
    """The backend's rule for whether an extend is causal."""
    from sglang.srt.layers.radix_attention import AttentionType

    return not (layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY
                or (layer.attn_type == AttentionType.DECODER_BIDIRECTIONAL
                    and backend.allow_bidirectional_attention_in_extend))


def _block_on_strided_kv(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                         score_mod=None, aux_tensors=None, **kwargs):
    def sglang(save_kv_cache=save_kv_cache):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, sinks=sinks,
                        score_mod=score_mod, aux_tensors=aux_tensors, **kwargs)

    # the forwards whose attention SGLang would offer its verify hook, with a plain KV write and no argument it does
    # not know (SGLang's signature refuses them); page_size 1, as block_attention reads one KV slot per token
    if not (forward_batch.forward_mode.is_target_verify() and k is not None and v is not None and self.page_size == 1
            and sinks is None and score_mod is None and not kwargs and layer.k_scale is None and self.dcp_size == 1
            and not self.enable_deterministic and getattr(forward_batch, "_attn_output", None) is None):
        return sglang()
    slots = _plain_kv_slots(self, forward_batch) if save_kv_cache else None
    if save_kv_cache and slots is None:
        _write_kv(self, layer, forward_batch, k, v)
    o = _block_attention(self, q, k, v, layer, slots)
    if o is not None:
        return o
    if slots is not None:  # declined before writing anything: the KV too is left to SGLang
        return sglang()
    return sglang(save_kv_cache=False)  # the KV is written


def _write_kv(backend, layer, forward_batch, k, v) -> None:
    """The block's k and v into the cache, as the backend writes them."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    meta = backend.forward_metadata
    loc = KVWriteLoc(forward_batch.out_cache_loc, meta.swa_out_cache_loc, full_loc=meta.out_cache_loc_full_physical)
    backend._set_kv_buffer(forward_batch, layer, loc, k, v)


def _plain_kv_slots(backend, forward_batch):
    """The block's cache slots where the backend's KV write is a plain store of each token's [heads, dim] rows into
    the buffers `get_key_buffer` / `get_value_buffer` return, which block_attention then does in its split kernel
    (SGLang's write is a launch of its own, without programmatic dependent launch); None for every other pool."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool

    pool, loc = backend.token_to_kv_pool, forward_batch.out_cache_loc
    if type(pool) is HybridLinearKVPool and not pool.use_mla:  # the full-attention layers' pool, as its write picks
        full_loc = backend.forward_metadata.out_cache_loc_full_physical
        pool, loc = pool.full_kv_pool, loc if full_loc is None else full_loc
    plain = (type(pool) is MHATokenToKVPool and not pool.is_quantized_kv_cache and pool.store_dtype == pool.dtype
             and not pool.use_hnd and pool.kv_cache_layout == "nhd")
    return loc if plain else None


@torch.compiler.disable
def _block_attention(backend, q, k, v, layer, slots=None):
    """The block's attention output [tokens, heads * value dim] by block_attention on k and v as they are (and k, v
    stored in the cache at `slots`, when given); None for what it does not serve. The prefix comes from the
    backend's metadata: the window's for a sliding-window layer."""
    from sglang.srt.layers.attention.triton_backend import logit_capping_mod

    from qflash.kernels.block_attention import block_attention

    meta, pool = backend.forward_metadata, backend.token_to_kv_pool
    windowed = layer.sliding_window_size is not None and layer.sliding_window_size > -1
    o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    served = block_attention(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k, v, o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), meta.qo_indptr,
        meta.window_kv_indptr if windowed else meta.kv_indptr, meta.window_kv_indices if windowed else meta.kv_indices,
        meta.custom_mask, _causal(backend, layer), meta.mask_indptr, meta.max_extend_len, 1.0, 1.0, layer.scaling,
        logit_cap=logit_capping_mod(layer.logit_capping_method, layer.logit_cap),
        sliding_window_size=layer.sliding_window_size if windowed else -1,
        window_kv_offsets=meta.window_kv_offsets if windowed else None, xai_temperature_len=layer.xai_temperature_len,
        max_bs=backend.req_to_token_pool.size, out_cache_loc=slots)
    return o if served else None


def _verify_metadata_in_one_launch(original, self, bs, seq_lens, req_pool_indices, spec_info):
    from qflash.kernels.verify_metadata import verify_metadata

    block = getattr(spec_info, "draft_token_num", None)
    block = self.num_draft_tokens if block is None else int(block)
    window = self.sliding_window_size if self.sliding_window_size is not None and self.sliding_window_size > 0 else 0
    if (bs == 0 or seq_lens.shape[0] != bs or getattr(spec_info, "custom_mask", None) is not None
            or (window and hasattr(self.token_to_kv_pool, "translate_loc_from_full_to_swa"))):
        return original(self, bs, seq_lens, req_pool_indices, spec_info)
    windowed = ((self.window_kv_indptr, self.cuda_graph_window_kv_indices, self.cuda_graph_window_kv_offsets)
                if window else ())
    verify_metadata(self.req_to_token, req_pool_indices, seq_lens, block, self.qo_indptr, self.kv_indptr,
                    self.cuda_graph_kv_indices, self.mask_indptr, window, *windowed)
    # what SGLang's returns: without a window, its whole window indptr buffer and three Nones
    window_outputs = ((self.window_kv_indptr[: bs + 1], self.cuda_graph_window_kv_indices,
                       self.cuda_graph_window_num_kv_splits, self.cuda_graph_window_kv_offsets)
                      if window else (self.window_kv_indptr, None, None, None))
    return self.qo_indptr[: bs + 1], self.kv_indptr[: bs + 1], None, self.mask_indptr[: bs + 1], *window_outputs


CHANGES = [
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__", _wrap_prefill_kernel, "AFTER"),
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend", _block_on_strided_kv, "AROUND"),
    Hook("sglang.srt.layers.attention.triton_backend.TritonAttnBackend._update_target_verify_buffers",
         _verify_metadata_in_one_launch, "AROUND"),
]
