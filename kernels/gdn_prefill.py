"""Gated-DeltaNet prefill of short prompts as one recurrent kernel, in place of SGLang's chunked path.

SGLang 0.5.17 prefills a GDN layer with FLA's chunked kernels (`chunk_gated_delta_rule`: two l2-norms, a
cumsum, the intra-chunk solve, the chunk states, the output), launched eagerly between the pieces of the
prefill graph: their host launch time, not their GPU work, sets a short prompt's prefill. One recurrent
kernel over the prompt, on the GDN fold's state tile (kernels/gdn_verify.py), launches once; its GPU time
grows with the prompt's length (one step per token), so it serves prompts up to `MAX_TOKENS` (`serves`), in a
fresh prompt's whole prefill graph too: there the chunks would take less GPU time past ~64 tokens, but other bits than
the eager path's (BENCHMARKS.md, 2026-12-06, fiftieth session).

It is the chunked path's contract: reads each request's state from its slot, writes the final state back
in place, and returns the output and the chunk states `h` (the state before every 64-token chunk, which
the prefix cache's tracking copies from).
"""

import os

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.gdn_verify import _l2_normalize, _program_sequence, _update


@triton.jit
def _token(p_q, p_k, p_v, p_g, p_beta, live):
    """A token's q, k and v rows and its gate and beta (zeros past the request's end)."""
    return (tl.load(p_q, mask=live, other=0.0), tl.load(p_k, mask=live, other=0.0), tl.load(p_v, mask=live, other=0.0),
            tl.load(p_g, mask=live, other=0.0), tl.load(p_beta, mask=live, other=0.0))


@triton.jit(do_not_specialize=["T"])
def _gdn_prefill_kernel(q, k, v, g, beta, o, h, state, slots, cu_seqlens, scale, T, stride_q, stride_k, stride_v,
                        stride_state, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    i_v, i_n, i_hv, i_h, bos, eos = _program_sequence(cu_seqlens, H, HV)
    chunk0 = bos * 0  # this request's first chunk in h: the chunks of the requests before it
    for j in range(0, i_n):
        chunk0 += (tl.load(cu_seqlens + j + 1) - tl.load(cu_seqlens + j) + CHUNK - 1) // CHUNK

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
    p_state = state + tl.load(slots + i_n).to(tl.int64) * stride_state + tile
    p_h = h + chunk0 * HV * K * V + tile
    p_q = q + bos * stride_q + i_h * K + o_k
    p_k = k + bos * stride_k + i_h * K + o_k
    p_v = v + bos * stride_v + i_hv * V + o_v
    p_gb = bos * HV + i_hv
    p_o = o + (bos * HV + i_hv) * V + o_v

    b_h = tl.load(p_state)
    b_q, b_k, b_v, b_g, b_beta = _token(p_q, p_k, p_v, g + p_gb, beta + p_gb, eos > bos)
    for step in range(0, eos - bos):
        # The next token's inputs do not depend on the state: they load while this token's step (a chain of
        # reductions) runs, instead of opening the next step.
        p_q += stride_q
        p_k += stride_k
        p_v += stride_v
        p_gb += HV
        n_q, n_k, n_v, n_g, n_beta = _token(p_q, p_k, p_v, g + p_gb, beta + p_gb, bos + step + 1 < eos)
        if step % CHUNK == 0:
            tl.store(p_h, b_h.to(p_h.dtype.element_ty))
            p_h += HV * K * V
        b_qn = _l2_normalize(b_q.to(tl.float32)) * scale
        b_kn = _l2_normalize(b_k.to(tl.float32))
        b_h = _update(b_h, b_kn, b_v.to(tl.float32), b_g, b_beta)
        tl.store(p_o, tl.sum(b_h * b_qn[:, None], 0).to(p_o.dtype.element_ty))
        p_o += HV * V
        b_q, b_k, b_v, b_g, b_beta = n_q, n_k, n_v, n_g, n_beta
    tl.store(p_state, b_h)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ssm_states: torch.Tensor, cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
            scale: float | None = None, config: dict | None = None) -> tuple[torch.Tensor, None, torch.Tensor]:
    """SGLang's `TritonGDNKernel.extend` (l2-normalized q and k): q, k [1, T, H, K], v [1, T, HV, V], g and
    beta [1, T, HV] fp32 from the gating, the fp32 state pool [slots, HV, V, K] updated in place at
    cache_indices. Returns (o [1, T, HV, V], None, h [1, chunks, HV, V, K]) as the chunked path does."""
    config = config or CONFIG
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != triton.next_power_of_2(K) or V % config["BV"]:
        raise ValueError(f"GDN heads of {K} keys x {V} values do not fit the {K} x {config['BV']} state tile")
    requests = len(query_start_loc) - 1
    chunks = T // CHUNK + requests  # room for each request's ceil(len / CHUNK); the tracking reads only those
    o = q.new_empty(v.shape)
    h = k.new_empty(1, chunks, HV, V, K)
    _gdn_prefill_kernel[(V // config["BV"], requests * HV)](
        q, k, v, g, beta, o, h, ssm_states, cache_indices, query_start_loc, K ** -0.5 if scale is None else scale, T,
        q.stride(1), k.stride(1), v.stride(1), ssm_states.stride(0), H=H, HV=HV, K=K, V=V, CHUNK=CHUNK, **config,
        **pdl.options(q.device))
    return o, None, h


def serves(tokens: int) -> bool:
    """Whether this kernel, not FLA's chunks, prefills `tokens` (all requests of the batch together)."""
    return tokens <= MAX_TOKENS


CHUNK = 64  # FLA's chunk: h holds the state before every CHUNK tokens of each request, as the chunked path's
# Prompts up to MAX_TOKENS take this kernel, longer ones SGLang's chunks: where this kernel's GPU time (growing with
# the prompt) passes the chunks' host launch time (`qflash bench-kernels`). That depends on the host, so
# QFLASH_GDN_PREFILL_MAX_TOKENS moves the limit (0: always SGLang's chunks).
MAX_TOKENS = int(os.environ.get("QFLASH_GDN_PREFILL_MAX_TOKENS", "256"))
CONFIG = {"BV": 4, "num_warps": 1, "num_stages": 3}  # the GDN fold's tile for one request (gdn_verify.FOLD_CONFIGS)
