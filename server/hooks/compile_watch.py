"""What the server says about Triton's compiles: how many kernel variants a process compiled during start-up, and
how long that took, then every compile while serving, one line each.

A kernel variant first reached by a request (a cache-hit extend of a new length, a batch size not seen yet) is
compiled then, and that request waits hundreds of milliseconds for it; nothing in SGLang's log says so. Triton's JIT
calls `knobs.runtime.jit_cache_hook` before compiling a kernel variant it has not built in this process (the
compile may still be served from Triton's disk cache) and `jit_post_compile_hook` after; qflash times each pair.
Start-up ends with the last request of `qflash serve`'s warm-up (server/warm_up.py, its rid DONE_RID), so a server
started without it reports no compile one by one. Retire when SGLang reports or prevents compiles while serving.
"""

import logging
import re
import threading
import time
from dataclasses import dataclass

from qflash.server import warm_up
from qflash.server.hooks import Hook

logger = logging.getLogger(__name__)
STARTUP = "qflash: {count} Triton kernel variants compiled during start-up and warm-up, {seconds:.1f} s of compiling"
# The variant is described by its launch options and each argument's type and specialization (Triton's marks: `D`
# divisible by 16, a pointer 16-byte aligned; `1` an integer equal to 1), so a compile while serving says what the
# warm-up did not reach.
WHILE_SERVING = "qflash: Triton compiled {name} while serving ({ms:.0f} ms; compiles while serving: {count}): {variant}"
# The two lines read back from a server's log (tests/test_compile_watch.py checks them against the formats).
_STARTUP_LINE = re.compile(r"qflash: \d+ Triton kernel variants compiled during start-up and warm-up")
_WHILE_SERVING_NAME = re.compile(r"qflash: Triton compiled (\S+) while serving \(")
_ARGUMENT = re.compile(r"\('([^']*)', '?([^')]*)'?\)")  # one argument's (type, specialization) in a cache key


class CompileLog:
    """Triton compiles in this process: counted and timed, each logged once the scheduler serves."""

    def __init__(self):
        self.count, self.seconds, self.serving, self.while_serving = 0, 0.0, False, 0
        self._started = threading.local()  # compiles run on the launching thread; several threads may launch

    def before(self, **_) -> None:
        self._started.at = time.perf_counter()
        return None  # a true value would tell Triton to skip the compile

    def after(self, *, fn, **call) -> None:
        seconds = time.perf_counter() - getattr(self._started, "at", time.perf_counter())
        self.count += 1
        self.seconds += seconds
        if self.serving:
            self.while_serving += 1
            logger.warning(WHILE_SERVING.format(name=f"{fn.module}.{fn.name}", ms=seconds * 1e3, count=self.while_serving,
                                                variant=_variant(fn, call)))

    def serving_starts(self) -> str:
        self.serving = True
        return STARTUP.format(count=self.count, seconds=self.seconds)


COMPILES = CompileLog()  # per process


@dataclass(frozen=True)
class TritonCompileHooks:
    """Triton's two JIT compile hooks (knobs, not functions HookRegistry wraps), set to this process's log."""

    log: CompileLog
    target: str = "triton.knobs.runtime.jit_cache_hook/jit_post_compile_hook"

    def install(self):
        from triton import knobs

        before = _chained(knobs.runtime.jit_cache_hook, self.log.before)
        after = _chained(knobs.runtime.jit_post_compile_hook, self.log.after)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
        return lambda: (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == (before, after)


def _variant(fn, call: dict) -> str:
    """Triton's `repr` of a variant with its arguments read from the cache key: Triton 3.6's own pairs the arguments
    with the key's characters (the key became a string, `str(specialization) + str(options)`)."""
    arguments = zip(getattr(fn.jit_function, "arg_names", ()), _ARGUMENT.findall(str(call.get("key", ""))))
    described = ", ".join(f"{name}: {kind} {spec}".rstrip() for name, (kind, spec) in arguments)
    return f"{call.get('repr', '').split('](')[0]}]({described})"


def _chained(earlier, ours):
    """`ours`, after a hook another tool set before qflash (whose answer, e.g. "skip this compile", stands)."""
    if earlier is None:
        return ours

    def both(**kwargs):
        ours(**kwargs)
        return earlier(**kwargs)

    return both


def compiles_while_serving(log: str) -> list[str] | None:
    """The kernels a server's log says were compiled while serving, in order; None where the log has no start-up
    line (a server without qflash's warm-up, whose compiles are not told apart)."""
    if not _STARTUP_LINE.search(log):
        return None
    return _WHILE_SERVING_NAME.findall(log)


def _end_start_up_after_the_warm_up(self, recv_req, *args, **kwargs):
    if recv_req.rid == warm_up.DONE_RID and not COMPILES.serving:
        logger.info(COMPILES.serving_starts())


CHANGES = [TritonCompileHooks(COMPILES),
           Hook("sglang.srt.managers.scheduler.Scheduler.handle_generate_request", _end_start_up_after_the_warm_up, "BEFORE")]
