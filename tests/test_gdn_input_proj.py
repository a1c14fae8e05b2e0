"""A Gated-DeltaNet layer's in_proj_qkvz and in_proj_ba as one GEMM (server/hooks/gdn_input_proj.py), against SGLang's
two GEMMs and its split kernel, and in a verify with the conv update in its epilogue, against the GEMM and then
qflash's conv kernel (CPU: Triton's interpreter; small heads of the real layout)."""

from types import SimpleNamespace

import pytest
import torch
from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkvzba_split_reshape_cat_contiguous
from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

from qflash.kernels import conv_update
from qflash.quant import handoff
from qflash.quant.method import W8A8LinearMethod
from qflash.server.hooks import gdn_input_proj, gdn_verify
from test_kernels import DEVICE, int8_weight

K_HEADS, V_HEADS, HEAD, HIDDEN = 2, 4, 8, 64  # Qwen3.5-4B: 16, 32, 128, 2560
KEY, VALUE = K_HEADS * HEAD, V_HEADS * HEAD


class _Linear(torch.nn.Module):
    """An int8 linear as SGLang's W8A8 method creates it: weight [N, K], scales [N, 1]."""

    def __init__(self, n, seed):
        super().__init__()
        weight, scale = int8_weight(n, HIDDEN, seed)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale[:, None], requires_grad=False)
        self.bias = None
        self.quant_method = W8A8LinearMethod()


def gdn_layer(seed=0, tp=1):
    """A decoder layer whose `linear_attn` has the attributes SGLang's Qwen3_5GatedDeltaNet gives it."""
    gdn = torch.nn.Module()
    gdn.in_proj_qkvz, gdn.in_proj_ba = _Linear(2 * KEY + 2 * VALUE, seed), _Linear(2 * V_HEADS, seed + 1)
    gdn.attn_tp_size, gdn.num_k_heads, gdn.num_v_heads, gdn.layer_id = tp, K_HEADS, V_HEADS, 0
    gdn.conv_dim, gdn.value_dim = 2 * KEY + VALUE, VALUE
    layer = torch.nn.Module()
    layer.linear_attn = gdn
    return layer


def load(gdn, seed):
    """What SGLang's loader and qflash's method do: copy the checkpoint into the parameters, then process them."""
    for linear, s in ((gdn.in_proj_qkvz, seed), (gdn.in_proj_ba, seed + 1)):
        weight, scale = int8_weight(*linear.weight.shape, s)
        linear.weight.data.copy_(weight)
        linear.weight_scale.data.copy_(scale[:, None])
        linear.quant_method.process_weights_after_loading(linear)


def sglang_path(gdn, x):
    qkvz = gdn.in_proj_qkvz.quant_method.apply(gdn.in_proj_qkvz, x)
    ba = gdn.in_proj_ba.quant_method.apply(gdn.in_proj_ba, x)
    return fused_qkvzba_split_reshape_cat_contiguous(qkvz, ba, K_HEADS, V_HEADS, HEAD, HEAD)


def merged_path(gdn, x):
    def never(*args):
        raise AssertionError("SGLang's path ran for a merged layer")

    projected = gdn_input_proj._one_gemm(never, gdn, x)
    return gdn_input_proj._split(never, *projected, K_HEADS, V_HEADS, HEAD, HEAD)


def rows(m, seed):
    return torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("m", [5, 16])
