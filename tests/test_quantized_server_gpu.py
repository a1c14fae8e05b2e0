"""Speculation is lossless, on a checkpoint that can show it (GPU only).

The shared `./launch.sh` server (conftest.served: DFLASH, real verification, prefix caching on) serves the
stable-choice checkpoint: `make-dummy --stable` writes bf16 weights of the published names whose greedy choices
depend on the context by wide margins (server/stable_weights.py), and their `qflash quantize` output is served,
the real path offline. QFLASH_CHECKPOINT and QFLASH_DRAFTER name real ones instead. Then one server of the same
checkpoint without speculation gives plain greedy decoding and a teacher-forced forward. Checked:
- speculative = the shared server's own teacher-forced argmax over prompt + output, at every position: the
  losslessness verdict in one server start (its prefill runs none of the cycle's draft, verify, accept or commit);
- speculative = plain greedy (the second server), token for token, over 16 prompts x 256 tokens, with mean
  acceptance > 2;
- 8 requests at once = each alone;
- plain = teacher-forced argmax, and fp32 / bf16 transformers choose the same, by the margins reported;
- each check catches its fault: a fault named while the shared server runs (tests/fault_control.py) must make
  its check fail.
"""

import concurrent.futures
import random
import sys

import pytest
import requests
import torch

from conftest import API, REAL, SERVED as BASE, served_model, stable_checkpoint, stop_served
from fault_control import injected
from qflash.server.dummy import TARGET_DIR
from qflash.server.launcher import ServerProcess, plugin_env
from qflash.server.preset import DFLASH_FLAGS, QFLASH_W8A8_FLAGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PORT = 30021
PROMPTS, NEW_TOKENS = 16, 256
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def prompts(count=PROMPTS, seed=0) -> list[list[int]]:
    """Token ids below the special tokens, long enough (>= 40) that every slot of the stable checkpoint is filled."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 200000) for _ in range(rng.randrange(40, 400))] for _ in range(count)]


def generate(base: str, ids: list[int], session=API) -> dict:
    r = session.post(base + "/generate", json={"input_ids": ids, "sampling_params": PARAMS}, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    return r.json()


def flush() -> None:
    assert API.post(BASE + "/flush_cache", timeout=60).status_code == 200


@pytest.fixture(scope="module")
def speculative(served) -> list[dict]:
    flush()
    return [generate(BASE, p) for p in prompts()]


def accept(outputs) -> float:
    return sum(o["meta_info"]["spec_accept_length"] for o in outputs) / len(outputs)


def test_real_verification_accepts_more_than_two_tokens_per_cycle(speculative):
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in speculative)
    print(f"\nDFLASH accept length over {PROMPTS} prompts: mean {accept(speculative):.2f}, "
          f"min {min(o['meta_info']['spec_accept_length'] for o in speculative):.2f}")
    assert accept(speculative) > 2


def test_eight_concurrent_requests_equal_each_alone(speculative):
    """Batched verify, draft and GDN commit against the same requests alone (the server runs 8 at a time)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(BASE, p)["output_ids"], prompts()[:8]))
    assert together == [o["output_ids"] for o in speculative[:8]]


