"""The recipe schema: one typed section per component, validated at the door.

Every model forbids unknown keys, so a typo fails before any process starts. Values that
are derived from others are computed by the component that needs them, never written back
into the recipe.
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


def _is_number(annotation: Any) -> bool:
    """int, float, or an optional of one of them."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return bool(args) and all(a in (int, float) for a in args)
    return False


class Section(BaseModel):
    # allow_inf_nan=False: `.nan` or `.inf` in a recipe is always a typo or a broken generator,
    # and NaN passes every `ge`/`le` bound silently.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads `true` as 1 for an int field: `num_blocks: true` would run one block.
        field = info.field_name  # always set for a field validator
        if isinstance(value, bool) and field is not None and _is_number(cls.model_fields[field].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}; write the count or value itself")
        return value


class CampaignConfig(Section):
    name: str = Field("campaign", max_length=200,
                      description="Human-readable campaign name; it names the campaign's Airflow DAG.")
    num_blocks: int = Field(3, ge=1, description="Blocks (DAG runs) in the campaign.")
    steps_per_block: int = Field(10, ge=1, description="RL steps per block.")
    max_eval_drop: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Regression gate: a block whose eval accuracy falls more than this below the best "
                    "block's pauses the campaign (resume continues from the best block's checkpoint). "
                    "null: no gate.")

    @field_validator("name")
    @classmethod
    def _name_has_a_word(cls, name: str) -> str:
        # The DAG id keeps only letters, digits and `_`: a name without any would be `milepost_`,
        # shared by every such campaign.
        if not any(c.isascii() and c.isalnum() for c in name):
            raise ValueError(f"campaign.name {name!r} has no letter or digit; it names the campaign's Airflow "
                             "DAG: use e.g. `tiny-arith`")
        return name


class TinyModelConfig(Section):
    """The project's own small model, built and warm-started when `model.path` is builtin."""

    hidden_size: int = Field(128, ge=16)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(256, ge=16)
    warmstart_steps: int = Field(600, ge=0, description="Supervised steps on the task before RL.")
    warmstart_batch_size: int = Field(64, ge=1)
    warmstart_lr: float = Field(1e-3, gt=0, description="Peak of a cosine-decayed schedule.")
    warmstart_unsimplified_fraction: float = Field(
        0.6, ge=0.0, le=1.0,
        description="Share of warm-start answers written unsimplified (`125+0`), which the "
                    "exact-match reward rejects: the base policy is right only sometimes.")

    SECTION: ClassVar[str] = "model.tiny"  # where the recipe holds it, for errors

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{self.SECTION}.hidden_size={self.hidden_size} is not divisible by num_heads="
                             f"{self.num_heads}; pick a hidden_size that is a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.SECTION}.num_heads={self.num_heads} is not divisible by num_kv_heads="
                             f"{self.num_kv_heads}; pick num_kv_heads dividing num_heads (e.g. 1, 2)")
        return self


class TinyMoeConfig(Section):
    """The MLP of `builtin:tiny-arith-moe` (a Qwen3-MoE; attention and warm-start from `model.tiny`)."""

    num_experts: int = Field(4, ge=2, description="Routed experts per layer.")
    num_experts_per_tok: int = Field(2, ge=1, description="top-k: experts each token is routed to.")
    moe_intermediate_size: int = Field(128, ge=8, description="Hidden width of one expert.")
    router_aux_loss_coef: float = Field(0.01, ge=0.0, description="Load-balancing loss in the warm-start.")

    @model_validator(mode="after")
    def _k_fits(self) -> TinyMoeConfig:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.tiny_moe.num_experts_per_tok={self.num_experts_per_tok} is more than "
                             f"num_experts={self.num_experts}; pick a top-k of at most num_experts")
        return self


