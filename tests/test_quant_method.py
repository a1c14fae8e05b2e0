"""`qflash_w8a8`, the SGLang quantization method: real SGLang layers built with it, loaded, and run.

SGLang's layers need its tensor-parallel state, so each check runs in a fresh interpreter that sets up a
one-process group (gloo), builds the layer with qflash's config, loads weights through the layer's own
weight loaders, and compares its forward with a float64 reference. On the CPU the kernels run in
Triton's interpreter.
"""

import json

import pytest
import torch

from conftest import REPO, run_python
from qflash.kernels.config_table import DECODE_MAX_M, gemm_phase
from qflash.quant.layout import METHOD_NAME as NAME
from qflash.quant.method import QflashW8A8Config
from qflash.quant.layout import quantized_config
from qflash.server.preset import TARGET_CONFIG

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def setup_one_process():
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method="tcp://127.0.0.1:29533")
    initialize_model_parallel(1)


def reference(x, w_q, w_scale):
    from test_kernels import quant_reference

    q, s = quant_reference(x.cpu())
    return (q.double() @ w_q.cpu().double().T) * s.double()[:, None] * w_scale.cpu().double().reshape(1, -1)


def rel_err(y, ref):
    return ((y.cpu().double() - ref).abs() / ref.abs().clamp_min(1e-12)).max().item()


def check_checkpoint_linear():
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    from qflash.quant.method import W8A8LinearMethod
    from qflash.quant.quantize import quantize_per_channel

    cfg = QflashW8A8Config.from_config(quantized_config(TARGET_CONFIG)["quantization_config"])
    with torch.device(DEVICE):
        layer = MergedColumnParallelLinear(64, [48, 40], bias=False, quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj")
    assert type(layer.quant_method) is W8A8LinearMethod and layer.weight.dtype == torch.int8
    g = torch.Generator().manual_seed(0)
    shards = [quantize_per_channel(torch.randn(n, 64, generator=g).to(torch.bfloat16)) for n in (48, 40)]
    for shard_id, (q, scale) in enumerate(shards):
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    y, _ = layer(x)
    w_q, w_scale = torch.cat([q for q, _ in shards]), torch.cat([s for _, s in shards])
    assert y.dtype == torch.bfloat16 and y.shape == (5, 88)
    assert rel_err(y, reference(x, w_q, w_scale)) <= 2.0 ** -7 + 1e-6


def check_ignored_linear_stays_bf16():
    from sglang.srt.layers.linear import RowParallelLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    cfg = QflashW8A8Config(ignore=["re:.*down_proj"], prequantized=True)
    with torch.device(DEVICE):
        layer = RowParallelLinear(64, 32, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj",
                                  params_dtype=torch.bfloat16)
    assert type(layer.quant_method) is UnquantizedLinearMethod and layer.weight.dtype == torch.bfloat16


def check_drafter_linear_quantized_at_load():
    from sglang.srt.layers.linear import ReplicatedLinear

    from qflash.quant.quantize import quantize_per_channel

    with torch.device(DEVICE):
        layer = ReplicatedLinear(64, 40, bias=False, quant_config=QflashW8A8Config(), prefix="layers.0.mlp.down_proj",
                                 params_dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16  # the drafter's checkpoint is bf16
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    q, scale = quantize_per_channel(w.to(DEVICE))
    assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale.reshape(-1))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    y, _ = layer(x)
    assert rel_err(y, reference(x, q, scale)) <= 2.0 ** -7 + 1e-6


def check_drafter_qkv_keeps_bf16_for_fused_kv_materialisation_and_projects_in_int8():
    """The drafter's QKV keeps bf16 weights that SGLang's fused context-KV write accepts and slices, and projects
    the draft's rows on the W8A8 kernel over an int8 copy of them."""
    from sglang.srt.layers.linear import QKVParallelLinear
    from sglang.srt.speculative.dflash_utils import can_dflash_use_fused_qkv_proj

    from qflash.quant.method import DrafterQKVMethod, W8A8LinearMethod, runs_w8a8
    from qflash.quant.quantize import quantize_per_channel

    def qkv(cfg, prefix):
        with torch.device(DEVICE):
            return QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=cfg, prefix=prefix, params_dtype=torch.bfloat16)

    drafter = qkv(QflashW8A8Config(), "qkv_proj")  # SGLang's DFlash layers name it so
    assert type(drafter.quant_method) is DrafterQKVMethod and drafter.weight.dtype == torch.bfloat16
    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    for shard_id, rows in (("q", w[:64]), ("k", w[64:96]), ("v", w[96:])):
        drafter.weight.weight_loader(drafter.weight, rows, shard_id)
    drafter.quant_method.process_weights_after_loading(drafter)
    assert can_dflash_use_fused_qkv_proj(drafter) == (True, "")  # SGLang's own check for its fused path
    assert torch.equal(drafter.weight.cpu(), w), "the fused KV write slices the bf16 weights"
    q, scale = quantize_per_channel(w.to(DEVICE))
    assert torch.equal(drafter.int8_weight, q) and torch.equal(drafter.int8_weight_scale, scale.reshape(-1))
    assert runs_w8a8(drafter), "its input norm hands it int8 rows"
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    y, _ = drafter(x)
    assert y.shape == (16, 128) and rel_err(y, reference(x, q, scale)) <= 2.0 ** -7 + 1e-6
    target = qkv(QflashW8A8Config.from_config(quantized_config(TARGET_CONFIG)["quantization_config"]),
                 "model.layers.3.self_attn.qkv_proj")
    assert type(target.quant_method) is W8A8LinearMethod and target.weight.dtype == torch.int8


