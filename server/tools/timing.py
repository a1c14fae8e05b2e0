"""GPU time of one call with a cold L2 and no host overhead, for the tuner and `qflash bench-kernels`; and the
time and host time of eager calls, for what runs outside CUDA graphs.

Timing eager calls measures Python dispatch (tens of microseconds) as much as the kernel, and
repeating a call over one buffer measures L2 (60 MB on the H200, larger than most weights here).
So `reps` calls, each after a write over 128 MiB, are captured in one CUDA graph; the same graph
without the calls is timed too, and the difference per call is the answer (CUDA events, median).
A decode GEMM in the cycle follows a short kernel instead, whose tail it overlaps (programmatic dependent launch),
and reads a weight no kernel before it read: `chain_us` times calls back to back, each over its own weight copy.
"""

import statistics
import time
from functools import lru_cache

import torch

FLUSH_BYTES = 128 << 20
CHAIN_CALLS = (8, 64)  # a chain's calls, fewest and most: enough weight copies to outgrow L2, within memory


def _replay_ms(graph: torch.cuda.CUDAGraph, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@lru_cache(maxsize=None)
def _flush() -> torch.Tensor:
    return torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")


def _graph_ms(body, rounds: int) -> float:
    """Median milliseconds of one replay of body() captured as a CUDA graph, after two replays that warm it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    _replay_ms(graph, 2)
    return _replay_ms(graph, rounds)


def _flushed(fn, reps: int):
    """A body of `reps` calls of fn (None: none), each after a write over FLUSH_BYTES."""
    flush = _flush()  # allocated outside the graph's memory pool

    def body():
        for _ in range(reps):
            flush.zero_()
            if fn is not None:
                fn()
    return body


@lru_cache(maxsize=None)
def _flush_only_ms(reps: int, rounds: int) -> float:
    return _graph_ms(_flushed(None, reps), rounds)


def cold_us(fn, reps: int = 10, rounds: int = 7) -> float:
    """Median GPU microseconds of fn() with L2 flushed before it; fn must be CUDA-graph capturable."""
    fn()  # compile and allocate outside the graph; a config that cannot run raises here
    torch.cuda.synchronize()
    took = _graph_ms(_flushed(fn, reps), rounds)
    return max(took - _flush_only_ms(reps, rounds), 0.0) / reps * 1e3


def chain_calls(weight_bytes: int) -> int:
    """How many calls, each over its own copy of a weight this size, outgrow L2 together (FLUSH_BYTES)."""
    fewest, most = CHAIN_CALLS
    return min(max(-(-FLUSH_BYTES // weight_bytes), fewest), most)


def chain_us(fns: list, rounds: int = 7) -> float:
    """Median GPU microseconds per call of `fns` run back to back in one CUDA graph (each over its own weight,
    see chain_calls; the graph's own launch is shared by all of them); each must be CUDA-graph capturable."""
    for fn in fns:
        fn()  # compile and allocate outside the graph; a config that cannot run raises here
    torch.cuda.synchronize()

    def body():
        for fn in fns:
            fn()
    return _graph_ms(body, rounds) / len(fns) * 1e3


def eager_us(fn, calls: int = 20, rounds: int = 5) -> float:
    """Median wall microseconds per call of fn() launched eagerly, back to back (GPU and launch time together), for
    what serving runs outside CUDA graphs."""
    fn()  # compile and allocate
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(times)


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds to launch fn() eagerly: `calls` calls queued without waiting for the GPU."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / calls * 1e6
