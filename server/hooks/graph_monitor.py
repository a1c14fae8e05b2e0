"""What the server says about its CUDA graphs (graphs/monitor.py): per captured family, the shapes, time and
memory, and every forward step that ran without a graph.

SGLang logs its capture progress but not which shapes each family holds, and falls back to eager forwards
silently; each eager step costs the launch overhead the graphs exist to remove, so qflash reports both.
Retire when SGLang reports captured shapes and eager fallbacks itself.
"""

import logging
import time

import torch

from qflash.graphs.monitor import EagerSteps, capture_report
from qflash.server.hooks import Hook

logger = logging.getLogger(__name__)
EAGER_STEPS = EagerSteps()  # per server process


def _report_capture(original, self, *args, **kwargs):
    torch.cuda.synchronize()
    free, start = torch.cuda.mem_get_info()[0], time.perf_counter()
    result = original(self, *args, **kwargs)
    torch.cuda.synchronize()
    seconds, held = time.perf_counter() - start, free - torch.cuda.mem_get_info()[0]
    role = "draft" if self.model_runner.is_draft_worker else "target"
    if hasattr(self, "capture_bs"):  # decode runner: verify or draft graphs of bs x K tokens
        report = capture_report(role, self.capture_forward_mode.name, list(self.capture_bs), self.captured_req_width, seconds, held)
    else:  # piecewise prefill runner: token buckets
        report = capture_report(role, "prefill", list(self.capture_num_tokens), 1, seconds, held)
    logger.info(report)
    return result


def _count_eager_step(result, self, forward_batch, *args, **kwargs):
    if not result.can_run_graph and not forward_batch.forward_mode.is_idle():
        role = "draft" if self.is_draft_worker else "target"
        line = EAGER_STEPS.record(role, forward_batch.forward_mode.name, forward_batch.batch_size, int(forward_batch.input_ids.numel()))
        if line:
            logger.info(line)
    return result


RUNNERS = "sglang.srt.model_executor.runner."
CHANGES = [
    Hook(RUNNERS + "decode_cuda_graph_runner.DecodeCudaGraphRunner.capture", _report_capture, "AROUND"),
    Hook(RUNNERS + "prefill_cuda_graph_runner.PrefillCudaGraphRunner.capture", _report_capture, "AROUND"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner._forward_raw", _count_eager_step, "AFTER"),
]
