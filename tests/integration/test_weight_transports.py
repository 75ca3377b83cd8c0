"""The three weight transports against real built-in engine processes over real HTTP, with
the trainer side in a real Ray actor (TorchBackend, one rank)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import ray
import torch
import torch.distributed as dist
from tinymodels import save_tiny_qwen2, start_engines, stop_engines

from milepost.core.config import AlgoConfig, RolloutConfig, TrainConfig
from milepost.core.fleet.client import EngineClient, EngineError
from milepost.core.fleet.fleet import Fleet, FleetTransport
from milepost.core.fleet.router import free_port
from milepost.core.train.torch_backend import TorchBackend
from milepost.core.types import Sample
from milepost.core.weight_sync import (
    DistributedTransport,
    TensorTransport,
    WeightSyncError,
    build_transport,
    groups,
    wire,
)
from milepost.core.weight_sync.base import on_engines, verify_versions

PROMPTS = [[3, 4, 5], [7, 8, 9, 10], [11]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
TIMEOUT_S = 5.0  # per push attempt in the stopped-engine tests


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("models")
    shape = dict(vocab=48, tie_embeddings=True, max_positions=256)
    return save_tiny_qwen2(root / "v0", 0, **shape), save_tiny_qwen2(root / "v1", 1, **shape)


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    """Two engine processes serving v0 (started together, so their start-ups overlap)."""
    started = start_engines(models[0], tmp_path_factory.mktemp("logs"), 2, "--weight-update-timeout-s", "20")
    yield started
    stop_engines(started)


@pytest.fixture(scope="module")
def backend(models):
    """The trainer: v1 plus one optimizer step, so its weights exist in no file."""
    ray.init(num_cpus=2, include_dashboard=False)
    b = TorchBackend.create(models[1], TrainConfig(num_ranks=1, micro_batch_size=4, lr=1e-2), AlgoConfig(),
                            1.0, seed=0)
    sample = Sample(prompt_index=0, group_index=0, prompt_ids=[3, 4, 5], response_ids=[6, 7, 8],
                    engine_logprobs=[-3.0, -3.0, -3.0], loss_mask=[1, 1, 1], finish_reason="stop",
                    weight_version="0", label="", advantage=1.0)
    b.train_step([sample], step=1)
    yield b
    b.shutdown()
    ray.shutdown()


def _outputs(clients: list[EngineClient]) -> list[list[list[int]]]:
    return [[o["output_ids"] for o in c.generate(PROMPTS, GREEDY)] for c in clients]


def _load_disk(clients: list[EngineClient], path: str, version: str) -> None:
    build_transport("disk").push(clients, path, version)


@pytest.fixture(scope="module")
def reference(engines, backend, models, tmp_path_factory):
    """Greedy outputs after a disk load of the trainer's weights, and of v0."""
    clients = [c for _, c in engines]
    export = str(tmp_path_factory.mktemp("export"))
    backend.export_hf(export)
    _load_disk(clients, export, "disk")
    trained = _outputs(clients)
    _load_disk(clients, models[0], "0")
    return {"trained": trained, "v0": _outputs(clients)}


@pytest.mark.parametrize("make", [
    lambda: TensorTransport(timeout_s=60),
    lambda: TensorTransport(timeout_s=60, bucket_mb=0.01),  # many buckets: writes overlap reads
    lambda: TensorTransport(timeout_s=60, bucket_mb=0.01, wire_format="sglang"),  # SGLang's pickled buckets
    lambda: DistributedTransport(timeout_s=60),
    # two engines: each stream a full mesh; flattened (the default over several streams), so
    # both sides send and receive in place: the packed trainer and the engines' shadow spans
    lambda: DistributedTransport(timeout_s=60, gloo_streams=4),
    lambda: DistributedTransport(timeout_s=60, gloo_streams=4, flattened=False),
    lambda: DistributedTransport(timeout_s=60, bucket_mb=0.01, flattened=True),
], ids=["tensor", "tensor-small-buckets", "tensor-sglang-format", "distributed", "distributed-4-streams",
        "distributed-4-streams-per-tensor", "distributed-flattened-small-buckets"])
def test_push_serves_what_a_disk_load_serves(make, engines, backend, models, reference):
    clients = [c for _, c in engines]
    _load_disk(clients, models[0], "0")
    transport = make()
    try:
        for version in ("1", "2"):  # the second push reuses buffers / the group
            metrics = transport.push(clients, "", version, backend=backend)
            assert metrics["sync/bytes"] > 0 and metrics["sync/attempts"] == 1
            assert [c.model_info()["weight_version"] for c in clients] == [version, version]
            assert _outputs(clients) == reference["trained"]
    finally:
        transport.close()
    assert reference["trained"] != reference["v0"]


