"""The built-in engine's LoRA routes (SGLang's /load_lora_adapter, /unload_lora_adapter,
lora_path on /generate): the adapter applied in the engine's forward gives the trainer's logprobs."""

from __future__ import annotations

import copy
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from milepost.core.config import LoraConfig
from milepost.core.engine.lora_adapter import EngineLora, take_batch
from milepost.core.engine.routes import create_app
from milepost.core.engine.scheduler import Scheduler
from milepost.core.train import lora
from tests.unit.test_lora import perturb, tiny_qwen2

CFG = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
PROMPT = [2, 5, 7, 9]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A served tiny model, LoRA on, and the trainer-side adapted model whose adapter is on disk."""
    root = tmp_path_factory.mktemp("lora-engine")
    base = tiny_qwen2()
    base.save_pretrained(root / "base")
    trained = copy.deepcopy(base)
    lora.inject(trained, CFG, seed=1)
    perturb(trained)
    lora.save_adapter(root / "adapter", lora.adapter_state(trained), CFG, str(root / "base"))
    sched = Scheduler(str(root / "base"))
    sched.lora = EngineLora(True, max_rank=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])
    sched.load()
    with TestClient(create_app(sched)) as client:
        yield SimpleNamespace(client=client, root=root, base=base, trained=trained.eval())


def logprobs_of(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def generate(client: TestClient, **extra) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3,
                                                     "ignore_eos": True}, "return_logprob": True, **extra}
    reply = client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_adapter_is_applied_only_to_requests_that_name_it(engine) -> None:
    c = engine.client
    assert c.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(engine.root / "adapter")}
                  ).json()["loaded_adapters"] == {"policy": str(engine.root / "adapter")}
    with_adapter, without = generate(c, lora_path="policy"), generate(c)
    for out, model in ((with_adapter, engine.trained), (without, engine.base)):
        engine_lp = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        trainer_lp = logprobs_of(model, PROMPT, out["output_ids"])
        assert max(abs(a - b) for a, b in zip(engine_lp, trainer_lp)) < 1e-5
    assert with_adapter["meta_info"]["output_token_logprobs"] != without["meta_info"]["output_token_logprobs"]
    assert c.post("/unload_lora_adapter", json={"lora_name": "policy"}).json()["success"]


def test_sglang_errors_for_unknown_duplicate_and_unloaded_adapters(engine) -> None:
    c, path = engine.client, str(engine.root / "adapter")
    r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "lora_path": "nope"})
    assert r.status_code == 400 and "requested LoRA adapters are not loaded: nope" in r.text
    assert c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": path}).status_code == 200
    r = c.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": path})
    assert r.status_code == 400 and "because it is already loaded" in r.json()["error_message"]
    assert c.post("/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    r = c.post("/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 400 and "LoRA with name a does not exist" in r.json()["error_message"]
    r = c.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": str(engine.root / "base")})
    assert r.status_code == 400 and "not a PEFT adapter folder" in r.json()["error_message"]


def test_an_adapter_over_the_max_rank_is_refused(engine, tmp_path) -> None:
    big = LoraConfig(rank=16, target_modules=["q_proj"])
    model = copy.deepcopy(engine.base)
    lora.inject(model, big, seed=1)
    lora.save_adapter(tmp_path, lora.adapter_state(model), big, "base")
    r = engine.client.post("/load_lora_adapter", json={"lora_name": "big", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "more than --max-lora-rank 8" in r.json()["error_message"]


def test_without_enable_lora_the_routes_say_so() -> None:
    ok, message = EngineLora(False).load(torch.nn.Linear(2, 2), "x", "/nowhere")
    assert not ok and "--enable-lora" in message


def test_a_batch_holds_one_adapter_and_the_others_keep_their_order() -> None:
    seqs = [SimpleNamespace(lora_name=n, i=i) for i, n in enumerate(["a", None, "a", "b", None, "a"])]
    queue = deque(seqs)
    assert [s.i for s in take_batch(queue, 2)] == [0, 2]
    assert [s.i for s in queue] == [1, 3, 4, 5]
    assert [s.i for s in take_batch(queue, 8)] == [1, 4]
    assert [s.i for s in queue] == [3, 5]


def test_the_launcher_renders_sglangs_lora_flags_and_the_builtin_engine_takes_them() -> None:
    from milepost.core.config import RolloutConfig
    from milepost.core.engine.server import parse_args
    from milepost.core.fleet.launcher import engine_command
    argv = engine_command(RolloutConfig(), "/m", "0", colocated=False, host="127.0.0.1", lora=CFG).resolve(
        port=8000, python="python").argv()
    i = argv.index("--enable-lora")
    assert argv[i:i + 6] == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj"]
    args = parse_args(argv[3:])
    assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules) == (True, 4, list(CFG.target_modules))
    assert "--enable-lora" not in engine_command(RolloutConfig(), "/m", "0", colocated=False).argv()


def test_rollout_requests_name_the_adapter_only_once_one_is_served() -> None:
    from milepost.core.weight_sync.lora_push import AdapterRequests

    class Recorder:  # what would go to the router: the keyword arguments of generate
        def generate(self, *args, **kwargs):
            return kwargs
    served: list[str | None] = [None]
    client = AdapterRequests(Recorder(), lambda: served[0])
    assert "lora_path" not in client.generate([1], {})
    served[0] = "policy"
    assert client.generate([1], {})["lora_path"] == "policy"


def test_a_corrupt_adapter_file_is_a_400_naming_it(engine, tmp_path) -> None:
    (tmp_path / lora.ADAPTER_CONFIG).write_text((engine.root / "adapter" / lora.ADAPTER_CONFIG).read_text())
    (tmp_path / lora.ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    r = engine.client.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and f"Failed to load LoRA adapter bad from {tmp_path}" in r.json()["error_message"]


def test_requests_whose_adapter_was_unloaded_meanwhile_do_not_run_on_the_base_model() -> None:
    lora_state = EngineLora(True)
    with (pytest.raises(ValueError, match="LoRA adapter gone was unloaded before its requests ran"),
          lora_state.active("gone")):
        pass
    with lora_state.active(None):
        assert lora_state.current is None
