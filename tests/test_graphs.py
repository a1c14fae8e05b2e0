"""CUDA-graph policy (graphs/policy.py), its start-up and run-time reports (graphs/monitor.py), and the
hooks that feed them (server/hooks/graph_monitor.py)."""

import logging
from types import SimpleNamespace

import pytest
import torch

from conftest import run_python
from qflash.graphs.monitor import EagerSteps, capture_report
from qflash.graphs.policy import decode_batch_sizes, graph_flags, prefill_token_buckets
from qflash.server.hooks import graph_monitor


def test_every_admitted_batch_size_gets_verify_and_draft_graphs():
    assert decode_batch_sizes(8) == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("chunk", [8192, 4096, 16384, 1008])
def test_prefill_buckets_are_block_multiples_up_to_the_chunk(chunk):
    sizes = prefill_token_buckets(16, chunk)
    assert sizes == sorted(set(sizes)) and sizes[0] == 16
    assert all(s % 16 == 0 for s in sizes) and sizes[-1] == chunk
    # a prompt pads up to the next bucket: never more than 1/8 extra above 512 tokens, one block below
    for small, big in zip(sizes, sizes[1:]):
        assert big - small == 16 if big <= 256 else (big - small) / small <= 1 / 4
        if small >= 4096:
            assert (big - small) / small <= 1 / 8


def test_a_chunk_that_is_not_a_block_multiple_is_refused():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        prefill_token_buckets(16, 1000)


def test_graph_flags_name_every_shape():
    flags = graph_flags(16, 8, 8192)
    assert flags[:2] == ["--chunked-prefill-size", "8192"]
    decode = flags[flags.index("--cuda-graph-bs-decode") + 1: flags.index("--cuda-graph-bs-prefill")]
    assert decode == [str(b) for b in range(1, 9)]
    assert flags[flags.index("--cuda-graph-bs-prefill") + 1:] == [str(t) for t in prefill_token_buckets(16, 8192)]


def test_capture_report_says_shapes_time_and_memory():
    line = capture_report("target", "TARGET_VERIFY", list(range(1, 9)), 16, 4.26, 3 * 2**29)
    assert line == ("qflash graphs: target TARGET_VERIFY graphs for batch sizes 1, 2, 3, 4, 5, 6, 7, 8 (16-128 tokens): "
                    "captured in 4.3 s, 1.50 GiB of GPU memory")
    line = capture_report("target", "prefill", prefill_token_buckets(16, 8192), 1, 20.0, 0)
    assert "token counts 16, 32, 48, 64, 80, 96, ... 8192 (48 shapes)" in line


def test_eager_steps_are_logged_at_powers_of_two_per_kind():
    steps = EagerSteps()
    logged = [n for n in range(1, 20) if steps.record("target", "EXTEND", 1, 9000)]
    assert logged == [1, 2, 4, 8, 16]
    line = steps.record("draft", "TARGET_VERIFY", 3, 48)
    assert line == ("qflash graphs: draft TARGET_VERIFY step ran eagerly (batch 3, 48 tokens); "
                    "eager steps of this kind: 1, of all kinds: 20")


def test_eager_step_hook_counts_only_steps_without_a_graph(monkeypatch, caplog):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunnerOutput

    monkeypatch.setattr(graph_monitor, "EAGER_STEPS", EagerSteps())
    runner = SimpleNamespace(is_draft_worker=False)
    batch = lambda mode, n: SimpleNamespace(forward_mode=mode, batch_size=1, input_ids=torch.zeros(n))  # noqa: E731
    with caplog.at_level(logging.INFO, logger=graph_monitor.logger.name):
        for mode, n, graph in [(ForwardMode.EXTEND, 9000, False), (ForwardMode.TARGET_VERIFY, 16, True),
                               (ForwardMode.IDLE, 0, False), (ForwardMode.TARGET_VERIFY, 16, False)]:
            out = ModelRunnerOutput(logits_output=None, can_run_graph=graph)
            assert graph_monitor._count_eager_step(out, runner, batch(mode, n)) is out
    assert dict(graph_monitor.EAGER_STEPS.counts) == {("target", "EXTEND"): 1, ("target", "TARGET_VERIFY"): 1}
    assert "target EXTEND step ran eagerly (batch 1, 9000 tokens)" in caplog.text


def test_graph_and_attention_hooks_wrap_sglang_in_qflash_servers_only():
    code = ("from sglang.srt.plugins import load_plugins\nload_plugins()\n"
            "from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner as D\n"
            "from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner as P\n"
            "from sglang.srt.model_executor.model_runner import ModelRunner as M\n"
            "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as T\n"
            "print(*(hasattr(f, '__wrapped__') for f in (D.capture, P.capture, M._forward_raw, T.__init__)))")
    assert run_python(code, env={"SGLANG_PLUGINS": "qflash"}).stdout.split() == ["True"] * 4
    assert run_python(code, env={"SGLANG_PLUGINS": "qflash_text_only"}).stdout.split() == ["False"] * 4
