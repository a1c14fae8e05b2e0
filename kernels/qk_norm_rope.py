"""The gated attention layer's prologue: per-head Gemma RMSNorm of q and k, then NeoX rotary on their first
rotary_dim channels, after programmatic dependent launch like every qflash kernel.

SGLang's Triton kernel for this step (`fused_qk_gemma_rmsnorm_rope_gate`) launches without PDL, so in a verify it waits
for the qkv GEMM before it to drain and then pays its own launch: 3.6 us a layer on an H100 (BENCHMARKS.md,
2026-12-05). Here one program per (token, head) loads the head once, and the rotary partner of each channel (i + half
below half, i - half above it, itself past rotary_dim) once more, normalises both, rounds them to the output dtype
as SGLang does, and rotates in fp32; a query head's program also copies the head's gate out of q_gate (SGLang's
layer views the gate as [T, hidden], which the interleaved rows are not).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _qk_norm_rope_kernel(qg_ptr, k_ptr, q_out_ptr, k_out_ptr, gate_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, eps,
                         stride_qg, stride_k, stride_cs, Q_HEADS: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    if head < Q_HEADS:
        src = qg_ptr + token * stride_qg + head * Q_HEAD_STRIDE
        dst = q_out_ptr + (token * Q_HEADS + head) * HEAD_DIM
        w_ptr = q_w_ptr
        gate = tl.load(src + HEAD_DIM + offs, mask=mask)
        tl.store(gate_ptr + (token * Q_HEADS + head) * HEAD_DIM + offs, gate, mask=mask)
    else:
        src = k_ptr + token * stride_k + (head - Q_HEADS) * HEAD_DIM
        dst = k_out_ptr + (token * (tl.num_programs(1) - Q_HEADS) + head - Q_HEADS) * HEAD_DIM
        w_ptr = k_w_ptr
    HALF: tl.constexpr = ROTARY_DIM // 2
    partner = tl.where(offs < HALF, offs + HALF, tl.where(offs < ROTARY_DIM, offs - HALF, offs))
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    x = (x * inv_rms * (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + 1.0))
    xp = (xp * inv_rms * (tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32) + 1.0))
    x = x.to(q_out_ptr.dtype.element_ty).to(tl.float32)  # rotated as the output dtype holds them
    xp = xp.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    rot = offs < ROTARY_DIM
    angle = tl.where(offs < HALF, offs, offs - HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + angle, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + angle, mask=rot, other=0.0).to(tl.float32)
    out = tl.where(offs < HALF, x * cos - xp * sin, tl.where(rot, x * cos + xp * sin, x))
    tl.store(dst + offs, out.to(q_out_ptr.dtype.element_ty), mask=mask)


def takes(q_gate: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
          num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int, has_gate: bool = True) -> bool:
    """Whether the kernel covers this call of SGLang's: rows of unit stride, q_gate interleaving each head's query
    and gate (has_gate), an even rotary_dim within the head, one position per token."""
    rows = q_gate.shape[0]
    return (has_gate and q_gate.dim() == 2 and k.dim() == 2 and q_gate.stride(1) == 1 and k.stride(1) == 1
            and q_gate.shape[1] == 2 * num_q_heads * head_dim and k.shape == (rows, num_kv_heads * head_dim)
            and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim and cos_sin_cache.stride(-1) == 1
            and positions.shape == (rows,) and k.dtype == q_gate.dtype)


def qk_norm_rope(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, rotary_dim: int, has_gate: bool = True) -> tuple[torch.Tensor, ...]:
    """SGLang's `fused_qk_gemma_rmsnorm_rope_gate` for what `takes` accepts: (q [T, heads x head_dim], k [T, kv heads x
    head_dim], gate [T, heads, head_dim])."""
    T = q_gate.shape[0]
    q_out = q_gate.new_empty((T, num_q_heads * head_dim))
    k_out = k.new_empty((T, num_kv_heads * head_dim))
    gate = q_gate.new_empty((T, num_q_heads, head_dim))
    if T:
        _qk_norm_rope_kernel[(T, num_q_heads + num_kv_heads)](
            q_gate, k, q_out, k_out, gate, q_weight, k_weight, cos_sin_cache, positions, eps, q_gate.stride(0), k.stride(0),
            cos_sin_cache.stride(0), Q_HEADS=num_q_heads, Q_HEAD_STRIDE=2 * head_dim, HEAD_DIM=head_dim,
            ROTARY_DIM=rotary_dim, BLOCK=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS,
            **pdl.options(q_gate.device))
    return q_out, k_out, gate


NUM_WARPS = 4  # SGLang's: a head's sum of squares in its order