class GpuArithConfig(TinyModelConfig):
    """`builtin:gpu-arith`: tiny-arith's tokenizer on a ~76 M Qwen2 (12 layers, hidden 768),
    warm-started on three-digit additions (core/model/gpu_arith.py; on a GPU when there is one).
    The warm-start's imperfection is in the arithmetic itself: a share of the rows whose sum
    carries are answered with their carries forgotten (457+368=715), so the base policy's
    greedy answer to most carrying sums has the wrong value, and a reward that checks the
    value (`arith-value`) is what RL can raise."""

    SECTION: ClassVar[str] = "model.gpu_arith"

    hidden_size: int = Field(768, ge=16)
    num_layers: int = Field(12, ge=1)
    num_heads: int = Field(12, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(2048, ge=16)
    # 750 x 2048 rows, not 3000 x 512: the same rows in a quarter of the steps, 100 s instead of
    # 241 s on an H100 (an eager 512-row step is launch-bound), the same base policy
    # (bench/results/warmstart_speed_gpu.txt).
    warmstart_steps: int = Field(750, ge=0, description="Supervised steps on the task before RL.")
    warmstart_batch_size: int = Field(2048, ge=1)
    warmstart_lr: float = Field(8e-4, gt=0, description="Peak of a cosine-decayed schedule.")
    warmstart_warmup_steps: int = Field(50, ge=0, description="Linear warm-up before the cosine decay.")
    warmstart_unsimplified_fraction: float = Field(0.0, ge=0.0, le=1.0, description="As model.tiny's.")
    warmstart_carry_error_fraction: float = Field(
        0.6, ge=0.0, le=1.0,
        description="Share of warm-start rows whose sum carries that are answered with every carry "
                    "forgotten (457+368=715): above 0.5 the base policy's greedy answer to those sums is wrong.")


class ModelConfig(Section):
    path: str = Field(
        "builtin:tiny-arith",
        description="An HF checkpoint folder/URL, or `builtin:tiny-arith` / `builtin:tiny-arith-moe` / "
                    "`builtin:gpu-arith` for the project's own models.",
    )
    tiny: TinyModelConfig = TinyModelConfig()
    tiny_moe: TinyMoeConfig = TinyMoeConfig()
    gpu_arith: GpuArithConfig = GpuArithConfig()
    catalog: str | None = Field(
        None, description="A shipped HF config (`milepost plan --models` lists them, e.g. `Qwen3-8B`) that "
                          "`milepost plan` uses when `path` has no config.json readable on this machine.")


class DataConfig(Section):
    train_path: str = Field(
        "builtin:tiny-arith/train", description="JSONL or Parquet prompts (fsspec URL or path)."
    )
    eval_path: str = Field("builtin:tiny-arith/eval", description="Held-out JSONL or Parquet prompts.")
    prompt_key: str = "prompt"
    label_key: str = "label"
    shuffle: bool = True
    num_train_rows: int = Field(20000, ge=1, description="Rows generated for builtin datasets.")
    num_eval_rows: int = Field(200, ge=1, description="Rows generated for builtin eval sets.")


# Flags the launcher sets itself (core/fleet/launcher.py): `rollout.sglang.extra_args` may not
# repeat them, nor put a key on the command line, where `ps` shows it to every user.
MANAGED_ENGINE_FLAGS = frozenset({
    "--model-path", "--model", "--host", "--port", "--nccl-port", "--tp-size", "--tensor-parallel-size",
    "--dp-size", "--data-parallel-size", "--ep-size", "--expert-parallel-size", "--ep", "--base-gpu-id",
    "--mem-fraction-static", "--enable-memory-saver", "--weight-version", "--skip-server-warmup",
    "--enable-return-routed-experts", "--enable-deterministic-inference", "--dist-init-addr",
    "--nccl-init-addr", "--nnodes", "--node-rank", "--max-running-requests", "--config", "--dtype",
    "--quantization"})
SECRET_ENGINE_FLAGS = frozenset({"--api-key", "--admin-api-key"})


class SglangConfig(Section):
    """Options of SGLang engines (`rollout.engine: sglang`); the built-in engine ignores them."""

    mem_fraction_static: float | None = Field(
        None, gt=0.0, lt=1.0, description="SGLang --mem-fraction-static: the share of each GPU for weights "
                                          "and KV cache; null: SGLang's own default. Colocated with the "
                                          "trainer, leave room for it (e.g. 0.5).")
    dp_size: int | None = Field(None, ge=1, description="SGLang --dp-size (data-parallel replicas inside one "
                                                        "engine); null: not passed.")
    ep_size: int | None = Field(None, ge=1, description="SGLang --ep-size (expert parallelism, MoE); null: "
                                                        "not passed.")
    enable_return_routed_experts: bool = Field(
        False, description="SGLang --enable-return-routed-experts: responses carry the routed experts "
                           "(MoE routing replay). Needs an MoE model.")
    extra_args: tuple[str, ...] = Field(
        (), description="More `sglang.launch_server` arguments, one list item per argv word, e.g. "
                        "[--attention-backend, fa3]. Flags milepost sets itself are refused.")

    @field_validator("extra_args")
    @classmethod
    def _not_managed(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        for arg in args:
            if any(c in arg for c in "\n\r\0"):
                raise ValueError(f"rollout.sglang.extra_args item {arg!r} contains a newline or NUL")
            flag = arg.split("=", 1)[0]
            if flag in SECRET_ENGINE_FLAGS:
                raise ValueError(f"rollout.sglang.extra_args: {flag} would put a key on the command line, "
                                 "visible in `ps`; milepost passes the campaign's admin key in an owner-only "
                                 "--config file itself")
            if flag in MANAGED_ENGINE_FLAGS:
                raise ValueError(f"rollout.sglang.extra_args: {flag} is set by milepost itself; use its "
                                 "rollout field instead (see `milepost run RECIPE --dry-run`)")
        return args


class RolloutConfig(Section):
    function: str = Field("default", description="Registered rollout function or import path.")
    num_engines: int = Field(1, ge=1)
    num_samples_per_prompt: int = Field(8, ge=1)
    prompts_per_step: int = Field(32, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_new_tokens: int = Field(8, ge=1)
    max_batch_size: int = Field(512, ge=1, description="Most sequences an engine decodes at once.")
    max_prompt_tokens: int = Field(
        512, ge=1, description="Longest prompt in tokens; `milepost plan` sizes the engines' KV cache and "
                               "the trainer's sequences with it.")
    deterministic_inference: bool = Field(
        False, description="Outputs and logprobs that do not depend on the batch a request runs in "
                           "(--enable-deterministic-inference: SGLang's batch-invariant kernels; the "
                           "built-in engine decodes each sequence alone). Slower; what makes a resumed "
                           "run bitwise the uninterrupted one, since the trainer uses the engines' "
                           "logprobs.")
    engine: Literal["builtin", "sglang"] = Field(
        "builtin", description="builtin: milepost's own engine (CPU, or one GPU). sglang: "
                               "`python -m sglang.launch_server` on GPU bundles (pip install milepost[sglang]).")
    sglang: SglangConfig = SglangConfig()
    engine_tensor_parallel: int = Field(1, ge=1, description="Devices per engine (SGLang --tp-size).")
    partial_rollout: bool = Field(
        True, description="A response cut by a weight push keeps its tokens and is continued under "
                          "the new policy (per-token versions recorded); false: its chunk is generated again.")
    request_timeout_s: float = Field(300.0, gt=0)
    engine_startup_timeout_s: float = Field(
        180.0, gt=0, description="Cold-start budget of one engine: launch until its first healthy "
                                 "/health_generate (an SGLang engine of a large model needs minutes).")
    router_policy: Literal["round_robin", "cache_aware", "power_of_two"] = "round_robin"
    max_engine_restarts: int = Field(
        2, ge=0, description="Engine restarts the fleet may make in one stage; one more death fails it.")
    health_check_interval_s: float = Field(
        5.0, gt=0, description="Seconds between /health_generate checks of each serving engine.")
    health_failure_threshold: int = Field(
        3, ge=1, description="Consecutive failed health checks that declare a live engine dead.")
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of one /health_generate (it waits behind the running batch).")

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:  # SGLang reads 0 as "keep no token"; -1 is its "off"
            raise ValueError("top_k=0 keeps no token; use -1 to disable top-k, or a count >= 1")
        return value


class RewardConfig(Section):
    function: str = Field(
        "tiny-arith", description="Registered reward name or `module:function` / `file.py:function`: "
                                  "fn(response_text, label) -> float. A sample whose reward raises or is "
                                  "not a finite number is left out of training and counted "
                                  "(rollout/reward_failed); a step where every sample fails stops the run.")
    num_workers: int = Field(2, ge=1, description="Threads that evaluate rewards concurrently.")


# Extension points (algo.advantage, algo.loss, filters.functions, hooks.*) take a registered
# name or an import path: which names exist and whether a path loads and has the right
# signature is checked at start-up by core/extensions.py (the registries live beside the
# code that calls them, which imports this module).
PLUGIN_SPEC = ("a registered name, or an import path `my_pkg.module:function` / `path/to/file.py:function` "
               "(a relative path is read from the folder milepost runs in)")


class FilterConfig(Section):
    drop_zero_variance_groups: bool = Field(
        True, description="Built-in filter `zero_variance_groups`: drop groups whose rewards are all equal.")
    max_response_tokens: int | None = Field(None, ge=1, description="Built-in length bound, inclusive.")
    min_response_tokens: int | None = Field(None, ge=0, description="Built-in length bound, inclusive.")
    functions: tuple[str, ...] = Field(
        (), description="More filters, applied in order after the built-in ones: each " + PLUGIN_SPEC +
                        "; fn(samples, context) -> (kept_samples, metrics).")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> FilterConfig:
        lo, hi = self.min_response_tokens, self.max_response_tokens
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"filters.min_response_tokens={lo} is above filters.max_response_tokens={hi}: "
                             "every sample would be dropped; lower the minimum or raise the maximum")
        return self


class AlgoConfig(Section):
    advantage: str = Field(
        "grpo", min_length=1, description="grpo, dr_grpo, rloo, reinforce_pp, or " + PLUGIN_SPEC +
                                          "; fn(rewards: Tensor[G, n]) -> Tensor[G, n].")
    loss: str = Field(
        "ppo", min_length=1, description="ppo (clip-higher, dual clip), gspo, or " + PLUGIN_SPEC +
                                         "; fn(inputs: PolicyLossInputs) -> (per_token_loss, clipfrac).")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="Ratios below 1 - clip_low are clipped.")
    clip_high: float = Field(0.28, ge=0.0, description="Clip-higher (DAPO) upper bound.")
    dual_clip_c: float | None = Field(3.0, gt=1.0, description="Dual-clip bound for A<0; null disables.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to the reference model.")
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0.0)
    tis_cap: float | None = Field(2.0, gt=0.0, description="Truncated importance sampling cap; null disables.")
    routing_replay: bool = Field(
        False, description="MoE only: the trainer routes each token to the experts the engine chose when it "
                           "sampled (gate weights recomputed from current logits); false: its own top-k.")


