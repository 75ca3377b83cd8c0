"""torch.distributed rendezvous stores that listen on the address they are given, only.

torch's `tcp://host:port` rendezvous (and a master `TCPStore(host, …)`) listens on every
interface whatever host it is given (measured: `*:port` in `ss`). Process groups of a
campaign — the trainer's own group, the weight-update group — must bind the loopback or
cluster-internal address they were given, never all interfaces: the master's socket is
created here, bound to that address, and handed to the store.
"""

from __future__ import annotations

import datetime
import os
import socket

from torch.distributed import TCPStore


def bound_store(address: str, port: int, world_size: int, is_master: bool,
                timeout: datetime.timedelta) -> TCPStore:
    """The group's TCP store: the master (rank 0) listens on `address:port` only; the other
    ranks connect to it, as torch's rendezvous would."""
    if not is_master:
        return TCPStore(address, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    fd = socket.create_server((address, port), family=family).detach()  # the store owns it from here
    try:
        return TCPStore(address, port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass  # the store closed it already
        raise
