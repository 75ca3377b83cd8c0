"""milepost's CUDA weight format end to end on one GPU: a trainer in this process pushes by
the `tensor` transport (TensorTransport, real HTTP) into a real built-in engine process on the
same GPU; the engine maps each trainer storage once and serves exactly what a disk load of
the same weights serves.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_cuda_buffers_gpu.py`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]


def _model(seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).cuda().eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tinymodels import start_engines, stop_engines
    root = tmp_path_factory.mktemp("cuda-buffers")
    for version in (0, 1):
        _model(version).save_pretrained(root / f"v{version}")
    started = start_engines(str(root / "v0"), root, 1, "--device", "cuda", "--dtype", "bfloat16",
                            "--mem-fraction-static", "0.3", "--context-length", "512", startup_timeout_s=300)
    yield root, started[0][1]
    stop_engines(started)


def _outputs(client) -> list[list[int]]:
    return [o["output_ids"] for o in client.generate(PROMPTS, GREEDY)]


def _laid_out(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    """copied: a storage per tensor (as built); packed: back to back in state-dict order (the
    torch backend); reversed: one buffer in reverse order (Megatron's DDP buffer)."""
    from milepost.core.weight_sync.packing import pack_in_order, pack_parameters
    if layout == "packed":
        pack_parameters(model)
    elif layout == "reversed":
        pack_in_order(list(model.parameters())[::-1])
    return model


@pytest.mark.parametrize("layout", ["copied", "packed", "reversed"])
def test_a_push_by_cuda_storages_serves_what_a_disk_load_serves(served, layout) -> None:
    from milepost.core.train.weight_source import InProcessWeightSource
    from milepost.core.weight_sync import TensorTransport
    root, client = served
    assert client.server_info()["tensor_formats"] == ["milepost-cuda-v1"]
    client.update_weights_from_disk(str(root / "v1"), weight_version="disk-v1")
    want = _outputs(client)
    client.update_weights_from_disk(str(root / "v0"), weight_version="disk-v0")
    assert _outputs(client) != want
    source = InProcessWeightSource(_laid_out(_model(1), layout))
    transport = TensorTransport(timeout_s=120, bucket_mb=16)
    try:
        for version in ("1", "2"):
            metrics = transport.push([client], "", version, backend=source)
            assert transport._format == "cuda" and metrics["sync/attempts"] == 1
            assert client.model_info()["weight_version"] == version
            assert _outputs(client) == want
        buffers = source.rank._weight_sender().cuda.buffers
        assert (len(buffers) == 0) == (layout != "copied")  # one storage: no staging copy on the trainer
    finally:
        transport.close()


def test_each_trainer_storage_is_mapped_once_and_kept_across_a_memory_release_while_read(served) -> None:
    """Two pushes of one bucket map one storage; the first one's commit (a push of every tensor)
    unmaps what it did not read (earlier tests' storages), a release keeps the one it read, and
    the next push maps nothing."""
    from milepost.core.train.weight_sender import WeightSender
    _, client = served
    sender = WeightSender(_model(1))
    (bucket,) = sender.buckets(1 << 40)  # bf16 only: one bucket
    names = [s["name"] for s in bucket]

    def push(version: str) -> tuple[int, str]:
        client.begin_weight_update()
        reply = client.update_weights_from_tensor(sender.to_cuda(names, 0), weight_version=version)
        client.end_weight_update()
        found = re.search(r"\((\d+) mapped; copied as one span; (plan reused|planned)\)", reply["message"])
        assert found, reply["message"]
        return int(found.group(1)), found.group(2)

    first, how = push("m1")  # earlier tests' trainer storages may still be mapped as it loads
    assert how == "planned" and first >= 1
    assert push("m2") == (1, "plan reused")  # m1's commit unmapped the rest; m2 found its mapping and plan
    client.release_memory_occupation()
    client.resume_memory_occupation()
    assert push("m3") == (1, "planned")  # the release dropped every plan, and kept the mapping m2 read
    sender.release()


@pytest.mark.parametrize("layout", ["copied", "reversed"])
def test_a_colocated_push_fills_the_resumed_weights_in_place(served, layout) -> None:
    """Colocated placement releases and resumes the weights around each trainer step: the push
    that follows goes straight into the resumed weights (no shadow allocated, nothing copied at
    the commit) and the engine serves exactly those weights. Reversed: the trainer's weights in
    one buffer in another order than the engine's (Megatron's), each tensor read where it lies."""
    from milepost.core.train.weight_sender import WeightSender
    root, client = served
    client.update_weights_from_disk(str(root / "v1"), weight_version="disk-v1")
    want = _outputs(client)
    sender = WeightSender(_laid_out(_model(1), layout))
    plan = [[s["name"] for s in bucket] for bucket in sender.buckets(16 << 20)]
    weight_bytes = sum(t.numel() * t.element_size() for t in sender.module.state_dict().values())

    def push(version: str) -> list[str]:
        client.begin_weight_update()
        replies = [client.update_weights_from_tensor(sender.to_cuda(names, i), weight_version=version)["message"]
                   for i, names in enumerate(plan)]
        client.end_weight_update()
        return replies

    client.update_weights_from_disk(str(root / "v0"), weight_version="disk-v0")
    push("warm")  # the trainer's bucket buffers and exports exist before memory is measured
    client.release_memory_occupation()
    client.resume_memory_occupation()
    torch.cuda.synchronize()
    free_resumed = torch.cuda.mem_get_info()[0]
    replies = push("colocated")
    taken = free_resumed - torch.cuda.mem_get_info()[0]
    assert all("in place" in r for r in replies), replies
    assert taken < weight_bytes / 2, f"the push took {taken} bytes of device memory (weights: {weight_bytes})"
    assert client.model_info()["weight_version"] == "colocated"
    assert _outputs(client) == want
