"""The cycle's glue and a window's whole cycles as CUDA graphs (graphs/glue.py, server/hooks/glue_graphs.py,
server/hooks/cycle_graphs.py), on the CPU with a stand-in graph that runs the captured function when it is captured
and counts replays: when a step runs eagerly, is captured or replays, what it returns, and what its keys hold. The
real capture and replay are checked on the H200 (tests/test_glue_graphs_gpu.py), where the window and losslessness
tests run through them too (tests/test_window_gpu.py, tests/test_quantized_server_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from conftest import Dispatched
from qflash.graphs import glue
from qflash.server.hooks import cycle_graphs, glue_graphs

COPIES = (torch.ops.aten.clone.default, torch.ops.aten.copy_.default)  # each a launch on a GPU


class StandInGraph:
    fail = False

    def __init__(self):
        self.replays = 0

    def capture_begin(self, capture_error_mode):
        assert capture_error_mode == "thread_local"  # the scheduler's other threads may use CUDA meanwhile

    def capture_end(self):
        if StandInGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):
        self.replays += 1


@pytest.fixture(autouse=True)
def stand_in_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    StandInGraph.fail = False
    glue.drop_all()
    for step in glue.ALL:
        step.broken = False


def test_a_layout_runs_eagerly_first_is_captured_second_and_replays_after():
    step, calls = glue.GlueGraphs("a step"), []
    for _ in range(4):
        step.run(key="bs 1", fn=lambda: calls.append("bs 1"))
    assert calls == ["bs 1", "bs 1"]  # eager, then inside the capture
    assert step.graphs["bs 1"][0].replays == 3  # after its capture, and twice more
    step.run(key="bs 2", fn=lambda: calls.append("bs 2"))
    assert calls[-1] == "bs 2" and "bs 2" not in step.graphs


def test_a_replay_returns_what_the_step_returned_when_captured():
    step, made = glue.GlueGraphs("a step"), []

    def fn():
        made.append(torch.zeros(1))
        return made[-1]

    values = [step.run(key="bs 1", fn=fn) for _ in range(4)]
    assert values[0] is made[0] and values[1] is made[1] and values[2] is values[3] is made[1]


def test_a_step_run_inside_another_steps_capture_is_held_by_that_capture():
    outer, inner, calls = glue.GlueGraphs("outer"), glue.GlueGraphs("inner"), []

    def both():
        calls.append("outer")
        inner.run(key="bs 1", fn=lambda: calls.append("inner"))

    for _ in range(3):
        outer.run(key="bs 1", fn=both)
    assert calls == ["outer", "inner", "outer", "inner"]  # eager, then inside the outer capture
    assert "bs 1" in outer.graphs and not inner.graphs  # the inner step's graph is not its own
    assert not glue.capturing()


def test_a_step_that_refuses_its_capture_stays_eager(caplog):
    step, calls = glue.GlueGraphs("a step"), []

    def fn():
        calls.append(glue.capturing())
        if glue.capturing():
            raise glue.NotCapturable("a forward ran without its graph")

    for _ in range(3):
        step.run(key="bs 1", fn=fn)
    assert calls == [False, True, False, False] and step.broken and not step.graphs
    assert "a step cannot be captured, it runs eagerly: a forward ran without its graph" in caplog.text


def test_no_key_runs_eagerly_every_time():
    step, calls = glue.GlueGraphs("a step"), []
    for _ in range(3):
        step.run(key=None, fn=lambda: calls.append(1))
    assert calls == [1, 1, 1] and not step.graphs and not step.seen


def test_a_capture_that_fails_leaves_the_step_eager_and_says_so(caplog):
    step, calls = glue.GlueGraphs("a step"), []
    StandInGraph.fail = True
    for _ in range(3):
        step.run(key="bs 1", fn=lambda: calls.append(1))
    assert calls == [1, 1, 1, 1]  # eager; captured (and lost) then eager; eager
    assert step.broken and not step.graphs
    assert "a step cannot be captured, it runs eagerly" in caplog.text


def test_dropped_graphs_are_captured_again_from_their_next_sight():
    step, calls = glue.GlueGraphs("a step"), []
    for _ in range(3):
        step.run(key="bs 1", fn=lambda: calls.append(1))
    glue.drop_all()
    step.run(key="bs 1", fn=lambda: calls.append(2))
    assert calls == [1, 1, 2] and not step.graphs


def test_a_steps_fresh_inputs_land_in_its_own_buffers_in_one_launch():
    buffers = {}
    first = glue.static_copies(buffers, "step", a=torch.tensor([1, 2]), b=torch.tensor([3]), c=None,
                               d=torch.tensor([4.0]))
    with Dispatched() as ops:
        again = glue.static_copies(buffers, "step", a=torch.tensor([5, 6]), b=torch.tensor([7]), c=None,
                                   d=torch.tensor([8.0]))
    assert again.a is first.a and again.b is first.b and again.d is first.d and again.c is None  # what a graph reads
    assert again.a.tolist() == [5, 6] and again.b.tolist() == [7] and again.d.tolist() == [8.0]
    assert ops.count(*COPIES) == 0 and ops.count(torch.ops.aten._foreach_copy_.default) == 2  # one per dtype
    other = glue.static_copies(buffers, "step", a=torch.tensor([5, 6, 7]), b=torch.tensor([7]), c=None,
                               d=torch.tensor([8.0]))
    assert other.a is not first.a and other.b is not first.b  # another shape: buffers of its own


def gdn_worker(slots):
    linear = SimpleNamespace(forward_metadata=SimpleNamespace(mamba_cache_indices=slots))
    return SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(
        attn_backend=SimpleNamespace(linear_attn_backend=linear))))


def test_the_gdn_commit_runs_on_copies_of_its_fresh_inputs_keyed_by_the_verifys_state_slots():
    seen = []

    def commit(self, *, batch, seq_lens_pre_verify, commit_lens):
        seen.append((batch.seq_lens.tolist(), batch.mamba_track_indices.tolist(), batch.req_pool_indices.tolist(),
                     seq_lens_pre_verify.tolist(), commit_lens.tolist(), commit_lens.data_ptr()))

    slots = torch.tensor([3, 4])
    worker = gdn_worker(slots)
    for k in range(3):  # fresh tensors every cycle, as SGLang's worker makes them
        batch = SimpleNamespace(seq_lens=torch.tensor([100 + k, 200 + k]), mamba_track_indices=torch.tensor([7, 8]),
                                req_pool_indices=torch.tensor([1, 2]))
        glue_graphs._gdn_commit_in_a_graph(commit, worker, batch=batch, seq_lens_pre_verify=torch.tensor([90, 190]),
                                           commit_lens=torch.tensor([5, 6], dtype=torch.int32))
    assert [s[:5] for s in seen] == [([100, 200], [7, 8], [1, 2], [90, 190], [5, 6]),
                                     ([101, 201], [7, 8], [1, 2], [90, 190], [5, 6])]  # eager, captured; then replayed
    assert seen[0][5] == seen[1][5]  # the same buffer: what the graph reads
    worker.target_worker.model_runner.attn_backend.linear_attn_backend.forward_metadata.mamba_cache_indices = slots.clone()
    batch = SimpleNamespace(seq_lens=torch.tensor([103, 203]), mamba_track_indices=None, req_pool_indices=torch.tensor([1, 2]))
    glue_graphs._gdn_commit_in_a_graph(lambda self, **kw: seen.append(kw["batch"].mamba_track_indices), worker, batch=batch,
                                       seq_lens_pre_verify=torch.tensor([90, 190]), commit_lens=torch.tensor([5, 6], dtype=torch.int32))
    assert seen[-1] is None  # other state slots, no tracking: another layout, run eagerly


def test_inside_a_cycles_capture_the_glue_steps_run_on_their_own_inputs_without_copies(monkeypatch):
    """The cycle's graph holds every address: copying the steps' fresh inputs into buffers would only add launches."""
    monkeypatch.setattr(glue._capture, "active", True)
    seen = []
    batch = SimpleNamespace(seq_lens=torch.tensor([100, 200]), mamba_track_indices=torch.tensor([7, 8]),
                            req_pool_indices=torch.tensor([1, 2]))
    pre, commit = torch.tensor([90, 190]), torch.tensor([5, 6], dtype=torch.int32)
    buffers = dict(glue_graphs._STATIC)  # the steps' buffers other tests made
    with Dispatched() as ops:
        glue_graphs._gdn_commit_in_a_graph(lambda self, **kw: seen.append(kw), gdn_worker(torch.tensor([3, 4])),
                                           batch=batch, seq_lens_pre_verify=pre, commit_lens=commit)
        hidden, loc = torch.zeros(4, 2), torch.arange(4)
        glue_graphs._drafter_kv_in_a_graph(lambda self, *args: seen.append(args), drafter(torch.zeros(16, 4)),
                                           ctx_hidden=hidden, ctx_positions=loc, ctx_cache_loc=loc,
                                           ctx_cache_loc_2d=loc.view(1, 4), commit_lens=commit)
    assert seen[0] == {"batch": batch, "seq_lens_pre_verify": pre, "commit_lens": commit} and seen[1][0] is hidden
    assert ops.count(*COPIES) == 0 and glue_graphs._STATIC == buffers and not glue_graphs.GDN_COMMIT.graphs


def drafter(workspace):
    helper = SimpleNamespace(_proj_workspace=workspace, _k_workspace=workspace, _v_workspace=workspace,
                             rotary_emb=SimpleNamespace(cos_sin_cache=torch.zeros(8, 4)))
    return SimpleNamespace(_fused_kv_helper=helper)


def test_the_drafter_kv_write_is_keyed_by_the_helpers_workspaces_and_a_prefills_write_stays_eager():
    calls = []

    def write(self, ctx_hidden, ctx_positions, ctx_cache_loc, ctx_cache_loc_2d=None, commit_lens=None):
        calls.append((ctx_hidden.tolist(), ctx_cache_loc_2d is None))

    worker, positions, loc = drafter(torch.zeros(16, 4)), torch.arange(4), torch.arange(4)
    commit = torch.tensor([2], dtype=torch.int32)
    for k in range(3):
        glue_graphs._drafter_kv_in_a_graph(write, worker, ctx_hidden=torch.full((4, 2), float(k)), ctx_positions=positions,
                                           ctx_cache_loc=loc, ctx_cache_loc_2d=loc.view(1, 4), commit_lens=commit)
    assert [c[0][0][0] for c in calls] == [0.0, 1.0]  # eager, captured; the third replayed
    prompt = torch.full((9, 2), 5.0)
    glue_graphs._drafter_kv_in_a_graph(write, worker, ctx_hidden=prompt, ctx_positions=torch.arange(9), ctx_cache_loc=torch.arange(9))
    assert calls[-1] == (prompt.tolist(), True)
    worker._fused_kv_helper._k_workspace = torch.zeros(32, 4)  # a longer prefill grew it
    glue_graphs._drafter_kv_in_a_graph(write, worker, ctx_hidden=torch.full((4, 2), 3.0), ctx_positions=positions,
                                       ctx_cache_loc=loc, ctx_cache_loc_2d=loc.view(1, 4), commit_lens=commit)
    assert calls[-1][0][0][0] == 3.0  # a new layout: eager


class CycleWorker:
    """What run_cycle reads of SGLang's DFlashWorkerV2; its cycle writes the lengths + 3 and bonus + 1 into the
    rotating buffers, as the real one's accept step does, and its forwards "replay" their graphs."""

    block_size = 16

    def __init__(self):
        self._fused_kv_helper = SimpleNamespace(_proj_workspace=torch.zeros(4), _k_workspace=None, _v_workspace=None)
        self._draft_block_ids_buf = torch.zeros(8, 16, dtype=torch.long)
        self.model_runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 64)))
        self.war_fastpath_runner = SimpleNamespace(war_fastpath_read_done_event=None)  # the target's, in SGLang
        self.rotating = [torch.zeros(2, dtype=torch.long) for _ in range(2)]
        self.cycles, self.graphs_replayed, self.seen = 0, 2, []

    def _next_accept_bonus_buffers(self, bs):
        return tuple(self.rotating)

    def _make_next_draft_input_decode(self, *, bonus_tokens, new_seq_lens):
        return SimpleNamespace(bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens)

    def cycle(self, batch, on_publish=None, grammar_barrier=None):
        assert on_publish is None  # run_cycle publishes after the graph
        self.cycles += 1
        self.seen.append((batch.seq_lens.data_ptr(), batch.seq_lens.tolist()))
        glue._capture.embedded += self.graphs_replayed
        new_seq_lens, bonus = self._next_accept_bonus_buffers(2)
        new_seq_lens.copy_(batch.seq_lens + 3)
        bonus.copy_(batch.spec_info.bonus_tokens + 1)
        batch.out_cache_loc = "the verify's slots"
        return SimpleNamespace(new_seq_lens=new_seq_lens, next_draft_input=SimpleNamespace(bonus_tokens=bonus))


