"""Colocated placement's engine side: /release_memory_occupation frees the built-in engine's
weights (RSS measured), the engine refuses to serve or load until resumed, and after resume
plus a weight push it serves exactly what it served before."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tinymodels import start_engines, stop_engines
from transformers import Qwen2Config, Qwen2ForCausalLM

from milepost.core.fleet.client import EngineError
from milepost.core.weight_sync import build_transport

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11]]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    torch.manual_seed(0)  # ~190 MB of fp32 weights: large enough to see in RSS
    cfg = Qwen2Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(root / "model")
    started = start_engines(str(root / "model"), root)
    yield str(root / "model"), *started[0]
    stop_engines(started)


def test_release_frees_the_weights_and_resume_plus_push_restores_them(engine) -> None:
    model, proc, client = engine
    before = client.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    rss_serving = _rss_mb(proc.pid)

    assert client.release_memory_occupation(["weights", "kv_cache"])["success"]
    rss_released = _rss_mb(proc.pid)
    assert rss_serving - rss_released > 150, (rss_serving, rss_released)
    with pytest.raises(EngineError, match="weights are released") as refused:
        client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert refused.value.status == 503
    assert not client.health_generate()
    with pytest.raises(EngineError, match="resume_memory_occupation"):
        client.update_weights_from_disk(model, weight_version="1")

    assert client.resume_memory_occupation(["weights", "kv_cache"])["success"]
    with pytest.raises(EngineError, match="push weights first"):
        client.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    build_transport("disk").push([client], model, "1")
    after = client.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True)
    assert [a["output_ids"] for a in after] == [b["output_ids"] for b in before]
    assert [a["meta_info"]["output_token_logprobs"] for a in after] == \
        [b["meta_info"]["output_token_logprobs"] for b in before]
    assert {a["meta_info"]["weight_version"] for a in after} == {"1"}
    assert _rss_mb(proc.pid) - rss_released > 150


def test_release_is_refused_while_requests_run_and_for_unknown_tags(engine) -> None:
    _, _, client = engine
    long = threading.Thread(target=lambda: client.generate(timeout_s=300,
        input_ids=[[3, 4]] * 16, sampling_params={"max_new_tokens": 120, "temperature": 1.0, "ignore_eos": True}))
    long.start()
    deadline = time.monotonic() + 30
    while client.get_load()[0]["num_tokens"] < 16 * 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.pause("in_place")  # hold them running: on a fast machine they could finish first
    assert client.get_load()[0]["num_tokens"] >= 16 * 5
    with pytest.raises(EngineError, match="requests running") as refused:
        client.release_memory_occupation(["weights"])
    assert refused.value.status == 400
    client.continue_generation()
    long.join(300)
    assert not long.is_alive()
    with pytest.raises(EngineError, match="unknown tags"):
        client.release_memory_occupation(["gpu"])
    assert client.health_generate(timeout_s=120)  # nothing was released
