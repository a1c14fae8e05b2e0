"""SGLang plugin entry points (group `sglang.srt.plugins`), run in the server and every scheduler process.

`qflash` is the whole stack; `qflash_text_only` is only the text-only Qwen3.5 switch, which the stock SGLang
systems of `qflash bench` load so that they serve the same text model without qflash's code. Both refuse to
let a server start without what they install (server/hooks/__init__.py).
"""

from qflash.server import hooks
from qflash.server.hooks import (attention, compile_watch, cycle_graphs, cycle_meter, dflash_prefill, dflash_taps,
                                 draft_pick, embedding, fresh_prefill, gdn_input_proj, gdn_prefill, gdn_verify,
                                 glue_graphs, graph_inputs, graph_monitor, logits_buffer, logprobs, multi_cycle,
                                 quant_handoff, quantization, radix_cache, requests, text_only_model, text_positions)

MODEL_PACKAGE = "qflash.server.models"
TEXT_ONLY = text_only_model.CHANGES
QFLASH = [*TEXT_ONLY, *quantization.CHANGES, *quant_handoff.CHANGES, *dflash_taps.CHANGES, *gdn_input_proj.CHANGES,
          *requests.CHANGES, *draft_pick.CHANGES, *logits_buffer.CHANGES, *embedding.CHANGES, *graph_inputs.CHANGES,
          *text_positions.CHANGES, *graph_monitor.CHANGES, *compile_watch.CHANGES, *attention.CHANGES,
          *radix_cache.CHANGES, *gdn_verify.CHANGES, *gdn_prefill.CHANGES, *fresh_prefill.CHANGES,
          *dflash_prefill.CHANGES, *logprobs.CHANGES, *multi_cycle.CHANGES, *cycle_graphs.CHANGES,
          *glue_graphs.CHANGES]  # last: its graphs hold the other hooks' work on the same steps


def metered(changes: list) -> list:
    """`changes`, with the cycle meter where the server's environment asks for it (`qflash bench`)."""
    return [*changes, *cycle_meter.CHANGES] if cycle_meter.enabled() else changes


def register_text_only() -> None:
    hooks.install(metered(TEXT_ONLY))


def _register_model_and_method() -> list[str]:
    """qflash's model class and quantization method, through SGLang's registries; returns what is missing."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from qflash.quant.layout import METHOD_NAME
    from qflash.quant.method import QflashW8A8Config
    from qflash.server.models.dflash_drafter import DFlashDraftModel
    from qflash.server.models.qwen3_5_text import Qwen3_5ForConditionalGeneration

    ModelRegistry.register(MODEL_PACKAGE, overwrite=True, strict=True)
    QUANTIZATION_METHODS[METHOD_NAME] = QflashW8A8Config
    if METHOD_NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([METHOD_NAME])
    found = {f"model class {cls.__name__}": ModelRegistry.models.get(cls.__name__) is cls
             for cls in (Qwen3_5ForConditionalGeneration, DFlashDraftModel)}
    found["quantization method"] = QUANTIZATION_METHODS.get(METHOD_NAME) is QflashW8A8Config
    return [name for name, ok in found.items() if not ok]


def register() -> None:
    hooks.install(metered(QFLASH), extra_check=_register_model_and_method)
