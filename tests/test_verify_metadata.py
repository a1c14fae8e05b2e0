"""The speculative block's attention metadata in one launch (kernels/verify_metadata.py), routed by
server/hooks/attention.py: SGLang 0.5.17's Triton backend fills the same CUDA-graph buffers with its own
`_update_target_verify_buffers` (torch operations and its kv-indices gather). Both run here on two copies of the
same backend. Every buffer starts as a sentinel, except an indptr's entry 0, which SGLang allocates as zero and
never writes; so a missed write, a write SGLang does not make, or a wrong value shows. CPU: Triton's interpreter,
which runs SGLang's gather too."""

from types import SimpleNamespace

import pytest
import torch

from qflash.kernels import verify_metadata as vm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_BS, CONTEXT, POOL_ROWS, SENTINEL = 4, 3000, 6, -7
BUFFERS = ("qo_indptr", "kv_indptr", "mask_indptr", "cuda_graph_kv_indices", "window_kv_indptr",
           "cuda_graph_window_kv_indices", "cuda_graph_window_kv_offsets")


def backend(window: int, block: int = 16, pool=None):
    """A TritonAttnBackend with only the fields its verify metadata reads and writes, each a sentinel; req_to_token
    holds distinct slots."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    b = TritonAttnBackend.__new__(TritonAttnBackend)
    full = lambda n, dtype: torch.full((n,), SENTINEL, dtype=dtype, device=DEVICE)  # noqa: E731
    # an indptr's entry 0 as SGLang keeps it: zero from its allocation, never written
    indptr = lambda dtype: torch.cat([torch.zeros(1, dtype=dtype, device=DEVICE), full(MAX_BS, dtype)])  # noqa: E731
    g = torch.Generator().manual_seed(0)
    vars(b).update(
        num_draft_tokens=block, device=DEVICE, sliding_window_size=window or None, _verify_mask=None,
        token_to_kv_pool=pool or SimpleNamespace(),
        req_to_token=torch.randperm(POOL_ROWS * CONTEXT, generator=g).to(torch.int32).view(POOL_ROWS, CONTEXT).to(DEVICE),
        qo_indptr=full(MAX_BS + 1, torch.int64), kv_indptr=indptr(torch.int32),
        mask_indptr=indptr(torch.int64), cuda_graph_kv_indices=full(MAX_BS * CONTEXT, torch.int64),
        window_kv_indptr=indptr(torch.int32) if window else None)
    if window:
        vars(b).update(cuda_graph_window_kv_indices=full(MAX_BS * window, torch.int64),
                       cuda_graph_window_num_kv_splits=full(MAX_BS, torch.int32),
                       cuda_graph_window_kv_offsets=full(MAX_BS, torch.int32))
    return b


def sglangs(b, *args):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend._update_target_verify_buffers(b, *args)


def never(*args):
    raise AssertionError("SGLang's metadata code ran")


def described(b, outputs) -> list:
    """Each of `outputs` as None or (the name of b's buffer it views, its shape, its dtype)."""
    def name(t):
        return next(n for n, v in vars(b).items() if isinstance(v, torch.Tensor) and v.data_ptr() == t.data_ptr())
    return [None if t is None else (name(t), tuple(t.shape), t.dtype) for t in outputs]


# Lengths that end inside a chunk, fill several chunks over the splits, and are shorter or longer than the window
@pytest.mark.parametrize("lens, pool, window, draft_tokens", [
    ([5], [3], 0, None),
    ([2999, 17, 1024], [1, 4, 0], 0, 8),  # a spec_info's block of 8
    ([700, 3, 2048, 40], [5, 2, 0, 3], 64, None),  # the drafter's sliding-window layers
    ([1], [0], 300, None),
], ids=["one", "three-long", "window", "window-short"])
def test_one_launch_fills_sglangs_buffers_as_sglang_does(monkeypatch, lens, pool, window, draft_tokens):
    from qflash.server.hooks.attention import _verify_metadata_in_one_launch

    monkeypatch.setitem(vm.CONFIG, "BLOCK", 256)  # several chunks a request, each split looping, in the interpreter
    monkeypatch.setitem(vm.CONFIG, "SPLITS", 3)
    spec = None if draft_tokens is None else SimpleNamespace(draft_token_num=draft_tokens, custom_mask=None)
    args = (len(lens), torch.tensor(lens, device=DEVICE), torch.tensor(pool, device=DEVICE), spec)
    theirs, mine = backend(window), backend(window)
    expected = sglangs(theirs, *args)
    got = _verify_metadata_in_one_launch(never, mine, *args)
    for name in BUFFERS:
        if getattr(theirs, name, None) is not None:
            assert torch.equal(getattr(mine, name), getattr(theirs, name)), name
    assert theirs.cuda_graph_kv_indices[sum(lens) - 1] != SENTINEL  # the slots were written at all
    assert described(mine, got) == described(theirs, expected)  # SGLang's return: views of the same buffers


@pytest.mark.parametrize("case", ["custom mask", "window in a separate SWA pool", "empty batch"])
def test_metadata_it_does_not_fill_runs_sglangs_code(case):
    from qflash.server.hooks.attention import _verify_metadata_in_one_launch

    window = 64 if case == "window in a separate SWA pool" else 0
    pool = SimpleNamespace(translate_loc_from_full_to_swa=lambda loc: loc) if window else None
    spec = SimpleNamespace(draft_token_num=16, custom_mask=torch.ones(1) if case == "custom mask" else None)
    bs = 0 if case == "empty batch" else 1
    got = _verify_metadata_in_one_launch(lambda *args: "sglang", backend(window, pool=pool), bs,
                                         torch.tensor([5] * bs, device=DEVICE), torch.tensor([0] * bs, device=DEVICE), spec)
    assert got == "sglang"
