"""Several speculative cycles per scheduler step decode exactly what one cycle per step decodes (GPU only).

On the shared `./launch.sh` server (conftest.served: the stable-choice checkpoint, real verification, the window
on as served). Its reference is the same server with the window planner held to one cycle per step, switched at
run time through the test plugin (`one_cycle_per_step`), so both sides run the same kernels, graphs and cache:
- 16 prompts x 256 tokens: windowed = one cycle per step, token for token, and the window really ran (fewer
  streamed steps); a window whose later cycles start from a stale bonus token fails that check;
- max_tokens and stop tokens that land inside a window end the output there exactly, as one cycle per step ends it;
- a stream delivers every token once, in order;
- a grammar-constrained request (one cycle per step) obeys its grammar beside an unconstrained one;
- the overlap plan stream (qflash's default) changes no token.
"""

import concurrent.futures
import re

import pytest
import torch

from conftest import API, SERVED as BASE, SERVED_KEY
from fault_control import injected
from test_quantized_server_gpu import NEW_TOKENS, generate, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def windowed(served) -> list[dict]:
    return [generate(BASE, p) for p in prompts()]


def one_cycle_per_step(fault_file, run):
    with injected(fault_file, "one_cycle_per_step"):
        return run()


def streamed(ids: list[int], **params) -> list[str]:
    """The text deltas of an OpenAI completions stream over token ids."""
    from openai import OpenAI

    client = OpenAI(base_url=BASE + "/v1", api_key=SERVED_KEY)
    stream = client.completions.create(model="Qwen3.5-4B", prompt=ids, stream=True, temperature=0,
                                       max_tokens=params.pop("max_tokens", NEW_TOKENS), **params)
    return [c.choices[0].text for c in stream if c.choices and c.choices[0].text]


def test_a_window_decodes_what_one_cycle_per_step_decodes(windowed, fault_file):
    single = one_cycle_per_step(fault_file, lambda: [generate(BASE, p) for p in prompts()])
    mismatches = [(i, k) for i, (w, s) in enumerate(zip(windowed, single))
                  for k, (a, b) in enumerate(zip(w["output_ids"], s["output_ids"])) if a != b]
    print(f"\nwindow vs one cycle per step: {len(prompts())} prompts x {NEW_TOKENS} tokens, {len(mismatches)} mismatches "
          f"{mismatches[:8]}; accept length {windowed[0]['meta_info']['spec_accept_length']:.2f} against "
          f"{single[0]['meta_info']['spec_accept_length']:.2f}")
    assert all(len(w["output_ids"]) == NEW_TOKENS for w in windowed) and not mismatches
    # one verify counted per cycle: a window's accept length is a cycle's (at most the block, where counting one
    # verify per step would read up to 8 blocks), a little below one cycle per step's: the cycles a request's last
    # window runs past its end count too (at 8 cycles a window and ~14 tokens a cycle, up to a third of 256)
    for w, s in zip(windowed, single):
        accept, reference = w["meta_info"]["spec_accept_length"], s["meta_info"]["spec_accept_length"]
        assert 0.6 * reference <= accept <= min(reference, 16) + 0.01


def test_the_window_really_runs_several_cycles_per_step(fault_file):
    ids = prompts()[0]
    windowed_chunks = streamed(ids)
    single_chunks = one_cycle_per_step(fault_file, lambda: streamed(ids))
    print(f"\nstreamed steps for {NEW_TOKENS} tokens: {len(windowed_chunks)} windowed, {len(single_chunks)} one cycle per step")
    assert "".join(windowed_chunks) == "".join(single_chunks)
    assert len(windowed_chunks) * 2 <= len(single_chunks)


def test_the_window_check_catches_a_stale_bonus_token(windowed, fault_file):
    with injected(fault_file, "window_stale_bonus"):
        faulty = [generate(BASE, p) for p in prompts()[:4]]
    assert [o["output_ids"] for o in faulty] != [o["output_ids"] for o in windowed[:4]]


def ask(ids, **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, **params}}
    r = API.post(BASE + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    return r.json()


@pytest.mark.parametrize("max_new", [1, 5, 17, 40, 61, 250])
def test_max_tokens_ends_the_output_inside_a_window_exactly(windowed, max_new):
    out = ask(prompts()[1], max_new_tokens=max_new, ignore_eos=True)
    assert out["output_ids"] == windowed[1]["output_ids"][:max_new]
    assert out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("position", [3, 37, 100])
def test_a_stop_token_ends_the_output_where_one_cycle_per_step_ends_it(windowed, fault_file, position):
    ref = windowed[2]["output_ids"]
    stop = ref[position]
    first = ref.index(stop)
    params = {"max_new_tokens": NEW_TOKENS, "stop_token_ids": [stop]}
    out = ask(prompts()[2], **params)
    single = one_cycle_per_step(fault_file, lambda: ask(prompts()[2], **params))
    assert out["output_ids"] == single["output_ids"] and out["meta_info"]["finish_reason"] == single["meta_info"]["finish_reason"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert ref[:first] == out["output_ids"][:first] and len(out["output_ids"]) <= first + 1


def test_a_stop_string_ends_the_text_where_one_cycle_per_step_ends_it(windowed, fault_file):
    text = windowed[3]["text"]
    stop = text[len(text) // 3: len(text) // 3 + 3]
    params = {"max_new_tokens": NEW_TOKENS, "stop": [stop]}
    out = ask(prompts()[3], **params)
    single = one_cycle_per_step(fault_file, lambda: ask(prompts()[3], **params))
    assert out["text"] == single["text"] and stop not in out["text"] and text.startswith(out["text"])
    assert len(out["text"]) < len(text)


def test_a_stream_delivers_every_token_once_in_order(windowed):
    chunks = streamed(prompts()[4])
    assert "".join(chunks) == windowed[4]["text"] and len(chunks) > 1


def test_a_grammar_request_obeys_its_grammar_beside_an_unconstrained_one(windowed):
    pattern = "(yes|no), [0-9]{3}"

    def constrained():
        return ask(prompts()[5], max_new_tokens=32, regex=pattern)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        grammar, plain = pool.submit(constrained), pool.submit(generate, BASE, prompts()[6])
        grammar, plain = grammar.result(), plain.result()
    assert re.fullmatch(pattern, grammar["text"]), grammar["text"]
    assert plain["output_ids"] == windowed[6]["output_ids"]


def test_the_plan_stream_changes_no_token(windowed, fault_file):
    with injected(fault_file, "plan_stream_off"):
        without = [generate(BASE, p)["output_ids"] for p in prompts()[:4]]
    assert without == [w["output_ids"] for w in windowed[:4]]
