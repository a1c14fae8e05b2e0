"""The test fault plugin (tests/faults/sitecustomize.py) on the CPU.

Here, with fakes in place of the wrapped functions: every hook passes its call through untouched until the fault
file names one of its faults, then changes the call as that fault says. In one fresh interpreter started as a
server's processes are (PYTHONPATH and QFLASH_FAULTS_FILE from fault_env, SGLang's plugin loading with qflash's
plugins): every target exists in the pinned SGLang and carries its hook beside qflash's own, and naming a fault
switches the real functions' results, and clearing the file switches them back, with no restart. In a fake
`sglang` tree: the hooks register when SGLang's hook registry is first imported, in a spawned child process too,
and not at all without the environment.
"""

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from conftest import run_python
from fault_control import FAULTS, fault_env, injected, plugin


@pytest.fixture
def fault_path(tmp_path, monkeypatch):
    path = tmp_path / "fault"
    monkeypatch.setenv(plugin().ENV, str(path))
    return path


def recorder():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "result"

    return calls, original


def call(target: str, **kwargs):
    """The hook on `target` around a recording fake: (args, kwargs) the fake received, what the hook returned."""
    calls, original = recorder()
    result = plugin().HOOKS[target](original, "self", **kwargs)
    (got,) = calls
    return got, result


WORKER = "sglang.srt.speculative.dflash_worker_v2."
TRITON_ACCEPT = WORKER + "_compute_dflash_accept_bonus_triton_unchecked"
EAGER_ACCEPT = WORKER + "compute_dflash_correct_drafts_and_bonus"
FOLD = "sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold.commit_gdn_replayssm_fold_after_verify"
KV = WORKER + "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc"
CARRY = "qflash.server.window.carry_to_next_cycle"
PLAN = "qflash.server.window.plan_cycles"
PLAN_STREAM = "sglang.srt.speculative.dflash_info_v2._get_overlap_plan_stream"
GLUE = "qflash.graphs.glue.GlueGraphs.run"
CYCLE = "qflash.server.hooks.cycle_graphs.run_cycle"
FRESH = "qflash.graphs.fresh_prefill.replay"
LOGPROBS = "sglang.srt.layers.logprob_processor.compute_spec_v2_logprobs"
VARLEN = "qflash.kernels.flash_prefill.varlen_attn"

CAND = torch.tensor([[7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 3, 4]])  # block of K=5: current token + 4 drafts
TOP = torch.tensor([[1, 2, 9, 9, 5], [1, 2, 3, 4, 5], [8, 8, 8, 8, 8]])  # target choices: 2, 4 (all), 0 drafts match
LAST = torch.tensor([0, 1, 5])


def sample_kwargs(target: str) -> dict:
    """The keyword arguments SGLang's call site passes to `target`, with small values."""
    if target == TRITON_ACCEPT:
        return {"candidates": CAND, "target_top1": TOP, "accept_lens_out": torch.zeros(3), "prefix_lens": torch.zeros(3)}
    if target == EAGER_ACCEPT:
        return {"candidates": CAND, "target_predict": TOP}
    if target == FOLD:
        return {"spec_state": object(), "state_batch_indices": torch.tensor([10, 11, 12]), "accept_lens": LAST + 1,
                "last_correct_step_indices": LAST, "mamba_track_indices": torch.tensor([20, 21, 22]),
                "mamba_steps_to_track": torch.tensor([-1, 0, 3])}
    if target == CARRY:
        return {"batch": object(), "draft_input": SimpleNamespace(bonus_tokens=torch.tensor([5])),
                "bonus_tokens": torch.tensor([6]), "seq_lens": torch.tensor([40])}
    if target == PLAN:
        return {"reqs": [], "limit": 4, "in_flight": 1, "block": 16, "context_len": 16384}
    if target == VARLEN:  # after query, key, value
        return {"cu_seq_q": torch.tensor([0, 5, 17], dtype=torch.int32), "max_q": 12, "max_k": 19, "scale": 0.1,
                "cu_seq_k": torch.tensor([0, 9, 28], dtype=torch.int32), "window_size": (-1, 0)}
    if target == LOGPROBS:
        return {"batch": object(), "logits_output": object(), "predict": torch.zeros(8, dtype=torch.int64),
                "accept_index": torch.arange(8).view(2, 4), "speculative_num_steps": 3}
    assert target == KV
    return {"target_hidden": torch.zeros(3, 2), "cache_loc": torch.tensor([4, 5, 6]), "positions": torch.tensor([0, 1, 2]),
            "commit_lens": torch.tensor([3])}


