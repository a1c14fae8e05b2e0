"""Gated-DeltaNet target verify for the ReplaySSM fold, with each draft step's inputs loaded a step ahead.

SGLang 0.5.17 verifies 16 draft tokens per request through a GDN layer with its recurrent kernel
(`fused_sigmoid_gating_delta_rule_update_kernel`, ring-writing mode): one warp per 128 x 32 state tile walks
the steps, and each step loads its q, k, v, a, b and then waits for them. With one warp per SM nothing
hides that wait, or the chain of exp, log, sqrt and cross-lane sums that turns the inputs into gate, beta
and normalized q and k: ~30 us per layer on the H200 for ~100 KB of inputs. Here step t + 1's loads and
that chain are issued right after step t's state update, in one branch-free loop body (the ring stores
are masked, not branched), so the two overlap. Tile, warp count and every arithmetic expression are
SGLang's, so the outputs and the rings that the commit's fold replays (k before its l2norm, v before the
delta rule, gate, beta) are the same bits; the loop-invariant A_log and dt_bias are loaded once.
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _gdn_verify_kernel(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, h0_source, h0_indices,
                       stride_h0_source, cu_seqlens, scale, T, stride_a, stride_q, stride_k, stride_v, stride_b,
                       rawv, rawk, ring_g, ring_beta, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, stride_rawv_slot: tl.constexpr,
                       stride_rawk_slot: tl.constexpr, stride_g_slot: tl.constexpr, stride_beta_slot: tl.constexpr,
                       MAX_CACHE_LEN: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos  # this sequence's steps; the argument is all sequences' (unspecialized, as SGLang's)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    p_q = q + bos * stride_q + i_h * K + o_k
    p_k = k + bos * stride_k + i_h * K + o_k
    p_v = v + bos * stride_v + i_hv * V + o_v
    p_b = b + bos * stride_b + i_hv
    p_a = a + bos * stride_a + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    slot = tl.load(h0_indices + i_n).to(tl.int64)
    if slot >= 0:
        p_h0 = h0_source + slot * stride_h0_source + i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        b_h += tl.load(p_h0, mask=mask_h, other=0).to(tl.float32)
    b_A_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)

    ring_v = rawv + slot * stride_rawv_slot + i_hv * MAX_CACHE_LEN * V + o_v
    ring_k = rawk + slot * stride_rawk_slot + i_h * MAX_CACHE_LEN * K + o_k
    ring_gate = ring_g + slot * stride_g_slot + i_hv * MAX_CACHE_LEN
    ring_b = ring_beta + slot * stride_beta_slot + i_hv * MAX_CACHE_LEN

    b_k, b_v, b_g, b_beta, b_qn, b_kn = _step_inputs(p_q, p_k, p_v, p_b, p_a, mask_k, mask_v, True, b_A_log, b_dt_bias,
                                                     softplus_beta, softplus_threshold, scale)
    for step in range(0, T):
        # the fold's ring (raw k, raw v, gate, beta); steps past its length are never committed
        ring = (slot >= 0) & (step < MAX_CACHE_LEN)
        tl.store(ring_v + step * V, b_v.to(rawv.dtype.element_ty), mask=mask_v & ring)
        tl.store(ring_k + step * K, b_k.to(rawk.dtype.element_ty), mask=mask_k & ring & (i_v == 0))
        tl.store(ring_gate + step, b_g, mask=ring & (i_v == 0))
        tl.store(ring_b + step, b_beta, mask=ring & (i_v == 0))

        b_h *= tl.exp(b_g)
        b_u = b_v - tl.sum(b_h * b_kn[:, None], 0)
        b_u *= b_beta
        b_h += b_kn[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_qn[:, None], 0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)

        # the next step's inputs and everything made from them alone, free to overlap the state update above
        p_q += stride_q
        p_k += stride_k
        p_v += stride_v
        p_b += stride_b
        p_a += stride_a
        p_o += HV * V
        b_k, b_v, b_g, b_beta, b_qn, b_kn = _step_inputs(p_q, p_k, p_v, p_b, p_a, mask_k, mask_v, step + 1 < T, b_A_log,
                                                         b_dt_bias, softplus_beta, softplus_threshold, scale)


@triton.jit
def _step_inputs(p_q, p_k, p_v, p_b, p_a, mask_k, mask_v, valid, b_A_log, b_dt_bias, softplus_beta,
                 softplus_threshold, scale):
    """One step's raw k and v, gate, beta and l2-normalized q (scaled) and k: SGLang's expressions."""
    b_q = tl.load(p_q, mask=mask_k & valid, other=0).to(tl.float32)
    b_k = tl.load(p_k, mask=mask_k & valid, other=0).to(tl.float32)
    b_v = tl.load(p_v, mask=mask_v & valid, other=0).to(tl.float32)
    b_b = tl.load(p_b, mask=valid, other=0).to(tl.float32)
    b_a = tl.load(p_a, mask=valid, other=0).to(tl.float32)
    x = b_a + b_dt_bias
    beta_x = softplus_beta * x
    softplus_x = tl.where(beta_x <= softplus_threshold, (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)), x)
    b_g = -tl.exp(b_A_log) * softplus_x
    b_beta = 1.0 / (1.0 + tl.exp(-b_b))
    b_qn = b_q / (tl.sqrt(tl.sum(b_q * b_q) + 1e-6))
    b_kn = b_k / (tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
    b_qn = b_qn * scale
    return b_k, b_v, b_g, b_beta, b_qn, b_kn


def fold_verify(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float,
                softplus_threshold: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                replayssm_rawv: torch.Tensor, replayssm_rawk: torch.Tensor, replayssm_g: torch.Tensor,
                replayssm_beta: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The verify of `fused_sigmoid_gating_delta_rule_update(..., use_qk_l2norm_in_kernel=True,
    disable_state_update=True, cache_ring=True)` for GDN (not KDA) with varlen sequences: q, k [1, T, H, K],
    v [1, T, HV, V], a, b [T, HV]; returns o [1, T, HV, V]; the state is read, never written."""
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = len(cu_seqlens) - 1
    BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 32)
    assert BK == K, "one program covers the whole key dimension"
    o = q.new_empty(v.shape)
    _gdn_verify_kernel[(triton.cdiv(V, BV), N * HV)](
        A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, o, initial_state_source,
        initial_state_indices, initial_state_source.stride(0), cu_seqlens, K ** -0.5 if scale is None else scale, T,
        a.stride(-2), q.stride(1), k.stride(1), v.stride(1), b.stride(-2), replayssm_rawv, replayssm_rawk,
        replayssm_g, replayssm_beta, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        stride_rawv_slot=replayssm_rawv.stride(0), stride_rawk_slot=replayssm_rawk.stride(0),
        stride_g_slot=replayssm_g.stride(0), stride_beta_slot=replayssm_beta.stride(0),
        MAX_CACHE_LEN=replayssm_rawv.shape[-2], **CONFIG)
    return o


# SGLang's launch of the kernel it mirrors: the reductions' order depends on the warp count, and the fold's
# replay matches this one.
CONFIG = {"num_warps": 1, "num_stages": 3}