def cycle_batch(lens, sampling_info=None):
    return SimpleNamespace(seq_lens=torch.tensor(lens), spec_info=SimpleNamespace(bonus_tokens=torch.tensor([5, 6])),
                           req_pool_indices=torch.tensor([1, 2]), mamba_track_indices=None, has_grammar=False,
                           sampling_info=sampling_info, out_cache_loc=None)


@pytest.fixture
def cycle_env(monkeypatch):
    from sglang.srt.speculative import dflash_worker_v2

    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda: None))
    monkeypatch.setattr(cycle_graphs.radix_cache, "refresh_mamba_track", lambda batch: None)
    monkeypatch.setattr(dflash_worker_v2, "SIMULATE_ACC_LEN", -1)
    cycle_graphs._STATIC.clear()
    return dflash_worker_v2


def run_cycle(worker, batch, **kwargs):
    return cycle_graphs.run_cycle(CycleWorker.cycle, worker, batch, **kwargs)


def test_a_cycle_replays_on_copies_of_its_inputs_and_hands_back_a_new_result_of_the_graphs_tensors(cycle_env):
    worker, published = CycleWorker(), []
    results = [run_cycle(worker, cycle_batch([100 + k, 200 + k]), on_publish=published.append) for k in range(4)]
    assert worker.cycles == 2  # eager, captured; then replayed
    assert worker.seen[0][0] == worker.seen[1][0] and [s[1] for s in worker.seen] == [[100, 200], [101, 201]]
    assert results[1].new_seq_lens.data_ptr() not in [t.data_ptr() for t in worker.rotating]  # the graph's own
    assert results[2] is not results[3] and results[2].next_draft_input is not results[3].next_draft_input
    assert results[3].new_seq_lens is results[1].new_seq_lens  # what the replays rewrite
    assert [p is r.new_seq_lens for p, r in zip(published, results)] == [True] * 4
    assert worker.war_fastpath_runner.war_fastpath_read_done_event is not None


