"""`qflash bench-kernels`: qflash's GEMMs against cuBLAS bf16, torch._int_mm and stock SGLang's int8 path, and
qflash's GDN verify and fold against SGLang's at each state tile, qflash's short-prompt GDN prefill against
SGLang's chunked one, and a fresh prompt's prefill attention on torch's SDPA against SGLang's Triton extend kernel
(`--skip-gemms`: all but the GEMM and lm_head tables). qflash's GEMMs run as served (`tune.served_gemm`: a GDN
input GEMM with its conv update).

Every timing starts from bf16 activations (the int8 paths include their per-token quantization) and is
GPU time with a cold L2 and no host overhead (`timing.cold_us`), as inside SGLang's CUDA graphs. The GDN
prefill runs eagerly, so its host launch time (`timing.host_us`) is given too.
"""

from pathlib import Path

import orjson
import torch

from qflash.kernels import gdn_prefill, w4_draft_pick
from qflash.kernels.config_table import DECODE_M, PREFILL_M
from qflash.kernels.flash_prefill import flash_prefill
from qflash.kernels.per_token_quant import per_token_quant
from qflash.kernels.w8a16_argmax import w8a16_argmax
from qflash.kernels.w8a16_gemm import w8a16_gemm
from qflash.kernels.w8a8_gemm import table_config
from qflash.server.launcher import require_gpu
from qflash.server.preset import BLOCK_SIZE
from qflash.server.tools.floors import REFERENCE_CARD, card_rate
from qflash.server.tools.shapes import ATTENTION_HEADS, DRAFTER, GDN_HEADS, LM_HEAD, TARGET, TARGET_COUNT
from qflash.server.tools.timing import cold_us, eager_us, host_us
from qflash.server.tools.tune import served_gemm


def time_us(fn) -> float | None:
    try:
        return cold_us(fn)
    except RuntimeError:  # e.g. torch._int_mm refuses some M
        return None


def _stock_path():
    from sgl_kernel import int8_scaled_mm
    from sglang.kernels.ops.quantization.int8_kernel import per_token_quant_int8

    def run(x, w_t, w_scale_col):
        x_q, x_s = per_token_quant_int8(x)
        return int8_scaled_mm(x_q, w_t, x_s, w_scale_col, out_dtype=torch.bfloat16, bias=None)
    return run


def gemm_row(phase: str, name: str, m: int, n: int, k: int, stock) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    w_scale = torch.rand(n, device="cuda") / (127 * k ** 0.5) + 1e-6
    w_bf16 = (w.float() * w_scale[:, None]).to(torch.bfloat16)
    served, config = served_gemm(phase, name, m), table_config(phase, m, n, k)

    def int_mm():
        x_q, x_s = per_token_quant(x)
        return (torch._int_mm(x_q, w.t()).float() * x_s[:, None] * w_scale[None, :]).to(torch.bfloat16)

    row = {"phase": phase, "gemm": name, "M": m, "N": n, "K": k,
           "cublas_bf16_us": time_us(lambda: x @ w_bf16.t()),
           "int_mm_us": time_us(int_mm),
           "sglang_int8_us": time_us(lambda: stock(x, w.t(), w_scale[:, None])),
           "qflash_us": time_us(lambda: served(x, w, w_scale, None, config))}
    row["qflash_weight_gbps"] = n * k / row["qflash_us"] / 1e3
    row["qflash_tops"] = 2 * m * n * k / row["qflash_us"] / 1e6
    row["vs_sglang"] = row["sglang_int8_us"] / row["qflash_us"] if row["sglang_int8_us"] else None
    return row


def lm_head_row(m: int) -> dict:
    name, n, k = LM_HEAD
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    w_scale = torch.rand(n, device="cuda") / (127 * k ** 0.5) + 1e-6
    w_bf16 = (w.float() * w_scale[:, None]).to(torch.bfloat16)
    w4, amax = w4_draft_pick.quantize(w)
    row = {"M": m, "cublas_bf16_us": time_us(lambda: x @ w_bf16.t()),
           "w8a16_us": time_us(lambda: w8a16_gemm(x, w, w_scale, "lm_head")),
           "w8a16_then_argmax_us": time_us(lambda: w8a16_gemm(x, w, w_scale, "lm_head").argmax(-1)),
           "fused_argmax_us": time_us(lambda: w8a16_argmax(x, w, w_scale, "lm_head")),
           "draft_pick_us": time_us(lambda: w4_draft_pick.pick(x, w4, amax, w, w_scale))}
    row["w8a16_weight_gbps"] = n * k / row["w8a16_us"] / 1e3
    return row


