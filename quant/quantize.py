"""`qflash quantize SRC DST`: a Hugging Face Qwen3.5 checkpoint to qflash's W8A8 text checkpoint.

- Decoder-layer linears: int8 weights, symmetric per output channel, with fp32 `weight_scale` [N, 1], in
  the compressed-tensors `int-quantized` layout (dynamic per-token int8 activations) that SGLang's own
  compressed-tensors W8A8 int8 scheme reads, so stock SGLang can serve the same body for comparisons.
- lm_head: untied from `embed_tokens` and stored int8 per channel (W8A16), described under its own config
  key `qflash_lm_head`; it is in the compressed-tensors `ignore` list, which stock methods skip.
- Embeddings, norms, conv1d, A_log, dt_bias stay as they are. The vision tower's and MTP head's weights are
  left out: this is the text model qflash serves (the config keeps `vision_config`, so a stock multimodal
  loader still builds; the tower is simply never loaded or used).

- Optional SmoothQuant (`--smooth CALIB.txt`): per-channel factors from the bf16 model's norm outputs over
  the calibration text, folded into the norms and the linears they feed before quantizing (quant/smooth.py).

Tensors are read one at a time (the calibration pass loads the bf16 model once); output is written in shards
to a temporary folder renamed at the end.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from qflash.quant.layout import DROPPED, TEXT, is_quantized_linear
from qflash.quant.smooth import apply as smooth_apply

SHARD_BYTES = 2 << 30
LM_HEAD = "lm_head.weight"
LM_HEAD_KEY = "qflash_lm_head"  # quantization_config key describing the int8 lm_head
SMOOTH_KEY = "qflash_smoothquant"  # quantization_config key: alpha and calibration size, when smoothed


class CheckpointError(ValueError):
    pass


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights and fp32 scales [N, 1]: scale = absmax(row) / 127, round to nearest."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


def quantization_config(text_layers: int) -> dict:
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**int8, "strategy": "channel", "dynamic": False},
            "input_activations": {**int8, "strategy": "token", "dynamic": True},
        }},
        "ignore": ["lm_head"],
        LM_HEAD_KEY: {"format": "w8a16", "weights": {**int8, "strategy": "channel"}, "text_layers": text_layers},
    }


def _source_files(src: Path) -> tuple[dict, list[Path]]:
    """The source config and safetensors files; clear errors for a missing, partial or foreign checkpoint."""
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: no config.json (not a Hugging Face checkpoint directory)")
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen3_5" or "text_config" not in config:
        raise CheckpointError(f"{src}: model_type {config.get('model_type')!r} is not a Qwen3.5 checkpoint (qwen3_5)")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise CheckpointError(f"{src}: partial checkpoint, missing {', '.join(missing)}")
        return config, [src / n for n in names]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors weights")
    return config, files


def quantized_config(config: dict, smoothing: Optional[dict] = None) -> dict:
    """The output checkpoint's config.json: untied lm_head, the quantization_config above (plus how it
    was smoothed, if it was)."""
    text = dict(config["text_config"], tie_word_embeddings=False)
    quant = quantization_config(text["num_hidden_layers"]) | ({SMOOTH_KEY: smoothing} if smoothing else {})
    return {**config, "text_config": text, "tie_word_embeddings": False, "quantization_config": quant}


def _smoothing_plan(src: Path, names: list, ids: torch.Tensor, alpha: float, device: str) -> dict:
    """SmoothQuant factors from the bf16 model's norm outputs over the calibration ids (quant/smooth.py)."""
    from qflash.quant import quality, smooth

    model = quality.load_bf16(src, device)
    act_absmax = smooth.activation_absmax(model, ids.reshape(1, -1).to(device))
    del model
    consumers = tuple(f".{c}.weight" for group in smooth.CONSUMERS.values() for c in group)
    tensors = {n: h.get_tensor(n) for h, n in names if n in act_absmax or (n.startswith(TEXT) and n.endswith(consumers))}
    return smooth.smoothing_plan(act_absmax, tensors, alpha)


class ShardWriter:
    """Collects tensors up to SHARD_BYTES, writes each shard, then the safetensors index."""

    def __init__(self, dst: Path):
        self.dst, self.pending, self.size, self.files, self.weight_map = dst, {}, 0, [], {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.size += tensor.numel() * tensor.element_size()
        if self.size >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            name = f"model-{len(self.files) + 1:05d}.safetensors"
            save_file(self.pending, str(self.dst / name), metadata={"format": "pt"})
            self.files.append(name)
            self.weight_map.update(dict.fromkeys(self.pending, name))
            self.pending, self.size = {}, 0

    def close(self) -> None:
        self.flush()
        total = sum((self.dst / f).stat().st_size for f in self.files)
        (self.dst / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": self.weight_map}, indent=2) + "\n")


def quantize_checkpoint(src: Path, dst: Path, force: bool = False, calibration_ids: Optional[torch.Tensor] = None,
                        alpha: float = 0.5, device: str = "cpu") -> Path:
    """Write DST from SRC; with calibration token ids, SmoothQuant-smooth the body first (quant/smooth.py)."""
    src, dst = Path(src), Path(dst)
    config, files = _source_files(src)
    if dst.exists() and not force:
        raise CheckpointError(f"{dst} exists; pass --force to overwrite it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        writer, embed = ShardWriter(tmp), None
        handles = [safe_open(str(f), framework="pt") for f in files]
        names = [(h, n) for h in handles for n in h.keys()]
        plan = {} if calibration_ids is None else _smoothing_plan(src, names, calibration_ids, alpha, device)
        for handle, name in tqdm(names, desc="qflash quantize", unit="tensor"):
            if name.startswith(DROPPED):
                continue
            tensor = smooth_apply(name, handle.get_tensor(name), plan)
            if is_quantized_linear(name) or name == LM_HEAD:
                q, scale = quantize_per_channel(tensor)
                writer.add(name, q)
                writer.add(name[:-len("weight")] + "weight_scale", scale)
                continue
            if name == TEXT + "embed_tokens.weight":
                embed = tensor
            writer.add(name, tensor)
        if LM_HEAD not in writer.weight_map and LM_HEAD not in writer.pending:
            if embed is None:
                raise CheckpointError(f"{src}: neither lm_head.weight nor embed_tokens to untie it from")
            q, scale = quantize_per_channel(embed)
            writer.add(LM_HEAD, q)
            writer.add("lm_head.weight_scale", scale)
        writer.close()
        smoothing = None if calibration_ids is None else {"alpha": alpha, "calibration_tokens": calibration_ids.numel()}
        (tmp / "config.json").write_text(json.dumps(quantized_config(config, smoothing), indent=2) + "\n")
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(extra, tmp / extra.name)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
        return dst
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
