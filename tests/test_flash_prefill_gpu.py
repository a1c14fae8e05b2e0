"""Prefill attention on torch's fused kernels (kernels/flash_prefill.py) against SGLang's Triton extend kernel, the
path it replaces, and float32 attention, at the target's real head shapes (GPU only): a fresh prompt on SDPA, a batch
of fresh prompts on flash attention over packed sequences."""

import pytest
import torch

from qflash.kernels.flash_prefill import flash_prefill
from test_flash_prefill import batch_problem, batch_reference, problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def float32_attention(p, scale):
    n = p["max_len_extend"]
    q, k, v = (p[name][:n].float() for name in ("q_extend", "k_extend", "v_extend"))
    group = q.shape[1] // k.shape[1]
    out = torch.empty(n, q.shape[1], v.shape[2], device=q.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    for h in range(q.shape[1]):
        s = (q[:, h] @ k[:, h // group].T * scale).masked_fill(causal, float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[:, h // group]
    return out


@pytest.mark.parametrize("tokens, padded", [(8192, 8192), (2000, 2048), (64, 64)])
def test_sdpa_prefill_agrees_with_sglangs_extend_kernel(tokens, padded):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    scale = 256 ** -0.5
    ours = problem(tokens, padded, heads=16, kv_heads=4, dim=256)
    theirs = dict(ours, o_extend=ours["o_extend"].clone())
    flash_prefill(None, **ours, sm_scale=scale)
    extend_attention_fwd(**theirs, sm_scale=scale)
    ref = float32_attention(ours, scale)
    our_err = (ours["o_extend"][:tokens].float() - ref).abs()
    their_err = (theirs["o_extend"][:tokens].float() - ref).abs()
    assert our_err.max().item() <= 2 * their_err.max().item() and our_err.mean().item() <= 2 * their_err.mean().item()
    assert torch.equal(ours["o_extend"][tokens:], theirs["o_extend"][tokens:])  # padding rows: neither writes them


@pytest.mark.parametrize("extends", [(2048, 300, 37), (1500, 1100)], ids=["three prompts", "two long prompts"])
def test_a_batch_of_fresh_prompts_agrees_with_sglangs_extend_kernel(extends):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    scale = 256 ** -0.5
    ours = batch_problem(extends, (0,) * len(extends), padding=5, heads=16, kv_heads=4, dim=256)
    theirs = dict(ours, o_extend=ours["o_extend"].clone())
    flash_prefill(None, **ours, sm_scale=scale)
    extend_attention_fwd(**theirs, sm_scale=scale)
    tokens = sum(extends)
    ref = batch_reference(ours, scale).float().cuda()
    our_err = (ours["o_extend"][:tokens].float() - ref).abs()
    their_err = (theirs["o_extend"][:tokens].float() - ref).abs()
    assert our_err.max().item() <= 2 * their_err.max().item() and our_err.mean().item() <= 2 * their_err.mean().item()
    assert torch.equal(ours["o_extend"][tokens:], theirs["o_extend"][tokens:])  # padding rows: neither writes them
