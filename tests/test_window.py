"""Several speculative cycles per scheduler step (server/window.py, server/hooks/multi_cycle.py) on the CPU: the
planner, the packing kernel (Triton's interpreter), the loop over SGLang's cycle with a stand-in for it, and the
scheduler-side changes on stand-ins for SGLang's objects. tests/test_window_gpu.py serves it."""

from types import SimpleNamespace

import pytest
import torch

from qflash.kernels.window_pack import pack_cycle
from qflash.server import window
from qflash.server.hooks import multi_cycle

BLOCK = 16


def req(*, max_new=256, out=0, cycles=0, correct=0, committed=100, rid="r"):
    return SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new), output_ids=[0] * out,
                           spec_verify_ct=cycles, spec_num_correct_drafts=correct, kv_committed_len=committed, rid=rid,
                           is_retracted=False, finished=lambda: False)


def plan(reqs, limit=4, in_flight=1, context_len=16384):
    return window.plan_cycles(reqs, limit=limit, in_flight=in_flight, block=BLOCK, context_len=context_len)


def test_the_planner_runs_the_window_while_requests_have_tokens_to_go():
    assert plan([req()]) == 4  # no history yet: a block per cycle, 256 tokens to go
    assert plan([req()], limit=8) == 8 and plan([req()], limit=1) == 1


def test_the_planner_stops_a_request_near_its_end_at_its_own_acceptance():
    # 40 cycles so far at 6.5 tokens each (260 = correct drafts + one bonus per cycle), 230 tokens of 256 out
    tau = req(out=230, cycles=40, correct=220)
    assert window.tokens_per_cycle(tau, BLOCK) == pytest.approx(6.5)
    assert plan([tau], in_flight=1) == 3  # (256 - 230 - 6.5) / 6.5 = 3.0: three cycles still decode
    assert plan([tau], in_flight=4) == 1  # the window in flight is expected to reach the end: one cycle, as SGLang
    assert plan([req(), tau], in_flight=1) == 3  # the batch runs what its nearest-to-done request needs
    assert plan([req(max_new=None, out=230, cycles=40, correct=220)]) == 4  # no budget: the window


def test_the_planner_keeps_every_cycle_inside_the_context():
    # each cycle writes a block past its prefix; in flight and next: committed + 16 x cycles <= context
    assert plan([req(committed=16384 - 16 * 5)], in_flight=1) == 4
    assert plan([req(committed=16384 - 16 * 4)], in_flight=1) == 3
    assert plan([req(committed=16380)], in_flight=1) == 1  # never fewer than SGLang's one


def test_pack_appends_each_cycles_accepted_run_at_its_rows_fill_level():
    bs, cycles = 3, 3
    rows = torch.full((bs, cycles * BLOCK), -1, dtype=torch.int64)
    filled = torch.zeros(bs, dtype=torch.int32)
    runs = [torch.tensor([16, 1, 5], dtype=torch.int32), torch.tensor([2, 16, 1], dtype=torch.int32),
            torch.tensor([1, 3, 16], dtype=torch.int32)]
    expected = [[] for _ in range(bs)]
    for k, commit in enumerate(runs):
        tokens = torch.arange(bs * BLOCK, dtype=torch.int64).view(bs, BLOCK) + 1000 * (k + 1)
        pack_cycle(tokens, commit, rows, filled)
        for i in range(bs):
            expected[i] += tokens[i, : commit[i]].tolist()
    assert filled.tolist() == [19, 20, 22]
    for i in range(bs):
        assert rows[i, : filled[i]].tolist() == expected[i]
        assert (rows[i, filled[i]:] == -1).all()  # nothing written past the runs


class FakeWorker:
    """SGLang's cycle as the window sees it: from the batch's lengths and the draft input's bonus token, one
    cycle commits a fixed number of tokens per request, which say which cycle and step wrote them."""

    block_size, device = BLOCK, "cpu"

    def __init__(self, commits):
        self.commits, self.calls = commits, []

    def cycle(self, worker, batch, on_publish=None, grammar_barrier=None):
        assert worker is self and batch.forward_mode.name == "DECODE"
        k = len(self.calls)
        self.calls.append({"seq_lens": batch.seq_lens.tolist(), "bonus": batch.spec_info.bonus_tokens.tolist(),
                           "publish": on_publish is not None})
        commit = torch.tensor(self.commits[k], dtype=torch.int32)
        out = batch.seq_lens[:, None] * 100 + torch.arange(BLOCK)  # token ids that name their position
        new_lens = batch.seq_lens + commit
        batch.forward_mode = SimpleNamespace(name="TARGET_VERIFY")  # what the verify preparation leaves
        batch.spec_info = "verify input"
        return SimpleNamespace(next_token_ids=out.reshape(-1), accept_lens=commit, new_seq_lens=new_lens,
                               next_draft_input=SimpleNamespace(bonus_tokens=new_lens * 7),
                               speculative_num_draft_tokens=BLOCK)


