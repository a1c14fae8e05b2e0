"""The scheduler's host time per speculative cycle, measured in the server (`qflash bench` turns it on).

In steady decoding SGLang's overlap scheduler blocks on the GPU once per step, on the previous step's result
(`copy_done.synchronize()` at the top of `process_batch_result_decode`); the rest of the loop is host work.
This wraps that method: it waits for the result itself, timing the wait, and takes the time from one call to
the next as the step's loop time. Per request, from its second decode step on, it sums loop time, wait and
cycles (a window's several), and logs one line when the request finishes: loop minus wait per cycle is the host's
CPU time per cycle, whatever the GPU's. With this on, a request's decode steps are all it can see; it says
nothing about prefill steps in between, which the benchmark's one-at-a-time requests do not have.

The same line splits that host time by stage (STAGES): the host time spent inside each of a few SGLang calls of
the step, summed over the interval a step's loop time covers (which holds the next step's launch, as the overlap
scheduler runs it before processing this one's result). Stages nest: `run_batch` holds the worker's, and the two
model forwards hold their graph launches.
Installed only when QFLASH_CYCLE_METER=1; retire when SGLang reports its scheduler's busy time per step.
"""

import os
import re
import sys
import time

from qflash.server.hooks import Hook

ENV = "QFLASH_CYCLE_METER"
LINE = "qflash cycle meter: rid={rid} steps={steps} cycles={cycles} loop_ms={loop:.3f} wait_ms={wait:.3f} stages={stages}"
PATTERN = re.compile(r"qflash cycle meter: rid=(\S+) steps=(\d+) cycles=(\d+) loop_ms=([\d.]+) wait_ms=([\d.]+)"
                     r"(?: stages=(\S*))?")
WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2."
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"  # a stage per runner, FORWARDS
FORWARDS = ("draft_forward", "verify_forward")
# stage -> the SGLang call whose host time it is
STAGES = {
    "run_batch": "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "graph_launch": "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend.replay",
    "verify_prepare": "sglang.srt.speculative.dflash_info.DFlashVerifyInput.prepare_for_verify",
    "gdn_commit": WORKER + "_update_target_mamba_state_after_verify",
    "drafter_kv": WORKER + "_append_target_hidden_to_draft_kv_by_loc",
}
IN_RUN_BATCH = (*FORWARDS, "verify_prepare", "gdn_commit", "drafter_kv")  # inside run_batch, none inside another


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class Meter:
    """Per-request sums of the decode steps it took part in, one scheduler process's."""

    def __init__(self):
        self.last_start: float | None = None
        self.requests: dict[str, list] = {}  # rid -> [steps, cycles, loop s, wait s, {stage: s}], from its second step
        self.stages: dict[str, float] = {}  # host seconds per stage since the last processed step

    def step(self, reqs, cycles: int, start: float, waited: float) -> list[str]:
        """Account one processed decode step; the lines of the requests it finished."""
        loop = None if self.last_start is None else start - self.last_start
        self.last_start = start
        stages, self.stages = self.stages, {}
        lines = []
        for req in reqs:
            sums = self.requests.get(req.rid)
            if sums is None:  # its first step (whose loop time ran before it decoded), or the step after its end
                if not req.finished():
                    self.requests[req.rid] = [0, 0, 0.0, 0.0, {}]
                continue
            if loop is not None:
                sums[0] += 1
                sums[1] += cycles
                sums[2] += loop
                sums[3] += waited
                for name, seconds in stages.items():
                    sums[4][name] = sums[4].get(name, 0.0) + seconds
            if req.finished():
                steps, cycles_run, loop_s, wait_s, stage_s = self.requests.pop(req.rid)
                spent = ",".join(f"{name}:{seconds * 1e3:.3f}" for name, seconds in stage_s.items())
                lines.append(LINE.format(rid=req.rid, steps=steps, cycles=cycles_run, loop=loop_s * 1e3,
                                         wait=wait_s * 1e3, stages=spent))
        return lines

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds


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


def _timed(stage):
    """An AROUND hook adding the call's host time to `stage`: a name, or a function of the call's first argument."""
    def around(original, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            METER.add(stage(args[0]) if callable(stage) else stage, time.perf_counter() - start)

    return around


def _forward_stage(runner) -> str:
    return FORWARDS[0] if runner.is_draft_worker else FORWARDS[1]


def host_ms_per_cycle(line_match) -> tuple[int, float, float, dict[str, float]]:
    """(cycles, loop ms per cycle, host ms per cycle, {stage: host ms per cycle}) of a PATTERN match."""
    cycles, loop, wait = max(int(line_match[3]), 1), float(line_match[4]), float(line_match[5])
    stages = dict(item.split(":") for item in (line_match[6] or "").split(",") if item)
    return cycles, loop / cycles, (loop - wait) / cycles, {name: float(ms) / cycles for name, ms in stages.items()}


CHANGES = [
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.process_batch_result_decode",
         _meter_decode_step, "AROUND"),
    Hook(MODEL_FORWARD, _timed(_forward_stage), "AROUND"),
    *(Hook(symbol, _timed(stage), "AROUND") for stage, symbol in STAGES.items()),
]
