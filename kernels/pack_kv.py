"""A prefill's keys and values packed for flash attention over variable-length sequences, in one launch.

Each request's cached prefix (rows of the layer's KV pool, at its slots in kv_indices) comes first, then its new
keys, requests one after another; cu_seq_k, where each request's keys start, is written by the same launch. Torch
ops would take ~25 launches a layer for this, and a prefill's attention layers run eagerly (between the segments
of SGLang's breakable graph), where the host's launches, not the GPU, set the time. Rows past the last request's
keys are zero. The request of a row is found by comparing it with every request's start: a prefill batch holds at
most a few requests. Counts are not specialized (Triton would compile a variant per count class while serving).
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl

BLOCK_ROWS = 4


@triton.jit
def _copy_rows(buf_ptr, ext_ptr, out_ptr, from_buf, from_ext, out, cached, new, keep):
    row = tl.load(buf_ptr + from_buf, mask=cached[:, None], other=0.0)
    row += tl.load(ext_ptr + from_ext, mask=new[:, None], other=0.0)
    tl.store(out_ptr + out, row, mask=keep)


@triton.jit(do_not_specialize=["num_req", "rows"])
def _pack_kv_kernel(k_ext_ptr, v_ext_ptr, k_buf_ptr, v_buf_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                    k_out_ptr, v_out_ptr, cu_seq_k_ptr, num_req, rows, stride_ext, stride_buf,
                    ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    pos = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    req = tl.zeros([BLOCK_ROWS], dtype=tl.int32)
    for r in range(1, num_req):
        req += (pos >= tl.load(kv_indptr_ptr + r) + tl.load(qo_indptr_ptr + r)).to(tl.int32)
    prefix_start = tl.load(kv_indptr_ptr + req)
    prefix = tl.load(kv_indptr_ptr + req + 1) - prefix_start
    off = pos - prefix_start - tl.load(qo_indptr_ptr + req)
    inside = pos < tl.load(kv_indptr_ptr + num_req) + tl.load(qo_indptr_ptr + num_req)
    cached = inside & (off < prefix)
    new = inside & (off >= prefix)
    slot = tl.load(kv_indices_ptr + prefix_start + off, mask=cached, other=0)
    new_row = tl.load(qo_indptr_ptr + req) + off - prefix
    cols = tl.arange(0, ROW)[None, :]
    from_buf = slot[:, None] * stride_buf + cols
    from_ext = new_row[:, None] * stride_ext + cols
    out = pos[:, None] * ROW + cols
    keep = (pos < rows)[:, None]
    _copy_rows(k_buf_ptr, k_ext_ptr, k_out_ptr, from_buf, from_ext, out, cached, new, keep)
    _copy_rows(v_buf_ptr, v_ext_ptr, v_out_ptr, from_buf, from_ext, out, cached, new, keep)
    if pid == 0:
        for first in range(0, num_req + 1, BLOCK_ROWS):
            ends = first + tl.arange(0, BLOCK_ROWS)
            at = ends <= num_req
            tl.store(cu_seq_k_ptr + ends, tl.load(kv_indptr_ptr + ends, mask=at) + tl.load(qo_indptr_ptr + ends, mask=at),
                     mask=at)


def pack_kv(k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices):
    """k/v_extend [new rows, heads, dim] (rows may be strided), k/v_buffer [slots, heads, dim], the requests' int32
    indptrs and int64 slots -> (k, v [prefix rows + new rows, heads, dim], cu_seq_k int32)."""
    rows = kv_indices.shape[0] + k_extend.shape[0]
    heads, dim = k_extend.shape[1:]
    # rows of heads x dim values back to back (ROW a power of two); the new rows may sit in a wider tensor
    assert k_extend.stride() == v_extend.stride() and k_extend.stride()[1:] == (dim, 1) and heads * dim & heads * dim - 1 == 0
    assert k_buffer.is_contiguous() and v_buffer.is_contiguous()
    k, v = (torch.empty((rows, heads, dim), dtype=k_extend.dtype, device=k_extend.device) for _ in range(2))
    cu_seq_k = torch.empty_like(qo_indptr, dtype=torch.int32)
    _pack_kv_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
        k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, k, v, cu_seq_k, qo_indptr.shape[0] - 1,
        rows, k_extend.stride(0), k_buffer.stride(0), ROW=heads * dim, BLOCK_ROWS=BLOCK_ROWS, **pdl.options(k.device))
    return k, v, cu_seq_k