def prompt_forward(base: str, prompt: list[int], output: list[int], top: int, session=API) -> tuple[list, list]:
    """(token logprob, the `top` best logprobs) at each output position, from one forward over prompt + output: a
    prefill, which runs none of the speculative cycle."""
    body = {"input_ids": prompt + output, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": top, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = session.post(base + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    meta = r.json()["meta_info"]
    return meta["input_token_logprobs"][1:len(output) + 1], meta["input_top_logprobs"][1:len(output) + 1]


def teacher_forced(base: str, prompt: list[int], output: list[int], session=API) -> list[tuple[int, float]]:
    """(greedy token, top-1 minus top-2 log-probability) at each output position of a prompt-only forward."""
    return [(t[0][1], t[0][0] - t[1][0]) for t in prompt_forward(base, prompt, output, 2, session)[1]]


def disagreements(outputs: list[dict]) -> tuple[list[tuple[int, int]], list[float]]:
    """(prompt, position) where an output is not the shared server's teacher-forced argmax, and the margins."""
    flush()  # the teacher's forward starts from the prompt's first token, not from a cached prefix
    mismatches, margins = [], []
    for i, (prompt, out) in enumerate(zip(prompts(), outputs)):
        for k, ((token, margin), emitted) in enumerate(zip(teacher_forced(BASE, prompt, out["output_ids"]),
                                                           out["output_ids"])):
            mismatches += [(i, k)] if token != emitted else []
            margins.append(margin)
    return mismatches, margins


def test_speculation_is_the_teacher_forced_argmax(speculative):
    mismatches, margins = disagreements(speculative)
    print(f"\nlosslessness (one server): {PROMPTS} prompts x {NEW_TOKENS} tokens, speculative vs teacher-forced "
          f"argmax: {len(mismatches)} mismatches {mismatches[:8]}; margin min {min(margins):.1f}")
    assert not mismatches
    assert min(margins) > 10  # far above any prefill-versus-cycle rounding: the check cannot flip on a near tie


def with_fault(fault: str, fault_file) -> list[dict]:
    flush()
    with injected(fault_file, fault):
        out = [generate(BASE, p) for p in prompts()[:4]]
    flush()
    return out


@pytest.mark.parametrize("fault", ["accept_off_by_one", "gdn_state_wrong_step"])
def test_losslessness_check_catches(fault, fault_file, speculative):
    faulty = with_fault(fault, fault_file)
    assert [o["output_ids"] for o in faulty] != [o["output_ids"] for o in speculative[:4]]
    assert disagreements(faulty)[0]


def test_acceptance_check_catches_shifted_drafter_kv(fault_file, speculative):
    faulty = with_fault("drafter_kv_shift", fault_file)
    print(f"\ndrafter KV shifted by one: accept length {accept(faulty):.2f} against {accept(speculative[:4]):.2f}")
    assert [o["output_ids"] for o in faulty] == [o["output_ids"] for o in speculative[:4]]  # verification holds
    assert accept(faulty) < accept(speculative[:4]) / 2


@pytest.fixture(scope="module")
def plain(speculative, tmp_path_factory) -> dict:
    """Plain greedy decoding and teacher-forced choices on a server of the same checkpoint without speculation
    (the preset minus DFLASH; SGLang's chunked GDN prefill for the teacher, not qflash's short-prompt one)."""
    stop_served()
    target, _ = served_model()
    flags = DFLASH_FLAGS[DFLASH_FLAGS.index("--attention-backend"):]
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), *QFLASH_W8A8_FLAGS[:2], *flags,
            "--port", str(PORT), "--disable-cuda-graph", "--disable-radix-cache"]
    server = ServerProcess(argv, plugin_env("qflash", {"QFLASH_GDN_PREFILL_MAX_TOKENS": "0"}),
                           tmp_path_factory.mktemp("plain") / "plain.log", f"http://127.0.0.1:{PORT}").start()
    try:
        server.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # one at a time, eager decoding takes minutes
            decoded = list(pool.map(lambda p: generate(server.base_url, p, requests)["output_ids"], prompts()))
        teacher = [teacher_forced(server.base_url, p, o, requests) for p, o in zip(prompts(), decoded)]
    finally:
        server.stop()
    return {"decoded": decoded, "teacher": teacher}


def test_speculation_is_greedy_lossless(speculative, plain):
    mismatches = [(i, k) for i, (s, p) in enumerate(zip(speculative, plain["decoded"]))
                  for k, (a, b) in enumerate(zip(s["output_ids"], p)) if a != b]
    print(f"\nlosslessness: {PROMPTS} prompts x {NEW_TOKENS} tokens, speculative vs plain greedy: {len(mismatches)} "
          f"mismatches {mismatches[:8]}")
    assert not mismatches


def test_plain_decoding_agrees_with_the_teacher_by_wide_margins(plain):
    margins = sorted(m for row in plain["teacher"] for _, m in row)
    agree = sum(t == o for row, out in zip(plain["teacher"], plain["decoded"]) for (t, _), o in zip(row, out))
    q = [margins[int(f * (len(margins) - 1))] for f in (0, 0.01, 0.5, 0.99)]
    print(f"\nstable checkpoint, W8A8 server: decode = teacher at {agree}/{len(margins)} positions; top-1 minus top-2 "
          f"log-probability min {q[0]:.1f}, p1 {q[1]:.1f}, median {q[2]:.1f}, p99 {q[3]:.1f}")
    assert agree == len(margins)
    assert q[0] > 10


@pytest.mark.skipif(all(REAL), reason="compares with the stable checkpoint's bf16 weights")
def test_fp32_bf16_and_w8a8_choose_alike(plain):
    """The margins hold in every arithmetic: transformers' Qwen3.5 in fp32 and bf16 on the bf16 checkpoint
    choose, at every position, what the W8A8 server decoded."""
    from qflash.quant.reference import load_bf16

    model = load_bf16(stable_checkpoint()[0].parent.parent / TARGET_DIR, "cuda")
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        agree, margins = 0, []
        # 4 x 256 positions: the time of a GPU call is short
        for prompt, out in list(zip(prompts(), plain["decoded"]))[:4]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out], device="cuda")).logits[0, len(prompt) - 1:-1].float()
            top = logits.log_softmax(-1).topk(2, dim=-1)
            agree += (top.indices[:, 0].cpu() == torch.tensor(out)).sum().item()
            margins += (top.values[:, 0] - top.values[:, 1]).tolist()
        margins.sort()
        print(f"\n{dtype}: argmax = W8A8 decode at {agree}/{len(margins)} positions; margin min {margins[0]:.1f}, "
              f"median {margins[len(margins) // 2]:.1f}")
        assert agree == len(margins)
    del model
    torch.cuda.empty_cache()
