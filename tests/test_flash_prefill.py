"""Fresh-prompt prefill attention through torch's SDPA (kernels/flash_prefill.py): causal attention over the new
tokens against float64, padding rows untouched, and every case it does not serve handed to SGLang's kernel
with its arguments unchanged. The H200 comparison with SGLang's extend kernel: test_flash_prefill_gpu.py."""

import pytest
import torch

from qflash.kernels import flash_prefill as fp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def problem(tokens, padded, heads=4, kv_heads=2, dim=64, prefix=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)  # noqa: E731
    return dict(q_extend=rand(padded, heads, dim), k_extend=rand(padded, kv_heads, dim), v_extend=rand(padded, kv_heads, dim),
                o_extend=torch.full((padded, heads, dim), 7.0, dtype=torch.bfloat16, device=DEVICE),
                k_buffer=rand(64, kv_heads, dim), v_buffer=rand(64, kv_heads, dim),
                qo_indptr=torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE),
                kv_indptr=torch.tensor([0, prefix], dtype=torch.int32, device=DEVICE),
                kv_indices=torch.arange(prefix, dtype=torch.int64, device=DEVICE),
                custom_mask=None, is_causal=True, mask_indptr=None, max_len_extend=tokens, k_scale=1.0, v_scale=1.0)


def reference(p, scale):
    n = p["max_len_extend"]
    q, k, v = (p[name][:n].double().cpu() for name in ("q_extend", "k_extend", "v_extend"))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


def never_called(*args, **kwargs):
    raise AssertionError("a plain fresh prefill reached SGLang's kernel")


@pytest.mark.parametrize("tokens, padded", [(37, 37), (37, 48)], ids=["exact", "graph-padded"])
def test_fresh_prefill_is_causal_attention(tokens, padded):
    p = problem(tokens, padded)
    fp.flash_prefill(never_called, **p, sm_scale=0.1, logit_cap=0.0, sliding_window_size=-1, sinks=None,
                     window_kv_offsets=None, xai_temperature_len=-1, page_size=1, score_mod=None, aux_tensors=None)
    assert (p["o_extend"][:tokens].double().cpu() - reference(p, 0.1)).abs().max().item() < 0.02
    assert (p["o_extend"][tokens:] == 7.0).all()  # the padding rows are left alone


@pytest.mark.parametrize("change", [
    dict(prefix=5), dict(custom_mask=True), dict(is_causal=False), dict(k_scale=0.5), dict(two_requests=True),
    dict(logit_cap=30.0), dict(sliding_window_size=16), dict(sinks=True), dict(lse_extend=True), dict(skip_prefix=True),
    dict(an_argument_it_does_not_know=1),
], ids=lambda change: next(iter(change)))
def test_what_it_does_not_serve_goes_to_sglang_unchanged(change):
    p = problem(16, 16, prefix=change.pop("prefix", 0))
    kwargs = {}
    for key, value in change.items():
        if key in ("custom_mask", "sinks", "lse_extend"):
            value = torch.ones(1, device=DEVICE)
        if key == "two_requests":
            p["qo_indptr"] = torch.tensor([0, 8, 16], dtype=torch.int32, device=DEVICE)
        elif key in p:
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
    attention._use_qflash_attention(None, backend)
    assert backend.extend_attention_fwd.__wrapped__.func is fp.flash_prefill
    assert backend.extend_attention_fwd.__wrapped__.args == (never_called,)
