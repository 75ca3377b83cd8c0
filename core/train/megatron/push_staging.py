"""The HF tensors a weight push sends, staged from this rank's megatron parameters.

A transport's first push stages the whole model once, to plan its buckets (the plan is kept:
core/weight_sync/session.py `plan`); every push then stages each bucket's names before sending
it (core/train/weight_source.py: Rank0WeightSource). At TP=1 a staged tensor is a view
of its parameter wherever the layouts allow (converter.to_hf's `views`); q/k/v, interleaved by
query group in the fused `linear_qkv`, are written into tensors kept from the last push and
laid out in one buffer per dtype. So every staged tensor keeps its address push after push
(the CUDA sender keeps its plans), most lie in the packed parameter buffer and the rest in the
q/k/v buffer, and a bucket of either is read where it lies (weight_sender.storage_groups,
cuda_sender.packed_placement). At TP>1 each tensor's shards are gathered (a collective: every
TP rank stages the same names) and concatenated, a new tensor each time.

Rules, beside the code that keeps them:
- A view reads the live parameters: the push sends before the next optimizer step (a rank
  runs one call at a time).
- A bucket stages only the megatron tensors its names come from (`_of_hf`), not the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from milepost.core.train.megatron.converter import Mapping, to_hf
from milepost.core.train.megatron.model import ModelSpec

Gather = Callable[[torch.Tensor], list[torch.Tensor]]  # a tensor's shards on every TP rank, in rank order


@dataclass(frozen=True)
class Source:
    """One megatron parameter and the HF tensors it makes."""
    name: str  # megatron global name
    mapping: Mapping
    param: torch.Tensor


class PushStaging:
    """Stages HF tensors from `sources` (in the model's order). `gather`: None at TP=1."""

    def __init__(self, sources: list[Source], spec: ModelSpec, gather: Gather | None) -> None:
        self.sources, self.spec, self.gather = sources, spec, gather
        self._of_hf = {hf: i for i, s in enumerate(sources) for hf in s.mapping.hf_names}
        self.kept: dict[str, torch.Tensor] = {}  # views: q/k/v staged last, by HF name

    def stage(self, wanted: set[str] | None) -> dict[str, torch.Tensor]:
        """The HF tensors `wanted` (all when None), by name, in the model's order; a name no
        parameter makes is left out (the sender names it in its error)."""
        picked = (list(range(len(self.sources))) if wanted is None
                  else sorted({self._of_hf[n] for n in wanted if n in self._of_hf}))
        views = self.gather is None
        staged: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i in picked:
                source = self.sources[i]
                t = source.param.detach()
                shards = [t] if self.gather is None or source.mapping.kind == "replicated" else self.gather(t)
                for n, full in to_hf(source.mapping, shards, self.spec, views=views, reuse=self.kept):
                    if wanted is None or n in wanted:
                        staged[n] = full
                    if views and source.mapping.kind == "qkv":
                        self.kept[n] = full
        if views and self._pack_kept():
            staged = {n: self.kept.get(n, t) for n, t in staged.items()}
        return staged

    def _pack_kept(self) -> bool:
        """Lay the kept q/k/v tensors out back to back in one buffer per dtype, once (later
        pushes write into them); True if it moved them."""
        storages: dict[torch.dtype, set[int]] = {}
        for t in self.kept.values():
            storages.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
        scattered = [d for d, ptrs in storages.items() if len(ptrs) > 1]
        for dtype in scattered:
            names = [n for n, t in self.kept.items() if t.dtype == dtype]
            first = self.kept[names[0]]
            buf, pos = torch.empty(sum(self.kept[n].numel() for n in names), dtype=dtype, device=first.device), 0
            for n in names:
                view = buf[pos:pos + self.kept[n].numel()].view(self.kept[n].shape)
                view.copy_(self.kept[n])
                pos += view.numel()
                self.kept[n] = view
        return bool(scattered)
