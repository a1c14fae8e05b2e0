"""qflash's GDN verify (its conv included) and commit fold (kernels/gdn_verify.py, routed by server/hooks/gdn_verify.py).

In one process, SGLang 0.5.17's verify of a block runs first: its causal-conv1d update, the q | k | v split, its
recurrent kernel. Then qflash's plugin is loaded and the GDN backend's `forward_extend` of a verify batch (the
backend's state reached through stand-ins holding the same tensors) reaches qflash's one kernel. Checked:
- the per-step conv windows and the rings the fold replays (raw k and v: the conv's outputs) are SGLang's bits,
  the outputs SGLang's values (qflash solves the block at once, SGLang steps through it: fp32 rounding apart), on
  keys alike from step to step (far from a diagonal system); a padding request (no slot) gets no window or ring;
- the conv state is left as it was, and SGLang's commit (the accepted step's window into the state) leaves what
  SGLang's conv update wrote: the last step's window is the block's last inputs;
- resuming: the fold of each request's accepted steps, then SGLang's verify of its remaining steps from the folded
  state, gives the first verify's outputs for those steps, so the fold commits the verify's state;
- a prefix-cache checkpoint slot gets the state after its step; the state read by the verify stays untouched.
CPU: Triton's interpreter in fp32 (its bf16 arithmetic is wrong) on small heads; GPU: the Qwen3.5-4B shape
(16 key heads, 32 value heads of 128) in bf16 with the fp32 state, where the tile's reduction order is real.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, change_attributes, run_python

VERIFY = """
import json, sys, torch
from types import SimpleNamespace as NS
from sglang.kernels.ops.attention.fla import fused_sigmoid_gating_recurrent as recurrent
from sglang.kernels.ops.attention.fla import gdn_replayssm_spec_fold as fold
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

dev, batch, H, HV, K, V = sys.argv[1], *map(int, sys.argv[2:])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes bf16 loads wrongly
STEPS, WIDTH, SLOTS = 16, 4, 2 * batch + 2
REAL = batch - 1 if batch > 1 else 1  # of several requests the last is padding (a CUDA graph's spare row: no slot)
DIM = 2 * H * K + HV * V
g = torch.Generator(device=dev).manual_seed(0)
rand = lambda *shape, dt=dtype: torch.randn(*shape, device=dev, dtype=dt, generator=g)
T = STEPS * batch
# the conv input's rows: q | k | v; keys alike from step to step and beta near 1, as a repeated token gives (the
# steps' system is far from diagonal)
x = torch.cat([rand(T, H * K), rand(1, H * K) + 0.3 * rand(T, H * K), rand(T, HV * V)], dim=1)
conv_weight, conv_bias, conv_state = rand(DIM, WIDTH) * 0.5, rand(DIM) * 0.1, rand(SLOTS, DIM, WIDTH - 1)
a, b = rand(T, HV), rand(T, HV) + 3
A_log, dt_bias = rand(HV, dt=torch.float32), rand(HV, dt=torch.float32)
state = rand(SLOTS, HV, V, K, dt=torch.float32) * 0.1
slots = torch.tensor(list(range(1, 2 * REAL, 2)) + [-1] * (batch - REAL), device=dev, dtype=torch.int32)
window_slots = torch.arange(batch, device=dev, dtype=torch.int32)  # SGLang's: request i's row i
accept = torch.tensor([6, 1, 15][:REAL], device=dev, dtype=torch.int32)  # steps committed per request
cu = torch.arange(0, T + 1, STEPS, device=dev, dtype=torch.int32)

def windows():  # SGLang's deduplicated windows: step t's window is inputs t .. t + WIDTH - 2 of one shared row
    shared = torch.zeros(batch + 1, DIM, STEPS + WIDTH - 2, device=dev, dtype=dtype)
    return shared.as_strided((batch + 1, STEPS, DIM, WIDTH - 1), (shared.stride(0), 1, shared.stride(1), 1))

def rings():
    return [torch.zeros(SLOTS, HV, STEPS, V, device=dev, dtype=dtype), torch.zeros(SLOTS, H, STEPS, K, device=dev, dtype=dtype),
            torch.zeros(SLOTS, HV, STEPS, device=dev), torch.zeros(SLOTS, HV, STEPS, device=dev)]

RING = ("replayssm_rawv", "replayssm_rawk", "replayssm_g", "replayssm_beta")

def sglang_verify(h, q, k, v, a, b, cu, slots, ring):
    return recurrent.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=h, initial_state_indices=slots,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=True, cache_ring=True, **dict(zip(RING, ring)))

# SGLang: conv update, split, recurrent verify
h, stock_conv_state, stock_windows, stock_rings = state.clone(), conv_state.clone(), windows(), rings()
qkv = causal_conv1d_update(x.view(batch, STEPS, DIM).transpose(1, 2), stock_conv_state, conv_weight, conv_bias,
                           "silu", conv_state_indices=slots, intermediate_conv_window=stock_windows,
                           intermediate_state_indices=window_slots).transpose(1, 2).reshape(T, DIM)
