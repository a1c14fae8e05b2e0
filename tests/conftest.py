import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be on before they are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300,
               stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: SGLang's plugin and hook state is per process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, input=stdin)


@pytest.fixture(scope="session")
def dummy_dirs(tmp_path_factory):
    from qflash.server.dummy import make_dummy

    return make_dummy(tmp_path_factory.mktemp("dummy"))


@contextlib.contextmanager
def launched(*args: str, log: Path, timeout_s: float = 900):
    """`./launch.sh ARGS` in its own process group until it prints that it is ready; Ctrl-C on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen([str(REPO / "launch.sh"), *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHON": sys.executable}, start_new_session=True)
    start = time.monotonic()
    try:
        while not re.search(r"ready in \d+ s", log.read_text()):
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
