"""DFLASH's GDN commit under `--enable-linear-replayssm-spec` (server/hooks/gdn_verify.py).

On the GPU, the GDN verify runs a 16-token block for two requests twice: SGLang 0.5.17's kernel caching the
state after every step (what DFLASH commits from without the flag), and qflash's, to which the plugin routes
the verify that keeps only each step's raw inputs (with it; kernels/gdn_verify.py, which also folds). The
commit through qflash's hooked `update_mamba_state_after_mtp_verify` must then leave the GDN states and the
prefix-cache checkpoint slot as SGLang's unhooked commit leaves them from the snapshots, up to the rounding of
another summation order, and the conv windows bit for bit. SGLang's scatter kernels refuse CPU tensors, so
the CPU checks the flags: SGLang accepts the fold together with DFLASH and the radix cache's extra_buffer,
as `./launch.sh` passes them.
"""

import json

import pytest
import torch

from conftest import run_python
from qflash.server.launcher import sglang_argv

FOLD = """
import json, torch
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

dev = "cuda"
torch.manual_seed(0)
LAYERS, SLOTS, H, HV, K, V, T = 2, 8, 2, 4, 32, 32, 16  # SGLang's tiles: BK = K, BV = min(V, 32)
CONV_DIM, CONV_W = 16, 3
slots = torch.tensor([2, 5], device=dev)           # the requests' GDN state slots
accept = torch.tensor([6, 16], device=dev)         # tokens committed, bonus included
track_slots = torch.tensor([6, 7], device=dev)     # prefix-cache checkpoint slots
track_steps = torch.tensor([3, -1], device=dev)    # request 0 crosses a checkpoint after step 3
B = len(slots)

def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=dev).to(dtype)

temporal = rnd(LAYERS, SLOTS, HV, V, K) * 0.1
conv = rnd(LAYERS, SLOTS, CONV_DIM, CONV_W)
windows = rnd(LAYERS, B + 1, T, CONV_DIM, CONV_W)
inputs = [dict(q=rnd(1, B * T, H, K, dtype=torch.bfloat16), k=rnd(1, B * T, H, K, dtype=torch.bfloat16),
               v=rnd(1, B * T, HV, V, dtype=torch.bfloat16), a=rnd(B * T, HV, dtype=torch.bfloat16),
               b=rnd(B * T, HV, dtype=torch.bfloat16), A_log=rnd(HV), dt_bias=rnd(HV)) for _ in range(LAYERS)]
cu = torch.arange(0, (B + 1) * T, T, device=dev, dtype=torch.int32)

def verify(state, **cache):
    outs = []
    for layer, x in enumerate(inputs):
        per_layer = {name: t[layer] for name, t in cache.items()}
        outs.append(fused_sigmoid_gating_delta_rule_update(
            A_log=x["A_log"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"],
            initial_state_source=state.temporal[layer], initial_state_indices=slots, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
            disable_state_update=True, **per_layer,
            **({"intermediate_state_indices": torch.arange(B, device=dev), "cache_steps": T}
               if "intermediate_states_buffer" in per_layer else {"cache_ring": True})))
    return outs

def spec_state(**extra):
    return SimpleNamespace(temporal=temporal.clone(), conv=[conv.clone()], intermediate_conv_window=[windows], **extra)

def commit(state, fold):
    pool = SimpleNamespace(replayssm_spec_fold=fold, replayssm_is_kda=False)
    req_pool = SimpleNamespace(mamba_pool=pool, get_speculative_mamba2_params_all_layers=lambda: state)
    backend = object.__new__(HybridLinearAttnBackend)
    backend.linear_attn_backend = SimpleNamespace(req_to_token_pool=req_pool,
                                                  forward_metadata=SimpleNamespace(mamba_cache_indices=slots))
    backend.update_mamba_state_after_mtp_verify(last_correct_step_indices=accept - 1, mamba_track_indices=track_slots,
                                                mamba_steps_to_track=track_steps, model=None, req_pool_indices=None)

snap = spec_state(intermediate_ssm=torch.zeros(LAYERS, B + 1, T, HV, V, K, device=dev))
ring = spec_state(replayssm_rawv=torch.zeros(LAYERS, SLOTS, HV, T, V, device=dev, dtype=torch.bfloat16),
                  replayssm_rawk=torch.zeros(LAYERS, SLOTS, H, T, K, device=dev, dtype=torch.bfloat16),
                  replayssm_g=torch.zeros(LAYERS, SLOTS, HV, T, device=dev),
                  replayssm_beta=torch.zeros(LAYERS, SLOTS, HV, T, device=dev))
out_snap = verify(snap, intermediate_states_buffer=snap.intermediate_ssm)
out_ring = verify(ring, replayssm_rawv=ring.replayssm_rawv, replayssm_rawk=ring.replayssm_rawk,
                  replayssm_g=ring.replayssm_g, replayssm_beta=ring.replayssm_beta)
commit(ring, fold=True)
commit(snap, fold=False)  # SGLang's own scatter of the snapshots
touched = sorted({*slots.tolist(), *track_slots[track_steps >= 0].tolist()})
print(json.dumps({
    "output error": max(((x.double() - y.double()).norm() / y.double().norm()).item() for x, y in zip(out_ring, out_snap)),
    "state error": ((ring.temporal.double() - snap.temporal.double()).norm() / snap.temporal.double().norm()).item(),
    "conv equal": torch.equal(ring.conv[0], snap.conv[0]),
    "moved": [s for s in range(SLOTS) if not torch.equal(ring.temporal[:, s], temporal[:, s])],
    "touched": touched,
}))
"""


