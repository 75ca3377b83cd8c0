"""Where a stage job's start-up time goes, as one line in its log.

A stage job is a fresh process: before its first useful line it imports torch and its
backend, connects to the block's Ray cluster, starts actors and loads a checkpoint. On a
fast node that is seconds; on a slow file system or a sandboxed node it can be a minute per
stage (the lent GPU machine: ~40 s before run_steps' first step). The line says which part:

    run_steps start-up: process 12.3 s before main, fleet attached 4.1 s, trainer ranks 18.0 s, ...

`process_age_s` reads the process's own start from /proc (Linux); elsewhere that part is left out.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # the fields after the command name (which may hold spaces), from its closing paren
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
        return max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Named parts of a start-up, timed back to back; `report` logs them as one line."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.parts: list[tuple[str, float]] = []
        before_main = process_age_s()
        if before_main is not None:
            self.parts.append(("process before this point", before_main))
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        """`part` took the time since the previous mark (or since the timer was made)."""
        now = time.perf_counter()
        self.parts.append((part, now - self._last))
        self._last = now

    def line(self) -> str:
        return f"{self.what} start-up: " + ", ".join(f"{part} {seconds:.1f} s" for part, seconds in self.parts)

    def report(self) -> None:
        log.info("%s", self.line())
