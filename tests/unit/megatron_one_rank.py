"""One megatron rank on the CPU for unit tests: gloo, TP 1, in a child process of its own
(megatron's process groups are global state, so each test's model lives and dies apart)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def one_rank(port: int) -> Iterator[None]:
    """Inside a child: torch.distributed (gloo, world of 1 on `port`), megatron's model-parallel
    state at TP 1 / PP 1 and its RNG tracker, with the project's CPU patches active."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from milepost.core.train.megatron import cpu_compat
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with cpu_compat.activate():
            parallel_state.initialize_model_parallel(1, 1)
            cpu_compat.seed_rng_tracker(0)
            yield
    finally:
        dist.destroy_process_group()


def in_child(target: Callable[..., None], *args: Any, timeout_s: float = 240) -> Any:
    """Run `target(port, *args, queue)` in a spawned process; what it put on the queue."""
    from milepost.core.train.torch_backend import _free_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(_free_port(), *args, queue))
    proc.start()
    result = queue.get(timeout=timeout_s)
    proc.join(timeout=60)
    return result
