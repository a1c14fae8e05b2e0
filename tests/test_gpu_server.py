"""The server end to end, started through `./launch.sh` (GPU machine only: `pytest -m gpu`)."""

import concurrent.futures

import pytest
import requests
import torch

from conftest import API, REAL, SERVED as BASE, SERVED_KEY

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODEL = "Qwen3.5-4B"
CONTEXT = 16384


@pytest.fixture(scope="module")
def server(served):
    """`./launch.sh` with no arguments (conftest.served)."""
    return served


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=BASE + "/v1", api_key=SERVED_KEY)


def assert_still_serving():
    assert API.get(BASE + "/health", timeout=30).status_code == 200
    r = API.post(BASE + "/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4


def test_health(server):
    assert API.get(BASE + "/health", timeout=30).status_code == 200


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_native_generate_speculates(server):
    words = " ".join(f"word{i}" for i in range(60))  # long enough to fill every slot of the stable checkpoint
    body = {"text": words, "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
    r = API.post(BASE + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] and out["meta_info"]["completion_tokens"] == 64
    # the drafter agrees with the stable checkpoint's target: real verification accepts several tokens a cycle
    assert out["meta_info"]["spec_accept_length"] > (1.0 if all(REAL) else 2.0)
    assert out["meta_info"]["spec_verify_ct"] < 64


def test_native_generate_from_token_ids_is_greedy_deterministic(server):
    body = {"input_ids": list(range(1000, 1100)), "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
    first, second = (API.post(BASE + "/generate", json=body, timeout=120).json() for _ in range(2))
    assert first["output_ids"] == second["output_ids"] and len(first["output_ids"]) == 32
    assert len(set(first["output_ids"])) > 1  # not one token repeated (SGLang's dummy weights did that)


def test_openai_chat(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=16, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.content
    assert resp.usage.completion_tokens <= 16 and resp.usage.prompt_tokens > 0


def test_openai_chat_stream(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}],
                                            max_tokens=24, temperature=0, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_openai_completions(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert resp.choices[0].text and resp.choices[0].finish_reason in ("length", "stop")


def test_sglang_frontend_program(server):
    import sglang as sgl

    @sgl.function
    def answer(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=16, temperature=0)

    state = answer.run(question="What is 2 + 2?", backend=sgl.RuntimeEndpoint(BASE, api_key=SERVED_KEY))
    assert state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] <= 16


def test_eight_concurrent_requests_all_complete(server):
    def one(i):
        body = {"input_ids": list(range(1000 + i, 1064 + 101 * i)), "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
        return API.post(BASE + "/generate", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r.status_code for r in results] == [200] * 8
    assert [r.json()["meta_info"]["completion_tokens"] for r in results] == [48] * 8


GENERATE, CHAT, COMPLETIONS = BASE + "/generate", BASE + "/v1/chat/completions", BASE + "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
VOCAB = 248320
RAW = "raw"  # the body is sent as these bytes


def native(**params) -> dict:
    return {"text": "hi", "sampling_params": params}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MSG, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", **fields}


# Every bad input of the issue through the native API and both OpenAI endpoints: each must be a 4xx with a
# message, and the server must go on serving.
BAD = {
    "malformed JSON, native": (GENERATE, b'{"text": "hi", "sampling_params": {', RAW),
    "malformed JSON, chat": (CHAT, b'{"model": "Qwen3.5-4B", "messages": [', RAW),
    "malformed JSON, completions": (COMPLETIONS, b'{"model": "Qwen3.5-4B", "prompt": "hi"', RAW),
    "non-UTF-8 bytes, native": (GENERATE, b'{"text": "caf\xe9 \xff\xfe"}', RAW),
    "non-UTF-8 bytes, chat": (CHAT, b'{"model": "Qwen3.5-4B", "messages": [{"role": "user", "content": "\xc3\x28"}]}', RAW),
    "non-UTF-8 bytes, completions": (COMPLETIONS, b'{"model": "Qwen3.5-4B", "prompt": "\x80abc"}', RAW),
    "body not an object, native": (GENERATE, [1, 2], None),
    "body not an object, chat": (CHAT, [1, 2], None),
    "body not an object, completions": (COMPLETIONS, "hi", None),
    "wrong type: text, native": (GENERATE, {"text": 5}, None),
    "wrong type: max_new_tokens, native": (GENERATE, native(max_new_tokens="ten"), None),
    "wrong type: unknown sampling parameter, native": (GENERATE, native(bogus=1), None),
    "wrong type: messages, chat": (CHAT, chat(messages="hi"), None),
    "wrong type: response_format, chat": (CHAT, chat(response_format="json"), None),
    "wrong type: prompt, completions": (COMPLETIONS, completion(prompt=5), None),
    "token id outside the vocabulary, native": (GENERATE, {"input_ids": [1000, VOCAB], "sampling_params": {"max_new_tokens": 4}}, None),
    "negative token id, native": (GENERATE, {"input_ids": [-1, 1000], "sampling_params": {"max_new_tokens": 4}}, None),
    "unknown model, chat": (CHAT, chat(model="gpt-17"), None),
    "unknown model, completions": (COMPLETIONS, completion(model="gpt-17"), None),
    "empty prompt, native": (GENERATE, {"text": "", "sampling_params": {"max_new_tokens": 4}}, None),
    "empty messages, chat": (CHAT, chat(messages=[]), None),
    "empty prompt, completions": (COMPLETIONS, completion(prompt=""), None),
    "max_new_tokens -1, native": (GENERATE, native(max_new_tokens=-1), None),
    "max_tokens -1, chat": (CHAT, chat(max_tokens=-1), None),
    "max_tokens -1, completions": (COMPLETIONS, completion(max_tokens=-1), None),
    "max_tokens 0, chat": (CHAT, chat(max_tokens=0), None),
    "max_completion_tokens 0, chat": (CHAT, chat(max_completion_tokens=0), None),
    "max_tokens 0, completions": (COMPLETIONS, completion(max_tokens=0), None),
    "max_new_tokens over the context, native": (GENERATE, native(max_new_tokens=10**9), None),
    "max_tokens over the context, chat": (CHAT, chat(max_tokens=10**9), None),
    "max_tokens over the context, completions": (COMPLETIONS, completion(max_tokens=CONTEXT), None),
    "prompt over the context, native": (GENERATE, {"input_ids": [1000] * (CONTEXT + 100), "sampling_params": {"max_new_tokens": 8}}, None),
    "prompt over the context, chat": (CHAT, chat(messages=[{"role": "user", "content": "hello " * CONTEXT}], max_tokens=8), None),
    "prompt over the context, completions": (COMPLETIONS, completion(prompt="hello " * CONTEXT, max_tokens=8), None),
    "n 0, native": (GENERATE, native(n=0), None),
    "n not an integer, native": (GENERATE, native(n="two"), None),
    "n 0, chat": (CHAT, chat(n=0, max_tokens=4), None),
    "n -1, completions": (COMPLETIONS, completion(n=-1, max_tokens=4), None),
    "temperature -1, native": (GENERATE, native(temperature=-1), None),
    "temperature not a number, native": (GENERATE, native(temperature="hot"), None),
    "temperature -1, chat": (CHAT, chat(temperature=-1), None),
    "temperature not a number, chat": (CHAT, chat(temperature="hot"), None),
    "temperature -1, completions": (COMPLETIONS, completion(temperature=-0.5), None),
    "n over the limit, native": (GENERATE, native(n=17), None),
    "n over the limit, chat": (CHAT, chat(n=17, max_tokens=4), None),
    "top_logprobs over the limit, chat": (CHAT, chat(logprobs=True, top_logprobs=21, max_tokens=4), None),
    "top_logprobs_num 10**9, native": (GENERATE, {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**9}, None),
    "logprobs 10**6, completions": (COMPLETIONS, completion(logprobs=10**6, max_tokens=4), None),
    "body over the limit, native": (GENERATE, b'{"text": "' + b"x" * (33 << 20) + b'"}', RAW),
}
# The limits' own messages (each names its limit).
LIMIT_MESSAGES = {"n over the limit": "at most 16", "top_logprobs": "from 0 to 20", "logprobs 10**6": "from 0 to 20",
                  "body over the limit": "larger than"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_readable_4xx_and_the_server_keeps_serving(server, case):
    url, body, kind = BAD[case]
    if kind == RAW:
        r = API.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=120)
    else:
        r = API.post(url, json=body, timeout=120)
    assert 400 <= r.status_code < 500, f"{case}: {r.status_code} {r.text[:500]}"
    error = r.json()
    message = error.get("message") or error.get("error", {}).get("message") or error.get("detail")
    assert message, f"{case}: no message in {error}"
    print(f"\n{case}: {r.status_code} {str(message)[:160]}")
    assert 'File "' not in str(message), "a server file path in the message"
    expected = next((m for prefix, m in LIMIT_MESSAGES.items() if case.startswith(prefix)), None)
    assert expected is None or expected in str(message), message
    assert_still_serving()


def test_the_api_key_is_required_everywhere_but_health(server):
    assert requests.get(BASE + "/health", timeout=30).status_code == 200  # liveness probes carry no key
    for method, url, body in (("post", GENERATE, native(max_new_tokens=2)), ("post", CHAT, chat(max_tokens=2)),
                              ("get", BASE + "/v1/models", None), ("post", BASE + "/flush_cache", None)):
        assert getattr(requests, method)(url, json=body, timeout=60).status_code == 401, url
        wrong = {"Authorization": "Bearer wrong"}
        assert getattr(requests, method)(url, json=body, headers=wrong, timeout=60).status_code == 401, url
        assert getattr(API, method)(url, json=body, timeout=120).status_code == 200, url


def test_the_log_says_how_many_hooks_each_process_applied(server):
    from conftest import served_log

    from qflash.server.plugin import QFLASH

    lines = [line for line in served_log().splitlines() if " hooks applied on sglang 0.5.17" in line]
    print("\n" + "\n".join(lines))
    count = len({change.target for change in QFLASH})  # every change once: the server runs without the cycle meter
    assert len(lines) >= 2 and all(line.split("qflash: ")[1].startswith(f"{count} hooks applied") for line in lines)


def test_every_layers_norms_activation_and_gate_hand_int8_rows_to_the_projections(server):
    from conftest import served_log

    from qflash.server.models.qwen3_5_text import HANDOFF_LOG
    from qflash.server.preset import DRAFTER_CONFIG, TEXT_CONFIG

    # Every layer's two norms and activation, each Gated-DeltaNet layer's output norm, each attention layer's output
    # gate; the drafter's two norms and activation (its QKV projects on its int8 copy).
    gdn_layers = TEXT_CONFIG["layer_types"].count("linear_attention")
    attention_layers = TEXT_CONFIG["layer_types"].count("full_attention")
    target = 3 * TEXT_CONFIG["num_hidden_layers"] + gdn_layers + attention_layers
    expected = [HANDOFF_LOG.format(model="target", count=target),
                HANDOFF_LOG.format(model="drafter", count=3 * DRAFTER_CONFIG["num_hidden_layers"])]
    found = [line for line in served_log().splitlines() if "int8 rows" in line]
    assert all(any(line in log for log in found) for line in expected), found
