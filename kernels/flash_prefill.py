"""Prefill attention through torch's fused kernels: a fresh prompt's through SDPA, a batch of fresh prompts through
flash attention over packed sequences (`torch.nn.attention.varlen`).

A fresh prefill is causal self-attention over each request's new tokens, which torch's fused kernels run several
times faster than SGLang's Triton extend kernel at long prompts (`qflash bench-kernels`). One request is plain SDPA
(no host sync, so a prefill graph can hold it). Several requests are already packed one after another, as
varlen_attn takes them; not while a CUDA graph is captured (the speculative block's graphs keep SGLang's kernel).
New tokens over a cached prefix stay on SGLang's kernel: packing the prefix for flash attention made every cache-hit
turn ~12 ms slower on the H200 (BENCHMARKS.md, 2026-12-04). Masks, windows, caps and scaled KV stay there too
(server/hooks/attention.py routes it).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

# extend_attention_fwd's keyword arguments and the values under which a call is plain causal attention.
PLAIN = {"logit_cap": 0.0, "skip_prefix_custom_mask": True, "sliding_window_size": -1, "sinks": None,
         "window_kv_offsets": None, "xai_temperature_len": -1, "lse_extend": None, "skip_prefix": False,
         "skip_extend": False, "page_size": 1, "score_mod": None, "aux_tensors": None}


def _plain(key, value) -> bool:
    default = PLAIN.get(key, object())  # an argument this module does not know: not plain
    return value is None if default is None else value == default


def plain_causal(custom_mask, is_causal, k_scale, v_scale, kwargs) -> bool:
    """Causal, unscaled KV, nothing but the defaults."""
    return (custom_mask is None and bool(is_causal) and float(k_scale) == 1.0 and float(v_scale) == 1.0
            and all(_plain(*item) for item in kwargs.items()))


def fresh(kv_indices) -> bool:
    """No request has a cached prefix (SGLang sizes kv_indices to the prefixes' total): known on the host."""
    return kv_indices.numel() == 0


def one_request(qo_indptr) -> bool:
    return qo_indptr.shape[0] == 2


def flash_prefill(extend_attention_fwd, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                  kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                  sm_scale=None, **kwargs):
    """SGLang's `extend_attention_fwd` signature. q/k/v_extend [tokens, heads, dim]; rows past the last request's
    new tokens (a prefill graph's padding) are left as SGLang's kernel leaves them."""
    served = max_len_extend is not None and fresh(kv_indices) and plain_causal(custom_mask, is_causal, k_scale,
                                                                              v_scale, kwargs)
    if not served or not one_request(qo_indptr) and q_extend.is_cuda and torch.cuda.is_current_stream_capturing():
        return extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                    kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                                    sm_scale, **kwargs)
    n = int(max_len_extend)
    if one_request(qo_indptr):
        q, k, v = (t[:n].transpose(0, 1).unsqueeze(0) for t in (q_extend, k_extend, v_extend))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        o_extend[:n].copy_(o[0].transpose(0, 1))
        return
    cu_seq = qo_indptr.to(torch.int32)  # SGLang's is int64; flash attention takes int32
    o = varlen_attn(q_extend, k_extend, v_extend, cu_seq_q=cu_seq, cu_seq_k=cu_seq, max_q=n, max_k=n, scale=sm_scale,
                    window_size=(-1, 0))
    rows = torch.arange(o_extend.shape[0], device=o_extend.device)[:, None, None]
    o_extend.copy_(torch.where(rows < qo_indptr[-1], o, o_extend))  # a graph's padding rows are left alone
