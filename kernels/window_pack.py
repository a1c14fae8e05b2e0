"""A speculative cycle's accepted tokens appended to its window's result rows, on the GPU (server/window.py).

Each request's row holds the window's accepted tokens back to back; `filled` is how many it holds. A cycle
appends the first `commit_lens[i]` of its `out_tokens[i]` at that fill level and advances it, in one launch with
no host sync, so the next cycle can follow at once.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _pack_cycle_kernel(tokens_ptr, commit_ptr, rows_ptr, filled_ptr, tokens_stride, rows_stride, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    pdl.enter(PDL)
    req = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    count = tl.load(commit_ptr + req)
    start = tl.load(filled_ptr + req)
    tokens = tl.load(tokens_ptr + req * tokens_stride + offs)
    tl.store(rows_ptr + req * rows_stride + start + offs, tokens, mask=offs < count)
    tl.store(filled_ptr + req, start + count)


def pack_cycle(out_tokens: torch.Tensor, commit_lens: torch.Tensor, rows: torch.Tensor, filled: torch.Tensor) -> None:
    """out_tokens [bs, K] int64 (a power-of-two K), commit_lens [bs] int32 (1..K), rows [bs, W] int64 with room
    for every cycle's run, filled [bs] int32: append each row's run, advance `filled`."""
    bs, block = out_tokens.shape
    if bs:
        _pack_cycle_kernel[(bs,)](out_tokens, commit_lens, rows, filled, out_tokens.stride(0), rows.stride(0),
                                  BLOCK=block, num_warps=1, **pdl.options(rows.device))
