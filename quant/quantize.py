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

from qflash.quant.layout import DROPPED, LM_HEAD, TEXT, is_qflash_config, is_quantized_linear, quantized_config
from qflash.quant.smooth import apply as smooth_apply
from qflash.server.errors import UserError

SHARD_BYTES = 2 << 30


class CheckpointError(UserError):
    """A source or destination the quantizer refuses, before writing anything."""


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights and fp32 scales [N, 1]: scale = absmax(row) / 127, round to nearest."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


def _source_files(src: Path) -> tuple[dict, list[Path]]:
    """The source config and safetensors files; clear errors for a missing, partial or foreign checkpoint."""
    if not src.is_dir():
        raise CheckpointError(f"{src} does not exist or is not a folder")
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: no config.json (not a Hugging Face checkpoint folder)")
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


def _check_destination(src: Path, dst: Path, force: bool) -> None:
    """DST may be new or empty; with --force, also an earlier output of `qflash quantize` (its config says so).
    Never SRC, a folder inside it or one that holds it, nor anything else a user owns."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d.is_relative_to(s) or s.is_relative_to(d):
        raise CheckpointError(f"{dst} is {'the source' if d == s else 'inside the source' if d.is_relative_to(s) else 'a folder holding the source'}; "
                              "write the quantized checkpoint to a folder of its own")
    if not dst.exists() or (dst.is_dir() and not any(dst.iterdir())):
        return
    config = dst / "config.json"
    earlier = dst.is_dir() and config.is_file() and is_qflash_config(json.loads(config.read_text()))
    if not earlier:
        raise CheckpointError(f"{dst} exists and is not a `qflash quantize` output; remove it yourself or pick another folder")
    if not force:
        raise CheckpointError(f"{dst} holds an earlier `qflash quantize` output; pass --force to replace it")


def _smoothing_plan(src: Path, names: list, ids: torch.Tensor, alpha: float, device: str) -> dict:
    """SmoothQuant factors from the bf16 model's norm outputs over the calibration ids (quant/smooth.py)."""
    from qflash.quant import smooth
    from qflash.quant.reference import load_bf16

    model = load_bf16(src, device)
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
    _check_destination(src, dst, force)
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
        if LM_HEAD not in writer.weight_map and LM_HEAD not in writer.pending:  # tied: untie from the embeddings
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
        if dst.exists():  # empty, or an earlier output (_check_destination)
            shutil.rmtree(dst)
        tmp.rename(dst)
        return dst
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def add_arguments(p) -> None:
    p.add_argument("src", type=Path, help="a Hugging Face Qwen3.5 checkpoint folder (bf16)")
    p.add_argument("dst", type=Path, help="a new folder for the quantized checkpoint")
    p.add_argument("--force", action="store_true", help="replace DST if it holds an earlier `qflash quantize` output")
    p.add_argument("--smooth", type=Path, metavar="CALIB.txt", help="SmoothQuant from this calibration text first")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength (default 0.5)")
    p.add_argument("--calibration-tokens", type=int, default=512, help="tokens of the text to use (default 512)")
    p.add_argument("--device", default="cpu", help="where the calibration forward runs: cpu (default) or cuda")


def run(args, extra) -> int:
    ids = None
    if args.smooth:
        from transformers import AutoTokenizer

        if not args.smooth.is_file():
            raise CheckpointError(f"{args.smooth} does not exist")
        _source_files(args.src)  # a clear error before the tokenizer is looked for
        text = args.smooth.read_text()
        ids = AutoTokenizer.from_pretrained(args.src)(text, return_tensors="pt").input_ids[0, :args.calibration_tokens]
    print(f"wrote {quantize_checkpoint(args.src, args.dst, args.force, ids, args.alpha, args.device)}")
    return 0
