"""Nothing compiles after ready: a mixed workload on the shared `./launch.sh` server compiles no Triton kernel
(server/hooks/compile_watch.py logs each compile while serving). GPU machine only: `pytest -m gpu`."""

import concurrent.futures

import pytest
import torch

from conftest import API, SERVED as BASE, served_log
from qflash.server.tools import workloads
from qflash.server.warm_up import prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
WHILE_SERVING = "while serving ("


def generate(ids: list[int], tokens: int = 32, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, **extra}
    r = API.post(BASE + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def mixed_workload() -> None:
    """What users send after ready: batched fresh prefills of mixed lengths, every batch size of decoding (1-8),
    `qflash bench`'s concurrency sweep (2, 4 and 16 in flight, 64-8,192 tokens, 256 out: requests join batches
    already decoding, some queue, every batch decodes for whole windows), turns that extend a cached prefix by
    different lengths, a stream, logprobs, a regex; other lengths and prompts than the warm-up's
    (server/warm_up.py), so that it must have reached the variants, not these requests."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for width in range(1, 9):
            list(pool.map(lambda i: generate(prompt(64 + 301 * i, 1000 + 100 * width + i)), range(width)))
    workloads.run_concurrency(lambda ids: {"output_ids": generate(ids, 256)["output_ids"]}, levels=(2, 4, 16))
    history = prompt(2048, 5000)
    for turn in range(4):  # a conversation: each turn's prompt is the last one plus its answer and a new message
        answer = generate(history, 48)
        assert turn == 0 or answer["meta_info"]["cached_tokens"] > 0
        history = history + answer["output_ids"] + prompt(17 + 150 * turn, 5050 + turn)
    r = API.post(BASE + "/generate", json={"input_ids": prompt(500, 6000), "stream": True,
                                          "sampling_params": {"max_new_tokens": 40, "temperature": 0}}, timeout=600, stream=True)
    assert r.status_code == 200 and sum(1 for line in r.iter_lines() if line.startswith(b"data:")) > 1
    generate(prompt(300, 6001), 24, return_logprob=True, top_logprobs_num=3)
    API.post(BASE + "/generate", json={"text": "Answer:", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                           "regex": "[0-9]{1,6}"}}, timeout=600).raise_for_status()


def test_a_mixed_workload_compiles_no_triton_kernel_after_ready(served):
    before = served_log().splitlines()
    startup = [line for line in before if "compiled during start-up and warm-up" in line]
    print("\n" + "\n".join(startup))
    assert startup, "the scheduler did not say what it compiled during start-up"
    mixed_workload()
    compiled = [line for line in served_log().splitlines()[len(before):] if WHILE_SERVING in line]
    print("\n".join(compiled))
    assert not compiled, f"{len(compiled)} Triton compiles while serving, e.g. {compiled[0]}"
