"""The norms (Gemma, plain, Gated-DeltaNet's gated one), SiLU-and-multiply and the attention output gate that write
their output's int8 rows,
and the handoff of those rows to the W8A8 projection (CPU: Triton's interpreter, which truncates fp32 -> bf16,
hence the 1-ulp tolerances on bf16 outputs)."""

import pytest
import torch

from qflash.kernels.gated_norm_quant import gated_norm_quant
from qflash.kernels.norm_quant import rms_norm_quant
from qflash.kernels.sigmoid_mul_quant import sigmoid_mul_quant
from qflash.kernels.silu_mul_quant import silu_mul_quant
from qflash.quant import handoff
from qflash.quant.method import DrafterQKVMethod, W8A8LinearMethod, runs_w8a8
from qflash.server.hooks.quant_handoff import (_gate_with_int8_output, _gated_norm_with_int8_output,
                                               _name_the_gated_layer, _rms_norm, _silu_mul_with_int8_output)
from test_kernels import BF16_ULP, DEVICE, int8_weight, quant_reference

EPS = 1e-6
# What reads a producer's output, as `handoff.mark` takes it (whether each reader is a W8A8 projection):
READ_TOO = [True, False]  # a W8A8 projection, and a reader of the output itself (it must be written)
INT8_ONLY = [True]  # W8A8 projections only (only the int8 rows are written)


@pytest.fixture(autouse=True)
def _no_offer_across_tests(monkeypatch):
    """Each test starts with no output offered, and leaves none behind it for the next."""
    monkeypatch.setattr(handoff, "_offered", None)
    monkeypatch.setattr(handoff, "_untaken", None)


@pytest.fixture
def unwritten_is_nan():
    """torch.empty fills float memory with NaN (ints with their maximum): an output left unwritten shows as NaN."""
    deterministic, warn_only = (torch.are_deterministic_algorithms_enabled(),
                                torch.is_deterministic_algorithms_warn_only_enabled())
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def rows(m, k, seed, scale=1.0):
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16).to(DEVICE)


def norm_reference(x, residual, weight, gemma=True):
    """SGLang's CUDA norms in float64: the residual sum kept unrounded, as flashinfer's kernels do."""
    h = x.double() + (0 if residual is None else residual.double())
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (int(gemma) + weight.double()), h


def gated_reference(x, z, weight):
    """FLA's gated norm in float64: each row (one head) normalised, times the weight, times silu(z)."""
    x, z = x.double(), z.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double() * z * torch.sigmoid(z)


def within_ulp(y, ref, ulps=2):
    return ((y.double() - ref).abs() <= ulps * BF16_ULP * ref.abs() + 1e-30).all()


