"""The scheduler's host time per speculative cycle, measured in the server (`qflash bench` turns it on).

In steady decoding SGLang's overlap scheduler blocks on the GPU once per step, on the previous step's result
(`copy_done.synchronize()` at the top of `process_batch_result_decode`); the rest of the loop is host work.
This wraps that method: it waits for the result itself, timing the wait, and takes the time from one call to
the next as the step's loop time. Per request, from its second decode step on, it sums loop time, wait and
cycles (a window's several), and logs one line when the request finishes: loop minus wait per cycle is the host's
CPU time per cycle, whatever the GPU's. With this on, a request's decode steps are all it can see; it says
nothing about prefill steps in between, which the benchmark's one-at-a-time requests do not have.
Installed only when QFLASH_CYCLE_METER=1; retire when SGLang reports its scheduler's busy time per step.
"""

import os
import re
import sys
import time

from qflash.server.hooks import Hook

ENV = "QFLASH_CYCLE_METER"
LINE = "qflash cycle meter: rid={rid} steps={steps} cycles={cycles} loop_ms={loop:.3f} wait_ms={wait:.3f}"
PATTERN = re.compile(r"qflash cycle meter: rid=(\S+) steps=(\d+) cycles=(\d+) loop_ms=([\d.]+) wait_ms=([\d.]+)")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class Meter:
    """Per-request sums of the decode steps it took part in, one scheduler process's."""

    def __init__(self):
        self.last_start: float | None = None
        self.requests: dict[str, list] = {}  # rid -> [steps, cycles, loop s, wait s], from its second step

    def step(self, reqs, cycles: int, start: float, waited: float) -> list[str]:
        """Account one processed decode step; the lines of the requests it finished."""
        loop = None if self.last_start is None else start - self.last_start
        self.last_start = start
        lines = []
        for req in reqs:
            sums = self.requests.get(req.rid)
            if sums is None:  # its first step (whose loop time ran before it decoded), or the step after its end
                if not req.finished():
                    self.requests[req.rid] = [0, 0, 0.0, 0.0]
                continue
            if loop is not None:
                sums[0] += 1
                sums[1] += cycles
                sums[2] += loop
                sums[3] += waited
            if req.finished():
                steps, cycles_run, loop_s, wait_s = self.requests.pop(req.rid)
                lines.append(LINE.format(rid=req.rid, steps=steps, cycles=cycles_run, loop=loop_s * 1e3, wait=wait_s * 1e3))
        return lines


METER = Meter()  # per scheduler process


def _meter_decode_step(original, self, batch, result):
    from qflash.server.window import CYCLES

    start = time.perf_counter()
    if result.copy_done is not None:
        result.copy_done.synchronize()
    waited = time.perf_counter() - start
    out = original(self, batch, result)
    for line in METER.step(batch.reqs, getattr(result, CYCLES, 1), start, waited):
        print(line, file=sys.stderr, flush=True)  # the server's log, where `qflash bench` reads it
    return out


def host_ms_per_cycle(line_match) -> tuple[int, float, float]:
    """(cycles, loop ms per cycle, host ms per cycle) of a PATTERN match."""
    cycles, loop, wait = int(line_match[3]), float(line_match[4]), float(line_match[5])
    return cycles, loop / max(cycles, 1), (loop - wait) / max(cycles, 1)


CHANGES = [
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.process_batch_result_decode",
         _meter_decode_step, "AROUND"),
]