def test_one_gemm_gives_sglangs_qkv_z_b_a_bit_for_bit(m):
    layer = gdn_layer()
    assert gdn_input_proj.merge([layer]) == 1
    gdn = layer.linear_attn
    load(gdn, seed=3)  # after the merge, as SGLang builds the model first
    x = rows(m, 4)
    expected, got = sglang_path(gdn, x), merged_path(gdn, x)
    assert [t.shape for t in got] == [t.shape for t in expected] == [(m, 2 * KEY + VALUE), (m, V_HEADS, HEAD),
                                                                       (m, V_HEADS), (m, V_HEADS)]
    assert all(t.is_contiguous() for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_one_gemm_reads_the_int8_rows_its_norm_handed_off(monkeypatch):
    layer = gdn_layer()
    gdn_input_proj.merge([layer])
    gdn = layer.linear_attn
    load(gdn, seed=5)
    x = rows(16, 6)
    expected = merged_path(gdn, x)
    monkeypatch.setattr(handoff, "_offered", None)  # put back after the test
    handoff.offer(x, torch.zeros(16, HIDDEN, dtype=torch.int8, device=DEVICE), torch.ones(16, device=DEVICE))
    # rows that are not x's: the GEMM must read them, so every output is zero
    assert all(not t.any() for t in merged_path(gdn, x)) and all(t.any() for t in expected)


def test_a_loader_that_replaced_the_parameters_stops_the_layer():
    """Else the merged weight, never loaded, would serve wrong tokens without a word."""
    layer = gdn_layer()
    gdn_input_proj.merge([layer])
    gdn = layer.linear_attn
    gdn.in_proj_ba.weight = torch.nn.Parameter(gdn.in_proj_ba.weight.data.clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match="no longer view their merged weight"):
        merged_path(gdn, rows(16, 7))


@pytest.mark.parametrize("case", ["bf16 ba", "two ranks", "no GDN"])
def test_layers_the_merge_does_not_cover_keep_sglangs_path(case):
    layer = gdn_layer(tp=2 if case == "two ranks" else 1)
    if case == "bf16 ba":
        layer.linear_attn.in_proj_ba = torch.nn.Linear(HIDDEN, 2 * V_HEADS, bias=False)
    if case == "no GDN":
        del layer.linear_attn
        layer.self_attn = torch.nn.Module()
    assert gdn_input_proj.merge([layer]) == 0
    if case != "no GDN":
        x = rows(4, 8)
        assert gdn_input_proj._one_gemm(lambda self, h: ("sglang", h), layer.linear_attn, x) == ("sglang", x)
        assert gdn_input_proj._split(lambda *args: "sglang", "qkvz", "ba", K_HEADS, V_HEADS, HEAD, HEAD) == "sglang"


T = 16  # DFLASH's block: a verify's tokens a request
CONV_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter computes bf16 arithmetic wrongly


class _ForwardBatch:
    """What `_verify_window` reads of SGLang's ForwardBatch."""

    def __init__(self, verify: bool):
        self.forward_mode = SimpleNamespace(is_target_verify=lambda: verify)
        self.spec_info = SimpleNamespace(draft_token_num=T)


def conv_inputs(batch: int, seed: int):
    """A verify's conv update arguments after x: states, weights, bias, and the slots and windows (the last of several
    requests is padding)."""
    g = torch.Generator().manual_seed(seed)
    dim = 2 * KEY + VALUE
    states = torch.randn(2 * batch + 2, dim, 3, generator=g).to(CONV_DTYPE).to(DEVICE)
    weight, bias = (torch.randn(*shape, generator=g).to(CONV_DTYPE).to(DEVICE) for shape in ((dim, 4), (dim,)))
    slots = torch.arange(1, 2 * batch + 1, 2, dtype=torch.int32, device=DEVICE)
    slots[-1] = -1 if batch > 1 else slots[-1]
    windows = torch.zeros(batch + 1, T, dim, 3, dtype=CONV_DTYPE, device=DEVICE)
    kwargs = dict(conv_state_indices=slots, intermediate_conv_window=windows,
                  intermediate_state_indices=torch.arange(batch, dtype=torch.int32, device=DEVICE).flip(0))
    return (states, weight, bias, "silu"), kwargs


def sglang_order(conv_call, calls_conv=True):
    """Qwen3_5GatedDeltaNet.forward in a verify, as far as the conv: the input projections, the split, then the conv
    update of q|k|v (gdn_backend's target verify, the first reader of the projections)."""
    def forward(self, hidden_states, forward_batch):
        qkv, z, b, a = merged_path(self, hidden_states)
        if calls_conv:
            qkv = conv_call(qkv.view(-1, T, qkv.shape[1]).transpose(1, 2)).transpose(1, 2).reshape(qkv.shape)
        return [t.clone() for t in (qkv, z, b, a)]
    return forward


def verify_layer(batch, seed, verify, conv=gdn_verify._conv_update_on_qflash, original=causal_conv1d_update):
    """(q|k|v after the conv, z, b, a, conv states, windows) of one merged layer's verify."""
    layer = gdn_layer()
    gdn_input_proj.merge([layer])
    gdn = layer.linear_attn
    load(gdn, seed)
    args, kwargs = conv_inputs(batch, seed + 1)
    out = gdn_input_proj._verify_window(sglang_order(lambda x: conv(original, x, *args, **kwargs)), gdn,
                                        rows(batch * T, seed + 2).to(CONV_DTYPE), _ForwardBatch(verify))
    return [*out, args[0], kwargs["intermediate_conv_window"]]


@pytest.mark.parametrize("batch", [1, 3])
def test_a_verify_runs_the_conv_in_the_input_gemms_epilogue(batch, monkeypatch):
    """Outputs, conv states and windows as the GEMM and then qflash's conv kernel give them (a request's rows that
    the conv reads from a neighbour's or from the wrong state would differ)."""
    expected = verify_layer(batch, 9, verify=False)
    monkeypatch.setattr(conv_update, "conv_update", None)  # the separate launch must not run
    got = verify_layer(batch, 9, verify=True)
    live = slice(0, max(batch - 1, 1) * T)  # the padding request's rows are the raw GEMM's, the kernel's are unwritten
    assert torch.equal(got[0][live], expected[0][live])
    assert all(torch.equal(a, b) for a, b in zip(got[1:], expected[1:]))
    assert not torch.equal(got[4], conv_inputs(batch, 10)[0][0])  # the states moved


def test_a_conv_call_qflash_does_not_take_gets_the_gemms_output_first():
    seen = []
    expected = verify_layer(2, 11, verify=False, conv=lambda original, x, *a, **k: x)
    got = verify_layer(2, 11, verify=True, original=lambda x, *a, **k: seen.append(x.clone()) or x,
                       conv=lambda original, x, *a, **k: gdn_verify._conv_update_on_qflash(
                           original, x, *a, **k, retrieve_next_token=torch.zeros(1)))
    assert torch.equal(seen[0].transpose(1, 2).reshape(2 * T, -1), expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4]))


