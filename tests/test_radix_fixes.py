"""The DFLASH radix-cache fixes of server/hooks/radix_cache.py, run on SGLang 0.5.17's own code with small tensors.

Each probe runs in a fresh interpreter (SGLang's hooks are per process) with the server arguments that
`./launch.sh` passes, published the way a scheduler publishes them, so `get_exec()` and
`get_server_args()` answer as in the server. The attention backend's state copy is the one fake: it
records what the verify commit asks it to copy.
"""

import json

from conftest import run_python
from qflash.server.launcher import sglang_argv

PRELUDE = """
import json, os, sys, torch
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.server_args as sa
sa.is_cuda = lambda: True  # SGLang validates the GDN radix cache only for a CUDA device
from sglang.srt.runtime_context import publish
publish(sa.prepare_server_args(sys.argv[1:]), role="test")
"""

COMMIT = PRELUDE + """
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

calls = []
backend = SimpleNamespace(update_mamba_state_after_mtp_verify=lambda **kw: calls.append(kw))
worker = object.__new__(DFlashWorkerV2)
worker._need_mamba_verify_commit = True
worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, model=None))
pre = torch.tensor(json.loads(os.environ["PRE"]), dtype=torch.int64)
commit = torch.tensor(json.loads(os.environ["COMMIT_LENS"]), dtype=torch.int32)
# as in DFlashWorkerV2.forward_batch_generation: batch.seq_lens still holds the pre-verify lengths
batch = SimpleNamespace(seq_lens=pre.clone(), mamba_track_indices=torch.arange(100, 100 + len(pre)),
                        req_pool_indices=torch.arange(len(pre)))
worker._update_target_mamba_state_after_verify(batch=batch, seq_lens_pre_verify=pre, commit_lens=commit)
(kw,) = calls
print(json.dumps({"track": kw["mamba_steps_to_track"].tolist(), "last": kw["last_correct_step_indices"].tolist(),
                  "slots": kw["mamba_track_indices"].tolist()}))
"""

# Verify steps before and after the 256-token checkpoints: (pre-verify length, tokens committed).
PRE = [250, 1000, 300, 511, 1020, 240, 255]
COMMIT_LENS = [10, 16, 3, 1, 16, 16, 1]
# The verify step whose GDN state is the state at the crossed boundary, -1 where none is crossed:
# 250 + 10 crosses 256 after step 256 - 250 - 1 = 5; 511 + 1 reaches 512 at step 0; 1020 + 16 crosses
# 1024 at step 3; 240 + 16 ends exactly on 256 (step 15); 255 + 1 likewise (step 0).
TRACKED = [5, -1, -1, 0, 3, 15, 0]


