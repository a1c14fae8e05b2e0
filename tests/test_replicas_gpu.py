"""`./launch.sh --replicas 2 --share-gpus` on one GPU: two qflash servers behind SGLang's router (GPU and the scale
extra only). Requests reach both; a conversation's later turns come from the cache of the replica that holds it; a
replica killed under load leaves every request answered or failed with a message, and the other serving."""

import concurrent.futures
import importlib.util
import os
import random
import signal
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import launched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="needs the scale extra")]

PORT, KEY = 30100, "k3y"  # the router; the replicas listen on PORT + 1 and PORT + 2
ROUTER = f"http://127.0.0.1:{PORT}"
API = requests.Session()
API.headers["Authorization"] = f"Bearer {KEY}"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicas")
    with launched("--replicas", "2", "--share-gpus", "--port", str(PORT), "--api-key", KEY, "--log",
                  str(folder / "server.log"), log=folder / "launch.out", ready="replicas ready behind"):
        yield folder / "launch.out"


def prompt(length: int, seed: str) -> list[int]:
    rng = random.Random(f"replicas-{seed}")
    return [rng.randrange(1000, 200000) for _ in range(length)]


def generate(url: str, ids: list[int], new: int, timeout: float = 300) -> requests.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    return API.post(url + "/generate", json=body, timeout=timeout)


def cached(url: str, ids: list[int]) -> int:
    r = generate(url, ids, 1)
    assert r.status_code == 200, r.text[:500]
    return r.json()["meta_info"]["cached_tokens"]


def test_both_replicas_receive_requests(router):
    """Prompts that share nothing, sent through the router at once, go to the replica with fewer in flight (one at a
    time, all would go to the first idle one); then each prompt is asked of each replica directly: the one that
    served it answers from its cache."""
    prompts = [prompt(600, f"spread-{i}") for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        for r in pool.map(lambda ids: generate(ROUTER, ids, 64), prompts):
            assert r.status_code == 200, r.text[:500]
    holders = [[cached(f"http://127.0.0.1:{PORT + 1 + i}", ids) > 0 for i in (0, 1)] for ids in prompts]
    print(f"\nreplicas holding each prompt: {holders}")
    assert all(sum(h) == 1 for h in holders) and {h.index(True) for h in holders} == {0, 1}


def test_a_conversation_s_later_turns_come_from_the_cache(router):
    ids, got = prompt(700, "conversation"), []
    for turn in range(4):
        r = generate(ROUTER, ids, 32)
        assert r.status_code == 200, r.text[:500]
        body = r.json()
        got.append(body["meta_info"]["cached_tokens"])
        ids = ids + body["output_ids"] + prompt(100, f"user-{turn}")
    print(f"\ncached tokens per turn: {got}")
    assert got[0] == 0 and all(c >= 512 for c in got[1:])  # the radix cache checkpoints every 256 tokens


def replica_pid(port: int) -> int:
    """The pid (and process group) of the replica serving on `port`: its `sglang.launch_server`."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sglang.launch_server" in argv and str(port).encode() in argv:
            return int(entry.name)
    raise AssertionError(f"no replica on port {port}")


def test_a_replica_killed_under_load_leaves_every_request_settled_and_the_other_serving(router):
    def send(i: int):
        try:
            r = generate(ROUTER, prompt(600, f"load-{i}"), 256, timeout=240)
            return r.status_code, r.text[:200]
        except requests.Timeout:
            return "hung", ""
        except requests.RequestException as exc:  # a dropped connection is a failure with a message too
            return "error", str(exc)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(send, i) for i in range(16)]
        time.sleep(3)
        os.killpg(replica_pid(PORT + 2), signal.SIGKILL)
        results = [f.result() for f in futures]
    codes = [code for code, _ in results]
    print(f"\nunder load, replica 1 killed: {codes}")
    assert "hung" not in codes
    assert all(code == 200 or text for code, text in results)  # every failure says something
    assert codes.count(200) >= 8  # the live replica's requests at least
    after = [generate(ROUTER, prompt(300, f"after-{i}"), 16, timeout=120).status_code for i in range(4)]
    print(f"afterwards: {after}")
    assert after == [200] * 4
    deadline = time.monotonic() + 30
    while "the router serves on with 1" not in router.read_text():
        assert time.monotonic() < deadline, router.read_text()[-2000:]
        time.sleep(1)
