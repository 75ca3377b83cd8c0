"""What every transport shares: the interfaces, errors, deadlines and the parallel
per-engine step (the session sequence itself is session.SessionTransport).

Ordering rule (SGLang's, every session transport): pause → flush → begin_weight_update →
send buckets → update_weight_version → end_weight_update → continue. Each step goes to all
engines in parallel and must succeed on all before the next starts, so no engine commits
while another is still receiving: a failure before the end step leaves every built-in
engine on the previous version (a failed push aborts the sessions: end with `abort`). Only
a failure during the end step itself can leave engines on different versions; the retry
(or the next push) brings them together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from milepost.core.fleet.client import EngineClient, EngineError

log = logging.getLogger("milepost.weight_sync")


class WeightSyncError(RuntimeError):
    """A push that did not complete. `retryable` is False when retrying could only wait
    again (an engine or the trainer did not answer within its timeout)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class WeightTransport(Protocol):
    name: str
    # True: push reads `export_dir` (the loop writes it first); False: it sends from the
    # trainer's memory, and the loop writes the export behind it (core/weight_export.py)
    reads_export: bool

    def push(self, clients: list[EngineClient], export_dir: str, version: str,
             backend: WeightSource | None = None) -> dict[str, float]:
        """Make every engine serve the trainer's weights as `version`; return metrics.
        `disk` reads `export_dir`; `tensor` and `distributed` read `backend`.
        Every transport here also has `close()`, releasing buffers and groups it holds."""
        ...


class WeightSource(Protocol):
    """The trainer side (TorchBackend implements it): blocking calls with a timeout."""

    def weight_buckets(self, bucket_mb: float, timeout_s: float = ...) -> list[list[dict[str, Any]]]: ...

    def named_tensors_to_shm(self, names: list[str], bucket: int, buffer_bytes: int,
                             timeout_s: float = ...) -> str: ...

    def named_tensors_to_sglang(self, names: list[str], bucket: int, copies: int = ...,
                                timeout_s: float = ...) -> list[str]: ...

    def named_tensors_to_cuda(self, names: list[str], bucket: int, readers: int = ...,
                              timeout_s: float = ...) -> list[str]: ...

    def release_weight_buffers(self, timeout_s: float = ...) -> None: ...

    def weight_group_address(self, timeout_s: float = ...) -> tuple[str, int]: ...

    def init_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          timeout_s: float = ..., backend: str = ..., streams: int = ...) -> None: ...

    def broadcast_weights(self, names: list[str], group_name: str, flattened: bool,
                          timeout_s: float = ...) -> None: ...

    def destroy_weight_group(self, group_name: str, timeout_s: float = ...) -> None: ...


class Deadline:
    """The time left for one push attempt; every step's timeout is what is left."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what, self.end = seconds, what, time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise WeightSyncError(f"{self.what} ran past its {self.seconds:g} s timeout", retryable=False)
        return remaining


def no_reply(exc: BaseException) -> bool:
    """True when the other side did not answer in time (or is gone): retrying only waits."""
    if isinstance(exc, WeightSyncError):
        return not exc.retryable
    if isinstance(exc, EngineError):
        return exc.status is None
    return isinstance(exc, (TimeoutError, FutureTimeout)) or "ActorDied" in type(exc).__name__


def check_reply(reply: Any, client: EngineClient, step: str) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineError(f"{step} {client.base_url}", 200, str(reply.get("message")))
    return reply


def result(future: Future, deadline: Deadline, what: str) -> Any:
    """A future's result, bounded by the deadline (its own call has a timeout too; the extra
    second lets that one report first)."""
    try:
        return future.result(timeout=max(0.0, deadline.end - time.monotonic()) + 1.0)
    except FutureTimeout:
        raise WeightSyncError(f"{what}: no answer within the {deadline.seconds:g} s timeout", retryable=False) from None
    except WeightSyncError:
        raise
    except Exception as exc:  # an engine's or the trainer's error, named
        raise WeightSyncError(f"{what}: {exc}", retryable=not no_reply(exc)) from exc


def on_engines(pool: ThreadPoolExecutor, clients: list[EngineClient], step: str,
               call: Callable[[EngineClient], Any], deadline: Deadline) -> list[Any]:
    """Run `call` on every engine in parallel; raise one error naming every engine that failed."""
    def checked(c: EngineClient) -> Any:
        return check_reply(call(c), c, step)

    futures = [(c, pool.submit(checked, c)) for c in clients]
    replies, errors = [], []
    for c, f in futures:
        try:
            replies.append(result(f, deadline, f"{step} on {c.base_url}"))
        except WeightSyncError as exc:  # collected, reported together
            errors.append(exc)
    if errors:
        raise WeightSyncError(f"{step} failed on {len(errors)} of {len(clients)} engines: "
                              + "; ".join(map(str, errors)), retryable=all(e.retryable for e in errors))
    return replies


CLEANUP_ATTEMPTS = 3


def best_effort(pool: ThreadPoolExecutor, clients: list[EngineClient], timeout_s: float,
                calls: Callable[[EngineClient, Deadline], object]) -> None:
    """Cleanup that must not hang nor raise: `calls` on every engine, all within timeout_s."""
    deadline = Deadline(timeout_s, "cleanup")

    def run(c: EngineClient) -> None:
        for attempt in range(CLEANUP_ATTEMPTS):
            try:
                calls(c, deadline)
                return
            except Exception as exc:  # noqa: BLE001 - logged; the push already failed or succeeded
                # No reply at all (a pooled connection the engine had closed: "Server
                # disconnected without sending a response"): the engine never saw the call,
                # and an engine left paused would hang every later request, so try again.
                # The cleanup calls are idempotent (continue carries the push's id).
                again = (isinstance(exc, EngineError) and exc.status is None and deadline.end - time.monotonic() > 0.5
                         and attempt + 1 < CLEANUP_ATTEMPTS)
                log.warning("cleanup on %s failed%s: %s", c.base_url, ", trying again" if again else "", exc)
                if not again:
                    return
                time.sleep(0.2)

    futures = [pool.submit(run, c) for c in clients]
    for f in futures:
        try:
            f.result(timeout=max(0.0, deadline.end - time.monotonic()) + 1.0)
        except FutureTimeout:
            pass


def verify_versions(clients: list[EngineClient], version: str, timeout_s: float,
                    pool: ThreadPoolExecutor | None = None) -> None:
    """Every engine's /model_info names `version` (retryable WeightSyncError otherwise).
    `pool`: run the calls there (it needs a free worker per engine), else in a new one."""
    deadline = Deadline(timeout_s, "version check")
    if pool is None:
        with ThreadPoolExecutor(max_workers=max(1, len(clients))) as own:
            return verify_versions(clients, version, timeout_s, own)
    infos = on_engines(pool, clients, "model_info", lambda c: c.model_info(timeout_s=deadline.left()), deadline)
    wrong = [f"{c.base_url} serves {i.get('weight_version')}" for c, i in zip(clients, infos)
             if str(i.get("weight_version")) != version]
    if wrong:
        raise WeightSyncError(f"after the update, expected version {version}: {', '.join(wrong)}")
