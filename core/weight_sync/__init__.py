"""Weight sync: make every engine serve the trainer's newest policy.

Transports, one interface (`WeightTransport.push(clients, export_dir, version, backend)`):
- `disk`: the trainer exports an HF folder; engines load it (/update_weights_from_disk).
- `tensor` (colocated): buckets through named /dev/shm buffers (/update_weights_from_tensor).
- `distributed` (disaggregated): a gloo/nccl group from trainer rank 0 to every engine,
  bucketed broadcast (/update_weights_from_distributed).
The session transports follow SGLang's sequence (pause → flush → begin_weight_update →
send → update_weight_version → end_weight_update → continue); ordering, timeout and retry
rules are in SessionTransport's docstring.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from milepost.core.config import SyncConfig

if TYPE_CHECKING:
    from milepost.core.weight_sync.base import WeightSource as WeightSource
    from milepost.core.weight_sync.base import WeightSyncError as WeightSyncError
    from milepost.core.weight_sync.base import WeightTransport as WeightTransport
    from milepost.core.weight_sync.disk import DiskTransport as DiskTransport
    from milepost.core.weight_sync.distributed import DistributedTransport as DistributedTransport
    from milepost.core.weight_sync.tensor import TensorTransport as TensorTransport

TRANSPORTS = ("disk", "tensor", "distributed")
# The trainer-side names, imported when first used: an engine process imports the wire
# formats of this package (wire, sglang_wire, groups) and must not load the transports, which
# drive engines through the fleet's HTTP client.
_LAZY = {"WeightSource": "base", "WeightSyncError": "base", "WeightTransport": "base", "DiskTransport": "disk",
         "DistributedTransport": "distributed", "TensorTransport": "tensor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_transport(name: str | SyncConfig, timeout_s: float = 120.0, bucket_mb: float = 512.0,
                    num_attempts: int = 2, pause_mode: str = "abort",
                    gloo_streams: int = SyncConfig.model_fields["gloo_streams"].default) -> WeightTransport:
    """The transport `name` (sync.transport), or the one a whole `SyncConfig` describes
    (its timeout_s, bucket_mb and gloo_streams then win). `timeout_s` bounds each push attempt."""
    from milepost.core.weight_sync.disk import DiskTransport
    from milepost.core.weight_sync.distributed import DistributedTransport
    from milepost.core.weight_sync.tensor import TensorTransport

    if isinstance(name, SyncConfig):
        sync = name
        name, timeout_s, bucket_mb, gloo_streams = sync.transport, sync.timeout_s, sync.bucket_mb, sync.gloo_streams
    if name == "disk":
        return DiskTransport(num_attempts, timeout_s, pause_mode)
    if name == "tensor":
        return TensorTransport(timeout_s, bucket_mb, num_attempts, pause_mode)
    if name == "distributed":
        return DistributedTransport(timeout_s, bucket_mb, num_attempts, pause_mode, gloo_streams=gloo_streams)
    raise ValueError(f"sync.transport `{name}` is not available; use one of {', '.join(TRANSPORTS)}")


__all__ = [
    "TRANSPORTS",
    "DiskTransport",
    "DistributedTransport",
    "TensorTransport",
    "WeightSource",
    "WeightSyncError",
    "WeightTransport",
    "build_transport",
]
