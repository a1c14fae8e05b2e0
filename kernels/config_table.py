"""Static launch-config tables: how the GEMM launchers look configs up and how the tuner writes them.

A table maps (phase, M bucket, N, K) to Triton launch parameters. It is the last statement of its
kernel file, `CONFIGS = {...}`, written there by `python -m qflash.kernels.tune`; nothing is tuned
while serving. An M between buckets takes the next larger bucket's config.
"""

import re
from pathlib import Path

from qflash.kernels.shapes import DECODE_M, PREFILL_M

PHASES = ("prefill", "verify", "draft", "lm_head")
M_BUCKETS = {"prefill": PREFILL_M, "verify": DECODE_M, "draft": DECODE_M, "lm_head": DECODE_M}


def m_bucket(phase: str, m: int) -> int:
    buckets = M_BUCKETS[phase]
    return next((b for b in buckets if m <= b), buckets[-1])


def lookup(table: dict, phase: str, m: int, n: int, k: int, default: dict) -> dict:
    if phase not in M_BUCKETS:
        raise ValueError(f"unknown GEMM phase {phase!r}; one of {PHASES}")
    return table.get((phase, m_bucket(phase, m), n, k), default)


def render(table: dict, machine: str) -> str:
    """The `CONFIGS = {...}` source block, one sorted line per key."""
    lines = [f"# Tuned on {machine} by `python -m qflash.kernels.tune`: (phase, M bucket, N, K) -> launch config.",
             "CONFIGS = {"]
    for key in sorted(table, key=lambda k: (PHASES.index(k[0]), *k[1:])):
        cfg = ", ".join(f"{name}={value!r}" for name, value in table[key].items())
        lines.append(f"    {key!r}: dict({cfg}),")
    return "\n".join(lines + ["}"]) + "\n"


def write(path: Path, table: dict, machine: str) -> None:
    """Replace the table at the end of a kernel file (from its `# Tuned on` / `CONFIGS = {` line on)."""
    text = Path(path).read_text()
    match = re.search(r"^(# Tuned on .*\n)?CONFIGS = \{", text, flags=re.M)
    if match is None:
        raise ValueError(f"{path} has no CONFIGS table")
    Path(path).write_text(text[:match.start()] + render(table, machine))
