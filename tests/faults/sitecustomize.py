"""Test-only fault injection into a running qflash server, so each GPU check can prove it catches its bug.

Never part of a user's server: a test puts this folder first on PYTHONPATH and names a file in
QFLASH_FAULTS_FILE (tests/fault_control.py). Python's `site` imports `sitecustomize` at every interpreter's
start, and SGLang starts its scheduler and detokenizer with multiprocessing spawn (engine.py sets it), i.e.
fresh interpreters that inherit the environment, so every process of the server loads this module.

Each fault wraps one SGLang (or qflash) function that runs on the host in every DFLASH cycle or prefill (never inside
a model runner's captured forward, whose work a wrapper could not switch on and off) and changes its arguments
while the file names that fault; where qflash's glue graphs (graphs/glue.py) hold such a call, a change of the
named fault drops them, so they are captured again as the call now runs. A few names are switches rather than
faults, for a reference or an A/B on one server: the window planner held to one cycle per step, the overlap plan
stream off or on, the glue eager, the window's cycles without their whole-cycle graph, a fresh prompt's prefill
without its whole graph. The file is re-read when it changes
(one os.stat per call), so one server runs clean, faulty, then clean again; with the file empty or missing, every
call passes through unchanged.

The wrappers go in through SGLang's HookRegistry, as qflash's own (server/hooks). `HookRegistry.register` only
records a dotted name; the hooks are applied with qflash's by the first `apply_hooks` (qflash's `install`, or
`load_plugins`). Importing the registry at start-up would import all of `sglang` (seconds, and transformers'
patches) in every interpreter with this path, so a one-shot import hook registers the faults right after
`sglang.srt.plugins.hook_registry` is first imported, before any plugin runs. No target here is one qflash hooks:
HookRegistry applies a target once, at the first `apply_hooks` after its first registration, so a fault on a
target qflash also hooks could be applied alone by an earlier `apply_hooks` (the qflash_text_only plugin's) and
qflash's own hook on it would be skipped without a word.
"""

import importlib.machinery
import importlib.util
import os
import sys

ENV = "QFLASH_FAULTS_FILE"
_seen: tuple = (None, "")  # (the file's stat when last read, the fault it named)


def active() -> str:
    """The fault named in $QFLASH_FAULTS_FILE now; '' for none (file empty or missing)."""
    global _seen
    path = os.environ.get(ENV)
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return ""
    key = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    if key != _seen[0]:
        try:
            with open(path) as f:
                named = f.read().strip()
        except OSError:
            return ""
        if named != _seen[1]:
            _drop_glue_graphs()
        _seen = (key, named)
    return _seen[1]


def _drop_glue_graphs() -> None:
    """qflash replays some of a cycle's glue as CUDA graphs (graphs/glue.py), which hold the Python a fault changed
    as it was when they were captured: a new fault drops them, so they are captured again with it (or without)."""
    glue = sys.modules.get("qflash.graphs.glue")
    if glue is not None:
        glue.drop_all()


def _first_rejection_matched(candidates, target):
    """`target` with each request's first rejected draft written in as the target's own choice there."""
    import torch

    accepted = (candidates[:, 1:] == target[:, :-1]).to(torch.int32).cumprod(1).sum(1, keepdim=True)
    step = torch.arange(target.shape[1] - 1, device=target.device)
    forced = target.clone()
    forced[:, :-1] = torch.where(step == accepted, candidates[:, 1:].to(target.dtype), target[:, :-1])
    return forced


def accept_off_by_one(kw: dict) -> dict:
    """One draft token more is accepted than verification decided (none past the block's K-1 drafts).

    The greedy accept rule (the Triton kernel and its eager fallback) is handed target choices in which each
    request's first rejected draft matches, so the rule itself takes it, and everything after it (bonus token,
    commit_lens, new seq_lens, GDN fold, drafter KV) agrees with the wrong count: the server emits one unverified
    draft token in every cycle that rejects a draft. Caught by test_quantized_server_gpu.py::
    test_losslessness_check_catches[accept_off_by_one]: speculative output != plain greedy, and != its teacher-forced
    argmax."""
    key = "target_top1" if "target_top1" in kw else "target_predict"
    kw[key] = _first_rejection_matched(kw["candidates"], kw[key])
    return kw


