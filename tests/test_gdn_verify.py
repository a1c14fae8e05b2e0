"""qflash's pipelined GDN verify against SGLang's (server/patches.py, apply_pipelined_gdn_verify).

The fold verify is called the way SGLang 0.5.17's GDN backend calls it (the module attribute, by keyword), once
before qflash's plugin is loaded and once after, on the same inputs: the outputs and the four rings the commit's
fold replays must be the same bits, the state must stay untouched, and calls without the ring still reach
SGLang's kernel. CPU: Triton's interpreter in fp32 (its bf16 arithmetic is wrong) on small heads; GPU: the
Qwen3.5-4B shape (16 key heads, 32 value heads of 128) in bf16 with the fp32 state.
"""

import json

import pytest
import torch

from conftest import run_python

VERIFY = """
import json, sys, torch
from sglang.kernels.ops.attention.fla import fused_sigmoid_gating_recurrent as recurrent

dev, batch, H, HV, K, V = sys.argv[1], *map(int, sys.argv[2:])
dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes bf16 loads wrongly
STEPS, SLOTS = 16, 2 * batch + 1
T = STEPS * batch
g = torch.Generator(device=dev).manual_seed(0)
rand = lambda *shape, dt=dtype: torch.randn(*shape, device=dev, dtype=dt, generator=g)
q, k, v = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, HV, V)
a, b = rand(T, HV), rand(T, HV)
A_log, dt_bias = rand(HV, dt=torch.float32), rand(HV, dt=torch.float32)
state = rand(SLOTS, HV, V, K, dt=torch.float32)
slots = torch.arange(1, 2 * batch, 2, device=dev, dtype=torch.int32)
cu_seqlens = torch.arange(0, T + 1, STEPS, device=dev, dtype=torch.int32)

def verify(cache_ring=True, direct=False):
    rings = (torch.zeros(SLOTS, HV, STEPS, V, device=dev, dtype=dtype), torch.zeros(SLOTS, H, STEPS, K, device=dev, dtype=dtype),
             torch.zeros(SLOTS, HV, STEPS, device=dev), torch.zeros(SLOTS, HV, STEPS, device=dev))
    h = state.clone()
    ring = dict(zip(("replayssm_rawv", "replayssm_rawk", "replayssm_g", "replayssm_beta"), rings)) if cache_ring else {}
    common = dict(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=h,
                  initial_state_indices=slots, cu_seqlens=cu_seqlens, softplus_beta=1.0, softplus_threshold=20.0, **ring)
    if direct:
        from qflash.kernels.gdn_verify import fold_verify
        o = fold_verify(**common)
    else:  # as SGLang's GDN backend calls it
        o = recurrent.fused_sigmoid_gating_delta_rule_update(**common, use_qk_l2norm_in_kernel=True, is_kda=False,
                                                             disable_state_update=cache_ring, cache_ring=cache_ring)
    return [o, *rings, h] if cache_ring else [o, h]

stock, stock_decode = verify(), verify(cache_ring=False)
from sglang.srt.plugins import load_plugins
load_plugins()
mine, mine_decode = verify(), verify(cache_ring=False)
print(json.dumps({"routed": recurrent.fused_sigmoid_gating_delta_rule_update.__code__.co_filename,
                  "equal": [torch.equal(x, y) for x, y in zip(stock, mine)],
                  "direct": [torch.equal(x, y) for x, y in zip(stock, verify(direct=True))],
                  "state kept": torch.equal(mine[-1], state),
                  "rings written": [bool(r[slots.long()].abs().sum() > 0) for r in mine[1:5]],
                  "finite": bool(mine[0].isfinite().all()),
                  "without the ring": [torch.equal(x, y) for x, y in zip(stock_decode, mine_decode)]}))
"""


def pipelined_verify(device: str, batch: int, h: int, hv: int, k: int, v: int) -> dict:
    interpret = {"TRITON_INTERPRET": "1"} if device == "cpu" else {}
    result = run_python(VERIFY, device, *map(str, (batch, h, hv, k, v)), env={"SGLANG_PLUGINS": "qflash", **interpret},
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(got: dict) -> None:
    assert got["routed"].endswith("server/patches.py")
    assert got["equal"] == got["direct"] == [True] * 6, "output, rawv, rawk, gate, beta rings, state"
    assert got["state kept"] and got["finite"] and got["rings written"] == [True] * 4
    assert got["without the ring"] == [True, True], "a call without the ring runs SGLang's kernel"


def test_pipelined_verify_gives_sglangs_bits():
    check(pipelined_verify("cpu", 2, 2, 4, 32, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 3])
def test_pipelined_verify_gives_sglangs_bits_at_the_real_shape_gpu(batch):
    check(pipelined_verify("cuda", batch, 16, 32, 128, 128))
