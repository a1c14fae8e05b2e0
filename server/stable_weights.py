"""Weights with stable greedy choices (`qflash make-dummy --stable`): a test checkpoint that can catch a broken
speculative path.

A random Qwen3.5 is chaotic: kernel rounding flips half its greedy tokens, and SGLang's own dummy weights emit
one token forever. These weights make the target a shift register instead, of the exact published shapes:
- each token's embedding is a random +-1 code of CODE_BITS bits in slot 0 of the residual stream, plus a
  constant dimension (ONE) and a flag (SPECIAL: -1 for special tokens);
- layer l copies slot l of the previous position into slot l+1 (the last layer into slot 0, which layer 0's
  MLP has emptied), so after the 32 layers slot 0 holds the code of the token 32 back, and the tied lm_head
  picks it: the next token is the one 33 places back, by 13-35 logits over the runner-up (H200, W8A8);
- the copy to the previous position goes through every kind of state a serving bug can corrupt: attention
  layers attend one position back (RoPE-phased constant queries and keys); most Gated-DeltaNet layers read it
  through the causal conv's state; every third one stores each token's code in its recurrent state under a
  one-hot key (a few bits of the code) and reads it back with the previous token's key, so the output depends
  on the state committed one step earlier;
- the drafter's layer 0 attends the context 32 positions back, where the target's tapped layer-1 hidden state
  holds the code of the token the rule asks for, so real verification accepts most of each block.
Every value a GEMM meets is +-1 or 0 times one scale per row, so per-channel int8 weights and per-token int8
activations represent them exactly; the remaining rounding is far below the margins. Two neighbouring tokens
whose hashed bits agree make a recurrent layer read the current token instead: each of the 8 hashes its own 7
bits, so about 6% of positions follow that, deterministically. The drafter cannot know, so real verification
rejects drafts there (faults in the accept path show), and tests compare servers with each other, not with the
rule.
"""

import math

import torch

CODE_BITS = 64  # bits of a token's code; 32 slots of them fill 2,048 of the 2,560 hidden dimensions
SPECIAL_PENALTY = 16.0  # final-norm gain of the SPECIAL flag: special tokens lose ~35 logits, never emitted
ATTENTION_GAIN = {"target": 4.5, "drafter": 5.5}  # q/k norm gains: the peak's score beats any other position by >40
SILU_ON = 4.0  # pre-activation scale of an "on" GDN channel (silu(8) ~ 8, silu(0) = 0)
BETA_LOGIT = 24.0  # sigmoid(24) ~ 1: each delta-rule write replaces what its key held
A_LOG = -30.0  # exp(-30) ~ 0: no decay of the recurrent state
GATE_LOGIT = 16.0  # attention output gate, sigmoid(16) ~ 1
SEED = 20261201


