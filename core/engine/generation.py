"""Batched generation with a KV cache on a HF causal LM (CPU, fp32).

Rows are left-padded and carry explicit position_ids (cumsum(mask) - 1), so a padded row
computes what the same prompt would alone. Finished rows are dropped from the batch and
the KV cache after every step, so a long tail costs only its own rows.

Logprob convention (docs/CONTRACTS.md): the logprob of a token is log_softmax(logits / T)
at that token (raw logits when T == 0), taken BEFORE top-k / top-p / min-p truncation and
before the min_new_tokens stop mask, because the trainer recomputes exactly that.
"""

from __future__ import annotations

import inspect
import random
import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from milepost.core.engine import routing_capture


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    sampling_seed: int | None = None


@dataclass
class Sequence:
    """One sample to generate. The scheduler owns it; only `abort_message` may be set
    from another thread (read once per step by the generation loop)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = ""
    seed: int = 0
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    on_done: Callable[[Sequence], None] | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (core/engine/lora_adapter.py); None: base
    routed_experts: list[torch.Tensor] = field(default_factory=list)  # [positions, layers, top_k] per forward

    def finished(self) -> None:
        """Hand the finished sequence to its owner (`on_done`, where one waits for it)."""
        if self.on_done is not None:
            self.on_done(self)

    def reset(self) -> None:
        """Forget partial output (retract): it is recomputed from the same seed."""
        self.output_ids, self.output_logprobs, self.input_logprobs = [], [], []
        self.routed_experts = []
        self.finish_reason = None


def make_sequences(prompt_ids: list[int], params: SamplingParams, n: int, rid: str = "",
                   logprob_start_len: int = -1) -> list[Sequence]:
    """n samples of one prompt, as SGLang makes them: the same params copied into each.
    With a `sampling_seed` every sample uses that seed, so the n samples are identical
    (SGLang with --enable-deterministic-inference; without it SGLang ignores the seed).
    Distinct reproducible samples: one input per sample, each with its own seed and n = 1
    (what milepost's rollout sends). Without a seed each sample draws its own."""
    seeds = [params.sampling_seed] * n if params.sampling_seed is not None else [random.getrandbits(62)
                                                                                for _ in range(n)]
    return [Sequence(list(prompt_ids), params, rid, seed, logprob_start_len) for seed in seeds]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _scaled_logprobs(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) per row, raw logits where T == 0."""
    t = torch.where(temps > 0, temps, torch.ones_like(temps)).unsqueeze(-1)
    return torch.log_softmax(logits.float() / t, dim=-1)


def _truncate(logprobs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply top-k, top-p and min-p to one row of logprobs; returns masked logprobs."""
    lp = logprobs.clone()
    if 0 < p.top_k < lp.numel():
        kth = torch.topk(lp, p.top_k).values[-1]
        lp[lp < kth] = float("-inf")
    if p.top_p < 1.0:
        sorted_lp, order = torch.sort(lp, descending=True)
        cum = torch.cumsum(sorted_lp.exp(), dim=0)
        drop = (cum - sorted_lp.exp()) > p.top_p  # keep the token that crosses top_p
        lp[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        lp[lp < lp.max() + torch.log(torch.tensor(p.min_p))] = float("-inf")
    return lp


def _sample_rows(logprobs: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row in `rows`, each drawn with its own sequence's generator: exactly the
    token `torch.multinomial(truncated_row.exp(), 1, generator)` draws (the same exponential
    race, argmax(p / Exp(1))), so outputs do not depend on the batch a sequence runs in. The
    noise is drawn row by row (one generator each); the rest is batched: a multinomial call
    per row cost most of a decode step for large batches of small models."""
    lp = logprobs[rows]
    for j, p in enumerate(params):
        if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
            lp[j] = _truncate(lp[j], p)
    probs = lp.exp()
    if not bool(torch.isfinite(probs).all()) or bool((probs.sum(-1) <= 0).any()):
        raise ValueError("invalid sampling distribution (NaN or infinite logits, or every token "
                         "masked): check the model's weights and the sampling parameters")
    noise = torch.empty_like(probs)
    for j, g in enumerate(gens):
        noise[j].exponential_(1, generator=g)
    return (probs / noise).argmax(-1)


class Generator:
    """Runs batches of `Sequence`s to completion on one model.

    Concurrency: `run_batch` is called from one thread (the scheduler). `model_lock`, if
    given, is held around each forward pass only, so a weight update can take it between
    steps and never lands mid-forward. `step_hook` is called before every step without the
    lock held; it may block (in-place pause) and returns True to retract the batch.
    """

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int = 0,
                 decode: Callable[[list[int]], str] | None = None, batch_invariant: bool = False) -> None:
        """`batch_invariant` (SGLang's --enable-deterministic-inference): every sequence is
        decoded alone, so its logprobs do not depend on what else is in the batch. In a batch
        they do, by ~1e-6 (the matmuls' blocking and the padded attention width change with
        the batch), and the trainer uses them (TIS): a step whose requests were batched
        differently trains different low bits, and a resumed run is no longer bitwise the
        uninterrupted one. Tokens are the same either way (each sequence samples from its
        own generator). Costs a forward per sequence and token instead of per batch."""
        self.model = model
        self.batch_invariant = batch_invariant
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.decode = decode  # needed only for stop strings
        # transformers renamed the KV-cache argument (`past_key_values` -> `cache`, 5.2x) and a
        # model silently ignores the name it does not know, decoding without context.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.route_tap: Any = None  # a RouterTap: the routes of every forward are kept (routing_capture.py)

    def _forward(self, ids, mask, pos, cache, all_logits: bool, lock) -> torch.Tensor:
        with lock or nullcontext(), torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=0 if all_logits else 1, **{self._cache_kw: cache})
        if cache.get_seq_length() < ids.shape[1]:
            raise RuntimeError(f"the model did not fill the KV cache passed as `{self._cache_kw}` "
                               "(transformers version mismatch?); generation would lose its context")
        return out.logits

    def run_batch(self, seqs: list[Sequence], model_lock: threading.Lock | None = None,
                  step_hook: Callable[[], bool] | None = None) -> bool:
        """Generate for every sequence; returns False if retracted (outputs reset)."""
        if not self.batch_invariant or len(seqs) <= 1:
            return self._run_together(seqs, model_lock, step_hook)
        for s in seqs:
            if not self._run_together([s], model_lock, step_hook):
                for other in seqs:
                    other.reset()
                return False
        return True

    def _run_together(self, seqs: list[Sequence], model_lock: threading.Lock | None,
                      step_hook: Callable[[], bool] | None) -> bool:
        for s in seqs:
            s.reset()
        gens = [torch.Generator().manual_seed(s.seed) for s in seqs]
        ids, mask = _left_pad([s.prompt_ids for s in seqs], self.pad_token_id)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        need_input = any(s.logprob_start_len >= 0 for s in seqs)
        if step_hook is not None and step_hook():
            return False
        logits = self._forward(ids, mask, pos, cache, need_input, model_lock)
        if self.route_tap is not None:
            routing_capture.record(self.route_tap, seqs, mask)
        if need_input:
            self._score_prompts(seqs, logits, mask)
        for s in seqs:
            if s.params.max_new_tokens <= 0:  # prefill scoring only
                s.finish_reason = {"type": "length", "length": 0}
        live = list(range(len(seqs)))
        last = logits[:, -1]
        while True:
            keep = [k for k, i in enumerate(live) if seqs[i].finish_reason is None]
            if not keep:
                return True
            if len(keep) < len(live):  # drop finished rows from the batch and KV cache
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                mask, pos, last = mask[idx], pos[idx], last[idx]
                live = [live[k] for k in keep]
            tokens = self._sample_step(seqs, gens, live, last)
            for k, i in enumerate(live):
                self._advance(seqs[i], tokens[k])
            if all(seqs[i].finish_reason is not None for i in live):
                return True
            if step_hook is not None and step_hook():
                for s in seqs:
                    s.reset()
                return False
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype)], dim=1)
            pos = pos[:, -1:] + 1
            last = self._forward(tokens.unsqueeze(-1), mask, pos, cache, False, model_lock)[:, -1]
            if self.route_tap is not None:
                routing_capture.record(self.route_tap, [seqs[i] for i in live], None)

    def _score_prompts(self, seqs: list[Sequence], logits: torch.Tensor, mask: torch.Tensor) -> None:
        width = mask.shape[1]
        for i, s in enumerate(seqs):
            if s.logprob_start_len < 0:
                continue
            off = width - len(s.prompt_ids)
            t = torch.tensor([s.params.temperature])
            lp = _scaled_logprobs(logits[i, off:], t.expand(len(s.prompt_ids)))
            for j in range(s.logprob_start_len, len(s.prompt_ids)):
                s.input_logprobs.append(None if j == 0 else lp[j - 1, s.prompt_ids[j]].item())

    def _sample_step(self, seqs, gens, live, last: torch.Tensor) -> torch.Tensor:
        """Pick one token per live row; records its (untruncated) logprob."""
        temps = torch.tensor([seqs[i].params.temperature for i in live], dtype=torch.float32)
        lp = _scaled_logprobs(last, temps)
        masked = lp
        blocked = [k for k, i in enumerate(live) if len(seqs[i].output_ids) < seqs[i].params.min_new_tokens]
        if blocked:  # min_new_tokens: stop tokens may not be sampled yet
            masked = lp.clone()
            for k in blocked:
                masked[k, list(self._stop_ids(seqs[live[k]].params))] = float("-inf")
        tokens = masked.argmax(-1)
        sampled = [k for k, i in enumerate(live) if seqs[i].params.temperature > 0]
        if sampled:
            tokens[sampled] = _sample_rows(masked, sampled, [seqs[live[k]].params for k in sampled],
                                           [gens[live[k]] for k in sampled])
        chosen = lp.gather(1, tokens.unsqueeze(-1)).squeeze(-1).tolist()  # one sync, not one per row
        for k, i in enumerate(live):
            seqs[i].output_logprobs.append(chosen[k])
        return tokens

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)

    def _advance(self, s: Sequence, token: torch.Tensor) -> bool:
        """Append a token; returns True when the sequence is finished."""
        tok = int(token)
        s.output_ids.append(tok)
        p = s.params
        if s.abort_message is not None:
            s.finish_reason = {"type": "abort", "message": s.abort_message}
        elif tok in self._stop_ids(p) and len(s.output_ids) > p.min_new_tokens:
            s.finish_reason = {"type": "stop", "matched": tok}
        elif p.stop and self.decode is not None and self._matched_str(s) is not None:
            s.finish_reason = {"type": "stop", "matched": self._matched_str(s)}
        elif len(s.output_ids) >= p.max_new_tokens:
            s.finish_reason = {"type": "length", "length": p.max_new_tokens}
        return s.finish_reason is not None

    def _matched_str(self, s: Sequence) -> str | None:
        if self.decode is None:  # no tokenizer: no stop strings
            return None
        tail = self.decode(s.output_ids[-16:])
        return next((x for x in s.params.stop if tail.endswith(x)), None)
