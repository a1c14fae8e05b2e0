"""`qflash profile`'s trace summary: GPU kernels of SGLang's torch-profiler trace summed by family per cycle."""

import pytest

from qflash.server.cli import parser
from qflash.server.tools.profile import family, launch_groups, own_times, render, short_name, summarize


def kernel(name, ts, dur, cat="kernel", corr=None, ext=None):
    """A GPU event; `corr`: its launch's correlation id; `ext`: the torch op's External id that launched it."""
    args = ({} if corr is None else {"correlation": corr}) | ({} if ext is None else {"External id": ext})
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def span(name, ts, dur, cat="user_annotation", tid=1, **args):
    """A host event of the scheduler process's thread `tid`: an annotation, a runtime call, an op or a Python call."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def runtime(name, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": 0, "dur": 1, "args": {"correlation": corr}}


def test_kernel_names_map_to_their_families():
    assert family("_w8a8_gemm_kernel") == family("_w8a8_tma_kernel") == "qflash W8A8 GEMM"
    assert family("_w8a16_argmax_kernel") == "qflash draft pick"
    assert family("_w4_scan_kernel") == family("_w4_rescore_kernel") == "qflash draft pick"
    assert family("_argmax_pick_kernel") == "sampling, argmax, top-k"  # its pick over the tiles' maxima
    # torch's argmax over the verify's logits (SGLang's greedy verify), not a norm's reduction
    assert family("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
                  "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
                  "long, 4, 4>)") == "sampling, argmax, top-k"
    assert family("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "Gated-DeltaNet"
    assert family("recompute_w_u_fwd_kernel") == family("l2norm_fwd_kernel") == "Gated-DeltaNet"  # FLA's prefill
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x256_4x1x1_cga1x1x1_kernel0_0"
                  ) == "attention"  # torch's SDPA on cuDNN (kernels/flash_prefill.py)
    assert family("fused_recurrent_gated_delta_rule_fwd_kernel") == "Gated-DeltaNet"
    assert family("_gdn_verify_kernel") == family("_gdn_fold_kernel") == "Gated-DeltaNet"  # kernels/gdn_verify.py
    assert family("_gdn_commit_steps_kernel") == "Gated-DeltaNet"  # kernels/commit_steps.py
    assert family("_conv_update_kernel") == "Gated-DeltaNet"  # kernels/conv_update.py
    assert family("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "bf16 GEMM (cuBLAS / CUTLASS)"
    assert family("_fwd_kernel_stage1") == "attention"
    assert family("_prefix_split_kernel") == family("_merge_block_kernel") == "attention"  # qflash's block attention
    assert family("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "norms, rotary, activations"
    assert family("Memcpy DtoD (Device -> Device)") == "copies and fills"
    assert family("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)") == "norms, rotary, activations"
    # qflash's norm and activation that also quantize (a "gemma" in a name would read as a GEMM)
    from qflash.kernels import norm_quant, sigmoid_mul_quant, silu_mul_quant

    for kernel in (norm_quant._rms_norm_quant_kernel, silu_mul_quant._silu_mul_quant_kernel,
                   sigmoid_mul_quant._sigmoid_mul_quant_kernel):
        assert family(kernel.fn.__name__) == "norms, rotary, activations", kernel.fn.__name__
    assert family("_fused_sigmoid_mul_kernel") == "norms, rotary, activations"  # SGLang's attention output gate
    assert family("my_new_kernel") == "other"


def test_summary_per_step_with_idle_time_and_overlapping_streams():
    trace = {"traceEvents": [
        kernel("_w8a8_gemm_kernel", 0, 300), kernel("_per_token_quant_kernel", 300, 100),
        kernel("fused_recurrent_gated_delta_rule_fwd_kernel", 500, 200),
        kernel("_w8a16_argmax_kernel", 600, 200),  # overlaps the GDN kernel on a side stream: its own 700-800
        kernel("Memcpy HtoD (Pageable -> Device)", 900, 100, cat="gpu_memcpy"),
        kernel("mystery", 1900, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host events are not GPU time
    ]}
    s = summarize(trace, steps=2)
    assert s["window_ms"] == pytest.approx(1.0)  # 2000 us over 2 steps
    assert s["gpu_busy_ms"] == pytest.approx((400 + 300 + 100 + 100) / 2e3)  # 500-800 counted once
    assert s["gpu_idle_ms"] == pytest.approx(1.0 - 0.45)
    assert s["families"]["qflash W8A8 GEMM"] == pytest.approx(0.15)
    assert s["families"]["Gated-DeltaNet"] == pytest.approx(0.1) and s["families"]["qflash draft pick"] == pytest.approx(0.05)
    assert sum(s["families"].values()) == pytest.approx(s["gpu_busy_ms"])
    assert s["top_other"] == [("mystery", pytest.approx(0.05))]
    assert s["top_kernels"][0] == ("_w8a8_gemm_kernel", "qflash W8A8 GEMM", 0.5, pytest.approx(0.15))  # a cycle a step
    assert [n for n, *_ in s["top_kernels"]] == ["_w8a8_gemm_kernel", "fused_recurrent_gated_delta_rule_fwd_kernel",
                                                 "_per_token_quant_kernel", "_w8a16_argmax_kernel", "Memcpy HtoD", "mystery"]
    assert s["launches"] == {"eager kernels": pytest.approx(0.45)}  # no graph replays in this trace: all of busy
    assert s["kernels_per_cycle"] == 3 and s["family_kernels_per_cycle"]["qflash W8A8 GEMM"] == 0.5  # a cycle a step
    table = render(s, "title")
    assert "| qflash W8A8 GEMM | 0.150 | 15% | 0.5 | 0.150 |" in table and "| GPU idle | 0.550 | 55% | | |" in table
    assert "2 cycles, GPU busy 0.450 ms and 3 kernels per cycle." in table
    assert "| eager kernels | 0.450 | 45% |" in table
    assert "| `_w8a8_gemm_kernel` | qflash W8A8 GEMM | 0.5 | 0.1500 |" in table
    # against the families' byte floors: times per cycle, floors where a family has one
    table = render(s, "title", {"qflash W8A8 GEMM": 0.1, "Gated-DeltaNet": 0.05})
    assert "| qflash W8A8 GEMM | 0.150 | 15% | 0.5 | 0.150 (0.100, 1.5x) |" in table
    assert "| Gated-DeltaNet | 0.100 | 10% | 0.5 | 0.100 (0.050, 2.0x) |" in table
    assert "| qflash draft pick | 0.050 | 5% | 0.5 | 0.050 |" in table
    assert "Byte floor 0.150 ms per cycle (3.0x) at the H200's 4.3 TB/s." in table  # a trace that names no card
    s = summarize({**trace, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}]}, steps=2)
    assert s["device"] == "NVIDIA H100 80GB HBM3"
    assert "at the H100's 3.0 TB/s." in render(s, "title", {"qflash W8A8 GEMM": 0.1})
    assert s["profiler_stall_ms"] == 0 and "stalls" not in render(s, "title")


def test_the_profilers_own_stalls_in_the_gpus_idle_time_are_named():
    """CUPTI's buffer request stops the host a few ms when a trace begins: the part of it inside the GPU's idle time
    (1000-1200 of the 800-1400 gap here; 1400-1500 is busy) is the profiler's, reported per step."""
    trace = {"traceEvents": [kernel("_w8a8_gemm_kernel", 0, 800), kernel("_w8a8_gemm_kernel", 1400, 600),
                             {"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0,
                              "ts": 1000, "dur": 500}]}
    s = summarize(trace, steps=2)
    assert s["gpu_idle_ms"] == pytest.approx(0.3) and s["profiler_stall_ms"] == pytest.approx(0.2)
    assert "GPU idle (host, gaps) 0.300 ms (the profiler's own stalls 0.200 ms of it); 2 cycles" in render(s, "title")


