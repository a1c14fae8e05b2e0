"""Gated-DeltaNet target verify and its commit fold (SGLang's ReplaySSM spec path).

SGLang 0.5.17 verifies 16 draft tokens per request through a GDN layer with its recurrent kernel
(`fused_sigmoid_gating_delta_rule_update_kernel`, ring-writing mode): one warp per 128 x 32 state tile, one
step after another, each step summing over the 128 key rows twice in cross-lane shuffles, 16 dependent steps
that nothing hides. qflash's verify solves the block's 16 steps at once (`_block`: the gated delta rule unrolled
over the block: a triangular system and matrix products), which gives the same outputs up to fp32 rounding.

The commit replays the accepted steps from the ring (raw k, raw v, gate, beta) into the state one at a time
(`_update`, SGLang's expressions and order), on narrower tiles than SGLang's fold, so several warps share
each SM. The verify writes the rings SGLang's does, bit for bit.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _l2_normalize(x):
    return x / (tl.sqrt(tl.sum(x * x) + 1e-6))


@triton.jit
def _l2_normalize_rows(x):
    return x / tl.sqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit
def _update(b_h, b_kn, b_v, b_g, b_beta):
    """One step of the gated delta rule on a [K, BV] state tile (SGLang's expressions and order)."""
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_kn[:, None], 0)
    b_v *= b_beta
    b_h += b_kn[:, None] * b_v[None, :]
    return b_h