VERIFY_TILES = ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8))  # (value columns, warps) per GDN verify program
FOLD_TILES = (4, 8, 16, 32)  # value columns per GDN fold program (one warp)


def gdn_row(batch: int) -> dict:
    """One GDN layer's verify of 16 tokens per request (ring-writing) and the fold of all 16 on commit, at the
    Qwen3.5-4B heads: SGLang's kernels against qflash's at each tile of VERIFY_TILES and FOLD_TILES."""
    from sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent import fused_sigmoid_gating_delta_rule_update
    from sglang.kernels.ops.attention.fla.gdn_replayssm_spec_fold import commit_gdn_replayssm_fold_all_layers

    from qflash.kernels import gdn_verify

    (h, hv, d), steps = GDN_HEADS, BLOCK_SIZE
    t = steps * batch

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    inputs = dict(A_log=rand(hv, dtype=torch.float32), dt_bias=rand(hv, dtype=torch.float32), q=rand(1, t, h, d),
                  k=rand(1, t, h, d), v=rand(1, t, hv, d), a=rand(t, hv), b=rand(t, hv),
                  initial_state_source=rand(batch, hv, d, d, dtype=torch.float32) * 0.1,
                  initial_state_indices=torch.arange(batch, device="cuda", dtype=torch.int32),
                  cu_seqlens=torch.arange(0, t + 1, steps, device="cuda", dtype=torch.int32),
                  softplus_beta=1.0, softplus_threshold=20.0)
    rings = dict(replayssm_rawv=rand(batch, hv, steps, d), replayssm_rawk=rand(batch, h, steps, d),
                 replayssm_g=rand(batch, hv, steps, dtype=torch.float32),
                 replayssm_beta=rand(batch, hv, steps, dtype=torch.float32))
    fold = dict(checkpoint_state=inputs["initial_state_source"][None], rawv_cache=rings["replayssm_rawv"][None],
                rawk_cache=rings["replayssm_rawk"][None], g_cache=rings["replayssm_g"][None],
                beta_cache=rings["replayssm_beta"][None], ssm_state_indices=inputs["initial_state_indices"],
                accept_lens=torch.full((batch,), steps, device="cuda", dtype=torch.int32), max_cache_len=steps,
                num_k_heads=h)
    row = {"batch": batch,
           "sglang_verify_us": time_us(lambda: fused_sigmoid_gating_delta_rule_update(
               **inputs, **rings, use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True,
               cache_ring=True)),
           "sglang_fold_us": time_us(lambda: commit_gdn_replayssm_fold_all_layers(**fold))}
    for bv, warps in VERIFY_TILES:
        config = dict(gdn_verify.VERIFY_CONFIGS[1], BV=bv, num_warps=warps)
        row[f"verify_{bv}x{warps}_us"] = time_us(lambda: gdn_verify.verify(**inputs, **rings, config=config))
    for bv in FOLD_TILES:
        config = dict(gdn_verify.FOLD_CONFIGS[1], BV=bv)
        row[f"fold_{bv}_us"] = time_us(lambda: gdn_verify.fold_all_layers(**fold, config=config))
    return row


GDN_PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)