def test_the_plugin_wraps_the_targets_this_test_knows():
    assert set(plugin().HOOKS) == {TRITON_ACCEPT, EAGER_ACCEPT, FOLD, KV, CARRY, PLAN, PLAN_STREAM, GLUE, CYCLE, LOGPROBS,
                                   FRESH, VARLEN}
    assert plugin().FAULTS == ["accept_off_by_one", "cycle_eager", "drafter_kv_shift", "fresh_prefill_off",
                               "gdn_state_wrong_step", "glue_eager", "logprobs_one_position_late", "one_cycle_per_step",
                               "plan_stream_off", "plan_stream_on", "prefill_requests_merged", "stale_cache_checkpoint",
                               "window_2", "window_4", "window_stale_bonus"]


def test_the_fault_is_read_again_whenever_the_file_changes(fault_path):
    assert plugin().active() == ""  # no file
    with injected(fault_path, "drafter_kv_shift"):
        assert plugin().active() == "drafter_kv_shift"
    assert plugin().active() == "" and fault_path.read_text() == ""
    with injected(fault_path, "accept_off_by_one"):
        assert plugin().active() == "accept_off_by_one"


@pytest.mark.parametrize("state", ["no file", "empty file", "another fault"])
@pytest.mark.parametrize("target", [TRITON_ACCEPT, EAGER_ACCEPT, FOLD, KV, CARRY, PLAN, LOGPROBS, VARLEN])
def test_a_hook_passes_the_call_through_unless_its_fault_is_named(target, state, fault_path):
    if state != "no file":
        other = next(f for f in plugin().FAULTS if f not in plugin().TARGETS[target])
        fault_path.write_text(other if state == "another fault" else "")
    kwargs = sample_kwargs(target)
    (args, got), result = call(target, **kwargs)
    assert result == "result" and args == ("self",)
    assert got.keys() == kwargs.keys() and all(got[k] is v for k, v in kwargs.items())


def test_prefill_requests_merged_attends_the_packed_requests_as_one_sequence(fault_path):
    fault_path.write_text("prefill_requests_merged")
    (args, got), _ = call(VARLEN, **sample_kwargs(VARLEN))
    assert got["cu_seq_q"].tolist() == [0, 17] and got["cu_seq_k"].tolist() == [0, 28]
    assert (got["max_q"], got["max_k"], got["scale"], got["window_size"]) == (17, 28, 0.1, (-1, 0))


def accepted(candidates, target):
    """The greedy rule's count of accepted drafts (SGLang's dflash_utils, restated for the fakes)."""
    return (candidates[:, 1:] == target[:, :-1]).int().cumprod(1).sum(1).tolist()


@pytest.mark.parametrize("target, key", [(TRITON_ACCEPT, "target_top1"), (EAGER_ACCEPT, "target_predict")])
def test_accept_off_by_one_makes_the_first_rejected_draft_match(target, key, fault_path):
    kwargs = sample_kwargs(target)
    before = TOP.clone()
    with injected(fault_path, "accept_off_by_one"):
        (_, got), result = call(target, **kwargs)
    assert result == "result" and torch.equal(TOP, before)  # a new tensor: the verify's own choices are untouched
    forced = got[key]
    assert accepted(CAND, TOP) == [2, 4, 0] and accepted(CAND, forced) == [3, 4, 1]  # one more, none past K-1
    # only the first rejection changed: the bonus token after it is still the target's choice there
    assert forced.tolist() == [[1, 2, 3, 9, 5], [1, 2, 3, 4, 5], [1, 8, 8, 8, 8]]
    assert forced.is_contiguous() and all(got[k] is v for k, v in kwargs.items() if k != key)


def test_gdn_state_wrong_step_folds_the_recurrent_state_one_step_short(fault_path):
    kwargs = sample_kwargs(FOLD)
    with injected(fault_path, "gdn_state_wrong_step"):
        (_, got), _ = call(FOLD, **kwargs)
    assert got["accept_lens"].tolist() == [1, 1, 5]  # steps folded: last accepted step - 1, at least step 0
    assert got["accept_lens"].dtype == kwargs["accept_lens"].dtype
    assert all(got[k] is v for k, v in kwargs.items() if k != "accept_lens")  # the conv commit's step too