def test_a_verify_layer_whose_conv_call_never_comes_stops():
    layer = gdn_layer()
    gdn_input_proj.merge([layer])
    load(layer.linear_attn, 12)
    with pytest.raises(RuntimeError, match="never came"):
        gdn_input_proj._verify_window(sglang_order(None, calls_conv=False), layer.linear_attn, rows(T, 13),
                                      _ForwardBatch(True))


def test_a_verify_whose_gemm_config_cannot_hold_the_conv_runs_them_apart(monkeypatch):
    """A split-K config (partial sums in its tiles) gets the GEMM at once and qflash's conv kernel after it."""
    expected = verify_layer(2, 14, verify=False)
    table_config = gdn_input_proj.w8a8_gemm.table_config
    monkeypatch.setattr(gdn_input_proj.w8a8_gemm, "table_config", lambda *key: {**table_config(*key), "SPLIT_K": 2})
    separate = []
    run = conv_update.conv_update
    monkeypatch.setattr(conv_update, "conv_update", lambda *a, **k: separate.append(1) or run(*a, **k))
    got = verify_layer(2, 14, verify=True)
    assert separate == [1] and gdn_input_proj._Verify.gemm is None
    assert torch.equal(got[0][:T], expected[0][:T])  # the padding request's rows: the kernel's, unwritten
    assert all(torch.equal(a, b) for a, b in zip(got[1:], expected[1:]))
