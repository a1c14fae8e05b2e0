"""Token embeddings on qflash's kernel (kernels/embedding.py), routed by server/hooks/embedding.py from SGLang's
`UnquantizedEmbeddingMethod.embedding`: the rows torch's embedding gives, bit for bit. CPU: Triton's interpreter."""

import pytest
import torch

from qflash.kernels.embedding import embedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def table(vocab: int, width: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape, width", [((16,), 2560), ((3, 16), 2560), ((5,), 1000), ((0,), 64), ((2, 7), 3000)])
def test_the_rows_are_torchs(shape, width):
    """A decode block, a draft's [requests, block] ids, widths not a multiple of the slice, an empty batch."""
    t = table(300, width)
    ids = torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for dtype in (torch.int64, torch.int32):
        assert torch.equal(embedding(ids.to(dtype), t), torch.nn.functional.embedding(ids, t))


def test_a_row_of_a_strided_table_and_fp32():
    t = table(50, 128, torch.float32)
    wide = torch.zeros(50, 256, device=DEVICE)
    wide[:, :128] = t
    ids = torch.tensor([49, 0, 7, 7], device=DEVICE)
    assert torch.equal(embedding(ids, wide[:, :128]), t[ids])


def test_an_id_outside_the_table_gives_zeros_not_a_read_past_it():
    t = table(10, 64)
    rows = embedding(torch.tensor([3, -1, 10, 9], device=DEVICE), t)
    assert torch.equal(rows[0], t[3]) and torch.equal(rows[3], t[9]) and not rows[1:3].any()


def test_the_hook_leaves_cpu_tensors_to_torch():
    from types import SimpleNamespace

    from qflash.server.hooks.embedding import _rows_in_one_launch

    layer, ids = SimpleNamespace(weight=table(20, 32).cpu()), torch.tensor([1, 2])
    assert _rows_in_one_launch(lambda self, layer, ids: "torch's", None, layer, ids) == "torch's"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sglangs_embedding_runs_one_launch_of_qflashs_kernel_gpu():
    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    from qflash.server.hooks.embedding import _rows_in_one_launch

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(table(248320, 2560), requires_grad=False)
    ids = torch.randint(0, 248320, (2, 16), device="cuda")
    method = UnquantizedEmbeddingMethod()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rows = _rows_in_one_launch(UnquantizedEmbeddingMethod.embedding, method, layer, ids)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_embedding_kernel"], kernels
    assert torch.equal(rows, method.embedding(layer, ids))