def batch(seq_lens):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lens = torch.tensor(seq_lens)
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=lens, batch_size=lambda: len(seq_lens),
                           spec_info=SimpleNamespace(bonus_tokens=lens * 7))


def test_a_window_chains_its_cycles_and_hands_the_scheduler_one_row_per_request():
    worker, b = FakeWorker([[3, 16], [1, 5], [16, 2]]), batch([50, 80])
    result = window.run_window(worker.cycle, worker, b, 3, on_publish="publish")
    assert [c["seq_lens"] for c in worker.calls] == [[50, 80], [53, 96], [54, 101]]  # each from the last one's commit
    assert [c["bonus"] for c in worker.calls] == [[350, 560], [371, 672], [378, 707]]  # the bonus it verified
    assert [c["publish"] for c in worker.calls] == [False, False, True]  # the FutureMap gets the last lengths alone
    assert result.accept_lens.tolist() == [20, 23] and result.speculative_num_draft_tokens == 3 * BLOCK
    rows = result.next_token_ids.view(2, 3 * BLOCK)
    assert rows[0, :20].tolist() == [5000, 5001, 5002, 5300] + [5400 + i for i in range(16)]
    assert rows[1, :23].tolist() == [8000 + i for i in range(16)] + [9600 + i for i in range(5)] + [10100, 10101]
    assert getattr(result, window.CYCLES) == 3 and getattr(result.next_draft_input, window.IN_FLIGHT) == 3