def test_a_cycles_capture_hands_the_accept_step_fresh_buffers_not_copies_of_sglangs(monkeypatch):
    """SGLang's accept kernel writes every element of its output buffers: the graph's own need no copy of the
    rotating ones' contents."""
    monkeypatch.setattr(glue._capture, "active", True)
    monkeypatch.setattr(glue._capture, "embedded", 0)
    worker = CycleWorker()
    with Dispatched() as ops:
        result, _ = cycle_graphs._captured_cycle(CycleWorker.cycle, worker, cycle_batch([100, 200]))
    assert result.new_seq_lens.tolist() == [103, 203] and result.next_draft_input.bonus_tokens.tolist() == [6, 7]
    assert result.new_seq_lens.data_ptr() not in [t.data_ptr() for t in worker.rotating]
    assert ops.count(*COPIES) == 2  # the cycle's own copies into them (the stand-in's accept step), none before


def test_the_batch_keeps_its_own_tensors_after_a_cycle(cycle_env):
    worker, batch = CycleWorker(), cycle_batch([100, 200])
    lens, pool = batch.seq_lens, batch.req_pool_indices
    run_cycle(worker, batch)
    assert batch.seq_lens is lens and batch.req_pool_indices is pool and batch.out_cache_loc == "the verify's slots"


