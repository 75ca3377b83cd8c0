"""One megatron-core rank: model chunks, Megatron DDP + optimizer, forward-backward schedule.

Plain Python (no Ray import), so the backend runs it as a Ray actor and a GPU benchmark can
run it in-process. Every public method runs inside `cpu_compat.activate()` (a no-op on GPU).

Gradient arithmetic (same contract as the torch backend): each micro-batch's loss is
rl_loss(..., token_normalizer = loss tokens of the whole step). `calculate_per_token_loss`
stops the schedule from dividing by the number of micro-batches and makes Megatron DDP *sum*
gradients over data-parallel ranks, and `num_tokens=None` in finalize_model_grads stops the
per-token rescale, so the gradient is exactly that of the full-batch token mean.

LR: the `lr_lambda` multiplier (core/train/schedule.py, shared with the torch backend), set on
every param group before each step.

Non-finite steps (core/train/nonfinite.py, as the torch backend): megatron's fp32 and bf16
optimizers step on NaN/inf gradients (only fp16's loss scaler looks for them), so before the
step every rank checks its losses and its reduced gradient buffers, and all ranks agree
(one all-reduce) to skip: no optimizer step, no schedule step, `skipped_nonfinite` reported.
A step megatron itself refuses (fp16 overflow) is skipped the same way. Save refuses
non-finite weights on every rank alike (agreed first, so no rank waits in the save's
collectives).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from milepost.core.algo.routing_replay import RankReplay
from milepost.core.config import AlgoConfig, LoraConfig, TrainConfig
from milepost.core.quant.fp8_cast import Fp8Recipe, weight_casts_reused
from milepost.core.quant.modes import int4_dtype
from milepost.core.tcp_store import bound_store
from milepost.core.train.batch import padding_sample
from milepost.core.train.megatron import cpu_compat, fusions, moe_tp, packed_attention
from milepost.core.train.megatron.converter import iter_hf_tensors, load_hf_into
from milepost.core.train.megatron.fp8 import RECIPES as FP8_RECIPES
from milepost.core.train.megatron.model import (
    ModelSpec,
    build_gpt_model,
    spec_from_hf_config,
    transformer_config,
)
from milepost.core.train.megatron.optimizer_kernels import use_fast_multi_tensor, use_fused_adam
from milepost.core.train.megatron.push_staging import PushStaging, Source
from milepost.core.train.megatron.step import (
    MicroBatch,
    build_micro_batches,
    forward_hidden,
    metrics_read,
    micro_batch_loss,
    response_logprobs,
)
from milepost.core.train.nonfinite import (
    NonFiniteWeightsError,
    agree_to_skip,
    all_finite,
    first_nonfinite,
    nonfinite_weights_message,
    tensors_finite,
)
from milepost.core.train.precision import autocast
from milepost.core.train.schedule import lr_lambda
from milepost.core.train.weight_source import SenderRank
from milepost.core.types import Sample
from milepost.core.weight_sync.packing import pack_parameters

PG_TIMEOUT = datetime.timedelta(minutes=10)
log = logging.getLogger(__name__)


def compat(method: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with cpu_compat.activate():
            return method(self, *args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = method.__name__, method.__doc__
    return wrapped


def check_fp8_device(device: torch.device) -> None:
    """fp8 runs on CPU (emulated) and on CUDA devices of compute capability >= 8.9; refuse others
    here too, for runs whose device was not known at start-up (core/quant/modes.py)."""
    from milepost.core.quant.modes import FP8_CAPABILITY
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        raise ValueError(f"precision.train fp8 needs a CUDA device of compute capability >= 8.9 (FP8 matmuls), "
                         f"this rank has {torch.cuda.get_device_name(device)} "
                         f"({torch.cuda.get_device_capability(device)}); use precision.train bf16")


class MegatronRankWorker(SenderRank):
    def __init__(self, rank: int, world_size: int, model_path: str, train_cfg: TrainConfig, algo_cfg: AlgoConfig,
                 temperature: float, seed: int, total_steps: int | None, precision: str = "fp32",
                 fp8_recipe: Fp8Recipe | None = None, weight_format: str | None = None) -> None:
        """`precision`: precision.train (fp32 | bf16 | fp8 | int4_qat; core/train/precision.py says what each
        does where). `fp8_recipe`: how fp8 scales (core/quant/fp8_cast.py); None: train.megatron.fp8_recipe's.
        `weight_format`: what weight sync sends (weight_sender.WeightSender)."""
        self.weight_format = weight_format
        torch.set_num_threads(train_cfg.num_threads_per_rank)
        self.rank, self.world_size, self.model_path, self.precision = rank, world_size, model_path, precision
        self.fp8_recipe = fp8_recipe or FP8_RECIPES[train_cfg.megatron.fp8_recipe]
        self.cfg, self.algo, self.temperature, self.seed = train_cfg, algo_cfg, temperature, seed
        self.lr_mult = lr_lambda(train_cfg.lr_schedule, train_cfg.warmup_steps, total_steps)
        self.sched_step = 0
        self._push_staging: PushStaging | None = None  # weight sync: made at the first push

    def free_port(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    # ---- set-up ----
    @compat
    def setup(self, port: int, master_addr: str = "127.0.0.1") -> dict[str, int]:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig
        m = self.cfg.megatron
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank % torch.cuda.device_count())))
        elif m.distributed_optimizer:
            raise ValueError("train.megatron.distributed_optimizer needs GPUs (it fails on CPU in megatron-core "
                             "0.16); set it to false for CPU runs")
        if m.sequence_parallel or m.context_parallel > 1:
            raise ValueError("train.megatron.sequence_parallel and context_parallel > 1 need Transformer Engine "
                             "layers (megatron-core's torch norm and attention refuse them), which this backend "
                             "does not use yet; set sequence_parallel false and context_parallel 1")
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        store = bound_store(master_addr, port, self.world_size, self.rank == 0, PG_TIMEOUT)
        dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=self.rank,
                                world_size=self.world_size, timeout=PG_TIMEOUT)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=m.tensor_parallel, pipeline_model_parallel_size=m.pipeline_parallel,
            virtual_pipeline_model_parallel_size=m.virtual_pipeline, context_parallel_size=m.context_parallel,
            expert_model_parallel_size=m.expert_parallel, expert_tensor_parallel_size=m.expert_tensor_parallel)
        random.seed(self.seed + self.rank)
        np.random.seed((self.seed + self.rank) % 2**32)
        torch.manual_seed(self.seed)
        cpu_compat.seed_rng_tracker(self.seed)
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), m.tensor_parallel
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        hf_cfg = AutoConfig.from_pretrained(self.model_path)
        self.spec: ModelSpec = spec_from_hf_config(hf_cfg, m.tensor_parallel)
        self.pad_id = int(getattr(hf_cfg, "pad_token_id", None) or 0)
        # bf16 on GPU: bf16 parameters, fp32 master weights in megatron's optimizer; on CPU (whose bf16
        # optimizer wraps CUDA tensors only) fp32 parameters under bf16 autocast (core/train/precision.py).
        # fp8 is bf16 training with the transformer linears' GEMMs in fp8 (megatron/fp8.py); int4_qat is
        # bf16 training with fake-quantised linears on GPU, fp32 on CPU (modes.int4_dtype: the engine's too)
        low = self.precision in ("bf16", "fp8")
        if self.precision == "fp8":
            check_fp8_device(self.device)
        int4_bf16 = self.precision == "int4_qat" and int4_dtype("megatron", on_gpu) == "bfloat16"
        self.dtype = torch.bfloat16 if (low and on_gpu) or int4_bf16 else torch.float32
        self.autocast = "bf16" if low and not on_gpu else "fp32"
        self.tconfig = transformer_config(self.spec, m, self.dtype, on_cpu=not on_gpu)
        chunks = self._build_chunks()
        self.replay = self._attach_replay(chunks)
        self.adapters = self._attach_lora(chunks)
        self._build_ddp_and_optimizer(chunks)
        self.ref = None
        if self.algo.kl_coef > 0:
            if m.pipeline_parallel > 1:
                raise ValueError("algo.kl_coef > 0 with train.megatron.pipeline_parallel > 1 is not supported yet")
            self.ref = self._build_chunks()
            for c in self.ref:
                c.requires_grad_(False).eval()
        return {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank,
                "reporter": int(self._reports()), "device": str(self.device),
                "packed_attention": packed_attention.kernel_for(self.device, self.dtype)}

    def _attach_replay(self, chunks: list[Any]) -> RankReplay | None:
        """MoE: a tap on the routers (megatron/routing.py), forcing the engine's experts when
        algo.routing_replay, else comparing only. None for a dense model."""
        from milepost.core.train.megatron.routing import (
            MegatronRouteTap,
            check_replay_layout,
        )
        tap = MegatronRouteTap.install(chunks)
        if tap is None:
            if self.algo.routing_replay:
                raise ValueError("algo.routing_replay: true needs a mixture-of-experts model (no top-k router "
                                 "found); set algo.routing_replay=false or use an MoE model")
            return None
        check_replay_layout(self.algo.routing_replay, self.cfg.megatron.recompute, self.cfg.megatron.pipeline_parallel)
        return RankReplay(tap, self.algo.routing_replay)  # type: ignore[arg-type]  # RouterTap's interface

    def _route_shape(self) -> tuple[int, int] | None:
        return None if self.replay is None else (self.replay.tap.num_layers, self.replay.tap.top_k)

    def _attach_lora(self, chunks: list[Any]) -> list[Any] | None:
        """train.lora: freeze the chunks and hook an adapter onto each layer (megatron/lora.py)."""
        if self.cfg.lora is None:
            return None
        from milepost.core.train.megatron import lora
        lora.check_supported(self.cfg.lora, self.cfg.megatron.pipeline_parallel)
        return lora.attach(chunks, self.cfg.lora, self.spec, self.tp_rank, self.tp_size, self.seed, self.dtype,
                           self.device)

    def _lora(self) -> tuple[list[Any], LoraConfig]:
        """The adapters and train.lora (the callers run with train.lora set only)."""
        assert self.adapters is not None and self.cfg.lora is not None, "train.lora is not set"
        return self.adapters, self.cfg.lora

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        from milepost.core.train.megatron import lora
        return {n: t.cpu() for n, t in lora.adapter_state(*self._lora()).items()}

    @compat
    def export_adapter(self, folder: str) -> None:
        """train.lora: the PEFT adapter folder (every rank holds the whole adapter; rank 0 writes)."""
        from milepost.core.train import lora
        if self.rank == 0:
            lora.save_adapter(folder, self._adapter_state(), self._lora()[1], self.model_path)

    def _build_chunks(self) -> list[Any]:
        vp = self.cfg.megatron.virtual_pipeline
        stages = [None] if vp is None else list(range(vp))
        chunks = [build_gpt_model(self.spec, self.tconfig, vp_stage=s).to(self.device) for s in stages]
        if self.precision == "fp8":
            self._attach_fp8(chunks)
        elif self.precision == "int4_qat":  # int4 fake-quantised linears (megatron/int4_qat.py), in self.dtype
            from milepost.core.train.megatron.int4_qat import attach_int4_qat
            layers = attach_int4_qat(chunks, self.tp_size)
            if self.rank == 0 and stages == [None]:
                log.info("precision.train int4_qat: %d linear layer(s) fake-quantised to int4", len(layers))
        for chunk in chunks:  # norms in the model dtype (megatron's ignore params_dtype), fused if asked
            fusions.swap_norms(chunk, self.dtype, self.cfg.megatron.fuse)
            # one buffer per dtype, before DDP and the optimizer hold the storages: a weight push
            # then reads its buckets where they lie (stage_weights' views, storage_groups)
            pack_parameters(chunk)
        load_hf_into(chunks, self.model_path, self.spec, self.tp_rank, self.tp_size, self.ep_rank)
        if self.spec.num_experts and not self.cfg.megatron.sequence_parallel:
            moe_tp.allow_tp_without_sequence_parallel(chunks, self.tp_size)  # replicated tokens (moe_tp.py)
        return chunks

    def _attach_fp8(self, chunks: list[Any]) -> None:
        """precision.train fp8: the transformer linears' GEMMs through torch._scaled_mm; one log
        line per rank-0 build (the layers in fp8, the bf16 fallbacks counted by reason)."""
        from milepost.core.train.megatron.fp8 import attach_fp8
        layers = attach_fp8(chunks, self.fp8_recipe, self.cfg.megatron.fp8_bf16_edge_layers)
        if self.rank == 0 and not getattr(self, "_fp8_logged", False):
            self._fp8_logged = True
            emulated = (" — on CPU torch._scaled_mm is emulated (no FP8 hardware) and slow: this runs the GPU's "
                        "code for tests, not for speed") if self.device.type == "cpu" else ""
            log.warning("precision.train fp8 (%s): %s%s", self.fp8_recipe.describe(), layers.describe(), emulated)

    def _build_ddp_and_optimizer(self, chunks: list[Any]) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        m, cfg = self.cfg.megatron, self.cfg
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=m.distributed_optimizer)
        self.model = [DistributedDataParallel(config=self.tconfig, ddp_config=ddp_cfg, module=c) for c in chunks]
        self.expert_params = moe_tp.expert_params(chunks) if not m.sequence_parallel else []
        opt_cfg = OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=0.0, weight_decay=cfg.weight_decay,
                                  adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=1e-8,
                                  clip_grad=cfg.grad_clip, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                                  use_distributed_optimizer=m.distributed_optimizer)
        use_fast_multi_tensor()  # megatron's stand-ins for Apex's kernels wait for the GPU per parameter
        self.optimizer = get_megatron_optimizer(opt_cfg, self.model)
        if self.device.type == "cuda":
            use_fused_adam(self.optimizer)
        self.tconfig.no_sync_func = [c.no_sync for c in self.model] if len(self.model) > 1 else self.model[0].no_sync
        # num_tokens=None: losses are already normalized by the step's token count (module doc)
        self.tconfig.finalize_model_grads_func = lambda models, num_tokens=None, *a, **k: finalize_model_grads(
            models, None, *a, **k)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss

    def _reports(self) -> bool:
        """Whether this rank's loss metrics are counted (one rank per data-parallel replica)."""
        from megatron.core import parallel_state as ps
        return (self.tp_rank == 0 and ps.is_pipeline_last_stage(ignore_virtual=True)
                and ps.get_context_parallel_rank() == 0)

    # ---- training ----
    def _forward_step(self, normalizer: float, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        mb: MicroBatch = next(data_iterator).to(self.device)
        with self.replay.applied(mb.routes) if self.replay else nullcontext():  # MoE: the engine's experts
            out = forward_hidden(model, mb)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref = self._response_logprobs(self.ref[0], mb)
        return out, partial(self._loss, model, mb, ref, normalizer)

    def _response_logprobs(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        return response_logprobs(forward_hidden(model, mb), model, mb, self.spec.vocab_size, self.tp_size,
                                 self.temperature, self.cfg.megatron.fuse)[0]

    def _loss(self, model: Any, mb: MicroBatch, ref: torch.Tensor | None, normalizer: float,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | float]]:
        compare: Callable[[torch.Tensor], dict[str, float]] | None = None
        if self.replay is not None and mb.routes is not None:  # agreement, gap with and without replay
            replay, routes = self.replay, mb.routes

            def compare_routes(lp: torch.Tensor) -> dict[str, float]:
                return replay.compare(lp, mb.batch, routes, lambda: self._response_logprobs(model, mb))
            compare = compare_routes
        loss, metrics = micro_batch_loss(hidden, model, mb, self.algo, self.temperature, normalizer,
                                         self.spec.vocab_size, self.tp_size, ref, self.cfg.megatron.fuse, compare)
        return loss, torch.ones((), dtype=torch.int, device=self.device), metrics

    def _run_schedule(self, micro_batches: list[MicroBatch], normalizer: float, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        vp = self.cfg.megatron.virtual_pipeline
        data: Any = [iter(micro_batches) for _ in self.model] if vp else iter(micro_batches)
        with weight_casts_reused():  # fp8 linears cast each weight once per schedule (no optimizer step inside)
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, normalizer), data_iterator=data,
                model=self.model if vp else self.model[0], num_microbatches=len(micro_batches),
                seq_length=max(mb.input_ids.shape[1] for mb in micro_batches), micro_batch_size=1,
                forward_only=forward_only)

    @compat
    def train(self, samples: list[Sample], normalizer: float) -> dict[str, Any]:
        """One optimizer step over this data-parallel shard. Returns this rank's metric sums."""
        m = self.cfg.megatron
        began = self._clock()
        samples = samples or [padding_sample(self.pad_id)]  # every replica joins the gradient all-reduce
        mbs = build_micro_batches(samples, self.pad_id, m.pack_sequences, self.cfg.micro_batch_size,
                                  m.micro_batch_tokens, self._route_shape())
        for c in self.model:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.cfg.lr * self.lr_mult(self.sched_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batched = self._clock()
        with autocast(self.autocast):
            per_micro = metrics_read(self._run_schedule(mbs, normalizer, forward_only=False))
        scheduled = self._clock()
        moe_tp.scale_expert_grads(self.expert_params, self.tp_size)  # experts saw TP copies of the tokens
        skip = agree_to_skip(not (all_finite(m.get("train/loss", 0.0) for m in per_micro) and self._grads_finite()),
                             self.device)
        grad_norm: Any = float("nan")
        if not skip:
            ok, grad_norm, _ = self.optimizer.step()
            skip = not ok  # fp16: megatron's loss scaler found inf/nan and skipped the step itself
        if skip:
            self.optimizer.zero_grad()
            grad_norm = float("nan")
        else:
            self.sched_step += 1
        stepped = self._clock()
        totals: dict[str, float] = {}
        for metrics in per_micro:
            for k, v in metrics.items():
                totals[k] = max(totals.get(k, v), v) if k.endswith("_max") else totals.get(k, 0.0) + v
        return {"metrics": totals, "grad_norm": float(grad_norm), "lr": lr, "reporter": self._reports(),
                "num_micro_batches": len(mbs), "skipped_nonfinite": float(skip),
                "phases_s": {"batch": batched - began, "forward_backward": scheduled - batched,
                             "optimizer": stepped - scheduled}}

    def _clock(self) -> float:
        """Seconds, after the device's queued work (a phase's time is its kernels', not their launch)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _grads_finite(self) -> bool:
        """Whether this rank's gradient buffers (after the data-parallel reduction) are all finite."""
        return tensors_finite(buf.grad_data for c in self.model
                              for buf in c.buffers + c.expert_parallel_buffers)

    @compat
    def logprobs(self, samples: list[Sample]) -> list[list[float]] | None:
        """Per-token logprobs of each sample's response under the current weights (forward only;
        pipeline_parallel 1). Tests and diagnostics."""
        mbs = build_micro_batches(samples, self.pad_id, self.cfg.megatron.pack_sequences,
                                  self.cfg.micro_batch_size, self.cfg.megatron.micro_batch_tokens)
        out: list[list[float]] = []
        with torch.no_grad(), autocast(self.autocast):
            for mb in mbs:
                mb = mb.to(self.device)
                chunk = self.model[0]
                chunk.eval()
                lp = self._response_logprobs(chunk, mb).cpu()
                n = mb.batch["response_mask"].sum(-1).long().tolist()
                out += [lp[i, :k].tolist() for i, k in enumerate(n)]
        return out

    # ---- weights ----
    def hf_tensors(self) -> Any:
        """HF-named full tensors of this pipeline stage (collective over the TP group)."""
        if self.cfg.megatron.expert_parallel > 1:
            raise NotImplementedError("exporting / syncing weights with train.megatron.expert_parallel > 1 is not "
                                      "built yet (experts would need a gather over the expert-parallel group)")
        from megatron.core import parallel_state as ps
        group = ps.get_tensor_model_parallel_group()

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            if self.tp_size == 1:
                return [t]
            shards = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(shards, t.contiguous(), group=group)
            return shards
        return iter_hf_tensors([c.module for c in self.model], self.spec, gather, self.ep_rank)

    @compat
    def export_shards(self, folder: str, max_shard_bytes: int) -> dict[str, tuple[str, int]]:
        """Write this pipeline stage's HF tensors (data-parallel replica 0, TP rank 0 writes)."""
        from milepost.core.train.megatron.converter import write_safetensors_shards
        tensors = self.hf_tensors()
        if self.dp_rank != 0:
            return {}
        if self.tp_rank != 0:
            for _ in tensors:  # still join every all-gather
                pass
            return {}
        return write_safetensors_shards(((n, t.to(self.dtype)) for n, t in tensors), folder,
                                        f"model-pp{self.pp_rank:03d}", max_shard_bytes)

    @compat
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's HF tensors on the CPU (every TP rank returns them; small models); with
        train.lora the adapter's, PEFT-named (the torch backend's names and digest)."""
        if self.adapters is not None:
            return {n: t.clone() for n, t in self._adapter_state().items()}
        return {n: t.detach().cpu().clone() for n, t in self.hf_tensors()}

    # ---- checkpoints ----
    def _sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        if len(self.model) == 1:
            model_sd = {"model": self.model[0].module.sharded_state_dict()}
        else:
            model_sd = {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(self.model)}
        # is_loading creates the (lazily built) Adam moments first, so the load has targets for them
        return {**model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}

    @compat
    def save(self, path: str) -> None:
        """Write this rank's share; every rank refuses (before writing) when any rank's weights are non-finite."""
        from megatron.core import dist_checkpointing
        bad = first_nonfinite((n, p) for c in self.model for n, p in c.module.named_parameters())
        if agree_to_skip(bad is not None, self.device):
            raise NonFiniteWeightsError(nonfinite_weights_message(bad or "a tensor of another rank",
                                                                  f"megatron backend rank {self.rank}"))
        if self.adapters is not None:  # the adapter (replicated) and each rank's optimizer; the base never changes
            if self.rank == 0:
                torch.save(self._adapter_state(), Path(path) / "adapter.pt")
            torch.save(self.optimizer.state_dict(), Path(path) / f"optim_rank{self.rank}.pt")
        else:
            folder = Path(path) / "dist"
            if self.rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(self._sharded_state_dict(), str(folder))
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        torch.save(rng, Path(path) / f"rng_rank{self.rank}.pt")
        self._save_amax_histories(path)
        if self.rank == 0:
            Path(path, "scheduler.json").write_text(json.dumps({"sched_step": self.sched_step}))
        dist.barrier()

    @compat
    def load(self, path: str) -> None:
        from megatron.core import dist_checkpointing
        if self.adapters is not None:
            self._load_lora(path)
        else:
            sharded = self._sharded_state_dict(is_loading=True)
            self._load_dist(dist_checkpointing.load(sharded, str(Path(path) / "dist")))
        if self.device.type == "cuda":  # the loaded param groups carry the writer's kernel choice
            use_fused_adam(self.optimizer)
        self.sched_step = json.loads(Path(path, "scheduler.json").read_text())["sched_step"]
        self._load_amax_histories(path)
        rng = Path(path) / f"rng_rank{self.rank}.pt"
        if rng.exists():  # absent when resuming at another world size
            s = torch.load(rng, weights_only=False)
            random.setstate(s["python"])
            np.random.set_state(s["numpy"])
            torch.set_rng_state(s["torch"])

    def _save_amax_histories(self, path: str) -> None:
        """fp8 delayed scaling: this rank's amax records, part of the train state (fp8_delayed)."""
        if self.precision == "fp8" and self.fp8_recipe.amax_history:
            from milepost.core.train.megatron.fp8 import amax_histories
            torch.save(amax_histories([c.module for c in self.model]), Path(path) / f"fp8_rank{self.rank}.pt")

    def _load_amax_histories(self, path: str) -> None:
        """Put this rank's amax records back; a checkpoint without them (current scaling wrote it,
        or another tensor-parallel layout) starts them again, said once in the log."""
        if self.precision != "fp8" or not self.fp8_recipe.amax_history:
            return
        from milepost.core.train.megatron.fp8 import restore_amax_histories
        saved = Path(path) / f"fp8_rank{self.rank}.pt"
        why = (restore_amax_histories([c.module for c in self.model], torch.load(saved, weights_only=True))
               if saved.exists() else f"{saved.name} is not in the checkpoint")
        if why is not None and self.rank == 0:
            log.warning("fp8 delayed scaling: amax histories start again (%s): the first steps after this resume "
                        "scale as at a fresh start", why)

    def _load_lora(self, path: str) -> None:
        from milepost.core.train.megatron import lora
        lora.load_adapter_state(*self._lora(), torch.load(Path(path) / "adapter.pt", weights_only=True))
        optim = Path(path) / f"optim_rank{self.rank}.pt"
        optim = optim if optim.exists() else Path(path) / "optim_rank0.pt"  # replicated adapter: equal states
        self.optimizer.load_state_dict(torch.load(optim, weights_only=False))

    def _load_dist(self, state: dict[str, Any]) -> None:
        if len(self.model) == 1:
            self.model[0].module.load_state_dict(state["model"])
        else:
            for i, c in enumerate(self.model):
                c.module.load_state_dict(state[f"model{i}"])
        self.optimizer.load_state_dict(state["optimizer"])

    @compat
    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- weight sync (tensor / distributed transports): rank 0 sends, its TP group gathers ----
    @compat
    def stage_weights(self, names: list[str] | None) -> None:
        """Gather the HF tensors `names` (all when None) of this stage onto this rank; only the
        megatron tensors that make them are all-gathered over TP (per bucket, not the model).
        At TP=1 they are views of the parameters, q/k/v kept in a buffer of their own
        (push_staging.py says why and what holds)."""
        from milepost.core.train.weight_sender import source_names
        if self._push_staging is None:
            self._push_staging = self._make_push_staging()
        # the sent names (fp8: scales too) -> the weights they are computed from
        self._staged = self._push_staging.stage(None if names is None else set(source_names(names, self.weight_format)))

    def _make_push_staging(self) -> PushStaging:
        from megatron.core import parallel_state as ps

        from milepost.core.train.megatron.converter import global_names, mapping_for

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            shards = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            return shards
        sources = [Source(name, mapping_for(name, self.spec), param)
                   for chunk in self.model for _, name, param in global_names(chunk.module, self.ep_rank)
                   if not (name == "output_layer.weight" and self.spec.tie_embeddings)]
        return PushStaging(sources, self.spec, None if self.tp_size == 1 else gather)

    def _weight_sender(self) -> Any:
        if getattr(self, "_sender", None) is None:
            from milepost.core.train.weight_sender import WeightSender
            worker = self

            class Staged(torch.nn.Module):
                def state_dict(self, *a: Any, **k: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
                    return worker._staged
            self._sender = WeightSender(Staged(), weight_format=self.weight_format)
        return self._sender

