"""Split-KV block attention (kernels/block_attention.py) against float64 attention on small shapes (CPU:
Triton's interpreter), with ragged prefixes, causal and bidirectional blocks and a sliding window that cuts
into the prefix. Agreement with SGLang's extend kernel at the real shapes: test_block_attention_gpu.py
(SGLang's kernel multiplies bf16 operands, which the interpreter cannot)."""

import pytest
import torch

from qflash.kernels import block_attention as ba

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = {(64, 64): dict(NSPLIT=4, BLOCK_N=16, num_warps=4, num_stages=2)}


def problem(prefix_lens, heads=4, kv_heads=2, dim=64, block=16, pool=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)  # noqa: E731
    bs = len(prefix_lens)
    slots = torch.randperm(pool, generator=g)[: sum(prefix_lens)]
    kv_indptr = torch.tensor([0, *torch.tensor(prefix_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        q_extend=rand(bs * block, heads, dim), k_extend=rand(bs * block, kv_heads, dim), v_extend=rand(bs * block, kv_heads, dim),
        o_extend=torch.zeros(bs * block, heads, dim, dtype=torch.bfloat16, device=DEVICE),
        k_buffer=rand(pool, kv_heads, dim), v_buffer=rand(pool, kv_heads, dim),
        qo_indptr=torch.arange(0, (bs + 1) * block, block, dtype=torch.int32, device=DEVICE),
        kv_indptr=kv_indptr.to(DEVICE), kv_indices=slots.to(torch.int64).to(DEVICE),
        custom_mask=None, mask_indptr=None, max_len_extend=block, k_scale=1.0, v_scale=1.0)


def reference(p, causal, window):
    """float64 softmax attention; query i of a block sits at position plen + i, after its prefix."""
    q, o = p["q_extend"].double().cpu(), torch.empty(p["o_extend"].shape, dtype=torch.float64)
    block, heads, dim = p["max_len_extend"], q.shape[1], q.shape[2]
    group = heads // p["k_extend"].shape[1]
    indptr = p["kv_indptr"].cpu()
    for b in range(len(indptr) - 1):
        slots = p["kv_indices"].cpu()[indptr[b]: indptr[b + 1]]
        plen = len(slots)
        k = torch.cat([p["k_buffer"].cpu()[slots], p["k_extend"].cpu()[b * block:(b + 1) * block]]).double()
        v = torch.cat([p["v_buffer"].cpu()[slots], p["v_extend"].cpu()[b * block:(b + 1) * block]]).double()
        i = torch.arange(block)[:, None]
        j = torch.arange(plen + block)[None, :]
        visible = (j < plen) | ((j - plen <= i) if causal else True)
        if window:
            visible = visible & torch.where(j < plen, plen + i <= j + window, i <= j - plen + window)
        for h in range(heads):
            s = q[b * block:(b + 1) * block, h] @ k[:, h // group].T * dim ** -0.5
            o[b * block:(b + 1) * block, h] = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, h // group]
    return o


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window-20"])
def test_block_attention_matches_float64(monkeypatch, causal, window):
    monkeypatch.setattr(ba, "CONFIGS", SMALL)
    p = problem([37, 0, 70])  # a prefix shorter than a split, an empty one, one over several splits
    assert ba.block_attention(**p, is_causal=causal, sliding_window_size=window or -1, max_bs=4)
    ref = reference(p, causal, window)
    assert (p["o_extend"].double().cpu() - ref).abs().max().item() < 0.03  # bf16 inputs, bf16 P as SGLang's kernel


def test_the_real_configs_run_qwen35_head_shapes():
    p = problem([50], heads=32, kv_heads=8, dim=128, seed=5)  # the DFlash drafter's heads, its real config
    assert ba.block_attention(**p, is_causal=False, sliding_window_size=4095, max_bs=1)
    assert (p["o_extend"].double().cpu() - reference(p, False, 4095)).abs().max().item() < 0.03


def test_cases_it_does_not_serve_are_left_to_sglang():
    p = problem([10], dim=96)  # no config for this head dim
    assert not ba.block_attention(**p, is_causal=True)
    p = problem([10], dim=128)
    assert not ba.block_attention(**dict(p, custom_mask=torch.ones(1, dtype=torch.bool)), is_causal=True)
    assert not ba.block_attention(**dict(p, max_len_extend=8), is_causal=True)
    assert not ba.block_attention(**dict(p, k_scale=0.5), is_causal=True)
    assert not ba.block_attention(**p, is_causal=True, logit_cap=30.0)
    assert not ba.block_attention(**problem([10], heads=6, kv_heads=2, dim=128), is_causal=True)  # 3 heads per KV head
    assert p["o_extend"].abs().max() == 0  # nothing was written


def test_the_plugin_puts_block_attention_behind_sglangs_verify_hook():
    from types import SimpleNamespace

    from qflash.server.hooks import attention

    backend = SimpleNamespace(page_size=1, use_verify_splitkv=False, verify_splitkv_fwd=None, extend_attention_fwd=None)
    attention._use_qflash_attention(None, backend)
    assert backend.use_verify_splitkv and backend.verify_splitkv_fwd.__wrapped__ is ba.block_attention
    paged = SimpleNamespace(page_size=16, use_verify_splitkv=False, verify_splitkv_fwd=None, extend_attention_fwd=None)
    attention._use_qflash_attention(None, paged)  # kv_indices would hold pages: left to SGLang
    assert not paged.use_verify_splitkv