def check_int8_lm_head():
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    from qflash.quant.method import W8A16LMHeadMethod, greedy_ids, is_int8_lm_head
    from qflash.quant.quantize import quantize_per_channel

    cfg = QflashW8A8Config.from_config(quantized_config(TARGET_CONFIG)["quantization_config"])
    with torch.device(DEVICE):
        head = ParallelLMHead(100, 64, quant_config=cfg, prefix="lm_head")  # padded to 128 rows
    assert type(head.quant_method) is W8A16LMHeadMethod and is_int8_lm_head(head)
    w_q, w_scale = quantize_per_channel(torch.randn(100, 64, generator=torch.Generator().manual_seed(3)))
    head.weight_loader(head.weight, w_q)
    head.weight_loader(head.weight_scale, w_scale)
    head.quant_method.process_weights_after_loading(head)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    logits = head.quant_method.apply(head, x)
    ref = (x.cpu().double() @ w_q.double().T) * w_scale.double().T
    assert logits.shape == (6, 128) and rel_err(logits[:, :100], ref) <= 2.0 ** -7 + 1e-4
    assert torch.equal(greedy_ids(head, x, 100).cpu(), ref.argmax(dim=1))


def check_logits_written_into_sglangs_buffer():
    """SGLang's logits step copies bf16 logits into its fp32 buffer; with the plugin the int8 lm_head writes the
    buffer itself, to the same bits, and SGLang's copy has the buffer for source and destination (torch launches
    nothing then). A scaled, biased or differently shaped call keeps SGLang's route."""
    from types import SimpleNamespace

    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.plugins import load_plugins

    from conftest import Dispatched
    from qflash.quant.quantize import quantize_per_channel

    cfg = QflashW8A8Config.from_config(quantized_config(TARGET_CONFIG)["quantization_config"])
    with torch.device(DEVICE):
        head = ParallelLMHead(128, 64, quant_config=cfg, prefix="lm_head")
    w_q, w_scale = quantize_per_channel(torch.randn(128, 64, generator=torch.Generator().manual_seed(5)))
    head.weight_loader(head.weight, w_q)
    head.weight_loader(head.weight_scale, w_scale)
    head.quant_method.process_weights_after_loading(head)
    processor = LogitsProcessor.__new__(LogitsProcessor)  # its __init__ reads a served model's published config
    torch.nn.Module.__init__(processor)
    vars(processor).update(vocab_size=128, logit_scale=None, do_tensor_parallel_all_gather=False, use_fp32_lm_head=False,
                           do_tensor_parallel_all_gather_dp_attn=False, final_logit_softcapping=None)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    buffer = torch.empty(16, 128, device=DEVICE)
    meta = SimpleNamespace(next_token_logits_buffer=buffer)

    def logits(meta=meta):
        buffer.fill_(float("nan"))
        with Dispatched() as seen:
            out = processor._get_logits(x, head, meta)
        copies = [args for func, args in seen.calls if func.overloadpacket.__name__ == "copy_"]
        return out, seen.names(), [a[0].data_ptr() == a[1].data_ptr() and a[0].dtype == a[1].dtype for a in copies]

    sglangs, names, _ = logits()
    expected = head.quant_method.apply(head, x).float()  # bf16 logits, widened as SGLang's copy widens them
    assert sglangs is buffer and torch.equal(sglangs, expected) and "w8a16_gemm_into" not in names
    load_plugins()
    ours, names, onto_itself = logits()
    assert ours is buffer and torch.equal(ours, expected), "the buffer holds SGLang's bits"
    assert "w8a16_gemm_into" in names and "w8a16_gemm" not in names and onto_itself == [True]
    assert head.quant_method.logits_buffer is None, "the buffer is the method's only during the logits step"
    other_rows = SimpleNamespace(next_token_logits_buffer=torch.empty(8, 128, device=DEVICE))
    for declined in (dict(meta=SimpleNamespace(next_token_logits_buffer=None)), dict(meta=other_rows)):
        assert "w8a16_gemm_into" not in logits(**declined)[1]
    processor.logit_scale = 0.5
    scaled, names, _ = logits()
    assert "w8a16_gemm_into" not in names and torch.equal(scaled, expected * 0.5)


