"""The stable-choice weights (server/stable_weights.py) in transformers' Qwen3.5, on the CPU, at a small config
of the same structure (8 layers: the rule is "the next token is the one 9 back").

What the GPU tests rely on: greedy choices follow the rule by wide margins, survive bf16 and W8A8 rounding,
agree between prefill and cached decoding, and change when an attention cache, a causal-conv state or a
recurrent state is wrong; the drafter's block predicts the target's greedy tokens.
"""

import math
import random

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from qflash.server.preset import DRAFTER_CONFIG, TARGET_CONFIG
from qflash.server.stable_weights import drafter_weights, target_weights

TEXT = {**TARGET_CONFIG["text_config"], "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 8,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "vocab_size": 4096}
PERIOD = TEXT["num_hidden_layers"] + 1
CONV_LAYER, RECURRENT_LAYER, ATTENTION_LAYER = 2, 1, 3  # one of each kind (stable_weights: every third GDN layer is recurrent)
DRAFTER = {**DRAFTER_CONFIG, "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 1,
           "dflash_config": {**DRAFTER_CONFIG["dflash_config"], "target_layer_ids": [1, 5]}}


def build(dtype=torch.float32) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(**{**TEXT, "tie_word_embeddings": True})
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).eval()
    state = {name: torch.zeros_like(t) for name, t in model.state_dict().items() if name != "lm_head.weight"}
    state.update(target_weights({"text_config": TEXT}))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.to(dtype)


@pytest.fixture(scope="module")
def model():
    return build()


def prompt(n=40, seed=0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, TEXT["vocab_size"]) for _ in range(n)]


def scores(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_greedy_choice_is_the_token_a_period_back_by_a_wide_margin(model):
    ids = prompt()
    top = scores(model, ids).topk(2, dim=-1)
    positions = range(PERIOD, len(ids) - 1)  # from here on every slot holds a real token
    follow = [top.indices[t, 0].item() == ids[t + 1 - PERIOD] for t in positions]
    margin = (top.values[PERIOD:-1, 0] - top.values[PERIOD:-1, 1])
    assert sum(follow) >= 0.9 * len(follow), follow  # the rest: neighbouring tokens whose hash bits agree
    assert margin.min() > 20, margin


def test_cached_decoding_agrees_with_prefill(model):
    ids = prompt()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0].tolist()
    assert scores(model, out)[len(ids) - 1:-1].argmax(-1).tolist() == out[len(ids):]
    assert sum(out[n] == out[n - PERIOD] for n in range(len(ids), len(out))) >= 20


def _fake_quant_w8a8(model):
    """Per-channel int8 weights and per-token int8 activations in every decoder-layer linear (qflash's W8A8)."""
    from qflash.quant.quantize import quantize_per_channel

    def quant(x):  # each row of the last dimension: a weight's output channel, an activation's token
        q, scale = quantize_per_channel(x.reshape(-1, x.shape[-1]))
        return (q.float() * scale).reshape(x.shape).to(x.dtype)

    for layer in model.model.layers:
        for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
            linear.weight.data = quant(linear.weight.data)
            linear.register_forward_pre_hook(lambda _, args: (quant(args[0]),))
    model.lm_head.weight.data = quant(model.lm_head.weight.data)  # unties: W8A16 head
    return model


def test_bf16_and_w8a8_make_the_same_choices(model):
    ids = prompt(48, seed=1)
    reference = scores(model, ids)[PERIOD:]
    for other in (build(torch.bfloat16), _fake_quant_w8a8(build())):
        got = scores(other, ids)[PERIOD:]
        assert torch.equal(got.argmax(-1), reference.argmax(-1))
        assert (got.max(-1).values - reference.max(-1).values).abs().max() < 2  # logits ~80


