"""What `qflash bench` and `qflash profile` run: the protocol's requests and the systems, each an SGLang server on
the dummy model started, made ready and stopped (protocol: shared/reference/benchmark-protocol.md)."""

import argparse
import contextlib
import os
import random
import time
from pathlib import Path

from tqdm import tqdm

from qflash.server.launcher import (ServerProcess, dummy_model_dirs, plugin_env, sglang_argv, unwind_on_sigterm,
                                    warm_up_and_freeze_gc)
from qflash.server.preset import PREFIX_CACHE

OUTPUT_LEN = 256
TOKEN_RANGE = (1000, 200000)
ACCEPT_LEN = 6.5

# system -> (SGLang flags beyond the shared DFlash preset, qflash plugins it loads); baseline is HF.
# Stock rows run as the protocol measured them, without prefix caching (launcher.sglang_argv's `stock`);
# qflash runs as `./launch.sh` serves by default. The bench's prompts never share a prefix anyway.
SGLANG_SYSTEMS = {
    "sglang-bf16": ([], "qflash_text_only"),
    "sglang-w8a8": (["--quantization", "w8a8_int8", "--speculative-draft-model-quantization", "unquant"],
                    "qflash_text_only"),
    "qflash": ([], "qflash"),
}
SYSTEMS = ("baseline", *SGLANG_SYSTEMS)


def make_prompt(bucket: int, index: int) -> list[int]:
    """A reproducible random prompt; each (bucket, index) gets its own, so no prefix is ever reused."""
    rng = random.Random(f"qflash-bench-{bucket}-{index}")
    return [rng.randrange(*TOKEN_RANGE) for _ in range(bucket)]


@contextlib.contextmanager
def system_server(system: str, log: Path, port: int, acc_len: float, env: dict | None = None, flags: list[str] = (),
                  prefix_cache: bool = PREFIX_CACHE):
    """One SGLang system of the scoreboard on the dummy model (plus extra SGLang `flags`), started, ready, and
    stopped on exit; `prefix_cache` applies to qflash (stock systems run without, as the protocol has them)."""
    extra, plugins = SGLANG_SYSTEMS[system]
    target, drafter = dummy_model_dirs(quantized=system == "qflash")
    server = ServerProcess(
        sglang_argv(target, drafter, [*extra, *flags], port=port, stock=system != "qflash", prefix_cache=prefix_cache),
        plugin_env(plugins, {"SGLANG_SIMULATE_ACC_LEN": str(acc_len), **(env or {})}), log, f"http://127.0.0.1:{port}",
    )
    unwind_on_sigterm()  # a bench stopped by `timeout` stops its server too
    try:
        server.start()
        took = server.wait_ready()
        if system == "qflash":
            warm_up_and_freeze_gc(server)  # what `qflash serve` does once ready
        tqdm.write(f"{system}: ready in {took:.0f} s")
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def replicas_server(count: int, share_gpus: bool, log_dir: Path, port: int, acc_len: float, flags: list[str] = (),
                    prefix_cache: bool = PREFIX_CACHE):
    """qflash as `qflash serve --replicas count` serves it on the dummy model (server/replicas.py): the router's
    server once every replica is warm; every process stopped on exit."""
    from qflash.server import replicas
    from qflash.server.launcher import gpu_count, replica_group, start_replicas

    plan = replicas.plan(count, replicas.visible_gpus(os.environ, gpu_count), share_gpus, port)
    workers, router = replica_group(plan, *dummy_model_dirs(), list(flags),
                                    plugin_env("qflash", {"SGLANG_SIMULATE_ACC_LEN": str(acc_len)}), log_dir,
                                    "127.0.0.1", port, prefix_cache=prefix_cache)
    unwind_on_sigterm()
    try:
        start = time.monotonic()
        start_replicas(plan, workers, router, say=tqdm.write)
        tqdm.write(f"qflash x{count}: ready in {time.monotonic() - start:.0f} s")
        yield router
    finally:
        for server in (router, *workers):
            server.stop()


def csv(kind, choices=None):
    def parse(text: str):
        items = [kind(x) for x in text.split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices))}" if bad else "empty list")
        return items
    return parse


def positive_csv(text: str) -> list[int]:
    items = csv(int)(text)
    if any(x <= 0 for x in items):
        raise argparse.ArgumentTypeError(f"{text!r}: bucket sizes must be positive")
    return items


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """What `qflash bench` and `qflash profile` share: simulated acceptance, qflash's prefix cache."""
    p.add_argument("--acc-len", type=float, default=ACCEPT_LEN,
                   help=f"SGLANG_SIMULATE_ACC_LEN for the speculative systems (default {ACCEPT_LEN})")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=PREFIX_CACHE,
                   help="qflash's prefix caching, as `qflash serve` has it (default: on); stock systems never have it")
