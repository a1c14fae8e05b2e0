"""qflash's Triton kernels on small shapes with ragged edges (CPU: Triton's interpreter, set in conftest).

The interpreter truncates fp32 -> bf16 instead of rounding, so bf16 outputs are compared with a 1-ulp
(2^-7 relative) tolerance here; the GPU tests hold the real rounding to 2^-8.
"""

import argparse
import ast
import json
from pathlib import Path

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from qflash.kernels import (block_attention, commit_steps, config_table, conv_update, embedding, gdn_prefill,
                            gdn_verify, per_token_quant, row_argmax, sigmoid_mul_quant, verify_metadata, w4_draft_pick,
                            w8a16_argmax, w8a16_gemm, w8a8_gemm)
from qflash.server.tools import shapes
from qflash.server import preset
from conftest import REPO, run_python

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0 ** -7
W8A8_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, GROUP_M=1, QUANT_X=q, SPLIT_K=1, num_warps=4, num_stages=2)
                for q in (True, False)] + [
    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, QUANT_X=False, SPLIT_K=1, num_warps=4, num_stages=2),
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, QUANT_X=False, SPLIT_K=3, num_warps=4, num_stages=2)]
# weight tiles loaded before the PDL wait (the first in a grid of one wave on the GPU; off CUDA none by default): one,
# two (past a split's K range at split-K 3) and four (past all of K = 100 at 32 a tile)
W8A8_CONFIGS += [dict(W8A8_CONFIGS[0], EARLY_TILES=1), dict(W8A8_CONFIGS[3], EARLY_TILES=2),
                 dict(W8A8_CONFIGS[2], EARLY_TILES=4)]
W8A8_IDS = ["fused-quant", "separate-quant", "32x32x32-grouped", "split-k-3", "fused-quant-early-tile",
            "split-k-3-two-early-tiles", "grouped-four-early-tiles"]
W8A16_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)


def quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    absmax = xf.abs().amax(dim=1).clamp_min(1e-10)
    # IEEE 127 / absmax (torch computes `127.0 / t` as reciprocal times 127), then x times it: as the kernels
    q = xf * (torch.full_like(absmax, 127.0) / absmax)[:, None]
    scale = absmax / 127.0
    return torch.where(q >= 0, q + 0.5, q - 0.5).trunc().to(torch.int8), scale


def int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    return w.to(DEVICE), scale.to(DEVICE)


def rel_err(y, ref):
    return ((y.double() - ref).abs() / ref.abs().clamp_min(1e-12)).max().item()


def test_per_token_quant_matches_the_rounding_rule_bit_for_bit():
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    x[2] = 0  # an all-zero row must not divide by zero
    x[4, 17] = -1000.0
    q, scale = per_token_quant.per_token_quant(x.to(DEVICE))
    q_ref, scale_ref = quant_reference(x)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)
    assert q[2].abs().max() == 0 and q[4, 17] == -127


@pytest.mark.parametrize("config", W8A8_CONFIGS, ids=W8A8_IDS)
def test_w8a8_integer_products_are_exact(config):
    # Integer-valued rows with absmax 127 quantize to themselves (scale 1); with unit weight scales and
    # fp32 output the result is the int32 accumulator itself, compared against int64 exactly.
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-127, 128, (5, 100), generator=g).float()
    x[:, 0] = 127.0
    w, _ = int8_weight(40, 100)
    y = w8a8_gemm.launch(x.to(DEVICE), w, torch.ones(40, device=DEVICE), None, config)
    assert torch.equal(y.cpu().to(torch.int64), x.to(torch.int64) @ w.cpu().to(torch.int64).T)


@pytest.mark.parametrize("config", W8A8_CONFIGS, ids=W8A8_IDS)
def test_w8a8_scaled_output_within_bf16_rounding(config):
    x = torch.randn(37, 200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w, w_scale = int8_weight(72, 200)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    y = w8a8_gemm.launch(x.to(DEVICE), w, w_scale, bias, config)
    q, s = quant_reference(x)
    ref = (q.double() @ w.cpu().double().T) * s.double()[:, None] * w_scale.cpu().double()[None, :] + bias.cpu().double()
    assert y.dtype == torch.bfloat16 and rel_err(y.cpu(), ref) <= BF16_ULP + 1e-6


def test_w8a8_fused_quantization_split_k_and_early_tiles_give_the_same_bits():
    x = torch.randn(20, 150, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    w, w_scale = int8_weight(48, 150)
    separate = w8a8_gemm.launch(x, w, w_scale, None, W8A8_CONFIGS[1])
    assert all(torch.equal(w8a8_gemm.launch(x, w, w_scale, None, c), separate) for c in W8A8_CONFIGS)


@pytest.mark.parametrize("config", W8A8_CONFIGS, ids=W8A8_IDS)
def test_output_cuts_write_each_segment_as_its_own_block(config):
    """A Gated-DeltaNet layer's q|k|v, z, b and a apart (server/hooks/gdn_input_proj.py): each block holds the bits
    of those columns of the plain output, with cuts inside tiles (40 and 104 are no multiple of 16 or 32) and a
    segment narrower than a tile."""
    x = torch.randn(20, 150, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).to(DEVICE)
    w, w_scale = int8_weight(120, 150)
    cuts = [40, 96, 104]
    blocks = w8a8_gemm.segments(w8a8_gemm.launch(x, w, w_scale, None, config, cuts=tuple(cuts)), 20, cuts, 120)
    assert [b.shape for b in blocks] == [(20, 40), (20, 56), (20, 8), (20, 16)] and all(b.is_contiguous() for b in blocks)
    assert torch.equal(torch.cat(blocks, dim=1), w8a8_gemm.launch(x, w, w_scale, None, config))
    empty = w8a8_gemm.segments(w8a8_gemm.launch(x[:0], w, w_scale, None, config, cuts=tuple(cuts)), 0, cuts, 120)
    assert [b.shape for b in empty] == [(0, 40), (0, 56), (0, 8), (0, 16)]  # a forward of no tokens


# The prefill's TMA kernel (kernels/w8a8_gemm.py): M, N and K all ragged against its tiles in the tests below.
TMA_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, QUANT_X=False, SPLIT_K=1, TMA=True, num_warps=4,
                  num_stages=2)


def test_tma_tiles_give_the_pointer_kernels_bits():
    """The same int32 sums and epilogue as the pointer kernel, bit for bit: past M, N and K the hardware's zero fill
    stands in for the masks; with a bias, output cuts, and x's rows quantized by their producer."""
    x = torch.randn(37, 144, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16).to(DEVICE)
    w, w_scale = int8_weight(72, 144)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).to(DEVICE)
    pointer = {k: v for k, v in TMA_CONFIG.items() if k != "TMA"}
    for b in (None, bias):
        y = w8a8_gemm.launch(x, w, w_scale, b, TMA_CONFIG)
        assert y.shape == (37, 72) and torch.equal(y, w8a8_gemm.launch(x, w, w_scale, b, pointer))
    cuts = (40, 56, 64)
    assert torch.equal(w8a8_gemm.launch(x, w, w_scale, None, TMA_CONFIG, cuts=cuts),
                       w8a8_gemm.launch(x, w, w_scale, None, pointer, cuts=cuts))
    x_q, x_scale = per_token_quant.per_token_quant(x)
    assert torch.equal(w8a8_gemm.launch(x, w, w_scale, None, TMA_CONFIG, x_q, x_scale),
                       w8a8_gemm.launch(x, w, w_scale, None, pointer))
    assert w8a8_gemm.launch(x[:0], w, w_scale, None, TMA_CONFIG).shape == (0, 72)


