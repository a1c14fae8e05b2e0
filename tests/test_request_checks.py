"""Bad requests answered with a readable 400 instead of a 500, a silent success or a crashed server.

The checks are qflash's hooks (server/hooks/requests.py), run here on SGLang 0.5.17's own request objects; the
parse-level cases are SGLang's FastAPI app itself (no model needed to reject a body it cannot parse).
The same table runs against the served model in tests/test_gpu_server.py.
"""

import json
from types import SimpleNamespace

import pytest

from conftest import run_python
from qflash.server.hooks import requests as checks
from sglang.srt.managers.io_struct import GenerateReqInput

GOOD = [
    {}, {"max_new_tokens": 0}, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, {"temperature": 1},
    {"n": 2, "stop": ["\n"], "stop_token_ids": [1, 2], "top_k": 5, "logit_bias": {"7": -1.5}},
    {"temperature": None, "max_new_tokens": None, "sampling_seed": None},  # what the OpenAI adapters pass
]
BAD = [
    ({"max_new_tokens": "ten"}, "'max_new_tokens'"), ({"temperature": "hot"}, "'temperature'"),
    ({"n": 2.5}, "'n'"), ({"n": "two"}, "'n'"), ({"n": 0}, "n must be at least 1"), ({"n": -1}, "n must be at least 1"),
    ({"ignore_eos": "yes"}, "'ignore_eos'"), ({"stop": 5}, "'stop'"), ({"bogus": 1}, "Unknown sampling parameter 'bogus'"),
]


@pytest.mark.parametrize("params", GOOD)
def test_valid_sampling_params_pass(params):
    checks.check_sampling_params(GenerateReqInput(text="hi", sampling_params=params))
    checks.check_sampling_params(GenerateReqInput(text=["a", "b"], sampling_params=[params, params]))


@pytest.mark.parametrize("params, message", BAD)
def test_invalid_sampling_params_are_a_value_error(params, message):
    with pytest.raises(ValueError, match=message):
        checks.check_sampling_params(GenerateReqInput(text="hi", sampling_params=params))


@pytest.mark.parametrize("field, value, message", [
    ("n", 17, r"n must be at least 1 and at most 16 \(the server's limit\), got 17"),
    ("top_logprobs_num", 21, r"top_logprobs must be an integer from 0 to 20 \(the server's limit\), got 21"),
    ("top_logprobs_num", 10**9, "at most|from 0 to 20"), ("top_logprobs_num", -1, "from 0 to 20"),
])
def test_requests_are_bounded(field, value, message):
    request = (GenerateReqInput(text="hi", sampling_params={"n": value}) if field == "n"
               else GenerateReqInput(text="hi", return_logprob=True, top_logprobs_num=value))
    with pytest.raises(ValueError, match=message):
        checks.check_sampling_params(request)


def test_the_bounds_follow_the_servers_flags(monkeypatch):
    checks.check_sampling_params(GenerateReqInput(text="hi", sampling_params={"n": 16}, top_logprobs_num=20))
    checks.check_sampling_params(GenerateReqInput(text=["a", "b"], sampling_params=[{}, {}], top_logprobs_num=[0, 20]))
    monkeypatch.setenv("QFLASH_MAX_N", "64")  # what `qflash serve --max-n 64` sets for the server
    checks.check_sampling_params(GenerateReqInput(text="hi", sampling_params={"n": 64}))
    with pytest.raises(ValueError, match="at most 64"):
        checks.check_sampling_params(GenerateReqInput(text="hi", sampling_params={"n": 65}))


def test_prompts_must_be_token_ids_of_the_vocabulary():
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=1000))
    checks.check_input_ids(manager, None, [0, 5, 999])
    checks.check_input_ids(manager, None, None)  # input_embeds requests carry no ids
    for ids, message in (([], "empty"), ([5, 1000], r"\[0, 1000\); got \[1000\]"), ([-1, 3], r"got \[-1\]")):
        with pytest.raises(ValueError, match=message):
            checks.check_input_ids(manager, None, ids)


def test_the_checks_run_where_sglang_parses_requests():
    code = """
import json
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
for call in (lambda: GenerateReqInput(text="hi", sampling_params={"n": "two"}).normalize_batch_and_arguments(),
             lambda: TokenizerManager._validate_one_request(
                 SimpleNamespace(model_config=SimpleNamespace(vocab_size=10)), GenerateReqInput(text="hi"), [3, 10])):
    try:
        call()
        print("accepted")
    except Exception as exc:
        print(type(exc).__name__)
"""
    assert run_python(code, env={"SGLANG_PLUGINS": "qflash"}).stdout.split()[-2:] == ["ValueError", "ValueError"]
    stock = run_python(code, env={"SGLANG_PLUGINS": "qflash_text_only"}).stdout.split()[-2:]
    assert stock[0] == "TypeError"  # what 0.5.17 raises: a 500


