"""The attention output gate, attn * sigmoid(gate) in place, that also writes the int8 rows and per-token scales of
its output (o_proj's input), so o_proj needs no quantization launch of its own.

One program per token: the gate read through its row and head strides (a flat [T, hidden] gate, or the per-head
[T, heads, head_dim] view SGLang's native path passes), the product in fp32 and stored in the output's dtype,
as SGLang's Triton kernel (`fused_sigmoid_mul`, the same `tl.sigmoid`: the same bits), then quantized from that
rounded row by `quantize_row`, bit for bit what `per_token_quant` gives for the written output.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl
from qflash.kernels.per_token_quant import launch_config, quantize_row


@triton.jit
def _sigmoid_mul_quant_kernel(attn_ptr, gate_ptr, q_ptr, scale_ptr, D, stride_gate_row, stride_gate_head,
                              HEAD_DIM: tl.constexpr, WRITE_Y: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < D
    head = offs // HEAD_DIM
    attn = tl.load(attn_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gate_row + head * stride_gate_head + offs - head * HEAD_DIM, mask=mask,
                   other=0.0).to(tl.float32)
    y = (attn * tl.sigmoid(gate)).to(attn_ptr.dtype.element_ty)
    if WRITE_Y:
        tl.store(attn_ptr + row * D + offs, y, mask=mask)
    q, scale = quantize_row(y.to(tl.float32))
    tl.store(q_ptr + row * D + offs, q, mask=mask)
    tl.store(scale_ptr + row, scale)


def _gate_strides(attn: torch.Tensor, gate: torch.Tensor) -> tuple[int, int, int]:
    """(row stride, head stride, head_dim) of the gate as SGLang's kernel reads it."""
    if gate.dim() == 3:
        return gate.stride(0), gate.stride(1), gate.shape[2]
    return attn.shape[1], attn.shape[1], attn.shape[1]


def takes(attn: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether the kernel covers this call of SGLang's gate: attn [T, hidden] contiguous; the gate flat and contiguous,
    or per head [T, heads, head_dim] with unit element stride."""
    if attn.dim() != 2 or not attn.is_contiguous():
        return False
    if gate.dim() == 3:
        return gate.shape[0] == attn.shape[0] and gate.shape[1] * gate.shape[2] == attn.shape[1] and gate.stride(2) == 1
    return gate.shape == attn.shape and gate.is_contiguous()


def sigmoid_mul_quant(attn: torch.Tensor, gate: torch.Tensor,
                      write_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """attn [T, hidden] *= sigmoid(gate) in place (`takes`); returns the result's int8 [T, hidden] and fp32 scales
    [T]. With `write_out` False attn is left as it was: only the int8 rows of the product are written."""
    T, D = attn.shape
    q = torch.empty((T, D), dtype=torch.int8, device=attn.device)
    scale = torch.empty((T,), dtype=torch.float32, device=attn.device)
    if T:
        stride_row, stride_head, head_dim = _gate_strides(attn, gate)
        _sigmoid_mul_quant_kernel[(T,)](attn, gate, q, scale, D, stride_row, stride_head, HEAD_DIM=head_dim,
                                        WRITE_Y=write_out, enable_fp_fusion=False, **launch_config(D),
                                        **pdl.options(attn.device))
    return q, scale
