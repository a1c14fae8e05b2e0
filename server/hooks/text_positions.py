"""A text prompt's mrope positions from one arange instead of a Python list of every token's position.

Qwen3.5's rotary is mrope: SGLang 0.5.17 builds an extend batch's positions [3, tokens] in
`ForwardBatch._compute_mrope_positions`, for a text-only request as `torch.tensor` of a nested list of each
position three times. For a fresh 8,192-token prompt that is 24,576 Python ints, milliseconds of host time before the
prefill graph launches, while the GPU waits: part of a long prompt's time to first token. The same positions come from
`torch.arange` (int64, on the CPU, then to the device as SGLang moves them). Batches with multimodal inputs stay
SGLang's.
Retire when SGLang builds text-only mrope positions with arange (or on the device).
"""

import torch

from qflash.server.hooks import Hook


def _text_positions_by_arange(original, self, model_runner, batch):
    mm = (batch.multimodal_inputs or [])[: self.seq_lens_cpu.shape[0]]
    if not mm or any(m is not None for m in mm) or not self.forward_mode.is_extend(include_draft_extend_v2=True):
        return original(self, model_runner, batch)
    rows = [torch.arange(prefix, prefix + length, dtype=torch.int64)
            for prefix, length in zip(batch.prefix_lens[: len(mm)], batch.extend_lens[: len(mm)])]
    self.mrope_positions = torch.cat(rows).repeat(3, 1).to(device=model_runner.device, non_blocking=True)


CHANGES = [Hook("sglang.srt.model_executor.forward_batch_info.ForwardBatch._compute_mrope_positions",
                _text_positions_by_arange, "AROUND")]
