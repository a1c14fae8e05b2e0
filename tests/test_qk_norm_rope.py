"""The attention prologue (kernels/qk_norm_rope.py, server/hooks/attention_prologue.py): per-head RMSNorm of q and k,
NeoX rotary on the first rotary_dim channels; the target's with Gemma weights and its gate copied out of the
interleaved rows, the drafter's in place after its deferred norm. CPU (Triton's interpreter) on small ragged shapes
against torch; on the GPU at the real shapes against SGLang's own kernels."""

from types import SimpleNamespace

import pytest
import torch

from qflash.kernels import qk_norm_rope
from qflash.server.hooks import attention_prologue
from qflash.server.preset import DRAFTER_CONFIG, TEXT_CONFIG
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


def head_norm(x, w, eps, offset):
    """[T, heads, head_dim] -> RMSNorm per head with weights offset + w, rounded to bf16."""
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.float() + offset)).to(torch.bfloat16).float()


def rotate(x, cos_sin, positions):
    """NeoX rotary of x [T, heads, head_dim] on cos_sin's width, in fp32."""
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions].float()[:, None, :half], cos_sin[positions].float()[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1).flatten(1)


def reference(q_gate, k, q_w, k_w, cos_sin, positions, eps, q_heads, kv_heads, head_dim, rotary_dim):
    rows = q_gate.view(q_gate.shape[0], q_heads, 2 * head_dim)
    heads = head_norm(rows[..., :head_dim], q_w, eps, 1), head_norm(k.view(k.shape[0], kv_heads, head_dim), k_w, eps, 1)
    return *(rotate(x, cos_sin[:, :rotary_dim], positions) for x in heads), rows[..., head_dim:]


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


def test_the_target_hook_runs_qflashs_kernel_where_it_covers_the_call():
    args = inputs(4, 2, 1, 32, 8)
    calls = []
    ours = attention_prologue._target_on_qflash(lambda *a: calls.append(a), *args)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(ours, qk_norm_rope.qk_norm_rope(*args)))
    attention_prologue._target_on_qflash(lambda *a: calls.append(a), *args, has_gate=False)
    assert len(calls) == 1 and calls[0][-1] is False  # SGLang's kernel, with every argument


