import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be on before they are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SESSION_MARK = "QFLASH_TEST_SESSION"


def marked_processes(mark: str) -> list[int]:
    """Live processes (not zombies) other than this one whose environment carries `mark`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, IndexError):  # exited meanwhile, or not ours to read
            pass
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Every process a test starts inherits this session's mark in its environment (orphans too); one still
    running when the session ends is a leak: it is killed and the session fails."""
    mark = f"{SESSION_MARK}={uuid.uuid4().hex}"
    os.environ[SESSION_MARK] = mark.split("=", 1)[1]
    yield
    if "torch._inductor.async_compile" in sys.modules:  # torch.compile's worker pool lives until the interpreter exits
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
    deadline = time.monotonic() + 15  # processes a test has just signalled may still be exiting
    while (leaked := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leaked, f"processes left behind by the tests: {leaked}"


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300,
               stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: SGLang's plugin and hook state is per process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, input=stdin)


def change_attributes(objects: dict, changes: dict) -> None:
    """Set each of `changes` ({"object.attribute": value}) on the named one of `objects`: a decline case of a hook's
    stand-ins."""
    for name, value in changes.items():
        owner, attribute = name.split(".")
        setattr(objects[owner], attribute, value)


class Dispatched(TorchDispatchMode):
    """The torch operations (with their arguments) dispatched while it is entered: each is a launch on a GPU."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))

    def names(self) -> set[str]:
        return {func.overloadpacket.__name__ for func, _ in self.calls}

    def count(self, *funcs) -> int:
        return sum(func in funcs for func, _ in self.calls)


@pytest.fixture(scope="session")
def dummy_dirs(tmp_path_factory):
    from qflash.server.dummy import make_dummy

    return make_dummy(tmp_path_factory.mktemp("dummy"))


@contextlib.contextmanager
def launched(*args: str, log: Path, timeout_s: float = 900, ready: str = r"ready in \d+ s"):
    """`./launch.sh ARGS` in its own process group until it prints that it is ready (`ready`, a pattern); Ctrl-C on
    exit. The shared server stops first."""
    stop_served()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(REPO / "launch.sh"), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHON": sys.executable}, start_new_session=True)
    start = time.monotonic()
    try:
        while not re.search(ready, log.read_text()):
            assert proc.poll() is None, f"launch.sh exited:\n{log.read_text()}"
            assert time.monotonic() - start < timeout_s, f"server not ready in {timeout_s:.0f} s"
            time.sleep(1)
        print(f"\nlaunch.sh {' '.join(args)}: ready after {time.monotonic() - start:.0f} s")
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)



SERVED_PORT = 30000
SERVED = f"http://127.0.0.1:{SERVED_PORT}"
SERVED_KEY = "qflash-gpu-tests"  # the shared server requires it, as a user's `--api-key` server does
API = requests.Session()  # what the GPU tests send to the shared server: with its key
API.headers["Authorization"] = f"Bearer {SERVED_KEY}"
_served: list[contextlib.ExitStack] = []  # the shared server while it runs
_served_log: list[Path] = []  # its SGLang log, this run's alone


def served_log() -> str:
    """What the shared server has logged (SGLang's log of this session's start)."""
    return _served_log[-1].read_text(errors="replace")


def pytest_collection_modifyitems(items):
    """Tests on the shared default server (`served`) run first: it starts once, then stops for the tests that
    launch servers of their own (an H200 holds one server at SGLang's memory fraction), among them those that
    also compare with the shared server's earlier answers (a fixture in STOPS_SERVED stops it)."""
    def after_served(item) -> bool:
        names = getattr(item, "fixturenames", ())
        return "served" not in names or any(name in STOPS_SERVED for name in names)

    items.sort(key=after_served)


STOPS_SERVED = {"plain"}  # tests/test_quantized_server_gpu.py: a server without speculation


def stop_served() -> None:
    while _served:
        _served.pop().close()


def stable_checkpoint() -> tuple[Path, Path]:
    """(quantized target, drafter) of `make-dummy --stable`, built once in the cache folder (~1.5 min): greedy
    choices that depend on the context by wide margins, and a drafter real verification accepts."""
    from qflash.server.dummy import DRAFTER_DIR, TARGET_DIR, W8A8_DIR, make_dummy

    root = Path(os.environ.get("QFLASH_CACHE", "~/.cache/qflash")).expanduser() / "stable"
    if not (root / W8A8_DIR / TARGET_DIR / "model.safetensors.index.json").exists():
        make_dummy(root, stable=True)
    return root / W8A8_DIR / TARGET_DIR, root / DRAFTER_DIR


REAL = os.environ.get("QFLASH_CHECKPOINT"), os.environ.get("QFLASH_DRAFTER")  # a real quantized target and drafter


def served_model() -> tuple[Path, Path]:
    """(target, drafter) the GPU tests serve: the real ones if named, else the stable-choice checkpoint."""
    return tuple(map(Path, REAL)) if all(REAL) else stable_checkpoint()


@pytest.fixture(scope="session")
def fault_file(tmp_path_factory) -> Path:
    """Where a test names the fault the shared server is to inject (tests/fault_control.py)."""
    return tmp_path_factory.mktemp("faults") / "fault"


@pytest.fixture(scope="session")
def served(tmp_path_factory, fault_file):
    """`./launch.sh` as a user starts it, once for every GPU module that talks to the default server (a start
    costs minutes of device time): qflash's kernels, DFLASH K=16, prefix caching on, an API key (SERVED_KEY; the
    tests send it through API), real verification (SGLANG_SIMULATE_ACC_LEN unset). The model is the stable-choice
    checkpoint, so comparisons of outputs mean something (QFLASH_CHECKPOINT and QFLASH_DRAFTER: real weights
    instead). The server carries the test fault plugin, idle until a test names a fault in `fault_file`."""
    from fault_control import fault_env

    os.environ.pop("SGLANG_SIMULATE_ACC_LEN", None)
    target, drafter = served_model()
    stack = contextlib.ExitStack()
    folder = tmp_path_factory.mktemp("served")
    _served_log.append(folder / "server.log")
    with pytest.MonkeyPatch.context() as env:
        for key, value in fault_env(fault_file).items():
            env.setenv(key, value)
        stack.enter_context(launched("--model-path", str(target), "--draft-model-path", str(drafter), "--port", str(SERVED_PORT),
                                     "--api-key", SERVED_KEY, "--log", str(_served_log[-1]), log=folder / "launch.out"))
    _served.append(stack)
    yield
    stop_served()
