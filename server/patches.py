"""Every change qflash makes to a private SGLang symbol, each with the reason it exists.

They are written for SGLang 0.5.17 exactly and refuse to apply to any other version: a private
symbol can change meaning between releases without notice.
"""

from importlib.metadata import version

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PINNED_SGLANG = "0.5.17"


def check_version() -> None:
    found = version("sglang")
    if found != PINNED_SGLANG:
        raise RuntimeError(f"qflash patches SGLang {PINNED_SGLANG} internals; found sglang {found}")


def _text_only_model_config(*args, **kwargs):
    # SGLang serves Qwen3_5ForConditionalGeneration as multimodal: ModelConfig then demands an image
    # processor, and `--enable-multimodal` can only turn multimodality on, never off. qflash serves the
    # text model only (server/models/qwen3_5_text.py), so every ModelConfig it builds is text-only.
    return args, {**kwargs, "enable_multimodal": False}


def apply_text_only() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.configs.model_config.ModelConfig.__init__", _text_only_model_config, HookType.BEFORE
    )


async def _reject_unknown_model(original, self, request, raw_request):
    # SGLang 0.5.17 answers an OpenAI request whatever model it names. An OpenAI server answers 404 for
    # a model it does not serve, so a client with a wrong model name hears so instead of getting ours.
    from sglang.srt.entrypoints.openai.protocol import DEFAULT_MODEL_NAME

    model = getattr(request, "model", None)
    served = self.tokenizer_manager.served_model_name
    if model is not None and model.split(":", 1)[0] not in (served, DEFAULT_MODEL_NAME):
        return self.create_error_response(
            f"The model '{model}' does not exist; this server serves '{served}'",
            err_type="NotFoundError", status_code=404,
        )
    return await original(self, request, raw_request)


def apply_openai_model_check() -> None:
    check_version()
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
        _reject_unknown_model, HookType.AROUND,
    )
