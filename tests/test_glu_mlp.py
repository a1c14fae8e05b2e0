"""The MLP at decode rows in two launches (kernels/w8a8_gemm.py `w8a8_glu_mlp`, server/hooks/glu_mlp.py): the bits of
the three launches it replaces (CPU: Triton's interpreter)."""

import pytest
import torch

from qflash.kernels import w8a8_gemm
from qflash.kernels.per_token_quant import per_token_quant
from qflash.kernels.silu_mul_quant import silu_mul_quant
from qflash.quant import handoff
from qflash.quant.method import W8A8LinearMethod
from qflash.server.hooks.glu_mlp import _in_two_launches
from test_kernels import DEVICE, W8A8_CONFIGS, int8_weight

K, D, N = 96, 80, 48  # hidden, intermediate (gate_up writes 2 * D), down's outputs: ragged against the tiles
GATE_UP = dict(W8A8_CONFIGS[1], BLOCK_N=32)
DOWNS = [W8A8_CONFIGS[1], W8A8_CONFIGS[3], W8A8_CONFIGS[4]]  # plain; split-K 3; an early weight tile


def rows(m, seed, scale):
    return (torch.randn(m, K, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16).to(DEVICE)


def three_launches(x, gate_up, down, down_config):
    y, q, scale = silu_mul_quant(w8a8_gemm.launch(x, *gate_up, None, GATE_UP))
    return w8a8_gemm.launch(y, *down, None, down_config, q, scale)


def two_launches(x, gate_up, down, down_config):
    y = w8a8_gemm.launch(x, *gate_up, None, dict(GATE_UP, BLOCK_N=16), glu=True)
    return w8a8_gemm.launch(y, *down, None, down_config, x_amax=True)


@pytest.mark.parametrize("down_config", DOWNS, ids=["plain", "split_k", "early"])
def test_two_launches_give_the_three_launches_bits_and_leave_the_maxima_zeroed(down_config):
    """Rows of large values, then of small ones: maxima left from the first MLP would quantize the second by them."""
    gate_up, down = int8_weight(2 * D, K, 1), int8_weight(N, D, 2)
    for m, seed, scale in ((5, 3, 2.0), (16, 4, 0.05), (1, 5, 0.5)):
        x = rows(m, seed, scale)
        assert torch.equal(two_launches(x, gate_up, down, down_config), three_launches(x, gate_up, down, down_config))
        amax, done = w8a8_gemm.row_maxima(x.device)
        assert not amax.any() and not done.any()


def test_the_glu_epilogue_writes_silu_of_the_gate_times_the_up_and_its_rows_maxima():
    gate_up, x = int8_weight(2 * D, K, 1), rows(5, 6, 1.0)
    y = w8a8_gemm.launch(x, *gate_up, None, dict(GATE_UP, BLOCK_N=16), glu=True)
    assert torch.equal(y, silu_mul_quant(w8a8_gemm.launch(x, *gate_up, None, GATE_UP))[0])
    amax = w8a8_gemm.row_maxima(x.device)[0]
    assert torch.equal(amax[:5].view(torch.float32), y.float().abs().amax(dim=1)) and not amax[5:].any()
    amax.zero_()


class _Linear(torch.nn.Module):
    def __init__(self, n, k, seed, phase="verify"):
        super().__init__()
        self.weight, self.weight_scale = int8_weight(n, k, seed)
        self.quant_method, self.bias, self.tp_size = W8A8LinearMethod(phase), None, 1


def _mlp(phase="verify"):
    mlp = torch.nn.Module()
    mlp.gate_up_proj, mlp.down_proj = _Linear(2 * D, K, 1, phase), _Linear(N, D, 2, phase)
    return mlp


def sglangs_forward(mlp, x):
    """Qwen2MoeMLP.forward on qflash's W8A8 method: gate_up, SiLU-and-multiply handing its int8 rows, down."""
    gate_up = mlp.gate_up_proj.quant_method.apply(mlp.gate_up_proj, x)
    y, q, scale = silu_mul_quant(gate_up)
    handoff.offer(y, q, scale)
    return mlp.down_proj.quant_method.apply(mlp.down_proj, y)


def _never(*args, **kwargs):
    raise AssertionError("SGLang's forward ran")


@pytest.mark.parametrize("phase", ["verify", "draft"])
def test_an_mlp_at_decode_rows_runs_in_two_launches_with_sglangs_bits(phase):
    mlp = _mlp(phase)
    for m in (1, 16, w8a8_gemm.GLU_MAX_M):
        x = rows(m, 7, 1.0)
        assert torch.equal(_in_two_launches(_never, mlp, x), sglangs_forward(mlp, x))


def test_an_mlp_reads_the_int8_rows_its_norm_offered():
    mlp, x = _mlp(), rows(4, 8, 1.0)
    expected = _in_two_launches(_never, mlp, x)
    q, scale = per_token_quant(x)
    handoff.offer(x, torch.zeros_like(q), scale)  # rows that are not x's: the MLP must read them
    assert not torch.equal(_in_two_launches(_never, mlp, x), expected)
    handoff.offer(x, q, scale)
    assert torch.equal(_in_two_launches(_never, mlp, x), expected)


def test_what_two_launches_do_not_cover_keeps_sglangs_forward():
    def sglang(mlp, x, *args, **kwargs):
        return "sglang"

    mlp = _mlp()
    cases = [(mlp, rows(w8a8_gemm.GLU_MAX_M + 1, 9, 1.0)), (mlp, rows(4, 9, 1.0).t()), (mlp, rows(0, 9, 1.0))]
    split = _mlp()
    split.down_proj.tp_size = 2
    bf16 = _mlp()
    bf16.gate_up_proj.quant_method = None
    biased = _mlp()
    biased.down_proj.bias = torch.zeros(N, device=DEVICE)
    cases += [(module, rows(4, 9, 1.0)) for module in (split, bf16, biased)]
    assert all(_in_two_launches(sglang, module, x) == "sglang" for module, x in cases)
    assert _in_two_launches(sglang, mlp, rows(4, 9, 1.0), "an argument SGLang's forward may add") == "sglang"
