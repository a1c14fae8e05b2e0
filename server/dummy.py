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

from qflash.quant.layout import WEIGHT_FILES, checkpoint_tensors, quantized_config, text_name
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


def make_dummy(root: Path, weights: bool = False, stable: bool = False) -> tuple[Path, Path]:
    """Write `<root>/Qwen3.5-4B`, `<root>/Qwen3.5-4B-DFlash` and `<root>/w8a8/Qwen3.5-4B`; return the first two.

    With `weights`, the target also gets random bf16 weights, so `qflash quantize` has a checkpoint to read.
    With `stable`, target and drafter get the weights of server/stable_weights.py, and w8a8/ their quantized
    target. Raises UserError, before writing anything, if one of the folders holds a model make-dummy did not
    write."""
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
    if weights and not stable:
        write_random_weights(target)
    if stable:
        write_stable_weights(target, drafter)
        from qflash.quant.quantize import quantize_checkpoint

        quantize_checkpoint(target, w8a8, force=True)
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


def _write(folder: Path, tensors: list, make, desc: str) -> None:
    """Shards of `make(name, shape, dtype)` for each (name, shape, dtype) of `tensors`."""
    writer = ShardWriter(Path(folder))
    total = sum(math.prod(shape) for _, shape, _ in tensors)
    with tqdm(total=total, desc=desc, unit="param", unit_scale=True) as progress:
        for name, shape, dtype in tensors:
            writer.add(name, make(name, shape, dtype))
            progress.update(math.prod(shape))
    writer.close()


def write_random_weights(target: Path, config: dict = TARGET_CONFIG) -> None:
    """A random safetensors checkpoint with the published tensor names and shapes (~9.3 GB at 4B)."""
    _write(target, checkpoint_tensors(config), _random_tensor, "random weights")


def write_stable_weights(target: Path, drafter: Path, config: dict = TARGET_CONFIG, drafter_config: dict = DRAFTER_CONFIG) -> None:
    """The bf16 target (published names and shapes; the vision tower and MTP head zero) and drafter of
    server/stable_weights.py."""
    from qflash.server.stable_weights import drafter_weights, target_weights

    built = target_weights(config)

    def target_tensor(name, shape, dtype):
        tensor = built.pop(text_name(name), None) if text_name(name) else None
        if tensor is None:
            return torch.zeros(shape, dtype=dtype)
        assert tuple(tensor.shape) == tuple(shape), (name, tensor.shape, shape)
        return tensor.to(dtype)

    _write(target, checkpoint_tensors(config), target_tensor, "stable target weights")
    assert not built, f"built tensors the checkpoint does not have: {sorted(built)[:5]}"
    draft = drafter_weights(drafter_config, config["text_config"])
    _write(drafter, [(name, tuple(t.shape), torch.bfloat16) for name, t in draft.items()],
           lambda name, shape, dtype: draft[name].to(dtype), "stable drafter weights")



def add_arguments(p) -> None:
    p.add_argument("dir", type=Path, help="folder to write Qwen3.5-4B/, Qwen3.5-4B-DFlash/ and w8a8/Qwen3.5-4B/ into")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--weights", action="store_true", help="also write random bf16 target weights (~9.3 GB, ~2 min)")
    kind.add_argument("--stable", action="store_true",
                      help="write weights whose greedy choices are stable and context-dependent (a test checkpoint that "
                           "can catch a broken speculative path), the drafter's, and the quantized target in w8a8/ "
                           "(~14 GB, a few minutes)")


def run(args, extra) -> int:
    target, drafter = make_dummy(args.dir, weights=args.weights, stable=args.stable)
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0