def test_a_qflash_cycle_names_the_sglang_kernels_its_hooks_replace_that_were_launched():
    """A hook that declines every served call leaves SGLang's kernel in the cycle; the profile names it."""
    store = "void (anonymous namespace)::store_kvcache<2048l, 2048l, 4, true, long>((anonymous namespace)::StoreKVCacheParams)"
    routed = summarize({"traceEvents": [kernel("_w8a8_gemm_kernel", 0, 10), kernel("_fwd_kernel_unified", 10, 10)]}, steps=2)
    declined = summarize({"traceEvents": [kernel("_w8a8_gemm_kernel", 0, 10), kernel(store, 10, 10),
                                          kernel(store, 20, 10), kernel("_fwd_kernel", 30, 10)]}, steps=2)
    line = "SGLang kernels that qflash's hooks replace, launched in the cycle: "
    assert line + "none" in render(routed, "title", qflash=True)
    assert (line + "`store_kvcache<2048l, 2048l, 4, true, long>` 1.0 a cycle (for block attention's KV store), "
            "`_fwd_kernel` 0.5 a cycle (for block attention)") in render(declined, "title", qflash=True)
    assert "replace" not in render(declined, "title")  # a stock system's cycle runs them as it should


def test_kernels_are_listed_by_symbol_without_return_type_or_parameters():
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<long>, at::detail::Array<char*, 1>)"
    assert short_name(fill) == "at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, at::detail::Array<char*, 1> >"
    store = "void (anonymous namespace)::store_kvcache<2048l, 2048l, 4, true, long>((anonymous namespace)::StoreKVCacheParams)"
    assert short_name(store) == "store_kvcache<2048l, 2048l, 4, true, long>"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD" and short_name("_merge_block_kernel") == "_merge_block_kernel"
    assert short_name("k" * 200) == "k" * 147 + "..."
    # launches of one kernel under different parameter lists are one row, with the family of the full symbol
    trace = {"traceEvents": [kernel(store, 0, 10), kernel(store.replace("Params)", "Params, int)"), 10, 20)]}
    assert summarize(trace, steps=1)["top_kernels"] == [("store_kvcache<2048l, 2048l, 4, true, long>", "other", 2.0,
                                                         pytest.approx(0.03))]


