"""Logprobs under DFLASH (server/hooks/logprobs.py), on the CPU: admission, the worker step's flag, and the verify
logprobs in the layout SGLang's result processing reads. The served values are checked on the H200
(tests/test_logprobs_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from qflash.server.hooks import logprobs


def request(**fields):
    return SimpleNamespace(**{"return_logprob": True, "return_hidden_states": False, **fields})


def test_admission_lets_logprob_requests_through_and_keeps_dflashs_other_refusals():
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    req = request()
    assert logprobs._admit_logprobs(validate_dflash_request, req, True) is None and req.return_logprob
    assert validate_dflash_request(request(), True) is not None  # what it refuses without the hook
    refused = logprobs._admit_logprobs(validate_dflash_request, request(return_hidden_states=True), True)
    assert "return_hidden_states" in refused


class Mode:
    def __init__(self, name):
        self.name = name

    def is_extend(self):
        return self.name == "extend"

    def is_idle(self):
        return self.name == "idle"


def batch(mode="decode", return_logprob=True):
    return SimpleNamespace(return_logprob=return_logprob, forward_mode=Mode(mode), is_extend_in_batch=False)


@pytest.fixture
def verified(monkeypatch):
    seen = []
    monkeypatch.setattr(logprobs, "verify_logprobs", lambda b, result: seen.append(result))
    return seen


@pytest.mark.parametrize("mode, gathers", [("decode", True), ("extend", False), ("idle", False)])
def test_the_step_hides_the_flag_from_dflashs_check_and_gathers_a_verifys_logprobs(mode, gathers, verified):
    step = batch(mode)

    def original(worker, b, on_publish=None, grammar_barrier=None):
        assert not b.return_logprob and getattr(b, logprobs.HIDDEN) and on_publish == "publish"
        b.forward_mode = Mode("extend")  # SGLang's verify leaves TARGET_VERIFY, which is_extend() counts
        return "result"

    assert logprobs._step_with_logprobs(original, "worker", step, on_publish="publish") == "result"
    assert step.return_logprob and not hasattr(step, logprobs.HIDDEN)
    assert verified == (["result"] if gathers else [])


def test_a_step_without_logprobs_passes_through(verified):
    step = batch(return_logprob=False)
    assert logprobs._step_with_logprobs(lambda w, b, **kw: "result", "worker", step) == "result"
    assert verified == [] and not hasattr(step, logprobs.HIDDEN)


def test_the_flag_comes_back_when_the_step_fails(verified):
    step = batch()

    def failing(worker, b, **kw):
        raise RuntimeError("the cycle failed")

    with pytest.raises(RuntimeError):
        logprobs._step_with_logprobs(failing, "worker", step)
    assert step.return_logprob and not hasattr(step, logprobs.HIDDEN) and verified == []


def test_the_prefills_target_forward_sees_the_flag_only_for_the_hidden_batch():
    seen = []
    original = lambda worker, b, *args, **kwargs: seen.append(b.return_logprob if b is not None else None)
    hidden = batch(return_logprob=False)
    setattr(hidden, logprobs.HIDDEN, True)
    logprobs._target_sees_logprobs(original, "target", hidden, capture_hidden_mode="full")
    logprobs._target_sees_logprobs(original, "target", batch(return_logprob=False))
    logprobs._target_sees_logprobs(original, "target", None, forward_batch="verify")
    assert seen == [True, False, None] and not hidden.return_logprob


def test_a_verifys_logprobs_are_those_of_each_committed_token_where_the_scheduler_reads_them():
    """Two requests, block 4: request 0 commits 3 tokens, request 1 one. SGLang's own decode-logprob step
    (`_apply_decode_logprobs`) reads each request's committed tokens' logprobs and top-2 from the step's output."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    bs, block, vocab = 2, 4, 11
    logits = torch.randn(bs * block, vocab, generator=torch.Generator().manual_seed(0))
    out_tokens = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0]])  # committed: 3, 7, 1 and 5; the rest is padding
    committed = [[3, 7, 1], [5]]
    step = SimpleNamespace(batch_size=lambda: bs, seq_lens=torch.zeros(bs), top_logprobs_nums=[2, 2],
                           sampling_info=SimpleNamespace(is_all_greedy=True), token_ids_logprobs=None)
    result = SimpleNamespace(speculative_num_draft_tokens=block, next_token_ids=out_tokens.view(-1),
                             logits_output=SimpleNamespace(next_token_logits=logits))
    logprobs.verify_logprobs(step, result)

    out = result.logits_output
    values = out.next_token_logprobs.tolist()
    out.next_token_top_logprobs_val = [v.tolist() for v in out.next_token_top_logprobs_val]
    out.next_token_top_logprobs_idx = [x.tolist() for x in out.next_token_top_logprobs_idx]
    expected = torch.log_softmax(logits, dim=-1).view(bs, block, vocab)
    for i, tokens in enumerate(committed):
        req = SimpleNamespace(logprob=SimpleNamespace(output_token_logprobs_val=[], output_token_logprobs_idx=[],
                                                      output_top_logprobs_val=[], output_top_logprobs_idx=[],
                                                      top_logprobs_num=2, token_ids_logprob=None))
        SchedulerBatchResultProcessor._apply_decode_logprobs(
            None, req=req, i=i, batch=SimpleNamespace(spec_algorithm=SimpleNamespace(is_none=lambda: False)),
            next_token_id=tokens, next_token_logprobs=values, logits_output=out)
        assert req.logprob.output_token_logprobs_idx == tokens
        want = [expected[i, j, t].item() for j, t in enumerate(tokens)]
        assert req.logprob.output_token_logprobs_val == pytest.approx(want, abs=1e-6)
        top = [expected[i, j].topk(2) for j in range(len(tokens))]
        assert req.logprob.output_top_logprobs_idx == [t.indices.tolist() for t in top]
        assert [v for row in req.logprob.output_top_logprobs_val for v in row] == pytest.approx(
            [v for t in top for v in t.values.tolist()], abs=1e-6)
