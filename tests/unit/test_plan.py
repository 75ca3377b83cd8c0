"""`milepost plan`: every shipped recipe plans; layouts that do not divide or fit are refused
(exit 2, reason and fix); parameter counts equal real transformers models; one memory case
is checked against numbers computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.cli import main
from milepost.core.plan import CATALOG, make_plan
from milepost.core.plan.arch import from_hf_config
from milepost.core.plan.catalog import TINY_VOCAB_SIZE
from milepost.core.plan.memory import stage_layers, trainer_memory
from milepost.core.recipe_io import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _items(plan) -> dict[str, float]:
    return {i.name: i.bytes for i in plan.trainer_items + plan.engine_items}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates_and_plans(recipe: Path, capsys) -> None:
    assert main(["plan", str(recipe)]) == 0
    out = capsys.readouterr().out
    assert "verdict    fits" in out and "memory per device" in out and "engines" in out


def test_the_real_model_recipes_are_shipped() -> None:
    names = {p.stem for p in RECIPES}
    assert {"qwen3-0.6b-gsm8k", "qwen3-8b-gsm8k", "qwen3-30b-a3b-gsm8k", "deepseek-v3-gsm8k"} <= names
    for stem in ("qwen3-0.6b-gsm8k", "qwen3-8b-gsm8k", "qwen3-30b-a3b-gsm8k", "deepseek-v3-gsm8k"):
        r = load_recipe(ROOT / "recipes" / f"{stem}.yaml")
        assert r.train.backend == "megatron" and r.cluster.executor == "slurm" and r.reward.function == "gsm8k"
        assert r.cluster.slurm.gpus_per_node > 0 and r.model.catalog in CATALOG


SMALL_CONFIGS = {
    "qwen2": dict(vocab_size=15, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "llama": dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, tie_word_embeddings=False),
    "qwen3_moe": dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "deepseek_v3": dict(vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1,
                        topk_group=1, tie_word_embeddings=False),
}


@pytest.mark.parametrize("model_type", sorted(SMALL_CONFIGS))
def test_parameter_count_equals_the_transformers_model(model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"model_type": model_type, **SMALL_CONFIGS[model_type]}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert from_hf_config(cfg, model_type).total_params() == sum(p.numel() for p in model.parameters())


def test_catalog_totals_match_the_model_cards() -> None:
    # Published sizes (model cards): total and activated parameters.
    published = {"Qwen3-0.6B": (0.6e9, None), "Qwen3-8B": (8.2e9, None), "Qwen3-30B-A3B": (30.5e9, 3.3e9),
                 "DeepSeek-V3": (671e9, 37e9)}
    for name, (total, active) in published.items():
        arch = from_hf_config(CATALOG[name], name)
        assert arch.total_params() == pytest.approx(total, rel=0.02), name
        if active:
            assert arch.active_params() == pytest.approx(active, rel=0.03), name
    # Qwen3-0.6B's safetensors hold exactly this many parameters (tied embedding counted once).
    assert from_hf_config(CATALOG["Qwen3-0.6B"], "q").total_params() == 596_049_920


def test_tiny_vocab_matches_the_tiny_tokenizer() -> None:
    from milepost.core.model import tiny

    assert len(tiny.SPECIALS) + len(tiny.CHARS) == TINY_VOCAB_SIZE


def test_memory_of_qwen3_8b_matches_hand_computed_values() -> None:
    """Qwen3-8B, TP 2 + SP, DP 4, bf16, distributed optimizer, 16384-token micro-batches, engines TP 2."""
    plan = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"))
    h, inter, vocab, layers, tp = 4096, 12288, 151936, 36, 2
    per_layer = (2 * h * 32 * 128 // tp      # q and o: 32 heads of 128 split over TP
                 + 2 * (8 // tp) * 128 * h   # k and v: 8 KV heads split over TP
                 + 2 * 128 + 2 * h           # q/k norms, two RMSNorms (replicated)
                 + 3 * h * inter // tp)      # gate, up, down
    params = layers * per_layer + 2 * vocab * h // tp + h  # + embedding, output layer, final norm
    assert params == 4_095_521_792
    got = _items(plan)
    assert got["weights"] == params * 2
    assert got["grads"] == params * 4
    assert got["optimizer"] == pytest.approx(params * 12 / 4)
    s = 16384
    act_per_layer = (2 * s * h / tp + s * (2 * 32 / tp + 2 * 8 / tp) * 128   # norm+qkv inputs (SP), q,k,v, attn out
                     + 2 * s * h / tp + 3 * s * inter / tp)                    # norm+fc1 inputs (SP), gate/up, fc2 in
    assert got["activations"] == pytest.approx(layers * act_per_layer * 2)
    assert got["logits"] == pytest.approx(s * vocab / tp * 8)
    assert got["engine KV cache"] == 256 * (512 + 1024) * layers * 2 * (8 // tp) * 128 * 2
    assert plan.phases[0].total_bytes == pytest.approx(sum(
        got[k] for k in ("weights", "grads", "optimizer", "activations", "logits")) + 0.08 * 141e9)


@pytest.mark.parametrize("rollout,layer_bytes,embedding_bytes", [("bf16", 2, 2), ("fp8", 1 + 4 / 128**2, 2),
                                                                  ("fp32", 4, 4)])
def test_engine_weights_count_decoder_layers_in_the_rollout_format_and_embeddings_in_its_dtype(
        rollout: str, layer_bytes: float, embedding_bytes: int) -> None:
    """Qwen3-8B engines at TP 2: fp8 stores the decoder layers' weights as e4m3 with a float32
    scale per 128 x 128 block; embeddings and the output layer stay in bf16."""
    plan = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml",
                                 [f"precision.rollout={rollout}", "rollout.engine=builtin"]))
    h, inter, vocab, layers, tp = 4096, 12288, 151936, 36, 2
    per_layer = 2 * h * 32 * 128 // tp + 2 * (8 // tp) * 128 * h + 2 * 128 + 2 * h + 3 * h * inter // tp
    embeddings = 2 * vocab * h // tp + h
    assert _items(plan)["engine weights"] == pytest.approx(layers * per_layer * layer_bytes
                                                           + embeddings * embedding_bytes)


def test_int4_qat_on_gpus_is_planned_as_bf16_training_and_its_engines_hold_bf16_landing_weights() -> None:
    """The megatron backend trains int4_qat in bf16 on GPUs (bf16 parameters, fp32 masters), and
    an int4 engine keeps the pushed weights in that dtype beside int4 values and scales
    (core/quant/modes.py int4_dtype): bf16's trainer memory, 2 + 0.5 + 4/128 B an engine layer
    parameter. On CPUs both stay fp32."""
    def plan(*sets: str):
        return make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml", ["rollout.engine=builtin", *sets]))
    bf16, int4 = plan("precision.train=bf16"), plan("precision.train=int4_qat", "precision.rollout=int4")
    assert _items(int4)["weights"] == _items(bf16)["weights"] and _items(int4)["optimizer"] == _items(bf16)["optimizer"]
    fp32_engine = plan("precision.train=int4_qat", "precision.rollout=int4", "train.backend=torch")
    h, inter, vocab, layers, tp = 4096, 12288, 151936, 36, 2
    per_layer = 2 * h * 32 * 128 // tp + 2 * (8 // tp) * 128 * h + 2 * 128 + 2 * h + 3 * h * inter // tp
    embeddings = 2 * vocab * h // tp + h
    assert _items(int4)["engine weights"] == pytest.approx(layers * per_layer * (2 + 0.5 + 4 / 128) + embeddings * 2)
    assert _items(fp32_engine)["engine weights"] == pytest.approx(layers * per_layer * (4 + 0.5 + 4 / 128)
                                                                  + embeddings * 4)


def _refused(capsys, recipe: str, *overrides: str) -> str:
    args = ["plan", str(ROOT / "recipes" / recipe)] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 2
    return capsys.readouterr().err


def test_tp_that_does_not_divide_the_heads_is_refused(capsys) -> None:
    err = _refused(capsys, "qwen3-0.6b-gsm8k.yaml", "train.megatron.tensor_parallel=3",
                   "train.num_ranks=6", "rollout.num_engines=6")
    assert "tensor_parallel=3 does not divide the 16 attention heads of Qwen3-0.6B" in err
    assert "fix: set train.megatron.tensor_parallel to one of [1, 2, 4, 8, 16]" in err


def test_engine_tp_that_does_not_divide_the_heads_is_refused(capsys) -> None:
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "rollout.engine_tensor_parallel=3",
                   "rollout.num_engines=2")
    assert "rollout.engine_tensor_parallel=3 does not divide the 32 attention heads" in err


def test_a_layout_that_cannot_fit_is_refused_with_the_biggest_cost_named(capsys) -> None:
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "train.megatron.distributed_optimizer=false",
                   "train.megatron.micro_batch_tokens=2048", "cluster.gpu_memory_gb=40")
    assert "does not fit in cluster.gpu_memory_gb=40" in err
    assert "fix: set train.megatron.distributed_optimizer: true" in err


def test_pipeline_expert_and_virtual_pipeline_rules(capsys) -> None:
    err = _refused(capsys, "qwen3-30b-a3b-gsm8k.yaml", "train.megatron.expert_parallel=6")
    assert "expert_parallel=6 does not divide the 128 experts" in err
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "train.megatron.tensor_parallel=1",
                   "train.megatron.pipeline_parallel=8", "rollout.engine_tensor_parallel=1", "rollout.num_engines=8")
    assert "pipeline_parallel=8 does not divide the 36 layers" in err
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "train.megatron.pipeline_parallel=2",
                   "train.megatron.virtual_pipeline=4")
    assert "virtual_pipeline=4 needs pipeline_parallel >= 2 and must divide the 18 layers per pipeline stage" in err
    err = _refused(capsys, "tiny-arith.yaml", "train.backend=megatron", "train.megatron.pipeline_parallel=4",
                   "train.num_ranks=4")  # more stages than the tiny model's 2 layers: refused, no crash
    assert "pipeline_parallel=4 does not divide the 2 layers of tiny-arith" in err
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "train.megatron.expert_parallel=2")
    assert "Qwen3-8B is a dense model" in err


def test_roles_colocated_engines_and_nodes(capsys) -> None:
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "rollout.num_engines=8")
    assert "colocated engines run on the trainer's 8 devices, but" in err and "= 16" in err
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "cluster.placement=disaggregated")
    assert "16 GPUs are needed (disaggregated) = 2 nodes of 8, but 1 node(s) are available" in err
    plan = make_plan(load_recipe(ROOT / "recipes" / "deepseek-v3-gsm8k.yaml"))
    assert (plan.roles.trainer_devices, plan.roles.engine_devices, plan.roles.nodes_needed) == (256, 128, 48)


def test_shared_placement_plans_the_trainer_beside_resident_engines(capsys) -> None:
    """`shared` (async on the trainer's devices, nothing handed over): one memory phase holding
    the trainer's whole step and the engines; the same devices as colocated, and its own fix."""
    recipe = load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml", ["cluster.placement=shared", "loop.max_staleness=1"])
    plan, colocated = make_plan(recipe), make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"))
    assert [p.name for p in plan.phases] == ["training beside the engines"]
    assert plan.phases[0].items == plan.trainer_items + plan.engine_items
    assert plan.roles.total_devices == colocated.roles.total_devices == 8
    assert plan.phases[0].total_bytes > max(p.total_bytes for p in colocated.phases)
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "cluster.placement=shared", "loop.max_staleness=1",
                   "cluster.gpu_memory_gb=24")
    assert "or cluster.placement: colocated (engines give their memory back" in err
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", "cluster.placement=shared", "rollout.num_engines=8")
    assert "shared engines run on the trainer's 8 devices, but" in err


