"""The DFLASH prefill step without the wait (server/hooks/dflash_prefill.py): the same calls with the same values as
SGLang's own extend branch, which runs on the same stand-in worker beside it; on the GPU, no synchronizing CUDA call
on the way (where SGLang's own makes one)."""

from types import SimpleNamespace

import pytest
import torch

from qflash.server.hooks import dflash_prefill

HIDDEN = 8


class Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend

    def is_idle(self):
        return False


def worker(device, backend):
    """A stand-in for DFlashWorkerV2 around its prefill: the target's forward and the drafter's KV write recorded."""
    calls = []

    def target_forward(batch, capture_hidden_mode):
        calls.append(("target", capture_hidden_mode))
        rows = sum(batch.extend_lens)
        hidden = torch.arange(rows * HIDDEN, dtype=torch.float32, device=device).view(rows, HIDDEN)
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden),
                               next_token_ids=torch.arange(len(batch.extend_lens), device=device) + 7)

    def append(**kwargs):
        calls.append(("drafter kv", {name: value.clone() for name, value in kwargs.items()}))

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    self = SimpleNamespace(calls=calls, target_worker=SimpleNamespace(forward_batch_generation=target_forward),
                           model_runner=SimpleNamespace(server_args=SimpleNamespace(attention_backend=backend)),
                           _append_target_hidden_to_draft_kv_by_loc=append,
                           _validate_phase1_sampling_support=lambda batch: calls.append(("validated", batch.rid)))
    self._make_next_draft_input_prefill = lambda **kw: DFlashWorkerV2._make_next_draft_input_prefill(self, **kw)
    return self


def prefill(device, prefix_lens=(0, 5, 3), extend_lens=(4, 2, 6)):
    rows = sum(extend_lens)
    return SimpleNamespace(rid="r", forward_mode=Mode(True), is_extend_in_batch=False, return_logprob=False,
                           prefix_lens=list(prefix_lens), extend_lens=list(extend_lens), sampling_info=None,
                           seq_lens=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)], device=device),
                           out_cache_loc=torch.arange(100, 100 + rows, device=device))


def run(step, device, backend, batch):
    self = worker(device, backend)
    published = []
    out = step(self, batch, on_publish=published.append)
    return self.calls, out, published


def sglang(self, batch, **kwargs):
    """SGLang's own step, under whatever hooks this process holds."""
    import inspect

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    return inspect.unwrap(DFlashWorkerV2.forward_batch_generation)(self, batch, **kwargs)


def hooked(self, batch, **kwargs):
    return dflash_prefill._prefill_without_waiting(lambda *a, **k: pytest.fail("not a prefill"), self, batch, **kwargs)


@pytest.mark.parametrize("backend", ["triton", "torch_native"])  # SGLang's two position paths
def test_the_step_makes_sglangs_calls_with_sglangs_values(backend):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs CPU tensors only in its interpreter
    theirs, ours = run(sglang, device, backend, prefill(device)), run(hooked, device, backend, prefill(device))
    assert [name for name, _ in ours[0]] == [name for name, _ in theirs[0]] == ["validated", "target", "drafter kv"]
    assert ours[0][1] == theirs[0][1]
    kv, sglang_kv = ours[0][2][1], theirs[0][2][1]
    assert kv.keys() == sglang_kv.keys()
    for name in kv:
        assert torch.equal(kv[name], sglang_kv[name]), name
    assert kv["positions"].tolist() == [0, 1, 2, 3, 5, 6, 3, 4, 5, 6, 7, 8]
    for out, published in (ours[1:], theirs[1:]):
        assert out.logits_output.hidden_states is None and published == [out.new_seq_lens]
    assert torch.equal(ours[1].next_draft_input.bonus_tokens, theirs[1].next_draft_input.bonus_tokens)
    assert torch.equal(ours[1].next_draft_input.new_seq_lens, theirs[1].next_draft_input.new_seq_lens)


def test_a_decode_step_goes_to_sglang():
    batch = prefill("cpu")
    batch.forward_mode = Mode(False)
    seen = []
    out = dflash_prefill._prefill_without_waiting(lambda self, b, **kw: seen.append((b, kw)) or "decoded", "worker",
                                                  batch, on_publish="publish")
    assert out == "decoded" and seen == [(batch, {"on_publish": "publish", "grammar_barrier": None})]


@pytest.mark.gpu
@pytest.mark.parametrize("step, synchronizes", [(hooked, False), (sglang, True)])
def test_the_step_queues_without_a_synchronizing_call(step, synchronizes):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch = prefill("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        if synchronizes:  # SGLang's own branch: the test can tell
            with pytest.raises(RuntimeError, match="synchroniz"):
                run(step, "cuda", "triton", batch)
            return
        calls, _, _ = run(step, "cuda", "triton", batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls[2][1]["positions"].tolist() == [0, 1, 2, 3, 5, 6, 3, 4, 5, 6, 7, 8]