@pytest.mark.parametrize("gemma", [True, False], ids=["gemma", "plain"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_writes_the_norm_and_the_int8_rows_of_what_it_wrote(with_residual, gemma):
    x, residual, weight = rows(5, 300, 1), rows(5, 300, 2) if with_residual else None, rows(1, 300, 3)[0] * 0.1
    x[3] = 0  # a row of zeros (with its residual, or alone: rsqrt(eps), no NaN)
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    out = x if with_residual else torch.empty_like(x)
    q, scale = rms_norm_quant(x, residual, weight, EPS, out, gemma)
    ref, summed = norm_reference(x0, r0, weight, gemma)
    assert within_ulp(out, ref) and not out.isnan().any()
    if with_residual:
        assert within_ulp(residual, summed, ulps=1)
    else:
        assert torch.equal(x, x0)  # out of place: the input is left as it was
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


def test_gated_norm_writes_each_heads_norm_and_the_int8_rows_of_each_tokens_heads():
    tokens, heads, head_dim = 3, 4, 32
    x, z, weight = rows(tokens * heads, head_dim, 16, 2.0), rows(tokens * heads, head_dim, 17, 3.0), rows(1, head_dim, 18)[0]
    x[5] = 0  # a head of zeros: rsqrt(eps), no NaN
    out, q, scale = gated_norm_quant(x, z, weight, EPS, heads * head_dim)
    assert out.shape == x.shape and q.shape == (tokens, heads * head_dim) and scale.shape == (tokens,)
    assert within_ulp(out, gated_reference(x, z, weight), ulps=3) and not out.isnan().any()
    q_ref, scale_ref = quant_reference(out.view(tokens, -1).cpu())  # a token's row: all its heads
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


def test_silu_mul_writes_the_product_and_the_int8_rows_of_what_it_wrote():
    x = rows(6, 2 * 200, 4, scale=3.0)
    out, q, scale = silu_mul_quant(x)
    gate, up = x.double().chunk(2, dim=-1)
    ref = gate / (1 + torch.exp(-gate)) * up
    assert out.shape == (6, 200) and within_ulp(out, ref, ulps=3)
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("per_head", [False, True], ids=["flat-gate", "per-head-gate"])
def test_the_gate_writes_sglangs_bits_in_place_and_the_int8_rows_of_what_it_wrote(per_head):
    """As SGLang's Triton gate: the flat gate of its CUDA path, or the per-head view of q | gate its native path makes
    (Qwen3.5-4B's 16 heads of 256)."""
    from sglang.kernels.ops.elementwise.elementwise import fused_sigmoid_mul

    tokens, heads, head_dim = 5, 16, 256
    attn = rows(tokens, heads * head_dim, 24, 2.0)
    q_gate = rows(tokens, 2 * heads * head_dim, 25, 3.0)
    gate = q_gate.view(tokens, heads, 2 * head_dim)[..., head_dim:] if per_head else q_gate[:, ::2].contiguous()
    expected = fused_sigmoid_mul(attn.clone(), gate, inplace=True)
    out = attn
    q, scale = sigmoid_mul_quant(out, gate)
    assert torch.equal(out, expected) and not torch.equal(out, rows(tokens, heads * head_dim, 24, 2.0))  # in place
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


def _producer_calls(producer):
    """(inputs, call(inputs, write_out) -> (output, int8 rows, scales)) for one of the four producers' kernels."""
    if producer in ("norm", "first layer's norm"):
        x, residual, weight = rows(5, 300, 1), rows(5, 300, 2) if producer == "norm" else None, rows(1, 300, 3)[0] * 0.1

        def norm(t, write_out):
            x, residual = t
            out = torch.empty_like(x) if residual is None else x
            return (out, *rms_norm_quant(x, residual, weight, EPS, out, write_out=write_out))
        return (x, residual), norm
    if producer == "gated norm":
        weight = rows(1, 32, 18)[0]
        return ((rows(12, 32, 16, 2.0), rows(12, 32, 17, 3.0)),
                lambda t, write_out: gated_norm_quant(*t, weight, EPS, 4 * 32, write_out))
    if producer == "silu":
        return (rows(6, 2 * 200, 4, scale=3.0),), lambda t, write_out: silu_mul_quant(*t, write_out)
    attn, q_gate = rows(5, 16 * 256, 24, 2.0), rows(5, 2 * 16 * 256, 25, 3.0)
    return (attn, q_gate[:, ::2].contiguous()), lambda t, write_out: (t[0], *sigmoid_mul_quant(*t, write_out))


@pytest.mark.parametrize("producer", ["norm", "first layer's norm", "gated norm", "silu", "gate"])
def test_a_kernel_whose_output_goes_unread_writes_only_its_int8_rows(producer, unwritten_is_nan):
    """The int8 rows and scales of the output it would have written, the output's memory as it was (in place: the
    input's bits; else unwritten NaN), and the rest (the residual sum) as written."""
    inputs, call = _producer_calls(producer)
    copies = tuple(None if t is None else t.clone() for t in inputs)
    out, q, scale = call(inputs, False)
    expected_out, expected_q, expected_scale = call(copies, True)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)
    assert not expected_out.isnan().any()
    if producer in ("norm", "gate"):  # in place: the input as it came
        assert out is inputs[0] and torch.equal(out, _producer_calls(producer)[0][0])
        assert not torch.equal(out, expected_out)
    else:
        assert out.isnan().all()
    if producer == "norm":
        assert torch.equal(inputs[1], copies[1])  # the residual sum, written as ever


def test_a_projection_reads_the_offered_rows_only_for_that_tensor_unchanged():
    x, q, scale = rows(4, 64, 5), torch.ones(4, 64, dtype=torch.int8), torch.ones(4)
    handoff.offer(x, q, scale)
    assert handoff.take(x) == (q, scale)
    assert handoff.take(x) == (q, scale)  # a second reader of the same input (a GDN layer's two projections)
    assert handoff.take(x.clone()) == (None, None)
    assert handoff.take(x.view(4, 64)) == (q, scale)  # another view of the same memory, as the rows see it
    assert handoff.take(x.view(8, 32)) == (None, None)  # the same memory as other rows
    assert handoff.take(x[1:]) == (None, None) and handoff.take(x[:, :32]) == (None, None)
    x.view(4, 64)[0, 0] = 1  # changed since, through a view: quantized anew
    assert handoff.take(x) == (None, None)


def test_an_output_left_unwritten_must_be_taken_whole_before_the_next_offer():
    x, q, scale = rows(4, 64, 5), torch.ones(4, 64, dtype=torch.int8), torch.ones(4)
    handoff.offer(x, q, scale, written=False)
    assert handoff.take(x.clone()) == (None, None)  # other memory: quantized anew, as ever
    with pytest.raises(RuntimeError, match="left unwritten"):
        handoff.take(x.view(8, 32))  # its memory as other rows: they would quantize bits never written
    with pytest.raises(RuntimeError, match="no W8A8 projection took"):
        handoff.offer(rows(4, 64, 6), q, scale)  # whatever read it instead read bits never written
    assert handoff.take(x) == (q, scale) and handoff.take(x) == (q, scale)  # taken (by a GDN layer's two projections)
    handoff.offer(rows(4, 64, 6), q, scale)  # so the next offer goes ahead


class _Linear(torch.nn.Module):
    def __init__(self, n, k, seed):
        super().__init__()
        self.weight, self.weight_scale = int8_weight(n, k, seed)
        self.quant_method = W8A8LinearMethod()


def test_a_projection_given_the_rows_computes_what_it_computes_without_them():
    """The whole point: the same bits. A handoff whose rows were not those of its tensor would fail here."""
    linear, x = _Linear(48, 300, 6), rows(8, 300, 7)
    alone = linear.quant_method.apply(linear, x.clone())
    q, scale = rms_norm_quant(x, None, torch.zeros(300, dtype=torch.bfloat16, device=DEVICE), EPS, x)
    expected = linear.quant_method.apply(linear, x.clone())
    handoff.offer(x, q, scale)
    assert torch.equal(linear.quant_method.apply(linear, x), expected)
    assert not torch.equal(alone, expected)  # the norm did change x: the rows are not trivially the same
    handoff.offer(x, torch.zeros_like(q), scale)  # rows that are not x's: the projection must read them
    assert not torch.equal(linear.quant_method.apply(linear, x), expected)


def _norm(cls, k, **kwargs):
    """SGLang's module as the model builds it (bf16 weights), with a weight away from its initial ones."""
    norm = cls(k, eps=EPS, **kwargs).to(device=DEVICE, dtype=torch.bfloat16)
    norm.weight.data.copy_(rows(1, k, 8)[0] * 0.1)
    return norm


def _never(*args, **kwargs):
    raise AssertionError("SGLang's kernel ran for a marked module")


@pytest.mark.parametrize("gemma", [True, False], ids=["gemma", "plain"])
def test_a_marked_norm_runs_the_quantizing_kernel_in_place_and_offers_its_rows(gemma):
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    norm, x, residual = _norm(GemmaRMSNorm if gemma else RMSNorm, 300), rows(4, 300, 9), rows(4, 300, 10)
    handoff.mark(norm, READ_TOO, 300)
    x0, r0 = x.clone(), residual.clone()
    out, res = _rms_norm(gemma)(_never, norm, x, residual)
    assert out is x and res is residual  # in place, as SGLang's fused add-norm
    assert within_ulp(out, norm_reference(x0, r0, norm.weight.data, gemma)[0])  # the module's own kind of norm
    q, scale = handoff.take(out)
    assert torch.equal(q.cpu(), quant_reference(out.cpu())[0])
    alone = _rms_norm(gemma)(_never, norm, rows(4, 300, 12))  # the first layer's norm: no residual
    assert handoff.take(alone)[0] is not None


def _gated_norm(head_dim, **kwargs):
    from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm as RMSNormGated

    norm = RMSNormGated(head_dim, eps=EPS, group_size=None, norm_before_gate=True, device=DEVICE,
                        dtype=torch.bfloat16, **kwargs)
    norm.weight.data.copy_(rows(1, head_dim, 19)[0])
    return norm


def test_a_marked_gated_norm_offers_each_tokens_row_as_the_projection_reads_it():
    """As SGLang's Gated-DeltaNet calls it: rows of one head in, the output reshaped to a token's heads for out_proj,
    which must find the rows though it is another view."""
    tokens, heads, head_dim = 3, 4, 32
    norm = _gated_norm(head_dim)
    handoff.mark(norm, READ_TOO, heads * head_dim)
    x, z = rows(tokens * heads, head_dim, 20), rows(tokens * heads, head_dim, 21)
    out = _gated_norm_with_int8_output(_never, norm, x, z)
    assert within_ulp(out, gated_reference(x, z, norm.weight.data), ulps=3)
    projection_input = out.reshape(tokens, heads, head_dim).reshape(tokens, -1)
    q, scale = handoff.take(projection_input)
    assert torch.equal(q.cpu(), quant_reference(projection_input.cpu())[0])
    assert handoff.take(out) == (None, None)  # rows of one head are not what was quantized


def _hooked_producer(producer):
    """(the module's call through its hook, its projection's input from its output, the projection) of SGLang's modules
    as a layer calls them."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    if producer == "norm":
        norm, x, residual = _norm(GemmaRMSNorm, 300), rows(4, 300, 9), rows(4, 300, 10)
        return norm, lambda: _rms_norm(True)(_never, norm, x.clone(), residual.clone())[0], lambda out: out, 300
    if producer == "gated norm":
        norm, x, z = _gated_norm(32), rows(12, 32, 20), rows(12, 32, 21)
        return (norm, lambda: _gated_norm_with_int8_output(_never, norm, x, z), lambda out: out.reshape(3, 4 * 32),
                4 * 32)
    act, x = torch.nn.Module(), rows(4, 2 * 96, 15)
    return act, lambda: _silu_mul_with_int8_output(_never, act, x), lambda out: out, 96


@pytest.mark.parametrize("producer", ["norm", "gated norm", "silu"])
def test_a_producer_read_by_projections_only_hands_them_the_same_rows_and_leaves_its_output_unwritten(
        producer, unwritten_is_nan):
    module, call, projection_input, width = _hooked_producer(producer)
    linear = _Linear(48, width, 6)
    results = []
    for readers in (READ_TOO, INT8_ONLY):
        handoff.mark(module, readers, width)
        out = call()
        results.append((out.clone(), linear.quant_method.apply(linear, projection_input(out))))
    (written, expected), (unwritten, projected) = results
    assert torch.equal(projected, expected) and not written.isnan().any()
    if producer == "norm":  # in place: the output's memory is the input's, as it came
        assert torch.equal(unwritten, rows(4, 300, 9))
    else:
        assert unwritten.isnan().all()


@pytest.mark.parametrize("case", ["unmarked", "no gate", "sigmoid gate", "heads not a power of two"])
def test_a_gated_norm_the_kernel_does_not_cover_keeps_sglangs(case):
    heads = 3 if case == "heads not a power of two" else 4
    norm = _gated_norm(32, **({"activation": "sigmoid"} if case == "sigmoid gate" else {}))
    handoff.mark(norm, [False] if case == "unmarked" else READ_TOO, heads * 32)
    x = rows(2 * heads, 32, 22)
    z = None if case == "no gate" else rows(2 * heads, 32, 23)
    assert _gated_norm_with_int8_output(lambda *a: "sglang", norm, x, z) == "sglang"


def test_an_unmarked_module_keeps_sglangs_kernel():
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    norm, act, x = _norm(GemmaRMSNorm, 300), torch.nn.Module(), rows(4, 300, 13)
    assert runs_w8a8(_Linear(16, 300, 14)) and not runs_w8a8(torch.nn.Linear(300, 16))
    handoff.mark(norm, [False], 300)
    calls = []
    _rms_norm(True)(lambda *a: calls.append("norm") or a[1], norm, x, None)
    _silu_mul_with_int8_output(lambda *a: calls.append("act") or a[1], act, x)
    handoff.mark(norm, READ_TOO, 300)
    _rms_norm(True)(lambda *a: calls.append("norm+") or a[1], norm, x, None, x)  # post-residual addition
    variant = RMSNorm(300, eps=EPS, cast_x_before_out_mul=True)  # a variant SGLang's forward treats apart
    handoff.mark(variant, READ_TOO, 300)
    _rms_norm(False)(lambda *a: calls.append("variant") or a[1], variant, x, None)
    assert calls == ["norm", "act", "norm+", "variant"]


def test_the_gate_offers_its_rows_only_inside_a_marked_attention_layer():
    attn, gate = rows(3, 128, 26), rows(3, 128, 27)
    sglang = lambda attn_output, gate, inplace=False: "sglang"
    layer = torch.nn.Module()
    layer.self_attention = lambda: _gate_with_int8_output(_never, attn, gate, inplace=True)
    assert _gate_with_int8_output(sglang, attn, gate, inplace=True) == "sglang"  # outside any attention layer
    handoff.mark(layer, [False], 128)
    assert _name_the_gated_layer(lambda self: _gate_with_int8_output(sglang, attn, gate, inplace=True), layer) == "sglang"
    handoff.mark(layer, READ_TOO, 128)
    assert _name_the_gated_layer(lambda self: _gate_with_int8_output(sglang, attn, gate), layer) == "sglang"  # a copy
    out = _name_the_gated_layer(lambda self: self.self_attention(), layer)
    assert out is attn and torch.equal(handoff.take(out)[0].cpu(), quant_reference(out.cpu())[0])
    assert _gate_with_int8_output(sglang, attn, gate, inplace=True) == "sglang"  # the layer's call is over


def test_a_marked_activation_offers_its_rows():
    act, x = torch.nn.Module(), rows(3, 2 * 96, 15)
    handoff.mark(act, READ_TOO, 96)
    out = _silu_mul_with_int8_output(_never, act, x)
    assert out.shape == (3, 96) and handoff.take(out)[0] is not None


def _module(**children):
    module = torch.nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def test_each_layers_producers_of_w8a8_input_are_marked_with_their_projections_row_width():
    """The names of SGLang's layers: a target's Gated-DeltaNet layer, the same with a plain bf16 in_proj_ba (its input
    norm must write its output for it), a DFlash drafter layer, and one whose QKV is a plain bf16 linear (so its input
    norm keeps SGLang's kernel)."""
    from qflash.server.models.qwen3_5_text import mark_int8_handoffs

    def w8a8(n, k, row_parallel=False):
        linear = _Linear(n, k, 0)
        linear.input_size = k * (2 if row_parallel else 1)  # as a row-parallel linear's whole input on 2 ranks
        if row_parallel:
            linear.input_size_per_partition = k
        return linear

    def plain(n, k, method=None):
        linear = torch.nn.Linear(k, n)
        linear.input_size, linear.quant_method = k, method
        return linear

    def mlp():
        return _module(gate_up_proj=w8a8(192, 64), act_fn=torch.nn.Module(), down_proj=w8a8(64, 96))

    gdn, gdn_plain_ba = (_module(input_layernorm=torch.nn.Module(), post_attention_layernorm=torch.nn.Module(),
                                 linear_attn=_module(in_proj_qkvz=w8a8(96, 64), in_proj_ba=ba, norm=torch.nn.Module(),
                                                     out_proj=w8a8(64, 128, row_parallel=True)), mlp=mlp())
                         for ba in (w8a8(8, 64), plain(8, 64)))
    drafter, plain_qkv = (_module(input_layernorm=torch.nn.Module(), post_attention_layernorm=torch.nn.Module(),
                                  self_attn=_module(qkv_proj=plain(96, 64, method)), mlp=mlp())
                          for method in (DrafterQKVMethod(), None))
    attention = _module(input_layernorm=torch.nn.Module(), post_attention_layernorm=torch.nn.Module(),
                        qkv_proj=w8a8(160, 64), o_proj=w8a8(64, 128, row_parallel=True), mlp=mlp())
    assert mark_int8_handoffs([gdn, gdn_plain_ba, drafter, plain_qkv, attention]) == 4 + 4 + 3 + 2 + 4
    layers = (("gdn", gdn), ("gdn_plain_ba", gdn_plain_ba), ("drafter", drafter), ("plain_qkv", plain_qkv),
              ("attention", attention))
    marks = {(layer, name): tuple(getattr(module, attr) for attr in (handoff.MARK, handoff.ONLY, handoff.ROW_WIDTH))
             for layer, model in layers for name, module in model.named_modules() if hasattr(module, handoff.MARK)}
    only, none = (True, True), (False, False)  # (int8 rows, only those)
    layer_norms_and_mlp = lambda layer, input_norm: {
        (layer, "input_layernorm"): (*input_norm, 64), (layer, "post_attention_layernorm"): (*only, 64),
        (layer, "mlp.act_fn"): (*only, 96)}
    assert marks == {("gdn", ""): (*none, 0), ("gdn", "linear_attn.norm"): (*only, 128),
                     ("gdn_plain_ba", ""): (*none, 0), ("gdn_plain_ba", "linear_attn.norm"): (*only, 128),
                     ("drafter", ""): (*none, 0), ("plain_qkv", ""): (*none, 0), ("attention", ""): (*only, 128),
                     **layer_norms_and_mlp("gdn", only), **layer_norms_and_mlp("gdn_plain_ba", (True, False)),
                     **layer_norms_and_mlp("drafter", only), **layer_norms_and_mlp("plain_qkv", none),
                     **layer_norms_and_mlp("attention", only)}
