"""Micro-batches for megatron's forward-backward schedule, and the RL loss on its logits.

A micro-batch is either padded rows (`pack_sequences: false`: micro_batch_size samples,
right-padded, causal attention so padding never reaches a real token) or one packed row
(`pack_sequences: true`: samples concatenated up to micro_batch_tokens, attention and RoPE
restarting at every sample through PackedSeqParams / cu_seqlens). Either way the loss tensors
come from `batch.collate`, and the hidden states that predict response tokens are picked at
`pick_rows, pick_cols`, so the loss is the very same `rl_loss` call as the torch backend's.

The model returns hidden states; the output layer runs at the picked positions only, and
its vocabulary-parallel logits [B, T, V/tp] are all-gathered across tensor-parallel ranks
(autograd-aware: backward keeps each rank's slice), the padded vocabulary rows dropped, then
log_softmax / entropy as `train/logprobs.py` computes them, a chunk of rows at a time (head.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from milepost.core.algo.losses import rl_loss_on_device, scalars_read
from milepost.core.config import AlgoConfig
from milepost.core.train.batch import collate, split_micro_batches
from milepost.core.train.megatron.head import logprobs_and_entropy, response_logits
from milepost.core.train.megatron.routing import micro_batch_routes
from milepost.core.types import Sample


@dataclass
class MicroBatch:
    input_ids: Tensor  # [b, L] (packed: [1, sum of lengths])
    position_ids: Tensor  # [b, L]
    cu_seqlens: Tensor | None  # int32 [n + 1] when packed
    max_seqlen: int
    pick_rows: Tensor  # [B, T]: row of the logit predicting response token t of sample i
    pick_cols: Tensor  # [B, T]: its position in that row
    batch: dict[str, Tensor]  # collate(...) of the samples: loss tensors [B, T]
    routes: Tensor | None = None  # MoE: the engine's experts [layers, tokens, top_k] in megatron's order

    def to(self, device: torch.device, pinned: bool = True) -> MicroBatch:
        """On `device`, without waiting for it. Why pinned: CUDA makes a copy from pageable host
        memory wait for everything queued on the stream, and a micro-batch moves while the one
        before it is still queued, so each of its ~15 tensors drained the GPU's queue (after
        which the GPU idles until the host has launched the next kernels). `pinned=False`: from
        pageable memory (bench/fp8_training.py's `/waits` modes measure the difference)."""
        pin = pinned and device.type == "cuda"

        def move(t: Tensor) -> Tensor:
            return (t.pin_memory() if pin and t.device.type == "cpu" else t).to(device, non_blocking=True)

        return MicroBatch(move(self.input_ids), move(self.position_ids),
                          None if self.cu_seqlens is None else move(self.cu_seqlens), self.max_seqlen,
                          move(self.pick_rows), move(self.pick_cols), {k: move(v) for k, v in self.batch.items()},
                          None if self.routes is None else move(self.routes))


def pack_groups(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Consecutive groups of samples with at most max_tokens tokens each (a longer sample is
    a group of its own)."""
    groups: list[list[Sample]] = []
    size = 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        if groups and size + n <= max_tokens:
            groups[-1].append(s)
            size += n
        else:
            groups.append([s])
            size = n
    return groups


def _routes(samples: list[Sample], batch: dict[str, Tensor], packed: bool,
            route_shape: tuple[int, int] | None) -> Tensor | None:
    if route_shape is None:
        return None
    return micro_batch_routes(samples, packed, batch["input_ids"].shape[1], *route_shape)


def _padded(samples: list[Sample], pad_id: int, route_shape: tuple[int, int] | None = None) -> MicroBatch:
    batch = collate(samples, pad_id)
    b, t = batch["logit_index"].shape
    rows = torch.arange(b).unsqueeze(-1).expand(b, t).contiguous()
    return MicroBatch(batch["input_ids"], batch["position_ids"], None, batch["input_ids"].shape[1],
                      rows, batch["logit_index"], batch, _routes(samples, batch, False, route_shape))


def _packed(samples: list[Sample], pad_id: int, route_shape: tuple[int, int] | None = None) -> MicroBatch:
    batch = collate(samples, pad_id)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    ids = torch.tensor([tok for s in samples for tok in s.prompt_ids + s.response_ids], dtype=torch.long)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cols = batch["logit_index"] + starts.unsqueeze(-1)  # junk (masked) entries stay in range
    return MicroBatch(ids.unsqueeze(0), pos.unsqueeze(0), cu, max(lengths), torch.zeros_like(cols), cols, batch,
                      _routes(samples, batch, True, route_shape))


def build_micro_batches(samples: list[Sample], pad_id: int, pack: bool, micro_batch_size: int,
                        micro_batch_tokens: int, route_shape: tuple[int, int] | None = None) -> list[MicroBatch]:
    """`route_shape` (MoE: (router layers, top_k)) lays each micro-batch's routed experts out
    in megatron's token order (`MicroBatch.routes`); None: no routes."""
    if pack:
        return [_packed(g, pad_id, route_shape) for g in pack_groups(samples, micro_batch_tokens)]
    return [_padded(g, pad_id, route_shape) for g in split_micro_batches(samples, micro_batch_size)]


def micro_batch_loss(hidden: Tensor, model: Any, mb: MicroBatch, algo: AlgoConfig, temperature: float,
                     normalizer: float, vocab_size: int, tp_size: int, ref_logprobs: Tensor | None = None,
                     fuse: bool = True, on_logprobs: Callable[[Tensor], dict[str, float]] | None = None
                     ) -> tuple[Tensor, dict[str, Tensor | float]]:
    """rl_loss of one micro-batch (sum over its loss tokens / the step's loss-token count).
    `on_logprobs(logprobs [B, T])`: more metrics from the trained logprobs (routing replay's).
    Metrics stay on the device (`rl_loss_on_device`: nothing here waits for the GPU between the
    forward and the backward); `metrics_read` turns a schedule's into floats, all at once."""
    batch = mb.batch
    logprobs, entropy = response_logprobs(hidden, model, mb, vocab_size, tp_size, temperature, fuse)
    if algo.entropy_coef == 0:
        entropy = entropy.detach()
    loss, on_device = rl_loss_on_device(logprobs, logprobs.detach(), batch["engine_logprobs"], batch["advantages"],
                                        batch["loss_mask"], algo, normalizer, ref_logprobs=ref_logprobs,
                                        entropy=entropy)
    metrics: dict[str, Tensor | float] = dict(on_device)
    # engine vs trainer logprobs of the same weights (as the torch backend reports), over the loss tokens
    mask = batch["loss_mask"].bool()
    gap = torch.where(mask, (logprobs.detach() - batch["engine_logprobs"]).abs(), 0.0)
    metrics["train/engine_logprob_diff_max"] = gap.amax()
    metrics["train/engine_logprob_absdiff_sum"] = gap.sum()
    metrics[_GAP_TOKENS] = mask.sum()
    metrics["train/loss"] = loss.detach()
    if on_logprobs is not None:
        metrics.update(on_logprobs(logprobs.detach()))
    return loss, metrics


_GAP_TOKENS = "_gap_tokens"  # micro_batch_loss -> metrics_read: the gap metrics count only with loss tokens


def metrics_read(per_micro: list[dict[str, Tensor | float]]) -> list[dict[str, float]]:
    """`micro_batch_loss`'s metrics of a schedule as floats, read back from the device in one copy
    (one wait for the GPU, after the schedule). A micro-batch without loss tokens reports no gap."""
    values = iter(scalars_read([v for m in per_micro for v in m.values() if isinstance(v, Tensor)]))
    out = []
    for m in per_micro:
        read = {k: next(values) if isinstance(v, Tensor) else float(v) for k, v in m.items()}
        if read.pop(_GAP_TOKENS, 1.0) == 0:
            read.pop("train/engine_logprob_diff_max", None)
            read.pop("train/engine_logprob_absdiff_sum", None)
        out.append(read)
    return out


def forward_hidden(model: Any, mb: MicroBatch) -> Tensor:
    """The model's final hidden states [s, b, h] for a micro-batch (`HiddenStatesGPTModel`;
    on a non-last pipeline stage, the hidden state it sends on)."""
    packed = None
    if mb.cu_seqlens is not None:
        from megatron.core.packed_seq_params import PackedSeqParams
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                                 max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
    return model(mb.input_ids, mb.position_ids, None, packed_seq_params=packed)


def response_logprobs(hidden: Tensor, model: Any, mb: MicroBatch, vocab_size: int, tp_size: int,
                      temperature: float, fuse: bool = True) -> tuple[Tensor, Tensor]:
    """(logprobs, entropy) [B, T] of the response tokens, from the last stage's hidden states."""
    logits = response_logits(model, hidden, mb.pick_rows, mb.pick_cols, vocab_size, tp_size)
    return logprobs_and_entropy(logits, mb.batch["target_ids"], temperature, compiled=fuse)