def test_tma_configs_run_the_tma_kernel_and_refuse_what_it_lacks(monkeypatch):
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, grid[0]))

    monkeypatch.setattr(w8a8_gemm, "_w8a8_tma_kernel", Recorder("tma"))
    monkeypatch.setattr(w8a8_gemm, "_w8a8_gemm_kernel", Recorder("pointer"))
    x = torch.randn(37, 144).to(torch.bfloat16)
    w, w_scale = torch.zeros(72, 144, dtype=torch.int8), torch.ones(72)
    w8a8_gemm.launch(x, w, w_scale, None, TMA_CONFIG)
    assert launched == [("tma", 2 * 3)]  # one program a 32 x 32 tile
    for config in (dict(TMA_CONFIG, QUANT_X=True), dict(TMA_CONFIG, SPLIT_K=2)):
        with pytest.raises(ValueError, match="one pass"):
            w8a8_gemm.launch(x, w, w_scale, None, config)
    with pytest.raises(ValueError, match="16 bytes"):  # rows of 100 int8 values: no TMA row
        w8a8_gemm.launch(x[:, :100], w[:, :100], w_scale, None, TMA_CONFIG)
    assert not w8a8_gemm.conv_fits(dict(TMA_CONFIG, BLOCK_M=16), 32, (64, 96, 100), 16)
    assert w8a8_gemm.conv_fits(dict(TMA_CONFIG, BLOCK_M=16, TMA=False), 32, (64, 96, 100), 16)
    # the table's TMA rows: prefill GEMMs on int8 rows in one pass, at widths whose rows TMA can read
    tma_rows = [(key, c) for key, c in w8a8_gemm.CONFIGS.items() if c.get("TMA")]
    assert tma_rows and all(key[0] == "prefill" and not c["QUANT_X"] and c["SPLIT_K"] == 1 and key[3] % 16 == 0
                            for key, c in tma_rows)


def test_the_first_weight_tile_goes_early_in_grids_of_one_wave(monkeypatch):
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid[0], kwargs["EARLY_K"]))

    monkeypatch.setattr(w8a8_gemm, "_w8a8_gemm_kernel", Recorder())
    monkeypatch.setattr(w8a8_gemm.pdl, "multiprocessors", lambda device: 6)
    x = torch.randn(16, 64).to(torch.bfloat16)
    for n, split_k in ((48, 1), (96, 1), (112, 1), (48, 2), (48, 3)):
        w, w_scale = torch.zeros(n, 64, dtype=torch.int8), torch.ones(n)
        w8a8_gemm.launch(x, w, w_scale, None, dict(W8A8_CONFIGS[1], SPLIT_K=split_k))
    w8a8_gemm.launch(x, w, w_scale, None, dict(W8A8_CONFIGS[1], SPLIT_K=3, EARLY_TILES=2))  # a table's count rules
    assert launched == [(3, 64), (6, 64), (7, 0), (6, 64), (9, 0), (9, 128)]


def test_split_k_leaves_its_workspace_zeroed_for_the_next_call():
    x = torch.randn(20, 150, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    w, w_scale = int8_weight(48, 150)
    first = w8a8_gemm.launch(x, w, w_scale, None, W8A8_CONFIGS[3])
    ws, counts = w8a8_gemm.split_k_buffers(x.device, 20, 48, 6)
    assert not ws.any() and not counts.any()
    assert torch.equal(w8a8_gemm.launch(x, w, w_scale, None, W8A8_CONFIGS[3]), first)


def test_w8a8_custom_op_reshapes_and_uses_the_table():
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    w, w_scale = int8_weight(32, 64)
    y = torch.ops.qflash.w8a8_gemm(x, w, w_scale, None, "verify")
    assert y.shape == (2, 3, 32)
    assert torch.equal(y.reshape(6, 32), w8a8_gemm.launch(x.reshape(6, 64), w, w_scale, None, w8a8_gemm.DEFAULT_DECODE))


def test_w8a16_gemm_within_bf16_rounding():
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    w, w_scale = int8_weight(100, 256)
    y = w8a16_gemm.launch(x.to(DEVICE), w, w_scale, dict(W8A16_CONFIG, GROUP_M=1))
    ref = (x.double() @ w.cpu().double().T) * w_scale.cpu().double()[None, :]
    assert rel_err(y.cpu(), ref) <= BF16_ULP + 1e-4


def test_fused_argmax_picks_the_greedy_token_without_logits():
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    w, w_scale = int8_weight(300, 128)  # 10 tiles of 32, the last one ragged
    ids = w8a16_argmax.launch(x.to(DEVICE), w, w_scale, W8A16_CONFIG)
    ref = ((x.double() @ w.cpu().double().T) * w_scale.cpu().double()[None, :]).argmax(dim=1)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ref)
    buffer = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)  # a graph's buffer: the ids go into its rows 1-5
    w8a16_argmax.launch(x.to(DEVICE), w, w_scale, W8A16_CONFIG, out=buffer[1:6])
    assert buffer.cpu().tolist() == [-1, *ref.tolist(), -1]


