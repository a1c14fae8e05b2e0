"""`qflash quality BF16_DIR W8A8_DIR`: what W8A8 and the W8A16 lm_head cost in accuracy, kernels aside.

Builds the text model with transformers from the bf16 checkpoint and runs a fixed sequence of token ids;
then loads the quantized checkpoint into it, every quantized linear swapped for qflash's W8A8 arithmetic
(int8 weights, per-token int8 activations rounded as the kernels round them, fp32 scaling), the lm_head
for its int8 weight-only form, the other tensors (norms, smoothed or not) copied, and runs the same ids.
Reports the relative error of the final hidden states and the logits, and how often the greedy token agrees.
"""

import json
import time
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM

from qflash.quant.reference import load_bf16, text_tensors
from qflash.server.errors import UserError


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


def load_w8a8(model: Qwen3_5ForCausalLM, path: Path) -> int:
    """Load the quantized checkpoint into `model`: each linear with an int8 weight becomes a W8A8Linear
    (the lm_head weight-only), every other tensor (norms, possibly smoothed) is copied in; return the
    number of linears swapped."""
    tensors = dict(text_tensors(path))
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


def add_arguments(p) -> None:
    p.add_argument("bf16", type=Path, help="the bf16 checkpoint that was quantized")
    p.add_argument("w8a8", type=Path, help="its `qflash quantize` output")
    p.add_argument("--positions", type=int, default=256, help="token positions compared (default 256)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def run(args, extra) -> int:
    for folder in (args.bf16, args.w8a8):
        if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
            raise UserError(f"{folder} is not a checkpoint folder (config.json and *.safetensors)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda, but no CUDA GPU is visible", code=1)
    print(json.dumps(compare(args.bf16, args.w8a8, args.positions, args.device), indent=2))
    return 0
