"""qflash's recurrent GDN prefill of short prompts (kernels/gdn_prefill.py, routed by server/hooks/gdn_prefill.py).

In one process: a float64 recurrence of the gated delta rule is the reference; then qflash's plugin is loaded
and SGLang's `TritonGDNKernel.extend` (as the GDN backend calls it) reaches qflash's kernel. Checked: the
output, the final state written to each request's slot and the chunk states `h` against the reference, other
slots untouched, and the call equal to the kernel's own launch. On the GPU also SGLang's chunked path at the
real shape: its error against the reference bounds qflash's, and prompts over MAX_TOKENS still run it bit for bit
on the state pass's tiles qflash picks by length. CPU: Triton's interpreter in fp32 on small heads (its bf16
arithmetic is wrong); and which tile a prefill's length picks.
"""

import json

import pytest
import torch

from conftest import run_python

PREFILL = """
import json, sys, torch
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

dev, H, HV, K, V, *lens = sys.argv[1], *map(int, sys.argv[2:])
cuda = dev == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
CHUNK, SLOTS, T = 64, 2 * len(lens) + 2, sum(lens)
gen = torch.Generator(device=dev).manual_seed(0)
rand = lambda *shape, dt=dtype: torch.randn(*shape, device=dev, dtype=dt, generator=gen)
q, k, v = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, HV, V)
g = -torch.rand(1, T, HV, device=dev, generator=gen) * 0.3
beta = torch.sigmoid(rand(1, T, HV, dt=torch.float32))
pool = rand(SLOTS, HV, V, K, dt=torch.float32) * 0.1
slots = torch.arange(1, 2 * len(lens), 2, device=dev, dtype=torch.int32)
cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)

def reference():
    out, states, h = torch.zeros(1, T, HV, V, dtype=torch.float64), {}, []
    qn = torch.nn.functional.normalize(q.double().cpu(), dim=-1, eps=0) * K ** -0.5
    kn = torch.nn.functional.normalize(k.double().cpu(), dim=-1, eps=0)
    for n, slot in enumerate(slots.tolist()):
        S = pool[slot].double().cpu().clone()  # [HV, V, K]
        for t in range(int(cu[n]), int(cu[n + 1])):
            if (t - int(cu[n])) % CHUNK == 0:
                h.append(S.clone())
            for hv in range(HV):
                i_h = hv // (HV // H)
                S[hv] *= torch.exp(g[0, t, hv].double().cpu())
                u = (v[0, t, hv].double().cpu() - S[hv] @ kn[0, t, i_h]) * beta[0, t, hv].double().cpu()
                S[hv] += u[:, None] * kn[0, t, i_h][None, :]
                out[0, t, hv] = S[hv] @ qn[0, t, i_h]
        states[slot] = S
    return out, states, torch.stack(h)[None]

def extend(state, q=q, k=k, v=v, g=g, beta=beta, cu=cu):
    return TritonGDNKernel().extend(q, k, v, g, beta, ssm_states=state, cache_indices=slots, query_start_loc=cu,
                                    state_checkpoint_cu_starts=None, num_state_checkpoints=0,
                                    state_checkpoint_every_n_tokens=0)

def rel(x, y):
    return ((x.double().cpu() - y.double().cpu()).norm() / y.double().cpu().norm()).item()

def worst(errors):  # torch's max propagates NaN, Python's max() may not
    return float(torch.tensor(list(errors)).max())

ref_o, ref_states, ref_h = reference()
result = {}
if cuda:
    stock_pool = pool.clone()
    stock_o, _, stock_h = extend(stock_pool)
    result["stock errors"] = [rel(stock_o, ref_o), worst(rel(stock_pool[s], ref_states[s]) for s in ref_states),
                              rel(stock_h[:, :ref_h.shape[1]], ref_h)]
    longs, stock_longs = [], []
    for long_len in (512, 2100):  # the short and long tiles of the chunks' state pass (server/hooks/gdn_prefill.py)
        long = dict(q=rand(1, long_len, H, K), k=rand(1, long_len, H, K), v=rand(1, long_len, HV, V),
                    g=-torch.rand(1, long_len, HV, device=dev, generator=gen) * 0.3,
                    beta=torch.sigmoid(rand(1, long_len, HV, dt=torch.float32)),
                    cu=torch.tensor([0, long_len - 100, long_len][:len(lens) + 1], device=dev, dtype=torch.int32))
        stock_long_pool = pool.clone()
        longs.append(long)
        stock_longs.append((extend(stock_long_pool, **long)[0], stock_long_pool))

from sglang.srt.plugins import load_plugins
load_plugins()
from qflash.kernels import gdn_prefill

mine_pool = pool.clone()
mine_o, none, mine_h = extend(mine_pool)
own_pool = pool.clone()
own_o = gdn_prefill.prefill(q, k, v, g, beta, own_pool, slots, cu)[0]
others = [s for s in range(SLOTS) if s not in ref_states]
result.update({
    "routed": torch.equal(mine_o, own_o) and torch.equal(mine_pool, own_pool),
    "errors": [rel(mine_o, ref_o), worst(rel(mine_pool[s], ref_states[s]) for s in ref_states),
               rel(mine_h[:, :ref_h.shape[1]], ref_h)],
    "no final state returned": none is None,
    "others untouched": torch.equal(mine_pool[others], pool[others]),
    "finite": bool(mine_o.isfinite().all()),
})
if cuda:
    from sglang.kernels.ops.attention.fla import chunk_delta_h
    state_pass = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    result["long prompts run SGLang's chunks"], result["state pass tiles"] = [], []
    for long, (stock_long, stock_long_pool) in zip(longs, stock_longs):
        long_pool = pool.clone()
        result["long prompts run SGLang's chunks"].append(torch.equal(extend(long_pool, **long)[0], stock_long)
                                                          and torch.equal(long_pool, stock_long_pool))
        tile = state_pass.best_config  # the config its autotuner launched
        result["state pass tiles"].append(dict(BV=tile.kwargs["BV"], num_warps=tile.num_warps,
                                               num_stages=tile.num_stages))
print(json.dumps(result))
"""


