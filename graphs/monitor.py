"""What the server says about its CUDA graphs: the shapes captured and what they cost at start-up, and
every forward step that ran eagerly instead (counted per kind, logged at the 1st, 2nd, 4th, 8th, ... of
each kind so a steady fallback stays visible without flooding the log)."""

from collections import Counter


def capture_report(role: str, phase: str, sizes: list[int], tokens_per_size: int, seconds: float, graph_bytes: int) -> str:
    """One start-up line per captured graph family, e.g. target TARGET_VERIFY graphs for batch sizes 1-8."""
    unit = "batch sizes" if tokens_per_size > 1 else "token counts"
    shapes = ", ".join(map(str, sizes)) if len(sizes) <= 12 else f"{', '.join(map(str, sizes[:6]))}, ... {sizes[-1]} ({len(sizes)} shapes)"
    tokens = f" ({sizes[0] * tokens_per_size}-{sizes[-1] * tokens_per_size} tokens)" if tokens_per_size > 1 else ""
    return (f"qflash graphs: {role} {phase} graphs for {unit} {shapes}{tokens}: "
            f"captured in {seconds:.1f} s, {graph_bytes / 2**30:.2f} GiB of GPU memory")


class EagerSteps:
    """Counts forward steps that did not replay a CUDA graph, by (role, forward mode)."""

    def __init__(self):
        self.counts: Counter = Counter()

    def record(self, role: str, mode: str, batch_size: int, num_tokens: int) -> str | None:
        """Count one eager step; the log line to write when this kind's count reaches a power of two."""
        key = (role, mode)
        self.counts[key] += 1
        n = self.counts[key]
        if n & (n - 1):
            return None
        total = sum(self.counts.values())
        return (f"qflash graphs: {role} {mode} step ran eagerly (batch {batch_size}, {num_tokens} tokens); "
                f"eager steps of this kind: {n}, of all kinds: {total}")
