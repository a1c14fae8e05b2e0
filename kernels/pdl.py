"""Programmatic dependent launch (Hopper and later) for every qflash kernel.

At M = 16 a cycle's ~700 kernels are mostly latency: each waits for the one before it to drain, then pays its
own launch and ramp. Launched with PDL, a kernel's programs may start while the previous kernel's last programs
run; `enter` makes each wait (griddepcontrol.wait: the previous grid complete, its writes visible) before it
touches memory, then lets the next kernel launch. Every qflash kernel calls `enter` first thing; a kernel of
SGLang's launched after ours without PDL waits for ours as usual. Two kinds of loads may come before `enter`:
- weights, which no kernel writes while serving (`load_weights`);
- what kernels two or more launches back wrote (`load_settled`): a kernel starts only once every program of the one
  before it has passed its own `enter` (or, for a kernel without PDL, has ended), so the kernel before that one has
  completed. The load goes to L2 (`.cg`), where that kernel's writes are, not to a stale L1 line. A kernel using it
  names the writer it relies on.
A third kind of access may come before `enter` for any memory: `prefetch`, which asks L2 for lines and brings
nothing into registers. After the wait, the load of a line HBM sent to L2 meanwhile waits on L2 alone.
Off in Triton's interpreter (no inline asm) and before sm90.
"""

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def enter(ON: tl.constexpr):
    if ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_weights(ptrs, mask=None, other=None):
    """A load that may come before `enter`: of weights, which no kernel writes while serving."""
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def load_settled(ptrs, mask=None, other=None):
    """A load that may come before `enter`: of what a kernel two or more launches back wrote."""
    return tl.load(ptrs, mask=mask, other=other, cache_modifier=".cg")


@triton.jit
def prefetch(ptrs, mask, ON: tl.constexpr):
    """Asks L2 for the lines at `ptrs` where `mask` holds (one request an element: give one element a 128-byte line),
    before `enter`, for data that the code after the wait reads behind a chain of other loads. Safe for any memory,
    whoever writes it and when: every kernel's stores land in L2, so a line brought there early is never stale, and
    the read itself comes after the wait. ON: the kernel's PDL (without it nothing runs early to overlap, and the
    interpreter runs no inline assembly)."""
    if ON:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                                  "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _supported(device_index: int) -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The SMs a grid spreads over on `device` (0 off CUDA: no grid counts as one wave there)."""
    return _multiprocessors(_index(device)) if device.type == "cuda" else 0


def options(device: torch.device) -> dict:
    """A qflash kernel's PDL launch keywords on `device`: the kernel's `PDL` constexpr and Triton's launch flag."""
    on = device.type == "cuda" and _supported(_index(device))
    return {"PDL": on, "launch_pdl": on}