class HooksConfig(Section):
    """User functions called at named moments of the loop (core/hooks.py). Each list holds
    registered names or import paths, called in order."""

    on_rollout: tuple[str, ...] = Field((), description="fn(samples, context): a step's scored samples.")
    on_step_end: tuple[str, ...] = Field((), description="fn(metrics, context): a step's metrics row.")
    on_checkpoint: tuple[str, ...] = Field((), description="fn(checkpoint, context): a committed checkpoint.")
    on_block_end: tuple[str, ...] = Field((), description="fn(block, context): the block's steps are done.")


Fp8RecipeName = Literal["rowwise", "rowwise-gw-bf16", "tensorwise", "tensorwise-fast", "tensorwise-fast-delayed",
                        "tensorwise-fast-e4m3"]


class MegatronConfig(Section):
    """Parallel layout of the Megatron-core backend (`train.backend: megatron`). The data-parallel
    size is derived: train.num_ranks / (tensor_parallel * pipeline_parallel * context_parallel)."""

    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    virtual_pipeline: int | None = Field(
        None, ge=2, description="Model chunks per pipeline rank (interleaved schedule); null: off.")
    context_parallel: int = Field(1, ge=1, description="Only 1 for now: needs Transformer Engine attention.")
    expert_parallel: int = Field(1, ge=1, description="MoE experts split over this many ranks (export and weight "
                                                      "sync need 1 for now).")
    expert_tensor_parallel: int | None = Field(None, ge=1, description="TP inside experts; null: tensor_parallel.")
    sequence_parallel: bool = Field(False, description="Needs Transformer Engine layers (not used yet): keep false.")
    distributed_optimizer: bool = Field(False, description="Shard optimizer state over data-parallel ranks (GPU only).")
    recompute: Literal["none", "selective", "full"] = "none"
    pack_sequences: bool = Field(True, description="Pack micro-batch samples into one sequence (THD).")
    micro_batch_tokens: int = Field(4096, ge=1, description="Token budget of one packed micro-batch.")
    fuse: bool = Field(True, description="Fused RoPE / RMSNorm / SwiGLU / logprob kernels (torch.compile on "
                                         "GPU, the same math eagerly on CPU); false: megatron's unfused ops.")
    fp8_recipe: Fp8RecipeName = Field(
        "tensorwise-fast", description="precision.train fp8: how the GEMM operands are scaled "
        "(core/train/megatron/fp8.py RECIPES). rowwise: a scale per token / feature, e4m3 gradients (its casts "
        "are compiled by inductor, not the Triton kernel; not yet measured on a GPU at the Qwen3-1.7B "
        "shape); rowwise-gw-bf16: the weight gradient in bf16; tensorwise: one scale per tensor, e5m2 "
        "gradients; tensorwise-fast (the "
        "default): and fast accumulation in the forward GEMM (the fastest measured: 1.03-1.16x bf16 on H100s at "
        "the Qwen3-1.7B shape, micro-batch 8); "
        "tensorwise-fast-delayed: and delayed scaling (amax history 16: no amax pass before each cast); "
        "tensorwise-fast-e4m3: tensorwise-fast with e4m3 gradients (half e5m2's rounding step).")
    fp8_bf16_edge_layers: int = Field(
        0, ge=0, description="precision.train fp8: keep the linears of the first and of the last this many "
        "transformer layers in bf16 (where a model's loss is most sensitive to rounding; each layer kept costs "
        "its share of fp8's speed-up).")