def drafter_inputs(tokens, q_heads, kv_heads, head_dim, seed=0):
    """q and k as the drafter's column slices of its qkv output, plain norms as SGLang's RMSNorm holds them, a rotary
    stand-in with SGLang's fields."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    q, k = qkv[:, :q_heads * head_dim], qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim]
    norms = [SimpleNamespace(weight=(torch.rand(head_dim, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE),
                             variance_epsilon=1e-6) for _ in "qk"]
    rope = SimpleNamespace(cos_sin_cache=torch.randn(4 * tokens, head_dim, generator=g).to(DEVICE), is_neox_style=True,
                           head_size=head_dim)
    positions = torch.randint(0, 4 * tokens, (tokens,), generator=g).to(DEVICE)
    return qkv, q, k, norms, rope, positions


def sglang_stand_ins(calls):
    """apply_qk_norm (out of place, as SGLang's native path) and the rotary forward (in place), recording calls."""
    def apply_qk_norm(q, k, q_norm, k_norm, head_dim):
        calls.append("norm")
        return tuple(head_norm(x.view(x.shape[0], -1, head_dim), n.weight, n.variance_epsilon, 0).flatten(1).to(x.dtype)
                     for x, n in ((q, q_norm), (k, k_norm)))

    def rotary(self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
        calls.append("rotary")
        for x in (query, key):
            x.copy_(rotate(x.view(x.shape[0], -1, self.head_size).float(), self.cos_sin_cache, positions))
        return query, key
    return apply_qk_norm, rotary


def test_the_drafters_norm_waits_for_its_rotary_and_both_run_in_one_launch(monkeypatch):
    qkv, q, k, (q_norm, k_norm), rope, positions = drafter_inputs(5, 4, 2, 32)
    monkeypatch.setattr(attention_prologue, "_rotary", rope)  # a drafter layer with SGLang's CUDA rotary runs
    calls, before = [], qkv.clone()
    apply_qk_norm, rotary = sglang_stand_ins(calls)
    expected = rotary(rope, positions, *apply_qk_norm(q, k, q_norm, k_norm, 32))
    calls.clear()
    q2, k2 = attention_prologue._defer_drafter_qk_norm(apply_qk_norm, q, k, q_norm, k_norm, 32)
    assert q2 is q and k2 is k and torch.equal(qkv, before)  # deferred: nothing ran yet
    q3, k3 = attention_prologue._norm_and_rotary(rotary, rope, positions, q, k)
    assert calls == [] and q3 is q and k3 is k and attention_prologue._deferred is None
    for got, ref in zip((q, k), expected):
        assert (got.float() - ref.float()).abs().max() <= 2 ** -6 * ref.float().abs().max()
    assert torch.equal(qkv[:, 6 * 32:], before[:, 6 * 32:])  # v untouched


def test_a_deferred_norm_no_rotary_takes_runs_as_sglangs(monkeypatch):
    qkv, q, k, (q_norm, k_norm), rope, positions = drafter_inputs(3, 2, 1, 16)
    monkeypatch.setattr(attention_prologue, "_rotary", rope)
    calls = []
    apply_qk_norm, rotary = sglang_stand_ins(calls)
    normed = [x.clone() for x in apply_qk_norm(q, k, q_norm, k_norm, 16)]
    calls.clear()
    attention_prologue._defer_drafter_qk_norm(apply_qk_norm, q, k, q_norm, k_norm, 16)
    other = q.clone(), k.clone()  # a rotary of other tensors: the deferred norm runs first, into q and k
    attention_prologue._norm_and_rotary(rotary, rope, positions, *other)
    assert calls == ["norm", "rotary"] and attention_prologue._deferred is None
    assert torch.equal(q, normed[0]) and torch.equal(k, normed[1])


def test_no_norm_is_deferred_outside_a_drafter_layer_with_sglangs_cuda_rotary(monkeypatch):
    qkv, q, k, (q_norm, k_norm), rope, positions = drafter_inputs(3, 2, 1, 16)
    calls = []
    apply_qk_norm, rotary = sglang_stand_ins(calls)
    monkeypatch.setattr(attention_prologue, "_rotary", None)
    attention_prologue._defer_drafter_qk_norm(apply_qk_norm, q, k, q_norm, k_norm, 16)
    assert calls == ["norm"] and attention_prologue._deferred is None
    layer = SimpleNamespace(rotary_emb=rope)  # a stand-in rotary: not SGLang's class, so never deferred inside either
    attention_prologue._drafter_layer(lambda self: calls.append(attention_prologue._rotary), layer)
    assert calls == ["norm", None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [16, 128])
def test_the_drafter_prologue_within_a_bf16_ulp_of_sglangs_kernels(tokens):
    from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace
    from sglang.kernels.ops.layernorm.norm import fused_inplace_qknorm

    d = DRAFTER_CONFIG
    qkv, q, k, (q_norm, k_norm), rope, positions = drafter_inputs(tokens, d["num_attention_heads"],
                                                                  d["num_key_value_heads"], d["head_dim"], seed=tokens)
    ref = qkv.clone()
    rq, rk = ref[:, :q.shape[1]], ref[:, q.shape[1]:q.shape[1] + k.shape[1]]
    views = [x.view(tokens, -1, d["head_dim"]) for x in (rq, rk)]
    fused_inplace_qknorm(q=views[0], k=views[1], q_weight=q_norm.weight, k_weight=k_norm.weight,
                         head_dim=d["head_dim"], eps=1e-6)
    apply_rope_with_cos_sin_cache_inplace(q=views[0], k=views[1], cos_sin_cache=rope.cos_sin_cache,
                                          positions=positions, is_neox=True)
    qk_norm_rope.qk_norm_rope_(q, k, q_norm.weight, k_norm.weight, rope.cos_sin_cache, positions, 1e-6, d["head_dim"])
    # SGLang's norm sums squares in its own order: a norm's last bit may differ, then the rotation of it
    err = (qkv.float() - ref.float()).abs().max().item()
    assert err <= 2 ** -7 * ref.float().abs().max().item(), err
    assert (qkv != ref).float().mean() < 0.05
