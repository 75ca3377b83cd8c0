"""The built-in engine's fast path on a GPU: CUDA graphs give the numbers of the same code
run eagerly; a real engine process serves through it, sees weight updates, and gives its
memory back on /release_memory_occupation so another process (the trainer) can use it.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_engine_gpu.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12], [5, 6, 7, 8, 9, 10, 11, 12, 13]]


def _config():
    from transformers import Qwen2Config
    return Qwen2Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                       tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)


def _model(seed: int) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(_config()).to(torch.bfloat16).cuda().eval()


def _feeder(queue: list) -> Callable[[int], list]:
    """The generator's source: up to `free` sequences from the front of `queue`."""
    return lambda free: [queue.pop(0) for _ in range(min(free, len(queue)))]


def _eager_and_replayed(model: torch.nn.Module) -> list:
    """[(tokens, logprobs) per sequence] run eagerly, then through captured CUDA graphs; the
    generators are returned too, to check what each ran."""
    from milepost.core.engine.continuous import ContinuousGenerator
    from milepost.core.engine.generation import SamplingParams, Sequence
    outs = []
    for graphs in (False, True):
        gen = ContinuousGenerator(model, [1], num_slots=16, max_len=512, use_graphs=graphs)
        seqs = [Sequence(list(p), SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True), seed=i)
                for i, p in enumerate(PROMPTS * 3)]
        assert gen.run(_feeder(list(seqs)), lambda s: None)
        assert gen.decoder.use_graphs == graphs and (not graphs or gen.decoder._graphs)
        outs.append(([(s.output_ids, s.output_logprobs) for s in seqs], gen))
    return outs


def test_graph_replay_equals_eager_decoding() -> None:
    (eager, _), (replayed, _) = _eager_and_replayed(_model(0))
    assert eager == replayed


def test_fp8_layers_replay_in_graphs_as_eagerly() -> None:
    """precision.rollout fp8 on the fast path (unfused fp8 projections, dequantised inside the
    captured graphs): replay gives the numbers of the same code run eagerly."""
    from milepost.core.engine.quantized import serve_fp8
    model = _model(0).float()  # quantised from float32, as load_model does
    assert len(serve_fp8(model, torch.bfloat16)) == 7 * 8
    (eager, _), (replayed, gen) = _eager_and_replayed(model)
    assert gen.decoder._fused is not None and set(gen.decoder._fused) == {None}
    assert eager == replayed


def test_compiled_dequantisations_equal_the_eager_ones_on_cuda() -> None:
    """Fp8Linear and Int4Linear dequantise through one compiled kernel on CUDA: the same bits
    as the eager functions (CPU: tests/unit/test_quant_fp8.py, test_quant_int4.py)."""
    from milepost.core.quant import fp8
    from milepost.core.quant.int4 import compiled_dequantize_packed, dequantize_packed, pack_int4, quantize_int4
    torch.manual_seed(0)
    for shape in ((2816, 1024), (200, 130)):
        w = torch.randn(*shape, device="cuda")
        q8, s8 = fp8.quantize_fp8_blockwise(w)
        q4, s4 = quantize_int4(w)
        p4 = pack_int4(q4)
        for dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(fp8.compiled_dequantize_fp8_blockwise()(q8, s8, dtype),
                               fp8.dequantize_fp8_blockwise(q8, s8, dtype))
            assert torch.equal(compiled_dequantize_packed()(p4, s4, shape[1], dtype),
                               dequantize_packed(p4, s4, shape[1], dtype))


def test_int4_layers_replay_in_graphs_as_eagerly_and_requantise_under_kept_graphs() -> None:
    """precision.rollout int4 on the fast path (unfused int4 projections, dequantised inside the
    captured graphs): replay gives the numbers of the same code run eagerly; after the receiver
    counts a change of weights copied in place, the kept graphs serve the re-quantised weights
    (Int4Linear.prepare writes them where the graphs read)."""
    from milepost.core.engine.continuous import ContinuousGenerator
    from milepost.core.engine.generation import SamplingParams, Sequence
    from milepost.core.engine.quantized import serve_int4
    model, generation = _model(0), [0]
    assert len(serve_int4(model, lambda: generation[0])) == 7 * 8
    (eager, _), (replayed, gen) = _eager_and_replayed(model)
    assert set(gen.decoder._fused) == {None}
    assert eager == replayed
    with torch.no_grad():  # an update copied into the live weights, as a push lands it
        for target, source in zip(model.parameters(), _model(1).parameters()):
            target.copy_(source)
    generation[0] += 1
    graphs = dict(gen.decoder._graphs)
    seqs = [Sequence(list(p), SamplingParams(**GREEDY), seed=0) for p in PROMPTS * 3]  # the shapes captured
    assert gen.run(_feeder(list(seqs)), lambda s: None)
    assert gen.decoder._graphs.keys() == graphs.keys()  # replayed, none captured anew
    fresh, expected = _model(1), [Sequence(list(p), SamplingParams(**GREEDY), seed=0) for p in PROMPTS * 3]
    serve_int4(fresh, lambda: 0)
    assert ContinuousGenerator(fresh, [1], num_slots=16, max_len=512, use_graphs=False).run(
        _feeder(list(expected)), lambda s: None)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in expected]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tinymodels import start_engines, stop_engines
    root = tmp_path_factory.mktemp("gpu-engine")
    for version in (0, 1):
        _model(version).save_pretrained(root / f"v{version}")
    torch.cuda.init()
    free_before = torch.cuda.mem_get_info()[0]
    started = start_engines(str(root / "v0"), root, 1, "--device", "cuda", "--dtype", "bfloat16",
                            "--mem-fraction-static", "0.5", "--context-length", "1024",
                            "--max-running-requests", "4096", startup_timeout_s=300)
    yield root, started[0][1], free_before
    stop_engines(started)


def test_engine_serves_by_the_fast_path_and_sees_weight_updates(served) -> None:
    root, client, _ = served
    info = client.server_info()
    assert info["device"] == "cuda" and info["decode_path"] == "fast"
    assert info["tensor_formats"] == ["milepost-cuda-v1"]  # trainer storages mapped once (cuda_buffers.py)
    first = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in first)
    client.update_weights_from_disk(str(root / "v1"), weight_version="1")
    other = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
    assert other != first  # the captured graphs read the new weights
    client.update_weights_from_disk(str(root / "v0"), weight_version="2")
    assert [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)] == first


def test_release_gives_the_memory_back_for_the_trainer(served, capsys) -> None:
    root, client, free_before = served
    first = [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in first)
    held = free_before - torch.cuda.mem_get_info()[0]
    message = client.release_memory_occupation()
    still = free_before - torch.cuda.mem_get_info()[0]
    total = torch.cuda.get_device_properties(0).total_memory
    with capsys.disabled():
        print(f"\nengine held {held / 2**30:.2f} GiB; after release {still / 2**30:.2f} GiB "
              f"({still / held:.3f} of it); engine says: {message}")
    assert still < 0.10 * held
    grab = torch.empty(int(free_before * 0.9), dtype=torch.uint8, device="cuda")  # the trainer's turn
    grab.fill_(1)
    torch.cuda.synchronize()
    assert held + grab.numel() > 0.5 * total  # it did not fit beside the engine's share
    del grab
    torch.cuda.empty_cache()
    client.resume_memory_occupation()
    client.update_weights_from_disk(str(root / "v0"), weight_version="3")
    assert [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)] == first