q, k, v = (part.contiguous() for part in qkv.split([H * K, H * K, HV * V], dim=1))
q, k, v = q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, HV, V)
stock = sglang_verify(h, q, k, v, a, b, cu, slots, stock_rings)

# qflash: the GDN backend's forward_extend of a verify batch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
mine_conv_state, mine_windows, mine_rings = conv_state.clone(), windows(), rings()
from test_gdn_verify import verify_call
cache = NS(conv=[mine_conv_state], temporal=h, intermediate_conv_window=[mine_windows], **dict(zip(RING, mine_rings)))
backend, layer, verify_batch = verify_call(cache, conv_weight, conv_bias, A_log, dt_bias, cu, slots, window_slots)
mine = GDNAttnBackend.forward_extend(backend, layer=layer, forward_batch=verify_batch, mixed_qkv=x, a=a, b=b)

def commit(conv_states, win, last):  # SGLang's commit of the conv: the accepted step's window into the state
    out = conv_states.clone()
    for i, slot in enumerate(slots.tolist()[:REAL]):
        out[slot] = win[window_slots[i], last[i]]
    return out

real = slots[:REAL].long()
last = accept.long() - 1
full = torch.full_like(last, STEPS - 1)

# fold each request's accepted steps (request 0 also checkpoints after its step 3), then verify the rest
folded, track_slot = h.clone(), SLOTS - 1
fold.commit_gdn_replayssm_fold_all_layers(
    checkpoint_state=folded[None], rawv_cache=mine_rings[0][None], rawk_cache=mine_rings[1][None],
    g_cache=mine_rings[2][None], beta_cache=mine_rings[3][None], ssm_state_indices=slots[:REAL], accept_lens=accept,
    max_cache_len=STEPS, num_k_heads=H, mamba_track_indices=torch.tensor([track_slot] + [-1] * (REAL - 1), device=dev),
    mamba_steps_to_track=torch.tensor([3] + [-1] * (REAL - 1), device=dev))
four = h.clone()
fold.commit_gdn_replayssm_fold_all_layers(
    checkpoint_state=four[None], rawv_cache=mine_rings[0][None], rawk_cache=mine_rings[1][None],
    g_cache=mine_rings[2][None], beta_cache=mine_rings[3][None], ssm_state_indices=slots[:REAL],
    accept_lens=torch.full_like(accept, 4), max_cache_len=STEPS, num_k_heads=H)  # the same batch: the fold's tile
rest = torch.cat([torch.arange(i * STEPS + int(n), (i + 1) * STEPS) for i, n in enumerate(accept.tolist())]).to(dev)
cu_rest = torch.nn.functional.pad((STEPS - accept).cumsum(0), (1, 0)).to(torch.int32)
resumed = sglang_verify(folded, q[:, rest], k[:, rest], v[:, rest], a[rest], b[rest], cu_rest, slots[:REAL], rings())
untouched = [s for s in range(SLOTS) if s not in slots.tolist() + [track_slot]]

error = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()
def hooked_by(fn, seen=()):  # the modules of the functions in fn's chain of hook wrappers
    inner = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if callable(c.cell_contents)]
    return sorted({getattr(f, "__module__", "") for f in inner}.union(*(hooked_by(f) for f in inner)) - {"", None})

live = slice(0, REAL * STEPS)
print(json.dumps({"routed": hooked_by(GDNAttnBackend.forward_extend),
                  "fold": hooked_by(fold.commit_gdn_replayssm_fold_all_layers),
                  "windows equal": torch.equal(stock_windows, mine_windows),
                  "windows written": bool(mine_windows[:REAL].abs().sum() > 0),
                  "padding's window untouched": bool(mine_windows[REAL:].abs().sum() == 0),
                  "rings equal": [torch.equal(x, y) for x, y in zip(stock_rings, mine_rings)],
                  "rings written": [bool(r[real].abs().sum() > 0) for r in mine_rings],
                  "conv state kept": torch.equal(mine_conv_state, conv_state),
                  "commit of all steps = SGLang's conv update": torch.equal(commit(mine_conv_state, mine_windows, full),
                                                                            stock_conv_state),
                  "commit equal": torch.equal(commit(mine_conv_state, mine_windows, last),
                                              commit(stock_conv_state, stock_windows, last)),
                  "output error": error(mine[:, live], stock[:, live]), "finite": bool(mine[:, live].isfinite().all()),
                  "resumed error": error(resumed, mine[:, rest]),
                  "checkpoint": torch.equal(folded[track_slot], four[slots[0]]),
                  "folded moved": not torch.equal(folded[real], h[real]),
                  "verify kept the state": torch.equal(h, state),
                  "others untouched": torch.equal(folded[untouched], state[untouched])}))
