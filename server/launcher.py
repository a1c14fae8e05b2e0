"""`qflash serve`: start SGLang with the qflash preset, wait until it answers with qflash in place, print its URL
(with `--replicas N`, N such servers and SGLang's router in front of them: server/replicas.py).

The server is SGLang's own `sglang.launch_server`, run as a child process group; qflash reaches into it only
through its plugin (SGLANG_PLUGINS). `qflash bench` starts the stock systems with the same class. Nothing heavy
is imported here at module level: `qflash serve --help` answers at once.
"""

import argparse
import functools
import http.client
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
from importlib.metadata import version
from pathlib import Path

from qflash.quant.layout import WEIGHT_FILES, is_qflash_config
from qflash.server.errors import UserError
from qflash.server.hooks import APPLIED, PINNED_SGLANG, REFUSED

APPLIED_MARK = APPLIED.split("{count}")[1].split("{version}")[0]  # " hooks applied on sglang "
from qflash.server import warm_up, window
from qflash.server.preset import (DFLASH_FLAGS, HOST, PORT, PREFIX_CACHE, PREFIX_CACHE_FLAGS, QFLASH_SERVER_ENV,
                                  QFLASH_SERVING_FLAGS, QFLASH_W8A8_FLAGS, REQUEST_LIMITS, WINDOW_CYCLES)

DEFAULT_CACHE = Path(os.environ.get("QFLASH_CACHE", "~/.cache/qflash")).expanduser()
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
PASSTHROUGH = True  # flags `qflash serve` does not know go to sglang.launch_server


class ServerDied(RuntimeError):
    pass


def is_dummy_dir(path: Path) -> bool:
    """True if `path` holds a config and tokenizer but no weights (serve it with --load-format dummy)."""
    path = Path(path)
    has_weights = any(any(path.glob(pattern)) for pattern in WEIGHT_FILES)
    return (path / "config.json").exists() and (path / "tokenizer.json").exists() and not has_weights


def dummy_model_dirs(cache: Path = DEFAULT_CACHE, quantized: bool = True) -> tuple[Path, Path]:
    """The offline dummy target (qflash's W8A8 layout, or the bf16 original) and drafter, built once in the cache."""
    from qflash.server.dummy import DRAFTER_DIR, TARGET_DIR, W8A8_DIR, make_dummy

    root = cache / "dummy"
    target, drafter = (root / W8A8_DIR if quantized else root) / TARGET_DIR, root / DRAFTER_DIR
    if not (is_dummy_dir(target) and is_dummy_dir(drafter)):
        make_dummy(root)
    return target, drafter


