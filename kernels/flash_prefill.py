"""A fresh prompt's prefill attention through torch's fused SDPA.

A prefill with no cached prefix is plain causal self-attention over the new tokens, which torch's fused SDPA
runs several times faster than SGLang's Triton extend kernel at long prompts (`qflash bench-kernels`). Everything
else (cached prefixes, several requests, masks, windows, caps, scaled KV, the speculative block) stays on
SGLang's kernel (server/hooks/attention.py routes it).
"""

import torch.nn.functional as F

# extend_attention_fwd's keyword arguments and the values under which a call is plain causal attention.
PLAIN = {"logit_cap": 0.0, "skip_prefix_custom_mask": True, "sliding_window_size": -1, "sinks": None,
         "window_kv_offsets": None, "xai_temperature_len": -1, "lse_extend": None, "skip_prefix": False,
         "skip_extend": False, "page_size": 1, "score_mod": None, "aux_tensors": None}


def _plain(key, value) -> bool:
    default = PLAIN.get(key, object())  # an argument this module does not know: not plain
    return value is None if default is None else value == default


def serves(kv_indices, qo_indptr, custom_mask, is_causal, k_scale, v_scale, kwargs) -> bool:
    """One request (qo_indptr's length is known on the host), no cached prefix (SGLang sizes kv_indices to
    the prefixes' total), causal, nothing but the defaults: no host sync is needed to decide."""
    return (qo_indptr.shape[0] == 2 and kv_indices.numel() == 0 and custom_mask is None and bool(is_causal)
            and float(k_scale) == 1.0 and float(v_scale) == 1.0 and all(_plain(*item) for item in kwargs.items()))


def flash_prefill(extend_attention_fwd, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                  kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                  sm_scale=None, **kwargs):
    """SGLang's `extend_attention_fwd` signature. q/k/v_extend [tokens, heads, dim]; rows past max_len_extend
    (a prefill graph's padding) are left as SGLang's kernel leaves them."""
    if not serves(kv_indices, qo_indptr, custom_mask, is_causal, k_scale, v_scale, kwargs):
        return extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                    kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                                    sm_scale, **kwargs)
    n = int(max_len_extend)
    q, k, v = (t[:n].transpose(0, 1).unsqueeze(0) for t in (q_extend, k_extend, v_extend))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    o_extend[:n].copy_(o[0].transpose(0, 1))
