"""Partial rollouts against a real built-in engine over HTTP: a weight push in the middle of
a rollout cuts the responses, which keep their tokens and go on under the new weights; every
token's logprob is that of the version that sampled it, and the spans say which."""

from __future__ import annotations

import threading
import time

import pytest
from tinymodels import save_tiny_qwen2, start_engines, stop_engines

from milepost.core.fleet.client import EngineClient
from milepost.core.rollout import RolloutRequest, default_rollout
from milepost.core.types import Prompt, Sample
from milepost.core.weight_sync import build_transport

MAX_NEW = 300
PROMPTS = [Prompt(index=i, text="", label="", prompt_ids=[2 + i % 20, 3, 4 + i % 7]) for i in range(16)]


def _request(partial: bool) -> RolloutRequest:
    return RolloutRequest(PROMPTS, 4, {"max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True},
                          sampling_seed=11, num_engines=1, decode=lambda ids: "",
                          continue_cut_responses=partial)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    v0, v1 = save_tiny_qwen2(root / "v0", 0), save_tiny_qwen2(root / "v1", 1)
    started = start_engines(v0, root)
    yield v0, v1, started[0][1]
    stop_engines(started)


def _rollout_with_push_midway(engine: EngineClient, partial: bool, model: str, version: str) -> list[Sample]:
    """Run a rollout; once the engine is decoding, push `model` as `version` (disk, abort mode)."""
    box: dict[str, list[Sample]] = {}
    worker = threading.Thread(target=lambda: box.update(samples=default_rollout(_request(partial), engine)))
    worker.start()
    deadline = time.monotonic() + 60
    while engine.get_load()[0]["num_tokens"] < len(PROMPTS) * 4 * 40:  # ~40 tokens into every response
        assert worker.is_alive() and time.monotonic() < deadline, "rollout ended before the push"
        time.sleep(0.01)
    build_transport("disk").push([engine], model, version)
    worker.join(120)
    assert not worker.is_alive()
    return box["samples"]


def _score(engine: EngineClient, sample: Sample) -> list[float]:
    """Logprobs of the sample's response tokens under the weights the engine serves now."""
    ids = sample.prompt_ids + sample.response_ids
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0, "temperature": 1.0},
                          return_logprob=True, logprob_start_len=len(sample.prompt_ids) - 1)
    return [float(e[0]) for e in out["meta_info"]["input_token_logprobs"]][-len(sample.response_ids):]


def test_cut_responses_continue_under_the_new_version(setup) -> None:
    v0, v1, engine = setup
    build_transport("disk").push([engine], v0, "0")
    samples = _rollout_with_push_midway(engine, partial=True, model=v1, version="1")
    assert len(samples) == len(PROMPTS) * 4
    assert all(len(s.response_ids) == MAX_NEW and s.finish_reason == "length" for s in samples)
    mixed = [s for s in samples if len(s.weight_version_spans) == 2]
    assert mixed, "the push cut no response: it came too late"
    for s in samples:
        assert s.weight_version == "1" or s.weight_version_spans == [[0, "0"]]
        assert s.oldest_version() == 0 if s.weight_version_spans[0][1] == "0" else 1
    sample = mixed[0]
    (_, first), (cut_at, second) = sample.weight_version_spans
    assert (first, second) == ("0", "1") and 0 < cut_at < MAX_NEW
    under_v1 = _score(engine, sample)
    build_transport("disk").push([engine], v0, "2")
    under_v0 = _score(engine, sample)
    # each span's engine logprobs are those of the policy that sampled it, and only those
    assert max(abs(a - b) for a, b in zip(sample.engine_logprobs[:cut_at], under_v0[:cut_at])) < 1e-4
    assert max(abs(a - b) for a, b in zip(sample.engine_logprobs[cut_at:], under_v1[cut_at:])) < 1e-4
    assert max(abs(a - b) for a, b in zip(sample.engine_logprobs[cut_at:], under_v0[cut_at:])) > 1e-2


def test_without_partial_rollouts_cut_responses_come_back_aborted(setup) -> None:
    v0, v1, engine = setup
    build_transport("disk").push([engine], v0, "0")
    samples = _rollout_with_push_midway(engine, partial=False, model=v1, version="1")
    cut = [s for s in samples if s.finish_reason == "abort"]
    assert cut and all(0 < len(s.response_ids) < MAX_NEW and s.weight_version_spans == [[0, "0"]] for s in cut)