def test_argmax_tie_takes_the_first_index_across_tiles():
    x = torch.ones(1, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(100, 64, dtype=torch.int8, device=DEVICE)
    w[[70, 40, 90]] = 1  # equal logits in three tiles; torch.argmax takes the first, 40
    assert w8a16_argmax.launch(x, w, torch.ones(100, device=DEVICE), W8A16_CONFIG).item() == 40


def test_fake_implementations_give_shapes_without_running():
    with FakeTensorMode():
        x = torch.empty(48, 2560, dtype=torch.bfloat16)
        w = torch.empty(12288, 2560, dtype=torch.int8)
        scale = torch.empty(12288)
        assert torch.ops.qflash.w8a8_gemm(x, w, scale, None, "verify").shape == (48, 12288)
        assert torch.ops.qflash.w8a16_gemm(x, w, scale, "lm_head").shape == (48, 12288)
        ids = torch.ops.qflash.w8a16_argmax(x, w, scale, "lm_head")
        assert ids.shape == (48,) and ids.dtype == torch.int64
        q, s = torch.ops.qflash.per_token_quant(x)
        assert (q.shape, q.dtype, s.shape) == ((48, 2560), torch.int8, (48,))


def test_config_lookup_by_phase_and_m_bucket():
    table = {("verify", 32, 64, 128): {"pick": "verify-32"}, ("prefill", 2048, 64, 128): {"pick": "prefill-2048"}}
    default = {"pick": "default"}
    assert config_table.lookup(table, "verify", 17, 64, 128, default)["pick"] == "verify-32"
    assert config_table.lookup(table, "verify", 16, 64, 128, default)["pick"] == "default"
    assert config_table.lookup(table, "prefill", 300, 64, 128, default)["pick"] == "prefill-2048"
    assert config_table.lookup(table, "prefill", 100_000, 64, 128, default)["pick"] == "default"  # bucket 8192
    with pytest.raises(ValueError, match="unknown GEMM phase"):
        config_table.lookup(table, "decode", 16, 64, 128, default)


def test_tuner_output_is_read_back_by_the_launcher(tmp_path):
    path = tmp_path / "w8a8_gemm_copy.py"
    path.write_text(open(w8a8_gemm.__file__).read())
    table = {("prefill", 8192, 2560, 9216): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, QUANT_X=False, num_warps=8, num_stages=3),
             ("verify", 16, 64, 2560): dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, GROUP_M=1, QUANT_X=True, num_warps=4, num_stages=4)}
    from qflash.server.tools import tune

    tune.write(path, table, "NVIDIA H200 (sm90)")
    tune.write(path, table, "NVIDIA H200 (sm90)")  # rewriting replaces, never appends
    text = path.read_text()
    assert text.count("CONFIGS = {") == 1 and text.count("# Tuned on NVIDIA H200 (sm90)") == 1
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CONFIGS")
    assert eval(compile(ast.Expression(node.value), str(path), "eval"), {"dict": dict}) == table
    assert tree.body[-1] is node  # the table stays the file's last statement


def test_the_tuner_times_decode_gemms_in_a_chain_over_weights_that_outgrow_l2(monkeypatch):
    """Decode M: calls back to back, each over its own weight copy (more bytes than L2 together, within memory),
    as a cycle's layers run; prefill M: one call after an L2 flush."""
    from qflash.server.tools import timing, tune
    from qflash.server.tools.shapes import DRAFTER, TARGET

    for _, n, k in TARGET + DRAFTER:
        calls = timing.chain_calls(n * k)
        assert timing.CHAIN_CALLS[0] <= calls <= timing.CHAIN_CALLS[1]
        assert calls * n * k >= timing.FLUSH_BYTES or calls == timing.CHAIN_CALLS[1]
    timed = []
    monkeypatch.setattr(tune.torch, "randn", lambda *shape, **kw: "x")
    monkeypatch.setattr(tune, "int8_weight", lambda n, k: ("w", "scale"))
    monkeypatch.setattr(tune, "chain_us", lambda fns: timed.append(("chain", [f.args[1] for f in fns])) or 1.0)
    monkeypatch.setattr(tune, "cold_us", lambda fn: timed.append(("cold", [fn.args[1]])) or 1.0)
    tune.w8a8_timer(16, 2560, 9216)({"BLOCK_M": 16})
    tune.w8a8_timer(2048, 2560, 9216)({"BLOCK_M": 128})
    assert [(how, len(weights)) for how, weights in timed] == [("chain", timing.chain_calls(2560 * 9216)), ("cold", 1)]


def test_the_tuner_then_picks_the_early_tiles_of_a_decode_config(monkeypatch, capsys):
    """Decode rows: the best tile config, then its count of weight tiles before the PDL wait (the fastest of
    tune.EARLY_TILES); a config that quantizes x itself keeps the launcher's default, and prefill has none. Each line
    also gives the time of the table entry it replaces."""
    from qflash.server.tools import tune

    monkeypatch.setattr(tune, "w8a8_timer", lambda m, n, k, gemm: lambda config: 3.0)
    monkeypatch.setattr(tune, "gdn_input_verify", lambda m, then_verify: None)
    rounds = []

    def best_config(time_us, candidates):
        rounds.append(candidates)
        if "EARLY_TILES" in candidates[0]:
            return next(c for c in candidates if c["EARLY_TILES"] == 2), 1.0
        return dict(candidates[0], QUANT_X=candidates[0]["BLOCK_M"] == 32), 2.0
    monkeypatch.setattr(tune, "best_config", best_config)
    table = tune.tune_w8a8((16, 32, 2048))
    assert {c.get("EARLY_TILES") for (_, m, _, _), c in table.items()} >= {2, None}
    assert all((c.get("EARLY_TILES") == 2) == (m == 16) for (_, m, _, _), c in table.items())
    assert [c["EARLY_TILES"] for c in rounds[1]] == list(tune.EARLY_TILES)
    lines = capsys.readouterr().out.splitlines()
    assert all("(table's 3.0 us)" in line for line in lines if "M=   16" in line)  # every 16-row shape has one


