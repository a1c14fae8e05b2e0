"""`qflash make-dummy`: a Qwen3.5-4B target and a DFlash drafter that SGLang serves with `--load-format dummy`.

No weights can be downloaded, so the directories hold the exact published configs and an offline
tokenizer; SGLang fills the weights at load time. A real checkpoint directory has the same layout.
"""

import json
from pathlib import Path

from qflash.server.preset import DRAFTER_CONFIG, EOS_TOKEN_ID, SPECIAL_TOKENS, TARGET_CONFIG
from qflash.server.tokenizer import build_tokenizer

TARGET_DIR = "Qwen3.5-4B"
DRAFTER_DIR = "Qwen3.5-4B-DFlash"


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_dummy(root: Path) -> tuple[Path, Path]:
    """Write `<root>/Qwen3.5-4B` and `<root>/Qwen3.5-4B-DFlash`; return (target, drafter) paths."""
    root = Path(root)
    target, drafter = root / TARGET_DIR, root / DRAFTER_DIR
    tokenizer = build_tokenizer()
    generation = {"eos_token_id": [SPECIAL_TOKENS["<|im_end|>"], EOS_TOKEN_ID], "do_sample": False}
    for path, config in ((target, TARGET_CONFIG), (drafter, DRAFTER_CONFIG)):
        path.mkdir(parents=True, exist_ok=True)
        _write_json(path / "config.json", config)
        tokenizer.save_pretrained(path)
    _write_json(target / "generation_config.json", generation)
    return target, drafter


def is_dummy_dir(path: Path) -> bool:
    """True if `path` holds a config and tokenizer but no weights (serve it with --load-format dummy)."""
    path = Path(path)
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").exists() and (path / "tokenizer.json").exists() and not has_weights