def test_the_byte_floor_of_a_cycle():
    from qflash.server.tools.floors import card_rate, per_cycle_ms

    short, long = per_cycle_ms(64), per_cycle_ms(8192)  # on the H200, where issue 23's targets are set
    # the int8 target body and drafter layers (~4.15 GB: issue 23's 4.06 and the drafter's QKV since), the int8
    # vocabulary (0.64 GB) and its 4-bit copy with a byte per 128 columns (0.32 + 0.005 GB); the drafter's bf16 fc and
    # the K|V rows of its QKV for the context-KV write
    assert short["qflash W8A8 GEMM"] * 4.3e9 == pytest.approx(4.15e9, rel=0.01)
    assert short["bf16 GEMM (cuBLAS / CUTLASS)"] * 4.3e9 == pytest.approx(2 * (8 + 6 * 2 * 1024 / 2560) * 2560 ** 2)
    assert short["qflash W8A16 lm_head"] == pytest.approx(0.636e9 / 4.3e9, rel=0.01)
    assert short["qflash draft pick"] == pytest.approx(0.323e9 / 4.3e9, rel=0.01)
    assert 1.2 < sum(short.values()) < sum(long.values()) < 1.4  # only attention grows with the context
    assert {f for f in short if short[f] != long[f]} == {"attention"}
    # each card at its own measured copy rate; a card without one at the H200's, which the label then names
    assert card_rate("NVIDIA H100 80GB HBM3") == ("H100", 3.0) and card_rate("NVIDIA H200") == ("H200", 4.3)
    assert card_rate("NVIDIA A100-SXM4-80GB") == ("H200", 4.3)
    h100 = per_cycle_ms(64, "NVIDIA H100 80GB HBM3")
    assert all(h100[f] == pytest.approx(short[f] * 4.3 / 3.0) for f in short)


def test_a_kernel_launched_early_under_pdl_is_charged_only_for_its_own_run():
    # Under PDL (kernels/pdl.py) the norm starts 10 us into the GEMM and waits for it: its trace interval covers the
    # GEMM's; the GEMM keeps its 100 us, the norm gets the 50 us it ran alone.
    trace = {"traceEvents": [kernel("_w8a8_gemm_kernel", 0, 100), kernel("_rms_norm_quant_kernel", 10, 140)]}
    s = summarize(trace, steps=1)
    assert s["families"] == {"qflash W8A8 GEMM": pytest.approx(0.1), "norms, rotary, activations": pytest.approx(0.05)}
    assert s["gpu_busy_ms"] == pytest.approx(0.15)


def test_the_w8a8_gemms_are_listed_by_grid_and_the_kernel_before_them():
    """Every projection runs one kernel: the grid names its table entry, the kernel before tells apart projections of
    one grid (down after SiLU-and-multiply, out_proj after the gated norm); own time a launch, as families count it."""
    def gemm(ts, dur, grid):
        return {**kernel("_w8a8_gemm_kernel", ts, dur), "args": {"grid": grid}}

    trace = {"traceEvents": [
        kernel("_rms_norm_quant_kernel", 0, 2), gemm(1, 20, [576, 1, 1]), kernel("_silu_mul_quant_kernel", 20, 4),
        gemm(23, 11, [80, 1, 1]),  # started 1 us into SiLU's run (PDL): charged 10 us
        kernel("_gated_norm_quant_kernel", 34, 2), gemm(36, 6, [80, 1, 1]),
        kernel("_silu_mul_quant_kernel", 42, 4), gemm(46, 12, [80, 1, 1])]}
    s = summarize(trace, steps=1)
    assert [row[:3] for row in s["gemm_launches"]] == [("80x1x1", "_silu_mul_quant_kernel", 2.0),
                                                       ("576x1x1", "_rms_norm_quant_kernel", 1.0),
                                                       ("80x1x1", "_gated_norm_quant_kernel", 1.0)]
    assert [row[3:] for row in s["gemm_launches"]] == [(pytest.approx(11.0), pytest.approx(0.022)),
                                                       (pytest.approx(19.0), pytest.approx(0.019)),
                                                       (pytest.approx(6.0), pytest.approx(0.006))]
    assert "| 80x1x1 | `_silu_mul_quant_kernel` | 2.0 | 11.00 | 0.0220 |" in render(s, "title")
    assert "W8A8 GEMMs by grid" not in render(summarize({"traceEvents": [kernel("mystery", 0, 5)]}, steps=1), "title")


