"""Built-in engine generation: padding invariance, seeding, and the logprob contract."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.engine.generation import Generator, SamplingParams, _sample_rows, _truncate, make_sequences

VOCAB = 32


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


PROMPTS = [[5, 6, 7], [3, 9, 11, 12, 4, 8, 20], [2], [15, 16, 17, 18]]


def _run(gen: Generator, prompts, params: SamplingParams, n: int = 1):
    seqs = [s for p in prompts for s in make_sequences(p, params, n)]
    assert gen.run_batch(seqs)
    return seqs


def test_greedy_batched_equals_single(model) -> None:
    gen = Generator(model, eos_token_ids=[1])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    batched = _run(gen, PROMPTS, params)
    for prompt, row in zip(PROMPTS, batched):
        single = _run(gen, [prompt], params)[0]
        assert row.output_ids == single.output_ids
        assert row.finish_reason == {"type": "length", "length": 12}
        torch.testing.assert_close(torch.tensor(row.output_logprobs), torch.tensor(single.output_logprobs),
                                   atol=1e-4, rtol=0)


def _logprobs_alone_and_in_batches(gen: Generator) -> tuple[list[float], list[list[float]]]:
    params = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=3)
    target = [5, 6, 7, 3, 8, 9, 4]
    alone = _run(gen, [target], params)[0]
    batched = []
    for others in ([[5, 6, 7, 3, 8, 9, 4, 2, 2, 3]], [[6, 7, 3], [9, 9, 3, 4, 5]], PROMPTS * 4):
        row = _run(gen, [target, *others], params)[0]
        assert row.output_ids == alone.output_ids  # tokens never depend on the batch
        batched.append(row.output_logprobs)
    return alone.output_logprobs, batched


def test_logprobs_depend_on_the_batch_unless_batch_invariant(model) -> None:
    """What --enable-deterministic-inference is for: in a batch, a sequence's logprobs move
    in their low bits with the batch's size and padding (if this ever stops holding, the
    default mode is batch-invariant too and the flag's cost can go); decoded alone, they
    are bitwise the same in any batch."""
    alone, batched = _logprobs_alone_and_in_batches(Generator(model, eos_token_ids=[1]))
    assert any(row != alone for row in batched)
    assert max(abs(a - b) for row in batched for a, b in zip(row, alone)) < 1e-4
    alone, batched = _logprobs_alone_and_in_batches(Generator(model, eos_token_ids=[1], batch_invariant=True))
    assert all(row == alone for row in batched)


def test_same_seed_same_output(model) -> None:
    gen = Generator(model, eos_token_ids=[1])
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=20, sampling_seed=7)
    a = _run(gen, PROMPTS, params, n=3)
    b = _run(gen, PROMPTS, params, n=3)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.output_logprobs for s in a] == [s.output_logprobs for s in b]
    # as SGLang (deterministic inference): n samples with one seed are the same sample
    assert len({tuple(s.output_ids) for s in a[:3]}) == 1
    # distinct samples: one sequence per sample, seeds s + j (what the rollout sends)
    distinct = [_run(gen, PROMPTS[:1], SamplingParams(**{**params.__dict__, "sampling_seed": 7 + j}))[0]
                for j in range(3)]
    assert len({tuple(s.output_ids) for s in distinct}) > 1


def test_unseeded_samples_of_one_prompt_differ(model) -> None:
    gen = Generator(model, eos_token_ids=[1])
    seqs = _run(gen, PROMPTS[:1], SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True), n=4)
    assert len({tuple(s.output_ids) for s in seqs}) > 1


def test_stop_and_min_new_tokens(model) -> None:
    gen = Generator(model, eos_token_ids=[1])
    free = _run(gen, [PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop_tok = free.output_ids[2]
    first = free.output_ids.index(stop_tok)
    stopped = _run(gen, [PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                     stop_token_ids=[stop_tok]))[0]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_tok}
    assert stopped.output_ids == free.output_ids[: first + 1]
    held = _run(gen, [PROMPTS[1]], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                  stop_token_ids=[stop_tok], min_new_tokens=6))[0]
    assert stop_tok not in held.output_ids[:6]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_trainer_forward(model, temperature: float) -> None:
    gen = Generator(model, eos_token_ids=[1])
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.8, top_k=10,
                            ignore_eos=True, sampling_seed=3)
    worst = 0.0
    for s in _run(gen, PROMPTS, params, n=2):
        full = torch.tensor([s.prompt_ids + s.output_ids])
        with torch.no_grad():
            logits = model(full).logits[0].float()
        t = temperature if temperature > 0 else 1.0
        lp = torch.log_softmax(logits / t, dim=-1)
        p = len(s.prompt_ids)
        ref = lp[p - 1 : p - 1 + len(s.output_ids)].gather(1, torch.tensor(s.output_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(s.output_logprobs)).abs().max().item())
    print(f"max abs logprob diff (T={temperature}): {worst:.3e}")
    assert worst < 1e-4


def test_prefill_scoring(model) -> None:
    gen = Generator(model, eos_token_ids=[1])
    prompt = PROMPTS[1]
    seqs = make_sequences(prompt, SamplingParams(max_new_tokens=0, temperature=1.0), 1, logprob_start_len=0)
    assert gen.run_batch(seqs)
    s = seqs[0]
    assert s.output_ids == [] and s.finish_reason == {"type": "length", "length": 0}
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    ref = [None] + [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    assert s.input_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(s.input_logprobs[1:]), torch.tensor(ref[1:]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("vocab", [2, 15, 17, 151, 32000])
def test_batched_sampling_draws_what_multinomial_draws_per_row(vocab: int) -> None:
    """The batched sampler must pick, row by row, the token torch.multinomial picks with the
    same generator: a sequence's tokens never depend on its batch, and seeds keep their meaning."""
    g = torch.Generator().manual_seed(vocab)
    logprobs = torch.log_softmax(4 * torch.randn(48, vocab, generator=g), dim=-1)
    params = [SamplingParams(temperature=1.0, top_k=(3 if j % 4 == 1 else -1), top_p=(0.7 if j % 4 == 2 else 1.0),
                             min_p=(0.05 if j % 4 == 3 else 0.0)) for j in range(48)]
    rows = list(range(48))
    ours = [torch.Generator().manual_seed(100 + j) for j in rows]
    theirs = [torch.Generator().manual_seed(100 + j) for j in rows]
    for _ in range(4):  # successive decode steps keep consuming each generator in step
        drawn = _sample_rows(logprobs, rows, params, ours)
        expected = [int(torch.multinomial(_truncate(logprobs[j], params[j]).exp(), 1, generator=theirs[j])[0])
                    for j in rows]
        assert drawn.tolist() == expected


