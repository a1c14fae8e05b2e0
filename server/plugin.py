"""SGLang plugin entry points (group `sglang.srt.plugins`), run in the server and every scheduler process.

`qflash` is the whole stack; `qflash_text_only` is only the text-only Qwen3.5 switch, which the stock
SGLang systems of `qflash bench` load so that they serve the same text model without qflash's code.
"""

from qflash.server import patches

MODEL_PACKAGE = "qflash.server.models"


def register_text_only() -> None:
    patches.apply_text_only()


def register() -> None:
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices

    from qflash.quant.method import NAME, QflashW8A8Config

    register_text_only()
    patches.apply_openai_checks()
    patches.apply_request_checks()
    patches.apply_int8_lm_head_draft_pick()
    patches.apply_graph_monitor()
    patches.apply_block_attention()
    patches.apply_flash_prefill_attention()
    patches.apply_dflash_radix_cache_fixes()
    patches.apply_gdn_fold_commit()
    patches.apply_conv_update_tiles()
    patches.apply_gdn_verify_tiles()
    patches.apply_short_gdn_prefill()
    ModelRegistry.register(MODEL_PACKAGE, overwrite=True, strict=True)
    QUANTIZATION_METHODS[NAME] = QflashW8A8Config
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
