"""DFlash's taps stored by the tapped layer's input norm into one buffer, which stands for SGLang's concatenation
(CPU: Triton's interpreter; SGLang's own communicator method and packer around a stand-in communicator)."""

import pytest
import torch

from qflash.kernels.norm_quant import rms_norm_quant
from qflash.quant import handoff
from qflash.server.hooks import dflash_taps
from qflash.server.hooks.quant_handoff import _rms_norm
from test_kernels import DEVICE
from test_quant_handoff import EPS, _norm, rows

TOKENS, WIDTH, TAPS = 5, 300, 3


def test_the_norm_stores_the_residual_sum_in_the_tap_columns_and_nothing_else():
    x, residual, weight = rows(TOKENS, WIDTH, 1), rows(TOKENS, WIDTH, 2), rows(1, WIDTH, 3)[0] * 0.1
    buffer = torch.full((TOKENS, TAPS * WIDTH), 7.0, dtype=torch.bfloat16, device=DEVICE)
    expected_x, expected_res = x.clone(), residual.clone()
    rms_norm_quant(expected_x, expected_res, weight, EPS, expected_x)
    rms_norm_quant(x, residual, weight, EPS, x, tap=buffer[:, WIDTH:2 * WIDTH])
    assert torch.equal(residual, expected_res) and torch.equal(x, expected_x)
    assert torch.equal(buffer[:, WIDTH:2 * WIDTH], residual)  # the residual's bits
    assert (buffer[:, :WIDTH] == 7).all() and (buffer[:, 2 * WIDTH:] == 7).all()


class _Communicator:
    """What SGLang's `prepare_attn_and_capture_last_layer_outputs` uses of its LayerCommunicator at one GPU."""

    def __init__(self, norm, place):
        self.input_layernorm, self._context = norm, None
        setattr(self, dflash_taps.TAP, (place, TAPS))

    def prepare_attn(self, hidden_states, residual, forward_batch, **kwargs):
        return self.input_layernorm(hidden_states, residual)

    def _communicate_simple_fn(self, hidden_states, forward_batch, context):
        return hidden_states

    def _post_attn_residual_is_read_only(self, residual):
        return False


def _layers(qflash_norm: bool):
    """TAPS tapped layers' communicators whose input norm runs through qflash's hook (marked) or SGLang's kernel."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    communicators = []
    for place in range(TAPS):
        norm = _norm(GemmaRMSNorm, WIDTH)
        handoff.mark(norm, [qflash_norm, False], WIDTH)  # `_forward` reads the norm's output too
        norm.forward = (lambda n: lambda x, r=None: _rms_norm(True)(type(n).forward_native, n, x, r))(norm)
        communicators.append(_Communicator(norm, place))
    return communicators


def _forward(communicators, hooked: bool):
    """The taps of a forward through the tapped layers (SGLang's method, with the hook or without), packed."""
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.layers.communicator import LayerCommunicator

    capture = LayerCommunicator.prepare_attn_and_capture_last_layer_outputs
    taps, hidden, residual = [], rows(TOKENS, WIDTH, 40), rows(TOKENS, WIDTH, 41)
    for i, communicator in enumerate(communicators):
        args = (communicator, hidden, residual, None)
        hidden, residual = (dflash_taps._tap_in_place(capture, *args, captured_last_layer_outputs=taps) if hooked
                            else capture(*args, captured_last_layer_outputs=taps))
        hidden = hidden + rows(TOKENS, WIDTH, 50 + i)  # the layer's own work, then the next layer's input
        residual.add_(rows(TOKENS, WIDTH, 60 + i))  # the post-attention norm's add, in place
    return taps, (dflash_taps._packed(pack_aux_hidden_states, taps) if hooked else pack_aux_hidden_states(taps))


class _CountingTap(dflash_taps._Tap):
    copies = 0

    def append(self, residual):
        _CountingTap.copies += dflash_taps._pending is not None
        super().append(residual)


@pytest.mark.parametrize("qflash_norm", [True, False], ids=["qflash-norm", "sglang-norm"])
def test_the_taps_are_sglangs_bits_in_one_buffer_without_copies_where_the_norm_is_qflashs(qflash_norm, monkeypatch):
    monkeypatch.setattr(dflash_taps, "_Tap", _CountingTap)
    _CountingTap.copies = 0
    expected_taps, expected = _forward(_layers(qflash_norm), hooked=False)
    taps, packed = _forward(_layers(qflash_norm), hooked=True)
    assert len(expected_taps) == len(taps) == TAPS and expected.shape == (TOKENS, TAPS * WIDTH)
    assert torch.equal(packed, expected)  # each tap the residual as it entered its layer, not as later layers left it
    assert packed is taps[0]._base  # the concatenation is the buffer itself: no copy
    assert _CountingTap.copies == (0 if qflash_norm else TAPS)  # SGLang's norm: the accumulator copies
    assert dflash_taps._pending is None and dflash_taps._buffer is None


def test_a_forward_that_does_not_reach_a_tap_in_order_keeps_sglangs_clones():
    communicators = _layers(True)
    setattr(communicators[1], dflash_taps.TAP, (2, TAPS))  # places that do not match the list
    expected_taps, expected = _forward(_layers(True), hooked=False)
    taps, packed = _forward(communicators, hooked=True)
    assert torch.equal(packed, expected) and taps[1]._base is None and packed._base is None


@pytest.mark.parametrize("case", ["out of order", "a gap", "not views", "one of two buffers"])
def test_only_the_columns_of_one_buffer_in_order_stand_for_their_concatenation(case):
    buffer = rows(TOKENS, TAPS * WIDTH, 70)
    columns = [buffer[:, i * WIDTH:(i + 1) * WIDTH] for i in range(TAPS)]
    taps = {"out of order": [columns[1], columns[0], columns[2]], "a gap": columns[:2] + [columns[2][:, 1:]],
            "not views": [c.clone() for c in columns],
            "one of two buffers": columns[:2] + [buffer.clone()[:, 2 * WIDTH:]]}[case]
    assert dflash_taps._columns_of_one_buffer(columns) is buffer
    assert dflash_taps._columns_of_one_buffer(taps) is None
    assert dflash_taps._columns_of_one_buffer(columns[:2]) is None  # two of three columns: not the whole buffer


def test_tapped_layers_learn_their_place_in_the_order_they_run():
    layers = [torch.nn.Module() for _ in range(8)]
    for layer in layers:
        layer.layer_communicator = torch.nn.Module()
    dflash_taps.mark(layers, [6, 2, 4])
    places = {i: getattr(layer.layer_communicator, dflash_taps.TAP, None) for i, layer in enumerate(layers)}
    assert places == {0: None, 1: None, 2: (0, 3), 3: None, 4: (1, 3), 5: None, 6: (2, 3), 7: None}
