"""A text batch's mrope positions from arange (server/hooks/text_positions.py), against SGLang's own on the same
batches: the same [3, tokens] int64 rows; what it does not serve goes to SGLang."""

import types

import pytest
import torch


@pytest.fixture
def sglang_positions(monkeypatch):
    """SGLang's `_compute_mrope_positions`, with its runtime context's one setting that it reads (a server publishes
    it; a test has none)."""
    from sglang.srt.model_executor import forward_batch_info

    exec_config = types.SimpleNamespace(deterministic=types.SimpleNamespace(rl_on_policy_target=None))
    monkeypatch.setattr(forward_batch_info, "get_exec", lambda: exec_config)
    return forward_batch_info.ForwardBatch._compute_mrope_positions


def batch_of(prefix_lens, extend_lens, mode="EXTEND", multimodal=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    forward = types.SimpleNamespace(seq_lens_cpu=torch.tensor(seq_lens), forward_mode=ForwardMode[mode])
    batch = types.SimpleNamespace(multimodal_inputs=multimodal or [None] * len(seq_lens), prefix_lens=prefix_lens,
                                  extend_lens=extend_lens)
    return forward, batch


@pytest.mark.parametrize("prefix_lens, extend_lens", [([0], [8192]), ([256], [37]), ([0, 512, 3], [64, 1, 2048])],
                         ids=["fresh prompt", "over a cached prefix", "a batch of three"])
def test_text_positions_are_sglangs(sglang_positions, prefix_lens, extend_lens):
    from qflash.server.hooks.text_positions import _text_positions_by_arange

    runner = types.SimpleNamespace(device="cpu")
    theirs, batch = batch_of(prefix_lens, extend_lens)
    sglang_positions(theirs, runner, batch)
    ours, _ = batch_of(prefix_lens, extend_lens)
    _text_positions_by_arange(sglang_positions, ours, runner, batch)
    assert ours.mrope_positions.dtype == theirs.mrope_positions.dtype == torch.int64
    assert ours.mrope_positions.is_contiguous() and torch.equal(ours.mrope_positions, theirs.mrope_positions)


@pytest.mark.parametrize("mode, multimodal", [("DECODE", None), ("EXTEND", [object()])], ids=["decode", "an image"])
def test_what_it_does_not_serve_is_sglangs(mode, multimodal):
    from qflash.server.hooks.text_positions import _text_positions_by_arange

    forward, batch = batch_of([5], [1], mode, multimodal)
    calls = []
    _text_positions_by_arange(lambda *args: calls.append(args), forward, "runner", batch)
    assert calls == [(forward, "runner", batch)] and not hasattr(forward, "mrope_positions")
