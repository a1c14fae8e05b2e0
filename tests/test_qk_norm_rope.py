"""The gated attention prologue (kernels/qk_norm_rope.py): per-head Gemma RMSNorm of q and k, NeoX rotary on the first
rotary_dim channels, the gate copied out of the interleaved rows. CPU (Triton's interpreter) on small ragged shapes
against torch; on the GPU at the real shape against SGLang's own kernel."""

import pytest
import torch

from qflash.kernels import qk_norm_rope
from qflash.server.preset import TEXT_CONFIG
from qflash.server.tools.shapes import ATTENTION_HEADS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(tokens, q_heads, kv_heads, head_dim, rotary_dim, cache_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_gate = torch.randn(tokens, 2 * q_heads * head_dim, generator=g) * 3
    k = torch.randn(tokens, kv_heads * head_dim + 8, generator=g)[:, :kv_heads * head_dim]  # a column slice, as served
    q_w, k_w = torch.randn(head_dim, generator=g) * 0.2, torch.randn(head_dim, generator=g) * 0.2
    cos_sin = torch.randn(4 * tokens + 50, rotary_dim, generator=g)
    positions = torch.randint(0, cos_sin.shape[0], (tokens,), generator=g)
    cast = [t.to(torch.bfloat16).to(DEVICE) for t in (q_gate, k, q_w, k_w)]
    return (*cast, cos_sin.to(cache_dtype).to(DEVICE), positions.to(DEVICE), 1e-6, q_heads, kv_heads, head_dim,
            rotary_dim)


def reference(q_gate, k, q_w, k_w, cos_sin, positions, eps, q_heads, kv_heads, head_dim, rotary_dim):
    half = rotary_dim // 2
    cos, sin = (cos_sin[positions].float()[:, None, :half], cos_sin[positions].float()[:, None, half:rotary_dim])

    def head(x, w):
        x = x.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + 1)).to(torch.bfloat16).float()
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], -1).flatten(1)

    rows = q_gate.view(q_gate.shape[0], q_heads, 2 * head_dim)
    return head(rows[..., :head_dim], q_w), head(k.reshape(k.shape[0], kv_heads, head_dim), k_w), rows[..., head_dim:]


@pytest.mark.parametrize("shape", [(5, 3, 2, 32, 8), (4, 2, 1, 48, 48), (3, 1, 1, 16, 2)],
                         ids=["partial-rotary", "whole-head-rotary-ragged-block", "two-rotary-channels"])
def test_qk_norm_rope_matches_torch(shape):
    args = inputs(*shape)
    q, k, gate = qk_norm_rope.qk_norm_rope(*args)
    ref_q, ref_k, ref_gate = reference(*args)
    assert torch.equal(gate, ref_gate) and gate.is_contiguous()
    for got, ref in ((q, ref_q), (k, ref_k)):
        # each output rotates two normalised channels, each within a bf16 ulp (the interpreter truncates)
        assert (got.float() - ref).abs().max() <= 2 ** -6 * ref.abs().max()


def test_takes_only_what_it_computes():
    q_gate, k, q_w, k_w, cos_sin, positions, eps, hq, hkv, d, r = inputs(4, 2, 1, 32, 8)
    assert qk_norm_rope.takes(q_gate, k, cos_sin, positions, hq, hkv, d, r)
    assert not qk_norm_rope.takes(q_gate, k, cos_sin, positions, hq, hkv, d, r, has_gate=False)
    assert not qk_norm_rope.takes(q_gate, k, cos_sin, positions, hq, hkv, d, 7)  # odd rotary_dim
    assert not qk_norm_rope.takes(q_gate[:, :-d], k, cos_sin, positions, hq, hkv, d, r)
    assert not qk_norm_rope.takes(q_gate, k, cos_sin, positions[:2], hq, hkv, d, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [16, 64, 300])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
def test_qk_norm_rope_gives_sglangs_bits(tokens, cache_dtype):
    from sglang.kernels.ops.attention.fused_qk_rmsnorm_rope_gate import fused_qk_gemma_rmsnorm_rope_gate

    q_heads, kv_heads, head_dim = ATTENTION_HEADS
    rotary_dim = int(head_dim * TEXT_CONFIG["partial_rotary_factor"])
    args = inputs(tokens, q_heads, kv_heads, head_dim, rotary_dim, cache_dtype, seed=tokens)
    ours, sglang = qk_norm_rope.qk_norm_rope(*args), fused_qk_gemma_rmsnorm_rope_gate(*args)
    for name, a, b in zip(("q", "k", "gate"), ours, sglang):
        assert a.shape == b.view(a.shape).shape and torch.equal(a, b.view(a.shape)), name
