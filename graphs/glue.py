"""The host glue of a speculative cycle replayed as CUDA graphs: one graph per layout of a step's inputs.

Between SGLang's two captured forwards a DFLASH cycle runs dozens of small eager kernels (the Gated-DeltaNet
commit, the drafter's context-KV write); each costs the host a Python call chain and a launch, so together they
take longer on the host than on the GPU. Their work is the same every cycle for a batch size: device tensors at
the same addresses, shapes fixed by the block. A `GlueGraphs` runs such a step eagerly the first time it sees a
layout (lazy allocations, autotuning and compiles happen outside any capture), captures it the second time, and
replays the graph from then on. The caller's key must hold every address and shape the step reads or writes that
can change, so that an equal key means the graph's baked addresses are the live ones.
"""

import logging

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64  # per step: batch sizes x the few buffer rotations SGLang's worker cycles through
MAX_SEEN = 1024  # layouts seen once, kept to recognise a second sight; past it forgotten (a layout churning eagerly)
ALL: list["GlueGraphs"] = []


class GlueGraphs:
    """One step's graphs by layout; `run(key=..., fn=...)` replays, captures or runs `fn` eagerly."""

    def __init__(self, name: str):
        self.name = name
        self.graphs: dict = {}
        self.seen: set = set()
        self.broken = False  # a capture failed: this step runs eagerly from then on
        ALL.append(self)

    def run(self, *, key, fn) -> None:
        """`fn()`'s GPU work on the current stream; key None: eagerly (a layout no graph may be kept for)."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        elif key is None or self.broken or len(self.graphs) >= MAX_GRAPHS:
            fn()
        elif key in self.seen:
            self._capture(key, fn)
        else:
            if len(self.seen) >= MAX_SEEN:
                self.seen.clear()
            self.seen.add(key)
            fn()

    def _capture(self, key, fn) -> None:
        import torch

        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        except RuntimeError as exc:  # e.g. the step synchronised with the host, or ran on the default stream
            self.broken = True
            logger.warning("qflash graphs: %s cannot be captured, it runs eagerly: %s", self.name, exc)
            fn()
            return
        self.graphs[key] = graph
        graph.replay()  # capture only recorded the work: this cycle's runs now
        n = len(self.graphs)
        if not n & (n - 1):  # the 1st, 2nd, 4th, ...: visible without flooding the log
            logger.info("qflash graphs: %s captured, layouts kept: %d", self.name, n)


def drop_all() -> None:
    """Forget every step's graphs (their next layouts are run eagerly, then captured again): for a change to the
    Python a graph baked in, such as the test plugin's faults."""
    for glue in ALL:
        glue.graphs.clear()
        glue.seen.clear()
