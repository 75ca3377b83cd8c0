"""The built-in engine as a real server process, behind the real sglang-router."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from tinymodels import save_tiny_qwen2, start_engines, stop_engines

from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.fleet.router import Router


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    return save_tiny_qwen2(root / "v0", 0), save_tiny_qwen2(root / "v1", 1)


@pytest.fixture(scope="module", params=["hf", "static"])
def engine(models, tmp_path_factory, request):
    """Both decode paths of the built-in engine (fast_path.py) answer the same protocol; the
    static one runs here on CPU without CUDA graphs (tests/gpu runs it with them)."""
    started = start_engines(models[0], tmp_path_factory.mktemp("logs"), 1, "--decode-path", request.param)
    yield started[0][1]
    stop_engines(started)


@pytest.fixture(scope="module")
def router(engine):
    r = Router.start([engine.base_url], policy="round_robin")
    yield r
    r.stop()


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_generate_n_through_router(router) -> None:
    client = EngineClient(router.url, timeout_s=60)
    sp = {"max_new_tokens": 5, "temperature": 1.0, "n": 3, "sampling_seed": 11, "ignore_eos": True}
    out = client.generate([[3, 4, 5], [7, 8]], sp, return_logprob=True)
    assert isinstance(out, list) and len(out) == 6
    for i, item in enumerate(out):
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == (3 if i < 3 else 2)  # input-major: input i sample k at i*n+k
        assert meta["finish_reason"] == {"type": "length", "length": 5}
        assert meta["completion_tokens"] == len(item["output_ids"]) == 5
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == item["output_ids"] and all(lp <= 0 for lp, _, _ in lps)
        assert {"id", "cached_tokens", "weight_version", "e2e_latency"} <= meta.keys()
    again = client.generate([[3, 4, 5], [7, 8]], sp, return_logprob=True)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]  # seeded: reproducible
    single = client.generate([3, 4, 5], GREEDY)
    assert isinstance(single, dict) and len(single["output_ids"]) == 6


def test_unknown_sampling_param(engine, router) -> None:
    with pytest.raises(EngineError) as err:
        engine.generate([3, 4], {"max_new_tokens": 2, "bogus": 1})
    assert err.value.status == 400 and "unknown field `bogus`" in err.value.message
    # sglang-router 0.3.2 re-serialises sampling_params with its own schema: it DROPS unknown
    # keys (measured), so through the router the request succeeds; a bad type is its 422.
    through = httpx.post(f"{router.url}/generate", json={"input_ids": [3, 4], "sampling_params": {
        "max_new_tokens": 2, "bogus": 1}}, timeout=30)
    assert through.status_code in (200, 400)
    bad = httpx.post(f"{router.url}/generate", json={"input_ids": [3, 4], "sampling_params": {
        "max_new_tokens": 2, "temperature": -1.0}}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]


def test_bad_requests_are_400(engine) -> None:
    url = f"{engine.base_url}/generate"
    assert httpx.post(url, content=b"{nope", timeout=10).status_code == 400
    assert httpx.post(url, json={"input_ids": "abc"}, timeout=10).status_code == 400
    assert httpx.post(url, json={"input_ids": [1, 99]}, timeout=10).status_code == 400
    assert httpx.post(url, json={"input_ids": [1], "sampling_params": {"top_k": "x"}}, timeout=10).status_code == 400
    assert httpx.post(url, json={"text": "hi"}, timeout=10).status_code == 400  # no tokenizer here


def test_prefill_scoring(engine) -> None:
    out = engine.generate([3, 4, 5, 6], {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                          logprob_start_len=0)
    lps = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in lps] == [3, 4, 5, 6] and lps[0][0] is None and all(lp < 0 for lp, _, _ in lps[1:])
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["length"] == 0


def test_update_weights_changes_version_and_outputs(engine, router, models) -> None:
    client = EngineClient(router.url, timeout_s=60)
    before = client.generate([5, 6, 7], GREEDY)
    engine.pause("retract")
    try:
        reply = engine.update_weights_from_disk(models[1], weight_version="1")
    finally:
        engine.continue_generation()
    assert reply["success"] is True
    assert engine.model_info()["weight_version"] == "1"
    after = client.generate([5, 6, 7], GREEDY)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    engine.update_weights_from_disk(models[0], weight_version="2")  # back, while idle
    assert client.generate([5, 6, 7], GREEDY)["output_ids"] == before["output_ids"]
    with pytest.raises(EngineError) as err:
        engine.update_weights_from_disk(str(Path(models[0]).parent / "missing"), weight_version="3")
    assert err.value.status == 400 and engine.model_info()["weight_version"] == "2"
    other = save_tiny_qwen2(Path(models[0]).parent / "vocab48", 2, vocab=48)
    with pytest.raises(EngineError) as err:  # shape mismatch: refused, model untouched
        engine.update_weights_from_disk(other, weight_version="4")
    assert "shape mismatch" in err.value.message and engine.model_info()["weight_version"] == "2"
    assert client.generate([5, 6, 7], GREEDY)["output_ids"] == before["output_ids"]
    engine.update_weight_version("7")
    assert engine.server_info()["weight_version"] == "7"


def _generate_in_thread(client: EngineClient, body: dict) -> tuple[threading.Thread, list]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(client.generate(**body)))
    t.start()
    return t, box


def test_pause_modes(engine) -> None:
    long = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}}
    # abort: the running request ends with finish_reason abort
    t, box = _generate_in_thread(engine, long)
    time.sleep(0.5)
    engine.pause("abort")
    t.join(30)
    assert box[0]["meta_info"]["finish_reason"]["type"] == "abort"
    # while paused, new requests wait; continue lets them run
    t, box = _generate_in_thread(engine, {"input_ids": [3, 4], "sampling_params": GREEDY})
    time.sleep(0.5)
    assert not box
    engine.continue_generation()
    t.join(30)
    assert box[0]["meta_info"]["finish_reason"]["type"] == "length"
    # retract: the request is recomputed after continue and ends normally, same greedy output
    ref = engine.generate(**long)
    t, box = _generate_in_thread(engine, long)
    time.sleep(0.5)
    engine.pause("retract")
    engine.continue_generation()
    t.join(60)
    assert box[0]["output_ids"] == ref["output_ids"]
    # in_place: running request parks; an update with flush_cache fails until it is done
    t, box = _generate_in_thread(engine, long)
    time.sleep(0.5)
    engine.pause("in_place")
    with pytest.raises(EngineError):
        engine.update_weights_from_disk(engine.model_info()["model_path"], flush_cache=True)
    engine.continue_generation()
    t.join(60)
    assert box[0]["output_ids"] == ref["output_ids"]


def test_health_and_info(engine, router) -> None:
    assert engine.health_generate()
    info = engine.model_info()
    assert info["is_generation"] is True and info["model_path"] and "weight_version" in info
    assert httpx.get(f"{engine.base_url}/get_load", timeout=5).json()[0]["num_tokens"] >= 0
    server = httpx.get(f"{engine.base_url}/get_server_info", timeout=5).json()
    assert server["dp_size"] == 1 and server["tp_size"] == 1
    assert server["max_gloo_streams"] > 1  # the trainer may ask /init_weights_update_group for more
    assert server["device"] == "cpu" and server["tensor_formats"] == ["milepost-shm-v1"]  # host memory: in place
    assert httpx.post(f"{router.url}/flush_cache", timeout=10).status_code == 200


def test_a_cuda_descriptor_to_an_engine_on_cpu_is_400_and_names_the_format_to_send(engine, models) -> None:
    """The tensor transport sends milepost's CUDA descriptor only to engines that list it; one
    sent anyway fails its session with the reason, and the engine keeps its weights."""
    import base64
    import math

    from safetensors import safe_open

    from milepost.core.weight_sync import cuda_buffers
    with safe_open(str(next(Path(models[0]).glob("*.safetensors"))), "pt") as f:
        name = next(iter(f.keys()))
        shape = list(f.get_slice(name).get_shape())
    storage = {"device": "GPU-00000000-0000-0000-0000-000000000000", "handle": base64.b64encode(b"0" * 64).decode(),
               "size_bytes": 4 * math.prod(shape), "offset_bytes": 0,
               "ref_counter_handle": base64.b64encode(b"/torch_1_2_3").decode(), "ref_counter_offset": 0,
               "event_handle": None, "event_sync_required": False}
    blob = cuda_buffers.encode_descriptor(storage, [{"name": name, "dtype": "float32", "shape": shape, "offset": 0}])
    version = engine.model_info()["weight_version"]
    engine.begin_weight_update()
    with pytest.raises(EngineError, match="CUDA format is for engines on a GPU.*on cpu: send the shm format"):
        engine.update_weights_from_tensor([blob], weight_version="never")
    with pytest.raises(EngineError, match="session discarded because an update failed"):
        engine.end_weight_update()
    assert engine.model_info()["weight_version"] == version


@pytest.mark.parametrize("change,named", [
    ({"gloo_streams": 0}, "gloo_streams"), ({"gloo_streams": 99}, "gloo_streams"),
    ({"gloo_streams": "4"}, "gloo_streams"), ({"backend": "nccl"}, "gloo"), ({"world_size": None}, "world_size"),
])
def test_bad_weight_group_requests_are_400(engine, change, named) -> None:
    """Refused before any rendezvous: nothing waits for a trainer."""
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "group_name": "bad", "backend": "gloo", **change}
    reply = httpx.post(f"{engine.base_url}/init_weights_update_group", json=body, timeout=10)
    assert reply.status_code == 400 and named in reply.json()["message"], reply.text


def test_flush_cache_is_plain_text_retried_until_200(engine) -> None:
    """SGLang's /flush_cache answers plain text, 200 or 400 while requests run; the client
    never parses it as JSON and retries the 400 until 200 within its timeout."""
    from milepost.core.engine.protocol import FLUSHED_TEXT
    for method in ("GET", "POST"):
        reply = httpx.request(method, f"{engine.base_url}/flush_cache", timeout=10)
        assert reply.status_code == 200 and reply.text == FLUSHED_TEXT, (method, reply.text)
    long = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1000, "temperature": 0.0, "ignore_eos": True}}
    t, box = _generate_in_thread(engine, long)
    time.sleep(0.5)
    engine.pause("in_place")  # the request stays running: no flush
    try:
        busy = httpx.post(f"{engine.base_url}/flush_cache", timeout=10)
        assert busy.status_code == 400 and "#running-req: 1" in busy.text, busy.text
        started = time.monotonic()
        with pytest.raises(EngineError) as err:
            engine.flush_cache(timeout_s=1.0)
        assert err.value.status == 400 and "not flushed within 1 s" in err.value.message
        assert time.monotonic() - started < 5
        threading.Timer(1.0, engine.continue_generation).start()  # the request finishes meanwhile
        assert engine.flush_cache(timeout_s=60) == FLUSHED_TEXT
    finally:
        engine.continue_generation()
        t.join(60)
    assert box and box[0]["meta_info"]["finish_reason"]["type"] == "length"


def test_seed_rule_as_sglang(engine) -> None:
    """n > 1 copies the params into every sample (SGLang): one seed gives n identical samples
    (as SGLang with --enable-deterministic-inference). Distinct reproducible samples come
    from one input per sample with its own seed: a `sampling_params` list, one per input,
    or one request per seed (what the rollout sends through sglang-router)."""
    sp = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    same = engine.generate([[3, 4, 5]], dict(sp, n=3, sampling_seed=11))
    assert len({tuple(o["output_ids"]) for o in same}) == 1
    listed = engine.generate([[3, 4, 5]] * 3, [dict(sp, sampling_seed=11 + j) for j in range(3)])
    one_each = [engine.generate([[3, 4, 5]], dict(sp, sampling_seed=11 + j))[0] for j in range(3)]
    assert [o["output_ids"] for o in listed] == [o["output_ids"] for o in one_each]
    assert listed[0]["output_ids"] == same[0]["output_ids"] and len({tuple(o["output_ids"]) for o in listed}) > 1
    with pytest.raises(EngineError) as err:
        engine.generate([[3, 4, 5]] * 2, [sp])
    assert err.value.status == 400 and "one object per input" in err.value.message
