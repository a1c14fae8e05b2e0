"""A fresh prompt's prefill as one CUDA graph per token bucket, beside SGLang's breakable prefill graph.

SGLang 0.5.17 prefills through breakable graphs (graphs/policy.py's buckets): the decoder stack's GEMMs and norms
replay as graph segments, but each of the 24 Gated-DeltaNet and 8 attention layers breaks the graph and runs
eagerly, its metadata built on the host. Up to a few thousand tokens that host work, not the GPU's, sets the time
to first token (BENCHMARKS.md). One request with nothing cached needs nothing from the host per layer: padding
after a prompt changes no causal row before it, and its lengths and state slots sit in the prefill runner's static
buffers. So each bucket up to `FRESH_PREFILL_MAX_TOKENS` is captured once more as one graph with those layers in
line (what they run inside it: server/hooks/fresh_prefill.py), and such prompts replay it.
"""

import logging
from types import SimpleNamespace

from qflash.graphs.policy import FRESH_PREFILL_MAX_TOKENS

logger = logging.getLogger(__name__)

GRAPHS: dict = {}  # key (the runner backend's and its bucket's) -> the captured graph
_REPLAYED: set = set()  # keys replayed at least once
_capture = SimpleNamespace(active=False, metadata=None, broken=False)  # this process's capture in progress


def wanted(size: int) -> bool:
    """Whether a bucket of `size` tokens gets a fresh-prompt graph: where the host bounds a prefill, and only while
    no capture has failed."""
    return size <= FRESH_PREFILL_MAX_TOKENS and not _capture.broken


def capturing() -> bool:
    """Whether the prefill running now is a fresh-prompt graph's (its warm-up or capture): its layers run in line."""
    return _capture.active


def metadata(make):
    """What every layer of the forward being captured reads, made by `make()` in the first layer that asks (so its
    device work is in the graph, ahead of the layers, and replayed with them)."""
    if _capture.metadata is None:
        _capture.metadata = make()
    return _capture.metadata


def capture(key, body, *, pool, stream) -> None:
    """Run `body` (the bucket's forward, its output written where the breakable graph writes it) once eagerly in
    line, which compiles what it launches, then capture it as `key`'s graph. A capture that fails is logged, and no
    further bucket is captured: prompts keep SGLang's breakable graphs."""
    import torch

    _capture.active = True
    try:
        body()
        _capture.metadata = None  # the warm-up's: the capture records its own
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
    except Exception as exc:  # noqa: BLE001 - any failure leaves the breakable graphs serving, said in the log
        _capture.broken = True
        logger.warning("qflash graphs: a fresh prompt's prefill cannot be captured whole, it keeps SGLang's "
                       "breakable graphs: %s", exc)
        return
    finally:
        _capture.active, _capture.metadata = False, None
    GRAPHS[key] = graph
    logger.info("qflash graphs: a fresh prompt's prefill captured whole for bucket %s (%d buckets)", key[-1], len(GRAPHS))


def replay(key, graphed: bool = True) -> bool:
    """Replay `key`'s graph if it has one (`graphed=False`: never, the breakable graph's reference); whether it did.
    The first replay of each bucket is logged, so that the log shows which buckets prompts took whole."""
    graph = GRAPHS.get(key) if graphed else None
    if graph is None:
        return False
    graph.replay()
    if key not in _REPLAYED:
        _REPLAYED.add(key)
        logger.info("qflash graphs: a fresh prompt's prefill replayed whole for bucket %s", key[-1])
    return True
