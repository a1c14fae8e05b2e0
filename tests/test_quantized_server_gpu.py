"""A `qflash quantize` checkpoint served through `./launch.sh`, and speculation's greedy losslessness (GPU only).

The checkpoint is the real path offline: `make-dummy --weights` (random bf16 weights of the published names)
then `qflash quantize`; QFLASH_CHECKPOINT and QFLASH_DRAFTER name real ones instead (a quantized target and
its drafter). Losslessness: every token the DFLASH server emits must be the target's own greedy token at
that position, checked by one teacher-forced forward of prompt + output on a server of the same checkpoint
without speculation; a position whose top-2 log-probabilities are within 1e-3 is a tie. The teacher prefills
on SGLang's own GDN kernels (chunked), not qflash's short-prompt recurrence (kernels/gdn_prefill.py), so
that it is a reference for both servers rather than the code of one of them.

On the random-weight dummy that check cannot hold for any server, speculative or not: a random 32-layer
Qwen3.5 is chaotic (quantizing only layer 0 moves the final hidden states by 33%, `qflash quality`), so
the bf16 differences between SGLang's decode/verify kernels and its prefill kernels flip about half the
greedy tokens, and plain greedy decoding disagrees with the teacher as often as speculation does (H200:
388 vs 408 of 768). There it is an expected failure, and the dummy test checks what can be checked:
speculation adds no disagreement beyond plain decoding's. (When the teacher ran qflash's recurrence, plain
decoding on that server, whose GDN decode is an fp32 recurrence too, disagreed at 157 positions and
speculation at 368: the teacher then computed like one side.)
"""

import os
import random
import sys
from pathlib import Path

import pytest
import requests
import torch

from conftest import launched
from qflash.quant.quantize import quantize_checkpoint
from qflash.server.dummy import DRAFTER_DIR, TARGET_DIR, make_dummy
from qflash.server.launcher import ServerProcess, plugin_env
from qflash.server.preset import DFLASH_FLAGS, QFLASH_W8A8_FLAGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PORT = 30020
BASE = f"http://127.0.0.1:{PORT}"
PROMPTS, NEW_TOKENS, TIE = 16, 48, 1e-3


REAL = os.environ.get("QFLASH_CHECKPOINT"), os.environ.get("QFLASH_DRAFTER")


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Path, Path]:
    """(quantized target, drafter): the real ones if named, else the dummy, built once in the cache folder."""
    if all(REAL):
        return Path(REAL[0]), Path(REAL[1])
    root = Path(os.environ.get("QFLASH_CACHE", "~/.cache/qflash")).expanduser() / "w8a8-test"
    target = root / "w8a8" / TARGET_DIR
    if not (target / "config.json").exists():
        make_dummy(root / "bf16", weights=True)
        quantize_checkpoint(root / "bf16" / TARGET_DIR, target)
    return target, root / "bf16" / DRAFTER_DIR


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 200000) for _ in range(rng.randrange(16, 400))] for _ in range(PROMPTS)]