def grammar_batch(**kw):
    """A step's batch; `in_flight`: what the last step left on its draft input (None: a prefill left it)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    in_flight = kw.pop("in_flight", 1)
    spec_info = SimpleNamespace(**{window.PLANNED: kw.pop("planned", 4)},
                                **({} if in_flight is None else {window.IN_FLIGHT: in_flight}))
    return SimpleNamespace(spec_info=spec_info, forward_mode=kw.pop("mode", ForwardMode.DECODE),
                           is_extend_in_batch=False, has_grammar=kw.pop("grammar", False), return_logprob=False)


@pytest.mark.parametrize("case", ["planned one", "grammar", "grammar after a prefill", "prefill", "idle"])
def test_steps_that_cannot_run_a_window_run_sglangs_own_cycle(case, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    b = grammar_batch(planned=1 if case == "planned one" else 4, grammar=case.startswith("grammar"),
                      in_flight=None if case.endswith("after a prefill") else 1,
                      mode={"prefill": ForwardMode.EXTEND, "idle": ForwardMode.IDLE}.get(case, ForwardMode.DECODE))
    calls, one_cycle = [], SimpleNamespace(next_draft_input=SimpleNamespace())
    monkeypatch.setattr(window, "run_window", lambda *a, **k: pytest.fail("ran a window"))
    got = multi_cycle._window_step(lambda *a, **k: calls.append((a, k)) or one_cycle, "worker", b, on_publish="p")
    assert got is one_cycle and calls == [(("worker", b), {"on_publish": "p", "grammar_barrier": None})]


@pytest.mark.parametrize("planned, in_flight", [(3, 1), (3, None), (1, None)])  # None: the first step after a prefill
def test_a_planned_window_runs_as_planned(monkeypatch, planned, in_flight):
    """Windows, and the one cycle after a prefill, run through the cycle graphs (run_window's cycle)."""
    b = grammar_batch(planned=planned, in_flight=in_flight)
    monkeypatch.setattr(window, "run_window", lambda cycle, worker, batch, cycles, **k: ("window", cycles, k))
    assert multi_cycle._window_step(lambda *a, **k: None, "w", b, on_publish="p") == ("window", planned, {"on_publish": "p", "grammar_barrier": None})


def prepared_batch(reqs):
    return SimpleNamespace(reqs=reqs, has_grammar=False, return_logprob=False, model_config=SimpleNamespace(context_len=16384))


@pytest.fixture
def spec(monkeypatch):
    monkeypatch.setattr("sglang.srt.runtime_context.get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=BLOCK))


def test_the_reservation_covers_the_window_in_flight_and_the_next(spec, monkeypatch):
    monkeypatch.setenv(window.ENV, "4")
    reqs = [req(committed=100), req(committed=300)]
    b = prepared_batch(reqs)
    draft = SimpleNamespace(**{window.IN_FLIGHT: 4})
    seen = []

    def sglang_prepare(self, batch):  # what SGLang's reads and seeds: committed + 2 blocks reserved
        seen.append([r.kv_committed_len + 2 * BLOCK for r in batch.reqs])
        batch.seq_lens_cpu = torch.tensor([r.kv_committed_len for r in batch.reqs])
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())

    multi_cycle._reserve_for_the_window(sglang_prepare, draft, b)
    assert getattr(draft, window.PLANNED) == 4
    assert seen == [[100 + 16 * 8, 300 + 16 * 8]]  # 4 cycles in flight + 4 next
    assert [r.kv_committed_len for r in reqs] == [100, 300]  # as they were
    assert b.seq_lens_cpu.tolist() == [100, 300] and b.seq_lens_sum == 400  # the committed lengths it seeds


@pytest.mark.parametrize("case", ["one-cycle window", "after a prefill", "grammar"])
def test_one_cycle_reserves_what_sglang_does(spec, monkeypatch, case):
    monkeypatch.setenv(window.ENV, "1" if case == "one-cycle window" else "8")
    b, seen = prepared_batch([req(committed=100)]), []
    b.has_grammar = case == "grammar"
    draft = SimpleNamespace() if case == "after a prefill" else SimpleNamespace(**{window.IN_FLIGHT: 1})
    multi_cycle._reserve_for_the_window(lambda self, batch: seen.append(batch.reqs[0].kv_committed_len), draft, b)
    assert seen == [100] and getattr(draft, window.PLANNED) == 1


def test_a_one_cycle_decode_step_says_a_decode_step_is_in_flight():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    result = SimpleNamespace(next_draft_input=SimpleNamespace())
    for mode, marked in [(ForwardMode.DECODE, True), (ForwardMode.EXTEND, False)]:
        result.next_draft_input = SimpleNamespace()
        b = grammar_batch(planned=1, mode=mode)
        assert multi_cycle._window_step(lambda *a, **k: result, "worker", b) is result
        assert getattr(result.next_draft_input, window.IN_FLIGHT, None) == (1 if marked else None)


def test_a_failed_reservation_leaves_the_committed_lengths_as_they_were(spec, monkeypatch):
    monkeypatch.setenv(window.ENV, "4")
    reqs = [req(committed=100)]

    def out_of_memory(self, batch):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        multi_cycle._reserve_for_the_window(out_of_memory, SimpleNamespace(), prepared_batch(reqs))
    assert reqs[0].kv_committed_len == 100


def test_the_memory_check_and_the_request_rows_grow_by_the_window(monkeypatch):
    args = SimpleNamespace(speculative_algorithm="DFLASH", speculative_num_steps=1, speculative_eagle_topk=1,
                           max_speculative_num_draft_tokens=BLOCK, page_size=1)
    monkeypatch.setattr("sglang.srt.mem_cache.allocation_sizing.get_server_args", lambda: args)
    monkeypatch.setenv(window.ENV, "4")
    assert multi_cycle._reserve_per_decode(lambda server_args=None: 2 * BLOCK, args) == 2 * 4 * BLOCK
    assert multi_cycle._row_headroom(lambda server_args: 4 + BLOCK, args) == 4 + BLOCK + 6 * BLOCK
    monkeypatch.setenv(window.ENV, "1")
    assert multi_cycle._reserve_per_decode(lambda server_args=None: 2 * BLOCK, args) == 2 * BLOCK
    assert multi_cycle._row_headroom(lambda server_args: 4 + BLOCK, args) == 4 + BLOCK


def test_a_window_counts_one_verify_per_cycle():
    live, done = req(cycles=10, correct=50, rid="live"), req(cycles=7, correct=30, rid="done")
    done.finished = lambda: True
    b = SimpleNamespace(reqs=[live, done])

    def resolve(self, result, batch):  # SGLang's count: one verify per step
        live.spec_verify_ct += 1
        live.spec_num_correct_drafts += 20 - 1
        return [["tokens"]]

    processor = SimpleNamespace(metrics_reporter=SimpleNamespace(spec_num_forward_ct=0))
    result = SimpleNamespace(**{window.CYCLES: 3})
    assert multi_cycle._count_each_cycle(resolve, processor, result, b) == [["tokens"]]
    assert (live.spec_verify_ct, live.spec_num_correct_drafts) == (13, 50 + 20 - 3)  # 20 tokens in 3 cycles: 17 drafts
    assert (done.spec_verify_ct, done.spec_num_correct_drafts) == (7, 30)
    # SGLang's reporter then adds one verify per request of the step: 3 per request in all, as 3 cycles ran
    assert processor.metrics_reporter.spec_num_forward_ct == 2 * 2
    multi_cycle._count_each_cycle(resolve, processor, SimpleNamespace(), b)  # one cycle: SGLang's count
    assert live.spec_verify_ct == 14 and processor.metrics_reporter.spec_num_forward_ct == 4
