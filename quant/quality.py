"""`qflash quality BF16_DIR W8A8_DIR`: what W8A8 and the W8A16 lm_head cost in accuracy, kernels aside.

Builds the text model with transformers from the bf16 checkpoint and runs a fixed sequence of token ids;
then loads the quantized checkpoint into it, every quantized linear swapped for qflash's W8A8 arithmetic
(int8 weights, per-token int8 activations rounded as the kernels round them, fp32 scaling), the lm_head
for its int8 weight-only form, the other tensors (norms, smoothed or not) copied, and runs the same ids. Reports the relative error of the
final hidden states and the logits, and how often the greedy token agrees.
"""

import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from qflash.quant.layout import DROPPED

_LANGUAGE_MODEL = "model.language_model."


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 as qflash's kernels do it: q = round-half-away(x * (127 / absmax)), scale absmax / 127."""
    absmax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    q = x.float() * (torch.full_like(absmax, 127.0) / absmax)
    return torch.where(q >= 0, q + 0.5, q - 0.5).trunc(), absmax / 127.0


class W8A8Linear(nn.Module):
    """y = (x_q @ w_q^T) * x_scale * w_scale, the W8A8 kernel's arithmetic in fp32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, quantize_input: bool = True):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.reshape(1, -1).float())
        self.quantize_input = quantize_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_input:
            q, x_scale = quantize_tokens(x)
            return ((q @ self.weight.float().T) * x_scale * self.scale).to(x.dtype)
        return ((x.float() @ self.weight.float().T) * self.scale).to(x.dtype)  # W8A16: bf16 input as it is


def _tensors(path: Path):
    """The text model's tensors of a checkpoint, under the text model's names."""
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if not name.startswith(DROPPED):
                    yield name.replace(_LANGUAGE_MODEL, "model."), f.get_tensor(name)


def _text_config(path: Path) -> Qwen3_5TextConfig:
    config = json.loads((path / "config.json").read_text())
    text = Qwen3_5TextConfig(**{**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)})
    text._attn_implementation = "eager"
    return text


def load_bf16(path: Path, device: str) -> Qwen3_5ForCausalLM:
    config = _text_config(path)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    missing, unexpected = model.load_state_dict(dict(_tensors(path)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{path}: checkpoint does not match the text model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if "lm_head.weight" in missing:
        model.tie_weights()
    return model.eval()


def load_w8a8(model: Qwen3_5ForCausalLM, path: Path) -> int:
    """Load the quantized checkpoint into `model`: each linear with an int8 weight becomes a W8A8Linear
    (the lm_head weight-only), every other tensor (norms, possibly smoothed) is copied in; return the
    number of linears swapped."""
    tensors = dict(_tensors(path))
    swapped = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name + ".weight_scale" in tensors:
            w, s = tensors.pop(name + ".weight"), tensors.pop(name + ".weight_scale")
            parent, _, attr = name.rpartition(".")
            swap = W8A8Linear(w.to(module.weight.device), s.to(module.weight.device), quantize_input=name != "lm_head")
            setattr(model.get_submodule(parent) if parent else model, attr, swap)
            swapped += 1
    _, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected:
        raise ValueError(f"{path}: tensors the text model does not have: {unexpected[:5]}")
    return swapped


@torch.inference_mode()
def final_states(model: Qwen3_5ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.update(hidden=o))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    return captured["hidden"][0].float(), logits[0].float()


def relative_errors(a: torch.Tensor, ref: torch.Tensor) -> dict:
    per_position = (a - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"relative": ((a - ref).norm() / ref.norm()).item(), "max_per_position": per_position.max().item()}


def compare(bf16_dir: Path, w8a8_dir: Path, positions: int = 256, device: str = "cpu", seed: int = 0) -> dict:
    start = time.monotonic()
    model = load_bf16(Path(bf16_dir), device)
    vocab = model.config.vocab_size
    ids = torch.randint(min(1000, vocab // 2), vocab, (1, positions), generator=torch.Generator().manual_seed(seed)).to(device)
    hidden_ref, logits_ref = final_states(model, ids)
    swapped = load_w8a8(model, Path(w8a8_dir))
    hidden, logits = final_states(model, ids)
    return {"positions": positions, "quantized_linears": swapped,
            "hidden_states": relative_errors(hidden, hidden_ref), "logits": relative_errors(logits, logits_ref),
            "greedy_agreement": (logits.argmax(-1) == logits_ref.argmax(-1)).float().mean().item(),
            "seconds": round(time.monotonic() - start, 1)}
