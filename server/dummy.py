"""`qflash make-dummy`: a Qwen3.5-4B target and a DFlash drafter that SGLang serves with `--load-format dummy`.

No weights can be downloaded, so the directories hold the exact published configs and an offline
tokenizer; SGLang fills the weights at load time. A real checkpoint directory has the same layout, and
`--weights` writes random ones of the real names and shapes for the quantizer. `w8a8/Qwen3.5-4B` is the
target as `qflash quantize` would write it (same folder name, so it is served as `Qwen3.5-4B` too).
"""

import json
import math
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from qflash.quant.layout import checkpoint_tensors
from qflash.quant.quantize import ShardWriter, quantized_config
from qflash.server.preset import DRAFTER_CONFIG, EOS_TOKEN_ID, SPECIAL_TOKENS, TARGET_CONFIG
from qflash.server.tokenizer import build_tokenizer

TARGET_DIR = "Qwen3.5-4B"
DRAFTER_DIR = "Qwen3.5-4B-DFlash"
W8A8_DIR = "w8a8"


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_dummy(root: Path, weights: bool = False) -> tuple[Path, Path]:
    """Write `<root>/Qwen3.5-4B`, `<root>/Qwen3.5-4B-DFlash` and `<root>/w8a8/Qwen3.5-4B`; return the first two.

    With `weights`, the target also gets random bf16 weights, so `qflash quantize` has a checkpoint to read."""
    root = Path(root)
    target, drafter = root / TARGET_DIR, root / DRAFTER_DIR
    tokenizer = build_tokenizer()
    generation = {"eos_token_id": [SPECIAL_TOKENS["<|im_end|>"], EOS_TOKEN_ID], "do_sample": False}
    w8a8 = root / W8A8_DIR / TARGET_DIR
    for path, config in ((target, TARGET_CONFIG), (drafter, DRAFTER_CONFIG), (w8a8, quantized_config(TARGET_CONFIG))):
        path.mkdir(parents=True, exist_ok=True)
        _write_json(path / "config.json", config)
        tokenizer.save_pretrained(path)
    for path in (target, w8a8):
        _write_json(path / "generation_config.json", generation)
    if weights:
        write_random_weights(target)
    return target, drafter


def _random_tensor(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Initial values of the tensor's kind: N(0, 0.02) matrices, 1+w norms at 0, plain norms at 1."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=g).log_().to(dtype)
    if name.endswith(("dt_bias", "linear_attn.norm.weight")):
        return torch.ones(shape, dtype=dtype)
    if len(shape) == 1:  # Gemma-style RMSNorm (1 + w) weights and biases
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape).normal_(0, 0.02, generator=g).to(dtype)


def write_random_weights(target: Path, config: dict = TARGET_CONFIG) -> None:
    """A random safetensors checkpoint with the published tensor names and shapes (~9.3 GB at 4B)."""
    tensors = checkpoint_tensors(config)
    writer = ShardWriter(Path(target))
    total = sum(math.prod(shape) for _, shape, _ in tensors)
    with tqdm(total=total, desc="random weights", unit="param", unit_scale=True) as progress:
        for name, shape, dtype in tensors:
            writer.add(name, _random_tensor(name, shape, dtype))
            progress.update(math.prod(shape))
    writer.close()


def is_dummy_dir(path: Path) -> bool:
    """True if `path` holds a config and tokenizer but no weights (serve it with --load-format dummy)."""
    path = Path(path)
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").exists() and (path / "tokenizer.json").exists() and not has_weights