def gdn_state_wrong_step(kw: dict) -> dict:
    """The recurrent (SSM) state committed after verify is the one of the step before the last accepted one
    (last_correct_step_indices - 1, at least step 0); the conv state is committed at the right step.

    qflash commits both through SGLang's `commit_gdn_replayssm_fold_after_verify` (server/hooks/gdn_verify.py),
    which hands `accept_lens` (the steps to fold) to the recurrent-state fold alone and
    `last_correct_step_indices` to the conv-window scatter alone; only `accept_lens` changes here
    (tests/test_faults.py checks that routing on the installed SGLang). A crossing at the last accepted step then
    also leaves the track slot's recurrent state unwritten: recurrent state too. Caught by
    test_quantized_server_gpu.py::test_losslessness_check_catches[gdn_state_wrong_step]."""
    last = kw["last_correct_step_indices"]
    kw["accept_lens"] = ((last - 1).clamp(min=0) + 1).to(kw["accept_lens"].dtype)
    return kw


def stale_cache_checkpoint(kw: dict) -> dict:
    """The radix cache's GDN checkpoint is not written by the verify step that crosses a 256-token boundary.

    As in 0.5.17 before qflash's fix (server/hooks/radix_cache.py, sglang#37817), the commit is told no request
    crossed one (every mamba_steps_to_track = -1), so neither the recurrent nor the conv state is copied into
    the tracking slot; the scheduler still records the boundary as checkpointed, and a later request that hits
    the cached prefix resumes from the slot's older state. The live state is committed as before. Caught by
    test_prefix_cache_gpu.py::test_the_check_catches_a_stale_checkpoint: cached follow-up != fresh one."""
    steps = kw.get("mamba_steps_to_track")
    if steps is not None:
        kw["mamba_steps_to_track"] = steps.new_full(steps.shape, -1)
    return kw


def drafter_kv_shift(kw: dict) -> dict:
    """The drafter's context K/V (from the target's hidden states, after prefill and after each verify) is
    written at positions + 1, so the drafter's RoPE sees every context token one place later.

    One entry point feeds all three writers (fused, per-layer prefix-valid, sequential), so all are shifted; a
    new tensor, as the same positions also serve the verify. Verification still decides every token, so output
    stays lossless while acceptance drops. Caught by test_quantized_server_gpu.py::
    test_acceptance_check_catches_shifted_drafter_kv: same tokens, accept length below half."""
    kw["positions"] = kw["positions"] + 1
    return kw


def window_stale_bonus(kw: dict) -> dict:
    """Between the cycles of a window (server/window.py) the next block starts from the previous cycle's bonus
    token instead of the one just verified: the target then verifies, and commits to its KV cache and GDN state,
    a token it never chose at each later cycle's first position. Caught by test_window_gpu.py::
    test_the_window_check_catches_a_stale_bonus_token: windowed output != one cycle per step."""
    kw["bonus_tokens"] = kw["draft_input"].bonus_tokens
    return kw


def logprobs_one_position_late(kw: dict) -> dict:
    """A verify step's committed token j gets its logprobs from block position j + 1 (the last from position 0):
    the values and top logprobs of the next token's distribution, an off-by-one in the layout qflash hands
    SGLang's spec-v2 gather (server/hooks/logprobs.py). Output tokens are unchanged. Caught by
    test_logprobs_gpu.py::test_the_logprob_check_catches_a_shifted_position: speculative logprobs != prompt-only."""
    kw["accept_index"] = kw["accept_index"].roll(-1, dims=1)
    return kw


def prefill_requests_merged(kw: dict) -> dict:
    """A batch of fresh prompts, packed one after another for flash attention, is attended as one sequence: each
    request's queries also see the keys of the requests packed before it, as if their boundaries were dropped.
    Caught by test_prefix_cache_gpu.py::test_the_batch_check_catches_merged_requests: batch != each alone."""
    import torch

    q, k = kw["cu_seq_q"], kw["cu_seq_k"]
    kw["cu_seq_q"], kw["cu_seq_k"] = (torch.stack([t[0], t[-1]]) for t in (q, k))
    kw["max_q"], kw["max_k"] = int(q[-1]), int(k[-1])
    return kw


def glue_eager(kw: dict) -> dict:
    """Not a fault: the cycle's glue runs eagerly, as SGLang runs it (graphs/glue.py), for an A/B of its graphs."""
    kw["key"] = None
    return kw


def cycle_eager(kw: dict) -> dict:
    """Not a fault: a window's cycles run without their whole-cycle graph (server/hooks/cycle_graphs.py), each as
    SGLang's Python with the glue graphs inside, for an A/B of the cycle graph."""
    kw["graphed"] = False
    return kw


def fresh_prefill_off(kw: dict) -> dict:
    """Not a fault: a fresh prompt's prefill replays SGLang's breakable graph instead of qflash's whole one
    (graphs/fresh_prefill.py), the whole graph's reference."""
    kw["graphed"] = False
    return kw


def window_of(cycles: int):
    """Not a fault: the window planner allows at most `cycles` per step (1: as SGLang runs after each request's first
    decode step, which replays its cycle graph either way; the windows' reference)."""
    def switch(kw: dict) -> dict:
        kw["limit"] = min(kw["limit"], cycles)
        return kw

    return switch