def test_stale_cache_checkpoint_tracks_no_crossing(fault_path):
    kwargs = sample_kwargs(FOLD)
    with injected(fault_path, "stale_cache_checkpoint"):
        (_, got), _ = call(FOLD, **kwargs)
        (_, without_track), _ = call(FOLD, **{**kwargs, "mamba_steps_to_track": None})
    assert got["mamba_steps_to_track"].tolist() == [-1, -1, -1]
    assert all(got[k] is v for k, v in kwargs.items() if k != "mamba_steps_to_track")
    assert without_track["mamba_steps_to_track"] is None


def test_drafter_kv_shift_writes_the_context_one_position_later(fault_path):
    kwargs = sample_kwargs(KV)
    with injected(fault_path, "drafter_kv_shift"):
        (_, got), _ = call(KV, **kwargs)
    assert got["positions"].tolist() == [1, 2, 3] and kwargs["positions"].tolist() == [0, 1, 2]
    assert all(got[k] is v for k, v in kwargs.items() if k != "positions")


def test_window_stale_bonus_starts_the_next_block_from_the_previous_bonus(fault_path):
    kwargs = sample_kwargs(CARRY)
    with injected(fault_path, "window_stale_bonus"):
        (_, got), _ = call(CARRY, **kwargs)
    assert got["bonus_tokens"] is kwargs["draft_input"].bonus_tokens
    assert all(got[k] is v for k, v in kwargs.items() if k != "bonus_tokens")


def test_logprobs_one_position_late_reads_each_token_from_the_next_position(fault_path):
    kwargs = sample_kwargs(LOGPROBS)
    with injected(fault_path, "logprobs_one_position_late"):
        (_, got), _ = call(LOGPROBS, **kwargs)
    assert got["accept_index"].tolist() == [[1, 2, 3, 0], [5, 6, 7, 4]] and kwargs["accept_index"][0, 0] == 0
    assert all(got[k] is v for k, v in kwargs.items() if k != "accept_index")


@pytest.mark.parametrize("switch, limit", [("one_cycle_per_step", 1), ("window_2", 2), ("window_4", 4)])
def test_window_switches_limit_the_planner(fault_path, switch, limit):
    with injected(fault_path, switch):
        (_, got), _ = call(PLAN, **{**sample_kwargs(PLAN), "limit": 8})
    assert got == {**sample_kwargs(PLAN), "limit": limit}


def test_plan_stream_off_sets_the_environment_for_the_call_alone(fault_path, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "1")
    seen = []
    hook = plugin().HOOKS[PLAN_STREAM]
    original = lambda device: seen.append(os.environ["SGLANG_ENABLE_OVERLAP_PLAN_STREAM"]) or device
    assert hook(original, "cuda") == "cuda"
    with injected(fault_path, "plan_stream_off"):
        assert hook(original, "cuda") == "cuda"
    assert hook(original, "cuda") == "cuda"
    monkeypatch.delenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM")
    with injected(fault_path, "plan_stream_on"):
        assert hook(original, "cuda") == "cuda"
    assert seen == ["1", "0", "1", "1"] and "SGLANG_ENABLE_OVERLAP_PLAN_STREAM" not in os.environ