@triton.jit
def _program_sequence(cu_seqlens, H: tl.constexpr, HV: tl.constexpr):
    """This program's value-column tile, request, value head and key head, and the request's tokens [bos, eos)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, eos = pdl.load_settled(cu_seqlens + i_n).to(tl.int64), pdl.load_settled(cu_seqlens + i_n + 1).to(tl.int64)
    return i_v, i_n, i_hv, i_hv // (HV // H), bos, eos


@triton.jit
def _merge(inverse, a, o_t, HALF: tl.constexpr):
    """The inverse of I + A within diagonal blocks of 2 * HALF steps, from the inverse within blocks of HALF: the
    block [[X, 0], [C, Y]] has the inverse [[X^-1, 0], [-Y^-1 C X^-1, Y^-1]], a substitution by halves (entries
    stay those of true inverses, no cancelling powers of A)."""
    c = tl.where((o_t[:, None] // (2 * HALF) == o_t[None, :] // (2 * HALF)) & (o_t[:, None] // HALF != o_t[None, :] // HALF),
                 a, 0.0)
    return inverse - tl.dot(tl.dot(inverse, c, input_precision="ieee"), inverse, input_precision="ieee")


@triton.jit
def _block(b_h, b_qn, b_kn, b_v, b_g, b_beta, o_t, BT: tl.constexpr):
    """The outputs [BT, BV] of BT steps of the gated delta rule from the state b_h [K, BV] (rows past the sequence
    have zero gate and beta). Unrolled, the steps' updates u solve the triangular system
    (I + A) u = beta (v - decay k S0), A[t, i] = beta_t (k_t . k_i) decay_t / decay_i for i < t. Products with the
    K = 128 keys in tf32x3 (fp32's accuracy on tensor cores: in fp32 FMA they spill registers); the 16 x 16 merges
    of the inverse in fp32."""
    tl.static_assert(BT == 16, "the inverse is merged from pairs to 16 steps")
    g_cum = tl.cumsum(b_g, 0)
    within = o_t[:, None] >= o_t[None, :]
    decay = tl.exp(tl.where(within, g_cum[:, None] - g_cum[None, :], 0.0))
    kk = tl.dot(b_kn, tl.trans(b_kn), input_precision="tf32x3")
    a = tl.where(o_t[:, None] > o_t[None, :], b_beta[:, None] * kk * decay, 0.0)
    pairs = (o_t[:, None] // 2 == o_t[None, :] // 2) & (o_t[:, None] != o_t[None, :])
    inverse = (o_t[:, None] == o_t[None, :]).to(tl.float32) - tl.where(pairs, a, 0.0)
    inverse = _merge(_merge(_merge(inverse, a, o_t, 2), a, o_t, 4), a, o_t, 8)
    ks = tl.dot(b_kn, b_h, input_precision="tf32x3")
    from_start = tl.exp(g_cum)  # each step's decay of the block's initial state
    u = tl.dot(inverse, b_beta[:, None] * (b_v - from_start[:, None] * ks), input_precision="tf32x3")
    qk = tl.where(within, tl.dot(b_qn, tl.trans(b_kn), input_precision="tf32x3") * decay, 0.0)
    return from_start[:, None] * tl.dot(b_qn, b_h, input_precision="tf32x3") + tl.dot(qk, u, input_precision="tf32x3")


@triton.jit
def _gdn_verify_kernel(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, h0_source, h0_indices,
                   stride_h0_source, cu_seqlens, scale, stride_a, stride_q, stride_k, stride_v, stride_b,
                   rawv, rawk, ring_g, ring_beta, stride_rawv_slot, stride_rawk_slot, stride_g_slot,
                   stride_beta_slot, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, BT: tl.constexpr, MAX_CACHE_LEN: tl.constexpr, PDL: tl.constexpr):
    # Before the PDL wait: the state (the last commit's fold wrote it), the lengths and slots. Not the gates' inputs a
    # and b: the layer's input GEMM writes them, and it is the launch before this one where it runs the conv update
    # in its epilogue (server/hooks/gdn_input_proj.py).
    i_v, i_n, i_hv, i_h, bos, eos = _program_sequence(cu_seqlens, H, HV)
    step = tl.arange(0, BT)
    live = step < eos - bos  # this sequence's steps, at most BT (the launcher's contract)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    slot = pdl.load_settled(h0_indices + i_n).to(tl.int64)
    tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
    b_h = pdl.load_settled(h0_source + slot * stride_h0_source + tile, mask=(slot >= 0) & (tile >= 0),  # as the fold
                           other=0.0)
    dt_bias_h, a_log_h = pdl.load_weights(dt_bias + i_hv).to(tl.float32), pdl.load_weights(A_log + i_hv).to(tl.float32)
    pdl.enter(PDL)
    b_b = tl.load(b + (bos + step) * stride_b + i_hv, mask=live, other=0.0).to(tl.float32)
    b_a = tl.load(a + (bos + step) * stride_a + i_hv, mask=live, other=0.0).to(tl.float32)
    x = b_a + dt_bias_h
    beta_x = softplus_beta * x
    softplus_x = tl.where(beta_x <= softplus_threshold, (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)), x)
    b_g = tl.where(live, -tl.exp(a_log_h) * softplus_x, 0.0)
    b_beta = tl.where(live, 1.0 / (1.0 + tl.exp(-b_b)), 0.0)
    row = (bos + step)[:, None]
    b_q = tl.load(q + row * stride_q + i_h * K + o_k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + row * stride_k + i_h * K + o_k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    b_v = tl.load(v + row * stride_v + i_hv * V + o_v[None, :], mask=live[:, None], other=0.0).to(tl.float32)

    ringed = live & (step < MAX_CACHE_LEN) & (slot >= 0)  # the fold's ring: steps past it are never committed
    ring_v = rawv + slot * stride_rawv_slot + (i_hv * MAX_CACHE_LEN + step[:, None]) * V + o_v[None, :]
    tl.store(ring_v, b_v.to(rawv.dtype.element_ty), mask=ringed[:, None])
    if i_v == 0:
        ring_k = rawk + slot * stride_rawk_slot + (i_h * MAX_CACHE_LEN + step[:, None]) * K + o_k[None, :]
        tl.store(ring_k, b_k.to(rawk.dtype.element_ty), mask=ringed[:, None])
        tl.store(ring_g + slot * stride_g_slot + i_hv * MAX_CACHE_LEN + step, b_g, mask=ringed)
        tl.store(ring_beta + slot * stride_beta_slot + i_hv * MAX_CACHE_LEN + step, b_beta, mask=ringed)

    b_o = _block(b_h, _l2_normalize_rows(b_q) * scale, _l2_normalize_rows(b_k), b_v, b_g, b_beta, step, BT)
    tl.store(o + ((bos + step) * HV + i_hv)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=live[:, None])


@triton.jit
def _gdn_fold_kernel(state, rawv, rawk, ring_g, ring_beta, slots, accept_lens, track_slots, track_steps,
                 stride_state_layer, stride_state_slot, stride_rawv_layer, stride_rawv_slot, stride_rawk_layer,
                 stride_rawk_slot, stride_g_layer, stride_g_slot, stride_beta_layer, stride_beta_slot,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 MAX_CACHE_LEN: tl.constexpr, HAS_TRACK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    i_v, i_n, i_lhv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    layer, i_hv = (i_lhv // HV).to(tl.int64), i_lhv % HV
    i_h = i_hv // (HV // H)
    slot = tl.load(slots + i_n).to(tl.int64)
    n_commit = tl.load(accept_lens + i_n).to(tl.int32)
    if slot >= 0 and n_commit > 0:
        o_k = tl.arange(0, K)
        o_v = i_v * BV + tl.arange(0, BV)
        tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        state += layer * stride_state_layer
        p_h = state + slot * stride_state_slot + tile
        ring_v = rawv + layer * stride_rawv_layer + slot * stride_rawv_slot + i_hv * MAX_CACHE_LEN * V + o_v
        ring_k = rawk + layer * stride_rawk_layer + slot * stride_rawk_slot + i_h * MAX_CACHE_LEN * K + o_k
        ring_gate = ring_g + layer * stride_g_layer + slot * stride_g_slot + i_hv * MAX_CACHE_LEN
        ring_b = ring_beta + layer * stride_beta_layer + slot * stride_beta_slot + i_hv * MAX_CACHE_LEN
        track_slot, track_step = -1, -1
        if HAS_TRACK:  # a prefix-cache checkpoint slot that takes the state after step track_step
            track_slot = tl.load(track_slots + i_n).to(tl.int64)
            track_step = tl.load(track_steps + i_n).to(tl.int32)

        b_h = tl.load(p_h).to(tl.float32)
        for step in range(0, n_commit):
            b_kn = _l2_normalize(tl.load(ring_k + step * K).to(tl.float32))
            b_v = tl.load(ring_v + step * V).to(tl.float32)
            b_h = _update(b_h, b_kn, b_v, tl.load(ring_gate + step), tl.load(ring_b + step))
            if step == track_step and track_slot >= 0:
                tl.store(state + track_slot * stride_state_slot + tile, b_h)
        tl.store(p_h, b_h)


def verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float,
           softplus_threshold: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
           initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
           replayssm_rawv: torch.Tensor, replayssm_rawk: torch.Tensor, replayssm_g: torch.Tensor,
           replayssm_beta: torch.Tensor, scale: float | None = None, config: dict | None = None) -> torch.Tensor:
    """SGLang's `fused_sigmoid_gating_delta_rule_update(..., use_qk_l2norm_in_kernel=True, disable_state_update=True,
    cache_ring=True)` for GDN with one block of BLOCK_STEPS tokens per request (`takes`): q, k [1, T, H, K],
    v [1, T, HV, V], a, b [T, HV], the fp32 state [slots, HV, V, K] read only, the per-layer rings written; returns
    o [1, T, HV, V]. config: the bench's."""
    if not takes(k, cu_seqlens):
        raise ValueError(f"the GDN verify takes {BLOCK_STEPS} tokens per request, not {k.shape[1]} for {len(cu_seqlens) - 1}")
    config = config or config_for(VERIFY_CONFIGS, len(cu_seqlens) - 1)
    H, K = k.shape[2:]
    HV, V = v.shape[2], v.shape[3]
    check_shape(K, V, config)
    o = q.new_empty(v.shape)
    _gdn_verify_kernel[(V // config["BV"], (len(cu_seqlens) - 1) * HV)](
        A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, initial_state_source,
        initial_state_indices, initial_state_source.stride(0), cu_seqlens, K ** -0.5 if scale is None else scale,
        a.stride(-2), q.stride(1), k.stride(1), v.stride(1), b.stride(-2), replayssm_rawv, replayssm_rawk,
        replayssm_g, replayssm_beta, replayssm_rawv.stride(0), replayssm_rawk.stride(0), replayssm_g.stride(0),
        replayssm_beta.stride(0), H=H, HV=HV, K=K, V=V, BT=BLOCK_STEPS, MAX_CACHE_LEN=replayssm_rawv.shape[-2], **config,
        **pdl.options(q.device))
    return o


def fold_all_layers(checkpoint_state: torch.Tensor, rawv_cache: torch.Tensor, rawk_cache: torch.Tensor,
                    g_cache: torch.Tensor, beta_cache: torch.Tensor, ssm_state_indices: torch.Tensor,
                    accept_lens: torch.Tensor, max_cache_len: int, num_k_heads: int,
                    mamba_track_indices: torch.Tensor | None = None, mamba_steps_to_track: torch.Tensor | None = None,
                    use_qk_l2norm_in_kernel: bool = True, null_block_id: int = -1, config: dict | None = None) -> None:
    """SGLang's `commit_gdn_replayssm_fold_all_layers` (same arguments) on qflash's tile: replays each request's
    accepted steps of every layer into checkpoint_state [layers, slots, HV, V, K] in place. config: the bench's."""
    assert use_qk_l2norm_in_kernel and null_block_id == -1, "the GDN verify above normalizes q and k; -1 is no slot"
    config = config or config_for(FOLD_CONFIGS, ssm_state_indices.shape[0])
    layers, _, HV, V, K = checkpoint_state.shape
    check_shape(K, V, config)
    has_track = mamba_track_indices is not None and mamba_steps_to_track is not None
    tracks = (mamba_track_indices, mamba_steps_to_track) if has_track else (ssm_state_indices, accept_lens)
    _gdn_fold_kernel[(V // config["BV"], ssm_state_indices.shape[0], layers * HV)](
        checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache, ssm_state_indices, accept_lens, *tracks,
        *checkpoint_state.stride()[:2], *rawv_cache.stride()[:2], *rawk_cache.stride()[:2], *g_cache.stride()[:2],
        *beta_cache.stride()[:2], H=num_k_heads, HV=HV, K=K, V=V, MAX_CACHE_LEN=max_cache_len, HAS_TRACK=has_track,
        **config, **pdl.options(checkpoint_state.device))


def takes(k: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether a verify is one block per request, as DFLASH's always is (every request verifies its draft block),
    read from the shapes alone (the lengths in cu_seqlens are on the GPU)."""
    return k.shape[1] == BLOCK_STEPS * (len(cu_seqlens) - 1)


def head_views(rows: torch.Tensor, heads: tuple) -> tuple[torch.Tensor, ...]:
    """q, k and v [1, T, heads, dim] as views of the conv's output rows [T, q|k|v], a token's row apart (qflash's GDN
    kernels read strided rows, so nothing is copied); heads: (count, dim) of q, k and v."""
    parts = rows.split([count * dim for count, dim in heads], dim=-1)
    return tuple(part.unflatten(-1, shape)[None] for part, shape in zip(parts, heads))


def check_shape(k: int, v: int, config: dict) -> None:
    if k != triton.next_power_of_2(k) or v % config["BV"]:
        raise ValueError(f"GDN heads of {k} keys x {v} values do not fit the {k} x {config['BV']} state tile")


def config_for(table: dict, requests: int) -> dict:
    """A kernel's launch config for a batch: the entry for the fewest requests that is at least `requests`, else
    the widest."""
    return table[min((n for n in table if n >= requests), default=max(table))]


BLOCK_STEPS = 16  # the verify's steps solved at once (`_block`): DFLASH's block (preset's draft tokens)
# Launch configs by requests in the batch, the fastest of `qflash bench-kernels --skip-gemms` on the H200
# (BENCHMARKS.md). The verify: BV value columns of all K keys per program. The fold: BV columns, one warp, the
# steps one at a time.
VERIFY_CONFIGS = {1: {"BV": 32, "num_warps": 4, "num_stages": 1}, 8: {"BV": 64, "num_warps": 4, "num_stages": 1}}
FOLD_CONFIGS = {1: {"BV": 4, "num_warps": 1, "num_stages": 3}, 8: {"BV": 16, "num_warps": 1, "num_stages": 3}}
