"""DFlash's taps of the target written by the norm that computes them, into the buffer the drafter reads.

SGLang 0.5.17's Qwen3.5 gathers the residual entering each tapped layer (8 for Qwen3.5-4B's DFlash) in a list: the
layer communicator clones each one (a copy launch) and the logits processor concatenates them (one more) into the
[tokens, taps x hidden] tensor the drafter reads. Here the tapped layer's input norm, qflash's kernel
(kernels/norm_quant.py), which computes that residual, also stores it in the tap's columns of one buffer, and the
concatenation of those columns in order is the buffer itself: 9 launches a forward fewer. The communicator is
handed SGLang's own accumulator interface (`copies_on_append`, as its AuxHiddenStatePacker), which copies the
residual itself where the norm did not store it (a norm SGLang runs). Serves one GPU (no tensor-parallel gather
between the norm and the tap). Retire when SGLang's Qwen3.5 collects its taps in an AuxHiddenStatePacker (as its
DeepSeek-V2 does) and a norm can write into it.
"""

from typing import Optional

import torch

from qflash.server.hooks import Hook

TAP = "qflash_dflash_tap"  # on a tapped layer's communicator: (its place among the taps, how many there are)
_buffer: Optional[torch.Tensor] = None  # this forward's [tokens, taps x hidden] buffer
_pending: Optional[tuple] = None  # (the norm that stores the residual, the columns it stores it in) until it does


def mark(layers, tapped: list[int]) -> None:
    """Tell each tapped layer's communicator its place among the taps (ascending: the order the layers run in)."""
    ordered = sorted(tapped)
    for place, index in enumerate(ordered):
        setattr(layers[index].layer_communicator, TAP, (place, len(ordered)))


def take(norm: torch.nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The columns `norm`, about to run qflash's kernel on rows x, also stores the residual sum in (once), if any."""
    global _pending
    if _pending is None or _pending[0] is not norm or _pending[1].shape != x.shape or _pending[1].dtype != x.dtype:
        return None
    columns, _pending = _pending[1], None
    return columns


class _Tap:
    """What one tapped layer's communicator appends its residual to."""

    copies_on_append = True  # SGLang then hands over the residual itself, not a clone of it

    def __init__(self, taps: list, columns: torch.Tensor):
        self.taps, self.columns = taps, columns

    def append(self, residual: torch.Tensor) -> None:
        global _pending
        if _pending is not None:  # the norm did not store it
            self.columns.copy_(residual)
            _pending = None
        self.taps.append(self.columns)


def _tap_in_place(original, self, hidden_states, residual, forward_batch, captured_last_layer_outputs=None,
                  **kwargs):
    global _buffer, _pending
    tap, taps = getattr(self, TAP, None), captured_last_layer_outputs
    if tap is None or type(taps) is not list or residual is None or hidden_states.dim() != 2 or not len(hidden_states):
        return original(self, hidden_states, residual, forward_batch, captured_last_layer_outputs=taps, **kwargs)
    (place, count), (rows, width) = tap, hidden_states.shape
    if place == 0:
        _buffer = hidden_states.new_empty((rows, count * width))
    if (len(taps) != place or _buffer is None or _buffer.shape != (rows, count * width)
            or _buffer.dtype != residual.dtype):
        return original(self, hidden_states, residual, forward_batch, captured_last_layer_outputs=taps, **kwargs)
    columns = _buffer[:, place * width:(place + 1) * width]
    _pending = (self.input_layernorm, columns)
    try:
        return original(self, hidden_states, residual, forward_batch, captured_last_layer_outputs=_Tap(taps, columns),
                        **kwargs)
    finally:
        _pending = None
        if place == count - 1:  # the taps hold the buffer now; a long prompt's next forward need not wait for it
            _buffer = None


def _columns_of_one_buffer(taps: list) -> Optional[torch.Tensor]:
    """The buffer whose columns, in order, the taps are (so their concatenation is the buffer), else None."""
    base = taps[0]._base
    if base is None or base.dim() != 2 or not base.is_contiguous():
        return None
    rows, width = base.shape[0], taps[0].shape[-1]
    in_order = all(t._base is base and t.shape == (rows, width) and t.stride() == base.stride()
                   and t.storage_offset() == base.storage_offset() + i * width for i, t in enumerate(taps))
    return base if in_order and base.shape[1] == width * len(taps) else None


def _packed(original, aux_hidden_states):
    if isinstance(aux_hidden_states, list) and aux_hidden_states:
        buffer = _columns_of_one_buffer(aux_hidden_states)
        if buffer is not None:
            return buffer
    return original(aux_hidden_states)


CHANGES = [
    Hook("sglang.srt.layers.communicator.LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
         _tap_in_place, "AROUND"),
    Hook("sglang.srt.layers.logits_processor.pack_aux_hidden_states", _packed, "AROUND"),
]
