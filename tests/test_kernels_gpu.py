"""qflash's kernels at every real Qwen3.5-4B shape and M, through the tables, against float64 (GPU only)."""

import pytest
import torch

from qflash.kernels.config_table import DECODE_M, PREFILL_M
from qflash.server.tools.shapes import DRAFTER, LM_HEAD, TARGET
from test_kernels import quant_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = ([("verify", m, s) for s in TARGET for m in DECODE_M] + [("draft", m, s) for s in DRAFTER for m in DECODE_M]
         + [("prefill", m, s) for s in TARGET + DRAFTER for m in PREFILL_M])


def weight(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    return w, torch.rand(n, device="cuda", generator=g) / (127 * k ** 0.5) + 1e-6


def activations(m, k, seed):
    return torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("phase, m, shape", CASES, ids=[f"{p}-{s[0]}-M{m}" for p, m, s in CASES])
def test_w8a8_against_float64(phase, m, shape):
    name, n, k = shape
    x, (w, w_scale) = activations(m, k, m + n), weight(n, k, k)
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y[:] = torch.ops.qflash.w8a8_gemm(x, w, w_scale, None, phase)
    # Quantize on the CPU, where torch divides exactly (on CUDA it multiplies by 1/127): the same x_q as
    # the kernels' IEEE divisions, then the GEMM in fp64.
    q, scale = quant_reference(x.cpu())
    q, scale = q.cuda().double(), scale.cuda().double()
    ref = (q @ w.double().T) * scale[:, None] * w_scale.double()[None, :]
    # bf16 rounds the exact int32 result once (half an ulp, 2^-9); fp32 scaling adds ~1e-7.
    err = ((y.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    normwise = ((y.double() - ref).norm() / ref.norm()).item()
    assert not y.isnan().any() and err <= 2 ** -8, f"{name} M={m}: max relative error {err:.2e}, normwise {normwise:.2e}"


@pytest.mark.parametrize("m", [16, 8192])
@pytest.mark.parametrize("k", sorted({k for _, _, k in TARGET + DRAFTER}))
def test_per_token_quant_at_every_real_width_bit_for_bit(m, k):
    from qflash.kernels.per_token_quant import per_token_quant

    x = activations(m, k, k) * 3
    x[1] = 0  # an all-zero row
    q, scale = per_token_quant(x)
    q_ref, scale_ref = quant_reference(x.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("split_k", [2, 4, 8])
@pytest.mark.parametrize("shape", [s for s in TARGET + DRAFTER if s[1] <= 2560], ids=lambda s: s[0])
def test_split_k_gives_the_same_bits_as_one_pass(shape, split_k):
    # Concurrent programs add int32 sums atomically; integer addition makes the order irrelevant.
    from qflash.kernels import w8a8_gemm

    name, n, k = shape
    (w, w_scale), one = weight(n, k, k), dict(w8a8_gemm.DEFAULT_DECODE, QUANT_X=False, BLOCK_N=32)
    for m in DECODE_M:
        x = activations(m, k, m)
        ref = w8a8_gemm.launch(x, w, w_scale, None, one)
        for _ in range(3):  # the workspace is left zeroed for the next call
            assert torch.equal(w8a8_gemm.launch(x, w, w_scale, None, dict(one, SPLIT_K=split_k)), ref), f"{name} M={m}"


PREFILL_SHAPES = list({(n, k): name for name, n, k in reversed(TARGET + DRAFTER)}.items())  # one name a shape


@pytest.mark.parametrize("shape, name", PREFILL_SHAPES, ids=[name for _, name in PREFILL_SHAPES])
def test_tma_prefill_gives_the_pointer_kernels_bits_in_a_cuda_graph(shape, name):
    # The TMA descriptors are made as the prefill graphs capture (graphs/), then replayed with new rows; M ragged
    # against the tiles; GDN's input projection with its output cuts (server/hooks/gdn_input_proj.py).
    from qflash.kernels import w8a8_gemm
    from qflash.server.tools.shapes import GDN_IN_PROJ_CUTS

    n, k = shape
    m, (w, w_scale) = 2048 + 80, weight(n, k, k)
    cuts = GDN_IN_PROJ_CUTS if name == "gdn.in_proj_qkvzba" else ()
    tma, pointer = w8a8_gemm.table_config("prefill", 8192, n, k), w8a8_gemm.DEFAULT_PREFILL
    assert tma.get("TMA") and not pointer.get("TMA")
    x = activations(m, k, n)
    w8a8_gemm.launch(x, w, w_scale, None, tma, cuts=cuts)  # compiled outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a8_gemm.launch(x, w, w_scale, None, tma, cuts=cuts)
    x.copy_(activations(m, k, n + 1))
    y.fill_(float("nan"))
    graph.replay()
    assert torch.equal(y, w8a8_gemm.launch(x, w, w_scale, None, pointer, cuts=cuts))


@pytest.mark.parametrize("m", DECODE_M)
def test_w8a16_lm_head_and_fused_argmax(m):
    name, n, k = LM_HEAD
    x, (w, w_scale) = activations(m, k, m), weight(n, k, 7)
    logits = torch.ops.qflash.w8a16_gemm(x, w, w_scale, "lm_head")
    ref = (x.double() @ w.double().T) * w_scale.double()[None, :]
    assert ((logits.double() - ref).norm() / ref.norm()).item() < 4e-3
    ids = torch.ops.qflash.w8a16_argmax(x, w, w_scale, "lm_head")
    top2 = ref.topk(2, dim=1).values
    tie = (top2[:, 0] - top2[:, 1]) <= 1e-3 * top2[:, 0].abs()
    picked = ref.gather(1, ids[:, None]).squeeze(1)
    assert torch.all((ids == ref.argmax(dim=1)) | (tie & (picked >= top2[:, 1])))


def test_ops_capture_in_a_cuda_graph_and_compile():
    x, (w, w_scale) = activations(16, 2560, 1), weight(12288, 2560, 2)
    eager = torch.ops.qflash.w8a8_gemm(x, w, w_scale, None, "verify")
    head_w, head_scale = weight(*LM_HEAD[1:], 3)
    eager_ids = torch.ops.qflash.w8a16_argmax(x, head_w, head_scale, "lm_head")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.qflash.w8a8_gemm(x, w, w_scale, None, "verify")
        ids = torch.ops.qflash.w8a16_argmax(x, head_w, head_scale, "lm_head")
    y.zero_()
    graph.replay()
    assert torch.equal(y, eager) and torch.equal(ids, eager_ids)

    @torch.compile(fullgraph=True)
    def layer(x):
        return torch.ops.qflash.w8a8_gemm(torch.nn.functional.silu(x), w, w_scale, None, "verify")

    ref = torch.ops.qflash.w8a8_gemm(torch.nn.functional.silu(x), w, w_scale, None, "verify")
    assert torch.equal(layer(x), ref)


def _within_one_ulp(a, b) -> tuple[bool, float]:
    """Whether two bf16 tensors are at most 1 ulp apart everywhere, and the share of elements that differ."""
    a, b = a.float(), b.float()
    close = (a - b).abs() <= 2 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-30
    return bool(close.all()), (a != b).float().mean().item()


@pytest.mark.parametrize("gemma", [True, False], ids=["gemma", "plain"])
@pytest.mark.parametrize("m", [16, 8192])
def test_norm_quant_against_sglangs_norm_at_the_real_width(m, gemma):
    """The norm's output within 1 ulp of SGLang's CUDA kernel (their reductions differ in order), its residual
    the same bits, its int8 rows those of what it wrote, bit for bit: the target's Gemma norms, the drafter's."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    from qflash.kernels.norm_quant import rms_norm_quant
    from qflash.server.tools.shapes import HIDDEN

    norm = (GemmaRMSNorm if gemma else RMSNorm)(HIDDEN, eps=1e-6).to(device="cuda", dtype=torch.bfloat16)  # as served
    norm.weight.data.copy_(activations(1, HIDDEN, 1)[0] * 0.2 + (0 if gemma else 1))
    x, residual = activations(m, HIDDEN, 2), activations(m, HIDDEN, 3) * 4
    ref_out, ref_res = norm.forward_cuda(x.clone(), residual.clone())
    out, res = x.clone(), residual.clone()
    q, scale = rms_norm_quant(out, res, norm.weight.data, norm.variance_epsilon, out, gemma)
    assert torch.equal(res, ref_res)
    close, differ = _within_one_ulp(out, ref_out)
    assert close and differ < 0.01, f"{differ:.2%} of the outputs differ"
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("m", [16, 8192])
def test_gated_norm_quant_against_sglangs_gated_norm_at_the_real_width(m):
    """Gated-DeltaNet's output norm as SGLang's layer calls it (rows of one head, FLA's kernel): each head's output
    within 1 ulp, the int8 rows those of each token's heads as written, bit for bit."""
    from sglang.kernels.ops.attention.fla.layernorm_gated import RMSNorm as RMSNormGated

    from qflash.kernels.gated_norm_quant import gated_norm_quant
    from qflash.server.preset import TEXT_CONFIG

    heads, head_dim = TEXT_CONFIG["linear_num_value_heads"], TEXT_CONFIG["linear_value_head_dim"]
    norm = RMSNormGated(head_dim, eps=1e-6, group_size=None, norm_before_gate=True, device="cuda", dtype=torch.bfloat16)
    norm.weight.data.copy_(activations(1, head_dim, 5)[0] * 0.2 + 1)
    x, z = activations(m * heads, head_dim, 6), activations(m * heads, head_dim, 7) * 3
    ref = norm(x, z)
    out, q, scale = gated_norm_quant(x, z, norm.weight.data, norm.eps, heads * head_dim)
    close, differ = _within_one_ulp(out, ref)
    assert close and differ < 0.01, f"{differ:.2%} of the outputs differ"
    q_ref, scale_ref = quant_reference(out.view(m, -1).cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("m", [16, 8192])
def test_silu_mul_quant_against_sglangs_activation_at_the_real_width(m):
    from sglang.srt.layers.activation import silu_and_mul  # SiluAndMul.forward_cuda's kernel

    from qflash.kernels.silu_mul_quant import silu_mul_quant
    from qflash.server.tools.shapes import TARGET

    d = dict((name, k) for name, _, k in TARGET)["mlp.down_proj"]
    x = activations(m, 2 * d, 4) * 3
    ref = torch.empty((m, d), dtype=x.dtype, device=x.device)
    silu_and_mul(x, ref)
    out, q, scale = silu_mul_quant(x)
    close, differ = _within_one_ulp(out, ref)
    assert close and differ < 0.01, f"{differ:.2%} of the outputs differ"
    q_ref, scale_ref = quant_reference(out.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref)
