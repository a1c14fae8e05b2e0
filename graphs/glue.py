"""The host glue of a speculative cycle replayed as CUDA graphs: one graph per layout of a step's inputs.

Between SGLang's two captured forwards a DFLASH cycle runs dozens of small eager kernels (the Gated-DeltaNet
commit, the drafter's context-KV write); each costs the host a Python call chain and a launch, so together they
take longer on the host than on the GPU. Their work is the same every cycle for a batch size: device tensors at
the same addresses, shapes fixed by the block. A `GlueGraphs` runs such a step eagerly the first time it sees a
layout (lazy allocations, autotuning and compiles happen outside any capture), captures it the second time, and
replays the graph from then on. The caller's key must hold every address and shape the step reads or writes that
can change, so that an equal key means the graph's baked addresses are the live ones.

A step may hold others (the whole cycle holds the commit and SGLang's two forwards): a `GlueGraphs` run inside
another's capture runs eagerly into it, and a graph replayed there goes in as a child node (`embed`), since
neither torch nor CUDA launches a graph into a capture.
"""

import logging
from types import SimpleNamespace

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64  # per step: batch sizes x the few buffer rotations SGLang's worker cycles through
MAX_SEEN = 1024  # layouts seen once, kept to recognise a second sight; past it forgotten (a layout churning eagerly)
ALL: list["GlueGraphs"] = []
_capture = SimpleNamespace(active=False, embedded=0)  # the capture in progress in this process, if any


class NotCapturable(Exception):
    """Raised by a step inside its capture when what it ran there cannot be replayed (e.g. a forward without its
    graph): the capture is dropped and the step runs eagerly from then on."""


class GlueGraphs:
    """One step's graphs by layout; `run(key=..., fn=...)` replays, captures or runs `fn` eagerly."""

    def __init__(self, name: str):
        self.name = name
        self.graphs: dict = {}  # key -> (graph, what fn returned when it was captured)
        self.seen: set = set()
        self.broken = False  # a capture failed: this step runs eagerly from then on
        ALL.append(self)

    def run(self, *, key, fn):
        """`fn()`'s GPU work on the current stream, and what it returns (for a replay: what it returned when
        captured, whose tensors the replay rewrote); key None: eagerly (a layout no graph may be kept for)."""
        if _capture.active:  # inside another step's capture, which holds this work
            return fn()
        kept = self.graphs.get(key)
        if kept is not None:
            kept[0].replay()
            return kept[1]
        if key is None or self.broken or len(self.graphs) >= MAX_GRAPHS:
            return fn()
        if key in self.seen:
            return self._capture(key, fn)
        if len(self.seen) >= MAX_SEEN:
            self.seen.clear()
        self.seen.add(key)
        return fn()

    def _capture(self, key, fn):
        import torch

        graph = torch.cuda.CUDAGraph()
        _capture.active, _capture.embedded = True, 0
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                value = fn()
            finally:
                graph.capture_end()
        except (RuntimeError, NotCapturable) as exc:  # e.g. the step synchronised with the host
            self.broken = True
            logger.warning("qflash graphs: %s cannot be captured, it runs eagerly: %s", self.name, exc)
        finally:
            _capture.active = False
        if self.broken:  # run only once the capture is over: its work was recorded, not run
            return fn()
        self.graphs[key] = (graph, value)
        graph.replay()  # capture only recorded the work: this cycle's runs now
        n = len(self.graphs)
        if not n & (n - 1):  # the 1st, 2nd, 4th, ...: visible without flooding the log
            logger.info("qflash graphs: %s captured, layouts kept: %d", self.name, n)
        return value


def capturing() -> bool:
    """Whether a glue graph's capture is in progress (the work being run now is recorded, not run)."""
    return _capture.active


def embedded() -> int:
    """Graphs embedded into the capture in progress so far."""
    return _capture.embedded


def embed(graph) -> None:
    """Add `graph` (a torch CUDAGraph captured with keep_graph=True) to the capture in progress on the current
    stream as a child-graph node, after everything captured so far: what its replay there would have run."""
    import torch
    from cuda.bindings import driver

    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    info = _checked(driver.cuStreamGetCaptureInfo(stream))  # status, id, graph, dependencies, [edge data,] count
    capture, dependencies, count = info[2], info[3], info[-1]
    node = _checked(driver.cuGraphAddChildGraphNode(capture, dependencies, count, driver.CUgraph(graph.raw_cuda_graph())))
    replace = int(driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES)
    try:  # CUDA 13's signature, with edge data
        _checked(driver.cuStreamUpdateCaptureDependencies(stream, [node], None, 1, replace))
    except TypeError:  # CUDA 12's
        _checked(driver.cuStreamUpdateCaptureDependencies(stream, [node], 1, replace))
    _capture.embedded += 1


def _checked(result):
    from cuda.bindings import driver

    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"embedding a graph into a capture: {err}")
    return values[0] if len(values) == 1 else values


def static_copies(buffers: dict, step: str, **fresh) -> SimpleNamespace:
    """`fresh`'s tensors copied into `buffers`' tensors of their shape and dtype for `step` (made on first use;
    None stays None): a graph reads a step's fresh inputs from buffers of its own. A foreach copy per dtype: on
    CUDA one kernel for those tensors, where tensor.copy_ queues a copy-engine memcpy for each (~2 us apart,
    BENCHMARKS.md)."""
    import torch

    key = (step, *((name, None if t is None else (tuple(t.shape), t.dtype)) for name, t in fresh.items()))
    kept = buffers.get(key)
    if kept is None:
        kept = buffers[key] = {name: None if t is None else t.clone() for name, t in fresh.items()}
    by_dtype: dict = {}  # torch's foreach kernel takes one dtype
    for name, t in fresh.items():
        if t is not None:
            by_dtype.setdefault(t.dtype, []).append(name)
    for names in by_dtype.values():
        torch._foreach_copy_([kept[name] for name in names], [fresh[name] for name in names])
    return SimpleNamespace(**kept)


def layout(*tensors) -> tuple:
    """What a graph key holds of each tensor a step reads: address, shape, strides, dtype (None stays None)."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def drop_all() -> None:
    """Forget every step's graphs (their next layouts are run eagerly, then captured again): for a change to the
    Python a graph baked in, such as the test plugin's faults."""
    for glue in ALL:
        glue.graphs.clear()
        glue.seen.clear()
