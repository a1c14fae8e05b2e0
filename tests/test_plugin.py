"""The SGLang plugin: entry points, text-only Qwen3.5, qflash's model class, valid server arguments.

SGLang keeps plugin and hook state per process, so each check runs in a fresh interpreter, as SGLang's
own server and scheduler processes do.
"""

import json
from importlib.metadata import entry_points

import pytest

from conftest import run_python
from qflash.graphs.policy import prefill_token_buckets
from qflash.server.launcher import sglang_argv
from qflash.server.models.qwen3_5_text import text_only_weights

PROBE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.models.registry import ModelRegistry
cls, _ = ModelRegistry.resolve_model_cls(["Qwen3_5ForConditionalGeneration"])
mc = ModelConfig(sys.argv[1])
print(json.dumps({"cls": cls.__module__ + "." + cls.__name__, "multimodal": mc.is_multimodal,
                  "hidden": mc.hf_text_config.hidden_size, "mrope": mc.model_is_mrope, "quant": mc.quantization}))
"""


def probe(target, plugins: str) -> dict:
    result = run_python(PROBE, str(target), env={"SGLANG_PLUGINS": plugins})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_points_are_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["qflash"] == "qflash.server.plugin:register"
    assert eps["qflash_text_only"] == "qflash.server.plugin:register_text_only"


def test_stock_sglang_treats_qwen35_as_multimodal(dummy_dirs):
    got = probe(dummy_dirs[0], "none")
    assert got["multimodal"] is True
    assert got["cls"] == "sglang.srt.models.qwen3_5.Qwen3_5ForConditionalGeneration"


def test_text_only_plugin_keeps_the_stock_model(dummy_dirs):
    got = probe(dummy_dirs[0], "qflash_text_only")
    assert got["multimodal"] is False
    assert got["cls"] == "sglang.srt.models.qwen3_5.Qwen3_5ForConditionalGeneration"


def test_qflash_plugin_serves_its_text_model(dummy_dirs):
    got = probe(dummy_dirs[0], "qflash")
    assert got == {"cls": "qflash.server.models.qwen3_5_text.Qwen3_5ForConditionalGeneration",
                   "multimodal": False, "hidden": 2560, "mrope": True, "quant": None}


def test_qflash_claims_its_w8a8_checkpoints_and_stock_sglang_reads_them_as_compressed_tensors(dummy_dirs):
    w8a8 = dummy_dirs[0].parent / "w8a8" / "Qwen3.5-4B"
    assert probe(w8a8, "qflash")["quant"] == "qflash_w8a8"
    assert probe(w8a8, "qflash_text_only")["quant"] == "compressed-tensors"  # the int8 body, for stock A/B runs


def test_draft_pick_hooks_wrap_the_dflash_worker():
    code = ("from sglang.srt.plugins import load_plugins\nload_plugins()\n"
            "from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2 as W\n"
            "print(hasattr(W._maybe_build_draft_sampler, '__wrapped__'), "
            "hasattr(W._greedy_sample_from_vocab_parallel_head, '__wrapped__'))")
    assert run_python(code, env={"SGLANG_PLUGINS": "qflash"}).stdout.split() == ["True", "True"]
    assert run_python(code, env={"SGLANG_PLUGINS": "qflash_text_only"}).stdout.split() == ["False", "False"]


def test_qflash_model_class_has_dflash_capture():
    code = ("from qflash.server.models.qwen3_5_text import Qwen3_5ForConditionalGeneration as C\n"
            "from sglang.srt.models.qwen3_5_text import Qwen3_5ForCausalLM as T\n"
            "print(hasattr(C, 'set_dflash_layers_to_capture'), hasattr(T, 'set_dflash_layers_to_capture'))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "False"]


def test_multimodal_checkpoint_names_map_to_the_text_model():
    names = ["model.language_model.layers.0.linear_attn.in_proj_qkv.weight", "model.language_model.embed_tokens.weight",
             "model.language_model.norm.weight", "model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight",
             "lm_head.weight", "model.layers.3.self_attn.q_proj.weight"]
    got = [name for name, _ in text_only_weights((n, None) for n in names)]
    assert got == ["model.layers.0.linear_attn.in_proj_qkv.weight", "model.embed_tokens.weight", "model.norm.weight",
                   "lm_head.weight", "model.layers.3.self_attn.q_proj.weight"]


def validated_server_args(argv: list[str], fields: list[str]) -> list:
    """The named fields of SGLang's ServerArgs after its own parsing and validation, with the qflash plugin.

    SGLang validates DFLASH and the GDN radix cache only for a CUDA device: `--device cuda` and a
    CUDA-present `is_cuda` let it do so on this CPU machine."""
    code = ("import json, sys\nfrom sglang.srt.plugins import load_plugins\nload_plugins()\n"
            "import functools, sglang.srt.server_args as sa\nsa.is_cuda = lambda: True\n"
            "a = sa.prepare_server_args(sys.argv[2:])\n"
            "print(json.dumps([functools.reduce(getattr, f.split('.'), a) for f in sys.argv[1].split(',')]))")
    result = run_python(code, ",".join(fields), *argv, "--device", "cuda", env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_preset_server_arguments_pass_sglang_validation(dummy_dirs):
    fields = ["speculative_algorithm", "speculative_num_draft_tokens", "enable_multimodal", "served_model_name",
              "load_format", "context_length", "disable_radix_cache", "chunked_prefill_size",
              "cuda_graph_config.decode.bs", "cuda_graph_config.prefill.bs"]
    got = validated_server_args(sglang_argv(*dummy_dirs, [])[3:], fields)
    assert got[:8] == ["DFLASH", 16, None, "Qwen3.5-4B", "dummy", 16384, False, 8192]  # prefix caching on
    assert got[8:] == [list(range(1, 9)), prefill_token_buckets(16, 8192)]  # graphs/policy.py's shapes reach SGLang


def test_prefix_cache_server_arguments_pass_sglang_validation(dummy_dirs):
    fields = ["disable_radix_cache", "mamba_radix_cache_strategy", "disable_overlap_schedule", "mamba_track_interval"]
    got = validated_server_args(sglang_argv(*dummy_dirs, [], prefix_cache=True)[3:], fields)
    # GDN states checkpointed every 256 tokens, overlap scheduling kept
    assert got == [False, "extra_buffer", False, 256]


def test_w8a8_server_arguments_pass_sglang_validation(dummy_dirs):
    argv = sglang_argv(dummy_dirs[0].parent / "w8a8" / "Qwen3.5-4B", dummy_dirs[1], [])[3:]
    got = validated_server_args(argv, ["quantization", "speculative_draft_model_quantization", "served_model_name"])
    assert got == ["qflash_w8a8", "qflash_w8a8", "Qwen3.5-4B"]


LOAD = """
import sys
import qflash.server.hooks as hooks
{fault}
from sglang.srt.plugins import load_plugins
load_plugins()
print("loaded")
"""
FAULTS = {
    "another SGLang": ('hooks.version = lambda name: "0.5.18"', "found sglang 0.5.18"),
    "a renamed target": ("import qflash.server.hooks.draft_pick as m\n"
                         "m.CHANGES[0] = hooks.Hook(m.WORKER + 'build_sampler', m._draft_sampler, 'AROUND')",
                         "DFlashWorkerV2.build_sampler does not exist in sglang 0.5.17"),
    "a hook HookRegistry skips": ("from sglang.srt.plugins.hook_registry import HookRegistry\n"
                                  "_apply = HookRegistry._apply_target.__func__\n"
                                  "def skip(cls, target, hooks):\n"
                                  "    if target.endswith('TritonAttnBackend.__init__'): raise RuntimeError('renamed')\n"
                                  "    return _apply(cls, target, hooks)\n"
                                  "HookRegistry._apply_target = classmethod(skip)",
                                  "not in place in sglang 0.5.17: sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"),
    "an unregistered model class": ("from sglang.srt.models.registry import ModelRegistry\n"
                                    "ModelRegistry.register = lambda *args, **kwargs: None", "not in place in sglang 0.5.17: model class"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_server_process_refuses_to_start_without_qflash_in_place(fault):
    """SGLang's own plugin loader swallows a plugin's exceptions and HookRegistry skips what it cannot apply; the
    refusal is a SystemExit that stops the process, with one line that names what is missing and the version."""
    code, message = FAULTS[fault]
    result = run_python(LOAD.format(fault=code), env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode != 0 and "loaded" not in result.stdout
    refusal = [line for line in result.stderr.splitlines() if line.startswith("qflash: refusing to start: ")]
    assert len(refusal) == 1 and message in refusal[0], result.stderr[-2000:]


@pytest.mark.parametrize("plugins, meter, count", [("qflash", "", 57), ("qflash_text_only", "", 1), ("", "", 57),
                                                  ("qflash", "1", 61), ("qflash_text_only", "1", 8)])
def test_each_process_says_how_many_hooks_it_applied(plugins, meter, count):
    """`qflash serve` waits for this line; with SGLANG_PLUGINS unset SGLang loads both plugins, once each change;
    `qflash bench` adds the cycle meter to both."""
    result = run_python(LOAD.format(fault=""), env={"SGLANG_PLUGINS": plugins, "QFLASH_CYCLE_METER": meter})
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-2000:]
    applied = [line for line in result.stderr.splitlines() if " hooks applied on sglang 0.5.17: " in line]
    assert sum(int(line.split()[1]) for line in applied) == count, applied


QUIET = """
import logging, sys
from sglang.srt.plugins import load_plugins
load_plugins()
if sys.argv[2] == "without the filter":
    from qflash.server.hooks import quantization
    logging.getLogger(quantization.LOGGER).removeFilter(quantization._keep)
from sglang.srt.configs.model_config import ModelConfig
print(ModelConfig(sys.argv[1]).quantization)
"""


@pytest.mark.parametrize("case", ["as served", "without the filter"])
def test_no_not_fully_optimized_warning_for_qflash_w8a8(dummy_dirs, case):
    result = run_python(QUIET, str(dummy_dirs[0].parent / "w8a8" / "Qwen3.5-4B"), case, env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0 and result.stdout.split()[-1] == "qflash_w8a8", result.stderr[-2000:]
    assert ("not fully optimized" in result.stderr) == (case == "without the filter")
