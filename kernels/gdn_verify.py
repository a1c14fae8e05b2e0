"""Gated-DeltaNet target verify and its commit fold (SGLang's ReplaySSM spec path) on narrower state tiles.

SGLang 0.5.17 verifies 16 draft tokens per request through a GDN layer with its recurrent kernel
(`fused_sigmoid_gating_delta_rule_update_kernel`, ring-writing mode) on one warp per 128 x 32 state tile:
128 programs, one per SM. Each step sums over the 128 key rows twice, cross-lane shuffles in that one warp,
and nothing else on the SM hides them. Tiles of BV < 32 value columns put 32 / BV warps on each SM and cut
each warp's shuffles by as much.

The commit replays the accepted steps from the ring (raw k, raw v, gate, beta) into the state; it must
give the verify's bits, which SGLang's fold does only for SGLang's tile. So both kernels are here, run one
step function (`_update`) on one tile (`config_for`), and write and read the same rings as SGLang's.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _l2_normalize(x):
    return x / (tl.sqrt(tl.sum(x * x) + 1e-6))


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
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_v, i_n, i_hv, i_hv // (HV // H), bos, eos


@triton.jit(do_not_specialize=["T"])
def _gdn_verify_kernel(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, h0_source, h0_indices,
                   stride_h0_source, cu_seqlens, scale, T, stride_a, stride_q, stride_k, stride_v, stride_b,
                   rawv, rawk, ring_g, ring_beta, stride_rawv_slot, stride_rawk_slot, stride_g_slot,
                   stride_beta_slot, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, MAX_CACHE_LEN: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    i_v, i_n, i_hv, i_h, bos, eos = _program_sequence(cu_seqlens, H, HV)
    T = eos - bos  # this sequence's steps; the argument is all sequences' (unspecialized, as SGLang's)

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_q = q + bos * stride_q + i_h * K + o_k
    p_k = k + bos * stride_k + i_h * K + o_k
    p_v = v + bos * stride_v + i_hv * V + o_v
    p_b = b + bos * stride_b + i_hv
    p_a = a + bos * stride_a + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v

    slot = tl.load(h0_indices + i_n).to(tl.int64)
    tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
    b_h = tl.load(h0_source + slot * stride_h0_source + tile, mask=(slot >= 0) & (tile >= 0), other=0.0)  # as the fold
    b_A_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
    ring_v = rawv + slot * stride_rawv_slot + i_hv * MAX_CACHE_LEN * V + o_v
    ring_k = rawk + slot * stride_rawk_slot + i_h * MAX_CACHE_LEN * K + o_k
    ring_gate = ring_g + slot * stride_g_slot + i_hv * MAX_CACHE_LEN
    ring_b = ring_beta + slot * stride_beta_slot + i_hv * MAX_CACHE_LEN

    for step in range(0, T):
        b_q = tl.load(p_q).to(tl.float32)
        b_k = tl.load(p_k).to(tl.float32)
        b_v = tl.load(p_v).to(tl.float32)
        b_b = tl.load(p_b).to(tl.float32)
        b_a = tl.load(p_a).to(tl.float32)
        x = b_a + b_dt_bias
        beta_x = softplus_beta * x
        softplus_x = tl.where(beta_x <= softplus_threshold, (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)), x)
        b_g = -tl.exp(b_A_log) * softplus_x
        b_beta = 1.0 / (1.0 + tl.exp(-b_b))

        if slot >= 0 and step < MAX_CACHE_LEN:  # the fold's ring: steps past it are never committed
            tl.store(ring_v + step * V, b_v.to(rawv.dtype.element_ty))
            if i_v == 0:
                tl.store(ring_k + step * K, b_k.to(rawk.dtype.element_ty))
                tl.store(ring_gate + step, b_g)
                tl.store(ring_b + step, b_beta)

        b_qn = _l2_normalize(b_q) * scale
        b_h = _update(b_h, _l2_normalize(b_k), b_v, b_g, b_beta)
        tl.store(p_o, tl.sum(b_h * b_qn[:, None], 0).to(p_o.dtype.element_ty))

        p_q += stride_q
        p_k += stride_k
        p_v += stride_v
        p_b += stride_b
        p_a += stride_a
        p_o += HV * V


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
    cache_ring=True)` for GDN with varlen sequences: q, k [1, T, H, K], v [1, T, HV, V], a, b [T, HV], the fp32
    state [slots, HV, V, K] read only, the per-layer rings written; returns o [1, T, HV, V]. config: the bench's."""
    config = config or config_for(len(cu_seqlens) - 1)
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    check_shape(K, V, config)
    o = q.new_empty(v.shape)
    _gdn_verify_kernel[(V // config["BV"], (len(cu_seqlens) - 1) * HV)](
        A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, initial_state_source,
        initial_state_indices, initial_state_source.stride(0), cu_seqlens, K ** -0.5 if scale is None else scale, T,
        a.stride(-2), q.stride(1), k.stride(1), v.stride(1), b.stride(-2), replayssm_rawv, replayssm_rawk,
        replayssm_g, replayssm_beta, replayssm_rawv.stride(0), replayssm_rawk.stride(0), replayssm_g.stride(0),
        replayssm_beta.stride(0), H=H, HV=HV, K=K, V=V, MAX_CACHE_LEN=replayssm_rawv.shape[-2], **config,
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
    config = config or config_for(ssm_state_indices.shape[0])
    layers, _, HV, V, K = checkpoint_state.shape
    check_shape(K, V, config)
    has_track = mamba_track_indices is not None and mamba_steps_to_track is not None
    tracks = (mamba_track_indices, mamba_steps_to_track) if has_track else (ssm_state_indices, accept_lens)
    _gdn_fold_kernel[(V // config["BV"], ssm_state_indices.shape[0], layers * HV)](
        checkpoint_state, rawv_cache, rawk_cache, g_cache, beta_cache, ssm_state_indices, accept_lens, *tracks,
        *checkpoint_state.stride()[:2], *rawv_cache.stride()[:2], *rawk_cache.stride()[:2], *g_cache.stride()[:2],
        *beta_cache.stride()[:2], H=num_k_heads, HV=HV, K=K, V=V, MAX_CACHE_LEN=max_cache_len, HAS_TRACK=has_track,
        **config, **pdl.options(checkpoint_state.device))


def check_shape(k: int, v: int, config: dict) -> None:
    if k != triton.next_power_of_2(k) or v % config["BV"]:
        raise ValueError(f"GDN heads of {k} keys x {v} values do not fit the {k} x {config['BV']} state tile")


def config_for(requests: int) -> dict:
    """The tile for a batch: the entry for the fewest requests that is at least `requests`, else the widest.
    The verify and the fold of one cycle see the same batch (a batch of 1 is never padded), so the same tile."""
    return CONFIGS[min((n for n in CONFIGS if n >= requests), default=max(CONFIGS))]


# The state tile both kernels run, by requests in the batch: BV value columns of all K keys, one warp (its reduction
# trees are the bits). The fastest tiles of `qflash bench-kernels --skip-gemms` on the H200 (BENCHMARKS.md).
CONFIGS = {1: {"BV": 4, "num_warps": 1, "num_stages": 3}, 8: {"BV": 16, "num_warps": 1, "num_stages": 3}}