def prefill(device: str, h: int, hv: int, k: int, v: int, *lens: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    result = run_python(PREFILL, device, *map(str, (h, hv, k, v, *lens)), env={"SGLANG_PLUGINS": "qflash", **interpret},
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict, tolerance: float) -> None:
    assert got["routed"], "TritonGDNKernel.extend of a short prompt runs qflash's prefill"
    assert got["finite"] and got["no final state returned"] and got["others untouched"]
    assert all(error <= tolerance for error in got["errors"]), got["errors"]  # a NaN fails (max() could skip it)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: a GPU runs the real shape below")
@pytest.mark.parametrize("lens", [(70,), (70, 5)])  # one request over a chunk boundary; two requests
def test_short_prefill(lens):
    check(prefill("cpu", 2, 4, 32, 16, *lens), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("lens", [(64,), (150, 37)])
def test_short_prefill_at_the_real_shape_gpu(lens):
    got = prefill("cuda", 16, 32, 128, 128, *lens)
    print(f"\nGDN prefill errors against float64, qflash {got['errors']}, SGLang's chunks {got['stock errors']}")
    check(got, 2 * max(got["stock errors"]) + 1e-3)
    assert got["long prompts run SGLang's chunks"] == [True, True]  # on qflash's short and long tiles, SGLang's bits
    from qflash.server.hooks.gdn_prefill import STATE_PASS_TILES
    assert got["state pass tiles"] == [STATE_PASS_TILES["short"], STATE_PASS_TILES["long"]]


ROUTE = """
import sys
import torch
from sglang.srt.plugins import load_plugins
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

load_plugins()
torch.set_default_device(sys.argv[1])
x = torch.zeros(1, 8, 2, 32)
TritonGDNKernel().extend(x, x, torch.zeros(1, 8, 4, 16), torch.zeros(1, 8, 4), torch.zeros(1, 8, 4),
                         ssm_states=torch.zeros(2, 4, 16, 32), cache_indices=torch.ones(1, dtype=torch.int32),
                         query_start_loc=torch.tensor([0, 8], dtype=torch.int32))
print("ran")
"""


def test_the_limit_comes_from_the_environment():
    # An 8-token prompt: qflash's kernel runs it by default; with the limit at 0 it reaches SGLang's chunked
    # path, which refuses fp32 inputs before launching anything (the only dtype Triton interprets correctly).
    # On a GPU it runs there: Triton 3.6's interpreter fails under NumPy 2.4 (the GPU machine's), whose arrays of
    # one element no longer convert to ints (a loop bound from a program id).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = {"SGLANG_PLUGINS": "qflash", **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    assert run_python(ROUTE, device, env=env).stdout.strip().endswith("ran")
    chunked = run_python(ROUTE, device, env={**env, "QFLASH_GDN_PREFILL_MAX_TOKENS": "0"})
    assert chunked.returncode != 0 and "does not support float32" in chunked.stderr, chunked.stderr[-2000:]


def test_a_nan_error_fails_the_check():
    good = {"routed": True, "finite": True, "no final state returned": True, "others untouched": True}
    for errors in ([float("nan"), 0.0, 0.0], [0.0, float("nan"), 0.0]):  # max() of the second is 0.0
        with pytest.raises(AssertionError):
            check({**good, "errors": errors}, 1e-6)


TILE = """
import json, sys, torch
from sglang.kernels.ops.attention.fla import chunk_delta_h
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
from sglang.srt.plugins import load_plugins

kernel = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
sglangs = kernel.configs[0]
load_plugins()
tiles = {}
for tokens in map(int, sys.argv[1:]):
    x, gate = torch.zeros(1, tokens, 2, 32), torch.zeros(1, tokens, 4)
    try:
        TritonGDNKernel().extend(x, x, torch.zeros(1, tokens, 4, 16), gate, gate,
                                 ssm_states=torch.zeros(2, 4, 16, 32), cache_indices=torch.ones(1, dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, tokens], dtype=torch.int32))
    except AssertionError as exc:  # the chunked path refuses fp32 inputs before it launches anything
        assert "does not support float32" in str(exc), exc
    config = kernel.configs[0]
    tiles[tokens] = "sglang's" if config is sglangs else dict(BV=config.kwargs["BV"], num_warps=config.num_warps,
                                                              num_stages=config.num_stages)
print(json.dumps(tiles))
"""


@pytest.mark.parametrize("knob", [None, "SGLANG_GDN_CHUNK_H_NUM_STAGES"])
def test_the_chunks_state_pass_takes_the_tile_of_the_prefills_length(knob):
    from qflash.server.hooks import gdn_prefill

    env = {"SGLANG_PLUGINS": "qflash", "TRITON_INTERPRET": "1", **({knob: "2"} if knob else {})}
    result = run_python(TILE, "300", "2048", "2049", "8192", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    short, long = gdn_prefill.STATE_PASS_TILES["short"], gdn_prefill.STATE_PASS_TILES["long"]
    # a user's own knob for SGLang's tile keeps SGLang's config at every length
    assert got == ({"300": short, "2048": short, "2049": long, "8192": long} if knob is None else
                   dict.fromkeys(("300", "2048", "2049", "8192"), "sglang's"))
