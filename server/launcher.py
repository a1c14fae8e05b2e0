"""`qflash serve`: start SGLang with the qflash preset, wait until it answers, print its URL.

The server is SGLang's own `sglang.launch_server`, run as a child process; qflash reaches into it only
through its plugin (SGLANG_PLUGINS). `qflash bench` starts the stock systems with the same class.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from qflash.quant.quantize import LM_HEAD_KEY
from qflash.server.dummy import DRAFTER_DIR, TARGET_DIR, W8A8_DIR, is_dummy_dir, make_dummy
from qflash.server.preset import (DFLASH_FLAGS, HOST, PORT, PREFIX_CACHE, PREFIX_CACHE_FLAGS, QFLASH_SERVING_FLAGS,
                                  QFLASH_W8A8_FLAGS)

DEFAULT_CACHE = Path(os.environ.get("QFLASH_CACHE", "~/.cache/qflash")).expanduser()


class ServerDied(RuntimeError):
    pass


def dummy_model_dirs(cache: Path = DEFAULT_CACHE, quantized: bool = True) -> tuple[Path, Path]:
    """The offline dummy target (qflash's W8A8 layout, or the bf16 original) and drafter, built once in the cache."""
    root = cache / "dummy"
    target, drafter = (root / W8A8_DIR if quantized else root) / TARGET_DIR, root / DRAFTER_DIR
    if not (is_dummy_dir(target) and is_dummy_dir(drafter)):
        make_dummy(root)
    return target, drafter


def is_qflash_checkpoint(target: Path) -> bool:
    """True for a target written by `qflash quantize` (its quantization_config describes the int8 lm_head)."""
    config = json.loads((Path(target) / "config.json").read_text())
    return LM_HEAD_KEY in config.get("quantization_config", {})


def sglang_argv(target: Path, drafter: Path, extra: list[str], host: str = HOST, port: int = PORT,
                stock: bool = False, prefix_cache: bool = PREFIX_CACHE) -> list[str]:
    """The `sglang.launch_server` command for a target + DFlash drafter, served under the target folder's
    name (e.g. `Qwen3.5-4B`); a qflash W8A8 target is served by qflash's quantization method, the drafter
    quantized the same way; qflash's serving flags and optional prefix caching unless `stock`; `extra`
    flags come last and win."""
    load = ["--load-format", "dummy"] if is_dummy_dir(target) else []
    quant = QFLASH_W8A8_FLAGS if is_qflash_checkpoint(target) else []
    draft_load = ["--speculative-draft-load-format", "dummy" if is_dummy_dir(drafter) else "auto"]
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(target), "--served-model-name", Path(target).name,
        "--speculative-draft-model-path", str(drafter),
        *load, *draft_load, *quant, *DFLASH_FLAGS, *PREFIX_CACHE_FLAGS[prefix_cache and not stock],
        *([] if stock else QFLASH_SERVING_FLAGS),
        "--host", host, "--port", str(port),
        *extra,
    ]


def plugin_env(plugins: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: this one, with only the named qflash plugins enabled."""
    return {**os.environ, "SGLANG_PLUGINS": plugins, "PYTHONUNBUFFERED": "1", **(extra or {})}


class ServerProcess:
    """One SGLang server as a child process group, with its log in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, base_url: str):
        self.argv, self.env, self.log_path, self.base_url = argv, env, Path(log_path), base_url
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        # A server already answering on the port would pass wait_ready's /health check in this one's place.
        url = urllib.parse.urlsplit(self.base_url)
        with socket.socket() as probe:
            if probe.connect_ex((url.hostname, url.port)) == 0:
                raise ServerDied(f"{url.hostname}:{url.port} is already in use (another server?): stop it or pick another --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Poll /health until it answers 200; return the seconds it took. Raise if the server exits."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise ServerDied(f"server exited with code {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def freeze_gc(base_url: str) -> None:
    """SGLang's `/freeze_gc`, once the server is ready: every object alive after start-up (model, CUDA graphs,
    caches) leaves Python's collector in the server's processes, so the collections that decoding triggers
    scan request objects only. Unfrozen, a full collection stalls the scheduler mid-request for tens of ms."""
    with urllib.request.urlopen(urllib.request.Request(base_url + "/freeze_gc", method="POST"), timeout=60) as resp:
        resp.read()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def unwind_on_sigterm() -> None:
    """SIGTERM (docker stop, kill, `timeout`) unwinds like Ctrl-C, so the `finally` that stops a started
    server's process group runs: a server left behind holds the GPU and its port."""
    signal.signal(signal.SIGTERM, _interrupt)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def serve(model_path: Path | None, draft_model_path: Path | None, extra: list[str], host: str, port: int,
          log_path: Path, dry_run: bool = False, prefix_cache: bool = PREFIX_CACHE) -> int:
    """Start the qflash server and block until it exits; return its exit code."""
    if (model_path is None) != (draft_model_path is None):
        print("qflash: give both --model-path and --draft-model-path, or neither (the dummy model)", file=sys.stderr)
        return 2
    if model_path is None:
        model_path, draft_model_path = dummy_model_dirs()
    argv = sglang_argv(model_path, draft_model_path, extra, host, port, prefix_cache=prefix_cache)
    if dry_run:
        print(" ".join(argv))
        return 0
    if not cuda_available():
        print("qflash: no CUDA GPU is visible; qflash serves on an NVIDIA GPU (sm80 or newer)", file=sys.stderr)
        return 1
    unwind_on_sigterm()
    server = ServerProcess(argv, plugin_env("qflash"), log_path, f"http://{host}:{port}")
    try:
        server.start()
        print(f"qflash: starting SGLang (log: {log_path})", flush=True)
        took = server.wait_ready()
        freeze_gc(server.base_url)
        print(f"qflash: ready in {took:.0f} s at {server.base_url} (OpenAI API: {server.base_url}/v1)", flush=True)
        return server.proc.wait()
    except (ServerDied, TimeoutError) as exc:
        print(f"qflash: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        server.stop()
