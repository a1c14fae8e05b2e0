"""qflash's GDN verify and commit fold (kernels/gdn_verify.py, routed by server/hooks/gdn_verify.py).

In one process, SGLang 0.5.17's verify runs first; then qflash's plugin is loaded and the same call (the
module attribute, by keyword, as SGLang's GDN backend makes it) reaches qflash's verify. Checked:
- the rings the fold replays are SGLang's bits, the outputs SGLang's values (qflash solves the block at once,
  SGLang steps through it: fp32 rounding apart), on keys alike from step to step (far from a diagonal system);
- resuming: the fold of each request's accepted steps, then the verify of its remaining steps from the folded
  state, gives the first verify's outputs for those steps, so the fold commits the verify's state;
- a prefix-cache checkpoint slot gets the state after its step; the state read by the verify stays untouched;
- calls without the ring, and calls of more than one 16-token block per request, still run SGLang's kernel.
CPU: Triton's interpreter in fp32 (its bf16 arithmetic is wrong) on small heads; GPU: the Qwen3.5-4B shape
(16 key heads, 32 value heads of 128) in bf16 with the fp32 state, where the tile's reduction order is real.
"""

import json

import pytest
import torch

from conftest import run_python
from test_kernels import DEVICE

VERIFY = """
import json, sys, torch
from sglang.kernels.ops.attention.fla import fused_sigmoid_gating_recurrent as recurrent
from sglang.kernels.ops.attention.fla import gdn_replayssm_spec_fold as fold

dev, batch, H, HV, K, V = sys.argv[1], *map(int, sys.argv[2:])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes bf16 loads wrongly
STEPS, SLOTS = 16, 2 * batch + 2
g = torch.Generator(device=dev).manual_seed(0)
rand = lambda *shape, dt=dtype: torch.randn(*shape, device=dev, dtype=dt, generator=g)
T = STEPS * batch
# keys alike from step to step and beta near 1, as a repeated token gives: the steps' system is far from diagonal
q, v, a = rand(1, T, H, K), rand(1, T, HV, V), rand(T, HV)
k, b = rand(1, 1, H, K) + 0.3 * rand(1, T, H, K), rand(T, HV) + 3
A_log, dt_bias = rand(HV, dt=torch.float32), rand(HV, dt=torch.float32)
state = rand(SLOTS, HV, V, K, dt=torch.float32) * 0.1
slots = torch.arange(1, 2 * batch, 2, device=dev, dtype=torch.int32)
accept = torch.tensor([6, 1, 15][:batch], device=dev, dtype=torch.int32)  # steps committed per request

def verify(h, q, k, v, a, b, cu, cache_ring=True, slots=slots, ring=STEPS):
    rings = [torch.zeros(SLOTS, HV, ring, V, device=dev, dtype=dtype), torch.zeros(SLOTS, H, ring, K, device=dev, dtype=dtype),
             torch.zeros(SLOTS, HV, ring, device=dev), torch.zeros(SLOTS, HV, ring, device=dev)]
    ring = dict(zip(("replayssm_rawv", "replayssm_rawk", "replayssm_g", "replayssm_beta"), rings)) if cache_ring else {}
    o = recurrent.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=h, initial_state_indices=slots,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=cache_ring, cache_ring=cache_ring, **ring)
    return o, rings

cu = torch.arange(0, T + 1, STEPS, device=dev, dtype=torch.int32)
h = state.clone()
stock, stock_rings = verify(h, q, k, v, a, b, cu)
stock_decode = verify(h.clone(), q, k, v, a, b, cu, cache_ring=False)[0]
LONG = 2 * STEPS + 5  # one request of more than one block (SGLang's kernel needs a ring as long)
cu_long = torch.tensor([0, LONG], device=dev, dtype=torch.int32)
long_args = (rand(1, LONG, H, K), rand(1, 1, H, K) + 0.3 * rand(1, LONG, H, K), rand(1, LONG, HV, V), rand(LONG, HV),
             rand(LONG, HV) + 3, cu_long)
stock_long, stock_long_rings = verify(h, *long_args, slots=slots[:1], ring=LONG)
from sglang.srt.plugins import load_plugins
load_plugins()
mine, rings = verify(h, q, k, v, a, b, cu)
mine_decode = verify(h.clone(), q, k, v, a, b, cu, cache_ring=False)[0]
mine_long, long_rings = verify(h, *long_args, slots=slots[:1], ring=LONG)

# fold each request's accepted steps (request 0 also checkpoints after its step 3), then verify the rest
folded, track_slot = h.clone(), SLOTS - 1
fold.commit_gdn_replayssm_fold_all_layers(
    checkpoint_state=folded[None], rawv_cache=rings[0][None], rawk_cache=rings[1][None], g_cache=rings[2][None],
    beta_cache=rings[3][None], ssm_state_indices=slots, accept_lens=accept, max_cache_len=STEPS, num_k_heads=H,
    mamba_track_indices=torch.tensor([track_slot] + [-1] * (batch - 1), device=dev),
    mamba_steps_to_track=torch.tensor([3] + [-1] * (batch - 1), device=dev))
four = h.clone()
fold.commit_gdn_replayssm_fold_all_layers(
    checkpoint_state=four[None], rawv_cache=rings[0][None], rawk_cache=rings[1][None], g_cache=rings[2][None],
    beta_cache=rings[3][None], ssm_state_indices=slots, accept_lens=torch.full_like(accept, 4),
    max_cache_len=STEPS, num_k_heads=H)  # the same batch, so the same tile as the fold above
rest = torch.cat([torch.arange(i * STEPS + int(n), (i + 1) * STEPS) for i, n in enumerate(accept.tolist())]).to(dev)
cu_rest = torch.nn.functional.pad((STEPS - accept).cumsum(0), (1, 0)).to(torch.int32)
resumed, _ = verify(folded, q[:, rest], k[:, rest], v[:, rest], a[rest], b[rest], cu_rest)
untouched = [s for s in range(SLOTS) if s not in slots.tolist() + [track_slot]]

error = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()
hooked_by = lambda fn: sorted({getattr(c.cell_contents, "__module__", "") for c in fn.__closure__ or ()} - {"", None})
print(json.dumps({"routed": hooked_by(recurrent.fused_sigmoid_gating_delta_rule_update),
                  "fold": hooked_by(fold.commit_gdn_replayssm_fold_all_layers),
                  "rings equal": [torch.equal(x, y) for x, y in zip(stock_rings, rings)],
                  "rings written": [bool(r[slots.long()].abs().sum() > 0) for r in rings],
                  "output error": error(mine, stock), "finite": bool(mine.isfinite().all()),
                  "longer block": torch.equal(mine_long, stock_long) and all(map(torch.equal, stock_long_rings, long_rings)),
                  "resumed error": error(resumed, mine[:, rest]),
                  "checkpoint": torch.equal(folded[track_slot], four[slots[0]]),
                  "folded moved": not torch.equal(folded[slots.long()], h[slots.long()]),
                  "verify kept the state": torch.equal(h, state),
                  "others untouched": torch.equal(folded[untouched], state[untouched]),
                  "without the ring": torch.equal(stock_decode, mine_decode)}))
"""