def test_idle_gaps_inside_a_step_are_listed_by_the_kernels_around_them():
    """A copy between two kernels, or a kernel that waits for the whole one before it, leaves the GPU idle; a gap as
    long as the host's between steps is not counted; overlapping kernels (PDL, a side stream) leave none."""
    trace = {"traceEvents": [
        kernel("_rms_norm_quant_kernel", 0, 10), kernel("memcpy32_post", 13, 2), kernel("_w8a8_gemm_kernel", 19, 50),
        kernel("_conv_update_kernel", 60, 20),  # launched early under PDL: no gap
        kernel("_rms_norm_quant_kernel", 200, 10),  # 120 us later: the host between steps
        kernel("memcpy32_post", 212, 2), kernel("_w8a8_gemm_kernel", 218, 50)]}
    s = summarize(trace, steps=2)
    assert s["gap_cycle_us"] == pytest.approx((3 + 4 + 2 + 4) / 2)
    assert s["top_gaps"] == [("memcpy32_post", "_w8a8_gemm_kernel", 1.0, pytest.approx(4.0)),
                             ("_rms_norm_quant_kernel", "memcpy32_post", 1.0, pytest.approx(2.5))]
    assert "| `memcpy32_post` | `_w8a8_gemm_kernel` | 1.0 | 4.00 |" in render(s, "title")


def test_kernels_are_grouped_by_the_graph_replay_that_launched_them():
    events = [runtime("cudaGraphLaunch", 1), runtime("cudaGraphLaunch", 2), runtime("cudaLaunchKernel", 3),
              runtime("cudaGraphLaunch", 4)]
    kernels = [
        kernel("_w8a8_gemm_kernel", 0, 40, corr=1), kernel("_w8a16_argmax_kernel", 40, 10, corr=1),  # draft graph
        kernel("_w8a8_gemm_kernel", 60, 100, corr=2), kernel("fused_recurrent_gated_delta_rule_fwd_kernel", 160, 30, corr=2),
        kernel("index_select", 200, 5, corr=3),  # launched on its own
        kernel("_w8a8_gemm_kernel", 210, 7, corr=4),  # a graph with neither argmax nor Gated-DeltaNet
    ]
    assert launch_groups(events + kernels, kernels, own_times(kernels)) == {"draft graph": 50, "verify graph": 130, "eager kernels": 5, "other graph": 7}
    whole = [kernel("_w8a16_argmax_kernel", 0, 10, corr=1), kernel("_w8a8_gemm_kernel", 10, 100, corr=1),
             kernel("_gdn_verify_kernel", 110, 30, corr=1)]  # a window's cycle in one graph (server/hooks/cycle_graphs.py)
    assert launch_groups(events + whole, whole, own_times(whole)) == {"cycle graph": 140}
    draft = [kernel("_w8a8_gemm_kernel", 0, 20, corr=1), kernel("_w4_scan_kernel", 20, 10, corr=1),
             kernel("_w4_rescore_kernel", 30, 1, corr=1)]  # the drafter's forward and its 4-bit draft pick
    assert launch_groups(events + draft, draft, own_times(draft)) == {"draft graph": 31}


def test_a_graph_launched_inside_a_prefill_step_is_a_prefill_graph_and_no_cycle():
    """A fresh prompt's whole prefill graph holds the target's GEMMs and Gated-DeltaNet as a verify graph does, and
    its argmax as a cycle graph does: what names it is its launch inside the prefill's forward step."""
    events = [span("step[EXTEND bs=1 toks=64]", 0, 100), span("step[TARGET_VERIFY bs=1]", 300, 50),
              span("cudaGraphLaunch", 50, 2, cat="cuda_runtime", correlation=1),
              span("cudaGraphLaunch", 320, 2, cat="cuda_runtime", correlation=2)]
    kernels = [kernel("_w8a8_gemm_kernel", 60, 100, corr=1), kernel("_gdn_prefill_kernel", 160, 40, corr=1),
               kernel("_row_argmax_tile_kernel", 200, 5, corr=1),
               kernel("_w8a8_gemm_kernel", 330, 30, corr=2), kernel("_gdn_verify_kernel", 360, 10, corr=2)]
    assert launch_groups(events + kernels, kernels, own_times(kernels)) == {"prefill graph": 145, "verify graph": 40}
    assert summarize({"traceEvents": events + kernels}, steps=1)["cycles"] == 1