def gdn_prefill_row(tokens: int) -> dict:
    """One GDN layer's prefill of a `tokens`-long prompt after the gating, at the Qwen3.5-4B heads: SGLang's
    chunked path (`TritonGDNKernel.extend`) against qflash's recurrent one, GPU and host launch us."""
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    h, hv, d = GDN_HEADS
    q, k = (torch.randn(1, tokens, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, tokens, hv, d, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(1, tokens, hv, device="cuda") * 0.3
    beta = torch.rand(1, tokens, hv, device="cuda")
    args = dict(ssm_states=torch.zeros(2, hv, d, d, device="cuda"),
                cache_indices=torch.ones(1, device="cuda", dtype=torch.int32),
                query_start_loc=torch.tensor([0, tokens], device="cuda", dtype=torch.int32))
    chunks = lambda: TritonGDNKernel().extend(q, k, v, g, beta, **args)  # this process loads no plugin
    mine = lambda: gdn_prefill.prefill(q, k, v, g, beta, **args)
    return {"tokens": tokens, "sglang_gpu_us": time_us(chunks), "sglang_host_us": host_us(chunks),
            "qflash_gpu_us": time_us(mine), "qflash_host_us": host_us(mine)}


def render_gdn_prefill(rows: list[dict]) -> str:
    out = [f"GDN prefill, one layer (qflash's kernel takes prompts up to {gdn_prefill.MAX_TOKENS} tokens):", "",
           "| tokens | SGLang chunks GPU / host us | qflash recurrent GPU / host us |", "| ---: | ---: | ---: |"]
    out += [f"| {r['tokens']} | {_f(r['sglang_gpu_us'])} / {_f(r['sglang_host_us'])} "
            f"| {_f(r['qflash_gpu_us'])} / {_f(r['qflash_host_us'])} |" for r in rows]
    return "\n".join(out) + "\n"


# (requests, tokens each): fresh prompts, and a batch of them as the concurrency sweep prefills it.
PREFILL_ATTENTION_CASES = ((1, 512), (1, 2048), (1, 8192), (7, 1170))


def prefill_attention_row(requests: int, tokens: int) -> dict:
    """One target full-attention layer's prefill (16 query heads, 4 KV heads, dim 256) of `requests` fresh prompts of
    `tokens` tokens each: SGLang's Triton extend kernel against torch's fused kernels (kernels/flash_prefill.py), us
    per eager call and TFLOP/s."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    heads, kv_heads, dim = ATTENTION_HEADS
    q = torch.randn(requests * tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(requests * tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    empty = torch.zeros(0, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    qo_indptr = torch.arange(requests + 1, device="cuda") * tokens  # int64 and int32, as SGLang's Triton backend has them
    kv_indptr = torch.zeros(requests + 1, device="cuda", dtype=torch.int32)
    args = (q, k, v, torch.empty_like(q), empty, empty, qo_indptr, kv_indptr, torch.zeros(0, device="cuda", dtype=torch.int64),
            None, True, None, tokens, 1.0, 1.0, dim ** -0.5)
    # eagerly, as a batch's attention runs between its prefill graph's segments
    sglang_us = eager_us(lambda: extend_attention_fwd(*args))
    torch_us = eager_us(lambda: flash_prefill(None, *args))
    flop = 4 * heads * dim * requests * tokens * (tokens + 1) / 2
    return {"requests": requests, "tokens": tokens, "sglang_us": sglang_us, "torch_us": torch_us,
            "sglang_tflops": flop / sglang_us / 1e6, "torch_tflops": flop / torch_us / 1e6}


def render_prefill_attention(rows: list[dict]) -> str:
    out = ["Prefill attention of fresh prompts, one target layer (16 / 4 heads, dim 256), eager calls:", "",
           "| requests x tokens | SGLang Triton extend us (TFLOP/s) | torch SDPA / flash us (TFLOP/s) |",
           "| ---: | ---: | ---: |"]
    out += [f"| {r['requests']} x {r['tokens']} | {_f(r['sglang_us'])} ({r['sglang_tflops']:.0f}) "
            f"| {_f(r['torch_us'])} ({r['torch_tflops']:.0f}) |" for r in rows]
    return "\n".join(out) + "\n"


def render_gdn(rows: list[dict]) -> str:
    verify = " | ".join(f"qflash {bv} cols x {warps} warps" for bv, warps in VERIFY_TILES)
    fold = " | ".join(f"qflash {bv} cols" for bv in FOLD_TILES)
    out = ["GDN verify of 16 tokens per request, one layer, us:", "", f"| requests | SGLang (32 cols, 1 warp) | {verify} |",
           "| ---: |" + " ---: |" * (1 + len(VERIFY_TILES))]
    out += [f"| {r['batch']} | {_f(r['sglang_verify_us'])} | "
            + " | ".join(_f(r[f"verify_{bv}x{warps}_us"]) for bv, warps in VERIFY_TILES) + " |" for r in rows]
    out += ["", "GDN fold of 16 steps per request, one layer, us:", "", f"| requests | SGLang (32 cols) | {fold} |",
            "| ---: |" + " ---: |" * (1 + len(FOLD_TILES))]
    out += [f"| {r['batch']} | {_f(r['sglang_fold_us'])} | " + " | ".join(_f(r[f"fold_{bv}_us"]) for bv in FOLD_TILES) + " |"
            for r in rows]
    return "\n".join(out) + "\n"


def _f(v, spec=".1f"):
    return "-" if v is None else f"{v:{spec}}"


def render(gemms: list[dict], heads: list[dict], step: dict, device_name: str = REFERENCE_CARD) -> str:
    """The GEMM and lm_head tables; bandwidth as a share of the card's measured copy rate (floors.card_rate)."""
    card, tbps = card_rate(device_name)
    out = [f"| phase | GEMM | M | N x K | cuBLAS bf16 us | _int_mm us | SGLang int8 us | qflash us | qflash weight GB/s (% of the {card}'s {tbps} TB/s) | TOPS | vs SGLang |",
           "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in gemms:
        out.append(f"| {r['phase']} | {r['gemm']} | {r['M']} | {r['N']}x{r['K']} | {_f(r['cublas_bf16_us'])} | {_f(r['int_mm_us'])} "
                   f"| {_f(r['sglang_int8_us'])} | {_f(r['qflash_us'])} | {r['qflash_weight_gbps']:.0f} ({r['qflash_weight_gbps'] / tbps / 10:.0f}%) "
                   f"| {r['qflash_tops']:.0f} | {_f(r['vs_sglang'], '.2f')}x |")
    out += ["", "| lm_head M | cuBLAS bf16 us | W8A16 us | W8A16 % of HBM | W8A16 + torch.argmax us | fused argmax us "
                "| 4-bit draft pick us |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {h['M']} | {_f(h['cublas_bf16_us'])} | {_f(h['w8a16_us'])} | {h['w8a16_weight_gbps'] / tbps / 10:.0f}% "
            f"| {_f(h['w8a16_then_argmax_us'])} | {_f(h['fused_argmax_us'])} | {_f(h['draft_pick_us'])} |" for h in heads]
    out += ["", f"One target verify step at M = 16, all {sum(TARGET_COUNT.values())} body GEMMs: "
            f"SGLang int8 {step['sglang_us']:.0f} us, qflash {step['qflash_us']:.0f} us ({step['sglang_us'] / step['qflash_us']:.2f}x); "
            f"worst qflash/SGLang ratio over all rows {step['worst_vs_sglang']:.2f}x."]
    return "\n".join(out) + "\n"


def run_bench_kernels(out: Path, skip_gemms: bool = False) -> int:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"gdn": [gdn_row(batch) for batch in (1, 8)],
            "gdn_prefill": [gdn_prefill_row(tokens) for tokens in GDN_PREFILL_TOKENS],
            "prefill_attention": [prefill_attention_row(*case) for case in PREFILL_ATTENTION_CASES]}
    tables = [render_gdn(data["gdn"]), render_gdn_prefill(data["gdn_prefill"]), render_prefill_attention(data["prefill_attention"])]
    if not skip_gemms:
        stock = _stock_path()
        jobs = ([("verify", m, s) for s in TARGET for m in DECODE_M] + [("draft", m, s) for s in DRAFTER for m in DECODE_M]
                + [("prefill", m, s) for s in TARGET + DRAFTER for m in PREFILL_M])
        gemms = [gemm_row(phase, name, m, n, k, stock) for phase, m, (name, n, k) in jobs]
        heads = [lm_head_row(m) for m in DECODE_M]
        verify16 = {r["gemm"]: r for r in gemms if r["phase"] == "verify" and r["M"] == 16}
        step = {"sglang_us": sum(TARGET_COUNT[g] * verify16[g]["sglang_int8_us"] for g in TARGET_COUNT),
                "qflash_us": sum(TARGET_COUNT[g] * verify16[g]["qflash_us"] for g in TARGET_COUNT),
                "worst_vs_sglang": min(r["vs_sglang"] for r in gemms if r["vs_sglang"] is not None)}
        data.update(gemms=gemms, lm_head=heads, verify_step=step)
        tables.insert(0, render(gemms, heads, step, torch.cuda.get_device_name()))
    table = f"{torch.cuda.get_device_name()}: `qflash bench-kernels --out {out}{' --skip-gemms' if skip_gemms else ''}`\n\n"
    table += "\n".join(tables)
    (out / "kernels.md").write_text(table)
    (out / "kernels.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    print(table)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder for kernels.md and kernels.json")
    p.add_argument("--skip-gemms", action="store_true",
                   help="all but the GEMM and lm_head tables: GDN verify, fold and prefill, prefill attention")


def run(args, extra) -> int:
    require_gpu()  # before the output folder is made
    return run_bench_kernels(args.out, skip_gemms=args.skip_gemms)
