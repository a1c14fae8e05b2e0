"""Prefill attention through torch's fused kernels (kernels/flash_prefill.py): a fresh prompt's causal attention
against float64; a batch of fresh prompts packed for flash attention (a stand-in with varlen_attn's documented
semantics on the CPU) against float64 attention; padding rows untouched; every case it does not serve (cached
prefixes among them) handed to SGLang's kernel with its arguments unchanged. The H200 comparison with SGLang's extend
kernel: test_flash_prefill_gpu.py."""

import itertools

import pytest
import torch

from qflash.kernels import flash_prefill as fp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def problem(tokens, padded, heads=4, kv_heads=2, dim=64, prefix=0, seed=0):
    """One request's extend, its index tensors of the dtypes SGLang's Triton backend gives them."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)  # noqa: E731
    return dict(q_extend=rand(padded, heads, dim), k_extend=rand(padded, kv_heads, dim), v_extend=rand(padded, kv_heads, dim),
                o_extend=torch.full((padded, heads, dim), 7.0, dtype=torch.bfloat16, device=DEVICE),
                k_buffer=rand(64, kv_heads, dim), v_buffer=rand(64, kv_heads, dim),
                qo_indptr=torch.tensor([0, tokens], dtype=torch.int64, device=DEVICE),
                kv_indptr=torch.tensor([0, prefix], dtype=torch.int32, device=DEVICE),
                kv_indices=torch.arange(prefix, dtype=torch.int64, device=DEVICE),
                custom_mask=None, is_causal=True, mask_indptr=None, max_len_extend=tokens, k_scale=1.0, v_scale=1.0)


def reference(p, scale):
    n = p["max_len_extend"]
    return attention(*(p[name][:n].double().cpu() for name in ("q_extend", "k_extend", "v_extend")), scale)


def never_called(*args, **kwargs):
    raise AssertionError("a plain fresh prefill reached SGLang's kernel")


@pytest.mark.parametrize("tokens, padded", [(37, 37), (37, 48)], ids=["exact", "graph-padded"])
def test_fresh_prefill_is_causal_attention(tokens, padded):
    p = problem(tokens, padded)
    fp.flash_prefill(never_called, **p, sm_scale=0.1, logit_cap=0.0, sliding_window_size=-1, sinks=None,
                     window_kv_offsets=None, xai_temperature_len=-1, page_size=1, score_mod=None, aux_tensors=None)
    assert (p["o_extend"][:tokens].double().cpu() - reference(p, 0.1)).abs().max().item() < 0.02
    assert (p["o_extend"][tokens:] == 7.0).all()  # the padding rows are left alone


def batch_problem(extends, prefixes, padding=3, heads=4, kv_heads=2, dim=64, seed=1):
    """Requests of `extends` new tokens over cached prefixes of `prefixes` tokens."""
    p = problem(sum(extends), sum(extends) + padding, heads, kv_heads, dim, seed=seed)
    p["kv_indices"] = torch.arange(sum(prefixes), device=DEVICE)
    p["qo_indptr"], p["kv_indptr"] = (torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype, device=DEVICE)
                                      for lens, dtype in ((extends, torch.int64), (prefixes, torch.int32)))
    p["max_len_extend"] = max(extends)
    return p


def batch_reference(p, scale):
    """Each fresh request's tokens, causally (a batch's own attention: no request sees another's)."""
    out = []
    for q0, q1 in itertools.pairwise(p["qo_indptr"].tolist()):
        q, k, v = (p[name][q0:q1].double().cpu() for name in ("q_extend", "k_extend", "v_extend"))
        out.append(attention(q, k, v, scale))
    return torch.cat(out)