def test_the_gpu_time_per_cycle_counts_the_verify_graphs_a_step_replays():
    """A window runs several cycles per scheduler step: each replays the verify graph once (and the glue's graphs,
    one of which runs Gated-DeltaNet's commit without the target's GEMMs)."""
    events = [runtime("cudaGraphLaunch", c) for c in (1, 2, 3, 4, 5)]
    kernels = [kernel("_w8a16_argmax_kernel", 0, 100, corr=1), kernel("fused_recurrent_gated_delta_rule_fwd_kernel", 100, 200, corr=2),
               kernel("_w8a8_gemm_kernel", 300, 100, corr=2), kernel("_gdn_fold_kernel", 400, 10, corr=5),
               kernel("_w8a16_argmax_kernel", 410, 90, corr=3), kernel("fused_recurrent_gated_delta_rule_fwd_kernel", 500, 200, corr=4),
               kernel("_w8a8_gemm_kernel", 700, 100, corr=4), kernel("_pack_cycle_kernel", 800, 10)]
    s = summarize({"traceEvents": events + kernels}, steps=1)
    assert s["cycles"] == 2 and s["gpu_cycle_ms"] == pytest.approx(0.405)
    assert "2 cycles, GPU busy 0.405 ms and 4 kernels per cycle" in render(s, "title")
    assert s["launches"]["other graph"] == pytest.approx(0.01)
    eager = summarize({"traceEvents": [kernel("_w8a8_gemm_kernel", 0, 100)]}, steps=4)  # no graphs: a cycle a step
    assert eager["cycles"] == 4 and eager["gpu_cycle_ms"] == pytest.approx(0.025)
    cycle = [kernel("_w8a16_argmax_kernel", 0, 100, corr=c) for c in (1, 2)] + [
        kernel("_w8a8_gemm_kernel", 100 + 300 * c, 200, corr=c) for c in (1, 2)] + [
        kernel("_gdn_verify_kernel", 300 + 300 * c, 10, corr=c) for c in (1, 2)]
    whole = summarize({"traceEvents": [runtime("cudaGraphLaunch", 1), runtime("cudaGraphLaunch", 2), *cycle]}, steps=1)
    assert whole["cycles"] == 2 and whole["kernels_per_cycle"] == 3  # one cycle graph a cycle


def test_host_spans_are_summed_per_step():
    trace = {"traceEvents": [
        kernel("_w8a8_gemm_kernel", 0, 10),
        span("scheduler.run_batch", 0, 6000), span("scheduler.run_batch", 0, 5000),
        span("step[TARGET_VERIFY bs=1]", 0, 1000), span("step[TARGET_VERIFY bs=3]", 0, 800),  # batch sizes summed together
        span("cudaGraphLaunch", 0, 300, cat="cuda_runtime"), span("cudaLaunchKernel", 0, 5, cat="cuda_runtime"),
        span("aten::mm", 0, 70, cat="cpu_op"),  # ops are not host spans
    ]}
    s = summarize(trace, steps=2)
    assert s["host"] == {"scheduler.run_batch": pytest.approx(5.5), "step[TARGET_VERIFY]": pytest.approx(0.9),
                         "cudaGraphLaunch": pytest.approx(0.15)}
    assert "| `scheduler.run_batch` | 5.500 |" in render(s, "title")


def test_a_prefill_profile_lists_host_spans_and_stretches_of_gpu_work_in_order():
    trace = {"traceEvents": [
        span("scheduler.recv_requests", 1000, 200), span("scheduler.run_batch", 1300, 900),
        span("step[EXTEND bs=1]", 1400, 700), span("cudaGraphLaunch", 1500, 100, cat="cuda_runtime"),
        kernel("_w8a8_gemm_kernel", 1600, 400), kernel("_rms_norm_quant_kernel", 2030, 20),  # a 30 us gap: one stretch
        kernel("_w8a16_gemm_kernel", 2100, 300),  # 50 us after the last: a second stretch
        span("scheduler.process_batch_result", 2500, 400), span("aten::mm", 2600, 10, cat="cpu_op"),
    ]}
    s = summarize(trace, steps=1)
    assert s["timeline"] == [("scheduler.recv_requests", 0.0, pytest.approx(0.2)),
                             ("scheduler.run_batch", pytest.approx(0.3), pytest.approx(0.9)),
                             ("step[EXTEND]", pytest.approx(0.4), pytest.approx(0.7)),
                             ("cudaGraphLaunch", pytest.approx(0.5), pytest.approx(0.1)),
                             ("GPU, 2 kernels", pytest.approx(0.6), pytest.approx(0.45)),
                             ("GPU, 1 kernels", pytest.approx(1.1), pytest.approx(0.3)),
                             ("scheduler.process_batch_result", pytest.approx(1.5), pytest.approx(0.4))]
    assert "| 0.600 | 0.450 | GPU, 2 kernels |" in render(s, "title", in_order=True)
    assert "In order" not in render(s, "title")  # a decode profile's cycles: no timeline


