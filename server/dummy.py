"""`qflash make-dummy`: a Qwen3.5-4B target and a DFlash drafter that SGLang serves with `--load-format dummy`.

No weights can be downloaded, so the directories hold the exact published configs and an offline
tokenizer; SGLang fills the weights at load time. A real checkpoint directory has the same layout, and
`--weights` writes random ones of the real names and shapes for the quantizer. `w8a8/Qwen3.5-4B` is the
target as `qflash quantize` would write it (same folder name, so it is served as `Qwen3.5-4B` too).
Each folder gets a marker file; a folder that holds a model without it is never written into.
"""

import json
import math
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from qflash.quant.layout import WEIGHT_FILES, checkpoint_tensors, quantized_config
from qflash.quant.quantize import ShardWriter
from qflash.server.errors import UserError
from qflash.server.preset import DRAFTER_CONFIG, EOS_TOKEN_ID, SPECIAL_TOKENS, TARGET_CONFIG
from qflash.server.tokenizer import build_tokenizer

TARGET_DIR = "Qwen3.5-4B"
DRAFTER_DIR = "Qwen3.5-4B-DFlash"
W8A8_DIR = "w8a8"
MARKER = "qflash-dummy.txt"
MODEL_FILES = ("config.json", "tokenizer.json", *WEIGHT_FILES)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def holds_other_model(path: Path) -> bool:
    """True if `path` holds model files that `make-dummy` did not write (no marker): they are a user's."""
    path = Path(path)
    return not (path / MARKER).exists() and any(any(path.glob(pattern)) for pattern in MODEL_FILES)


def make_dummy(root: Path, weights: bool = False) -> tuple[Path, Path]:
    """Write `<root>/Qwen3.5-4B`, `<root>/Qwen3.5-4B-DFlash` and `<root>/w8a8/Qwen3.5-4B`; return the first two.

    With `weights`, the target also gets random bf16 weights, so `qflash quantize` has a checkpoint to read.
    Raises UserError, before writing anything, if one of the folders holds a model make-dummy did not write."""
    import transformers

    root = Path(root)
    target, drafter, w8a8 = root / TARGET_DIR, root / DRAFTER_DIR, root / W8A8_DIR / TARGET_DIR
    taken = [str(p) for p in (target, drafter, w8a8) if holds_other_model(p)]
    if taken:
        raise UserError(f"{', '.join(taken)} already hold{'s' if len(taken) == 1 else ''} a model that make-dummy did not "
                        "write; pick another folder")
    tokenizer = build_tokenizer()
    generation = {"eos_token_id": [SPECIAL_TOKENS["<|im_end|>"], EOS_TOKEN_ID], "do_sample": False}
    for path, config in ((target, TARGET_CONFIG), (drafter, DRAFTER_CONFIG), (w8a8, quantized_config(TARGET_CONFIG))):
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).write_text("Written by `qflash make-dummy`: published configs, an offline tokenizer, random "
                                   "weights (or none: served with --load-format dummy).\n")
        # transformers_version as save_pretrained writes it: without it transformers takes the local tokenizer for
        # a Mistral one and warns that its regex is wrong
        _write_json(path / "config.json", {**config, "transformers_version": transformers.__version__})
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



def add_arguments(p) -> None:
    p.add_argument("dir", type=Path, help="folder to write Qwen3.5-4B/, Qwen3.5-4B-DFlash/ and w8a8/Qwen3.5-4B/ into")
    p.add_argument("--weights", action="store_true", help="also write random bf16 target weights (~9.3 GB, ~2 min)")


def run(args, extra) -> int:
    target, drafter = make_dummy(args.dir, weights=args.weights)
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0