def generate(base: str, body: dict) -> dict:
    r = requests.post(base + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text[:1000]
    return r.json()


@pytest.fixture(scope="module")
def speculative_outputs(checkpoint, tmp_path_factory) -> list[dict]:
    """Greedy outputs of the DFLASH server (`./launch.sh` with the quantized checkpoint)."""
    target, drafter = checkpoint
    log = tmp_path_factory.mktemp("w8a8") / "launch.out"
    with launched("--model-path", str(target), "--draft-model-path", str(drafter), "--port", str(PORT), log=log):
        server_log = (Path(os.environ.get("QFLASH_CACHE", "~/.cache/qflash")).expanduser() / "logs" / f"server-{PORT}.log").read_text()
        assert "fused W8A16 argmax over the int8 lm_head" in server_log  # the draft pick runs on qflash's kernel
        assert "DFLASH fused KV materialization enabled" in server_log  # the drafter's bf16 qkv_proj allows it
        assert "GDN ReplaySSM ring buffers allocated (record_len=16, fold=True)" in server_log  # the GDN verify's fold
        from openai import OpenAI

        chat = OpenAI(base_url=BASE + "/v1", api_key="none").chat.completions.create(
            model=TARGET_DIR, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
        assert chat.usage.completion_tokens <= 8
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return [generate(BASE, {"input_ids": p, "sampling_params": params}) for p in prompts()]


def test_quantized_checkpoint_serves_with_speculation(speculative_outputs):
    accept = [o["meta_info"]["spec_accept_length"] for o in speculative_outputs]
    assert all(len(o["output_ids"]) == NEW_TOKENS for o in speculative_outputs)
    assert min(accept) >= 1.0
    print(f"\nDFLASH accept length over {PROMPTS} prompts: mean {sum(accept) / len(accept):.2f}, min {min(accept):.2f}")


def teacher_mismatches(base: str, prompt: list[int], output: list[int]) -> tuple[list[tuple], int]:
    """Positions where `output` is not the greedy token of one teacher-forced forward over prompt + output
    (ties within TIE excepted): [(prompt length, k, emitted, teacher top-1, top-1 minus top-2)], ties."""
    seq, start = prompt + output, len(prompt) - 1
    teacher = generate(base, {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                              "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2})
    meta = teacher["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == seq[start:]  # entry j scores seq[start + j]
    mismatches, ties = [], 0
    for k, token in enumerate(output):
        (lp1, id1, _), (lp2, id2, _) = meta["input_top_logprobs"][k + 1][:2]
        if token == id1:
            continue
        if token == id2 and lp1 - lp2 <= TIE:
            ties += 1
        else:
            mismatches.append((len(prompt), k, token, id1, round(lp1 - lp2, 5)))
    return mismatches, ties


@pytest.fixture(scope="module")
def teacher_report(checkpoint, speculative_outputs, tmp_path_factory) -> dict:
    """Teacher-forced mismatches of the speculative outputs and of plain greedy decoding, on one server of
    the same checkpoint without speculation."""
    target, _ = checkpoint
    flags = DFLASH_FLAGS[DFLASH_FLAGS.index("--attention-backend"):]  # the preset, minus speculation
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), *QFLASH_W8A8_FLAGS[:2], *flags,
            "--port", str(PORT + 1), "--disable-cuda-graph"]
    log = tmp_path_factory.mktemp("teacher") / "teacher.log"
    env = plugin_env("qflash", {"QFLASH_GDN_PREFILL_MAX_TOKENS": "0"})  # SGLang's chunked GDN prefill
    server = ServerProcess(argv, env, log, f"http://127.0.0.1:{PORT + 1}").start()
    report = {"spec": [], "ties": 0, "decode": [], "same_as_decode": 0}
    try:
        server.wait_ready()
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        for prompt, out in zip(prompts(), speculative_outputs):
            plain = generate(server.base_url, {"input_ids": prompt, "sampling_params": params})["output_ids"]
            report["same_as_decode"] += plain == out["output_ids"]
            found, ties = teacher_mismatches(server.base_url, prompt, out["output_ids"])
            report["spec"] += found
            report["ties"] += ties
            report["decode"] += teacher_mismatches(server.base_url, prompt, plain)[0]
    finally:
        server.stop()
    print(f"\nlosslessness: {PROMPTS * NEW_TOKENS} tokens, {report['ties']} ties, {len(report['spec'])} mismatches "
          f"{report['spec'][:8]}; {report['same_as_decode']}/{PROMPTS} outputs equal plain greedy decoding, whose own "
          f"mismatches: {len(report['decode'])} {report['decode'][:4]}")
    return report


def test_speculation_adds_no_disagreement_beyond_plain_decoding(teacher_report):
    assert len(teacher_report["spec"]) <= 1.1 * len(teacher_report["decode"]) + 16


@pytest.mark.xfail(not all(REAL), reason="random-weight dummy: plain greedy decoding fails this check as often (see module doc)")
def test_speculation_is_greedy_lossless(teacher_report):
    assert not teacher_report["spec"]
