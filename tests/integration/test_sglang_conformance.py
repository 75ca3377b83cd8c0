"""milepost against SGLang 0.5.23's own code (not our reading of it): the oracle is the wheel's
Python, imported on CPU by sglang_oracle.py (its docstring says exactly what is stubbed:
`triton` while common.py imports, and `srt.managers.schedule_batch`; nothing else).

Needs `pip install --no-deps sglang==0.5.23` and the test extra (pybase64, pyzmq, pillow);
.ci/run installs them. Without them every test here FAILS naming the install line: a
missing oracle is never a silent skip.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sglang_oracle
import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from milepost.core.fleet.client import EngineClient
from milepost.core.rollout import RolloutRequest, default_rollout
from milepost.core.types import Prompt
from milepost.core.weight_sync import groups

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def sgl():
    return sglang_oracle.load()  # SGLangMissing fails the test, with the install line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the weight-update group: SGLang's init_custom_process_group meets milepost's trainer ----

SPECS = [{"name": "embed", "dtype": "float32", "shape": [64, 16]}, {"name": "norm", "dtype": "bfloat16", "shape": [16]},
         {"name": "steps", "dtype": "int64", "shape": [3]}, {"name": "big", "dtype": "float32", "shape": [257, 129]}]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for s in SPECS:
        dtype = getattr(torch, s["dtype"])
        if dtype.is_floating_point:
            out[s["name"]] = torch.randn(s["shape"], generator=g).to(dtype)
        else:
            out[s["name"]] = torch.randint(-2**40, 2**40, s["shape"], generator=g, dtype=dtype)
    return out


def test_a_group_formed_by_sglangs_own_function_meets_the_trainer(sgl, tmp_path) -> None:
    """Two real processes: the engine side is SGLang's `init_custom_process_group` (gloo,
    tcp:// rendezvous, group name, as its /init_weights_update_group calls it); the trainer
    side is milepost's rank 0 (groups.init_weight_group). Every tensor arrives bit for bit."""
    port, group, out = _free_port(), "weight_update_group_conformance", tmp_path / "received.pt"
    (tmp_path / "received.pt.specs.json").write_text(json.dumps(SPECS))
    engine = subprocess.Popen([sys.executable, str(HERE / "sglang_oracle.py"), "127.0.0.1", str(port), "1", "2",
                               group, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pg = groups.init_weight_group("127.0.0.1", port, 0, 2, group, 60.0, backend="gloo", streams=1)
        try:
            sent = _tensors()
            for s in SPECS:  # milepost's per-tensor bucket: one broadcast per tensor, in order
                dist.broadcast(sent[s["name"]], src=0, group=pg)
        finally:
            groups.destroy_weight_group(pg)
        output, _ = engine.communicate(timeout=120)
        assert engine.returncode == 0, output
    finally:
        if engine.poll() is None:
            engine.kill()
    received = torch.load(out)
    for name, t in sent.items():
        assert received[name].dtype == t.dtype and torch.equal(received[name], t), name


# ---- every request body milepost sends constructs SGLang's request class ----

REQUEST_CLASSES = {
    "/generate": "GenerateReqInput", "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput", "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput", "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}


class Recorder:
    """A real HTTP server that records what milepost sends and answers as SGLang would
    (JSON {"success", "message"}; plain text for /flush_cache; a /server_info that
    announces no milepost extension)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, str, Any]] = []
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def record(path: str, request: Request) -> Any:
            raw = await request.body()
            body = json.loads(raw) if raw else None
            self.bodies.append((request.method, "/" + path, body))
            if path == "flush_cache":
                return Response("Cache flushed.\n", status_code=200)
            if path in ("server_info", "model_info"):
                return {"tp_size": 1, "weight_version": "7", "model_path": "m"}
            if path == "generate":
                rows = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
                n = body["sampling_params"].get("n", 1)
                one = {"text": "", "output_ids": [5], "meta_info": {
                    "finish_reason": {"type": "length", "length": 1}, "weight_version": "7",
                    "output_token_logprobs": [[-0.5, 5, None]]}}
                return [one] * (len(rows) * n)
            return JSONResponse({"success": True, "message": "ok"})

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "recording server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _fields(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def test_every_request_body_constructs_sglangs_request_class(sgl) -> None:
    recorder = Recorder()
    client = EngineClient(f"http://127.0.0.1:{recorder.port}", timeout_s=30)
    try:
        prompts = [Prompt(index=i, text="", label="", prompt_ids=[3, 4 + i]) for i in range(3)]
        default_rollout(RolloutRequest(prompts, 4, {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0,
                                                    "top_k": -1, "stop_token_ids": [1]}, sampling_seed=5,
                                       num_engines=1, decode=lambda ids: ""), client)
        client.generate([3, 4, 5], {"max_new_tokens": 0, "temperature": 1.0}, return_logprob=True,
                        logprob_start_len=2)  # prefill scoring
        client.pause("retract", push_id="p1")  # no extension announced: no push_id sent
        client.flush_cache(timeout_s=10)
        client.begin_weight_update("all")
        client.init_weights_update_group("127.0.0.1", 29500, 1, 3, "g", "nccl")
        client.update_weights_from_distributed(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], "g", None)
        client.update_weights_from_distributed(["a"], ["bfloat16"], [[2, 3]], "g", "flattened_bucket")
        client.update_weights_from_tensor(["aGVsbG8="], "flattened_bucket")
        client.update_weight_version("8", False)
        client.end_weight_update()
        client.end_weight_update(abort=True)  # no extension announced: an empty body
        client.continue_generation(push_id="p1")
        client.update_weights_from_disk("/exports/8", weight_version="8")
        client.destroy_weights_update_group("g")
        client.abort_request(abort_all=True)
        client.release_memory_occupation(["weights", "kv_cache"])
        client.resume_memory_occupation(None)
    finally:
        client.close()
        recorder.stop()
    seen = set()
    for method, path, body in recorder.bodies:
        if path in ("/server_info", "/model_info"):
            continue
        if path == "/flush_cache":  # no body: only ?timeout=, FlushCacheReqInput's one field
            assert method in ("GET", "POST") and body is None
            seen.add(path)
            continue
        cls_name = REQUEST_CLASSES[path]
        seen.add(path)
        body = body or {}
        parsed = sglang_oracle.request(sgl, cls_name, body)  # raises if SGLang's parser refuses it
        cls = getattr(sgl.io_struct, cls_name)
        extra = set(body) - _fields(cls)  # SGLang ignores these: an unannounced extension
        assert not extra, f"{path} sends {sorted(extra)}, fields SGLang's {cls_name} does not have"
        if path == "/generate":
            assert sgl.generate_contract_error(body) is None, (body, sgl.generate_contract_error(body))
            parsed.normalize_batch_and_arguments()  # SGLang's own batch/n/params checks
            params = body["sampling_params"]
            assert params.get("n", 1) == 1 or params.get("sampling_seed") is None, \
                "n > 1 with one seed: SGLang would make identical (or unseeded) samples"
    assert seen == set(REQUEST_CLASSES) | {"/flush_cache"}, set(REQUEST_CLASSES) - seen


def test_sglang_refuses_what_it_should(sgl) -> None:
    """The oracle is live: a wrong body is refused by SGLang's own parsers."""
    import pydantic
    with pytest.raises(pydantic.ValidationError):
        sglang_oracle.request(sgl, "InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": "x"})
    assert "unknown field `bogus`" in sgl.generate_contract_error({"input_ids": [1], "sampling_params": {"bogus": 1}})


# ---- tensor payloads in SGLang's format ----

def test_milepost_payload_decodes_with_sglangs_deserializer_in_another_process(sgl, tmp_path) -> None:
    """The trainer's payload (sglang_wire.encode over a shared buffer) read by SGLang's own
    MultiprocessingSerializer + FlattenedTensorBucket in an unrelated process: bit for bit."""
    from milepost.core.weight_sync import sglang_wire, wire
    sent = _tensors()
    specs = [dict(s) for s in SPECS]
    offs, total = wire.offsets(specs)
    flat = sglang_wire.shared_buffer(total)
    for s, o in zip(specs, offs):
        wire.view(flat, o, s).copy_(sent[s["name"]])
    blob = sglang_wire.encode(flat, specs)
    out = tmp_path / "decoded.pt"
    reader = subprocess.run([sys.executable, str(HERE / "sglang_oracle.py"), "decode", str(out)], input=blob + "\n",
                            capture_output=True, text=True, timeout=300)
    assert reader.returncode == 0, reader.stdout + reader.stderr
    decoded = torch.load(out)
    assert list(decoded) == [s["name"] for s in SPECS]
    for name, t in sent.items():
        assert decoded[name].dtype == t.dtype and torch.equal(decoded[name], t), name


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tinymodels import save_tiny_qwen2, start_engines, stop_engines
    root = tmp_path_factory.mktemp("conformance")
    v0, v1 = save_tiny_qwen2(root / "v0", 0), save_tiny_qwen2(root / "v1", 1)
    started = start_engines(v0, root)
    yield started[0][1], v0, v1
    stop_engines(started)


def test_the_engine_loads_a_payload_serialized_by_sglang_itself(sgl, engine) -> None:
    """A bucket serialized by SGLang's own MultiprocessingSerializer (file_system sharing,
    as a CPU sender must) is loaded by the built-in engine: it then serves what a disk
    load of the same weights serves."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    client, v0, v1 = engine
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    client.update_weights_from_disk(v1, weight_version="disk-v1")
    want = client.generate([[3, 4, 5]], greedy)[0]["output_ids"]
    client.update_weights_from_disk(v0, weight_version="0")
    assert client.generate([[3, 4, 5]], greedy)[0]["output_ids"] != want
    state = load_file(str(Path(v1) / "model.safetensors"))
    named = [(k, v.contiguous()) for k, v in state.items() if v.dtype == torch.float32]
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        bucket = sgl.FlattenedTensorBucket(named_tensors=named)
        blob = sgl.MultiprocessingSerializer.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                                        "metadata": bucket.get_metadata()}, output_str=True)
    finally:
        mp.set_sharing_strategy(strategy)
    client.begin_weight_update()
    try:
        reply = client.update_weights_from_tensor([blob], "flattened_bucket")
        assert reply["success"], reply
        client.update_weight_version("tensor-v1", False)
    finally:
        client.end_weight_update()
    assert client.model_info()["weight_version"] == "tensor-v1"
    assert client.generate([[3, 4, 5]], greedy)[0]["output_ids"] == want


# ---- precision.rollout fp8: the block rule, SGLang's own check against milepost's ----

def _sglang_linears(config: dict[str, int], tp: int) -> list[dict[str, Any]]:
    """The arguments SGLang's fp8 linears pass to validate_block_quant_shapes for one decoder
    layer of a dense Qwen-style model on `tp` ranks (srt/layers/linear.py: QKVParallelLinear and
    MergedColumnParallelLinear split each part over the ranks, k/v heads replicated when there
    are fewer than ranks; RowParallelLinear splits its input)."""
    heads, kv_heads, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    head_dim, inter = config.get("head_dim", hidden // heads), config["intermediate_size"]
    q, kv = heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    column = [("qkv_proj", hidden, [q, kv, kv]), ("gate_up_proj", hidden, [inter // tp, inter // tp])]
    row = [("o_proj", heads * head_dim, hidden), ("down_proj", inter, hidden)]
    return ([dict(name=n, input_size=i, input_size_per_partition=i, output_size=sum(parts) * tp,
                  output_size_per_partition=sum(parts), output_partition_sizes=parts) for n, i, parts in column]
            + [dict(name=n, input_size=i, input_size_per_partition=i // tp, output_size=o,
                    output_size_per_partition=o, output_partition_sizes=[o]) for n, i, o in row])


FP8_SHAPES = [
    {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864},  # 0.5B
    {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
     "intermediate_size": 6144},  # Qwen3-1.7B
    {"hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048},  # gpu-arith
    {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256},  # tiny-arith
    {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 2816},
]


# heads that do not split over the ranks are refused by SGLang for any precision: not fp8's case
@pytest.mark.parametrize("config,tp", [(c, tp) for c in FP8_SHAPES for tp in (1, 2, 4)
                                       if c["num_attention_heads"] % tp == 0])
def test_milepost_refuses_exactly_the_fp8_shapes_sglangs_own_check_refuses(config, tp) -> None:
    """core/quant/fp8_folder.sglang_fp8_problem against SGLang's validate_block_quant_shapes,
    run on the partition sizes of each of a layer's four fp8 linears."""
    from milepost.core.quant.fp8_folder import sglang_fp8_problem
    check = sglang_oracle.fp8_block_check()
    quant = types.SimpleNamespace(weight_block_size=[128, 128])
    refused = []
    for linear in _sglang_linears(config, tp):
        layer = types.SimpleNamespace(tp_group=types.SimpleNamespace(world_size=tp) if tp > 1 else None)
        try:
            check(layer, quant, linear["input_size"], linear["input_size_per_partition"], linear["output_size"],
                  linear["output_size_per_partition"], linear["output_partition_sizes"], False)
        except ValueError:
            refused.append(linear["name"])
    problem = sglang_fp8_problem(config, tp)
    assert (problem is not None) == bool(refused), (refused, problem)