def test_sampling_rejects_a_row_with_nothing_to_draw() -> None:
    logprobs = torch.full((2, 5), float("-inf"))
    logprobs[0, 1] = 0.0
    with pytest.raises(ValueError, match="invalid sampling distribution"):
        _sample_rows(logprobs, [0, 1], [SamplingParams(temperature=1.0)] * 2,
                     [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)])


class _OldNameModel(torch.nn.Module):
    """A model whose forward knows the KV cache only as `past_key_values` (transformers < 5.2x)."""

    def __init__(self, inner: torch.nn.Module, keep_cache: bool = True) -> None:
        super().__init__()
        self.inner, self.keep_cache = inner, keep_cache

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True,
                logits_to_keep=0, **_ignored):
        cache = past_key_values if self.keep_cache else None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          cache=cache, use_cache=use_cache, logits_to_keep=logits_to_keep)


def test_the_kv_cache_goes_by_the_name_the_model_knows(model) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _run(Generator(model, eos_token_ids=[1]), PROMPTS, params)
    old = _run(Generator(_OldNameModel(model), eos_token_ids=[1]), PROMPTS, params)
    assert [s.output_ids for s in old] == [s.output_ids for s in expected]


def test_a_model_that_drops_the_kv_cache_fails_the_batch(model) -> None:
    gen = Generator(_OldNameModel(model, keep_cache=False), eos_token_ids=[1])
    seqs = make_sequences(PROMPTS[0], SamplingParams(max_new_tokens=4, temperature=0.0), 1)
    with pytest.raises(RuntimeError, match="did not fill the KV cache"):
        gen.run_batch(seqs)