@pytest.mark.parametrize("served_us, kept", [(1.01, True), (1.03, False), (None, False)])
def test_the_tuner_keeps_a_table_entry_within_its_noise_of_the_best(monkeypatch, capsys, served_us, kept):
    """A table entry within tune.KEEP_WITHIN (2%) of the fastest candidate stays; a slower one, or one that does not
    run on this chip (None: it raises), is replaced."""
    from qflash.server.tools import tune

    served = set(map(id, w8a8_gemm.CONFIGS.values()))

    def timer(config):
        if id(config) not in served:
            return 1.0
        if served_us is None:
            raise RuntimeError("out of shared memory")
        return served_us
    monkeypatch.setattr(tune, "w8a8_timer", lambda m, n, k, gemm: timer)
    monkeypatch.setattr(tune, "gdn_input_verify", lambda m, then_verify: None)
    monkeypatch.setattr(tune, "best_config", lambda time_us, candidates: ({"BLOCK_M": 16, "QUANT_X": True}, 1.0))
    table = tune.tune_w8a8((16,))
    assert table and all((c is w8a8_gemm.CONFIGS[key]) == kept for key, c in table.items())
    lines = capsys.readouterr().out.splitlines()
    assert lines and all((", kept)" in line) == kept and ("(table's" in line) == (served_us is not None) for line in lines)


def test_bench_kernels_times_each_gemm_as_served_on_its_table_config(monkeypatch):
    """qflash's column in `bench-kernels` is the tuner's served call (the GDN input GEMM with its conv) on the config
    the table gives. The 16-row shapes are real ones, whose tables differ by phase: a config of the wrong phase fails."""
    from qflash.server.tools import bench_kernels

    made = {name: getattr(torch, name) for name in ("randn", "randint", "rand")}
    for name, make in made.items():  # the bench's tensors on this machine's device
        monkeypatch.setattr(torch, name, lambda *a, make=make, device=None, **kw: make(*a, **kw))
    calls = []
    monkeypatch.setattr(bench_kernels, "served_gemm", lambda phase, name, m: lambda *args: calls.append(
        (phase, name, m, args[1].shape, args[4])))
    monkeypatch.setattr(bench_kernels, "time_us", lambda fn: (fn(), 1.0)[1])
    real = {name: (name, n, k) for name, n, k in shapes.TARGET + shapes.DRAFTER}
    for phase, m, (name, n, k) in (("verify", 16, real["mlp.down_proj"]), ("draft", 16, real["draft.down_proj"]),
                                   ("draft", 2048, ("draft.o_proj", 32, 64))):
        bench_kernels.gemm_row(phase, name, m, n, k, stock=lambda *args: None)
        assert calls.pop(0) == (phase, name, m, (n, k), w8a8_gemm.table_config(phase, m, n, k))
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_tuner_runs_the_gdn_input_gemm_with_and_without_its_conv_epilogue_and_verify_gpu():
    from qflash.server.tools import tune

    n, k = next((n, k) for name, n, k in shapes.TARGET if name == "gdn.in_proj_qkvzba")
    x, (w, w_scale) = torch.randn(32, k, device="cuda", dtype=torch.bfloat16), tune.int8_weight(n, k)
    for split_k in (1, 2):  # the conv in the epilogue; split-K: the GEMM, then the conv kernel
        for then_verify in (False, True):
            tune.gdn_input_verify(32, then_verify)(x, w, w_scale, None,
                                                    dict(w8a8_gemm.DEFAULT_DECODE, QUANT_X=False, SPLIT_K=split_k))
    torch.cuda.synchronize()