def attention(q, k, v, scale):
    """Causal attention with the last query row seeing every key (the prefix before the queries' own keys)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(k.shape[0] - q.shape[0] + 1),
                      float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


def varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size):
    """torch.nn.attention.varlen.varlen_attn as documented (flash attention, which has no CPU kernel): sequences
    packed one after another, causal aligned to each sequence's end; rows past the last sequence unwritten (NaN)."""
    assert window_size == (-1, 0)  # causal
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32  # flash attention refuses others
    out = torch.full(query.shape, float("nan"), dtype=query.dtype, device=query.device)
    for i in range(cu_seq_q.shape[0] - 1):
        (q0, q1), (k0, k1) = cu_seq_q[i:i + 2].tolist(), cu_seq_k[i:i + 2].tolist()
        assert q1 - q0 <= max_q and k1 - k0 <= max_k  # the bounds it is given hold
        out[q0:q1] = attention(query[q0:q1].double(), key[k0:k1].double(), value[k0:k1].double(), scale).to(out.dtype)
    return out


@pytest.mark.parametrize("extends", [(5, 12, 9), (16, 1)], ids=["three prompts", "a one-token prompt"])
def test_a_batch_of_fresh_prompts_is_causal_attention_over_packed_sequences(monkeypatch, extends):
    monkeypatch.setattr(fp, "varlen_attn", varlen_stand_in)
    p = batch_problem(extends, (0,) * len(extends))
    fp.flash_prefill(never_called, **p, sm_scale=0.1)
    tokens = sum(extends)
    assert (p["o_extend"][:tokens].double().cpu() - batch_reference(p, 0.1)).abs().max().item() < 0.02
    assert (p["o_extend"][tokens:] == 7.0).all()  # the padding rows are left alone


@pytest.mark.parametrize("extends, prefixes", [((16,), (40,)), ((5, 12, 9), (0, 7, 20))],
                         ids=["one cached prefix", "a batch, some with prefixes"])
def test_new_tokens_over_a_cached_prefix_stay_on_sglangs_kernel(extends, prefixes):
    p = batch_problem(extends, prefixes)
    calls = []
    fp.flash_prefill(lambda *args, **kw: calls.append(args), **p, sm_scale=0.1)
    assert len(calls) == 1 and calls[0][8] is p["kv_indices"] and (p["o_extend"] == 7.0).all()


def test_while_a_graph_is_captured_only_a_lone_prompt_is_served(monkeypatch):
    monkeypatch.setattr(fp.torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(fp.torch.Tensor, "is_cuda", True)
    monkeypatch.setattr(fp, "varlen_attn", varlen_stand_in)
    calls = []
    fp.flash_prefill(lambda *args, **kw: calls.append(args), **batch_problem((5, 12), (0, 0)), sm_scale=0.1)
    fp.flash_prefill(never_called, **problem(16, 16), sm_scale=0.1)
    assert len(calls) == 1


@pytest.mark.parametrize("change", [
    dict(custom_mask=True), dict(is_causal=False), dict(k_scale=0.5), dict(max_len_extend=None),
    dict(logit_cap=30.0), dict(sliding_window_size=16), dict(sinks=True), dict(lse_extend=True), dict(skip_prefix=True),
    dict(an_argument_it_does_not_know=1),
], ids=lambda change: next(iter(change)))
def test_what_it_does_not_serve_goes_to_sglang_unchanged(change):
    p = problem(16, 16)
    kwargs = {}
    for key, value in change.items():
        if key in ("custom_mask", "sinks", "lse_extend"):
            value = torch.ones(1, device=DEVICE)
        if key in p:
            p[key] = value
        else:
            kwargs[key] = value
    calls = []
    fp.flash_prefill(lambda *args, **kw: calls.append((args, kw)), **p, sm_scale=0.1, **kwargs)
    assert len(calls) == 1
    args, kw = calls[0]
    assert args[0] is p["q_extend"] and args[3] is p["o_extend"] and args[15] == 0.1 and kw == kwargs
    assert (p["o_extend"] == 7.0).all()


def test_the_plugin_wraps_the_backends_extend_kernel():
    from types import SimpleNamespace

    from qflash.server.hooks import attention

    backend = SimpleNamespace(page_size=1, extend_attention_fwd=never_called)
    attention._wrap_prefill_kernel(None, backend)
    assert backend.extend_attention_fwd.__wrapped__.func is fp.flash_prefill
    assert backend.extend_attention_fwd.__wrapped__.args == (never_called,)