def test_a_trace_without_gpu_events_is_refused():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarize({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}, steps=1)


def test_profile_command_line():
    args, extra = parser("profile").parse_known_args(["profile", "--out", "/tmp/p", "--prompt-len", "64,8192", "--attention-backend", "flashinfer"])
    assert (args.system, args.prompt_len, args.steps, args.acc_len) == ("qflash", [64, 8192], 10, 6.5)
    assert extra == ["--attention-backend", "flashinfer"] and args.passthrough and not args.prefill
    assert parser("profile").parse_args(["profile", "--out", "/tmp/p", "--prefill", "--steps", "2"]).prefill
    assert not args.with_stack and args.prefix_cache  # as served
    args = parser("profile").parse_args(["profile", "--out", "/tmp/p", "--with-stack", "--no-prefix-cache"])
    assert args.with_stack and not args.prefix_cache


@pytest.mark.parametrize("prefill, cached", [(False, 0), (True, 0), (True, 16)],
                         ids=["cycles", "prefill", "prefill over a cached prefix"])
def test_the_profiler_starts_before_the_request_or_a_few_cycles_in(tmp_path, monkeypatch, prefill, cached):
    """Against a local HTTP stand-in for SGLang's two endpoints, streaming a chunk every 0.1 s: when the
    profiler is started, relative to the profiled request's chunks, is what is checked."""
    import gzip
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from qflash.server.tools import profile

    monkeypatch.setattr(profile, "TRACE_SETTLE_S", 0)
    (tmp_path / "qflash-9.trace.json.gz").write_bytes(b"")  # an earlier run's trace in the same --out: not this one
    sent = []  # chunks streamed so far, per request
    prompts = []  # each request's input_ids
    started = []  # (request index, chunks it had streamed) at each /start_profile

    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked streaming, as SGLang's server sends it

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            if self.path == "/start_profile":
                started.append((len(sent) - 1, sent[-1] if sent else None, body["with_stack"]))
                with gzip.open(f"{body['output_dir']}/{body['profile_prefix']}-0.trace.json.gz", "wt") as f:
                    json.dump({"traceEvents": []}, f)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            prompts.append(body["input_ids"])
            sent.append(0)
            for _ in range(8):
                data = b'data: {"text": "x"}\n\n'
                sent[-1] += 1  # counted before the client can read it: on a busy machine it may read it first
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        trace = profile._profile_one(SimpleNamespace(base_url=f"http://127.0.0.1:{httpd.server_address[1]}"),
                                     "qflash", tmp_path, 64, 2, prefill, with_stack=prefill, cached=cached)
    finally:
        httpd.shutdown()
    assert trace.name == "qflash-0.trace.json.gz" and len(started) == 1 and len(sent) == 2
    request, chunks, with_stack = started[0]
    assert with_stack is prefill  # passed on to SGLang's profiler
    if prefill:
        assert (request, chunks) == (0, 8)  # after the warm-up, before the profiled request
    else:
        assert request == 1 and profile.SKIP_CHUNKS + 1 <= chunks < 8  # a few cycles in, before the request ends
    warm_up, profiled = prompts
    assert len(warm_up) == len(profiled) == 64
    assert warm_up[:cached] == profiled[:cached] and warm_up[cached] != profiled[cached]  # shared up to `cached` alone


@pytest.mark.parametrize("argv", [["--cached", "512"], ["--prefill", "--cached", "2048"],
                                  ["--prefill", "--cached", "512", "--no-prefix-cache"],
                                  ["--prefill", "--cached", "512", "--system", "sglang-bf16"]],
                         ids=["without --prefill", "not below the prompt", "no prefix cache", "a stock system"])