@pytest.mark.parametrize("gemms", [None, ("gdn.in_proj_qkvzba",)])
def test_tuning_some_row_buckets_keeps_the_tables_other_entries(monkeypatch, gemms):
    """`--rows 16`: the 16-row buckets of every table; with `--gemms`, of the W8A8 table's named GEMMs alone."""
    from qflash.server.tools import tune

    jobs, written = [], {}
    monkeypatch.setattr(tune, "require_gpu", lambda: None)
    monkeypatch.setattr(tune.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(tune.torch.cuda, "get_device_capability", lambda: (9, 0))
    class Timer(tuple):  # (M, N, K, gemm), and a time for the table entry a line reports beside the new one
        def __call__(self, config):
            return 2.0
    monkeypatch.setattr(tune, "w8a8_timer", lambda m, n, k, gemm: Timer((m, n, k, gemm)))
    monkeypatch.setattr(tune, "gdn_input_verify", lambda m, then_verify: f"the GDN input GEMM of {m} rows, its conv "
                        f"in a verify{', then the GDN verify' if then_verify else ''}")
    monkeypatch.setattr(tune, "int8_weight", lambda n, k: (None, None))
    monkeypatch.setattr(tune.w4_draft_pick, "quantize", lambda w: (torch.empty(0), torch.empty(0)))
    monkeypatch.setattr(tune.torch, "randn", lambda *shape, **kw: None)
    def best_config(timer, candidates):  # a shape's timer, once: its early tiles' round (below) is another test's
        if "EARLY_TILES" not in candidates[0]:
            jobs.append(timer)
        return {"new": True}, 1.0
    monkeypatch.setattr(tune, "best_config", best_config)
    monkeypatch.setattr(tune, "write", lambda path, table, tuned_on: written.update({Path(path).stem: table,
                                                                                     "tuned_on": tuned_on}))
    assert tune.run(argparse.Namespace(rows=[16], gemms=gemms or tune.W8A8_GEMMS), []) == 0
    of = f" of {gemms[0]}" if gemms else ""
    assert written.pop("tuned_on") == f"NVIDIA H200 (sm90), the 16-row buckets{of} only (the others: BENCHMARKS.md)"
    assert set(written) == ({"w8a8_gemm"} if gemms else {"w8a8_gemm", "w8a16_gemm", "w8a16_argmax", "w4_draft_pick"})
    in_proj = next(n for name, n, _ in shapes.TARGET if name == "gdn.in_proj_qkvzba")
    if gemms:  # its one W8A8 job; the table's other 16-row entries kept
        assert [timer[3] for timer in jobs] == [
            "the GDN input GEMM of 16 rows, its conv in a verify, then the GDN verify"]
        assert [key for key, c in written["w8a8_gemm"].items() if c == {"new": True}] == [
            ("verify", 16, in_proj, shapes.HIDDEN)]
        return
    assert {timer[0] for timer in jobs if isinstance(timer, tuple)} == {16}  # (M, N, K) of the W8A8 shapes timed
    # the GDN input GEMM's verify timed as served, with the conv and the GDN verify that waits on it; the rest alone
    gemms = [timer[3] for timer in jobs if isinstance(timer, tuple)]
    assert [timer[3] for timer in jobs if isinstance(timer, tuple) and timer[1] == in_proj] == [
        "the GDN input GEMM of 16 rows, its conv in a verify, then the GDN verify"]
    assert gemms.count(w8a8_gemm.launch) == len(gemms) - 1
    for module in (w8a8_gemm, w8a16_gemm, w8a16_argmax, w4_draft_pick):
        table = written[Path(module.__file__).stem]
        assert table.keys() >= module.CONFIGS.keys()
        assert all((c == {"new": True}) == (key[1] == 16) for key, c in table.items())


def test_shapes_follow_from_the_preset():
    t, d = preset.TEXT_CONFIG, preset.DRAFTER_CONFIG
    key, value = t["linear_num_key_heads"] * t["linear_key_head_dim"], t["linear_num_value_heads"] * t["linear_value_head_dim"]
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    h, ffn = t["hidden_size"], t["intermediate_size"]
    assert dict((n, (N, K)) for n, N, K in shapes.TARGET) == {
        "gdn.in_proj_qkvzba": (2 * key + 2 * value + 2 * t["linear_num_value_heads"], h),
        "gdn.out_proj": (h, value), "attn.qkv_proj": (2 * q + 2 * kv, h), "attn.o_proj": (h, q),
        "mlp.gate_up_proj": (2 * ffn, h), "mlp.down_proj": (h, ffn)}
    dq = d["num_attention_heads"] * d["head_dim"]
    dkv = d["num_key_value_heads"] * d["head_dim"]
    # its fc is a plain nn.Linear in SGLang's DFlash model
    assert dict((n, (N, K)) for n, N, K in shapes.DRAFTER) == {
        "draft.qkv_proj": (dq + 2 * dkv, h), "draft.o_proj": (h, dq), "draft.gate_up_proj": (2 * ffn, h), "draft.down_proj": (h, ffn)}
    assert shapes.LM_HEAD == ("lm_head", t["vocab_size"], h)
    assert sum(shapes.TARGET_COUNT.values()) == 24 * 2 + 8 * 2 + 32 * 2


def test_bench_kernels_gdn_table_renders():
    from qflash.server.tools.bench_kernels import FOLD_TILES, VERIFY_TILES, render_gdn

    row = {"batch": 1, "sglang_verify_us": 29.9, "sglang_fold_us": 56.0,
           **{f"verify_{bv}x{w}_us": bv + w / 10 for bv, w in VERIFY_TILES}, **{f"fold_{bv}_us": None for bv in FOLD_TILES}}
    lines = render_gdn([row]).splitlines()
    assert lines[2].count("|") == 3 + len(VERIFY_TILES) and lines[-3].count("|") == 3 + len(FOLD_TILES)
    assert "| 1 | 29.9 | 16.2 | 16.4 | 32.4 | 32.8 | 64.4 | 64.8 |" in lines
    assert "| 1 | 56.0 | - | - | - | - |" in lines


def test_bench_kernels_gdn_prefill_table_renders():
    from qflash.server.tools.bench_kernels import render_gdn_prefill
    from qflash.kernels.gdn_prefill import MAX_TOKENS

    table = render_gdn_prefill([{"tokens": 64, "sglang_gpu_us": 37.0, "sglang_host_us": 668.7, "qflash_gpu_us": 70.5,
                                 "qflash_host_us": None}])
    assert f"up to {MAX_TOKENS} tokens" in table.splitlines()[0]
    assert "| 64 | 37.0 / 668.7 | 70.5 / - |" in table


def test_bench_kernels_table_renders():
    from qflash.server.tools.bench_kernels import render

    row = {"phase": "verify", "gemm": "mlp.down_proj", "M": 16, "N": 2560, "K": 9216, "cublas_bf16_us": 14.0,
           "int_mm_us": None, "sglang_int8_us": 12.0, "qflash_us": 8.0, "qflash_weight_gbps": 2949.1,
           "qflash_tops": 94.4, "vs_sglang": 1.5}
    head = {"M": 16, "cublas_bf16_us": 300.0, "w8a16_us": 170.0, "w8a16_weight_gbps": 3741.0,
            "w8a16_then_argmax_us": 190.0, "fused_argmax_us": 160.0, "draft_pick_us": 90.0}
    table = render([row], [head], {"sglang_us": 1200.0, "qflash_us": 800.0, "worst_vs_sglang": 1.5})
    assert "| verify | mlp.down_proj | 16 | 2560x9216 | 14.0 | - | 12.0 | 8.0 | 2949 (69%) | 94 | 1.50x |" in table
    assert "| 16 | 300.0 | 170.0 | 87% | 190.0 | 160.0 | 90.0 |" in table
    assert "SGLang int8 1200 us, qflash 800 us (1.50x)" in table
    table = render([row], [head], {"sglang_us": 1200.0, "qflash_us": 800.0, "worst_vs_sglang": 1.5}, "NVIDIA H100 80GB HBM3")
    assert "(% of the H100's 3.0 TB/s)" in table and "| 2949 (98%) |" in table  # the card's own copy rate
    assert "| 16 | 300.0 | 170.0 | 125% |" in table  # the lm_head's share too


SM90_SHARED_MEMORY = 232448  # bytes of shared memory one program may hold on an H200


def compile_for_sm90(kernel, pointers: dict, config: dict, divisible=()):
    """Compile a kernel for an H200 (sm90) without a GPU, as it is served there (programmatic dependent launch on):
    Triton's front end, ptxas included. Pointers and the integers named in `divisible` are multiples of 16, as Triton
    specializes them when serving (without that it neither vectorizes nor pipelines the loads, and the shared memory
    of the pipeline's stages goes unchecked); the program must fit the H200's shared memory."""
    fn = JITFunction(getattr(kernel, "fn", kernel))  # under the interpreter the kernel wraps the Python function
    launch = {"num_warps", "num_stages"}
    constexprs = {k: v for k, v in config.items() if k not in launch} | {"PDL": True}
    signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a in divisible or signature[a].startswith("*")}
    options = {k: v for k, v in config.items() if k in launch} | {"enable_fp_fusion": False, "launch_pdl": True}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= SM90_SHARED_MEMORY, (fn.__name__, config, compiled.metadata.shared)
    return compiled


