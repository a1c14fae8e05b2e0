"""`qflash make-dummy`: configs of the exact shapes and an offline tokenizer that transformers loads."""

import json
import logging

import pytest
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from qflash.server import preset
from qflash.server.launcher import is_dummy_dir


def test_target_loads_as_a_transformers_config(dummy_dirs):
    target, _ = dummy_dirs
    config = AutoConfig.from_pretrained(target)
    assert type(config).__name__ == "Qwen3_5Config"
    text = config.text_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers, text.vocab_size) == (2560, 9216, 32, 248320)
    assert text.layer_types.count("full_attention") == 8
    assert GenerationConfig.from_pretrained(target).eos_token_id == [248046, 248044]


def test_drafter_config_is_written_verbatim(dummy_dirs):
    _, drafter = dummy_dirs
    written = json.loads((drafter / "config.json").read_text())
    assert written.pop("transformers_version") == transformers.__version__  # as save_pretrained writes it
    assert written == preset.DRAFTER_CONFIG


def test_loading_the_tokenizer_warns_of_nothing(dummy_dirs, caplog):
    """Without `transformers_version` in config.json transformers takes a local tokenizer for a Mistral one and
    warns that its regex pattern is wrong: a user reads that as a broken tokenizer."""
    with caplog.at_level(logging.WARNING):
        for folder in dummy_dirs:
            AutoTokenizer.from_pretrained(folder)
    assert "regex" not in caplog.text


def test_make_dummy_never_writes_over_a_model_it_did_not_write(dummy_dirs, tmp_path, capsys):
    from qflash.server.cli import main
    from qflash.server.dummy import make_dummy

    root = tmp_path / "models"
    (root / "Qwen3.5-4B").mkdir(parents=True)
    real = (root / "Qwen3.5-4B" / "config.json")
    real.write_text('{"a real": "config"}')
    assert main(["make-dummy", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qflash make-dummy: {root / 'Qwen3.5-4B'} already holds a model that make-dummy did not write; "
                   "pick another folder"]
    assert real.read_text() == '{"a real": "config"}' and not (root / "Qwen3.5-4B-DFlash").exists()
    make_dummy(dummy_dirs[0].parent)  # its own output: written again


@pytest.fixture(scope="module")
def tokenizer(dummy_dirs):
    return AutoTokenizer.from_pretrained(dummy_dirs[0])


@pytest.mark.parametrize("text", ["Hello, world!", "Grüße aus Zürich, 你好, 🙂", "  leading and\ttabs\nnewlines  ", ""])
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < preset.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_covers_the_whole_vocabulary(tokenizer):
    assert len(tokenizer) == preset.VOCAB_SIZE
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(preset.VOCAB_SIZE))


def test_special_tokens_sit_at_their_qwen_ids(tokenizer):
    assert tokenizer.eos_token_id == preset.EOS_TOKEN_ID == 248044
    for token, token_id in preset.SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False).count(token_id) == 1
    assert tokenizer.decode([248045, 248046], skip_special_tokens=True) == ""


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(248045) == 3 and ids.count(248046) == 2


def test_dummy_dir_is_one_without_weights(dummy_dirs, tmp_path):
    target, drafter = dummy_dirs
    assert is_dummy_dir(target) and is_dummy_dir(drafter)
    real = tmp_path / "real"
    real.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (real / name).write_bytes((target / name).read_bytes())
    (real / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert not is_dummy_dir(real)
    assert not is_dummy_dir(tmp_path / "missing")


def test_make_dummy_takes_random_or_stable_weights_not_both(tmp_path, capsys):
    from qflash.server.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["make-dummy", str(tmp_path / "d"), "--weights", "--stable"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
