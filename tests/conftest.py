import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: SGLang's plugin and hook state is per process."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def dummy_dirs(tmp_path_factory):
    from qflash.server.dummy import make_dummy

    return make_dummy(tmp_path_factory.mktemp("dummy"))