def distinct(configs):
    return [dict(c) for c in {tuple(sorted(c.items())) for c in configs}]


def pointer_constants(config: dict) -> dict:
    """A pointer-kernel W8A8 config's constexprs as `w8a8_gemm.launch` passes them, but the early tiles' count,
    which the caller turns into EARLY_K."""
    return {k: v for k, v in config.items() if k != "EARLY_TILES"}


# the W8A8 GEMM's pointer arguments but x's, and those of its conv epilogue
GEMM_POINTERS = {"x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*i8", "y_ptr": "*bf16",
                 "ws_ptr": "*i32", "count_ptr": "*i32"}
CONV_POINTERS = {"cw_ptr": "*bf16", "cb_ptr": "*bf16", "cs_ptr": "*bf16", "slots_ptr": "*i32", "win_ptr": "*bf16",
                 "win_slots_ptr": "*i32"}


def compiled_apart(function: str, timeout: int = 900):
    """What this file's `function`() returns (JSON), run in a process without Triton's interpreter, which patches
    triton.language while it runs."""
    code = f"import json, sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\nfrom test_kernels import {function}\n" \
           f"print(json.dumps({function}()))"
    result = run_python(code, env={"TRITON_INTERPRET": "0"}, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def compile_every_table_config() -> list[tuple[str, dict, bool]]:
    """(kernel, config, uses wgmma) for every distinct config in the tables and defaults, compiled for sm90."""
    done = []
    gemm_ints = ("N", "K", "stride_xm", "stride_wn", "stride_ym")  # multiples of 16 at every served shape
    split_k = dict(w8a8_gemm.DEFAULT_DECODE, QUANT_X=False, SPLIT_K=4)  # the atomic split-K path compiles too
    for config in distinct([*w8a8_gemm.CONFIGS.values(), w8a8_gemm.DEFAULT_DECODE, w8a8_gemm.DEFAULT_PREFILL, split_k]):
        if config.get("TMA"):  # the prefill's TMA kernel, plain and with output cuts
            descriptors = {"x_desc": f"tensordesc<i8[{config['BLOCK_M']}, {config['BLOCK_K']}]>",
                           "w_desc": f"tensordesc<i8[{config['BLOCK_N']}, {config['BLOCK_K']}]>"}
            for segmented in (False, True):
                kernel = compile_for_sm90(w8a8_gemm._w8a8_tma_kernel, {**descriptors, **GEMM_POINTERS},
                                          {**{k: v for k, v in config.items() if k not in ("TMA", "QUANT_X", "SPLIT_K")},
                                           "HAS_BIAS": False, "SEGMENTED": segmented}, ("N", "K", "cut1", "cut2", "cut3"))
            done.append(("w8a8_gemm", config, "wgmma" in kernel.asm["ptx"]))
            continue
        pointers = {"x_ptr": "*bf16" if config["QUANT_X"] else "*i8", **GEMM_POINTERS}
        # weight tiles after or before the PDL wait (by the grid or the table's count, as served); the output in blocks
        constants = pointer_constants(config)
        for early, segmented in ((0, False), (config.get("EARLY_TILES", 1), False), (0, True)):
            kernel = compile_for_sm90(w8a8_gemm._w8a8_gemm_kernel, pointers,
                                      {"SPLIT_K": 1, **constants, "HAS_BIAS": False, "EARLY_K": early * config["BLOCK_K"],
                                       "SEGMENTED": segmented, **conv_update.no_epilogue(None)[1]},
                                      gemm_ints + ("cut1", "cut2", "cut3"))
        done.append(("w8a8_gemm", config, "wgmma" in kernel.asm["ptx"]))
    # the GDN input projection's verify configs with the conv update in the epilogue (server/hooks/gdn_input_proj.py)
    in_proj = next(n for name, n, _ in shapes.TARGET if name == "gdn.in_proj_qkvzba")
    for (phase, m, n, _), config in w8a8_gemm.CONFIGS.items():
        if phase == "verify" and n == in_proj and w8a8_gemm.conv_fits(config, m, shapes.GDN_IN_PROJ_CUTS,
                                                                      preset.BLOCK_SIZE):
            compile_for_sm90(w8a8_gemm._w8a8_gemm_kernel, {"x_ptr": "*i8", **GEMM_POINTERS, **CONV_POINTERS},
                             {**pointer_constants(config), "HAS_BIAS": False,
                              "EARLY_K": 0, "SEGMENTED": True, "CONV_T":
                              preset.BLOCK_SIZE, "CONV_WIDTH": shapes.GDN_CONV_WIDTH, "CONV_BIAS": False},
                             gemm_ints + ("cut1", "cut2", "cut3"))
            done.append(("w8a8_gemm + conv", config, None))
    for k in sorted({k for _, _, k in shapes.TARGET + shapes.DRAFTER}):  # the quantization's rows, in registers
        config = per_token_quant.launch_config(k)
        compile_for_sm90(per_token_quant._per_token_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32"},
                         config)
        done.append(("per_token_quant", config, None))
    pointers = {"x_ptr": "*bf16", "max_ptr": "*fp32", "idx_ptr": "*i32", **GEMM_POINTERS}
    for module, kernel in ((w8a16_gemm, w8a16_gemm._w8a16_gemm_kernel), (w8a16_argmax, w8a16_argmax._w8a16_argmax_kernel)):
        for config in distinct([*module.CONFIGS.values(), module.DEFAULT]):
            compiled = compile_for_sm90(kernel, pointers, {**config, "DOT_DTYPE": triton.language.bfloat16}, gemm_ints)
            done.append((module.__name__.split(".")[-1], config, "wgmma" in compiled.asm["ptx"]))
    for config in distinct([*w4_draft_pick.CONFIGS.values(), w4_draft_pick.DEFAULT]):
        compile_for_sm90(w4_draft_pick._w4_scan_kernel, {**pointers, "w_ptr": "*u8", "amax_ptr": "*u8"},
                         {**config, "DOT_DTYPE": triton.language.bfloat16, "NIBBLE_ASM": True,
                          "GROUP": w4_draft_pick.GROUP}, (*gemm_ints, "stride_amax"))
        done.append(("w4_draft_pick", config, None))
        tiles = triton.next_power_of_2(triton.cdiv(shapes.LM_HEAD[1], config["BLOCK_N"]))
        compile_for_sm90(w4_draft_pick._w4_rescore_kernel, {**pointers, "out_ptr": "*i64"},
                         {"FINALISTS": w4_draft_pick.FINALISTS, "BLOCK_T": tiles,
                          "BLOCK_K": triton.next_power_of_2(shapes.LM_HEAD[2]), "num_warps": 4}, gemm_ints)
    # the pick over the tiles' maxima of the real vocabulary, the fused argmax's and the row argmax's
    widths = {c["BLOCK_N"] for c in w8a16_argmax.CONFIGS.values()} | {row_argmax.CONFIG["BLOCK_N"]}
    for tiles in {triton.next_power_of_2(triton.cdiv(shapes.LM_HEAD[1], width)) for width in widths}:
        compile_for_sm90(w8a16_argmax._argmax_pick_kernel, {"max_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64"},
                         {"BLOCK_T": tiles})
        done.append(("w8a16_pick", {"BLOCK_T": tiles}, None))
    lengths = {"pre_ptr": "*i64", "commit_ptr": "*i32", "last_ptr": "*i64", "track_ptr": "*i64"}
    for track in (True, False):  # the GDN commit's steps, for the most requests a decode graph holds
        compile_for_sm90(commit_steps._gdn_commit_steps_kernel, lengths, {"TRACK": track, "BLOCK": 8})
    done.append(("commit_steps", {"BLOCK": 8}, None))
    pointers = {"q_ptr": "*bf16", "kbuf_ptr": "*bf16", "vbuf_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
                "o_ptr": "*bf16", "kv_indptr": "*i32", "kv_indices": "*i64", "loc_ptr": "*i64", "acc_ptr": "*fp32",
                "ml_ptr": "*fp32", "sm_scale": "fp32"}
    for (dim, dv), config in block_attention.CONFIGS.items():
        for window in (0, 4095):
            common = dict(GROUP=4, L=16, D=dim, DV=dv, NSPLIT=config["NSPLIT"], WINDOW=window, DOT_DTYPE=triton.language.bfloat16)
            for store in (True, False):  # the block's KV written by the split kernel, or by SGLang before it
                compile_for_sm90(block_attention._prefix_split_kernel, pointers, {**common, **config, "STORE": store})
            for causal in (True, False):
                compile_for_sm90(block_attention._merge_block_kernel, pointers,
                                 {**common, "CAUSAL": causal, "BLOCK_N": config["BLOCK_N"], "BLOCK_DV": block_attention.MERGE_DV,
                                  "CHUNK": block_attention.MERGE_CHUNK, "num_warps": 4})
        done.append(("block_attention", config, None))
    heads = dict(H=16, HV=32, K=128, V=128, MAX_CACHE_LEN=gdn_verify.BLOCK_STEPS)  # Qwen3.5-4B's GDN
    pointers = {name: "*bf16" for name in ("a", "q", "k", "v", "b", "o", "rawv", "rawk")} | {
        name: "*fp32" for name in ("A_log", "dt_bias", "h0_source", "ring_g", "ring_beta", "state")} | {
        name: "fp32" for name in ("softplus_beta", "softplus_threshold", "scale")} | {
        name: "*i32" for name in ("h0_indices", "cu_seqlens", "slots", "accept_lens", "track_slots", "track_steps")}
    for config in distinct(gdn_verify.VERIFY_CONFIGS.values()):
        compile_for_sm90(gdn_verify._gdn_verify_kernel, pointers, {**heads, "BT": gdn_verify.BLOCK_STEPS, **config})
        done.append(("gdn_verify", config, None))
    for config in distinct(gdn_verify.FOLD_CONFIGS.values()):
        compile_for_sm90(gdn_verify._gdn_fold_kernel, pointers, {**heads, "HAS_TRACK": True, **config})
        done.append(("gdn_fold", config, None))
    prefill_heads = {name: heads[name] for name in ("H", "HV", "K", "V")}  # a short prompt's recurrent prefill
    compile_for_sm90(gdn_prefill._gdn_prefill_kernel, {**pointers, "g": "*fp32", "beta": "*fp32", "h": "*bf16"},
                     {**prefill_heads, "CHUNK": gdn_prefill.CHUNK, **gdn_prefill.CONFIG})
    done.append(("gdn_prefill", gdn_prefill.CONFIG, None))
    pointers = {name: "*bf16" for name in ("x_ptr", "w_ptr", "bias_ptr", "state_ptr", "win_ptr", "o_ptr")} | {
        "slots_ptr": "*i32", "win_slots_ptr": "*i32"}
    config = dict(T=16, WIDTH=4, HAS_BIAS=True, BLOCK_N=conv_update.BLOCK_N, num_warps=conv_update.NUM_WARPS)
    compile_for_sm90(conv_update._conv_update_kernel, pointers, config)
    done.append(("conv_update", config, None))
    config = dict(per_token_quant.launch_config(dict((name, k) for name, _, k in shapes.TARGET)["attn.o_proj"]),
                  HEAD_DIM=shapes.ATTENTION_HEADS[2], WRITE_Y=False)  # the attention output gate, read by o_proj alone
    compile_for_sm90(sigmoid_mul_quant._sigmoid_mul_quant_kernel,
                     {"attn_ptr": "*bf16", "gate_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32"}, config)
    done.append(("sigmoid_mul_quant", config, None))
    pointers = {"req_to_token_ptr": "*i32", "pool_ptr": "*i64", "lens_ptr": "*i64", "qo_indptr_ptr": "*i64",
                "kv_indptr_ptr": "*i32", "kv_indices_ptr": "*i64", "mask_indptr_ptr": "*i64",
                "window_indptr_ptr": "*i32", "window_indices_ptr": "*i64", "window_offsets_ptr": "*i32"}
    for window in (True, False):  # the drafter's sliding-window layers and the target's
        compile_for_sm90(verify_metadata._verify_metadata_kernel, pointers,
                         {**verify_metadata.CONFIG, "BS_BLOCK": 8, "WINDOW": window})
    done.append(("verify_metadata", verify_metadata.CONFIG, None))
    compile_for_sm90(row_argmax._row_argmax_tile_kernel, {"x_ptr": "*fp32", "max_ptr": "*fp32", "idx_ptr": "*i32"},
                     row_argmax.CONFIG, ("N", "stride_xm"))
    done.append(("row_argmax", row_argmax.CONFIG, None))
    compile_for_sm90(embedding._embedding_kernel, {"ids_ptr": "*i64", "table_ptr": "*bf16", "out_ptr": "*bf16"},
                     embedding.CONFIG, ("D", "stride_table", "stride_out"))
    done.append(("embedding", embedding.CONFIG, None))
    return done


def test_every_table_config_compiles_for_sm90():
    done = compiled_apart("compile_every_table_config")
    tables = [*w8a8_gemm.CONFIGS.values(), *w8a16_gemm.CONFIGS.values(), *w8a16_argmax.CONFIGS.values(),
              *w4_draft_pick.CONFIGS.values(),
              *block_attention.CONFIGS.values(), *gdn_verify.VERIFY_CONFIGS.values(), *gdn_verify.FOLD_CONFIGS.values()]
    assert all(c in [d[1] for d in done] for c in tables)
    # int8 tiles of 64+ rows use Hopper's wgmma; decode tiles of 16-32 rows use mma.sync.
    assert all(wgmma == (c["BLOCK_M"] >= 64) for kernel, c, wgmma in done if kernel == "w8a8_gemm")


def conv_epilogue_ptx() -> str:
    """The PTX of the GDN input GEMM with the conv update in its epilogue, at the verify's 16-row config, for sm90."""
    n, k = next((n, k) for name, n, k in shapes.TARGET if name == "gdn.in_proj_qkvzba")
    config = pointer_constants(w8a8_gemm.table_config("verify", preset.BLOCK_SIZE, n, k))
    return compile_for_sm90(w8a8_gemm._w8a8_gemm_kernel, {"x_ptr": "*i8", **GEMM_POINTERS, **CONV_POINTERS},
                            {**config, "HAS_BIAS": False, "EARLY_K": config["BLOCK_K"], "SEGMENTED": True,
                             "CONV_T": preset.BLOCK_SIZE, "CONV_WIDTH": shapes.GDN_CONV_WIDTH, "CONV_BIAS": False},
                            ("N", "K", "stride_xm", "stride_wn", "cut1", "cut2", "cut3")).asm["ptx"]


def test_the_input_gemm_asks_l2_for_the_convs_states_before_it_waits():
    # pdl.prefetch is inline assembly whose result nothing reads: were it dropped, the conv after the K loop would read
    # its states from HBM again, and no output would show it.
    ptx = compiled_apart("conv_epilogue_ptx")
    assert 0 <= ptx.find("prefetch.global.L2") < ptx.index("griddepcontrol.wait")


def test_bench_kernels_prefill_attention_table_renders():
    from qflash.server.tools.bench_kernels import render_prefill_attention

    table = render_prefill_attention([{"requests": 7, "tokens": 1170, "sglang_us": 4750.0, "torch_us": 1500.0,
                                       "sglang_tflops": 115.8, "torch_tflops": 366.6}])
    assert "| 7 x 1170 | 4750.0 (116) | 1500.0 (367) |" in table


MEMORY_OPS = ("tl.load", "tl.store", "tl.atomic_")


def test_every_kernel_waits_for_the_kernel_before_it_touches_memory():
    # Launched with PDL (kernels/pdl.py), a kernel may start before the previous one has finished: a load or store
    # before `pdl.enter` would race with that kernel, but for pdl's two loads of what no such kernel writes (weights,
    # and what kernels two or more launches back wrote). The helpers a kernel calls before it waits are read too.
    import importlib
    import inspect
    import pkgutil
    import re

    import qflash.kernels

    kernels, helpers = [], {}
    for info in pkgutil.iter_modules(qflash.kernels.__path__):
        module = importlib.import_module(f"qflash.kernels.{info.name}")
        for name, obj in vars(module).items():
            if hasattr(obj, "arg_names") and info.name != "pdl":
                (kernels.append((info.name, name, getattr(obj, "fn", obj))) if name.endswith("_kernel")
                 else helpers.setdefault(name, inspect.getsource(getattr(obj, "fn", obj))))
    assert len(kernels) >= 12 and "_program_sequence" in helpers, kernels
    for module, name, fn in kernels:
        body = inspect.getsource(fn).split("pdl.enter(PDL)")
        assert len(body) == 2 and "PDL" in inspect.signature(fn).parameters, f"{module}.{name} never enters"
        before = body[0] + "".join(helpers.get(call, "") for call in re.findall(r"(\w+)\(", body[0]))
        assert not any(op in before for op in MEMORY_OPS), f"{module}.{name} touches memory before it waits"


def test_pdl_is_off_on_the_cpu():
    from qflash.kernels import pdl

    assert pdl.options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
