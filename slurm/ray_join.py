"""Wait until a Ray cluster has N live nodes, then publish its address to a file.

Run by the Ray-on-Slurm allocation script (see sbatch.py) on the head node:

    python -m milepost.slurm.ray_join --address IP:PORT --num-nodes 2 --timeout-s 600 \
        --publish /shared/campaign/ray-address

The file is written to a temporary name and renamed, so a reader sees either nothing or
the whole address; it is written only once every node has joined, so its existence
means "the cluster is complete".
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from milepost.core.errors import cause_chain_line


def publish(path: Path, address: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(address)
    os.replace(tmp, path)


def wait_for_nodes(address: str, num_nodes: int, timeout_s: float, interval_s: float = 1.0) -> int:
    """Connect to the cluster at `address`; return the live node count once ≥ num_nodes."""
    import ray  # heavy: only where it runs, never at import time

    deadline = time.monotonic() + timeout_s
    _connect(address, deadline, interval_s)
    try:
        while True:
            alive = sum(1 for node in ray.nodes() if node["Alive"])
            if alive >= num_nodes:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} of {num_nodes} Ray nodes joined {address} in {timeout_s}s")
            time.sleep(interval_s)
    finally:
        ray.shutdown()


def _connect(address: str, deadline: float, interval_s: float) -> None:
    """ray.init to the head, retried until `deadline`: the GCS port answers before the head's
    raylet has registered, and a driver that connects in between fails at once ("No node info
    found …"); on a loaded node that gap lasts seconds."""
    import ray

    while True:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            return
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not connect to the Ray head {address}: {cause_chain_line(e)}") from e
            print(f"ray_join: the head {address} is not ready yet ({cause_chain_line(e)}); retrying", file=sys.stderr)
            if ray.is_initialized():
                ray.shutdown()
            time.sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="The head's IP:PORT (GCS).")
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--publish", type=Path, required=True, help="File that receives IP:PORT.")
    args = parser.parse_args(argv)
    try:
        alive = wait_for_nodes(args.address, args.num_nodes, args.timeout_s)
    except TimeoutError as err:
        print(f"ray_join: {err}", file=sys.stderr)
        return 1
    publish(args.publish, args.address)
    print(f"ray_join: {alive} nodes joined {args.address}; published to {args.publish}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
