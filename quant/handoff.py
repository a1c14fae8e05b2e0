"""int8 activations handed from the kernel that writes a W8A8 projection's input to the projection itself.

A norm or SiLU-and-multiply marked as feeding qflash's W8A8 projections (`mark`) runs a qflash kernel that
also writes the int8 rows and per-token scales of its output (kernels/norm_quant.py, kernels/silu_mul_quant.py,
kernels/gated_norm_quant.py; server/hooks/quant_handoff.py routes SGLang's layers there) and offers them here
with that output, as the projection will see it (a token's row: the gated norm works on rows of one head). A
projection whose input is that tensor, unchanged since (the same memory, shape and strides at the same version
counter, which views share), reads them instead of quantizing it again: the bits are the same, one launch fewer.
Any other input is quantized as before. Holding the offered tensor keeps its memory from being reused meanwhile.
One slot: a producer's output is read by the projections right after it (two, on two streams, for a
Gated-DeltaNet layer's input) before the next producer runs.
"""

from typing import Optional

import torch

MARK = "qflash_int8_output"  # set on a producer module whose output feeds a W8A8 projection
ROW_WIDTH = "qflash_int8_row_width"  # and the width of that projection's input rows
_offered: Optional[tuple] = None  # (output, its version, int8 rows, scales)


def mark(producer: torch.nn.Module, feeds_w8a8: bool, row_width: int) -> bool:
    """Have `producer` write int8 rows of its output, where that output feeds a W8A8 projection whose input rows
    are `row_width` wide."""
    setattr(producer, MARK, feeds_w8a8)
    setattr(producer, ROW_WIDTH, row_width)
    return feeds_w8a8


def wanted(producer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `producer`, called on rows x, should write int8 rows (marked, 2-D rows of unit stride, not traced)."""
    return getattr(producer, MARK, False) and x.dim() == 2 and x.stride(-1) == 1 and not torch.compiler.is_compiling()


def offer(output: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor) -> None:
    global _offered
    _offered = (output, output._version, x_q, x_scale)


def take(x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(int8 rows, scales) of x if its producer offered them and x is unchanged since; else (None, None)."""
    if _offered is None or torch.compiler.is_compiling():  # traced tensors have no memory to compare
        return None, None
    output, version, x_q, x_scale = _offered
    same = (x.data_ptr() == output.data_ptr() and x.shape == output.shape and x.stride() == output.stride()
            and x._version == version)
    return (x_q, x_scale) if same else (None, None)