class LoraConfig(Section):
    """train.lora: train a low-rank adapter (PEFT's LoRA) instead of every weight; engines keep
    the base weights and get only the adapter (core/weight_sync/lora_push.py)."""

    rank: int = Field(8, ge=1, description="r: the adapter's rank.")
    alpha: float = Field(16.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Linear layers to adapt, by the last part(s) of their names (PEFT's matching).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="lora_dropout on the adapter's input (training only).")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, names: list[str]) -> list[str]:
        if not names or any(not n or n != n.strip() for n in names):
            raise ValueError(f"train.lora.target_modules must name at least one Linear layer, e.g. [q_proj, v_proj]; "
                             f"got {names}")
        return names


class TrainConfig(Section):
    backend: Literal["torch", "megatron"] = "torch"
    num_ranks: int = Field(2, ge=1, description="Trainer processes (one per GPU on GPU machines).")
    parallel: Literal["ddp"] = Field("ddp", description="Parallelism of the torch backend.")
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    micro_batch_size: int = Field(64, ge=1)
    grad_clip: float = Field(1.0, gt=0.0)
    num_threads_per_rank: int = Field(1, ge=1)
    megatron: MegatronConfig = MegatronConfig()
    lora: LoraConfig | None = Field(None, description="A LoRA adapter instead of full fine-tuning; null: off.")

    @model_validator(mode="before")
    @classmethod
    def _precision_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "precision" in data:
            raise ValueError(f"train.precision moved to precision.train (beside precision.rollout): write "
                             f"`precision: {{train: {data['precision']}}}` at the top level of the recipe")
        return data

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW betas must each be in [0, 1), got {list(betas)}; e.g. [0.9, 0.999]")
        return betas

    @model_validator(mode="after")
    def _layout_divides(self) -> TrainConfig:
        m = self.megatron
        model_parallel = m.tensor_parallel * m.pipeline_parallel * m.context_parallel
        if self.backend == "megatron" and self.num_ranks % model_parallel:
            raise ValueError(
                f"train.num_ranks={self.num_ranks} is not divisible by tensor_parallel*pipeline_parallel*"
                f"context_parallel={m.tensor_parallel}*{m.pipeline_parallel}*{m.context_parallel}="
                f"{model_parallel}; set num_ranks to a multiple of {model_parallel}")
        return self


TrainPrecision = Literal["fp32", "bf16", "fp8", "int4_qat"]
RolloutPrecision = Literal["fp32", "bf16", "fp8", "int4"]


class PrecisionConfig(Section):
    """Number formats of training and rollout. What each mode runs on, and the start-up
    refusal of one the device cannot run: core/quant/modes.py. Where the two differ, the
    trainer's and the engines' logprobs differ (train/engine_logprob_diff_mean) and TIS
    (algo.tis_cap, on by default) corrects for it."""

    train: TrainPrecision = Field(
        "fp32", description="fp32; bf16 (torch backend: bf16 autocast over fp32 weights, on CPU too; megatron: "
                            "bf16 parameters with fp32 master weights in its optimizer on GPU, autocast on CPU); "
                            "int4_qat (fp32 parameters, every Linear but the head and MoE routers "
                            "fake-quantised to group-wise int4 in the forward, straight-through gradients; "
                            "megatron: the transformer linears, with tensor parallelism leaving each rank whole "
                            "groups of 128 input features); "
                            "fp8 (megatron backend: bf16 training with the transformer linears' GEMMs through "
                            "torch._scaled_mm, fp32 master weights; CUDA compute capability >= 8.9, or a CPU, "
                            "where it is emulated and slow).")
    rollout: RolloutPrecision = Field(
        "fp32", description="Engine weights: fp32, bf16 (--dtype float32 / bfloat16); int4 (built-in engine: "
                            "the pushed fp32 weights quantised with precision.train int4_qat's function, "
                            "stored as int4 + scales, dequantised for each matmul); fp8 (Linear weights in "
                            "block-wise e4m3 with 128 x 128 scales, SGLang's and DeepSeek-V3's format, quantised "
                            "by the trainer on sync; the built-in engine dequantises them to bf16 for each "
                            "matmul, SGLang engines launch and load from disk an fp8 copy of each folder and need "
                            "each merged projection's part to be a multiple of 128 rows per rank).")


class SyncConfig(Section):
    transport: Literal["disk", "tensor", "distributed"] = Field(
        "disk", description="disk: HF export + /update_weights_from_disk. tensor (colocated): /dev/shm "
                            "buckets. distributed (disaggregated): broadcast from trainer rank 0.")
    timeout_s: float = Field(120.0, gt=0, description="Bound on one push attempt, every step included.")
    bucket_mb: float = Field(512.0, gt=0, description="Bucket size of the tensor and distributed transports.")
    gloo_streams: int = Field(
        4, ge=1, le=16, description="distributed over gloo (CPU): TCP connections from the trainer to each "
                                    "engine (fewer if an engine takes fewer; SGLang takes 1). nccl ignores it.")


class CheckpointConfig(Section):
    every_steps: int = Field(5, ge=1)
    keep_last: int = Field(3, ge=1)


class LoopConfig(Section):
    max_staleness: int = Field(
        0, ge=0, description="0: synchronous on-policy. k>0: rollout runs up to k policy versions "
                             "ahead of training, overlapping with it.")
    on_stale: Literal["regenerate", "drop"] = Field(
        "regenerate", description="A rollout older than the bound (after a resume with a smaller "
                                  "bound) is generated again, or dropped with its prompts.")


class EvalConfig(Section):
    num_prompts: int = Field(200, ge=1)
    max_new_tokens: int = Field(8, ge=1)


# Sinks beside blocks/<n>/metrics.jsonl, and the extra each needs (module to find, pip extra).
SINK_EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
               "wandb": ("wandb", "wandb")}
KNOWN_SINKS = ("jsonl", *SINK_EXTRAS)


class MlflowSinkConfig(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; null: an SQLite file under the campaign store "
                          "(<campaign>/metrics/mlflow/mlflow.db), offline. Credentials of a server come "
                          "from the environment (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD).")
    experiment: str | None = Field(None, max_length=500,
                                   description="MLflow experiment; null: campaign.name.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        # A password in the recipe would be stored in campaign.yaml and every stage record's view.
        if uri and "@" in uri.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError("metrics.mlflow.tracking_uri holds credentials (`user:password@`); "
                             "remove them and set MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
                             "MLFLOW_TRACKING_TOKEN in the environment instead")
        return uri


class MetricsConfig(Section):
    """Where step metrics go. blocks/<n>/metrics.jsonl is always written (listing `jsonl` is
    allowed and changes nothing); the other sinks get each committed step exactly once."""

    sinks: tuple[str, ...] = Field(
        ("jsonl",), description="Any of jsonl, tensorboard (<campaign>/metrics/tensorboard), "
                                "mlflow, wandb (one offline run per campaign); each but jsonl needs its "
                                "extra: pip install 'milepost[tensorboard]' / 'milepost[mlflow]' / "
                                "'milepost[wandb]'.")
    mlflow: MlflowSinkConfig = MlflowSinkConfig()

    @field_validator("sinks")
    @classmethod
    def _known_and_installed(cls, sinks: tuple[str, ...]) -> tuple[str, ...]:
        import difflib
        import importlib.util

        for name in sinks:
            if name not in KNOWN_SINKS:
                close = difflib.get_close_matches(name, KNOWN_SINKS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ValueError(f"metrics.sinks: unknown sink {name!r}{hint}; choose from "
                                 f"{', '.join(KNOWN_SINKS)}")
            if name in SINK_EXTRAS and importlib.util.find_spec(SINK_EXTRAS[name][0]) is None:
                raise ValueError(f"metrics.sinks: {name} needs the `{SINK_EXTRAS[name][0]}` package, which "
                                 f"is not installed here: pip install 'milepost[{SINK_EXTRAS[name][1]}]' "
                                 f"(in every environment that runs stages), or remove {name}")
        if len(set(sinks)) != len(sinks):
            raise ValueError(f"metrics.sinks lists a sink twice ({list(sinks)}); name each once")
        return sinks


# --- cluster: where the block's stages run ----------------------------------------------
# sbatch long options (Slurm 22.05) that may be passed through `extra`.
EXTRA_DIRECTIVES = frozenset("""
acctg-freq bb bbf begin chdir cluster-constraint clusters comment container contiguous
core-spec cores-per-socket cpu-freq cpus-per-gpu deadline delay-boot dependency
distribution exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind
gpu-freq gpus gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs
kill-on-invalid-dep licenses mail-type mail-user mcs-label mem-bind mem-per-cpu mem-per-gpu
mincpus network nice no-kill no-requeue nodefile nodelist ntasks ntasks-per-core
ntasks-per-socket overcommit oversubscribe power prefer priority profile propagate reboot
requeue reservation sockets-per-node spread-job switches thread-spec threads-per-core
time-min tmp uid use-min-nodes wckey
""".split())  # noqa: SIM905 - a word list, as Slurm's manual lists them

# Options with a typed field: `extra` may not set them a second way.
TYPED_DIRECTIVES = {
    "partition": "partition", "account": "account", "qos": "qos", "time": "time_min",
    "nodes": "nodes", "ntasks-per-node": "tasks_per_node", "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task", "mem": "mem_gb", "constraint": "constraint",
}
# Options the executors set themselves (log paths, job name, the preemption signal).
RESERVED_DIRECTIVES = frozenset({"output", "error", "job-name", "signal", "open-mode", "array",
                                 "input", "wrap", "parsable", "wait", "test-only"})

DirectiveValue = bool | int | float | str


def check_directive_value(name: str, value: object) -> None:
    """A value that would end the `#SBATCH` line early would inject shell code."""
    if isinstance(value, str) and any(c in value for c in "\n\r\0"):
        raise ValueError(f"sbatch option {name!r} contains a newline or NUL character: {value!r}")


class SlurmOptions(BaseModel):
    """sbatch options for every job of a campaign (`cluster.slurm` in a recipe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = Field(None, description="Node features, e.g. `h200&ib`.")
    time_min: int = Field(60, ge=1, description="Wall-clock limit of each job in minutes.")
    nodes: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1)
    cpus_per_task: int | None = Field(None, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    mem_gb: float | None = Field(None, gt=0, description="Memory per node; None: the partition default.")
    extra: dict[str, DirectiveValue] = Field(
        default_factory=dict,
        description="Other sbatch long options without the leading `--`, e.g. "
                    "`{reservation: demo, exclusive: true}`.")

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _one_line(cls, value: str | None, info) -> str | None:
        check_directive_value(info.field_name, value)
        return value

    @field_validator("extra")
    @classmethod
    def _known_directives(cls, extra: dict[str, DirectiveValue]) -> dict[str, DirectiveValue]:
        for name, value in extra.items():
            if name in TYPED_DIRECTIVES:
                raise ValueError(f"sbatch option {name!r} has its own field: set "
                                 f"`{TYPED_DIRECTIVES[name]}` instead of `extra.{name}`")
            if name in RESERVED_DIRECTIVES:
                raise ValueError(f"sbatch option {name!r} is set by milepost itself and cannot be overridden")
            if name not in EXTRA_DIRECTIVES:
                raise ValueError(f"unknown sbatch option {name!r} in `extra`; valid options: "
                                 f"{', '.join(sorted(EXTRA_DIRECTIVES))}")
            if value is False:
                raise ValueError(f"sbatch option {name!r}: false is not a value; leave the option out")
            check_directive_value(name, value)
        return extra

    def with_resources(self, resources: BaseModel | None) -> SlurmOptions:
        """These options with the resources that `resources` sets replacing the defaults."""
        if resources is None:
            return self
        return self.model_copy(update=resources.model_dump(exclude_none=True))


class ClusterConfig(Section):
    """Where a block's stages run. `local`: local processes and a local Ray head (the embedded
    default). `slurm`: the block's Ray cluster on a Slurm allocation of `num_nodes` nodes,
    every stage a Slurm job (options from `slurm`)."""

    executor: Literal["local", "slurm"] = "local"
    placement: Literal["colocated", "disaggregated", "shared"] = Field(
        "colocated", description="colocated: trainer and engines share devices (engines sleep while "
                                 "training). disaggregated: separate devices, overlapping freely. shared: "
                                 "trainer and engines share devices and both stay resident, so they overlap "
                                 "there (async RL on one GPU; the two must fit its memory together).")
    num_nodes: int = Field(1, ge=1, description="Nodes of the block's Ray allocation (slurm; the local "
                                                "executor always runs on one machine).")
    slurm: SlurmOptions = SlurmOptions()
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of one GPU (80: A100/H100 80GB, 141: H200); `milepost plan` "
                                "refuses layouts whose per-GPU estimate exceeds it.")
    max_block_retries: int = Field(
        1, ge=0, description="Times a block whose stage failed (a node lost, the allocation gone) is torn "
                             "down and launched again; train resumes from its last checkpoint.")
    orphan_grace_s: int | None = Field(
        None, ge=10, description="A block's Ray cluster (a Slurm allocation, or the local head with its engines) "
                                 "stops itself once no run has held the campaign's lease for this long (its "
                                 "`milepost run` killed, or its Airflow run gone, so teardown never came); a "
                                 "resumed campaign starts a new one. null: 1800 s on Slurm (an Airflow run's "
                                 "lapse shows only when its lease expires), 120 s locally (a `milepost run`'s "
                                 "lease names its process: a killed one is seen at once).")

    def orphan_grace(self) -> int:
        """`orphan_grace_s`, or the executor's default."""
        if self.orphan_grace_s is not None:
            return self.orphan_grace_s
        return 1800 if self.executor == "slurm" else 120


class Recipe(Section):
    seed: int = 1
    campaign: CampaignConfig = CampaignConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    filters: FilterConfig = FilterConfig()
    algo: AlgoConfig = AlgoConfig()
    hooks: HooksConfig = HooksConfig()
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    sync: SyncConfig = SyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    loop: LoopConfig = LoopConfig()
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _check_cross_field(self) -> Recipe:
        if self.cluster.placement == "colocated" and self.loop.max_staleness > 0:
            raise ValueError(
                f"loop.max_staleness={self.loop.max_staleness} needs cluster.placement: disaggregated: "
                "colocated engines sleep while the trainer runs, so nothing can be generated ahead; "
                "set cluster.placement=disaggregated (separate devices), cluster.placement=shared (the "
                "same devices, both resident), or loop.max_staleness=0")
        if self.train.lora is not None and self.sync.transport != "disk":
            raise ValueError(
                f"train.lora sends only the adapter, as a PEFT folder through /load_lora_adapter; "
                f"sync.transport={self.sync.transport} is for full weights: set sync.transport=disk")
        self._check_precision_combination()
        if self.algo.advantage in ("grpo", "dr_grpo", "rloo") and self.rollout.num_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.num_samples_per_prompt must be >= 2 for advantage `{self.algo.advantage}` "
                f"(group baselines need several samples); got {self.rollout.num_samples_per_prompt}"
            )
        return self

    def _check_precision_combination(self) -> None:
        """What no device runs yet (what a device cannot run: core/quant/modes.py)."""
        p = self.precision
        if self.train.lora is not None and (p.train == "int4_qat" or p.rollout in ("int4", "fp8")):
            raise ValueError(f"precision.train {p.train} / precision.rollout {p.rollout} with train.lora is not "
                             "supported yet (the adapter would sit on quantised base weights); remove train.lora "
                             "or use fp32 / bf16")
        if p.rollout == "int4" and self.rollout.engine != "builtin":
            # sglang 0.5.23, layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py:
            # process_weights_after_loading repacks for Marlin; restore_weights_before_loading is the no-op
            raise ValueError("precision.rollout int4 is served by the built-in engine only: SGLang serves int4 "
                             "linears through compressed-tensors W4A16, which repacks them for its Marlin kernel "
                             "after loading and does not undo that before a reload, so weights pushed each step "
                             "would land in the wrong layout; set rollout.engine=builtin or precision.rollout=bf16 "
                             "(or fp8, which SGLang reloads)")