@pytest.mark.parametrize("make", [
    lambda: TensorTransport(timeout_s=60, wire_format="sglang"),  # flattened buckets copied in
    lambda: DistributedTransport(timeout_s=60, gloo_streams=4),  # flattened, broadcast straight in
], ids=["tensor-sglang-format", "distributed-4-streams"])
def test_a_push_after_a_memory_release_fills_the_resumed_weights_and_serves_them(make, engines, backend,
                                                                                  reference):
    """Colocated placement's cycle: release, resume (weights allocated, empty), push. The push
    is received straight into the resumed weights (core/engine/staging.py); the engines serve
    exactly the pushed weights, and a push after that (weights served) stages privately again."""
    clients = [c for _, c in engines]
    transport = make()
    try:
        for cycle in ("1", "2"):
            for c in clients:
                assert c.release_memory_occupation(["weights"])["success"]
                assert c.resume_memory_occupation(["weights"])["success"]
                with pytest.raises(EngineError, match="push weights first"):
                    c.generate(input_ids=[[3, 4]], sampling_params={"max_new_tokens": 1})
            transport.push(clients, "", f"resumed-{cycle}", backend=backend)
            assert _outputs(clients) == reference["trained"]
        transport.push(clients, "", "served", backend=backend)
        assert [c.model_info()["weight_version"] for c in clients] == ["served", "served"]
        assert _outputs(clients) == reference["trained"]
    finally:
        transport.close()


@pytest.mark.parametrize("make", [lambda: TensorTransport(timeout_s=60, bucket_mb=0.01),
                                  lambda: DistributedTransport(timeout_s=60, gloo_streams=2)],
                         ids=["tensor", "distributed"])
def test_an_in_process_trainer_pushes_what_a_disk_load_serves(make, engines, models):
    """InProcessWeightSource: the trainer's sender called in this process, no Ray (a GPU
    machine without Ray runs benchmarks and tests/gpu this way)."""
    from transformers import Qwen2ForCausalLM

    from milepost.core.train.weight_source import InProcessWeightSource
    clients = [c for _, c in engines]
    _load_disk(clients, models[1], "1")
    want = _outputs(clients)
    _load_disk(clients, models[0], "0")
    source = InProcessWeightSource(Qwen2ForCausalLM.from_pretrained(models[1]))
    transport = make()
    try:
        transport.push(clients, "", "in-process", backend=source)
        assert _outputs(clients) == want
    finally:
        transport.close()


@pytest.mark.parametrize("name", ["tensor", "distributed", "disk"])
def test_stopped_engine_fails_within_timeout_and_others_keep_serving(name, engines, backend, models, reference,
                                                                     tmp_path):
    (_, healthy), (stopped_proc, stopped) = engines
    _load_disk([healthy, stopped], models[0], "0")
    export = str(tmp_path / "export")
    if name == "disk":
        backend.export_hf(export)
    transport = build_transport(name, timeout_s=TIMEOUT_S)
    os.kill(stopped_proc.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as err:
            transport.push([healthy, stopped], export, "9", backend=backend)
        elapsed = time.monotonic() - start
    finally:
        os.kill(stopped_proc.pid, signal.SIGCONT)
        transport.close()
    assert elapsed < 3 * TIMEOUT_S, f"a push against a stopped engine took {elapsed:.1f} s"  # hang check
    assert stopped.base_url in str(err.value)
    assert healthy.model_info()["weight_version"] == "0"
    assert _outputs([healthy]) == reference["v0"][:1]
    # resumed: the requests that waited in its sockets do not leave it paused or changed
    assert stopped.model_info()["weight_version"] == "0"
    assert [[o["output_ids"] for o in stopped.generate(PROMPTS, GREEDY, timeout_s=30)]] == reference["v0"][1:]


def test_session_rules(engines, models):
    (_, client), _ = engines
    url = client.base_url
    with pytest.raises(EngineError) as err:
        client.update_weights_from_tensor(["e30="])
    assert err.value.status == 400 and "begin_weight_update" in err.value.message
    before = client.model_info()["weight_version"]
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError) as err:
            client.begin_weight_update()
        assert err.value.status == 400 and "already open" in err.value.message
        with pytest.raises(EngineError):
            client.update_weights_from_disk(models[0])  # not while a session is open
        client.update_weight_version("staged")  # waits for the end of the session
        assert client.model_info()["weight_version"] == before
    finally:
        client.end_weight_update(abort=True)
    assert client.model_info()["weight_version"] == before
    with pytest.raises(EngineError):
        client.end_weight_update()  # no session any more
    assert httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["x"]},
                      timeout=10).status_code == 400


