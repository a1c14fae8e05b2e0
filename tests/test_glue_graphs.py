"""The cycle's glue as CUDA graphs (graphs/glue.py, server/hooks/glue_graphs.py), on the CPU with a stand-in graph
that runs the captured function when it is captured and counts replays: when a step runs eagerly, is captured or
replays, and what its keys hold. The real capture and replay are checked on the H200, where the window and
losslessness tests run through them (tests/test_window_gpu.py, tests/test_gpu_server.py)."""

from types import SimpleNamespace

import pytest
import torch

from qflash.graphs import glue
from qflash.server.hooks import glue_graphs


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
    assert step.graphs["bs 1"].replays == 3  # after its capture, and twice more
    step.run(key="bs 2", fn=lambda: calls.append("bs 2"))
    assert calls[-1] == "bs 2" and "bs 2" not in step.graphs


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
