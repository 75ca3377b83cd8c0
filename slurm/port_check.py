"""Is a Ray port slot free on this host? Checked before `ray start`, locally and on Slurm.

Two campaigns hash to the same slot with probability 1/42 (sbatch.RayPorts), and a port
may be held by anything else. `ray start` on a taken port fails late and unclearly, so the
slot is checked first: the local launcher then takes the next slot, and the allocation
script exits with PORTS_TAKEN_EXIT, after which the launcher submits on the next slot.

    python -m milepost.slurm.port_check 20000 20001 20002 20010-20013 20100-20299
"""

from __future__ import annotations

import socket
import sys

PORTS_TAKEN_EXIT = 75  # EX_TEMPFAIL: another slot will do
TAKEN_MESSAGE = "port(s) of this Ray port slot are taken"  # the launcher reads it where sacct gives no exit code


def port_free(port: int) -> bool:
    """True when nothing listens on `port` on any interface (Ray binds all of them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def taken_ports(ports: list[int]) -> list[int]:
    return [p for p in ports if not port_free(p)]


def _parse(args: list[str]) -> list[int]:
    ports: list[int] = []
    for arg in args:
        lo, _, hi = arg.partition("-")
        ports.extend(range(int(lo), int(hi or lo) + 1))
    return ports


def main(argv: list[str] | None = None) -> int:
    ports = _parse(sys.argv[1:] if argv is None else argv)
    taken = taken_ports(ports)
    if taken:
        shown = ", ".join(map(str, taken[:8])) + (" …" if len(taken) > 8 else "")
        print(f"port_check: {len(taken)} {TAKEN_MESSAGE} on {socket.gethostname()} "
              f"({shown}); another Ray cluster or service holds them: the launcher moves to the next slot",
              file=sys.stderr)
        return PORTS_TAKEN_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
