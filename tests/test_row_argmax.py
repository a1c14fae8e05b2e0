"""The verify's greedy pick on qflash's row argmax (kernels/row_argmax.py), which the cycle graph's dispatch mode
(server/hooks/cycle_graphs.py `VocabArgmax`) routes torch.argmax over a vocabulary's fp32 logits to: torch's
indices, ties and all. CPU: Triton's interpreter."""

import pytest
import torch

from qflash.kernels import row_argmax
from qflash.server.hooks import cycle_graphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logits(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("rows, width", [(16, 20000), (3, 8192), (1, 8193), (5, 100), (0, 300)])
def test_the_indices_are_torchs(rows, width):
    x = logits(rows, width)
    assert torch.equal(row_argmax.argmax(x), torch.argmax(x, dim=-1))


def test_ties_go_to_the_first_within_a_slice_and_across_slices():
    x = logits(4, 3 * row_argmax.CONFIG["BLOCK_N"])
    x[0, [5, 9]] = 50.0  # within one slice
    x[1, [9000, 20000, 100]] = 50.0  # across slices
    x[2] = 7.0  # all equal
    x[3] = float("-inf")
    assert row_argmax.argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [5, 100, 0, 0]


def test_a_nan_is_the_maximum_as_torch_takes_it():
    x = logits(2, 10000)
    x[0, 7000] = float("nan")
    x[1, 3] = 1e30
    assert row_argmax.argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [7000, 3]


def test_a_strided_row_start():
    x = logits(3, 70000)[:, :65536]
    assert torch.equal(row_argmax.argmax(x), torch.argmax(x, dim=-1))


def test_the_dispatch_mode_takes_only_a_pick_over_a_vocabulary(monkeypatch):
    calls = []
    ours = row_argmax.argmax
    monkeypatch.setattr(row_argmax, "argmax", lambda x: calls.append(x.shape) or ours(x))
    wide = logits(16, cycle_graphs.VOCAB_WIDE)
    with cycle_graphs.VocabArgmax():
        picked = torch.argmax(wide, dim=-1).view(1, 16)  # as SGLang's verify calls it
        also = wide.argmax(1)
        # anything else stays torch's: another dim, keepdim, a narrow row, another dtype, a vector, an out tensor
        others = [torch.argmax(wide, dim=0), torch.argmax(wide, dim=-1, keepdim=True), torch.argmax(wide[:, :100], -1),
                  torch.argmax(wide.to(torch.bfloat16), -1), torch.argmax(wide[0]), torch.argmax(wide)]
        out = torch.empty(16, dtype=torch.int64, device=DEVICE)
        torch.argmax(wide, dim=-1, out=out)
    assert calls == [(16, cycle_graphs.VOCAB_WIDE)] * 2
    assert torch.equal(picked.view(-1), torch.argmax(wide, dim=-1)) and torch.equal(also, picked.view(-1))
    assert torch.equal(others[0], torch.argmax(wide, dim=0)) and others[1].shape == (16, 1)
    assert torch.equal(out, picked.view(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_verify_pick_is_two_launches_without_a_memset_gpu():
    x = logits(16, 248320)
    x[3, 100000] = float("nan")  # the GPU's max instruction drops a NaN: the kernel must not
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with cycle_graphs.VocabArgmax():
            picked = torch.argmax(x, dim=-1)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_row_argmax_tile_kernel", "_argmax_pick_kernel"], kernels
    assert torch.equal(picked, torch.argmax(x, dim=-1))
