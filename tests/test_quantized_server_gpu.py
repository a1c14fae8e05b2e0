"""A `qflash quantize` checkpoint served through `./launch.sh`, and speculation's greedy losslessness (GPU only).

The checkpoint is the real path offline: `make-dummy --weights` (random bf16 weights of the published names)
then `qflash quantize`. Losslessness: every token the DFLASH server emits must be the target's own greedy
token at that position, checked by one teacher-forced forward of prompt + output on a server of the same
checkpoint without speculation; a position whose top-2 log-probabilities are within 1e-3 is a tie.
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


@pytest.fixture(scope="module")
def checkpoint() -> tuple[Path, Path]:
    """(quantized target, bf16 drafter config), built once in the cache folder."""
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


def test_speculation_is_greedy_lossless(checkpoint, speculative_outputs, tmp_path):
    target, _ = checkpoint
    flags = DFLASH_FLAGS[DFLASH_FLAGS.index("--attention-backend"):]  # the preset, minus speculation
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), *QFLASH_W8A8_FLAGS[:2], *flags,
            "--port", str(PORT + 1), "--disable-cuda-graph"]
    server = ServerProcess(argv, plugin_env("qflash"), tmp_path / "teacher.log", f"http://127.0.0.1:{PORT + 1}").start()
    mismatches, ties, checked = [], 0, 0
    try:
        server.wait_ready()
        for prompt, out in zip(prompts(), speculative_outputs):
            seq, start = prompt + out["output_ids"], len(prompt) - 1
            teacher = generate(server.base_url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                                 "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2})
            meta = teacher["meta_info"]
            assert [t[1] for t in meta["input_token_logprobs"]] == seq[start:]  # entry j scores seq[start + j]
            for k, token in enumerate(out["output_ids"]):
                (lp1, id1, _), (lp2, id2, _) = meta["input_top_logprobs"][k + 1][:2]
                checked += 1
                if token == id1:
                    continue
                if token == id2 and lp1 - lp2 <= TIE:
                    ties += 1
                    continue
                mismatches.append((len(prompt), k, token, id1, round(lp1 - lp2, 5)))
    finally:
        server.stop()
    print(f"\nlosslessness: {checked} tokens checked, {ties} ties, {len(mismatches)} mismatches {mismatches[:10]}")
    assert not mismatches