def test_each_simulated_acceptance_length_has_its_graph_drawn_before_the_cycle(cycle_env, monkeypatch):
    from sglang.srt.speculative import spec_utils

    monkeypatch.setattr(cycle_env, "SIMULATE_ACC_LEN", 6.5)
    lengths = iter([6, 7, 6, 7, 6, 7])
    monkeypatch.setattr(spec_utils, "_sample_simulated_acc_len", lambda *a: next(lengths))
    worker, drawn = CycleWorker(), []
    real_cycle = CycleWorker.cycle

    def cycle(self, batch, **kw):
        drawn.append(cycle_graphs._drawn_length(lambda *a: "sampled in the cycle", 6.5, "match-expected", 16))
        return real_cycle(self, batch, **kw)

    for _ in range(6):
        cycle_graphs.run_cycle(cycle, worker, cycle_batch([100, 200]))
    assert drawn == [6, 7, 6, 7] and worker.cycles == 4  # each length: eager, captured; then both replayed
    assert cycle_graphs._drawn_length(lambda *a: "sampled in the cycle") == "sampled in the cycle"  # outside a cycle


def test_a_cycle_whose_forward_ran_without_its_graph_stays_eager(cycle_env):
    worker = CycleWorker()
    worker.graphs_replayed = 1
    for _ in range(3):
        run_cycle(worker, cycle_batch([100, 200]))
    assert worker.cycles == 4 and cycle_graphs.CYCLE.broken


