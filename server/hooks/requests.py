"""Bad requests answered with a 4xx and a readable message, never a 500, a silent success or a crashed server.

SGLang 0.5.17 lets through requests that later fail deep in its request path (a 500) or in the scheduler
(which takes the whole server down), or that it serves where an OpenAI server would refuse:
- a body that is not a JSON object, or a `response_format` that is not one: an AttributeError in its request
  model's validators; a body of any size is read whole;
- sampling parameters of the wrong type (it builds `SamplingParams(**params)` unchecked), `n` below 1 (taken as
  1) or unbounded (each of `n` is a sub-request), `top_logprobs` unbounded (the scheduler runs `topk` on it);
- token ids outside the vocabulary (an out-of-range embedding lookup: a device-side assert on the GPU) and
  empty prompts; SGLang has a vocabulary check (`_validate_input_ids_in_vocab`) but never calls it;
- an OpenAI request naming a model it does not serve, or `max_tokens` 0 on chat;
- validation errors whose message carries SGLang's file paths and line numbers (FastAPI's `str(exc)`).
The limits (`n`, `top_logprobs`, body size) come from the server's environment, which `qflash serve` sets
from its flags (server/preset.py's REQUEST_LIMITS are the defaults).
Retire each check when SGLang makes it itself.
"""

import functools
import os
import typing

from qflash.server.hooks import Hook
from qflash.server.preset import REQUEST_LIMITS

REQUEST_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


def limit(name: str) -> int:
    """A request limit: the server's environment (`QFLASH_MAX_N`, ...) or REQUEST_LIMITS' default."""
    return int(os.environ.get("QFLASH_" + name.upper(), REQUEST_LIMITS[name]))


async def _check_openai_request(original, self, request, raw_request):
    from sglang.srt.entrypoints.openai.protocol import DEFAULT_MODEL_NAME

    model = getattr(request, "model", None)
    served = self.tokenizer_manager.served_model_name
    if model is not None and model.split(":", 1)[0] not in (served, DEFAULT_MODEL_NAME):  # `:adapter` suffixes
        return self.create_error_response(
            f"The model '{model}' does not exist; this server serves '{served}'",
            err_type="NotFoundError", status_code=404,
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, field, None)
        if value is not None and value < 1:
            return self.create_error_response(f"{field} must be at least 1, got {value}")
    return await original(self, request, raw_request)


async def _check_json_body(original, self):
    from fastapi import HTTPException

    if self.url.path in REQUEST_PATHS:
        await _read_bounded_body(self, limit("max_request_bytes"))
    body = await original(self)
    if self.url.path in REQUEST_PATHS:
        if not isinstance(body, dict):
            raise HTTPException(400, f"The request body must be a JSON object, got {type(body).__name__}")
        if body.get("response_format") and not isinstance(body["response_format"], dict):
            raise HTTPException(400, "response_format must be an object, e.g. {\"type\": \"json_object\"}")
    return body


async def _read_bounded_body(request, max_bytes: int) -> None:
    """Read the body into Starlette's cache (`_body`, which `json()` then parses), refusing it with a 413 once it
    is larger than `max_bytes`, declared or streamed."""
    from fastapi import HTTPException

    too_large = HTTPException(413, f"The request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    if not hasattr(request, "_body"):
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
        request._body = b"".join(chunks)


@functools.cache
def _sampling_param_types() -> dict:
    from sglang.srt.sampling.sampling_params import SamplingParams

    return typing.get_type_hints(SamplingParams)


def check_sampling_params(obj) -> None:
    """Raise ValueError (SGLang answers 400) for sampling parameters or a logprob request SGLang would fail on,
    or that exceed the server's limits. Each value is checked against SamplingParams' own type annotation, as
    msgspec (SGLang's struct library) converts it; None is SGLang's "default" for every field."""
    import msgspec

    types = _sampling_param_types()
    params = obj.sampling_params
    max_n = limit("max_n")
    for p in params if isinstance(params, list) else [params or {}]:
        for name, value in p.items():
            if name not in types:
                raise ValueError(f"Unknown sampling parameter '{name}'")
            if value is not None:
                try:
                    msgspec.convert(value, types[name])
                except msgspec.ValidationError as exc:
                    raise ValueError(f"Sampling parameter '{name}': {exc}, got {value!r}") from None
        n = p.get("n")
        if n is not None and not 1 <= n <= max_n:
            raise ValueError(f"n must be at least 1 and at most {max_n} (the server's limit), got {n}")
    max_top = limit("max_top_logprobs")
    top = obj.top_logprobs_num
    for value in top if isinstance(top, list) else [top]:
        if value is not None and not (isinstance(value, int) and 0 <= value <= max_top):
            raise ValueError(f"top_logprobs must be an integer from 0 to {max_top} (the server's limit), got {value!r}")


def check_input_ids(self, obj, input_ids) -> None:
    """Raise ValueError (400) for an empty prompt or token ids outside the vocabulary."""
    if input_ids is None:  # input_embeds instead of tokens
        return
    if not input_ids:
        raise ValueError("The prompt is empty")
    vocab = self.model_config.vocab_size
    bad = [t for t in input_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"Token ids must be in [0, {vocab}); got {bad[:8]}")


def scrub_validation_error(handler):
    """SGLang's validation-error handler, given the error without FastAPI's endpoint context (the file and line
    of SGLang's route), which `str(exc)` would otherwise put into the client's message."""
    from fastapi.exceptions import RequestValidationError

    async def scrubbed(request, exc):
        return await handler(request, RequestValidationError(exc.errors(), body=getattr(exc, "body", None)))

    scrubbed.scrubs = handler
    return scrubbed


class ValidationErrorHandler:
    """The app's handler for RequestValidationError is held in FastAPI's handler table, not reachable by a hook."""

    target = "sglang.srt.entrypoints.http_server.app.exception_handlers[RequestValidationError]"

    def install(self):
        from fastapi.exceptions import RequestValidationError
        from sglang.srt.entrypoints.http_server import app

        app.exception_handlers[RequestValidationError] = scrub_validation_error(app.exception_handlers[RequestValidationError])
        return lambda: hasattr(app.exception_handlers[RequestValidationError], "scrubs")


CHANGES = [
    Hook("sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request", _check_openai_request, "AROUND"),
    Hook("sglang.srt.entrypoints.http_server.ORJSONRequest.json", _check_json_body, "AROUND"),
    Hook("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", check_sampling_params, "BEFORE"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", check_input_ids, "BEFORE"),
    ValidationErrorHandler(),
]
