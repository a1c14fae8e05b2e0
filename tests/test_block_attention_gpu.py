"""qflash's split-KV block attention against SGLang's Triton extend kernel (the path it replaces), at the
target's and the DFlash drafter's real head shapes and long prefixes (GPU only)."""

import pytest
import torch

from qflash.kernels.block_attention import block_attention
from test_block_attention import block_slots, problem, with_block_stored

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("heads, kv_heads, dim, prefix_lens, causal, window", [
    (16, 4, 256, [8192, 3000], True, -1),  # target verify: 8 full-attention layers, causal block
    (16, 4, 256, [64], True, -1),
    (32, 8, 128, [4095, 2048, 17], False, 4095),  # DFlash drafter: sliding window, bidirectional block
    (32, 8, 128, [8192], False, -1),  # the drafter's full-attention layer
], ids=["target-8192", "target-64", "draft-window", "draft-full"])
def test_block_attention_agrees_with_sglangs_extend_kernel(heads, kv_heads, dim, prefix_lens, causal, window):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    ours = problem(prefix_lens, heads, kv_heads, dim, pool=sum(prefix_lens) + 64)
    theirs = dict(ours, o_extend=torch.zeros_like(ours["o_extend"]))
    assert block_attention(**ours, is_causal=causal, sliding_window_size=window, max_bs=8)
    extend_attention_fwd(*[theirs[k] for k in ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer",
                                                "qo_indptr", "kv_indptr", "kv_indices", "custom_mask")],
                         causal, None, 16, 1.0, 1.0, sliding_window_size=window)
    diff = (ours["o_extend"].float() - theirs["o_extend"].float()).abs()
    assert diff.max().item() < 0.02 and diff.mean().item() < 1e-3


@pytest.mark.parametrize("heads, kv_heads, dim, causal, window", [(16, 4, 256, True, -1), (32, 8, 128, False, 4095)],
                         ids=["target", "draft-window"])
def test_strided_k_and_v_give_the_bits_of_their_copies(heads, kv_heads, dim, causal, window):
    """The verify route hands the kernel the block's q, k and v as column slices of one qkv projection's output; in a
    pool of plain rows, the kernel stores the block's k and v in the cache too."""
    ours = problem([3000, 64], heads, kv_heads, dim, pool=3200)
    rows = ours["q_extend"].shape[0]
    qkv = torch.cat([ours[name].reshape(rows, -1) for name in ("q_extend", "k_extend", "v_extend")], dim=1)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    strided = dict(ours, q_extend=q.view(rows, heads, dim), k_extend=k.view(rows, kv_heads, dim),
                   v_extend=v.view(rows, kv_heads, dim), o_extend=torch.zeros_like(ours["o_extend"]))
    assert not strided["k_extend"].is_contiguous() and not strided["v_extend"].is_contiguous()
    assert block_attention(**ours, is_causal=causal, sliding_window_size=window, max_bs=8)
    assert block_attention(**strided, is_causal=causal, sliding_window_size=window, max_bs=8)
    assert torch.equal(ours["o_extend"], strided["o_extend"])
    # and with the block's KV stored by the kernel, in slots no prefix holds
    slots = block_slots(ours, rows)
    expected_k, expected_v = with_block_stored(strided, slots)
    stored = dict(strided, k_buffer=ours["k_buffer"].clone(), v_buffer=ours["v_buffer"].clone(),
                  o_extend=torch.zeros_like(ours["o_extend"]))
    assert block_attention(**stored, is_causal=causal, sliding_window_size=window, max_bs=8, out_cache_loc=slots)
    assert torch.equal(ours["o_extend"], stored["o_extend"])
    assert torch.equal(stored["k_buffer"], expected_k) and torch.equal(stored["v_buffer"], expected_v)