def commit(dummy_dirs, plugins: str) -> dict:
    argv = sglang_argv(*dummy_dirs, ["--device", "cuda"], prefix_cache=True)[3:]
    env = {"SGLANG_PLUGINS": plugins, "PRE": json.dumps(PRE), "COMMIT_LENS": json.dumps(COMMIT_LENS)}
    result = run_python(COMMIT, *argv, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_verify_steps_crossing_a_checkpoint_track_the_boundary_state(dummy_dirs):
    got = commit(dummy_dirs, "qflash")
    assert got["track"] == TRACKED
    assert got["last"] == [n - 1 for n in COMMIT_LENS]  # the live state: the last committed step
    assert got["slots"] == list(range(100, 100 + len(PRE)))


def test_stock_sglang_never_tracks_under_dflash(dummy_dirs):
    # sglang#37817: what 0.5.17 does without the fix (the text-only plugin loads none of qflash's hooks)
    assert commit(dummy_dirs, "qflash_text_only")["track"] == [-1] * len(PRE)


AGAINST_SGLANG = PRELUDE + """
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from qflash.server.hooks.radix_cache import _commit_at_post_verify_lens

g = torch.Generator().manual_seed(0)
n = 64
pre = torch.randint(0, 3000, (n,), generator=g)
pre[:8] = torch.tensor([255, 256, 511, 0, 240, 1023, 767, 512])  # at and around the boundaries
commit = torch.randint(1, 17, (n,), generator=g, dtype=torch.int32)
commit[:8] = torch.tensor([1, 16, 1, 16, 16, 2, 1, 1], dtype=torch.int32)
stock = DFlashWorkerV2._update_target_mamba_state_after_verify  # unhooked: no qflash plugin in this process
out = {}
for track in (True, False):
    for name in ("stock", "qflash"):
        calls = []
        worker = object.__new__(DFlashWorkerV2)
        worker._need_mamba_verify_commit = True
        backend = SimpleNamespace(update_mamba_state_after_mtp_verify=lambda **kw: calls.append(kw))
        worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend, model="the model"))
        # 0.5.17's method as sglang#37818 fixes it: handed the post-verify lengths
        lens = pre + commit.to(pre.dtype) if name == "stock" else pre.clone()
        batch = SimpleNamespace(seq_lens=lens, mamba_track_indices=torch.arange(100, 100 + n) if track else None,
                                req_pool_indices=torch.arange(n + 2))
        if name == "stock":
            stock(worker, batch=batch, seq_lens_pre_verify=pre, commit_lens=commit)
        else:
            _commit_at_post_verify_lens(stock, worker, batch=batch, seq_lens_pre_verify=pre, commit_lens=commit)
        (kw,) = calls
        out[f"{name} {track}"] = {k: [str(v.dtype), v.tolist()] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
print(json.dumps(out))
"""


def test_the_commits_steps_are_sglangs_on_the_post_verify_lengths(dummy_dirs):
    """qflash's one-launch arithmetic (kernels/commit_steps.py) against 0.5.17's torch operations as sglang#37818 has
    them run, on 64 verify steps around and across the 256-token checkpoints, with and without tracking slots."""
    argv = sglang_argv(*dummy_dirs, ["--device", "cuda"], prefix_cache=True)[3:]
    result = run_python(AGAINST_SGLANG, *argv, env={"SGLANG_PLUGINS": "qflash_text_only"})
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    for track in ("True", "False"):
        assert got[f"qflash {track}"] == got[f"stock {track}"]
    assert got["qflash False"]["mamba_steps_to_track"] is None
    assert sum(step >= 0 for step in got["qflash True"]["mamba_steps_to_track"][1]) >= 8  # crossings among them


REFRESH = PRELUDE + """
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from qflash.server.hooks import radix_cache

_tensor = torch.tensor
torch.tensor = lambda *a, pin_memory=False, **k: _tensor(*a, **k)  # no pinned memory without CUDA
# ping-pong tracking slots of request-pool rows 0..3
pool = SimpleNamespace(req_index_to_mamba_ping_pong_track_buffer_mapping=torch.tensor([[10, 11], [12, 13], [14, 15], [16, 17]]))
reqs = [SimpleNamespace(mamba_next_track_idx=i) for i in (0, 1, None)]
out = {"hooked": hasattr(DFlashVerifyInput.prepare_for_verify, "__wrapped__")}
for mode in ("DECODE", "IDLE"):
    # after a batch merge, 0.5.17 leaves the tracking slots None and the prefill's track mask behind
    batch = SimpleNamespace(forward_mode=ForwardMode[mode], reqs=reqs, req_to_token_pool=pool,
                            req_pool_indices=torch.tensor([2, 0, 3]), mamba_track_indices=None,
                            mamba_track_mask=torch.tensor([True, False, True]), mamba_track_seqlens=None)
    radix_cache._refresh_mamba_track_before_verify(None, batch, None)
    out[mode] = None if batch.mamba_track_indices is None else batch.mamba_track_indices.tolist()
    out[mode + " mask"] = batch.mamba_track_mask is None
print(json.dumps(out))
"""


def test_verify_rebuilds_the_tracking_slots_from_the_requests(dummy_dirs):
    result = run_python(REFRESH, *sglang_argv(*dummy_dirs, ["--device", "cuda"], prefix_cache=True)[3:], env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["hooked"]
    # row 2 tracks into its slot 0, row 0 into slot 1, row 3 (no slot chosen yet) into slot 0
    assert got["DECODE"] == [14, 11, 16] and got["DECODE mask"]
    assert got["IDLE"] is None and not got["IDLE mask"]