def tiled_verify(device: str, batch: int, h: int, hv: int, k: int, v: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    result = run_python(VERIFY, device, *map(str, (batch, h, hv, k, v)), env={"SGLANG_PLUGINS": "qflash", **interpret},
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict, tolerance: float) -> None:
    assert "qflash.server.hooks.gdn_verify" in got["routed"] and "qflash.server.hooks.gdn_verify" in got["fold"]
    assert got["rings equal"] == got["rings written"] == [True] * 4, "raw v, raw k, gate, beta"
    assert got["finite"] and got["output error"] <= tolerance, got["output error"]
    assert got["resumed error"] <= tolerance, "verify after the fold gives the first verify's outputs"
    assert got["checkpoint"] and got["folded moved"] and got["verify kept the state"] and got["others untouched"]
    assert got["without the ring"], "a call without the ring runs SGLang's kernel"
    assert got["longer block"], "a call of more than 16 tokens per request runs SGLang's kernel"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: a GPU runs the real shape below")
@pytest.mark.parametrize("batch", [1, 3])  # the tiles for one request and for more
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


HEADS = (2, 2, 4, 32, 32, 64)  # q, k, v heads; their dims (SGLang's split's arguments)


def conv_rows(tokens: int, seed: int = 0) -> torch.Tensor:
    """A conv output's rows as the verify gets them: a token's q | k | v contiguous, tokens apart."""
    q_heads, k_heads, v_heads, dq, dk, dv = HEADS
    width = q_heads * dq + k_heads * dk + v_heads * dv
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_split_hands_out_views_of_contiguous_rows_in_whole_blocks(monkeypatch):
    from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkv_split_gdn_prefill as sglang_split

    from qflash.kernels import gdn_prefill
    from qflash.server.hooks import gdn_input_proj
    from qflash.server.hooks.gdn_verify import _verify_reads_conv_rows

    rows = conv_rows(32)
    views = _verify_reads_conv_rows(sglang_split, rows, *HEADS)
    assert all(torch.equal(view, copy) for view, copy in zip(views, sglang_split(rows, *HEADS)))
    assert all(view.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() for view in views)
    # a conv output read through its transpose, rows short of a whole block, and a prompt past qflash's recurrent
    # prefill (FLA's chunks, which would copy each view apart): SGLang's copies
    longer = conv_rows((gdn_prefill.MAX_TOKENS // 16 + 1) * 16, seed=1)
    for other in (rows.t().contiguous().t(), rows[:20], longer):
        split = _verify_reads_conv_rows(sglang_split, other, *HEADS)
        assert all(part.is_contiguous() and torch.equal(part, copy) for part, copy in zip(split, sglang_split(other, *HEADS)))
    monkeypatch.setattr(gdn_input_proj._Verify, "layer", object())  # a verify's rows, however many: views
    assert not _verify_reads_conv_rows(sglang_split, longer, *HEADS)[0].is_contiguous()


def test_the_verify_of_row_views_is_the_verify_of_copies_bit_for_bit():
    from qflash.kernels import gdn_verify
    from qflash.server.hooks.gdn_verify import _verify_reads_conv_rows

    q_heads, k_heads, v_heads, dq, dk, dv = HEADS
    batch, steps, slots = 2, gdn_verify.BLOCK_STEPS, 5
    tokens = batch * steps
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)
    views = _verify_reads_conv_rows(None, conv_rows(tokens, seed=2), *HEADS)
    assert not views[0].is_contiguous()
    a, b, A_log, dt_bias = rand(tokens, v_heads), rand(tokens, v_heads) + 3, rand(v_heads), rand(v_heads)
    state = rand(slots, v_heads, dv, dk) * 0.1

    def verify(q, k, v):
        rings = [torch.zeros(shape, device=DEVICE) for shape in ((slots, v_heads, steps, dv), (slots, k_heads, steps, dk),
                                                                 (slots, v_heads, steps), (slots, v_heads, steps))]
        as_int = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)
        o = gdn_verify.verify(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, state, as_int([1, 3]),
                              as_int(list(range(0, tokens + 1, steps))), *rings)
        return [o, *rings]

    assert all(map(torch.equal, verify(*views), verify(*(view.contiguous() for view in views))))


CHAIN = """
import json, torch
from qflash.kernels import conv_update, gdn_verify, w8a8_gemm
from qflash.server.tools import shapes

# one request's verify as served: the GDN input GEMM (the conv update in its epilogue) writes q|k|v, z, b and a, and
# the verify launches right after it (PDL), its gates read from the GEMM's b and a
H, HV, K = shapes.GDN_HEADS
V, T, WIDTH, batch = shapes.GDN_VALUE // HV, 16, shapes.GDN_CONV_WIDTH, 2
n, k = next((n, k) for name, n, k in shapes.TARGET if name == "gdn.in_proj_qkvzba")
cuts, dim = shapes.GDN_IN_PROJ_CUTS, shapes.GDN_CONV
g = torch.Generator().manual_seed(0)
rand = lambda *shape, dt=torch.bfloat16: torch.randn(*shape, generator=g).to(dt).cuda()
x, w = rand(batch * T, k), torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).cuda()
w_scale, conv_w, A_log, dt_bias = rand(n, dt=torch.float32) * 0.01, rand(dim, WIDTH), rand(HV, dt=torch.float32), rand(HV, dt=torch.float32)
states, h = rand(4, dim, WIDTH - 1), rand(4, HV, V, K, dt=torch.float32) * 0.1
slots = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
cu = torch.arange(0, batch * T + 1, T, dtype=torch.int32, device="cuda")
config = w8a8_gemm.table_config("verify", batch * T, n, k)

def layer(settle):
    # NaN until the GEMM writes it: a read before then, which the same inputs' last run would otherwise hide, shows
    y = torch.full((batch * T * n,), float("nan"), dtype=torch.bfloat16, device="cuda")
    qkv, z, b, a = w8a8_gemm.segments(y, batch * T, list(cuts), n)
    windows = torch.zeros(4, T, dim, WIDTH - 1, dtype=torch.bfloat16, device="cuda")
    conv = conv_update.epilogue(qkv.view(batch, T, dim).transpose(1, 2), states.clone(), conv_w, None, "silu",
                                conv_state_indices=slots, intermediate_conv_window=windows, intermediate_state_indices=slots)
    w8a8_gemm.launch(x, w, w_scale, None, config, cuts=cuts, conv=conv, y=y)
    if settle:
        torch.cuda.synchronize()
    q, kk, v = (rows.unflatten(-1, (heads, -1))[None] for rows, heads in
                zip(qkv.split([shapes.GDN_KEY, shapes.GDN_KEY, shapes.GDN_VALUE], -1), (H, H, HV)))
    rings = [torch.zeros(4, HV, T, V, dtype=torch.bfloat16, device="cuda"), torch.zeros(4, H, T, K, dtype=torch.bfloat16, device="cuda"),
             torch.zeros(4, HV, T, device="cuda"), torch.zeros(4, HV, T, device="cuda")]
    return gdn_verify.verify(A_log, a, dt_bias, 1.0, 20.0, q, kk, v, b, h, slots, cu, *rings)

settled = layer(True)
chained = [layer(False) for _ in range(20)]
print(json.dumps({"equal": [torch.equal(o, settled) for o in chained], "finite": bool(settled.isfinite().all())}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_verify_reads_the_input_gemms_gates_after_its_wait_gpu():
    """The verify launched right after the GDN input GEMM that runs the conv (server/hooks/gdn_input_proj.py) gives
    what it gives with the GEMM complete: its gates' inputs a and b are that GEMM's outputs, so it may not read them
    before its PDL wait (a read before it, as when the conv ran between, took the gates of unwritten rows)."""
    result = run_python(CHAIN, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["finite"] and all(got["equal"]), got
