"""The builtin models' supervised warm-start and their greedy eval, on the CPU or a GPU.

On the CPU (tiny-arith, tiny-arith-moe) this is the procedure the CPU recipes' numbers come
from, unchanged bit for bit: fp32, torch's default AdamW, the loss read every step. On a
CUDA device (`builtin:gpu-arith` where one is present) the same loop runs with bf16 autocast
over fp32 weights and the fused AdamW kernel, and the loss is read only at the end, so the
host never waits on the device inside the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from milepost.core.data.arith import either_form_correct


@dataclass(frozen=True)
class Schedule:
    """What the warm-start runs: steps of `batch_size` rows, peak lr, linear warm-up, then cosine."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 0
    # CUDA only: pad every batch to one length and run forward and backward through
    # torch.compile, so the many small kernels of an eager 12-layer step become fewer fused
    # ones (bench/warmstart_speed.py measures both). Ignored on the CPU.
    compile: bool = False


def train_device(prefer_cuda: bool) -> torch.device:
    """A CUDA device when asked for and present, else the CPU."""
    return torch.device("cuda" if prefer_cuda and torch.cuda.is_available() else "cpu")


def _lr_factor(schedule: Schedule) -> Any:
    total = max(1, schedule.steps)

    def factor(step: int) -> float:
        # Cosine decay + clipping: a constant lr made tiny-arith's accuracy swing 5%..60% across seeds.
        cosine = 0.5 * (1 + math.cos(math.pi * step / total))
        if schedule.warmup_steps:  # gpu-arith's 12 layers start gently; tiny-arith has none
            return cosine * min(1.0, (step + 1) / schedule.warmup_steps)
        return cosine
    return factor


def _char_table(tokenizer: Any) -> np.ndarray:
    """byte -> id for a per-character tokenizer (the builtin models'): each one-character
    token's id, and for any other byte the id the tokenizer gives an unknown character."""
    table = np.full(256, tokenizer.unk_token_id, dtype=np.int64)
    for token, index in tokenizer.get_vocab().items():
        if len(token) == 1 and ord(token) < 256:
            table[ord(token)] = index
    return table


def batch(rows: list[dict[str, str]], targets: list[str], tokenizer: Any, length: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt + target + eos, right-padded (to `length` when given, else to the longest); the
    mask selects target and eos tokens only.
    The builtin tokenizer gives one token per character, so a batch is encoded through a byte
    table in numpy: the same ids as the tokenizer (tests/unit/test_warmstart_batch.py), at
    ~1 ms instead of ~30 ms per 512 rows, which kept the GPU warm-start waiting on the host."""
    texts = np.array([r["prompt"] + t for r, t in zip(rows, targets)], dtype=np.bytes_)  # ASCII sums
    codes = texts.view(np.uint8).reshape(len(texts), -1)  # zero-padded to the longest
    text_len = np.char.str_len(texts)
    prompt_len = np.array([len(r["prompt"]) for r in rows])
    column = np.arange(max(int(text_len.max()) + 1, length or 0))[None, :]
    x = np.full((len(texts), column.shape[1]), tokenizer.pad_token_id, dtype=np.int64)
    x[:, :codes.shape[1]] = np.where(codes != 0, _char_table(tokenizer)[codes], tokenizer.pad_token_id)
    x[np.arange(len(texts)), text_len] = tokenizer.eos_token_id
    m = (column >= prompt_len[:, None]) & (column <= text_len[:, None])
    return torch.from_numpy(x), torch.from_numpy(m.astype(np.float32))


def _masked_nll(model: Any, x: torch.Tensor, m: torch.Tensor, aux_loss_coef: float) -> torch.Tensor:
    out = model(input_ids=x, output_router_logits=True) if aux_loss_coef else model(input_ids=x)
    logits = out.logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                            reduction="none")
    loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
    return loss + aux_loss_coef * out.aux_loss if aux_loss_coef else loss


def warmstart(model: Any, tokenizer: Any, rows: list[dict[str, str]], targets: list[str], schedule: Schedule,
              aux_loss_coef: float = 0.0) -> float:
    """Supervised training on the answers only (`targets[i]` for `rows[i]`, in order), on the
    model's device; the last step's loss. `aux_loss_coef` (MoE models): weight of the router's
    load-balancing loss, so every expert keeps being used and routing stays a real choice."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    compiled = cuda and schedule.compile
    nll = torch.compile(_masked_nll, dynamic=False) if compiled else _masked_nll
    # One shape for every batch, so the compiled step is built once.
    length = max(len(r["prompt"]) + len(t) for r, t in zip(rows, targets)) + 1 if compiled else None
    opt = torch.optim.AdamW(model.parameters(), lr=schedule.lr, fused=True if cuda else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor(schedule))
    loss = torch.tensor(float("nan"))
    bs = schedule.batch_size
    model.train()
    for step in range(schedule.steps):
        x, m = batch(rows[step * bs:(step + 1) * bs], targets[step * bs:(step + 1) * bs], tokenizer, length)
        if cuda:  # from pageable memory a copy waits for the device: the host could never run ahead
            x, m = x.pin_memory(), m.pin_memory()
        x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = nll(model, x, m, aux_loss_coef)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, str]], max_new_tokens: int = 5
                    ) -> dict[str, float]:
    """Greedy answers scored by exact match (`accuracy`) and by value in either form
    (`either_form`); prompts are batched by length so there is no padding."""
    device = next(model.parameters()).device
    by_len: dict[int, list[dict[str, str]]] = {}
    for row in rows:
        by_len.setdefault(len(row["prompt"]), []).append(row)
    exact = either = 0
    for group in by_len.values():
        x = torch.tensor([tokenizer.encode(r["prompt"], add_special_tokens=False) for r in group], device=device)
        start = x.shape[1]
        for _ in range(max_new_tokens):  # no KV cache: sequences are a dozen tokens long
            x = torch.cat([x, model(input_ids=x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for row, ids in zip(group, x[:, start:].tolist()):
            ids = ids[:ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            exact += text == row["label"]
            either += either_form_correct(text, row["label"])
    n = max(1, len(rows))
    return {"accuracy": exact / n, "either_form": either / n}