"""


def tiled_verify(device: str, batch: int, h: int, hv: int, k: int, v: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    code = f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n" + VERIFY  # for verify_call
    result = run_python(code, device, *map(str, (batch, h, hv, k, v)), env={"SGLANG_PLUGINS": "qflash", **interpret},
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict, tolerance: float) -> None:
    assert "qflash.server.hooks.gdn_verify" in got["routed"] and "qflash.server.hooks.gdn_verify" in got["fold"]
    assert got["windows written"] and got["padding's window untouched"] and got["windows equal"], "the conv's windows"
    assert got["rings equal"] == got["rings written"] == [True] * 4, "raw v, raw k, gate, beta"
    assert got["conv state kept"] and got["commit of all steps = SGLang's conv update"] and got["commit equal"]
    assert got["finite"] and got["output error"] <= tolerance, got["output error"]
    assert got["resumed error"] <= tolerance, "verify after the fold gives the first verify's outputs"
    assert got["checkpoint"] and got["folded moved"] and got["verify kept the state"] and got["others untouched"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: a GPU runs the real shape below")
@pytest.mark.parametrize("batch", [1, 3])  # the tiles for one request and for more (two and a padding row)
def test_tiled_verify_and_fold(batch):
    check(tiled_verify("cpu", batch, 2, 4, 32, 64), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_tiled_verify_and_fold_at_the_real_shape_gpu(batch):
    check(tiled_verify("cuda", batch, 16, 32, 128, 128), 4e-3)  # bf16 outputs: a last-bit rounding here and there


def test_the_verify_block_is_dflashs_block():
    from qflash.kernels import gdn_verify
    from qflash.server import preset

    assert gdn_verify.BLOCK_STEPS == preset.BLOCK_SIZE, "every DFLASH verify must reach the block-solved kernel"


def verify_call(cache, conv_weight, conv_bias, A_log, dt_bias, query_start_loc, cache_indices, window_indices) -> tuple:
    """Stand-ins for the GDN backend, layer and forward batch of a verify that SGLang's ring-fold path serves: what
    `forward_extend`'s verify branch reads, around `cache` (one layer's speculative state) and the layer's weights."""
    backend = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache,
                                          mamba_pool=SimpleNamespace(replayssm_spec_fold=True, replayssm_is_kda=False)),
        forward_metadata=SimpleNamespace(query_start_loc=query_start_loc, mamba_cache_indices=cache_indices,
                                         retrieve_next_token=None, retrieve_parent_token=None),
        kernel_dispatcher=SimpleNamespace(verify_kernel_is_flashinfer=False),
        verify_intermediate_state_indices=window_indices)
    layer = SimpleNamespace(layer_id=0, conv_weights=conv_weight, bias=conv_bias, activation="silu", A_log=A_log,
                            dt_bias=dt_bias)
    return backend, layer, SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))


def stand_ins(**changes) -> tuple:
    """`verify_call`'s stand-ins of two 16-token requests with no tensor read, and their conv input: `changes`
    replaces one of their attributes, named `object.attribute`."""
    cu = torch.arange(0, 33, 16, dtype=torch.int32)
    cache = SimpleNamespace(conv=[torch.zeros(4, 8, 3)], temporal=torch.zeros(4, 1), intermediate_conv_window=[None],
                            replayssm_rawv=torch.zeros(1), replayssm_rawk=None, replayssm_g=None, replayssm_beta=None)
    backend, layer, batch = verify_call(cache, torch.zeros(8, 4), None, None, None, cu, None, cu)
    objects = {"backend": backend, "pool": backend.req_to_token_pool.mamba_pool, "meta": backend.forward_metadata,
               "dispatcher": backend.kernel_dispatcher, "cache": cache, "layer": layer, "batch": batch}
    change_attributes(objects, changes)
    return backend, layer, batch, torch.zeros(32, 8)


@pytest.mark.parametrize("changes", [
    {"batch.forward_mode": SimpleNamespace(is_target_verify=lambda: False)},  # a prefill
    {"cache.replayssm_rawv": None},  # no ring: SGLang's snapshotting verify
    {"pool.replayssm_is_kda": True},
    {"dispatcher.verify_kernel_is_flashinfer": True, "cache.temporal": torch.zeros(4, 1, dtype=torch.bfloat16)},
    {"meta.retrieve_next_token": torch.zeros(2)},  # an EAGLE tree
    {"layer.activation": None},
    {"cache.conv": [torch.zeros(4, 3, 8)]},  # the state's window axis first
    {"meta.query_start_loc": torch.tensor([0, 32], dtype=torch.int32)},  # 32 tokens for one request
])
def test_verifies_qflash_cannot_follow_run_sglangs_code(changes):
    from qflash.server.hooks.gdn_verify import _verify_from_conv_input

    backend, layer, batch, x = stand_ins(**changes)
    called = _verify_from_conv_input(lambda *args, **kwargs: "sglang", backend, layer, batch, x, None, None)
    assert called == "sglang"


def test_a_verify_it_follows_reaches_qflashs_kernel(monkeypatch):
    from qflash.kernels import gdn_verify
    from qflash.server.hooks.gdn_verify import _verify_from_conv_input

    monkeypatch.setattr(gdn_verify, "verify", lambda *args, **kwargs: "qflash")
    backend, layer, batch, x = stand_ins()
    assert _verify_from_conv_input(lambda *args, **kwargs: "sglang", backend, layer, batch, x, None, None) == "qflash"