def read_config(folder: Path, role: str) -> dict:
    """A model folder's config.json; UserError for a folder that is missing or holds no model."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{role} {folder} does not exist or is not a folder")
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{role} {folder} has no config.json (not a Hugging Face model folder)") from None
    except ValueError as exc:
        raise UserError(f"{role} {folder}/config.json is not valid JSON ({exc})") from None


def sglang_argv(target: Path, drafter: Path, extra: list[str], host: str = HOST, port: int = PORT,
                stock: bool = False, prefix_cache: bool = PREFIX_CACHE) -> list[str]:
    """The `sglang.launch_server` command for a target + DFlash drafter, served under the target folder's
    name (e.g. `Qwen3.5-4B`); a qflash W8A8 target is served by qflash's quantization method, the drafter
    quantized the same way; qflash's serving flags and optional prefix caching unless `stock`; `extra`
    flags come last and win."""
    load = ["--load-format", "dummy"] if is_dummy_dir(target) else []
    quant = QFLASH_W8A8_FLAGS if is_qflash_config(read_config(target, "--model-path")) else []
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
    """The server's environment: this one (over qflash's SGLang settings, for the full stack), with only the named
    qflash plugins enabled."""
    serving = QFLASH_SERVER_ENV if plugins == "qflash" else {}
    return {**serving, **os.environ, "SGLANG_PLUGINS": plugins, "PYTHONUNBUFFERED": "1", **(extra or {})}


class ServerProcess:
    """One SGLang server as a child process group, with its log in a file (appended to: `log()` reads this run's part)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, base_url: str, api_key: str | None = None):
        self.argv, self.env, self.log_path, self.base_url, self.api_key = argv, env, Path(log_path), base_url, api_key
        self.proc: subprocess.Popen | None = None
        self.log_start = 0

    def start(self) -> "ServerProcess":
        # A server already answering on the port would pass wait_ready's /health check in this one's place.
        url = urllib.parse.urlsplit(self.base_url)
        with socket.socket() as probe:
            if probe.connect_ex((url.hostname, url.port)) == 0:
                raise ServerDied(f"{url.hostname}:{url.port} is already in use (another server?): stop it or pick another --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_start = log.tell()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        """What this run wrote to the log."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            return log.read().decode(errors="replace")

    def refusal(self) -> str | None:
        """qflash's own reason for stopping the server at start-up (server/hooks), if it gave one."""
        return next((line[line.index(REFUSED) + len("qflash: "):] for line in self.log().splitlines() if REFUSED in line), None)

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Poll /health until it answers 200; return the seconds it took. Raise ServerDied if the server exits."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise ServerDied(self.refusal() or f"server exited with code {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log: {self.log_path}")

    def post(self, route: str, payload: dict | None = None, timeout: float = 60) -> None:
        """POST to one of SGLang's routes (a JSON body when given), with the server's API key when it has one."""
        data = None if payload is None else json.dumps(payload).encode()
        self._call(route, data, "POST", timeout)

    def get_json(self, route: str, timeout: float = 10):
        return json.loads(self._call(route, None, "GET", timeout))

    def _call(self, route: str, data: bytes | None, method: str, timeout: float) -> bytes:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base_url + route, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.read()

    def stop(self) -> None:
        """SIGTERM to the whole process group (SGLang's scheduler and detokenizer are the server's children), then
        SIGKILL if it has not exited within a minute."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wait_ready_with_qflash(server: ServerProcess) -> tuple[float, str]:
    """Wait until a started server answers with qflash's plugin in place, then warm it up: the seconds to ready and
    the plugin's line from the log."""
    took = server.wait_ready()
    applied = [line for line in server.log().splitlines() if line.startswith("qflash: ") and APPLIED_MARK in line]
    if not applied:
        raise ServerDied("the server started without qflash's SGLang plugin (is qflash installed in this Python?)")
    try:
        warm_up_and_freeze_gc(server)
    except (OSError, http.client.HTTPException) as exc:  # a warm-up request the server dropped: it failed serving
        raise ServerDied(f"the server failed during the warm-up ({exc}); log: {server.log_path}") from exc
    return took, applied[0]


def warm_up_and_freeze_gc(server: ServerProcess) -> None:
    """What `qflash serve` does once the server answers: the warm-up (server/warm_up.py), then `freeze_gc`."""
    print(warm_up.run(server.post), flush=True)
    freeze_gc(server)


def freeze_gc(server: ServerProcess) -> None:
    """SGLang's `/freeze_gc`, once the server is ready: every object alive after start-up (model, CUDA graphs,
    caches) leaves Python's collector in the server's processes, so the collections that decoding triggers
    scan request objects only. Unfrozen, a full collection stalls the scheduler mid-request for tens of ms."""
    server.post("/freeze_gc")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def unwind_on_sigterm() -> None:
    """SIGTERM (docker stop, kill, `timeout`) unwinds like Ctrl-C, so the `finally` that stops a started
    server's process group runs: a server left behind holds the GPU and its port."""
    signal.signal(signal.SIGTERM, _interrupt)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def require_gpu() -> None:
    if not cuda_available():
        raise UserError("no CUDA GPU is visible; qflash serves on an NVIDIA GPU (sm80 or newer)", code=1)


def require_pinned_sglang() -> None:
    found = version("sglang")
    if found != PINNED_SGLANG:
        raise UserError(f"qflash changes SGLang {PINNED_SGLANG} internals; this Python has sglang {found}", code=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", type=Path, help="Qwen3.5-4B checkpoint folder (default: the offline dummy model)")
    p.add_argument("--draft-model-path", type=Path, help="Qwen3.5-4B-DFlash drafter folder")
    p.add_argument("--host", default=HOST, help=f"address to listen on (default {HOST})")
    p.add_argument("--port", type=int, default=PORT, help=f"(default {PORT})")
    p.add_argument("--api-key", default=os.environ.get("QFLASH_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $QFLASH_API_KEY)")
    p.add_argument("--log", type=Path, help="server log file (default: ~/.cache/qflash/logs/server-PORT.log; with "
                   "--replicas its folder holds each replica's and the router's)")
    p.add_argument("--dry-run", action="store_true", help="print the SGLang command and exit")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=PREFIX_CACHE,
                   help="SGLang's radix cache with qflash's DFLASH fixes (default: on)")
    p.add_argument("--window-cycles", type=window_cycles, default=WINDOW_CYCLES,
                   help=f"speculative cycles per scheduler step, 1-{window.MAX_CYCLES} (default {WINDOW_CYCLES})")
    p.add_argument("--max-n", type=int, default=REQUEST_LIMITS["max_n"],
                   help=f"largest `n` a request may ask for (default {REQUEST_LIMITS['max_n']})")
    p.add_argument("--max-top-logprobs", type=int, default=REQUEST_LIMITS["max_top_logprobs"],
                   help=f"largest top_logprobs a request may ask for (default {REQUEST_LIMITS['max_top_logprobs']})")
    p.add_argument("--max-request-mb", type=float, default=REQUEST_LIMITS["max_request_bytes"] / 2**20,
                   help=f"largest request body in MiB (default {REQUEST_LIMITS['max_request_bytes'] >> 20})")
    p.add_argument("--replicas", type=int, default=1,
                   help="N servers, one per visible GPU, behind SGLang's router at --host/--port (needs the scale extra)")
    p.add_argument("--share-gpus", action="store_true",
                   help="with --replicas: place more replicas than GPUs, each GPU's memory split between its replicas")


def window_cycles(text: str) -> int:
    value = int(text)
    if not 1 <= value <= window.MAX_CYCLES:
        raise argparse.ArgumentTypeError(f"{text!r}: choose 1 to {window.MAX_CYCLES}")
    return value


def settings_env(args: argparse.Namespace) -> dict[str, str]:
    """The request limits and the window as the server's hooks read them (server/hooks/requests.py, server/window.py)."""
    return {"QFLASH_MAX_N": str(args.max_n), "QFLASH_MAX_TOP_LOGPROBS": str(args.max_top_logprobs),
            "QFLASH_MAX_REQUEST_BYTES": str(int(args.max_request_mb * 2**20)), window.ENV: str(args.window_cycles)}


def run(args: argparse.Namespace, extra: list[str]) -> int:
    """Start the qflash server and block until it exits; return its exit code."""
    if (args.model_path is None) != (args.draft_model_path is None):
        raise UserError("give both --model-path and --draft-model-path, or neither (the dummy model)")
    if args.model_path is not None:
        read_config(args.model_path, "--model-path")
        read_config(args.draft_model_path, "--draft-model-path")
    if not args.dry_run:
        require_gpu()
        require_pinned_sglang()
    model_path, draft_model_path = (args.model_path, args.draft_model_path) if args.model_path else dummy_model_dirs()
    if args.host not in LOCAL_HOSTS and not args.api_key:
        print(f"qflash: warning: listening on {args.host} without --api-key: anyone who can reach it can use the server, "
              "admin routes included", file=sys.stderr)
    if args.replicas != 1:
        return serve_replicas(args, extra, model_path, draft_model_path, args.log.parent if args.log else DEFAULT_CACHE / "logs")
    key = ["--api-key", args.api_key] if args.api_key else []
    argv = sglang_argv(model_path, draft_model_path, [*key, *extra], args.host, args.port, prefix_cache=args.prefix_cache)
    if args.dry_run:
        print(" ".join(argv))
        return 0
    log = args.log or DEFAULT_CACHE / "logs" / f"server-{args.port}.log"
    server = ServerProcess(argv, plugin_env("qflash", settings_env(args)), log, f"http://{args.host}:{args.port}", args.api_key)

    def serve() -> int:
        server.start()
        print(f"qflash: starting SGLang (log: {log})", flush=True)
        took, applied = wait_ready_with_qflash(server)
        print(f"{applied}\nqflash: ready in {took:.0f} s at {server.base_url} (OpenAI API: {server.base_url}/v1)", flush=True)
        return server.proc.wait()

    return run_stopping([server], serve)


def run_stopping(processes: list[ServerProcess], serve) -> int:
    """`serve()` (start, wait, serve; its return is the exit code), SIGTERM unwinding like Ctrl-C: a server that
    cannot start is one line and exit 1, and every process in `processes` is stopped at the end."""
    unwind_on_sigterm()
    try:
        return serve()
    except (ServerDied, TimeoutError, urllib.error.URLError) as exc:
        print(f"qflash: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        for process in processes:
            process.stop()


def serve_replicas(args: argparse.Namespace, extra: list[str], target: Path, drafter: Path, log_dir: Path) -> int:
    """`--replicas N` (server/replicas.py): start every replica, then the router once all are warm; block until the
    router exits or no replica is left."""
    from qflash.server import replicas

    plan = replicas.plan(args.replicas, replicas.visible_gpus(os.environ, gpu_count), args.share_gpus, args.port)
    workers, router = replica_group(plan, target, drafter, extra, plugin_env("qflash", settings_env(args)), log_dir,
                                    args.host, args.port, args.api_key, args.prefix_cache)
    if args.dry_run:
        for r, w in zip(plan, workers):
            print(f"CUDA_VISIBLE_DEVICES={r.device} {' '.join(w.argv)}")
        print(" ".join(router.argv))
        return 0
    replicas.require_router()

    def serve() -> int:
        applied = start_replicas(plan, workers, router)
        print(f"{applied}\nqflash: {len(workers)} replicas ready behind SGLang's router at {router.base_url} "
              f"(OpenAI API: {router.base_url}/v1; log: {router.log_path})", flush=True)
        return watch_replicas(router, workers)

    return run_stopping([router, *workers], serve)


def replica_group(plan: list, target: Path, drafter: Path, extra: list[str], env: dict[str, str], log_dir: Path,
                  host: str, port: int, api_key: str | None = None,
                  prefix_cache: bool = PREFIX_CACHE) -> tuple[list[ServerProcess], ServerProcess]:
    """The servers of `plan`'s replicas (on 127.0.0.1, in `env` on their own GPU) and the router's at host:port,
    not started yet."""
    from qflash.server import replicas

    key = ["--api-key", api_key] if api_key else []
    workers = [ServerProcess(
        sglang_argv(target, drafter, [*key, "--mem-fraction-static", str(r.mem_fraction), *extra], HOST, r.port,
                    prefix_cache=prefix_cache),
        {**env, "CUDA_VISIBLE_DEVICES": r.device}, log_dir / f"server-{r.port}.log", f"http://{HOST}:{r.port}",
        api_key) for r in plan]
    router = ServerProcess(replicas.router_argv([w.base_url for w in workers], host, port, api_key), dict(os.environ),
                           log_dir / f"router-{port}.log", f"http://{host}:{port}", api_key)
    return workers, router


def start_replicas(plan: list, workers: list[ServerProcess], router: ServerProcess,
                   say=functools.partial(print, flush=True)) -> str:
    """Start the replicas wave by wave (replicas.plan: those sharing a GPU one after another), each ready with qflash
    and warmed up, then the router; return the plugin's line."""
    for wave in sorted({r.wave for r in plan}):
        starting = [(r, w) for r, w in zip(plan, workers) if r.wave == wave]
        for r, w in starting:
            w.start()
            say(f"qflash: starting replica {r.index} on GPU {r.device} (log: {w.log_path})")
        for r, w in starting:
            took, applied = wait_ready_with_qflash(w)
            say(f"qflash: replica {r.index} ready in {took:.0f} s at {w.base_url}")
    router.start()
    router.wait_ready(timeout_s=120)
    wait_routing(router, [w.base_url for w in workers])
    return applied


def wait_routing(router: ServerProcess, urls: list[str], timeout_s: float = 120) -> None:
    """Wait until the router lists every replica as healthy: it answers /health before it has registered any (that
    runs in the background), and a request meanwhile gets 503 "no available workers"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise ServerDied(f"the router exited with code {router.proc.returncode}; log: {router.log_path}")
        try:
            if {w["url"] for w in router.get_json("/workers")["workers"] if w["is_healthy"]} >= set(urls):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the router did not take up every replica in {timeout_s:.0f} s; log: {router.log_path}")


def watch_replicas(router: ServerProcess, workers: list[ServerProcess], poll_s: float = 1.0) -> int:
    """Serve while the router and at least one replica live; say once which replica exited."""
    gone = set()
    while router.proc.poll() is None:
        for i, w in enumerate(workers):
            if i not in gone and w.proc.poll() is not None:
                gone.add(i)
                left = len(workers) - len(gone)
                print(f"qflash: replica {i} ({w.base_url}) exited with code {w.proc.returncode}; "
                      + (f"the router serves on with {left}" if left else "none is left, stopping"), file=sys.stderr, flush=True)
        if len(gone) == len(workers):
            return 1
        time.sleep(poll_s)
    print(f"qflash: the router exited with code {router.proc.returncode}; log: {router.log_path}", file=sys.stderr)
    return router.proc.returncode or 1