CHAT = {"model": "Qwen3.5-4B", "messages": [{"role": "user", "content": "hi"}]}


def openai_check(request) -> tuple[int, str] | None:
    """The OpenAI-level check: None when the request goes on to SGLang, else (status, message)."""
    import asyncio

    from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase

    class Serving:
        tokenizer_manager = SimpleNamespace(served_model_name="Qwen3.5-4B")
        create_error_response = OpenAIServingBase.create_error_response

    async def original(self, request, raw_request):
        return None

    response = asyncio.run(checks._check_openai_request(original, Serving(), request, None))
    return None if response is None else (response.status_code, response.body.decode())


def test_openai_requests_must_name_the_model_and_ask_for_tokens():
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    assert openai_check(ChatCompletionRequest(**CHAT, max_tokens=5)) is None
    assert openai_check(ChatCompletionRequest(**CHAT)) is None
    assert openai_check(ChatCompletionRequest(**{**CHAT, "model": "Qwen3.5-4B:my-adapter"})) is None  # an adapter suffix
    status, body = openai_check(ChatCompletionRequest(**{**CHAT, "model": "gpt-17"}))
    assert status == 404 and "gpt-17" in body
    for field in ("max_tokens", "max_completion_tokens"):
        for value in (0, -3):
            status, body = openai_check(ChatCompletionRequest(**CHAT, **{field: value}))
            assert status == 400 and f"{field} must be at least 1, got {value}" in body


APP = """
import json, sys
from fastapi.testclient import TestClient
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.entrypoints.http_server import app
client = TestClient(app, raise_server_exceptions=False)
for line in sys.stdin:
    url, body = json.loads(line)
    r = client.post(url, content=body.encode("utf-8", "surrogateescape"), headers={"Content-Type": "application/json"})
    print(json.dumps([r.status_code, r.text]))
"""
MESSAGES = [{"role": "user", "content": "hi"}]
# Bodies SGLang's app rejects before any model runs (no server state here: a body that parses goes on
# to the handler, which this test does not have).
UNPARSABLE = [
    ("/generate", '{"text": "hi", "sampling_params": {'), ("/v1/chat/completions", '{"model": "m", "messages": ['),
    ("/v1/completions", '{"prompt": "hi"'),
    ("/generate", '{"text": "\udcff\udcfe"}'), ("/v1/chat/completions", '{"messages": "\udcc3("}'),  # bytes ff fe, c3 28
    ("/generate", '[1, 2]'), ("/v1/chat/completions", '[1, 2]'), ("/v1/chat/completions", 'null'), ("/v1/completions", '"hi"'),
    ("/generate", '{"text": 5}'), ("/v1/chat/completions", json.dumps({"model": "m", "messages": "hi"})),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": MESSAGES, "response_format": "json"})),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": MESSAGES, "temperature": "hot"})),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "max_tokens": 0})),
    ("/generate", json.dumps({"text": "x" * 3000})), ("/v1/chat/completions", json.dumps({"model": "m", "messages": MESSAGES, "x": "y" * 3000})),
]
LARGE = 2  # the last cases: bodies over the test's QFLASH_MAX_REQUEST_BYTES


@pytest.mark.parametrize("plugins", ["qflash", "qflash_text_only"])
def test_unparsable_bodies_are_a_400_with_a_message(plugins):
    lines = "".join(json.dumps(case) + "\n" for case in UNPARSABLE)
    result = run_python(APP, env={"SGLANG_PLUGINS": plugins, "QFLASH_MAX_REQUEST_BYTES": "2048"}, stdin=lines)
    assert result.returncode == 0, result.stderr[-3000:]
    got = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(UNPARSABLE):]]
    statuses = [status for status, _ in got]
    if plugins == "qflash":
        assert statuses == [400] * (len(UNPARSABLE) - LARGE) + [413] * LARGE, list(zip(UNPARSABLE, got))
        messages = [json.loads(text)["message"] for _, text in got]
        assert all(messages) and "larger than 2048 bytes" in messages[-1]
        assert not [m for m in messages if 'File "' in m or ".py" in m], "server file paths in a client's message"
    else:  # stock 0.5.17: a body that is not an object, or a bad response_format, is a 500
        assert statuses[6:8] == [500, 500] and statuses[11] == 500
