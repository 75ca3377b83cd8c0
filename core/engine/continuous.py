"""Continuous batching on the static-cache fast path (static_model.py, device_sampling.py).

Live sequences occupy rows 0..n-1 of the decode batch, each row its own cache slot. Every
iteration: new sequences are admitted into free slots (a prefill, which samples their first
token), then one decode step runs for every live row. A finished row leaves at once (its
`finished` callback fires) and the last live rows move into the holes, so the batch stays
dense and the next step runs at the smallest captured size that holds it.

Outputs stay on the device until a sequence finishes: tokens and logprobs of every step go
into [slots, max_len] buffers, and a step reads back only one flag per row, so the host's
per-step work does not grow with the batch (Python bookkeeping of each token per row cost
as much as the GPU step at batch 256).

Concurrency (as generation.Generator): `model_lock` is held around each prefill and decode
step only; `step_hook` runs between steps, may block (in-place pause) and returns True to
retract (every live sequence is reset and handed back). `batch_invariant`: decode always at
the largest captured batch and the full cache length, prefill one sequence at a time, so a
sequence's logits do not depend on the others (SGLang's --enable-deterministic-inference).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext

import torch

from milepost.core.engine.device_sampling import RowParams, sample
from milepost.core.engine.generation import Sequence
from milepost.core.engine.static_model import StaticDecoder

MAX_STOP_IDS = 32  # stop tokens per sequence (eos + stop_token_ids) the device table holds
PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (bounds its activations)


class ContinuousGenerator:
    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], num_slots: int, max_len: int,
                 decode: Callable[[list[int]], str] | None = None, use_graphs: bool = True,
                 batch_invariant: bool = False) -> None:
        self.decoder = StaticDecoder(model, num_slots, max_len, use_graphs)
        self.eos_token_ids, self.decode_text = list(eos_token_ids), decode
        self.num_slots, self.max_len, self.batch_invariant = num_slots, max_len, batch_invariant
        self.rows: list[Sequence] = []
        self.pos: list[int] = []  # each row's input position of the next step
        dev = self.decoder.device

        def zeros(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.zeros(num_slots, *shape, dtype=dtype, device=dev)

        self.buf = {  # per-row state on the device; moved together on compaction
            "out_tokens": zeros(torch.long, max_len), "out_logprobs": zeros(torch.float32, max_len),
            "n_out": zeros(torch.long), "temperature": zeros(torch.float32), "top_k": zeros(torch.long),
            "top_p": zeros(torch.float32), "min_p": zeros(torch.float32), "seed": zeros(torch.long),
            "max_new": zeros(torch.long), "min_new": zeros(torch.long), "stopped": zeros(torch.bool),
            "stop_ids": torch.full((num_slots, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)}

    # ---- the loop ----
    def run(self, admit: Callable[[int], list[Sequence]], finished: Callable[[Sequence], None],
            model_lock: threading.Lock | None = None, step_hook: Callable[[], bool] | None = None) -> bool:
        """Serve until nothing is live and `admit(free_slots)` offers nothing. False when
        retracted: every live sequence was reset and is returned by `take_live()`."""
        lock = model_lock or nullcontext()
        self.decoder.allocate()
        while True:
            if step_hook is not None and step_hook():
                for s in self.rows:
                    s.reset()
                return False
            new = admit(self.num_slots - len(self.rows))
            for chunk in ([[s] for s in new] if self.batch_invariant else _prefill_chunks(new)):
                with lock:
                    first, done = len(self.rows), self._prefill(chunk)
                self._finish_rows(finished, done, first)
            if not self.rows:
                return True
            with lock:
                done = self._step()
            self._finish_rows(finished, done, 0)

    def take_live(self) -> list[Sequence]:
        """The live sequences (after a retract), leaving the generator empty."""
        live, self.rows, self.pos = self.rows, [], []
        return live

    # ---- admission ----
    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run `seqs` into the next free rows and sample their first tokens; → done flags."""
        for s in seqs:
            s.reset()
        first = len(self.rows)
        rows = torch.arange(first, first + len(seqs), device=self.decoder.device)
        self._write_params(rows, seqs)
        scoring = any(s.logprob_start_len >= 0 for s in seqs)
        with torch.inference_mode():
            logits = self.decoder.prefill([s.prompt_ids for s in seqs], first, all_logits=scoring)
            if scoring:
                self._score_prompts(seqs, logits)
                lens = torch.tensor([len(s.prompt_ids) - 1 for s in seqs], device=logits.device)
                logits = logits[torch.arange(len(seqs), device=logits.device), lens]
            self.rows += seqs
            self.pos += [len(s.prompt_ids) for s in seqs]
            self.decoder.in_pos[rows] = torch.tensor(self.pos[first:], device=rows.device)
            done = self._sample_into(rows, logits)
        for s in seqs:
            if s.params.max_new_tokens <= 0:  # prefill scoring only: no token is kept
                s.finish_reason = {"type": "length", "length": 0}
        return done

    def _write_params(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        b, cpu = self.buf, lambda values, dtype: torch.tensor(values, dtype=dtype).to(rows.device)
        b["n_out"][rows] = 0
        b["temperature"][rows] = cpu([s.params.temperature for s in seqs], torch.float32)
        b["top_k"][rows] = cpu([s.params.top_k for s in seqs], torch.long)
        b["top_p"][rows] = cpu([s.params.top_p for s in seqs], torch.float32)
        b["min_p"][rows] = cpu([s.params.min_p for s in seqs], torch.float32)
        b["seed"][rows] = cpu([_signed64(s.seed) for s in seqs], torch.long)
        b["max_new"][rows] = cpu([s.params.max_new_tokens for s in seqs], torch.long)
        b["min_new"][rows] = cpu([s.params.min_new_tokens for s in seqs], torch.long)
        stops = torch.full((len(seqs), MAX_STOP_IDS), -1, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids = sorted(set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(self.eos_token_ids)))
            if len(ids) > MAX_STOP_IDS:
                raise ValueError(f"{len(ids)} stop token ids; the fast path takes at most {MAX_STOP_IDS}")
            stops[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        b["stop_ids"][rows] = stops.to(rows.device)

    def _score_prompts(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """input_logprobs from prefill logits [B, T, V] (the convention of generation.py)."""
        from milepost.core.engine.device_sampling import scaled_logprobs
        for i, s in enumerate(seqs):
            if s.logprob_start_len < 0:
                continue
            n = len(s.prompt_ids)
            temps = torch.full((n,), s.params.temperature, device=logits.device)
            lp = scaled_logprobs(logits[i, :n], temps)
            picked = lp[:-1].gather(1, torch.tensor(s.prompt_ids[1:], device=lp.device).unsqueeze(1))[:, 0].tolist()
            s.input_logprobs = [None if j == 0 else picked[j - 1] for j in range(s.logprob_start_len, n)]

    # ---- decoding ----
    def _step(self) -> torch.Tensor:
        n = len(self.rows)
        with torch.inference_mode():
            logits = self.decoder.decode(n, max(self.pos), fixed=self.batch_invariant)
            rows = torch.arange(n, device=logits.device)
            done = self._sample_into(rows, logits)
        self.pos = [p + 1 for p in self.pos]
        self.decoder.in_pos[:n] += 1
        return done

    def _sample_into(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Sample a token for each of `rows` (a contiguous range) and store it; → done flags."""
        b, lo, hi = self.buf, int(rows[0]), int(rows[-1]) + 1
        live = self.rows[lo:hi]
        trunc = any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in live)
        p = RowParams(b["temperature"][lo:hi], b["top_k"][lo:hi], b["top_p"][lo:hi], b["min_p"][lo:hi],
                      b["seed"][lo:hi], trunc)
        n_out, stop_ids, min_new = b["n_out"][lo:hi], b["stop_ids"][lo:hi], b["min_new"][lo:hi]
        blocked = None
        if any(s.params.min_new_tokens > 0 for s in live):
            blocked = _stop_mask(stop_ids, logits.shape[-1]) & (n_out < min_new).unsqueeze(-1)
        tokens, logprobs = sample(logits, p, n_out, blocked)
        b["out_tokens"][rows, n_out] = tokens
        b["out_logprobs"][rows, n_out] = logprobs
        n_out += 1
        self.decoder.in_tokens[lo:hi] = tokens
        b["stopped"][lo:hi] = (stop_ids == tokens.unsqueeze(-1)).any(-1) & (n_out > min_new)
        return b["stopped"][lo:hi] | (n_out >= b["max_new"][lo:hi])

    # ---- leaving ----
    def _finish_rows(self, finished: Callable[[Sequence], None], done: torch.Tensor, first: int) -> None:
        """Finish rows that are done (device flags of rows first.., one read-back), aborted,
        or stopped by a stop string."""
        flagged = {first + i for i in done.nonzero()[:, 0].tolist()}
        flagged |= {i for i, s in enumerate(self.rows) if s.abort_message is not None or s.finish_reason}
        flagged |= self._stop_string_rows(flagged)
        if not flagged:
            return
        ending = sorted(flagged)
        idx = torch.tensor(ending, device=self.decoder.device)
        b = self.buf
        n_out, stopped = b["n_out"][idx].tolist(), b["stopped"][idx].tolist()
        tokens, logprobs = b["out_tokens"][idx].tolist(), b["out_logprobs"][idx].tolist()
        for k, i in enumerate(ending):
            s = self.rows[i]
            n = min(n_out[k], max(0, s.params.max_new_tokens))
            s.output_ids, s.output_logprobs = tokens[k][:n], logprobs[k][:n]
            s.finish_reason = s.finish_reason or _reason(s, stopped[k], self._matched(s))
        left = [self.rows[i] for i in ending]
        self._compact(ending)
        for s in left:
            finished(s)

    def _stop_string_rows(self, skip: set[int]) -> set[int]:
        decode = self.decode_text
        if decode is None:  # no tokenizer: no stop strings
            return set()
        rows = [i for i, s in enumerate(self.rows) if s.params.stop and i not in skip]
        if not rows:
            return set()
        idx = torch.tensor(rows, device=self.decoder.device)
        n_out = self.buf["n_out"][idx].tolist()
        tails = self.buf["out_tokens"][idx].tolist()
        return {i for k, i in enumerate(rows)
                if any(decode(tails[k][max(0, n_out[k] - 16):n_out[k]]).endswith(x)
                       for x in self.rows[i].params.stop)}

    def _matched(self, s: Sequence) -> str | None:
        if not (s.params.stop and self.decode_text):
            return None
        tail = self.decode_text(s.output_ids[-16:])
        return next((x for x in s.params.stop if tail.endswith(x)), None)

    def _compact(self, ending: list[int]) -> None:
        """Drop rows `ending`; the last live rows move into their places."""
        keep, gone = len(self.rows) - len(ending), set(ending)
        holes = [i for i in ending if i < keep]
        movers = [i for i in range(keep, len(self.rows)) if i not in gone]
        for src, dst in zip(movers, holes):
            self.rows[dst], self.pos[dst] = self.rows[src], self.pos[src]
        if movers:
            self.decoder.move_rows(movers, holes)
            s, d = (torch.tensor(x, device=self.decoder.device) for x in (movers, holes))
            for t in self.buf.values():
                t[d] = t[s]
        del self.rows[keep:], self.pos[keep:]


def _reason(s: Sequence, stopped: bool, matched: str | None) -> dict:
    if s.abort_message is not None:
        return {"type": "abort", "message": s.abort_message}
    if stopped:
        return {"type": "stop", "matched": s.output_ids[-1]}
    if matched is not None:
        return {"type": "stop", "matched": matched}
    return {"type": "length", "length": s.params.max_new_tokens}


def _stop_mask(stop_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, K] stop ids (-1 padded) → [B, V] bool."""
    mask = torch.zeros((stop_ids.shape[0], vocab + 1), dtype=torch.bool, device=stop_ids.device)
    mask.scatter_(1, torch.where(stop_ids >= 0, stop_ids, vocab), True)
    return mask[:, :vocab]


def _prefill_chunks(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Groups whose padded size stays within PREFILL_TOKENS (one sequence at least)."""
    chunks: list[list[Sequence]] = []
    for s in seqs:
        group = chunks[-1] if chunks else None
        width = max([len(x.prompt_ids) for x in group or []] + [len(s.prompt_ids)])
        if group is None or width * (len(group) + 1) > PREFILL_TOKENS:
            chunks.append([s])
        else:
            group.append(s)
    return chunks


def _signed64(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed
