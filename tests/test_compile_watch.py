"""Triton compiles counted before serving and reported one by one while serving (server/hooks/compile_watch.py)."""

import logging

import triton
import triton.language as tl
from triton.runtime.jit import compute_cache_key

from conftest import run_python
from qflash.server.hooks import compile_watch
from qflash.server.hooks.compile_watch import CompileLog


@triton.jit
def _fwd_kernel(Q, O, n, BLOCK: tl.constexpr):
    pass


# What Triton 3.6 hands its hooks for a variant: its `repr` (whose arguments are garbled: the first pairs with the
# cache key's second character) and the cache key, from Triton's own function.
KEY = compute_cache_key({}, [("*bf16", "D"), ("*i64", ""), ("i32", "1"), ("constexpr", 16)], "CUDAOptions(...)")
REPR = "_fwd_kernel[num_warps=4, num_ctas=1, num_stages=2, enable_fp_fusion=True, launch_cooperative_grid=False](Q: ()"
VARIANT = ("_fwd_kernel[num_warps=4, num_ctas=1, num_stages=2, enable_fp_fusion=True, launch_cooperative_grid=False]"
           "(Q: *bf16 D, O: *i64, n: i32 1, BLOCK: constexpr 16)")


def compile_once(log: CompileLog, module: str = "qflash.kernels.w8a8_gemm", name: str = "_w8a8_gemm_kernel"):
    """What Triton's JIT does around one compile: both hooks, with the function's info (triton's JitFunctionInfo)
    and its description of the variant."""
    from triton.runtime.jit import JitFunctionInfo

    call = dict(key=KEY, repr=REPR, compile={}, is_manual_warmup=False, already_compiled=False)
    assert log.before(fn=None, **call) is None
    log.after(fn=JitFunctionInfo(module, name, _fwd_kernel), **call)


def test_start_up_compiles_are_counted_and_each_compile_while_serving_is_logged(caplog):
    log = CompileLog()
    with caplog.at_level(logging.INFO, logger=compile_watch.logger.name):
        compile_once(log)
        compile_once(log)
        assert not caplog.records  # start-up: counted, not logged one by one
        line = log.serving_starts()
        assert line.startswith("qflash: 2 Triton kernel variants compiled during start-up and warm-up, ")
        assert line.endswith(" s of compiling")
        compile_once(log, "sglang.srt.layers.attention.triton_ops.extend_attention", "_fwd_kernel")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "qflash: Triton compiled sglang.srt.layers.attention.triton_ops.extend_attention._fwd_kernel while serving"]
    assert caplog.records[0].levelno == logging.WARNING
    assert caplog.records[0].getMessage().endswith(f"compiles while serving: 1): {VARIANT}")
    assert (log.count, log.while_serving) == (3, 1)


def test_the_last_warm_up_request_ends_start_up(caplog, monkeypatch):
    from types import SimpleNamespace

    from qflash.server import warm_up

    monkeypatch.setattr(compile_watch, "COMPILES", CompileLog())
    with caplog.at_level(logging.INFO, logger=compile_watch.logger.name):
        compile_watch._end_start_up_after_the_warm_up(object(), SimpleNamespace(rid="a user's request"))
        assert not compile_watch.COMPILES.serving and not caplog.records
        for _ in range(2):  # a second marker (a user may send that rid) changes nothing
            compile_watch._end_start_up_after_the_warm_up(object(), SimpleNamespace(rid=warm_up.DONE_RID))
    assert compile_watch.COMPILES.serving and len(caplog.records) == 1
    assert "compiled during start-up and warm-up" in caplog.records[0].getMessage()


WATCHED = """
from sglang.srt.plugins import load_plugins
load_plugins()
from triton import knobs
from triton.runtime.jit import JitFunctionInfo
from qflash.server.hooks.compile_watch import COMPILES
call = dict(key="k", repr="r", compile={}, is_manual_warmup=False, already_compiled=False)
knobs.runtime.jit_cache_hook(fn=None, **call)  # what Triton's JIT calls around a compile, as the plugin left it
knobs.runtime.jit_post_compile_hook(fn=JitFunctionInfo("m", "_k", None), **call)
print(COMPILES.count)
"""


def test_the_plugin_sets_tritons_compile_hooks_in_every_process():
    result = run_python(WATCHED, env={"SGLANG_PLUGINS": "qflash"})
    assert result.returncode == 0 and result.stdout.split()[-1] == "1", result.stderr[-2000:]


def test_a_hook_set_before_qflash_still_runs_and_its_answer_stands():
    seen = []
    chained = compile_watch._chained(lambda **kw: seen.append(kw["key"]) or True, lambda **kw: None)
    assert chained(key="k") is True and seen == ["k"]  # e.g. a tool that tells Triton to skip the compile


def test_a_server_log_gives_back_the_kernels_compiled_while_serving(caplog):
    """What `qflash bench` reports per server, read from the lines the watch writes (None without its start-up)."""
    log = CompileLog()
    with caplog.at_level(logging.INFO, logger=compile_watch.logger.name):
        compile_once(log)
        started = log.serving_starts()
        assert compile_watch.compiles_while_serving(f"[t] {started}\n") == []
        compile_once(log, "sglang.srt.mem_cache.allocation", "assign_req_to_token_pool")
        compile_once(log, "qflash.kernels.window_pack", "_pack_cycle_kernel")
    text = "\n".join(["[t] serving", started] + [f"[t] {r.getMessage()}" for r in caplog.records])
    assert compile_watch.compiles_while_serving(text) == [
        "sglang.srt.mem_cache.allocation.assign_req_to_token_pool", "qflash.kernels.window_pack._pack_cycle_kernel"]
    assert compile_watch.compiles_while_serving("[t] The server is fired up and ready to roll!\n") is None
