"""The attention metadata of a speculative block's forward (a DFlash verify or draft), in one launch.

Before each TARGET_VERIFY forward, SGLang 0.5.17's Triton backend fills its CUDA-graph buffers with torch operations
and two gathers: qo_indptr (an arange), kv_indptr (a cumsum of the lengths), kv_indices (each request's cached
slots from req_to_token), mask_indptr (a cumsum of block * (length + block)) and, for sliding-window layers, the
window's indptr, slots and offsets: 11 launches before the target's verify and 18 before the drafter's, each a
microsecond or two of an M = 16 cycle. Here program (request, split) writes its request's entries of every buffer
and a share of its slots, with the same values and dtypes as SGLang's operations, and nothing else.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _gather_slots(req_to_token_ptr, row, first, count, out_ptr, split, BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    """out[0:count] = req_to_token[row, first:first + count], this split's chunks of BLOCK."""
    for chunk in range(split * BLOCK, count, SPLITS * BLOCK):
        offs = chunk + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < count
        tl.store(out_ptr + offs, tl.load(req_to_token_ptr + row + first + offs, mask=mask), mask=mask)


@triton.jit
def _verify_metadata_kernel(req_to_token_ptr, pool_ptr, lens_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                            mask_indptr_ptr, window_indptr_ptr, window_indices_ptr, window_offsets_ptr,
                            bs, block, window, row_stride, BS_BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                            BLOCK: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    req, split = tl.program_id(0), tl.program_id(1)
    others = tl.arange(0, BS_BLOCK)
    lens = tl.load(lens_ptr + others, mask=others < bs, other=0).to(tl.int64)
    earlier = others < req
    start = tl.sum(tl.where(earlier, lens, 0))  # kv_indptr[req]: the cumsum's entry before this request's
    n = tl.load(lens_ptr + req).to(tl.int64)
    row = tl.load(pool_ptr + req).to(tl.int64) * row_stride
    if split == 0:
        if req == 0:
            tl.store(qo_indptr_ptr, 0)
        tl.store(qo_indptr_ptr + req + 1, (req + 1) * block)
        tl.store(kv_indptr_ptr + req + 1, start + n)
        # the cumsum of block * (length + block) up to this request
        tl.store(mask_indptr_ptr + req + 1, block * (start + n) + (req + 1) * block * block)
    _gather_slots(req_to_token_ptr, row, 0, n, kv_indices_ptr + start, split, BLOCK, SPLITS)
    if WINDOW:
        kept = tl.minimum(n, window)
        window_start = tl.sum(tl.where(earlier, tl.minimum(lens, window), 0))
        if split == 0:
            tl.store(window_indptr_ptr + req + 1, window_start + kept)
            tl.store(window_offsets_ptr + req, n - kept)
        _gather_slots(req_to_token_ptr, row, n - kept, kept, window_indices_ptr + window_start, split, BLOCK, SPLITS)


def verify_metadata(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, block: int,
                    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    mask_indptr: torch.Tensor, window: int = 0, window_indptr=None, window_indices=None,
                    window_offsets=None) -> None:
    """For a batch of len(seq_lens) requests with `block` query tokens each and seq_lens cached tokens, in slots
    req_to_token[req_pool_indices[i], :seq_lens[i]]: qo_indptr[0:bs+1], kv_indptr / mask_indptr[1:bs+1] and
    kv_indices[0:sum(seq_lens)]; with a `window` > 0, the same for the last `window` slots of each request into
    window_indptr[1:bs+1], window_indices, and window_offsets[0:bs] (where each request's window starts)."""
    bs = seq_lens.shape[0]
    if not bs:
        return
    _verify_metadata_kernel[(bs, CONFIG["SPLITS"])](
        req_to_token, req_pool_indices, seq_lens, qo_indptr, kv_indptr, kv_indices, mask_indptr,
        *((window_indptr, window_indices, window_offsets) if window > 0 else (kv_indptr,) * 3),
        bs, block, window, req_to_token.stride(0), BS_BLOCK=triton.next_power_of_2(bs), WINDOW=window > 0,
        **CONFIG, **pdl.options(seq_lens.device))


# One chunk of slots per program up to 8,192 cached tokens (SPLITS * BLOCK); longer contexts loop.
CONFIG = dict(BLOCK=1024, SPLITS=8, num_warps=4)
