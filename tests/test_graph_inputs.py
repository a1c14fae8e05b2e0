"""A forward's copies into its graph's input buffers (server/hooks/graph_inputs.py): SGLang's grouped foreach copy
with its dense pairs in one call and the strided ones in another, against SGLang's own on the same tensors."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS, MAX_TOKENS = 16, 64


def graph_inputs():
    """(destinations, sources) as SGLang's graph runner hands them before a target verify: five dense slots and the
    mrope positions' [3, tokens] slice of a [3, max tokens] buffer."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randint(0, 1000, shape, generator=g).to(DEVICE)  # noqa: E731
    dsts = [torch.zeros(MAX_TOKENS, dtype=torch.int64, device=DEVICE)[:TOKENS] for _ in range(5)]
    dsts.insert(2, torch.zeros(3, MAX_TOKENS, dtype=torch.int64, device=DEVICE)[:, :TOKENS])
    return dsts, [rand(*d.shape) for d in dsts]


def test_dense_pairs_go_to_one_call_and_the_strided_to_another():
    from sglang.srt.model_executor.cuda_graph_buffer_registry import _grouped_foreach_copy_

    from qflash.server.hooks.graph_inputs import _dense_pairs_in_one_launch

    dsts, srcs = graph_inputs()
    calls = []

    def sglang(d, s):
        calls.append(len(d))
        _grouped_foreach_copy_(d, s)

    _dense_pairs_in_one_launch(sglang, dsts, srcs)
    assert calls == [5, 1]
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


@pytest.mark.parametrize("strided", [0, 6], ids=["all dense", "all strided"])
def test_a_group_of_one_kind_goes_to_sglang_as_it_is(strided):
    from qflash.server.hooks.graph_inputs import _dense_pairs_in_one_launch

    dsts = [torch.zeros(4, 2)[:, 0] if i < strided else torch.zeros(4) for i in range(6)]
    srcs = [torch.ones(4) for _ in dsts]
    calls = []
    _dense_pairs_in_one_launch(lambda d, s: calls.append((d, s)), dsts, srcs)
    assert len(calls) == 1 and calls[0][0] is dsts and calls[0][1] is srcs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_target_verifys_six_input_copies_are_two_launches_gpu():
    from sglang.srt.model_executor.cuda_graph_buffer_registry import _grouped_foreach_copy_

    from qflash.server.hooks.graph_inputs import _dense_pairs_in_one_launch

    def launches(copy) -> int:
        dsts, srcs = graph_inputs()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            copy(dsts, srcs)
            torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    assert launches(_grouped_foreach_copy_) == 6  # SGLang's: torch's slow path, a copy each
    assert launches(lambda d, s: _dense_pairs_in_one_launch(_grouped_foreach_copy_, d, s)) == 2
