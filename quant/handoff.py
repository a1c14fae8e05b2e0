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

Where W8A8 projections are all that read a producer's output (`only_int8_read`), the kernel writes only the int8
rows: the output itself is never read, and a prefill's norms and activations spend a fifth to a third of their
bytes writing it (BENCHMARKS.md, 2026-12-07). Such an output must then be taken before the next offer, and no
projection may find its memory under another shape: either would mean a reader of bits never written, so both
raise.
"""

from typing import Optional, Sequence

import torch

MARK = "qflash_int8_output"  # set on a producer module whose output feeds a W8A8 projection
ONLY = "qflash_int8_only"  # and set where W8A8 projections are all that read that output
ROW_WIDTH = "qflash_int8_row_width"  # and the width of that projection's input rows
_offered: Optional[tuple] = None  # (output, its version, int8 rows, scales)
_untaken: Optional[torch.Tensor] = None  # an offered output left unwritten that no projection has taken yet


def mark(producer: torch.nn.Module, readers_w8a8: Sequence[bool], row_width: int) -> bool:
    """Have `producer` write int8 rows of its output where one of its readers (whether each is a W8A8 projection)
    is a W8A8 projection whose input rows are `row_width` wide, and only those rows where all are."""
    feeds_w8a8 = any(readers_w8a8)
    setattr(producer, MARK, feeds_w8a8)
    setattr(producer, ONLY, feeds_w8a8 and all(readers_w8a8))
    setattr(producer, ROW_WIDTH, row_width)
    return feeds_w8a8


def wanted(producer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `producer`, called on rows x, should write int8 rows (marked, 2-D rows of unit stride, not traced)."""
    return getattr(producer, MARK, False) and x.dim() == 2 and x.stride(-1) == 1 and not torch.compiler.is_compiling()


def only_int8_read(producer: torch.nn.Module) -> bool:
    """Whether W8A8 projections are all that read `producer`'s output, so its kernel may leave it unwritten."""
    return getattr(producer, ONLY, False)


def offer(output: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, written: bool = True) -> None:
    global _offered, _untaken
    if _untaken is not None:
        raise RuntimeError(f"qflash: no W8A8 projection took the int8 rows of a {tuple(_untaken.shape)} output "
                           "left unwritten for them; whatever read it instead read unwritten memory")
    _offered = (output, output._version, x_q, x_scale)
    _untaken = None if written else output


def take(x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(int8 rows, scales) of x if its producer offered them and x is unchanged since; else (None, None)."""
    global _untaken
    if _offered is None or torch.compiler.is_compiling():  # traced tensors have no memory to compare
        return None, None
    output, version, x_q, x_scale = _offered
    same = (x.data_ptr() == output.data_ptr() and x.shape == output.shape and x.stride() == output.stride()
            and x._version == version)
    if same:
        _untaken = None
        return x_q, x_scale
    if _untaken is not None and x.data_ptr() == _untaken.data_ptr():
        raise RuntimeError(f"qflash: a W8A8 projection read {tuple(x.shape)} rows of an output offered as "
                           f"{tuple(output.shape)} and left unwritten")
    return None, None
