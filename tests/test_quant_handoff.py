"""The norms and SiLU-and-multiply that write their output's int8 rows, and the handoff of those rows to the W8A8
projection (CPU: Triton's interpreter, which truncates fp32 -> bf16, hence the 1-ulp tolerances on bf16 outputs)."""

import pytest
import torch

from qflash.kernels.norm_quant import gemma_norm_quant
from qflash.kernels.silu_mul_quant import silu_mul_quant
from qflash.quant import handoff
from qflash.quant.method import W8A8LinearMethod, runs_w8a8
from qflash.server.hooks.quant_handoff import _norm_with_int8_output, _silu_mul_with_int8_output
from test_kernels import BF16_ULP, DEVICE, int8_weight, quant_reference

EPS = 1e-6


def rows(m, k, seed, scale=1.0):
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16).to(DEVICE)


def gemma_reference(x, residual, weight):
    """SGLang's CUDA norm in float64: the residual sum kept unrounded, as flashinfer's kernel does."""
    h = x.double() + (0 if residual is None else residual.double())
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1 + weight.double()), h


def within_ulp(y, ref, ulps=2):
    return ((y.double() - ref).abs() <= ulps * BF16_ULP * ref.abs() + 1e-30).all()


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_writes_the_norm_and_the_int8_rows_of_what_it_wrote(with_residual):
    x, residual, weight = rows(5, 300, 1), rows(5, 300, 2) if with_residual else None, rows(1, 300, 3)[0] * 0.1
    x[3] = 0  # a row of zeros (with its residual, or alone: rsqrt(eps), no NaN)
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    out = x if with_residual else torch.empty_like(x)
    q, scale = gemma_norm_quant(x, residual, weight, EPS, out)
    ref, summed = gemma_reference(x0, r0, weight)
    assert within_ulp(out, ref) and not out.isnan().any()
    if with_residual:
        assert within_ulp(residual, summed, ulps=1)
    else:
        assert torch.equal(x, x0)  # out of place: the input is left as it was
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


def test_silu_mul_writes_the_product_and_the_int8_rows_of_what_it_wrote():
    x = rows(6, 2 * 200, 4, scale=3.0)
    out, q, scale = silu_mul_quant(x)
    gate, up = x.double().chunk(2, dim=-1)
    ref = gate / (1 + torch.exp(-gate)) * up
    assert out.shape == (6, 200) and within_ulp(out, ref, ulps=3)
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


def test_a_projection_reads_the_offered_rows_only_for_that_tensor_unchanged():
    x, q, scale = rows(4, 64, 5), torch.ones(4, 64, dtype=torch.int8), torch.ones(4)
    handoff.offer(x, q, scale)
    assert handoff.take(x) == (q, scale)
    assert handoff.take(x) == (q, scale)  # a second reader of the same input (a GDN layer's two projections)
    assert handoff.take(x.clone()) == (None, None)
    assert handoff.take(x.view(4, 64)) == (None, None)  # another tensor object over the same memory
    x.mul_(2)  # changed since: quantized anew
    assert handoff.take(x) == (None, None)


class _Linear(torch.nn.Module):
    def __init__(self, n, k, seed):
        super().__init__()
        self.weight, self.weight_scale = int8_weight(n, k, seed)
        self.quant_method = W8A8LinearMethod()


def test_a_projection_given_the_rows_computes_what_it_computes_without_them():
    """The whole point: the same bits. A handoff whose rows were not those of its tensor would fail here."""
    linear, x = _Linear(48, 300, 6), rows(8, 300, 7)
    alone = linear.quant_method.apply(linear, x.clone())
    q, scale = gemma_norm_quant(x, None, torch.zeros(300, dtype=torch.bfloat16, device=DEVICE), EPS, x)
    expected = linear.quant_method.apply(linear, x.clone())
    handoff.offer(x, q, scale)
    assert torch.equal(linear.quant_method.apply(linear, x), expected)
    assert not torch.equal(alone, expected)  # the norm did change x: the rows are not trivially the same
    handoff.offer(x, torch.zeros_like(q), scale)  # rows that are not x's: the projection must read them
    assert not torch.equal(linear.quant_method.apply(linear, x), expected)


class _Norm(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.weight = torch.nn.Parameter(rows(1, k, 8)[0] * 0.1)
        self.variance_epsilon = EPS


def _never(*args, **kwargs):
    raise AssertionError("SGLang's kernel ran for a marked module")


def test_a_marked_norm_runs_the_quantizing_kernel_in_place_and_offers_its_rows():
    norm, x, residual = _Norm(300), rows(4, 300, 9), rows(4, 300, 10)
    handoff.mark(norm, True)
    out, res = _norm_with_int8_output(_never, norm, x, residual)
    assert out is x and res is residual  # in place, as SGLang's fused add-norm
    q, scale = handoff.take(out)
    assert torch.equal(q.cpu(), quant_reference(out.cpu())[0])
    alone = _norm_with_int8_output(_never, norm, rows(4, 300, 12))  # the first layer's norm: no residual
    assert handoff.take(alone)[0] is not None


def test_an_unmarked_module_keeps_sglangs_kernel():
    norm, act, x = _Norm(300), torch.nn.Module(), rows(4, 300, 13)
    assert runs_w8a8(_Linear(16, 300, 14)) and not runs_w8a8(torch.nn.Linear(300, 16))
    handoff.mark(norm, False)
    calls = []
    _norm_with_int8_output(lambda *a: calls.append("norm") or a[1], norm, x, None)
    _silu_mul_with_int8_output(lambda *a: calls.append("act") or a[1], act, x)
    handoff.mark(norm, True)
    _norm_with_int8_output(lambda *a: calls.append("norm+") or a[1], norm, x, None, x)  # post-residual addition
    assert calls == ["norm", "act", "norm+"]


def test_a_marked_activation_offers_its_rows():
    act, x = torch.nn.Module(), rows(3, 2 * 96, 15)
    handoff.mark(act, True)
    out = _silu_mul_with_int8_output(_never, act, x)
    assert out.shape == (3, 96) and handoff.take(out)[0] is not None
