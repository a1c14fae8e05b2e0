"""Switching the test fault plugin (tests/faults/sitecustomize.py) of a running server."""

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

FAULTS = Path(__file__).resolve().parent / "faults"  # the folder a server's PYTHONPATH starts with


@functools.cache
def plugin():
    """The plugin module, loaded under another name than `sitecustomize`: nothing is registered in this process."""
    spec = importlib.util.spec_from_file_location("qflash_test_faults", FAULTS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fault_env(fault_file: Path) -> dict[str, str]:
    """The environment that makes a server carry the plugin, idle until `fault_file` names a fault."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{FAULTS}{os.pathsep}{path}" if path else str(FAULTS), plugin().ENV: str(fault_file)}


def _write(fault_file: Path, text: str) -> None:
    """Replace the file whole, so a server process never reads half a name."""
    tmp = Path(f"{fault_file}.tmp")
    tmp.write_text(text)
    os.replace(tmp, fault_file)


@contextlib.contextmanager
def injected(fault_file: Path, fault: str):
    """The server misbehaves as `fault` names while the block runs (a name the plugin does not know is an error:
    the server would run clean and the check would seem to miss its fault)."""
    if fault not in plugin().FAULTS:
        raise ValueError(f"no fault {fault!r}; the plugin has {plugin().FAULTS}")
    _write(fault_file, fault)
    try:
        yield
    finally:
        _write(fault_file, "")
