"""An attention layer's prologue in one launch: per-head RMSNorm of q and k, then NeoX rotary on their first
rotary_dim channels, after programmatic dependent launch like every qflash kernel.

SGLang runs this step on kernels launched without PDL: the target's gated attention on a Triton kernel
(`fused_qk_gemma_rmsnorm_rope_gate`), the DFlash drafter's on a JIT q/k norm and then a rotary kernel. In a verify
each waits for the kernel before it to drain and pays its own launch (the target's: a 3.6 us gap a layer on an H100,
BENCHMARKS.md, 2026-12-05; the drafter's not measured). Here one program per (token, head) loads the head once,
and the rotary partner of each channel (i + half below half, i - half above it, itself past rotary_dim) once more,
normalises both, rounds them to the output dtype (as SGLang's kernels store the norm before rotating), and rotates
in fp32. Two forms:
- `qk_norm_rope`, the target's: Gemma weights (1 + w), q interleaved with the gate head by head in q_gate, new
  q, k and gate tensors out (the gate copied: SGLang's layer views it as [T, hidden]);
- `qk_norm_rope_`, the drafter's: plain weights, q and k rotated in place (column slices of the qkv output).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, gate_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, eps,
                         weight_offset, stride_q, stride_k, stride_qo, stride_ko, stride_cs, Q_HEADS: tl.constexpr,
                         Q_HEAD_STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                         GATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    if head < Q_HEADS:
        src = q_ptr + token * stride_q + head * Q_HEAD_STRIDE
        dst = q_out_ptr + token * stride_qo + head * HEAD_DIM
        w_ptr = q_w_ptr
        if GATE:  # the head's gate follows its query in q_gate
            gate = tl.load(src + HEAD_DIM + offs, mask=mask)
            tl.store(gate_ptr + (token * Q_HEADS + head) * HEAD_DIM + offs, gate, mask=mask)
    else:
        src = k_ptr + token * stride_k + (head - Q_HEADS) * HEAD_DIM
        dst = k_out_ptr + token * stride_ko + (head - Q_HEADS) * HEAD_DIM
        w_ptr = k_w_ptr
    HALF: tl.constexpr = ROTARY_DIM // 2
    partner = tl.where(offs < HALF, offs + HALF, tl.where(offs < ROTARY_DIM, offs - HALF, offs))
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    x = (x * inv_rms * (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset))
    xp = (xp * inv_rms * (tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32) + weight_offset))
    x = x.to(q_out_ptr.dtype.element_ty).to(tl.float32)  # rotated as the output dtype holds them
    xp = xp.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    rot = offs < ROTARY_DIM
    angle = tl.where(offs < HALF, offs, offs - HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + angle, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + angle, mask=rot, other=0.0).to(tl.float32)
    out = tl.where(offs < HALF, x * cos - xp * sin, tl.where(rot, x * cos + xp * sin, x))
    tl.debug_barrier()  # in place: every thread has read its channels and their partners before any is written
    tl.store(dst + offs, out.to(q_out_ptr.dtype.element_ty), mask=mask)


def _launch(q, k, q_out, k_out, gate, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, q_heads,
            kv_heads, q_head_stride, head_dim, rotary_dim):
    if q.shape[0]:
        _qk_norm_rope_kernel[(q.shape[0], q_heads + kv_heads)](
            q, k, q_out, k_out, q_out if gate is None else gate, q_weight, k_weight, cos_sin_cache, positions, eps,
            weight_offset, q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0), cos_sin_cache.stride(0),
            Q_HEADS=q_heads, Q_HEAD_STRIDE=q_head_stride, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
            GATE=gate is not None, BLOCK=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS, **pdl.options(q.device))


def _rows(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, head_dim: int,
          rotary_dim: int) -> bool:
    """Rows of unit stride, one position per token, an even rotary_dim within the head."""
    return (q.dim() == 2 and k.dim() == 2 and q.stride(1) == 1 and k.stride(1) == 1 and k.shape[0] == q.shape[0]
            and k.shape[1] % head_dim == 0 and k.dtype == q.dtype and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim
            and cos_sin_cache.dim() == 2 and cos_sin_cache.stride(1) == 1 and cos_sin_cache.shape[1] == rotary_dim
            and positions.shape == (q.shape[0],))


def takes(q_gate: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
          num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, has_gate: bool = True) -> bool:
    """Whether `qk_norm_rope` covers this call of SGLang's target kernel: q_gate interleaving each head's query and
    gate (has_gate)."""
    return (has_gate and _rows(q_gate, k, cos_sin_cache, positions, head_dim, rotary_dim)
            and q_gate.shape[1] == 2 * num_q_heads * head_dim and k.shape[1] == num_kv_heads * head_dim)


def qk_norm_rope(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rotary_dim: int, has_gate: bool = True) -> tuple[torch.Tensor, ...]:
    """SGLang's `fused_qk_gemma_rmsnorm_rope_gate` for what `takes` accepts: (q [T, heads x head_dim], k [T, kv heads x
    head_dim], gate [T, heads, head_dim])."""
    T = q_gate.shape[0]
    q_out = q_gate.new_empty((T, num_q_heads * head_dim))
    k_out = k.new_empty((T, num_kv_heads * head_dim))
    gate = q_gate.new_empty((T, num_q_heads, head_dim))
    _launch(q_gate, k, q_out, k_out, gate, q_weight, k_weight, cos_sin_cache, positions, eps, 1.0, num_q_heads,
            num_kv_heads, 2 * head_dim, head_dim, rotary_dim)
    return q_out, k_out, gate


def takes_in_place(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                   head_dim: int) -> bool:
    """Whether `qk_norm_rope_` covers q [T, heads x head_dim] and k (rotary over cos_sin_cache's width)."""
    return q.shape[-1] % head_dim == 0 and _rows(q, k, cos_sin_cache, positions, head_dim, cos_sin_cache.shape[-1])


def qk_norm_rope_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, head_dim: int) -> None:
    """q and k (`takes_in_place`) <- NeoX rotary of their per-head RMSNorm (plain weights), in place."""
    _launch(q, k, q, k, None, q_weight, k_weight, cos_sin_cache, positions, eps, 0.0, q.shape[1] // head_dim,
            k.shape[1] // head_dim, head_dim, head_dim, cos_sin_cache.shape[1])


NUM_WARPS = 4  # SGLang's: a head's sum of squares in its order