@pytest.mark.parametrize("check", ["check_checkpoint_linear", "check_ignored_linear_stays_bf16",
                                   "check_drafter_linear_quantized_at_load",
                                   "check_drafter_qkv_keeps_bf16_for_fused_kv_materialisation_and_projects_in_int8",
                                   "check_int8_lm_head",
                                   "check_logits_written_into_sglangs_buffer"])
def test_sglang_layers_run_on_qflash_kernels(check):
    code = (f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\nimport test_quant_method as t\n"
            f"t.setup_one_process()\nt.{check}()\nprint('passed')")
    result = run_python(code, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("passed"), result.stderr[-4000:]


def test_checkpoint_config_is_claimed_only_for_qflash():
    quant = quantized_config(TARGET_CONFIG)["quantization_config"]
    assert QflashW8A8Config.override_quantization_method(quant, None) == NAME
    assert QflashW8A8Config.override_quantization_method(quant, NAME) == NAME
    assert QflashW8A8Config.override_quantization_method(quant, "w8a8_int8") is None  # asked for stock
    stock = {k: v for k, v in quant.items() if k != "qflash_lm_head"}
    assert QflashW8A8Config.override_quantization_method(stock, None) is None
    cfg = QflashW8A8Config.from_config(json.loads(json.dumps(quant)))
    assert (cfg.ignore, cfg.int8_lm_head, cfg.prequantized) == (["lm_head"], True, True)
    assert (QflashW8A8Config().int8_lm_head, QflashW8A8Config().prequantized) == (False, False)


def test_gemm_phase_follows_role_and_m():
    assert [gemm_phase("verify", m) for m in (16, DECODE_MAX_M, DECODE_MAX_M + 1)] == ["verify", "verify", "prefill"]
    assert gemm_phase("draft", 48) == "draft" and gemm_phase("draft", 8192) == "prefill"
