"""The static-cache fast path (static_model.py, continuous.py, device_sampling.py) on CPU:
the same numbers as the HF model, the same greedy tokens as the HF path, sampling that
depends on a sequence's own seed only, and continuous batching's bookkeeping. The CUDA
graphs of the same code run in tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from milepost.core.engine.continuous import ContinuousGenerator
from milepost.core.engine.device_sampling import RowParams, sample, uniforms
from milepost.core.engine.generation import Generator, SamplingParams, Sequence
from milepost.core.engine.static_model import StaticDecoder, batch_buckets, unsupported_reason

VOCAB, EOS = 40, 1


def _model(kind: str = "qwen2") -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                  eos_token_id=EOS, pad_token_id=0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common)).eval()


def _prompts() -> list[list[int]]:
    return [[3, 4, 5], [7, 8, 9, 10, 11, 12], [2], [5, 6, 7, 8]]


def _run(gen: ContinuousGenerator, seqs: list[Sequence], per_call: int = 1000) -> list[Sequence]:
    queue, done = list(seqs), []

    def admit(free: int) -> list[Sequence]:
        taken = queue[:min(free, per_call)]
        del queue[:len(taken)]
        return taken

    assert gen.run(admit, done.append)
    return done


def _seq(prompt: list[int], seed: int = 0, **params) -> Sequence:
    return Sequence(list(prompt), SamplingParams(**params), seed=seed)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_prefill_and_decode_logits_equal_the_hf_forward(kind: str) -> None:
    model = _model(kind)
    dec = StaticDecoder(model, num_slots=4, max_len=32, use_graphs=False)
    dec.allocate()
    prompts = _prompts()
    with torch.inference_mode():
        last = dec.prefill(prompts, 0, all_logits=False)
        nxt = torch.tensor([6, 13, 3, 9])
        dec.in_tokens[:4] = nxt
        dec.in_pos[:4] = torch.tensor([len(p) for p in prompts])
        step = dec.decode(4, max(len(p) for p in prompts))
        for i, p in enumerate(prompts):
            ref = model(torch.tensor([p + [int(nxt[i])]])).logits[0]
            assert torch.allclose(last[i], ref[-2], atol=1e-5), i
            assert torch.allclose(step[i], ref[-1], atol=1e-5), i


def test_greedy_tokens_equal_the_hf_path() -> None:
    model = _model()
    params = dict(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    fast = _run(ContinuousGenerator(model, [EOS], num_slots=4, max_len=32, use_graphs=False),
                [_seq(p, **params) for p in _prompts()])
    ref = [_seq(p, **params) for p in _prompts()]
    Generator(model, [EOS]).run_batch(ref)
    by_prompt = {tuple(s.prompt_ids): s for s in fast}
    for r in ref:
        s = by_prompt[tuple(r.prompt_ids)]
        assert s.output_ids == r.output_ids
        assert s.output_logprobs == pytest.approx(r.output_logprobs, abs=1e-5)
        assert s.finish_reason == {"type": "length", "length": 10}


def test_a_sample_depends_on_its_own_seed_not_on_the_batch() -> None:
    """Batch-invariant mode: bit-identical alone and among others, admitted at once or one by one."""
    model = _model()

    def make() -> list:
        return [_seq(p, seed=100 + i, max_new_tokens=12, temperature=1.0, ignore_eos=True)
                for i, p in enumerate(_prompts())]

    together = _run(ContinuousGenerator(model, [EOS], 4, 32, use_graphs=False, batch_invariant=True), make())
    trickled = _run(ContinuousGenerator(model, [EOS], 4, 32, use_graphs=False, batch_invariant=True), make(),
                    per_call=1)
    alone = [_run(ContinuousGenerator(model, [EOS], 4, 32, use_graphs=False, batch_invariant=True), [s])[0]
             for s in make()]

    def key(seqs: list) -> dict:
        return {s.seed: (s.output_ids, s.output_logprobs) for s in seqs}

    assert key(together) == key(alone) == key(trickled)
    assert len({tuple(s.output_ids) for s in alone}) == 4  # the seeds really differ


def test_uniforms_are_uniform_and_depend_only_on_seed_index_and_entry() -> None:
    seeds = (torch.arange(400, dtype=torch.long) * 7919 - 10**12).unsqueeze(-1)
    idx = (torch.arange(400, dtype=torch.long) % 17).unsqueeze(-1)
    vocab = torch.arange(50, dtype=torch.long).unsqueeze(0)
    u = uniforms(seeds, idx, vocab)
    assert u.shape == (400, 50) and u.dtype == torch.float32
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    perm = torch.randperm(400)
    assert torch.equal(uniforms(seeds[perm], idx[perm], vocab), u[perm])
    assert torch.equal(uniforms(seeds, idx, vocab[:, 10:20]), u[:, 10:20])


def test_sampling_follows_the_distribution_and_truncation() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-9]])).repeat(6000, 1)
    n = logits.shape[0]
    p = RowParams(torch.ones(n), torch.full((n,), -1), torch.ones(n), torch.zeros(n),
                  torch.arange(n, dtype=torch.long), False)
    tokens, lp = sample(logits, p, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    p.top_k, p.needs_truncation = torch.full((n,), 2), True
    tokens, _ = sample(logits, p, torch.zeros(n, dtype=torch.long))
    assert set(tokens.tolist()) == {0, 1}
    p.top_k, p.top_p = torch.full((n,), -1), torch.full((n,), 0.6)
    tokens, _ = sample(logits, p, torch.zeros(n, dtype=torch.long))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.6: the crossing token is kept


def test_stop_tokens_min_new_tokens_and_scoring_only() -> None:
    model = _model()
    gen = ContinuousGenerator(model, [EOS], 4, 32, use_graphs=False)
    greedy = _run(gen, [_seq([3, 4, 5], max_new_tokens=8, temperature=0.0, ignore_eos=True)])[0].output_ids
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    stopped = _run(gen, [_seq([3, 4, 5], max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_at])])[0]
    assert stopped.output_ids == greedy[:first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}
    late = _run(gen, [_seq([3, 4, 5], max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_at],
                           min_new_tokens=first + 1)])[0]
    assert len(late.output_ids) > first + 1 or late.finish_reason["type"] == "length"
    scored = _seq([3, 4, 5, 6], max_new_tokens=0, temperature=1.0)
    scored.logprob_start_len = 0
    out = _run(gen, [scored])[0]
    assert out.output_ids == [] and out.finish_reason == {"type": "length", "length": 0}
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([[3, 4, 5, 6]])).logits[0], -1)
    assert out.input_logprobs[0] is None
    assert out.input_logprobs[1:] == pytest.approx([float(ref[j, t]) for j, t in enumerate([4, 5, 6])], abs=1e-5)


def test_continuous_admission_frees_slots_and_keeps_outputs_per_sequence() -> None:
    """More sequences than slots, of different lengths: every one gets its own output, the
    batch refills as rows leave (compaction moves the cache rows with them)."""
    model = _model()
    lengths = [3, 9, 1, 6, 4, 12, 2, 7, 5, 8]
    seqs = [_seq([2 + i % 5, 3, 4 + i % 3], max_new_tokens=n, temperature=0.0, ignore_eos=True)
            for i, n in enumerate(lengths)]
    done = _run(ContinuousGenerator(model, [EOS], 3, 32, use_graphs=False), seqs)
    assert sorted(len(s.output_ids) for s in done) == sorted(lengths)
    for s in done:  # each equals the sequence decoded alone
        ref = _seq(s.prompt_ids, max_new_tokens=s.params.max_new_tokens, temperature=0.0, ignore_eos=True)
        Generator(model, [EOS]).run_batch([ref])
        assert s.output_ids == ref.output_ids


def test_abort_and_retract() -> None:
    model = _model()
    gen = ContinuousGenerator(model, [EOS], 4, 64, use_graphs=False)
    seqs = [_seq(p, max_new_tokens=40, temperature=0.0, ignore_eos=True) for p in _prompts()]
    calls = {"n": 0}

    def hook() -> bool:
        calls["n"] += 1
        if calls["n"] == 3:
            seqs[1].abort_message = "stop it"
        return calls["n"] == 6

    queue, done = list(seqs), []
    assert not gen.run(lambda free: [queue.pop(0) for _ in range(min(free, len(queue)))], done.append,
                       step_hook=hook)
    assert [s.finish_reason for s in done] == [{"type": "abort", "message": "stop it"}]
    live = gen.take_live()
    assert len(live) == 3 and all(s.output_ids == [] and s.finish_reason is None for s in live)


def test_unsupported_models_and_buckets() -> None:
    assert unsupported_reason(_model()) is None
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, use_sliding_window=True)
    assert "sliding" in unsupported_reason(Qwen2ForCausalLM(cfg))
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert batch_buckets(3) == [1, 2, 3]


def test_weights_fused_by_the_first_prefill_take_span_copies_outside_inference_mode() -> None:
    """The fast path fuses q/k/v and gate/up on its first prefill, in inference mode; Qwen2's
    q/k/v biases keep its q/k/v weights apart, so fusing moves them into a new buffer. A weight
    push on a GPU then copies into views of the live weights (packing.py's span copies) outside
    inference mode: the buffer must not be an inference tensor, or torch refuses the copy."""
    model = _model()
    gen = ContinuousGenerator(model, [EOS], num_slots=4, max_len=32, use_graphs=False)
    attn = model.model.layers[0].self_attn
    before = attn.q_proj.weight.data_ptr()
    _run(gen, [_seq(p, max_new_tokens=2) for p in _prompts()])
    assert attn.q_proj.weight.data_ptr() != before  # moved into the fused buffer
    for name, param in model.named_parameters():
        assert not param.data.is_inference(), name
        span = torch.as_strided(param.data, (param.numel(),), (1,))  # as a span copy views it
        span.copy_(torch.zeros_like(span))
    assert int(torch.count_nonzero(attn.k_proj.weight)) == 0
