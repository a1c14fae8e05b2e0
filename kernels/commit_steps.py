"""Which verify steps a speculative cycle commits into its Gated-DeltaNet states, in one launch.

After a verify, each request's GDN state is committed at its last accepted step, and, where the committed tokens
cross a multiple of the radix cache's tracking interval, the state at the boundary is copied into the request's
tracking slot. SGLang 0.5.17 works both steps out with some fifteen torch operations on [batch] tensors, each a
launch; here one program does the same integer arithmetic for the whole batch.
"""

import torch
import triton
import triton.language as tl

from qflash.kernels import pdl


@triton.jit
def _gdn_commit_steps_kernel(pre_ptr, commit_ptr, last_ptr, track_ptr, n, interval, TRACK: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    commit = tl.load(commit_ptr + offs, mask=mask, other=1).to(tl.int64)
    tl.store(last_ptr + offs, commit - 1, mask=mask)
    if TRACK:
        pre = tl.load(pre_ptr + offs, mask=mask, other=0).to(tl.int64)
        boundary = (pre + commit) // interval * interval  # the last multiple up to the new length (never negative)
        # crossed when it lies past the old length: the state after the step that reaches it
        tl.store(track_ptr + offs, tl.where(boundary > pre, boundary - pre - 1, -1), mask=mask)


def commit_steps(pre_verify_lens: torch.Tensor, commit_lens: torch.Tensor, interval: int,
                 track: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the last committed step of each request, int64 [batch]; with `track`, the step whose state its tracking slot
    takes, -1 where no multiple of `interval` lies in pre_verify_lens + 1 .. pre_verify_lens + commit_lens, else
    None), from the lengths before the verify and the tokens it commits (the bonus token included)."""
    n = commit_lens.shape[0]
    last = torch.empty((n,), dtype=torch.int64, device=commit_lens.device)
    steps = torch.empty_like(last) if track else None
    if n:
        _gdn_commit_steps_kernel[(1,)](pre_verify_lens, commit_lens, last, last if steps is None else steps, n,
                                       interval, TRACK=track, BLOCK=triton.next_power_of_2(n),
                                       **pdl.options(commit_lens.device))
    return last, steps
