"""The cycle's glue and a window's whole cycles replayed as CUDA graphs (graphs/glue.py) decode what SGLang's eager
cycle decodes (GPU only).

A graph embedded into another's capture (SGLang's forwards inside a cycle's graph) runs in that graph's replay.
On the shared `./launch.sh` server (conftest.served: the stable-choice checkpoint, real verification, so a
broken GDN commit changes tokens and a broken drafter-KV write lowers acceptance). Its reference is the same
server with the cycle run eagerly, switched at run time through the test plugin (`glue_eager`), both orders, and
the window's cycles without their whole-cycle graph (`cycle_eager`: the glue graphs alone):
- 16 prompts x 256 tokens, 8 at a time (batch sizes 1-8 each get their graphs): identical tokens and acceptance;
- the graphs were really captured (the server log says so) and replayed: the eager side's glue is SGLang's own.
A fault inside a graph (the GDN fold's, tests/test_quantized_server_gpu.py) still changes the output: the fault's
switch drops the graphs, so they are captured again with it.
"""

import concurrent.futures

import pytest
import torch

from conftest import SERVED as BASE, served_log
from fault_control import injected
from test_quantized_server_gpu import NEW_TOKENS, flush, generate, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def decode_all() -> list[dict]:
    flush()  # no cache hits: both sides prefill and decode every prompt alike
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: generate(BASE, p), prompts()))


def mean_accept(outputs) -> float:
    return sum(o["meta_info"]["spec_accept_length"] for o in outputs) / len(outputs)


def test_a_graph_embedded_in_a_capture_runs_in_its_replay():
    from qflash.graphs import glue

    x = torch.ones(1024, device="cuda")
    y, z = torch.zeros_like(x), torch.zeros_like(x)
    stream = torch.cuda.Stream()
    inner, outer = torch.cuda.CUDAGraph(keep_graph=True), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        inner.capture_begin(capture_error_mode="thread_local")
        y.copy_(x * 2)
        inner.capture_end()
        inner.instantiate()
        outer.capture_begin(capture_error_mode="thread_local")
        x.add_(1)
        glue.embed(inner)  # after the add, before the copy: the order it runs in
        z.copy_(y + 1)
        outer.capture_end()
    torch.cuda.synchronize()
    assert (x[0].item(), y[0].item(), z[0].item()) == (1.0, 0.0, 0.0)  # captured, not run
    outer.replay()
    torch.cuda.synchronize()
    assert (x[0].item(), y[0].item(), z[0].item()) == (2.0, 4.0, 5.0)
    inner.replay()  # still a graph of its own
    torch.cuda.synchronize()
    assert y[0].item() == 4.0


def test_glue_graphs_decode_what_the_eager_glue_decodes(served, fault_file):
    graphs_first = decode_all()
    with injected(fault_file, "glue_eager"):
        eager = decode_all()
    with injected(fault_file, "cycle_eager"):
        glue_only = decode_all()
    graphs_again = decode_all()
    for name, side in (("graphs first", graphs_first), ("graphs after eager", graphs_again),
                       ("glue graphs without the cycle graph", glue_only)):
        mismatches = [(i, k) for i, (g, e) in enumerate(zip(side, eager))
                      for k, (a, b) in enumerate(zip(g["output_ids"], e["output_ids"])) if a != b]
        accept, reference = mean_accept(side), mean_accept(eager)
        print(f"\nglue graphs vs eager ({name}): {len(prompts())} prompts x {NEW_TOKENS} tokens, {len(mismatches)} "
              f"mismatches {mismatches[:8]}; accept length {accept:.2f} against {reference:.2f}")
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in side) and not mismatches
        # the same drafts are accepted; what moves it is where the windows' last cycles fall, which timing decides
        assert accept == pytest.approx(reference, rel=0.1)
    log = served_log()
    assert "qflash graphs: a whole DFLASH cycle captured" in log and "cannot be captured" not in log
    assert "qflash graphs: the GDN commit after a verify captured" in log
    assert "qflash graphs: the drafter's context-KV write after a verify captured" in log
