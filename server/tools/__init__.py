"""Measurement tools: the scoreboard, the profiler, the kernel bench and tuner, the quality checks. Nothing on the
serving path imports them; the CLI imports each only when its subcommand runs."""
