"""Does a sequence's engine logprob depend on the batch it runs in? (built-in engine, CPU)

Evidence for the soak's sha mismatches in sync mode (RESULTS.md): the same prompt and seed
give the same tokens in any batch, but logprobs that differ by up to ~1e-6 with the batch's
size and padding. The trainer uses the engine's logprobs (TIS weights), so a step whose
requests the engine happened to batch differently (timing, load) trains slightly different
weights. Not collected by pytest; run it with the tiny model's folder as the argument:

    python tests/faults/probe_engine_batch_invariance.py ~/.cache/milepost/models/tiny-arith-41d599b1bfbf67f0
"""
import sys

import torch
from transformers import AutoModelForCausalLM

from milepost.core.engine.generation import Generator, SamplingParams, make_sequences

torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
g = Generator(m, [1], 0)
p = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=7)
target = [5, 6, 7, 3, 8, 9, 4]
others = [[5, 6, 7, 3, 8, 9, 4, 2, 2, 3], [6, 7, 3], [9, 9, 3, 4, 5], [5, 6, 7, 3, 8]]
def run(batch_others):
    seqs = make_sequences(target, p, 1) + [s for o in batch_others for s in make_sequences(o, p, 1)]
    g.run_batch(seqs)
    return seqs[0].output_ids, seqs[0].output_logprobs
alone = run([])
for k in range(1, len(others) + 1):
    ids, lps = run(others[:k])
    print(f"batch of {k+1}: same tokens {ids == alone[0]}, logprobs bitwise equal {lps == alone[1]}, "
          f"max diff {max(abs(a - b) for a, b in zip(lps, alone[1])) if ids == alone[0] else 'n/a'}")
print("torch threads", torch.get_num_threads())
