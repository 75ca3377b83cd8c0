"""precision.rollout side by side in one run (issue 21, must-show 1, the rollout half): for
each mode, the built-in engine's decode tokens/s against bf16's, and the gap between the
engine's logprobs of its own samples and the trainer's (fp32 master weights; and bf16
autocast, what precision.train bf16 computes) on the same tokens.

Every mode serves the same fp32 master weights, prepared as the engine prepares them
(core/engine/quantized.py): fp32 and bf16 cast, fp8 block-quantised from fp32 (128 x 128
scales, dequantised to bf16 for each matmul), int4 group-quantised from the bf16 weights
(what a megatron int4_qat trainer holds on a GPU; dequantised to bf16 for each matmul). All
run the engine's fast path (ContinuousGenerator over StaticDecoder; CUDA graphs on a GPU), in
this process, after a warm-up run. int4's trainers are int4_qat ones (fake-quantised fp32
and bf16 copies of the master): that is the trainer an int4 engine serves. Its weight bytes
count what the engine holds: the landing weights pushes fill (bf16) and the int4 values and
scales the matmuls read.

Shapes: `qwen2-0.5b` (494 M, the default on a GPU) or `tiny` (hidden 256, 4 layers: the CPU
run). The weights are random (no model hub here), so the logits are nearly flat: the gaps
compare the modes with one another, and are not what a trained model shows.

    python bench/rollout_precision.py [--shape tiny|qwen2-0.5b] [--batch 64] [--new 128]

Prints the table; writes bench/results/rollout_precision_<cpu|gpu>.txt and .json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from milepost.core.engine.continuous import ContinuousGenerator
from milepost.core.engine.generation import SamplingParams, Sequence
from milepost.core.engine.quantized import Int4Linear, serve_fp8, serve_int4
from milepost.core.train.precision import attach_int4_qat

RESULTS = Path(__file__).parent / "results"
PROMPT = 64
MODES = ("bf16", "fp8", "int4", "fp32")  # bf16 first: the reference of the ratios
SHAPES = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2),
}


def master(shape: str, device: torch.device) -> torch.nn.Module:
    """The policy's fp32 master weights (random, seeded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to(device).float().eval()


def served(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """`model` as an engine serving precision.rollout `mode` holds it."""
    engine = copy.deepcopy(model)
    if mode == "fp8":
        serve_fp8(engine, torch.bfloat16)
        return engine
    engine.to(torch.float32 if mode == "fp32" else torch.bfloat16)
    if mode == "int4":
        serve_int4(engine, lambda: 0)
    return engine


def trainers(model: torch.nn.Module, mode: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The fp32 and the bf16 trainer of `mode`'s engine: the master itself (bf16: under
    autocast), or for int4 int4_qat copies of it in fp32 and in bf16 parameters."""
    if mode != "int4":
        return model, model
    fp32, bf16 = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    attach_int4_qat(fp32)
    attach_int4_qat(bf16)
    return fp32, bf16


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters, and an int4 layer's values and scales."""
    extra = [t for m in model.modules() if isinstance(m, Int4Linear) for t in (m.weight_packed, m.weight_scale)]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *extra] if t is not None)


def decode(model: torch.nn.Module, rows: list[list[int]], new: int) -> tuple[float, list[Sequence]]:
    """Tokens/s of a timed run after a warm-up run (graph capture), and the timed run's samples."""
    cuda = next(model.parameters()).is_cuda
    gen = ContinuousGenerator(model, [], num_slots=len(rows), max_len=PROMPT + new)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def run() -> tuple[float, list[Sequence]]:
        seqs = [Sequence(list(p), SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True), seed=i)
                for i, p in enumerate(rows)]
        queue = list(seqs)
        sync()
        start = time.perf_counter()
        gen.run(lambda free: [queue.pop(0) for _ in range(min(free, len(queue)))], lambda s: None)
        sync()
        return time.perf_counter() - start, seqs

    run()  # warm-up: graph capture on a GPU
    elapsed, seqs = run()
    return len(rows) * new / elapsed, seqs


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, seqs: list[Sequence], autocast_bf16: bool) -> list[torch.Tensor]:
    """The trainer's logprob of each sampled token (temperature 1), one sequence at a time."""
    device = next(model.parameters()).device
    out = []
    for s in seqs:
        ids = torch.tensor([s.prompt_ids + s.output_ids], device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        picked = F.log_softmax(logits, dim=-1).gather(1, ids[0, len(s.prompt_ids):, None])[:, 0]
        out.append(picked.cpu())
    return out


def gap(engine: list[Sequence], trainer: list[torch.Tensor]) -> tuple[float, float]:
    """(mean, max) |engine - trainer| logprob per sampled token."""
    diffs = torch.cat([(torch.tensor(s.output_logprobs) - t).abs() for s, t in zip(engine, trainer)])
    return float(diffs.mean()), float(diffs.max())


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b" if cuda else "tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new", type=int, default=128 if cuda else 32)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    model = master(args.shape, device)
    rows = torch.randint(2, SHAPES[args.shape]["vocab_size"], (args.batch, PROMPT),
                         generator=torch.Generator().manual_seed(1)).tolist()
    name = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    result: dict = {"device": name, "torch": torch.__version__, "shape": args.shape, "batch": args.batch,
                    "prompt": PROMPT, "new_tokens": args.new,
                    "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
                    "command": f"python bench/rollout_precision.py --shape {args.shape} --batch {args.batch} "
                               f"--new {args.new}", "modes": {}}
    lines = [f"# {result['date']}, {name}, torch {torch.__version__}: {result['command']}",
             f"shape {args.shape} (random weights), batch {args.batch}, prompt {PROMPT}, {args.new} new tokens, "
             "temperature 1; gaps: |engine - trainer| logprob per sampled token, mean (max)"]
    for mode in MODES:
        engine = served(model, mode)
        tok_s, seqs = decode(engine, rows, args.new)
        held = weight_bytes(engine)
        del engine
        fp32_trainer, bf16_trainer = trainers(model, mode)
        row = {"tok_s": tok_s, "weight_bytes": held,
               "gap_vs_fp32_trainer": gap(seqs, trainer_logprobs(fp32_trainer, seqs, False)),
               "gap_vs_bf16_trainer": gap(seqs, trainer_logprobs(bf16_trainer, seqs, True))}
        del fp32_trainer, bf16_trainer
        reference = result["modes"].get("bf16", row)
        row["tok_s_vs_bf16"] = tok_s / reference["tok_s"]
        row["weight_bytes_vs_bf16"] = row["weight_bytes"] / reference["weight_bytes"]
        result["modes"][mode] = row
        (m32, x32), (m16, x16) = row["gap_vs_fp32_trainer"], row["gap_vs_bf16_trainer"]
        lines.append(f"rollout {mode:>4}: {tok_s:,.0f} tok/s = {row['tok_s_vs_bf16']:.2f}x bf16; weights "
                     f"{row['weight_bytes'] / 2**20:,.1f} MiB = {row['weight_bytes_vs_bf16']:.2f}x bf16; gap vs "
                     f"trainer fp32 {m32:.2e} ({x32:.2e}), vs trainer bf16 {m16:.2e} ({x16:.2e})")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"rollout_precision_{'gpu' if cuda else 'cpu'}"
    stem.with_suffix(".txt").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
