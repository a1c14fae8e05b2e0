"""`qflash serve --replicas N`: where N qflash servers go and the router in front of them (the launcher starts them).

Each replica is the one-GPU server `qflash serve` starts (preset, plugin, prefix caching, warm-up), listening on
127.0.0.1 at the ports after the router's; the router (`sglang-router`, the `scale` extra: a Rust load balancer)
listens where the single server would and routes cache-aware, so a conversation's turns reach the replica whose
radix cache holds its prefix. It checks its workers' health and stops routing to one that dies; the launcher keeps
serving while the router and one replica live. With an API key the router asks clients for it and passes it on.
"""

import importlib.util
import math
import sys
from dataclasses import dataclass

from qflash.server.errors import UserError
from qflash.server.preset import MEM_FRACTION_STATIC

# The router's flags: cache-aware routing; a replica's circuit opens after 2 failed calls (the default 10 lets a dead
# replica fail two clients' requests before the router's retries move on; with 2, a retry already reaches a live
# one), and health is checked every 10 s (default 60).
ROUTER_FLAGS = ["--policy", "cache_aware", "--cb-failure-threshold", "2", "--health-check-interval-secs", "10"]


@dataclass(frozen=True)
class Replica:
    index: int
    device: str  # its CUDA_VISIBLE_DEVICES: one of the GPUs this process sees
    port: int
    wave: int  # its place on its GPU: the replicas of wave w start once those of wave w - 1 are ready
    mem_fraction: float  # its --mem-fraction-static: of the memory its GPU has free when it starts


def visible_gpus(environ: dict[str, str], device_count) -> list[str]:
    """The GPUs a child may be given, as CUDA_VISIBLE_DEVICES entries: this process's own list when it has one,
    else every device CUDA counts (`device_count()`)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in listed.split(",") if d.strip()] if listed is not None else [str(i) for i in range(device_count())]


def plan(replicas: int, gpus: list[str], share_gpus: bool, router_port: int) -> list[Replica]:
    """One replica per GPU; with `share_gpus`, round-robin over the GPUs, each GPU's memory split evenly.

    SGLang takes a server's static memory as a fraction of what the GPU has free when the server starts, so replicas
    sharing a GPU start one after another (in waves) and a later one asks for a larger fraction of what the earlier
    ones left: each ends up with MEM_FRACTION_STATIC / sharing of the whole. Started together, the first to size its
    KV cache would take the share of both."""
    if replicas < 1:
        raise UserError(f"--replicas {replicas}: give 1 or more")
    if not gpus:
        raise UserError(f"--replicas {replicas}: no GPU is visible to place them on", code=1)
    if replicas > len(gpus) and not share_gpus:
        raise UserError(f"--replicas {replicas} needs {replicas} GPUs, {len(gpus)} visible: add --share-gpus to run "
                        "several on one GPU (its memory split between them), or ask for fewer")
    share = MEM_FRACTION_STATIC / math.ceil(replicas / len(gpus))
    waves = [i // len(gpus) for i in range(replicas)]
    return [Replica(i, gpus[i % len(gpus)], router_port + 1 + i, wave, round(share / (1 - wave * share), 3))
            for i, wave in enumerate(waves)]


def router_argv(worker_urls: list[str], host: str, port: int, api_key: str | None) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, *ROUTER_FLAGS, *(["--api-key", api_key] if api_key else [])]


def require_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise UserError("--replicas needs SGLang's router in this Python: pip install -e '.[scale]'", code=1)
