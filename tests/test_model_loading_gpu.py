"""The real loading path: qflash's text model reads a multimodal Qwen3.5 checkpoint (GPU only).

A small checkpoint of the published layout (`model.language_model.*`, `model.visual.*`, `mtp.*`) is
loaded into `Qwen3_5ForConditionalGeneration` as SGLang builds it; every parameter must come from it.
SGLang's parallel state is per process, so the check runs in a fresh interpreter.
"""

import json

import pytest
import torch

from conftest import REPO, run_python

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LOAD = r"""
import json, re, sys
from types import SimpleNamespace
import torch
from safetensors import safe_open
sys.path.insert(0, sys.argv[2])
from test_quantize import small_config
from qflash.server.dummy import write_random_weights
from sglang.srt.configs.qwen3_5 import Qwen3_5Config
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.layers.dp_attention import initialize_dp_attention
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import ServerArgs

src = sys.argv[1]
json.dump(small_config(), open(src + "/config.json", "w"))
write_random_weights(src, small_config())
config = Qwen3_5Config(**small_config())
init_distributed_environment(backend="nccl", world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:29555")
initialize_model_parallel(1, 1)
args = ServerArgs(model_path=src, disable_radix_cache=True)
publish(args, role="target", hf_config=config)
initialize_dp_attention(args, SimpleNamespace(hf_config=config, hidden_size=64, dtype=torch.bfloat16))
from qflash.server.models.qwen3_5_text import Qwen3_5ForConditionalGeneration
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = Qwen3_5ForConditionalGeneration(config)
for p in model.parameters():
    p.data.fill_(float("nan"))
index = json.load(open(src + "/model.safetensors.index.json"))["weight_map"]
source = {}
for shard in set(index.values()):
    with safe_open(src + "/" + shard, framework="pt") as f:
        source.update({n: f.get_tensor(n) for n in f.keys()})
loaded = model.load_weights(iter(source.items()))
params = dict(model.named_parameters())

def same(pattern, name):
    # SGLang names some modules differently from the checkpoint (e.g. attention without `self_attn`)
    (param,) = [p for n, p in params.items() if re.fullmatch(pattern, n)]
    rows = source[name].shape[0]  # the vocabulary is padded to a multiple of 64 (not at 248,320)
    return torch.equal(param[:rows].cpu(), source[name].to(param.dtype)) and not param[rows:].any().item()

print(json.dumps({
    "unloaded": sorted(n for n, p in params.items() if p.isnan().any()),
    "not_reported": sorted(set(params) - set(loaded)),
    "embed": same(r"model\.embed_tokens\.weight", "model.language_model.embed_tokens.weight"),
    "tied": model.lm_head is model.model.embed_tokens,
    "down_proj": same(r"model\.layers\.2\.mlp\.down_proj\.weight", "model.language_model.layers.2.mlp.down_proj.weight"),
    "o_proj": same(r"model\.layers\.3\.(self_attn\.)?o_proj\.weight", "model.language_model.layers.3.self_attn.o_proj.weight"),
    "norm": same(r"model\.norm\.weight", "model.language_model.norm.weight"),
}))
"""


def test_text_model_loads_every_parameter_from_a_multimodal_checkpoint(tmp_path):
    result = run_python(LOAD, str(tmp_path), str(REPO / "tests"), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"unloaded": [], "not_reported": [], "embed": True, "tied": True, "down_proj": True,
                   "o_proj": True, "norm": True}