WORKER = "sglang.srt.speculative.dflash_worker_v2."
FOLD = "sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold.commit_gdn_replayssm_fold_after_verify"
# target -> {fault: how it changes the call's keyword arguments}; every call site passes them by keyword.
# All but the last are called from DFlashWorkerV2.forward_batch_generation's own Python, after the target's forward
# (a CUDA graph replay: the verify's, or prefill's piecewise one) has returned and outside the draft forward (the
# drafter's graph); none is reached from a model runner's forward. A window's cycle graph holds them all (their
# device work, as the fault named at its capture had it), the fold also the GDN-commit graph. The last chooses, on
# the host, which of a prefill bucket's graphs replays.
TARGETS = {
    WORKER + "_compute_dflash_accept_bonus_triton_unchecked": {"accept_off_by_one": accept_off_by_one},
    WORKER + "compute_dflash_correct_drafts_and_bonus": {"accept_off_by_one": accept_off_by_one},
    FOLD: {"gdn_state_wrong_step": gdn_state_wrong_step, "stale_cache_checkpoint": stale_cache_checkpoint},
    WORKER + "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc": {"drafter_kv_shift": drafter_kv_shift},
    # a logprob batch's verify gather, from qflash's hook around that step (never in a window's cycle graph)
    "sglang.srt.layers.logprob_processor.compute_spec_v2_logprobs": {"logprobs_one_position_late": logprobs_one_position_late},
    # qflash's own functions, which qflash hooks nowhere: the window's carry between cycles, its planner
    "qflash.server.window.carry_to_next_cycle": {"window_stale_bonus": window_stale_bonus},
    "qflash.server.window.plan_cycles": {"one_cycle_per_step": window_of(1), "window_2": window_of(2),
                                         "window_4": window_of(4)},
    "qflash.graphs.glue.GlueGraphs.run": {"glue_eager": glue_eager},
    # a batch prefill's attention, looked up in kernels/flash_prefill.py's globals at each call; it runs between the
    # prefill graph's segments, eagerly (while a graph is captured, flash_prefill leaves batches to SGLang's kernel)
    "qflash.kernels.flash_prefill.varlen_attn": {"prefill_requests_merged": prefill_requests_merged},
    "qflash.server.hooks.cycle_graphs.run_cycle": {"cycle_eager": cycle_eager},
    # the prefill's, from qflash's hook around the breakable graph's replay
    "qflash.graphs.fresh_prefill.replay": {"fresh_prefill_off": fresh_prefill_off},
}
# switches that set an SGLang environment variable for the calls of the target that reads it
ENV_SWITCHES = {"plan_stream_off": ("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "0"),
                "plan_stream_on": ("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "1")}
ENV_TARGET = "sglang.srt.speculative.dflash_info_v2._get_overlap_plan_stream"
FAULTS = sorted({name for changes in TARGETS.values() for name in changes} | set(ENV_SWITCHES))


def around(changes: dict):
    """A HookRegistry AROUND hook: the original, with its keyword arguments changed while a fault of `changes` is
    named."""
    def hook(original, *args, **kwargs):
        change = changes.get(active())
        return original(*args, **(change(dict(kwargs)) if change else kwargs))

    return hook


def around_env(original, *args, **kwargs):
    """The original, with the environment variable a switch names set while it runs."""
    switch = ENV_SWITCHES.get(active())
    if switch is None:
        return original(*args, **kwargs)
    name, value = switch
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return original(*args, **kwargs)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


HOOKS = {target: around(changes) for target, changes in TARGETS.items()} | {ENV_TARGET: around_env}


def register(hook_registry) -> None:
    """Register every fault hook with SGLang's HookRegistry (module `hook_registry`); applied by its next apply_hooks."""
    for target, hook in HOOKS.items():
        hook_registry.HookRegistry.register(target, hook, hook_registry.HookType.AROUND,
                                            source=hook_registry.HookSource("qflash_test_faults", None))
    print(f"qflash test faults: {len(HOOKS)} hooks registered in pid {os.getpid()}, faults read from "
          f"{os.environ.get(ENV)}", file=sys.stderr, flush=True)


class _RegisterOnImport:
    """A meta-path finder that lets the real finder load `sglang.srt.plugins.hook_registry`, then registers."""

    NAME = "sglang.srt.plugins.hook_registry"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                register(module)

            spec.loader.exec_module = exec_module
        return spec


def _chain_next_sitecustomize() -> None:
    """Run the sitecustomize this one shadows (a distribution's or a venv's), if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != here])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # imported by `site`; tests load this file under another name, without effects
    if os.environ.get(ENV):
        sys.meta_path.insert(0, _RegisterOnImport())
    _chain_next_sitecustomize()