def test_the_control_helpers(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = fault_env(tmp_path / "f")
    assert env == {"PYTHONPATH": f"{FAULTS}{os.pathsep}/elsewhere", "QFLASH_FAULTS_FILE": str(tmp_path / "f")}
    with pytest.raises(ValueError, match="no fault"):
        with injected(tmp_path / "f", "accept_of_by_one"):
            pass
    with pytest.raises(RuntimeError):
        with injected(tmp_path / "f", "gdn_state_wrong_step"):
            assert (tmp_path / "f").read_text() == "gdn_state_wrong_step"
            raise RuntimeError
    assert (tmp_path / "f").read_text() == ""


# A server process's view: SGLang's plugin loading (both qflash plugins) with the fault plugin in from start-up,
# then the real functions, with only their GPU-side callees replaced by recorders, clean, under each fault, clean.
PROBE = """
import json, os, pkgutil, sys
from pathlib import Path
from types import SimpleNamespace
import torch
from sglang.srt.plugins import load_plugins
load_plugins()
import sitecustomize as faults  # the module this interpreter loaded at start
from qflash.server.plugin import QFLASH
from sglang.kernels.ops.attention.fla import gdn_replayssm_spec_fold as fold
from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
from sglang.srt.speculative import dflash_worker_v2 as worker


def wraps(fn, hook):  # whether hook is in the chain of HookRegistry wrappers fn heads (each closure holds the next)
    cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    return any(c is hook for c in cells) or any(wraps(c, hook) for c in cells if callable(c) and c is not fn)


def carries(target, hook):
    owner, _, attr = target.rpartition(".")
    return wraps(getattr(pkgutil.resolve_name(owner), attr), hook)


out = {"faults": {t: carries(t, hook) for t, hook in faults.HOOKS.items()},
       "qflash": {c.target: carries(c.target, c.fn) for c in QFLASH if hasattr(c, "fn")}, "runs": []}
cand = torch.tensor([[7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 3, 4]])
top = torch.tensor([[1, 2, 9, 9, 5], [1, 2, 3, 4, 5], [8, 8, 8, 8, 8]])


def accept():
    lens, bonus = worker.compute_dflash_correct_drafts_and_bonus(candidates=cand, target_predict=top)
    bufs = [torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
            torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)]
    worker._compute_dflash_accept_bonus_triton_unchecked(
        candidates=cand, target_top1=top, accept_lens_out=bufs[0], commit_lens_out=bufs[1], bonus_ids_out=bufs[2],
        out_tokens_out=bufs[3], prefix_lens=torch.tensor([100, 200, 300]), new_seq_lens_out=bufs[4])
    return {"eager": [lens.tolist(), bonus.tolist()], "triton": [b.tolist() for b in bufs]}


calls = []
fold.commit_gdn_replayssm_fold_all_layers = lambda **kw: calls.append(
    ["ssm", kw["ssm_state_indices"].tolist(), kw["accept_lens"].tolist(), kw["mamba_steps_to_track"].tolist()])
scatter.fused_conv_window_scatter_with_mask = lambda conv, window, slots, steps: calls.append(
    ["conv", slots.tolist(), steps.tolist()])
spec = SimpleNamespace(replayssm_rawv=torch.zeros(1, 1, 1, 16, 1), replayssm_rawk=torch.zeros(1, 1, 1, 16, 1),
                       temporal=None, replayssm_g=None, replayssm_beta=None, conv=[None], intermediate_conv_window=[None])


def commit():
    calls.clear()
    last = torch.tensor([0, 1, 5])
    fold.commit_gdn_replayssm_fold_after_verify(
        spec_state=spec, state_batch_indices=torch.tensor([10, 11, 12]), accept_lens=last + 1,
        last_correct_step_indices=last, mamba_track_indices=torch.tensor([20, 21, 22]),
        mamba_steps_to_track=torch.tensor([-1, 0, 3]))
    return list(calls)


written = []
drafter = SimpleNamespace(
    model_runner=SimpleNamespace(device=torch.device("cpu")), _use_fused_kv_materialize=False,
    draft_model=SimpleNamespace(project_target_hidden=lambda hidden: hidden),
    _append_target_hidden_sequential=lambda ctx_hidden, ctx_positions, ctx_cache_loc: written.append(ctx_positions.tolist()))


def append():
    written.clear()
    worker.DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc(
        drafter, target_hidden=torch.zeros(3, 2), cache_loc=torch.tensor([4, 5, 6]), positions=torch.tensor([0, 1, 2]))
    return written[0]


from qflash.server import window
from sglang.srt.speculative import dflash_info_v2 as info

batch, draft = SimpleNamespace(), SimpleNamespace()


def carry():
    draft.bonus_tokens = "verified before"
    window.carry_to_next_cycle(batch=batch, draft_input=draft, bonus_tokens="just verified", seq_lens="new lengths")
    return [draft.bonus_tokens, batch.seq_lens, batch.forward_mode.name]


def plan():
    req = SimpleNamespace(spec_verify_ct=0, spec_num_correct_drafts=0, output_ids=[], kv_committed_len=100,
                          sampling_params=SimpleNamespace(max_new_tokens=None))
    return window.plan_cycles([req], limit=4, in_flight=1, block=16, context_len=16384)


def plan_stream():
    info._OVERLAP_PLAN_STREAMS.clear()
    fake = SimpleNamespace(Stream=lambda: "a stream", stream=lambda stream: None)
    real, torch.get_device_module = torch.get_device_module, lambda device: fake
    try:
        return info._get_overlap_plan_stream("cuda")[0]
    finally:
        torch.get_device_module = real


from qflash.graphs.glue import GlueGraphs


def glue():
    step = GlueGraphs("probe")
    step.run(key="a layout", fn=lambda: None)
    return sorted(step.seen)


from qflash.server.hooks import cycle_graphs


class Batch:  # whether run_cycle asked if the batch may be graphed (it does not when told to run eagerly)
    asked = False

    @property
    def has_grammar(self):
        Batch.asked = True
        return True  # a grammar batch: run as SGLang runs it, graphed or not


def cycle():
    Batch.asked = False
    cycle_graphs.run_cycle(lambda worker, batch, **kw: None, None, Batch())
    return "graphed" if Batch.asked else "eager"


from qflash.graphs import fresh_prefill


class Graph:
    def replay(self):
        pass


def fresh():
    fresh_prefill.GRAPHS["a bucket"] = Graph()
    return "whole" if fresh_prefill.replay("a bucket", graphed=True) else "breakable"


from qflash.server.hooks import logprobs as logprob_hook


def logprobs():  # which block position each committed token's logprobs came from: row r's top token is r
    bs, block = 2, 4
    logits = torch.eye(bs * block) * 10
    batch = SimpleNamespace(batch_size=lambda: bs, seq_lens=torch.zeros(bs), sampling_info=SimpleNamespace(is_all_greedy=True),
                            top_logprobs_nums=[1, 1], token_ids_logprobs=None)
    result = SimpleNamespace(speculative_num_draft_tokens=block, next_token_ids=torch.zeros(bs * block, dtype=torch.int64),
                             logits_output=SimpleNamespace(next_token_logits=logits))
    logprob_hook.verify_logprobs(batch, result)
    return [int(idx[0]) for idx in result.logits_output.next_token_top_logprobs_idx]


captured, out["drops"] = GlueGraphs("captured"), []
for fault in ["", *faults.FAULTS, ""]:
    captured.graphs["a layout"] = "a graph"
    Path(os.environ["QFLASH_FAULTS_FILE"]).write_text(fault)
    out["runs"].append([fault, {"accept": accept(), "commit": commit(), "kv": append(), "carry": carry(), "plan": plan(),
                                "plan_stream": plan_stream(), "glue": glue(), "cycle": cycle(),
                                "logprobs": logprobs(), "fresh": fresh()}])
    out["drops"].append(not captured.graphs)
print(json.dumps(out))
"""

CLEAN = {
    "accept": {"eager": [[2, 4, 0], [9, 5, 8]],
               "triton": [[2, 4, 0], [3, 5, 1], [9, 5, 8], [[1, 2, 9, 4, 0], [1, 2, 3, 4, 5], [8, 2, 3, 4, 0]], [103, 205, 301]]},
    "commit": [["ssm", [10, 11, 12], [1, 2, 6], [-1, 0, 3]], ["conv", [10, 11, 12], [0, 1, 5]], ["conv", [20, 21, 22], [-1, 0, 3]]],
    "kv": [0, 1, 2],
    "carry": ["just verified", "new lengths", "DECODE"],
    "plan": 4,
    "plan_stream": "a stream",
    "glue": ["a layout"],
    "cycle": "graphed",
    "logprobs": [0, 1, 2, 3, 4, 5, 6, 7],
    "fresh": "whole",
}
FAULTY = {  # what each fault changes of CLEAN
    "accept_off_by_one": {"accept": {"eager": [[3, 4, 1], [9, 5, 8]],
                                     "triton": [[3, 4, 1], [4, 5, 2], [9, 5, 8], [[1, 2, 3, 9, 0], [1, 2, 3, 4, 5], [1, 8, 3, 4, 0]], [104, 205, 302]]}},
    "gdn_state_wrong_step": {"commit": [["ssm", [10, 11, 12], [1, 1, 5], [-1, 0, 3]], *CLEAN["commit"][1:]]},
    "stale_cache_checkpoint": {"commit": [["ssm", [10, 11, 12], [1, 2, 6], [-1, -1, -1]], CLEAN["commit"][1],
                                          ["conv", [20, 21, 22], [-1, -1, -1]]]},
    "drafter_kv_shift": {"kv": [1, 2, 3]},
    "window_stale_bonus": {"carry": ["verified before", "new lengths", "DECODE"]},
    "one_cycle_per_step": {"plan": 1},
    "window_2": {"plan": 2},
    "window_4": {},
    "plan_stream_off": {"plan_stream": None},
    "plan_stream_on": {},
    "glue_eager": {"glue": []},
    "cycle_eager": {"cycle": "eager"},
    "fresh_prefill_off": {"fresh": "breakable"},
    "logprobs_one_position_late": {"logprobs": [1, 2, 3, 0, 5, 6, 7, 4]},
    "prefill_requests_merged": {},  # its call is flash attention's (GPU only): checked in this process above
}


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    fault_path = tmp_path_factory.mktemp("probe") / "fault"
    env = {**fault_env(fault_path), "SGLANG_PLUGINS": "qflash_text_only,qflash", "TRITON_INTERPRET": "1",
           "SGLANG_ENABLE_OVERLAP_PLAN_STREAM": "1"}  # as qflash serves (preset.QFLASH_SERVER_ENV)
    result = run_python(PROBE, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"qflash test faults: {len(plugin().HOOKS)} hooks registered in pid" in result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_server_process_carries_every_fault_beside_qflash_hooks(server_process):
    assert server_process["faults"] == dict.fromkeys(plugin().HOOKS, True)
    assert server_process["qflash"] and all(server_process["qflash"].values()), server_process["qflash"]


def test_a_server_process_switches_each_fault_on_and_off_at_run_time(server_process):
    runs = server_process["runs"]
    assert [fault for fault, _ in runs] == ["", *plugin().FAULTS, ""]
    assert runs[0][1] == CLEAN and runs[-1][1] == CLEAN
    for fault, got in runs[1:-1]:
        assert got == {**CLEAN, **FAULTY[fault]}, fault


def test_a_change_of_fault_drops_the_glue_graphs_that_hold_the_calls_as_they_ran(server_process):
    assert server_process["drops"] == [False] + [True] * (len(server_process["runs"]) - 1)


FAKE_REGISTRY = """
import collections, enum
HookSource = collections.namedtuple("HookSource", "plugin_name dist_name")
HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")
class HookRegistry:
    registered = []
    @classmethod
    def register(cls, target, hook, hook_type, *, source=None):
        cls.registered.append([target, hook_type.name, source.plugin_name])
"""

SPAWNING = """
import json, multiprocessing, os, sys

def registered(queue):
    from sglang.srt.plugins.hook_registry import HookRegistry
    queue.put(HookRegistry.registered)

if __name__ == "__main__":
    import sglang.srt.plugins.hook_registry as registry  # the fake one
    context = multiprocessing.get_context("spawn")  # as SGLang starts its scheduler
    queue = context.Queue()
    child = context.Process(target=registered, args=(queue,))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    print(json.dumps({"main": registry.HookRegistry.registered, "child": got, "chained": os.environ.get("CHAINED")}))
"""


def test_hooks_register_in_spawned_processes_only_with_the_environment(tmp_path):
    """A fake `sglang` whose registry records registrations; a later sitecustomize the plugin's shadows."""
    fake = tmp_path / "fake"
    (fake / "sglang/srt/plugins").mkdir(parents=True)
    for package in ("sglang", "sglang/srt", "sglang/srt/plugins"):
        (fake / package / "__init__.py").write_text("")
    (fake / "sglang/srt/plugins/hook_registry.py").write_text(textwrap.dedent(FAKE_REGISTRY))
    (tmp_path / "chained").mkdir()
    (tmp_path / "chained/sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    (tmp_path / "spawning.py").write_text(SPAWNING)

    def run(env):
        env = {**os.environ, **env}
        env["PYTHONPATH"] += os.pathsep + os.pathsep.join([str(fake), str(tmp_path / "chained")])
        result = subprocess.run([sys.executable, str(tmp_path / "spawning.py")], capture_output=True, text=True,
                                env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    expected = [[target, "AROUND", "qflash_test_faults"] for target in plugin().HOOKS]
    assert run(fault_env(tmp_path / "fault")) == {"main": expected, "child": expected, "chained": "yes"}
    assert run({"PYTHONPATH": str(FAULTS), "QFLASH_FAULTS_FILE": ""}) == {"main": [], "child": [], "chained": "yes"}