def code_bits(text: dict) -> int:
    """Bits per slot: CODE_BITS, or fewer where a small test config has no room for them."""
    return min(CODE_BITS, (text["hidden_size"] - 2) // text["num_hidden_layers"], text["linear_value_head_dim"] // 2)


def hash_bits(text: dict) -> int:
    """Bits a recurrent layer hashes a code to: one key per dimension of a GDN key head."""
    return int(math.log2(text["linear_key_head_dim"]))


def token_codes(vocab: int, bits: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 2, (vocab, bits), generator=g, dtype=torch.int8) * 2 - 1


class Residual:
    """Where things sit in the residual stream: slot j holds the code of the token j positions back."""

    def __init__(self, text: dict):
        self.h, self.layers, self.bits = text["hidden_size"], text["num_hidden_layers"], code_bits(text)
        self.one, self.special = self.layers * self.bits, self.layers * self.bits + 1

    def slot(self, j: int) -> slice:
        return slice(j * self.bits, (j + 1) * self.bits)

    def gain(self, filled: int) -> float:
        """What RMS normalisation makes of a +-1 entry when `filled` slots, ONE and SPECIAL are set."""
        return math.sqrt(self.h / (filled * self.bits + 2))


def _rope_pattern(head_dim: int, rotary: int, theta: float, peak: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Constant query and key of one head whose score, after rotary embedding, peaks `peak` positions back.
    Pair i (dims i, i + rotary/2) turns at w_i; with weights 1/(i+1) every other distance, up to the longest
    context, scores at least 14% of the peak lower."""
    half = rotary // 2
    w = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary)
    amp = (1.0 / torch.arange(1, half + 1, dtype=torch.float64)).sqrt()
    q, k = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    q[:half], q[half:rotary] = amp * torch.cos(w * peak), -amp * torch.sin(w * peak)
    k[:half] = amp
    return q, k


def _silu(x: float) -> float:
    return x / (1 + math.exp(-x))


class _Tensors(dict):
    """name -> float32 tensor being built; anything not set is written as zeros."""

    def at(self, name: str, shape: tuple) -> torch.Tensor:
        if name not in self:
            self[name] = torch.zeros(shape)
        return self[name]


def _gdn_layer(t: _Tensors, p: str, text: dict, r: Residual, layer: int, recurrent: int | None) -> None:
    """`recurrent`: which recurrent layer this is (None: a conv-shift layer); it picks the code bits it hashes."""
    nk, dk, nv, dv = (text[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim"))
    kernel, key_dim = text["linear_conv_kernel_dim"], nk * dk
    m = r.gain(max(layer, 1))
    src, dst = r.slot(layer), r.slot((layer + 1) % r.layers)
    qkv = t.at(p + "in_proj_qkv.weight", (2 * key_dim + nv * dv, r.h))
    conv = t.at(p + "conv1d.weight", (2 * key_dim + nv * dv, 1, kernel))
    now, before = kernel - 1, kernel - 2  # conv taps: this position, the previous one
    v0 = 2 * key_dim  # value head 0, read through key head 0
    for b in range(r.bits):  # value: each bit as an on/off pair, so every head's RMS is the same at every position
        for row, sign in ((v0 + 2 * b, 1), (v0 + 2 * b + 1, -1)):
            qkv[row, r.one], qkv[row, src.start + b] = SILU_ON / m, sign * SILU_ON / m
            conv[row, 0, before if recurrent is None else now] = 1
    if recurrent is not None:  # key: one-hot of some code bits at this position; query: the same of the previous one
        nbits = hash_bits(text)
        first = src.start + recurrent * nbits % (r.bits - nbits + 1)  # each layer its own bits: clashes independent
        pattern = torch.tensor([[1 - 2 * ((i >> b) & 1) for b in range(nbits)] for i in range(dk)], dtype=torch.float32)
        for rows, tap in ((slice(0, dk), before), (slice(key_dim, key_dim + dk), now)):
            qkv[rows, first:first + nbits] = pattern * 3 * SILU_ON / m
            qkv[rows, r.one] = -(nbits - 1) * 3 * SILU_ON / m
            conv[rows, 0, tap] = 1
    else:  # query = key = a constant unit vector: the state holds the latest value, read back at once
        for row in (0, key_dim):
            qkv[row, r.one] = SILU_ON / m
            conv[row, 0, now] = 1
    t.at(p + "in_proj_z.weight", (nv * dv, r.h))[:dv, r.one] = 2 * SILU_ON / m
    t.at(p + "in_proj_b.weight", (nv, r.h))[:, r.one] = BETA_LOGIT / m
    t[p + "A_log"] = torch.full((nv,), A_LOG)
    t[p + "norm.weight"] = torch.ones(dv)
    out = t.at(p + "out_proj.weight", (r.h, nv * dv))
    on = math.sqrt(dv / r.bits) * _silu(2 * SILU_ON)  # an "on" channel after the gated RMSNorm (bits of dv are on)
    for b in range(r.bits):
        out[dst.start + b, 2 * b], out[dst.start + b, 2 * b + 1] = 1 / on, -1 / on


def _attention_layer(t: _Tensors, p: str, text: dict, r: Residual, layer: int) -> None:
    hd, nq = text["head_dim"], text["num_attention_heads"]
    rope = text.get("rope_parameters") or {}
    rotary = int(hd * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    q, k = _rope_pattern(hd, rotary, rope.get("rope_theta", 1e7), 1)  # one position back
    m = r.gain(layer)
    src, dst = r.slot(layer), r.slot((layer + 1) % r.layers)
    qp = t.at(p + "q_proj.weight", (2 * nq * hd, r.h))
    qp[:hd, r.one] = q.float()  # head 0's query (its scale is normalised away by q_norm)
    qp[hd:2 * hd, r.one] = GATE_LOGIT / m
    t.at(p + "k_proj.weight", (text["num_key_value_heads"] * hd, r.h))[:hd, r.one] = k.float()
    v = t.at(p + "v_proj.weight", (text["num_key_value_heads"] * hd, r.h))
    o = t.at(p + "o_proj.weight", (r.h, nq * hd))
    for b in range(r.bits):
        v[b, src.start + b] = 1 / m
        o[dst.start + b, b] = 1
    for norm in ("q_norm.weight", "k_norm.weight"):  # Gemma RMSNorm: scales by 1 + weight
        t[p + norm] = torch.full((hd,), ATTENTION_GAIN["target"] - 1)


def _clear_slot0_mlp(t: _Tensors, p: str, text: dict, r: Residual) -> None:
    """Layer 0's MLP subtracts slot 0 (the token's own code, now copied on) so the last layer can write there.
    silu(u) - silu(-u) = u makes an exact linear map of a SwiGLU MLP."""
    m = r.gain(2)
    gate, up = t.at(p + "mlp.gate_proj.weight", (text["intermediate_size"], r.h)), t.at(p + "mlp.up_proj.weight", (text["intermediate_size"], r.h))
    down = t.at(p + "mlp.down_proj.weight", (r.h, text["intermediate_size"]))
    for b in range(r.bits):
        for row, sign in ((2 * b, 1), (2 * b + 1, -1)):
            gate[row, b], up[row, r.one] = sign / m, 1 / m
            down[b, row] = -sign


def target_weights(config: dict) -> dict[str, torch.Tensor]:
    """The text model's tensors under the text model's names (`model.layers.N...`, `model.embed_tokens.weight`),
    float32; tensors not listed are zeros. Gemma norms scale by 1 + weight."""
    text = config["text_config"]
    r, t = Residual(text), _Tensors()
    from qflash.server.preset import SPECIAL_TOKENS

    embed = t.at("model.embed_tokens.weight", (text["vocab_size"], r.h))
    embed[:, r.slot(0)] = token_codes(text["vocab_size"], r.bits).float()
    embed[:, r.one] = 1
    embed[:, r.special] = 1
    embed[min(SPECIAL_TOKENS.values()):, r.special] = -1
    gdn = 0
    for layer, kind in enumerate(text["layer_types"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.zeros(r.h)
        t[p + "post_attention_layernorm.weight"] = torch.zeros(r.h)
        if kind == "full_attention":
            _attention_layer(t, p + "self_attn.", text, r, layer)
        else:
            _gdn_layer(t, p + "linear_attn.", text, r, layer, recurrent=gdn // 3 if gdn % 3 == 1 else None)
            gdn += 1
    _clear_slot0_mlp(t, "model.layers.0.", text, r)
    norm = torch.full((r.h,), -1.0)  # the final norm keeps slot 0 (the answer) and the SPECIAL flag only
    norm[r.slot(0)], norm[r.special] = 0, SPECIAL_PENALTY - 1
    t["model.norm.weight"] = norm
    return t


def drafter_weights(drafter: dict, target_text: dict) -> dict[str, torch.Tensor]:
    """The DFlash drafter's tensors (`fc.weight`, `layers.N...`), float32; plain RMSNorms (scale by weight).
    Layer 0 attends the context 32 positions back (one per target layer), whose tapped target layer-1 state
    holds in slot 1 the code of the token 33 back from the block position: the target's greedy token there. Its MLP moves that code into
    slot 0, where the target's lm_head reads it. Layers 1-5 add nothing."""
    r, t = Residual(target_text), _Tensors()
    h, hd, nq, nkv = drafter["hidden_size"], drafter["head_dim"], drafter["num_attention_heads"], drafter["num_key_value_heads"]
    taps, ffn = len(drafter["dflash_config"]["target_layer_ids"]), drafter["intermediate_size"]
    assert drafter["dflash_config"]["target_layer_ids"][0] == 1, "the context code is read from target layer 1"
    feature = r.slot(1)
    fc = t.at("fc.weight", (h, taps * r.h))
    for b in range(r.bits):
        fc[feature.start + b, feature.start + b] = 1
    fc[r.one, r.one] = 1
    t["hidden_norm.weight"] = torch.ones(h)
    context_gain = math.sqrt(h / (r.bits + 1))  # the normalised context: one code and ONE
    # block position i is the token PERIOD back; context position s holds in slot 1 the token at s - 1
    q, k = _rope_pattern(hd, hd, (drafter.get("rope_parameters") or {}).get("rope_theta", 1e7), r.layers)
    for layer in range(drafter["num_hidden_layers"]):
        p = f"layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"] = torch.ones(h)
        for norm in ("q_norm", "k_norm"):
            t[p + f"self_attn.{norm}.weight"] = torch.full((hd,), ATTENTION_GAIN["drafter"])
        for name, shape in (("q_proj", (nq * hd, h)), ("k_proj", (nkv * hd, h)), ("v_proj", (nkv * hd, h)), ("o_proj", (h, nq * hd))):
            t.at(p + f"self_attn.{name}.weight", shape)
        for name, shape in (("gate_proj", (ffn, h)), ("up_proj", (ffn, h)), ("down_proj", (h, ffn))):
            t.at(p + f"mlp.{name}.weight", shape)
    p = "layers.0."
    t[p + "self_attn.q_proj.weight"][:hd, r.one] = q.float()
    t[p + "self_attn.k_proj.weight"][:hd, r.one] = k.float()
    for b in range(r.bits):
        t[p + "self_attn.v_proj.weight"][b, feature.start + b] = 1
        t[p + "self_attn.o_proj.weight"][feature.start + b, b] = 1 / context_gain
    m = math.sqrt(h / (2 * r.bits + 2))  # MLP input: slot 0 (the block token), slot 1 (the answer), ONE, SPECIAL
    gate, up, down = (t[p + f"mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    for b in range(r.bits):  # slot 0 += slot 1 - slot 0
        for row, sign in ((2 * b, 1), (2 * b + 1, -1)):
            gate[row, feature.start + b], gate[row, b], up[row, r.one] = sign / m, -sign / m, 1 / m
            down[b, row] = sign
    norm = torch.zeros(h)
    norm[r.slot(0)] = 1
    t["norm.weight"] = norm
    return t