@pytest.mark.parametrize("case", ["sampled", "penalties", "logit bias", "grammar", "eager switch"])
def test_cycles_that_depend_on_host_state_run_as_sglang_runs_them(cycle_env, case):
    info = SimpleNamespace(is_all_greedy=case != "sampled", has_custom_logit_processor=False, grammar_mask=None,
                           logit_bias=torch.zeros(1) if case == "logit bias" else None,
                           penalizer_orchestrator=SimpleNamespace(is_required=case == "penalties"))
    worker, batch = CycleWorker(), cycle_batch([100, 200], sampling_info=info)
    batch.has_grammar = case == "grammar"
    for _ in range(3):
        run_cycle(worker, batch, graphed=case != "eager switch")
    assert worker.cycles == 3 and not cycle_graphs.CYCLE.graphs and not cycle_graphs._STATIC


def test_sglangs_full_graphs_are_kept_when_captured_and_embedded_inside_a_cycles_capture(monkeypatch):
    made = []

    class Graph:
        def __init__(self, keep_graph=False):
            self.keep_graph, self.instantiated = keep_graph, False
            made.append(self)

        def instantiate(self):
            self.instantiated = True

    def capture_one(self, shape_key, forward_fn, capture_inputs=None, post_warmup_hook=None):  # as SGLang's builds it
        self._graphs[shape_key], self._outputs[shape_key] = torch.cuda.CUDAGraph(), forward_fn()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    backend = SimpleNamespace(_graphs={}, _outputs={})
    cycle_graphs.CYCLE.graphs["a layout"] = ("a cycle graph", "its result")
    cycle_graphs._keep_decode_graphs(capture_one, backend, "bs 1", lambda: "logits", capture_inputs=None)
    assert made[0].keep_graph and made[0].instantiated and torch.cuda.CUDAGraph is Graph  # restored after the call
    assert not cycle_graphs.CYCLE.graphs  # it held a clone of the forward graph captured again
    embedded = []
    monkeypatch.setattr(glue, "embed", embedded.append)
    replays = []
    replay = lambda self, key, fb: replays.append(key) or "replayed"
    assert cycle_graphs._embed_inside_a_cycle_capture(replay, backend, "bs 1", None) == "replayed" and not embedded
    monkeypatch.setattr(glue._capture, "active", True)
    assert cycle_graphs._embed_inside_a_cycle_capture(replay, backend, "bs 1", None) == "logits"
    assert embedded == [made[0]] and replays == ["bs 1"]


def test_a_graphed_cycles_verify_pick_runs_qflashs_row_argmax_and_an_eager_cycles_torchs(cycle_env, monkeypatch):
    """In the cycles a graph holds (the eager first run that compiles, the capture) torch.argmax over the verify's
    fp32 logits runs qflash's kernel; a cycle outside them keeps torch's."""
    from qflash.kernels import row_argmax

    picks, ours = [], row_argmax.argmax
    monkeypatch.setattr(row_argmax, "argmax", lambda x: picks.append("qflash") or ours(x))
    logits = torch.randn(2 * 16, cycle_graphs.VOCAB_WIDE, generator=torch.Generator().manual_seed(0))
    logits = logits.to("cuda" if torch.cuda.is_available() else "cpu")  # where the kernel runs

    class PickingWorker(CycleWorker):
        def cycle(self, batch, on_publish=None, grammar_barrier=None):
            self.picked = torch.argmax(logits, dim=-1).view(2, 16)  # as SGLang's verify picks
            return CycleWorker.cycle(self, batch, on_publish, grammar_barrier)

    worker = PickingWorker()
    for _ in range(2):  # eager, captured
        cycle_graphs.run_cycle(PickingWorker.cycle, worker, cycle_batch([100, 200]))
        assert torch.equal(worker.picked.view(-1), logits.argmax(-1))  # outside any cycle: torch's
    assert picks == ["qflash"] * 2
    cycle_graphs.run_cycle(PickingWorker.cycle, worker, cycle_batch([100, 200]), graphed=False)
    assert picks == ["qflash"] * 2
