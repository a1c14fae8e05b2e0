import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be on before they are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: SGLang's plugin and hook state is per process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def dummy_dirs(tmp_path_factory):
    from qflash.server.dummy import make_dummy

    return make_dummy(tmp_path_factory.mktemp("dummy"))
