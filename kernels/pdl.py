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
