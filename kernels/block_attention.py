"""Attention of a speculative block (K queries per request) over its request's KV cache, split along the cache.

Verify and draft forwards attend K = 16 new tokens to the whole context. SGLang's Triton extend kernel
walks the cached prefix serially with one program per (request, head): 16 programs for the target at
batch 1, however long the context. Here the prefix is split across NSPLIT programs per (request, KV head),
flash-decoding style, each reading its keys once for all the query heads that share them; a second kernel merges
the splits' partial softmax sums and adds the block's own keys (causal for the target, bidirectional for the DFlash
drafter), with the same sliding-window rule as SGLang's kernel. Its signature is that of SGLang's
`verify_splitkv_fwd` (the Triton backend's verify hook): it returns False, doing nothing, for a case it does not serve.
q, k and v are read through their row and head strides, so the column slices of a qkv projection need no copy.
Given the block's cache slots, the split kernel also stores the block's k and v there (the KV write SGLang's backend
would otherwise launch before it).
"""

import os

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl

DOT_DTYPE = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
NEG = tl.constexpr(-1.0e30)  # "no key seen yet": finite, so exp(NEG - NEG) = 1 and empty splits add nothing


@triton.jit
def _prefix_split_kernel(q_ptr, kbuf_ptr, vbuf_ptr, kv_indptr, kv_indices, acc_ptr, ml_ptr, sm_scale,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         k_ptr, v_ptr, loc_ptr, stride_bkt, stride_bkh, stride_bvt, stride_bvh,
                         GROUP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         NSPLIT: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         STORE: tl.constexpr, PDL: tl.constexpr):
    # One program per (request, KV head, split): the GROUP query heads sharing the KV head are its
    # GROUP * L rows, so each key and value of the split is read once.
    pdl.enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    if STORE and s == 0:
        # The block's own keys and values into its cache slots, for the cycles after this one (nothing in this
        # forward reads them there: the prefix's slots are others, and the merge reads the block's k and v as handed).
        block_rows = b * L + tl.arange(0, L)
        slot = tl.load(loc_ptr + block_rows).to(tl.int64)
        k_new = tl.load(k_ptr + block_rows[:, None] * stride_bkt + kvh * stride_bkh + offs_d[None, :])
        tl.store(kbuf_ptr + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :], k_new)
        v_new = tl.load(v_ptr + block_rows[:, None] * stride_bvt + kvh * stride_bvh + offs_dv[None, :])
        tl.store(vbuf_ptr + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :], v_new)
    start = tl.load(kv_indptr + b)
    plen = tl.load(kv_indptr + b + 1) - start
    per = tl.cdiv(tl.cdiv(plen, NSPLIT), BLOCK_N) * BLOCK_N
    lo = s * per
    if lo >= plen:  # past the prefix: the merge reads only the splits that hold keys
        return
    hi = tl.minimum(lo + per, plen)
    rows = tl.arange(0, GROUP * L)
    head = kvh * GROUP + rows // L
    token = rows % L
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (b * L + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :])
    m_i = tl.full([GROUP * L], NEG, tl.float32)
    l_i = tl.zeros([GROUP * L], tl.float32)
    acc = tl.zeros([GROUP * L, DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + offs_n
        mask_n = n < hi
        loc = tl.load(kv_indices + start + n, mask=mask_n, other=0)
        k = tl.load(kbuf_ptr + loc[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        qk = tl.dot(q.to(DOT_DTYPE), k.to(DOT_DTYPE)) * sm_scale
        visible = mask_n[None, :]
        if WINDOW > 0:  # query token i sits at prefix position plen + i
            visible = visible & ((plen + token[:, None]) <= (n[None, :] + WINDOW))
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        v = tl.load(vbuf_ptr + loc[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE))
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    part = (b * tl.num_programs(1) * GROUP + head) * NSPLIT + s  # partials per (request, query head, split)
    tl.store(acc_ptr + (part * L + token)[:, None] * DV + offs_dv[None, :], acc)
    tl.store(ml_ptr + part * 2 * L + token, m_i)
    tl.store(ml_ptr + part * 2 * L + L + token, l_i)


@triton.jit
def _merge_block_kernel(q_ptr, k_ptr, v_ptr, o_ptr, kv_indptr, acc_ptr, ml_ptr, sm_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                        GROUP: tl.constexpr, L: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                        NSPLIT: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    # One program per (request, query head, BLOCK_DV value columns). The splits' maxima come first, so each
    # split's weight is known before its partial sums are read: those loads (CHUNK splits at a time, unrolled)
    # do not wait on one another, where a running rescale would chain one load latency per split.
    # The block's own scores come first, before the PDL wait: the split kernel, always the launch just before this
    # one, writes only the partials; q, k, v and the lengths were written before it (pdl.load_settled).
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    plen = pdl.load_settled(kv_indptr + b + 1) - pdl.load_settled(kv_indptr + b)
    offs_m = tl.arange(0, L)
    offs_d = tl.arange(0, D)
    rows = b * L + offs_m
    q = pdl.load_settled(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :])
    k = pdl.load_settled(k_ptr + rows[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None])
    qk = tl.dot(q.to(DOT_DTYPE), k.to(DOT_DTYPE)) * sm_scale
    visible = offs_m[:, None] >= 0
    if CAUSAL:
        visible = offs_m[:, None] >= offs_m[None, :]
    if WINDOW > 0:
        visible = visible & (offs_m[:, None] <= offs_m[None, :] + WINDOW)
    qk = tl.where(visible, qk, float("-inf"))
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v = pdl.load_settled(v_ptr + rows[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :])  # as k
    pdl.enter(PDL)
    per = tl.maximum(tl.cdiv(tl.cdiv(plen, NSPLIT), BLOCK_N) * BLOCK_N, 1)
    splits = tl.cdiv(plen, per)  # the splits that held keys (the split kernel's rule)
    offs_s = tl.arange(0, NSPLIT)
    first = (b * tl.num_programs(1) + h) * NSPLIT  # this head's first partial
    held = (offs_s < splits)[:, None]
    ml = ml_ptr + (first + offs_s)[:, None] * 2 * L + offs_m[None, :]
    m_s = tl.load(ml, mask=held, other=NEG)
    l_s = tl.load(ml + L, mask=held, other=0.0)
    m_i = tl.max(m_s, 0)
    w = tl.exp(m_s - m_i[None, :])
    l_i = tl.sum(w * l_s, 0)
    acc = tl.zeros([L, BLOCK_DV], tl.float32)
    for c in tl.static_range(0, NSPLIT, CHUNK):
        s = c + tl.arange(0, CHUNK)
        part = ((first + s)[:, None, None] * L + offs_m[None, :, None]) * DV + offs_dv[None, None, :]
        a = tl.load(acc_ptr + part, mask=(s < splits)[:, None, None], other=0.0)
        w_c = tl.exp(tl.load(ml_ptr + (first + s)[:, None] * 2 * L + offs_m[None, :], mask=(s < splits)[:, None],
                             other=NEG) - m_i[None, :])
        acc += tl.sum(a * w_c[:, :, None], 0)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE))
    l_i = l_i * alpha + tl.sum(p, 1)
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :], out.to(o_ptr.dtype.element_ty))


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(device, rows: int, heads: int, nsplit: int, block: int, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums per (request, head, split), allocated once per shape for the largest batch the server
    admits, so CUDA graphs captured at any batch size keep valid addresses."""
    key = (str(device), heads, nsplit, block, dv)
    if key not in _SCRATCH or _SCRATCH[key][0].shape[0] < rows:
        _SCRATCH[key] = (torch.empty((rows, heads, nsplit, block, dv), dtype=torch.float32, device=device),
                         torch.empty((rows, heads, nsplit, 2, block), dtype=torch.float32, device=device))
    return _SCRATCH[key]


def block_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                    custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=None,
                    logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1, sinks=None,
                    window_kv_offsets=None, xai_temperature_len=-1, max_bs=None, out_cache_loc=None) -> bool:
    """Every request extends by exactly `max_len_extend` tokens (a speculative block): q/k/v_extend
    [bs * K, heads, dim], the prefix's cache slots in kv_indices[kv_indptr[b]:kv_indptr[b + 1]]. Writes
    o_extend and returns True; returns False for what it does not serve (custom masks, sinks, soft caps,
    scaled KV, block sizes other than 16 or 32, head dims without a config, GQA groups that are not powers
    of two), and then writes nothing. Given out_cache_loc [bs * K], the block's cache slots, it also stores k and
    v_extend there in k and v_buffer (rows of [heads, dim] by slot), which SGLang's KV write would do in a launch of
    its own."""
    block, bs = int(max_len_extend), qo_indptr.shape[0] - 1
    heads, dim = q_extend.shape[1], q_extend.shape[2]
    dv, kv_heads = v_extend.shape[2], k_extend.shape[1]
    config = CONFIGS.get((dim, dv))
    if (custom_mask is not None or sinks is not None or (logit_cap or 0) > 0 or (xai_temperature_len or 0) > 0
            or float(k_scale) != 1.0 or float(v_scale) != 1.0 or block not in (16, 32) or config is None
            or q_extend.shape[0] != bs * block or heads % kv_heads or k_buffer.dtype != q_extend.dtype or bs < 1
            or (heads // kv_heads * block) & (heads // kv_heads * block - 1)):  # a program's rows: a power of two
        return False
    config = dict(config)
    nsplit = config.pop("NSPLIT")
    acc, ml = _scratch(q_extend.device, max(bs, max_bs or 0), heads, nsplit, block, dv)
    sm_scale = sm_scale if sm_scale is not None else dim ** -0.5
    window = sliding_window_size if sliding_window_size is not None and sliding_window_size > 0 else 0
    common = dict(GROUP=heads // kv_heads, L=block, D=dim, DV=dv, NSPLIT=nsplit, WINDOW=window, DOT_DTYPE=DOT_DTYPE,
                  **pdl.options(q_extend.device))
    _prefix_split_kernel[(bs, kv_heads, nsplit)](
        q_extend, k_buffer, v_buffer, kv_indptr, kv_indices, acc, ml, sm_scale,
        q_extend.stride(0), q_extend.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k_extend, v_extend, k_extend if out_cache_loc is None else out_cache_loc, k_extend.stride(0), k_extend.stride(1),
        v_extend.stride(0), v_extend.stride(1), STORE=out_cache_loc is not None, **common, **config)
    merge_dv = min(MERGE_DV, dv)
    _merge_block_kernel[(bs, heads, dv // merge_dv)](
        q_extend, k_extend, v_extend, o_extend, kv_indptr, acc, ml, sm_scale,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        o_extend.stride(0), o_extend.stride(1), **common, CAUSAL=bool(is_causal), BLOCK_N=config["BLOCK_N"],
        BLOCK_DV=merge_dv, CHUNK=min(MERGE_CHUNK, nsplit), num_warps=4)
    return True


MERGE_DV, MERGE_CHUNK = 32, 8  # a merge program's value columns and the splits it reads at once: 32 registers a thread
# (head dim, value head dim) -> prefix-split launch config: Qwen3.5-4B's target (256, 4 KV heads) and the
# DFlash drafter (128, 8 KV heads), the best of sweeps at long prefixes (BENCHMARKS.md). The split kernel's gathered
# K/V loads are latency-bound: five stages in flight, not three, read an 8,192-key cache ~20% faster on the H100.
CONFIGS = {
    (256, 256): dict(NSPLIT=32, BLOCK_N=32, num_warps=4, num_stages=5),
    (128, 128): dict(NSPLIT=16, BLOCK_N=32, num_warps=4, num_stages=5),
}
