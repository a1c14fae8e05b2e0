"""The bf16 text model of a Qwen3.5 checkpoint, in transformers: the reference that SmoothQuant calibrates on
(`qflash quantize --smooth`) and that `qflash quality` compares qflash's arithmetic with."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from qflash.quant.layout import LM_HEAD, text_name


def text_tensors(path: Path):
    """(name, tensor) of a checkpoint's text model, under the text model's names, one tensor at a time."""
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if text_name(name) is not None:
                    yield text_name(name), f.get_tensor(name)


def text_config(path: Path) -> Qwen3_5TextConfig:
    config = json.loads((Path(path) / "config.json").read_text())
    text = Qwen3_5TextConfig(**{**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)})
    text._attn_implementation = "eager"
    return text


def load_bf16(path: Path, device: str) -> Qwen3_5ForCausalLM:
    """The text model with the checkpoint's bf16 weights (the lm_head tied to the embeddings if it has none)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(text_config(path))
    finally:
        torch.set_default_dtype(torch.float32)
    missing, unexpected = model.load_state_dict(dict(text_tensors(path)), strict=False)
    if unexpected or set(missing) - {LM_HEAD}:
        raise ValueError(f"{path}: checkpoint does not match the text model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if LM_HEAD in missing:
        model.tie_weights()
    return model.eval()