ARGS = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.server_args as sa
sa.is_cuda = lambda: True  # SGLang validates the GDN radix cache only for a CUDA device
args = sa.prepare_server_args(sys.argv[1:])
"""

FLAGS = ARGS + """
print(json.dumps({"fold": args.enable_linear_replayssm_spec, "ssm dtype": args.mamba_ssm_dtype,
                  "strategy": args.mamba_radix_cache_strategy, "algorithm": args.speculative_algorithm}))
"""


def test_sglang_takes_the_gdn_fold_with_dflash_and_the_prefix_cache(dummy_dirs):
    argv = sglang_argv(*dummy_dirs, ["--device", "cuda"], prefix_cache=True)[3:]
    result = run_python(FLAGS, *argv, env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    # float32 keeps the fold bit-identical to the snapshots (SGLang warns about drift otherwise)
    assert got == {"fold": True, "ssm dtype": "float32", "strategy": "extra_buffer", "algorithm": "DFLASH"}


POOL = ARGS + """
from types import SimpleNamespace
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.runtime_context import get_parallel, publish

publish(args, role="test")
builder = object.__new__(KVCacheConfigurator)  # the fields _build_hybrid_req_pool reads
builder.server_args, builder.model_config, builder.device = args, ModelConfig(args.model_path), "cpu"
builder.mambaish_config = builder.hybrid_gdn_config = mambaish_config(builder.model_config)
builder.layer_info = SimpleNamespace(start_layer=0, end_layer=builder.model_config.num_hidden_layers)
try:
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        builder._build_hybrid_req_pool(max_num_reqs=2, extra_max_context_len=0)
    print(json.dumps("built"))
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__}: {exc}"))
"""


@pytest.mark.parametrize("plugin", ["qflash", "qflash_text_only"])
def test_the_pool_builder_takes_the_gdn_fold_under_dflash(dummy_dirs, plugin):
    # 0.5.17 refuses the flag under DFLASH for GDN models, its commit being unable to fold them; with qflash's
    # commit it is built. The GDN state pool itself is allocated on CUDA, hence the end here on a CPU.
    argv = sglang_argv(*dummy_dirs, ["--device", "cuda", "--max-mamba-cache-size", "4"], prefix_cache=True)[3:]
    result = run_python(POOL, *argv, env={"SGLANG_PLUGINS": plugin})
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    if plugin == "qflash_text_only":  # stock 0.5.17
        assert outcome.startswith("ValueError: --enable-linear-replayssm-spec with DSPARK/DFLASH requires a KDA")
    elif torch.cuda.is_available():
        assert outcome == "built"
    else:
        assert outcome.startswith("RuntimeError: Found no NVIDIA driver"), outcome


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dflash_commit_folds_the_gdn_window_as_sglang_scatters_the_snapshots_gpu():
    result = run_python(FOLD, env={"SGLANG_PLUGINS": "qflash"}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    # qflash's verify and fold sum on another tile than SGLang's verify: the same values up to rounding (bf16
    # outputs, fp32 states); tests/test_gdn_verify.py holds qflash's fold to its verify's bits
    assert got["output error"] <= 4e-3, got["output error"]
    assert got["state error"] <= 1e-5, got["state error"]
    assert got["conv equal"]
    # the two requests' slots and request 0's checkpoint slot changed, nothing else
    assert got["moved"] == got["touched"] == [2, 5, 6]
