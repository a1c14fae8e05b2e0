"""SGLang's causal-conv1d update with qflash's channel tiles (server/hooks/gdn_verify.py).

The GDN verify's conv update runs as SGLang 0.5.17 launches it (256 channels per program) and as qflash's
plugin launches it (CONV_UPDATE_BLOCK_N), on the same inputs: the outputs, the updated conv states and the
per-step windows the commit reads back must be the same bits. CPU: Triton's interpreter in fp32 (its bf16 arithmetic is
wrong), a small channel count that no tile divides evenly; GPU: the Qwen3.5-4B shape (8,192 channels, 16 tokens).
"""

import json

import pytest
import torch

from conftest import run_python

UPDATE = """
import json, sys, torch
from sglang.kernels.ops.mamba import causal_conv1d_triton as conv

dev, dim, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes bf16 loads wrongly
T, WIDTH, SLOTS = 16, 4, 8
torch.manual_seed(0)
x = torch.randn(batch, T, dim, device=dev, dtype=dtype).transpose(1, 2)  # as the GDN backend hands it
weight = torch.randn(dim, WIDTH, device=dev, dtype=dtype)
bias = torch.randn(dim, device=dev, dtype=dtype)
states = torch.randn(SLOTS, dim, WIDTH - 1, device=dev, dtype=dtype)
slots = torch.arange(1, 2 * batch, 2, device=dev, dtype=torch.int32)

def update():
    state, windows = states.clone(), torch.zeros(batch + 1, T, dim, WIDTH - 1, device=dev, dtype=dtype)
    out = conv.causal_conv1d_update(x.clone(), state, weight, bias, "silu", conv_state_indices=slots,
                                    intermediate_conv_window=windows,
                                    intermediate_state_indices=torch.arange(batch, device=dev, dtype=torch.int32))
    return out, state, windows

stock = update()
from sglang.srt.plugins import load_plugins
load_plugins()
tiled = update()
print(json.dumps({"tiles": getattr(conv._causal_conv1d_update_kernel, "block_n", 256),
                  "equal": [torch.equal(a, b) for a, b in zip(stock, tiled)],
                  "finite": bool(stock[0].isfinite().all()),
                  "windows written": bool(stock[2].abs().sum() > 0)}))
"""


def tiled_update(device: str, dim: int, batch: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}  # on a GPU machine too
    result = run_python(UPDATE, device, str(dim), str(batch), env={"SGLANG_PLUGINS": "qflash", **interpret}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict) -> None:
    from qflash.server.hooks.gdn_verify import CONV_UPDATE_BLOCK_N

    assert got["tiles"] == CONV_UPDATE_BLOCK_N < 256
    assert got["windows written"] and got["finite"]
    assert got["equal"] == [True, True, True], "output, conv states, per-step windows"


def test_channel_tiles_give_sglangs_bits():
    check(tiled_update("cpu", 200, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_channel_tiles_give_sglangs_bits_at_the_real_shape_gpu(batch):
    check(tiled_update("cuda", 8192, batch))