def test_version_check_names_an_engine_serving_another_version(engines, models):
    clients = [c for _, c in engines]
    _load_disk(clients, models[0], "0")
    verify_versions(clients, "0", 10.0)
    clients[1].update_weight_version("other", False)  # outside a session: takes effect at once
    try:
        # as a push runs it: in the push's pool
        with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(WeightSyncError) as err:
            verify_versions(clients, "0", 10.0, pool)
        assert err.value.retryable and f"{clients[1].base_url} serves other" in str(err.value)
        assert clients[0].base_url not in str(err.value)
    finally:
        clients[1].update_weight_version("0", False)


def test_mismatched_bucket_is_rejected_and_the_engine_keeps_serving(engines, models, reference):
    (_, client), _ = engines
    _load_disk([client], models[0], "0")
    name = f"milepost-test-{os.getpid()}"
    good = {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}
    bad = {"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [48, 32]}  # really [48, 64]
    nbytes = wire.HEADER_BYTES + wire.offsets([good, bad])[1]
    fd = wire.create_shm(name, nbytes)
    buf = wire.map_fd(fd)
    buf[wire.HEADER_BYTES:].fill_(0)  # zeros: loading them would change every output
    wire.write_header(buf, 7, nbytes)
    os.close(fd)
    try:
        client.begin_weight_update()
        client.update_weights_from_tensor([wire.encode_shm_descriptor(name, nbytes, 7, [good])])  # staged
        with pytest.raises(EngineError) as err:
            client.update_weights_from_tensor([wire.encode_shm_descriptor(name, nbytes, 7, [good, bad])])
        assert err.value.status == 400 and "model.embed_tokens.weight" in err.value.message
        client.update_weight_version("bad")
        with pytest.raises(EngineError) as err:  # the session failed: nothing is committed
            client.end_weight_update()
        assert "discarded" in err.value.message
    finally:
        os.unlink(wire.shm_path(name))
    assert client.model_info()["weight_version"] == "0"
    assert _outputs([client]) == reference["v0"][:1]


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_mismatched_distributed_bucket_is_rejected_and_the_group_stays_in_step(flattened, engines, models,
                                                                              reference):
    """This process is the trainer (rank 0 of a 2-stream gloo group with one engine). A
    bucket whose shape does not fit is still received (the broadcast completes), then
    refused; the session is discarded, and the next bucket in a new session commits."""
    (_, client), _ = engines
    _load_disk([client], models[0], "0")
    group, port = f"milepost_test_{os.getpid()}", free_port()
    good = {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}
    bad = {"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [48, 32]}  # really [48, 64]
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo",
                             timeout_s=30, gloo_streams=2)
        pg = groups.init_weight_group("127.0.0.1", port, 0, 2, group, 30.0, streams=2)
        assert "2 stream(s)" in joined.result(60)["message"]

        def update(specs: list[dict]) -> Any:
            """/update_weights_from_distributed while this process broadcasts zeros of the
            shapes the specs claim; returns the engine's reply (or raises its error)."""
            reply = pool.submit(client.update_weights_from_distributed, [s["name"] for s in specs],
                                [s["dtype"] for s in specs], [s["shape"] for s in specs], group,
                                "flattened_bucket" if flattened else None, timeout_s=30)
            if flattened:  # the bucket's bytes, one piece per stream
                sent = groups.flat_pieces(torch.zeros(sum(wire.spec_nbytes(s) for s in specs) // 4), 2)
            else:
                sent = [torch.zeros(s["shape"]) for s in specs]
            for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in sent]:
                w.wait()
            return reply.result(60)

        try:
            client.begin_weight_update()
            update([good])
            with pytest.raises(EngineError) as err:
                update([good, bad])
            assert err.value.status == 400 and "model.embed_tokens.weight" in err.value.message
            client.update_weight_version("bad")
            with pytest.raises(EngineError) as err:
                client.end_weight_update()
            assert "discarded" in err.value.message
            assert client.model_info()["weight_version"] == "0"
            assert _outputs([client]) == reference["v0"][:1]
            client.begin_weight_update()  # the group is still in step
            update([good])
            client.update_weight_version("zeroed-norm")
            client.end_weight_update()
            assert client.model_info()["weight_version"] == "zeroed-norm"
        finally:
            client.destroy_weights_update_group(group)
            groups.destroy_weight_group(pg)
            _load_disk([client], models[0], "0")


class HalfBrokenTensorTransport(TensorTransport):
    """Sends every bucket to the first engine, then a bucket the second refuses (while
    `broken`)."""

    broken = True

    def _send(self, pool, clients, backend, deadline):
        if not self.broken:
            return super()._send(pool, clients, backend, deadline)
        nbytes = super()._send(pool, clients[:1], backend, deadline)
        on_engines(pool, clients[1:], "update_weights_from_tensor",
                   lambda c: c.update_weights_from_tensor(["bm90IGEgZGVzY3JpcHRvcg=="]), deadline)
        return nbytes


def test_a_refused_bucket_on_one_engine_leaves_every_engine_on_the_old_version(engines, backend, models,
                                                                              reference):
    clients = [c for _, c in engines]
    _load_disk(clients, models[0], "0")
    transport = HalfBrokenTensorTransport(timeout_s=30, num_attempts=2)
    try:
        with pytest.raises(WeightSyncError) as err:
            transport.push(clients, "", "5", backend=backend)
    finally:
        transport.close()
    assert clients[1].base_url in str(err.value) and "2 attempt(s)" in str(err.value)  # refused: retried
    assert [c.model_info()["weight_version"] for c in clients] == ["0", "0"]
    assert _outputs(clients) == reference["v0"]


def test_a_push_that_fails_half_way_restores_the_last_good_weights_before_continue(engines, backend, models,
                                                                                  reference, tmp_path):
    """SGLang loads each bucket as it arrives: after a failure, engines that do not discard
    an aborted session reload the export of the last committed push before `continue`, and
    the error says so. restore="always" treats the built-in engines that way."""
    clients = [c for _, c in engines]
    _load_disk(clients, models[0], "0")
    export = tmp_path / "export-1"
    backend.export_hf(str(export))
    transport = HalfBrokenTensorTransport(timeout_s=30, num_attempts=1, restore="always")
    transport.broken = False
    try:
        transport.push(clients, str(export), "1", backend=backend)
        assert transport.last_good == (str(export), "1")
        _load_disk(clients, models[0], "0")  # engines on other weights: the restore must bring back "1"
        transport.broken = True
        with pytest.raises(WeightSyncError) as err:
            transport.push(clients, str(tmp_path / "export-2"), "2", backend=backend)
    finally:
        transport.close()
    assert err.value.args[0].count(f"restored version 1 from {export}") == 2, err.value
    for c in clients:
        info = c.model_info()
        assert (info["weight_version"], info["model_path"]) == ("1", str(export))
    assert _outputs(clients) == reference["trained"]


@pytest.fixture(scope="module")
def fleet(backend, models):
    """Two engines as Ray actors behind the real sglang-router, serving v0. Its tests come
    last in this module, so its engines do not load the machine during the timing-bound
    stopped-engine tests."""
    cfg = RolloutConfig(num_engines=2, engine_startup_timeout_s=90.0, request_timeout_s=60.0)
    f = Fleet.start(models[0], 2, cfg, weight_version="0")
    yield f
    f.stop()


@pytest.mark.parametrize("name", ["tensor", "distributed"])
def test_fleet_push_then_generation_through_the_router(name, fleet, backend, reference, tmp_path):
    """What the loop does: the push goes to each engine of the fleet, generation through the
    router; the router then serves what a disk load of the trainer's weights serves."""
    export = str(tmp_path / "export")  # a restarted engine would load this
    backend.export_hf(export)
    transport = FleetTransport(fleet, build_transport(name, timeout_s=60))
    try:
        for version in (f"{name}-1", f"{name}-2"):
            transport.push(fleet.clients, export, version, backend=backend)
            assert fleet.served == (export, version)
            assert [c.model_info()["weight_version"] for c in fleet.clients] == [version, version]
            for _ in range(2):  # the router spreads requests: ask it more than once
                assert [o["output_ids"] for o in fleet.router_client.generate(PROMPTS, GREEDY)] == \
                    reference["trained"][0]
    finally:
        transport.inner.close()