def test_a_cached_prefix_the_profile_cannot_make_is_one_line(argv, capsys):
    from qflash.server.cli import main

    assert main(["profile", "--out", "/tmp/p", "--prompt-len", "2048", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "qflash profile: --cached needs --prefill, qflash with its prefix cache, and fewer tokens than each --prompt-len"]


def test_a_prefill_profile_starts_at_the_requests_arrival_and_sums_what_runs_before_the_first_cycle():
    """The scheduler polls while idle before the request comes (left out of the timeline); the kernels launched before
    the first verify forward are the request's way to its first cycle, one GPU behind its launches included, each
    eager kernel named with the torch op that launched it."""
    trace = {"traceEvents": [
        *(span("scheduler.recv_requests", ts, 50) for ts in (0, 300, 600, 900)),  # the last poll gets the request
        span("scheduler.get_next_batch_to_run", 1000, 150), span("aten::copy_", 1050, 20, cat="cpu_op", **{"External id": 5}),
        span("cudaMemcpyAsync", 1060, 5, cat="cuda_runtime", correlation=10, **{"External id": 5}),
        kernel("Memcpy HtoD (Pageable -> Device)", 1100, 10, corr=10, ext=5),
        span("step[EXTEND toks=64]", 1200, 300), span("cudaGraphLaunch", 1250, 20, cat="cuda_runtime", correlation=11),
        kernel("_w8a8_gemm_kernel", 1300, 400, corr=11), kernel("_rms_norm_quant_kernel", 1700, 100, corr=11),
        span("aten::copy_", 1880, 20, cat="cpu_op", **{"External id": 6}),
        span("cudaLaunchKernel", 1900, 5, cat="cuda_runtime", correlation=12, **{"External id": 6}),
        kernel("direct_copy_kernel_cuda", 2200, 50, corr=12, ext=6),  # launched before the verify, run after it began
        span("cuLaunchKernelEx", 1950, 5, cat="cuda_driver", correlation=14),  # Triton launches through the driver
        kernel("chunk_fwd_kernel_o", 2250, 50, corr=14),
        span("step[TARGET_VERIFY bs=1]", 2000, 100), span("cudaGraphLaunch", 2050, 20, cat="cuda_runtime", correlation=13),
        kernel("_w8a16_argmax_kernel", 2300, 100, corr=13), kernel("_w8a8_gemm_kernel", 2400, 300, corr=13),
    ]}
    s = summarize(trace, steps=1)
    assert s["timeline"][0] == ("scheduler.recv_requests", 0.0, pytest.approx(0.05))  # the poll at 900
    assert [row[0] for row in s["timeline"]].count("scheduler.recv_requests") == 1
    pre = s["prefill"]
    assert pre["kernels"] == 5 and pre["gpu_busy_ms"] == pytest.approx(0.61)
    assert pre["arrival_to_end_ms"] == pytest.approx(1.4) and pre["arrival_to_first_kernel_ms"] == pytest.approx(0.2)
    assert pre["families"] == {"qflash W8A8 GEMM": pytest.approx(0.4), "norms, rotary, activations": pytest.approx(0.1),
                               "copies and fills": pytest.approx(0.06), "Gated-DeltaNet": pytest.approx(0.05)}
    assert pre["top_kernels"][0] == ("_w8a8_gemm_kernel", "", 1, pytest.approx(0.4))
    assert ("direct_copy_kernel_cuda", "aten::copy_", 1, pytest.approx(0.05)) in pre["top_kernels"]
    table = render(s, "title", in_order=True)
    assert "the 5 kernels launched before the first cycle's verify or graph): 1.400 ms from its arrival" in table
    assert "| `direct_copy_kernel_cuda` | `aten::copy_` | 1 | 0.0500 |" in table
    assert pre["arrival_to_first_cycle_ms"] == pytest.approx(1.4) and pre["gpu_idle_ms"] == pytest.approx(0.79)
    assert pre["idle_blame"] == [] and "(`--with-stack` names what the host ran)" in table
    assert summarize({"traceEvents": trace["traceEvents"][:-4]}, steps=1)["prefill"] is None  # no verify forward
    assert summarize({"traceEvents": trace["traceEvents"][-4:]}, steps=1)["prefill"] is None  # a window of cycles


def test_a_first_cycle_replayed_as_one_graph_ends_the_prefill():
    """A first decode step that replays its whole-cycle graph has no verify forward span: the cycle graph's launch
    ends the request's way to its first cycle."""
    trace = {"traceEvents": [
        span("scheduler.recv_requests", 0, 50), span("cudaGraphLaunch", 100, 20, cat="cuda_runtime", correlation=1),
        kernel("_w8a8_gemm_kernel", 200, 400, corr=1), kernel("_gdn_prefill_kernel", 600, 100, corr=1),  # the prefill
        span("cudaGraphLaunch", 650, 20, cat="cuda_runtime", correlation=2),  # the first cycle, queued behind it
        *(kernel(name, ts, 100, corr=2) for name, ts in [("_w4_scan_kernel", 750), ("_w8a8_gemm_kernel", 850),
                                                          ("_gdn_verify_kernel", 950), ("_w8a16_argmax_kernel", 1050)]),
    ]}
    pre = summarize(trace, steps=1)["prefill"]
    assert pre["kernels"] == 2 and pre["gpu_busy_ms"] == pytest.approx(0.5)
    assert pre["arrival_to_first_cycle_ms"] == pytest.approx(0.75) and pre["gpu_idle_ms"] == pytest.approx(0.25)


def test_with_python_stacks_the_prefill_profile_names_what_the_host_ran_while_the_gpu_idled():
    """Each Python function's own time (its callees' left out) inside the GPU's idle gaps between the request's arrival
    and the first cycle's first kernel: 900-1100, 1110-1300, 1800-2200 and 2250-2300 us here; the scheduler's thread
    only, each span ended by its caller's end at the latest."""
    def py(where, ts, dur, tid=1):
        return span(f"/usr/lib/python3/site-packages/sglang/srt/{where}", ts, dur, cat="python_function", tid=tid)

    trace = {"traceEvents": [
        span("scheduler.recv_requests", 900, 50), kernel("Memcpy HtoD", 1100, 10, corr=10),
        span("cudaMemcpyAsync", 1060, 5, cat="cuda_runtime", correlation=10),
        span("cudaGraphLaunch", 1250, 20, cat="cuda_runtime", correlation=11),
        kernel("_w8a8_gemm_kernel", 1300, 400, corr=11), kernel("_rms_norm_quant_kernel", 1700, 100, corr=11),
        span("cudaLaunchKernel", 1900, 5, cat="cuda_runtime", correlation=12), kernel("direct_copy", 2200, 50, corr=12),
        span("step[TARGET_VERIFY bs=1]", 2000, 100), span("cudaGraphLaunch", 2050, 20, cat="cuda_runtime", correlation=13),
        kernel("_w8a16_argmax_kernel", 2300, 100, corr=13),
        py("managers/scheduler.py(10): event_loop", 900, 1400),
        py("managers/scheduler.py(20): get_next_batch_to_run", 1000, 150),
        py("managers/schedule_batch.py(30): prepare_for_extend", 1050, 90),
        py("speculative/dflash_worker_v2.py(40): forward_batch_generation", 1800, 200),
        # a C function's span the tracer left open past its caller's return: it ends with the caller (2000)
        span("<built-in method w8a16_gemm_into>", 1850, 1000, cat="python_function"),
        py("managers/tokenizer_manager.py(50): wait", 1800, 400, tid=2),  # another thread, idle over the same gap
    ]}
    clean = summarize(trace, steps=1)["prefill"]["idle_blame"]  # before the profiler stalls the host
    # the profiler stalls the host inside prepare_for_extend (1060-1100: 40 of its 80 us idle) and in a busy stretch
    trace["traceEvents"] += [{"ph": "X", "cat": "overhead", "name": "Activity Buffer Request", "pid": -1, "tid": 0,
                              "ts": ts, "dur": dur} for ts, dur in [(1060, 40), (1400, 100)]]
    pre = summarize(trace, steps=1)["prefill"]
    assert pre["gpu_idle_ms"] == pytest.approx(0.84)
    assert pre["idle_blame"] == [("sglang/srt/managers/scheduler.py(10): event_loop", pytest.approx(0.5)),
                                 ("<built-in method w8a16_gemm_into>", pytest.approx(0.15)),
                                 ("sglang/srt/managers/scheduler.py(20): get_next_batch_to_run", pytest.approx(0.06)),
                                 ("sglang/srt/speculative/dflash_worker_v2.py(40): forward_batch_generation", pytest.approx(0.05)),
                                 ("sglang/srt/managers/schedule_batch.py(30): prepare_for_extend", pytest.approx(0.04)),
                                 ("(the profiler: CUPTI's activity buffer requests)", pytest.approx(0.04))]
    assert clean == [("sglang/srt/managers/scheduler.py(10): event_loop", pytest.approx(0.5)),
                     ("<built-in method w8a16_gemm_into>", pytest.approx(0.15)),
                     ("sglang/srt/managers/schedule_batch.py(30): prepare_for_extend", pytest.approx(0.08)),
                     ("sglang/srt/managers/scheduler.py(20): get_next_batch_to_run", pytest.approx(0.06)),
                     ("sglang/srt/speculative/dflash_worker_v2.py(40): forward_batch_generation", pytest.approx(0.05))]
    table = render(summarize(trace, steps=1), "title", in_order=True)
    assert "| `sglang/srt/managers/schedule_batch.py(30): prepare_for_extend` | 0.040 |" in table
    assert "| `(the profiler: CUPTI's activity buffer requests)` | 0.040 |" in table