def test_kv_heads_rule_and_readable_config_json_wins(tmp_path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    cfg = {**CATALOG["Qwen3-8B"], "num_attention_heads": 24, "num_key_value_heads": 8}
    (model / "config.json").write_text(json.dumps(cfg))
    err = _refused(capsys, "qwen3-8b-gsm8k.yaml", f"model.path={model}",
                   "train.megatron.tensor_parallel=6", "train.num_ranks=6", "cluster.slurm.gpus_per_node=6",
                   "rollout.num_engines=3")
    assert "tensor_parallel=6 is neither a divisor nor a multiple of the 8 KV heads" in err
    assert f"architecture from {model / 'config.json'}" in err
    assert "model.catalog `Qwen3-8B` differs from model.path's config.json (num_heads 24 vs 32)" in err
    # KV heads below TP are replicated (4 KV heads, TP 8): allowed, each rank holds one.
    plan = make_plan(load_recipe(ROOT / "recipes" / "qwen3-30b-a3b-gsm8k.yaml",
                                 ["train.megatron.tensor_parallel=8", "rollout.engine_tensor_parallel=8",
                                  "rollout.num_engines=2"]))
    assert plan.ok, plan.problems


def test_a_model_without_a_readable_config_needs_a_catalog_name(capsys) -> None:
    assert main(["plan", str(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"), "--set", "model.catalog=null"]) == 2
    assert "set model.catalog to one of Qwen3-0.6B" in capsys.readouterr().err
    assert main(["plan", str(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"), "--set", "model.catalog=Qwen9"]) == 2
    assert "model.catalog `Qwen9` is not a shipped config" in capsys.readouterr().err


def test_pipeline_stages_and_the_worst_stage() -> None:
    assert stage_layers(8, 2, None, 1) == [4, 5, 6, 7]
    assert stage_layers(8, 2, 2, 0) == [0, 1, 4, 5]  # interleaved: chunks 0 and 2 of 4
    one = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"))
    two = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml", [
        "train.megatron.pipeline_parallel=2", "train.megatron.tensor_parallel=1", "train.num_ranks=8"]))
    # PP 2 at TP 1 holds half the layers at twice the width: about the same weights per GPU,
    # while stage 0 holds 2 micro-batches in flight (1F1B) instead of 1.
    assert two.trainer_stage in (0, 1)
    assert _items(two)["weights"] == pytest.approx(_items(one)["weights"], rel=0.1)
    stage0 = next(i for i in trainer_memory(two.arch, two.layout, 0) if i.name == "activations")
    assert "2.00 in flight" in stage0.formula


def test_planning_imports_neither_torch_nor_transformers() -> None:
    """`milepost plan` runs on a login node: no heavy imports."""
    import subprocess
    import sys

    code = ("import sys; from milepost.cli import main; "
            f"rc = main(['plan', {str(ROOT / 'recipes' / 'deepseek-v3-gsm8k.yaml')!r}]); "
            "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0 False False"


def test_the_megatron_note_matches_what_the_backend_builds() -> None:
    import ast

    from milepost.core.plan.layout import MEGATRON_BUILDS

    tree = ast.parse((ROOT / "core" / "train" / "megatron" / "model.py").read_text())
    built = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", "") == "SUPPORTED_ARCHITECTURES")
    assert set(built) == set(MEGATRON_BUILDS)
    plan = make_plan(load_recipe(ROOT / "recipes" / "deepseek-v3-gsm8k.yaml"))
    assert any("does not build `deepseek_v3` models yet" in n for n in plan.notes)
    qwen = make_plan(load_recipe(ROOT / "recipes" / "qwen3-8b-gsm8k.yaml"))
    assert not any("does not build" in n for n in qwen.notes)
