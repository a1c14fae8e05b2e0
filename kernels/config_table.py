"""Static launch-config tables: how the GEMM launchers look their configs up.

A table maps (phase, M bucket, N, K) to Triton launch parameters. It is the last statement of its kernel file,
`CONFIGS = {...}`, written there by `qflash tune` on the GPU it serves; nothing is tuned while serving. An M
between buckets takes the next larger bucket's config.
"""

from qflash.server.preset import BLOCK_SIZE, MAX_RUNNING_REQUESTS, PROMPT_BUCKETS

PHASES = ("prefill", "verify", "draft", "lm_head")
# Decode GEMMs (a verify or draft block of 1 to MAX_RUNNING_REQUESTS requests) in power-of-two batches; any larger
# M is a prefill, tuned at the benchmark's prompt lengths.
DECODE_M = tuple(BLOCK_SIZE << i for i in range(MAX_RUNNING_REQUESTS.bit_length()))
DECODE_MAX_M = DECODE_M[-1]
PREFILL_M = PROMPT_BUCKETS
M_BUCKETS = {"prefill": PREFILL_M, "verify": DECODE_M, "draft": DECODE_M, "lm_head": DECODE_M}


def gemm_phase(decode_phase: str, m: int) -> str:
    """The table a GEMM of M rows reads: its role's decode table up to DECODE_MAX_M rows, else prefill."""
    return "prefill" if m > DECODE_MAX_M else decode_phase


def m_bucket(phase: str, m: int) -> int:
    buckets = M_BUCKETS[phase]
    return next((b for b in buckets if m <= b), buckets[-1])


def lookup(table: dict, phase: str, m: int, n: int, k: int, default: dict) -> dict:
    if phase not in M_BUCKETS:
        raise ValueError(f"unknown GEMM phase {phase!r}; one of {PHASES}")
    return table.get((phase, m_bucket(phase, m), n, k), default)