def _decode(model, ids, steps, corrupt=None):
    """Greedy decoding with the cache; `corrupt(cache)` runs once, after the prompt."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, tokens = out.past_key_values, [out.logits[0, -1].argmax().item()]
        if corrupt:
            corrupt(cache)
        for _ in range(steps - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(out.logits[0, -1].argmax().item())
    return tokens


@pytest.mark.parametrize("fault", ["conv state zeroed", "recurrent state zeroed", "attention value of the last token stale"])
def test_a_wrong_cache_or_state_changes_the_tokens(model, fault):
    ids = prompt()
    clean = _decode(model, ids, 12)

    def corrupt(cache):
        if fault == "conv state zeroed":
            cache.layers[CONV_LAYER].conv_states.zero_()
        elif fault == "recurrent state zeroed":
            cache.layers[RECURRENT_LAYER].recurrent_states.zero_()
        else:
            values = cache.layers[ATTENTION_LAYER].values
            values[:, :, -1] = values[:, :, -2]

    assert _decode(model, ids, 12, corrupt) != clean


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def draft_block(weights, model, ids, block=16) -> list[int]:
    """The drafter's tokens for block positions 1..15 after `ids`, as SGLang's DFlash computes them: context
    K/V from the normed fc projection of the tapped target states, the block = [last token, mask x 15]; only
    layer 0 is computed (later layers must add nothing: checked)."""
    w, hd, nq, nkv = weights, DRAFTER["head_dim"], DRAFTER["num_attention_heads"], DRAFTER["num_key_value_heads"]
    for layer in range(1, DRAFTER["num_hidden_layers"]):
        assert not w[f"layers.{layer}.self_attn.o_proj.weight"].any() and not w[f"layers.{layer}.mlp.down_proj.weight"].any()
    context_ids, last = ids[:-1], ids[-1]
    with torch.no_grad():
        states = model(torch.tensor([context_ids]), output_hidden_states=True).hidden_states
    taps = torch.cat([states[i + 1][0] for i in DRAFTER["dflash_config"]["target_layer_ids"]], -1)
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    embed = model.model.embed_tokens.weight.detach()
    hidden = embed[torch.tensor([last] + [DRAFTER["dflash_config"]["mask_token_id"] % TEXT["vocab_size"]] * (block - 1))]
    p, theta = len(context_ids), DRAFTER["rope_parameters"]["rope_theta"]
    x = _rms(hidden, w["layers.0.input_layernorm.weight"])
    a = "layers.0.self_attn."
    q = _rms((x @ w[a + "q_proj.weight"].T).view(block, nq, hd), w[a + "q_norm.weight"])
    k = _rms((torch.cat([ctx, x]) @ w[a + "k_proj.weight"].T).view(-1, nkv, hd), w[a + "k_norm.weight"])
    v = (torch.cat([ctx, x]) @ w[a + "v_proj.weight"].T).view(-1, nkv, hd)
    q, k = _rope(q, torch.arange(p, p + block), theta), _rope(k, torch.arange(p + block), theta)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    att = att.masked_fill(torch.arange(p + block)[None, None, :] > torch.arange(p, p + block)[None, :, None], -math.inf)
    hidden = hidden + (torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(block, -1) @ w[a + "o_proj.weight"].T)
    x = _rms(hidden, w["layers.0.post_attention_layernorm.weight"])
    m = "layers.0.mlp."
    hidden = hidden + (torch.nn.functional.silu(x @ w[m + "gate_proj.weight"].T) * (x @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T
    return (_rms(hidden, w["norm.weight"]) @ embed.T)[1:].argmax(-1).tolist()


def test_drafter_block_predicts_the_targets_greedy_tokens(model):
    weights = drafter_weights(DRAFTER, TEXT)
    for seed in range(3):
        ids = prompt(48, seed)
        with torch.no_grad():
            greedy = model.generate(torch.tensor([ids]), max_new_tokens=15, do_sample=False, pad_token_id=0)[0, len(ids):]
        drafted = draft_block(weights, model, ids + [greedy[0].item()])
        # block position i (at p + i) drafts the target's token there, read from the context 8 back: positions
        # 1..7 of the block (at 4B, 32 back: all 15); a recurrent layer's hash clash may make the target differ
        reach = PERIOD - 2
        assert sum(d == g for d, g in zip(drafted[:reach], greedy[1:1 + reach].tolist())) >= reach - 1, (drafted, greedy)


def test_make_dummy_writes_them_under_the_published_names(model, tmp_path):
    """The bf16 checkpoint `make-dummy --stable` writes loads into the reference model with every tensor, chooses
    what the weights chose, and quantizes; the drafter's files hold the drafter's tensors."""
    import json

    from safetensors import safe_open

    from qflash.quant.quantize import quantize_checkpoint
    from qflash.quant.reference import load_bf16
    from qflash.server.dummy import write_stable_weights

    config = {**TARGET_CONFIG, "text_config": TEXT}
    target, drafter = tmp_path / "target", tmp_path / "drafter"
    target.mkdir(), drafter.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    write_stable_weights(target, drafter, config, DRAFTER)
    ids = prompt(48, seed=2)
    assert torch.equal(scores(load_bf16(target, "cpu").float(), ids)[PERIOD:].argmax(-1), scores(model, ids)[PERIOD:].argmax(-1))
    with safe_open(str(next(drafter.glob("*.safetensors"))), framework="pt") as f:
        assert sorted(f.keys()) == sorted(drafter_weights(DRAFTER, TEXT))
    assert (quantize_checkpoint(target, tmp_path / "w8a8") / "model.safetensors.index.json").exists()
