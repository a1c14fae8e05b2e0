"""`qflash quantize` and `make-dummy --weights`, on a small checkpoint of the real Qwen3.5 layout."""

import copy
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from qflash.quant import layout
from qflash.quant.quantize import CheckpointError, quantize_checkpoint, quantize_per_channel
from qflash.server import preset
from qflash.server.cli import main
from qflash.server.dummy import write_random_weights

SMALL_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, vocab_size=300, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16)
SMALL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=16)


def small_config() -> dict:
    config = copy.deepcopy(preset.TARGET_CONFIG)
    config["text_config"].update(SMALL_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"])
    config["vision_config"].update(SMALL_VISION)
    return config


def read_all(path) -> dict:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in set(index.values()):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    assert set(out) == set(index)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = tmp_path_factory.mktemp("qwen35-small")
    (src / "config.json").write_text(json.dumps(small_config()))
    (src / "tokenizer_config.json").write_text("{}")
    write_random_weights(src, small_config())
    return src


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    return quantize_checkpoint(source, tmp_path_factory.mktemp("out") / "qwen35-w8a8")


def test_full_size_layout_is_the_published_checkpoint():
    tensors = layout.checkpoint_tensors(preset.TARGET_CONFIG)
    assert len(tensors) == 738 and sum(math.prod(s) for _, s, _ in tensors) == 4_659_865_088
    linears = [s for n, s, _ in tensors if layout.is_quantized_linear(n)]
    assert len(linears) == 24 * 5 + 8 * 4 + 32 * 3 and sum(math.prod(s) for s in linears) == 3_569_090_560


def test_random_weights_have_real_names_and_the_initializer(source):
    tensors = read_all(source)
    assert set(tensors) == {n for n, _, _ in layout.checkpoint_tensors(small_config())}
    w = tensors["model.language_model.layers.0.mlp.down_proj.weight"].float()
    assert w.dtype == torch.float32 and abs(w.std().item() - 0.02) < 0.002
    assert tensors["model.language_model.layers.0.linear_attn.A_log"].dtype == torch.float32


def test_per_channel_error_is_at_most_half_a_step():
    w = torch.randn(96, 200, dtype=torch.float32) * torch.logspace(-3, 1, 96)[:, None]
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (96, 1) and q.abs().max() == 127
    assert torch.all((q.float() * scale - w).abs() <= scale * (0.5 + 1e-4))  # half a step, plus fp32 rounding


def test_body_is_int8_per_channel_and_lm_head_untied(source, quantized):
    before, after = read_all(source), read_all(quantized)
    for name, w in before.items():
        if name.startswith(layout.DROPPED):
            assert name not in after
        elif layout.is_quantized_linear(name):
            scale = after[name[:-len("weight")] + "weight_scale"]
            assert after[name].dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
            assert torch.all((after[name].float() * scale - w.float()).abs() <= scale * (0.5 + 1e-4))  # half a step, plus fp32 rounding
        else:
            assert torch.equal(after[name], w), name  # norms, conv1d, A_log, dt_bias, embeddings: untouched
    embed = before["model.language_model.embed_tokens.weight"].float()
    assert after["lm_head.weight"].dtype == torch.int8 and after["lm_head.weight_scale"].shape == (embed.shape[0], 1)
    assert torch.allclose(after["lm_head.weight"].float() * after["lm_head.weight_scale"], embed, atol=embed.abs().max().item() / 254)


def test_config_describes_the_quantization(quantized):
    config = json.loads((quantized / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["text_config"]["tie_word_embeddings"] is False
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "int-quantized" and q["ignore"] == ["lm_head"]
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"] == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    assert q["qflash_lm_head"]["format"] == "w8a16"
    assert (quantized / "tokenizer_config.json").exists()
    assert AutoConfig.from_pretrained(quantized).text_config.hidden_size == 64


def test_an_earlier_output_is_replaced_only_with_force(source, quantized):
    with pytest.raises(CheckpointError, match="--force"):
        quantize_checkpoint(source, quantized)
    (quantized / "marker").write_text("old")
    quantize_checkpoint(source, quantized, force=True)
    assert not (quantized / "marker").exists()
    assert [p.name for p in quantized.parent.iterdir()] == [quantized.name]  # no temporary folder left behind


def tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case, message", [
    ("the source", "is the source"),
    ("a folder holding the source", "is a folder holding the source"),
    ("inside the source", "is inside the source"),
    ("a user's folder", "exists and is not a `qflash quantize` output"),
])
def test_force_never_deletes_what_quantize_did_not_write(case, message, source, tmp_path):
    """`qflash quantize models/Qwen3.5-small models --force` once deleted models/, the source with it."""
    models = tmp_path / "models"
    src = models / "Qwen3.5-small"
    src.mkdir(parents=True)
    for f in source.iterdir():
        (src / f.name).symlink_to(f)
    (models / "another-model").mkdir()
    (models / "another-model" / "weights.bin").write_bytes(b"mine")
    dst = {"the source": src, "a folder holding the source": models, "inside the source": src / "w8a8",
           "a user's folder": models / "another-model"}[case]
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        quantize_checkpoint(src, dst, force=True)
    assert tree(tmp_path) == before


def test_an_empty_destination_folder_is_used(source, tmp_path):
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(source, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()


def test_shards_close_at_the_size_limit(tmp_path, monkeypatch):
    from qflash.quant import quantize

    monkeypatch.setattr(quantize, "SHARD_BYTES", 1000)
    writer = quantize.ShardWriter(tmp_path)
    for i in range(5):
        writer.add(f"t{i}", torch.zeros(100))  # 400 bytes each: shards of 3 (1,200 bytes) and 2
    writer.close()
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(shards.values()) == ["model-00001.safetensors"] * 3 + ["model-00002.safetensors"] * 2


@pytest.mark.parametrize("case, message", [
    ("nonexistent", "does not exist or is not a folder"),
    ("missing", "no config.json"),
    ("llama", "not a Qwen3.5 checkpoint"),
    ("partial", "partial checkpoint, missing model-00002-of-00002.safetensors"),
    ("no-weights", "no *.safetensors weights"),
])
def test_bad_sources_give_clear_errors(case, message, tmp_path, capsys):
    src = tmp_path / case
    if case != "nonexistent":
        src.mkdir()
    if case not in ("missing", "nonexistent"):
        config = {"model_type": "llama"} if case == "llama" else small_config()
        (src / "config.json").write_text(json.dumps(config))
    if case == "partial":
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
        (src / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert main(["quantize", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qflash quantize: ") and message in err[0]
    assert not (tmp_path / "out").exists()


def test_quality_compares_the_w8a8_checkpoint_with_its_source(source, quantized, capsys):
    assert main(["quality", str(source), str(quantized), "--positions", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantized_linears"] == 3 * 5 + 4 + 4 * 3 + 1  # every body linear and the lm_head
    # int8 per channel and per token: well under a few percent, and not zero (the W8A8 path did run)
    for key in ("hidden_states", "logits"):
        assert 1e-4 < report[key]["relative"] < 0.05, report
    assert report["greedy_agreement"] > 0.5
