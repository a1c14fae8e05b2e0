"""qflash's causal-conv1d update of a verify block (kernels/conv_update.py) against SGLang's kernel.

On the same inputs the outputs, the updated conv states and the per-step windows the commit reads back must be
SGLang's bits, for several requests (one of them padding), and the GDN backend's call must reach qflash's kernel
once the plugin is loaded. CPU: Triton's interpreter in fp32 (its bf16 arithmetic is wrong), a channel count that
no tile divides evenly; GPU: bf16 at the Qwen3.5-4B shape (8,192 channels, 16 tokens).
"""

import json

import pytest
import torch

from conftest import run_python

UPDATE = """
import json, sys, torch
from sglang.kernels.ops.mamba import causal_conv1d_triton as stock
from qflash.kernels import conv_update

dev, dim, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes bf16 loads wrongly
T, WIDTH, SLOTS = 16, 4, 8
torch.manual_seed(0)
x = torch.randn(batch, T, dim, device=dev, dtype=dtype).transpose(1, 2)  # as the GDN backend hands it
weight = torch.randn(dim, WIDTH, device=dev, dtype=dtype)
bias = torch.randn(dim, device=dev, dtype=dtype)
states = torch.randn(SLOTS, dim, WIDTH - 1, device=dev, dtype=dtype)
slots = torch.arange(1, 2 * batch, 2, device=dev, dtype=torch.int32)
slots[-1] = -1  # the last request is padding (a CUDA graph's spare row)
window_slots = torch.arange(batch, device=dev, dtype=torch.int32).flip(0)

def update(fn):
    state, windows = states.clone(), torch.zeros(batch + 1, T, dim, WIDTH - 1, device=dev, dtype=dtype)
    args = (x.clone(), state, weight, bias, "silu")
    kwargs = dict(conv_state_indices=slots, intermediate_conv_window=windows, intermediate_state_indices=window_slots)
    assert conv_update.takes(*args, **kwargs)
    return fn(*args, **kwargs)[: batch - 1], state, windows

ours, theirs = update(conv_update.conv_update), update(stock.causal_conv1d_update)
from sglang.srt.plugins import load_plugins
from sglang.srt.layers.attention.linear import gdn_backend
calls = []
conv_update.conv_update, qflash_update = (lambda *a, **k: calls.append(1) or qflash_update(*a, **k)), conv_update.conv_update
load_plugins()
update(gdn_backend.causal_conv1d_update)
print(json.dumps({"equal": [torch.equal(a, b) for a, b in zip(ours, theirs)],
                  "finite": bool(ours[0].isfinite().all()), "state moved": not torch.equal(ours[1], states),
                  "windows written": bool(ours[2].abs().sum() > 0), "backend reaches qflash": len(calls) == 1}))
"""


def updates(device: str, dim: int, batch: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    result = run_python(UPDATE, device, str(dim), str(batch), env={"SGLANG_PLUGINS": "qflash", **interpret}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict) -> None:
    assert got["windows written"] and got["finite"] and got["state moved"]
    assert got["equal"] == [True, True, True], "output, conv states, per-step windows"
    assert got["backend reaches qflash"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: a GPU runs the real shape below")
def test_block_conv_update_gives_sglangs_bits():
    check(updates("cpu", 200, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [2, 4])
def test_block_conv_update_gives_sglangs_bits_at_the_real_shape_gpu(batch):
    check(updates("cuda", 8192, batch))


EPILOGUE = """
import json, sys, torch
from qflash.kernels import conv_update, w8a8_gemm
from qflash.server.tools import shapes

dev, batch = sys.argv[1], int(sys.argv[2])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
T, WIDTH = 16, shapes.GDN_CONV_WIDTH
n, k = next((n, k) for name, n, k in shapes.TARGET if name == "gdn.in_proj_qkvzba")
cuts = shapes.GDN_IN_PROJ_CUTS
if dev == "cpu":  # the interpreter: a few of the real layout's tiles
    n, k, cuts = 200, 64, (128, 160, 168)
dim = cuts[0]
g = torch.Generator().manual_seed(0)
x = torch.randn(batch * T, k, generator=g).to(dtype).to(dev)
w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).to(dev)
w_scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(dev)
weight, bias = torch.randn(dim, WIDTH, generator=g).to(dtype).to(dev), torch.randn(dim, generator=g).to(dtype).to(dev)
states = torch.randn(2 * batch + 1, dim, WIDTH - 1, generator=g).to(dtype).to(dev)
slots = torch.arange(1, 2 * batch + 1, 2, dtype=torch.int32, device=dev)
slots[-1] = -1  # the last request is padding
window_slots = torch.arange(batch, dtype=torch.int32, device=dev).flip(0)
config = w8a8_gemm.table_config("verify", batch * T, n, k)
assert w8a8_gemm.conv_fits(config, batch * T, cuts, T), config

def run(fused):
    state, windows = states.clone(), torch.zeros(batch + 1, T, dim, WIDTH - 1, device=dev, dtype=dtype)
    y = torch.full((batch * T * n,), float("nan"), device=dev, dtype=dtype)  # what neither path writes stays NaN
    qkv = w8a8_gemm.segments(y, batch * T, list(cuts), n)[0].view(batch, T, dim).transpose(1, 2)
    kwargs = dict(conv_state_indices=slots, intermediate_conv_window=windows, intermediate_state_indices=window_slots)
    if fused:
        w8a8_gemm.launch(x, w, w_scale, None, config, cuts=cuts, y=y,
                         conv=conv_update.epilogue(qkv, state, weight, bias, "silu", **kwargs))
        return qkv[: batch - 1], y[batch * T * dim:], state, windows
    w8a8_gemm.launch(x, w, w_scale, None, config, cuts=cuts, y=y)
    return conv_update.conv_update(qkv, state, weight, bias, "silu", **kwargs)[: batch - 1], y[batch * T * dim:], state, windows

got, expected = run(True), run(False)
print(json.dumps({"equal": [torch.equal(a, b) for a, b in zip(got, expected)], "config": config}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [2, 5])
def test_the_input_gemms_conv_epilogue_gives_the_kernels_bits_at_the_real_shape_gpu(batch):
    """The GDN input GEMM with the conv update in its epilogue (the verify's, server/hooks/gdn_input_proj.py) against
    the GEMM and then this kernel, with the table's config: q|k|v after the conv, z|b|a, states and windows."""
    result = run_python(EPILOGUE, "cuda", str(batch), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["equal"] == [True] * 4, got


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run: a GPU runs the real shape above")
def test_the_input_gemms_conv_epilogue_gives_the_kernels_bits():
    result = run_python(EPILOGUE, "cpu", "3", env={"TRITON_INTERPRET": "1"}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["equal"] == [True] * 4
