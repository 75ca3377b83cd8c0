"""The Megatron trainer's side of a weight push, staged as copies (the staging before views) and
by push_staging.PushStaging (what `stage_weights` runs at TP=1), side by side in one run.

Why: Megatron's weights are not in HF layout, so a push first stages HF tensors from the
parameters (core/train/megatron/push_staging.py). Staged as copies, that is two copies of most
of the model (a concatenation of one shard, a clone) at new addresses each push, so the CUDA
sender plans every bucket again (core/train/cuda_sender.py), and every parameter is visited for
every bucket. Staged as views only q/k/v are copied (strided in the fused tensor), into the
last push's tensors, and a bucket visits only its own parameters.

The parameters are made as megatron-core's DDP buffer holds them: one contiguous bf16 buffer,
in reverse order of the model's parameters, Qwen3-1.7B-shaped (28 layers, tied embedding).
A push is what the worker does: at the first push, stage every HF tensor (to plan the buckets,
a plan each transport keeps), then at every push, for each 1 GB bucket, stage its names and
(on a GPU) WeightSender.to_cuda (the copy into the bucket buffer, the export), each push
synchronised. Printed: each way's push time, the views' speed-up over
copies, and each against one device copy of the model's bytes. On a CPU only the staging is
timed.

    python bench/megatron_stage.py [--layers 28] [--pushes 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cuda_ipc_sync import device_copy_s, emit

from milepost.core.train.megatron.converter import mapping_for, to_hf
from milepost.core.train.megatron.model import ModelSpec
from milepost.core.train.megatron.push_staging import PushStaging, Source
from milepost.core.train.weight_sender import WeightSender

RESULTS = Path(__file__).parent / "results"


def qwen3_spec(layers: int) -> ModelSpec:
    return ModelSpec(model_type="qwen3", num_layers=layers, hidden_size=2048, num_heads=16, num_query_groups=8,
                     head_dim=128, ffn_hidden_size=6144, vocab_size=151936, padded_vocab_size=151936,
                     tie_embeddings=True, qkv_bias=False, qk_layernorm=True, norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960)


def megatron_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(megatron global name, shape) of every parameter, in the model's order."""
    h, d = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_query_groups) * d
    out: list[tuple[str, tuple[int, ...]]] = [("embedding.word_embeddings.weight", (spec.padded_vocab_size, h))]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attention.linear_qkv.weight", (qkv_rows, h)),
                (p + "self_attention.q_layernorm.weight", (d,)), (p + "self_attention.k_layernorm.weight", (d,)),
                (p + "self_attention.linear_proj.weight", (h, spec.num_heads * d)),
                (p + "pre_mlp_layernorm.weight", (h,)), (p + "mlp.linear_fc1.weight", (2 * spec.ffn_hidden_size, h)),
                (p + "mlp.linear_fc2.weight", (h, spec.ffn_hidden_size))]
    return out + [("decoder.final_layernorm.weight", (h,))]


def ddp_buffer_params(shapes: list[tuple[str, tuple[int, ...]]], device: str) -> dict[str, torch.Tensor]:
    """The parameters as views of one bf16 buffer, laid out in reverse order (as DDP's buffer)."""
    total = sum(torch.Size(s).numel() for _, s in shapes)
    buf = (torch.randn(total, device=device) * 0.02).to(torch.bfloat16)
    params, pos = {}, total
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        pos -= n
        params[name] = buf[pos:pos + n].view(shape)
    return params


def stage_copies(sources: list[Source], spec: ModelSpec, wanted: set[str] | None) -> dict[str, torch.Tensor]:
    """The staging before views (the baseline): every parameter visited, each HF tensor of the
    wanted ones made by to_hf's default (copies)."""
    staged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for source in sources:
            if wanted is not None and not wanted.intersection(source.mapping.hf_names):
                continue
            for n, full in to_hf(source.mapping, [source.param], spec):
                if wanted is None or n in wanted:
                    staged[n] = full
    return staged


class Staged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.staged: dict[str, torch.Tensor] = {}

    def state_dict(self, *a, **k) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.staged


def pushes(sources: list[Source], spec: ModelSpec, views: bool, count: int,
           bucket_bytes: int) -> tuple[list[float], list[float]]:
    """(stage seconds, whole push seconds) of each push. A push stages as the worker does: the
    first one stages the whole model to plan the buckets (a transport asks for the plan once,
    core/weight_sync/session.py `plan`), then every push stages each bucket's names before its
    to_cuda."""
    module, cuda = Staged(), sources[0].param.is_cuda
    staging = PushStaging(sources, spec, None)  # what the worker runs at TP=1
    sender = WeightSender(module)
    stage_s, push_s = [], []

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def stage(wanted: set[str] | None) -> dict[str, torch.Tensor]:
        return staging.stage(wanted) if views else stage_copies(sources, spec, wanted)

    plan: list[list[dict[str, object]]] = []
    for _ in range(count):
        start = sync()
        if not plan:
            module.staged = stage(None)
            plan = sender.buckets(bucket_bytes)
        staged_s = sync() - start
        for i, bucket in enumerate(plan):
            names = [s["name"] for s in bucket]
            begun = sync()
            module.staged = stage(set(names))
            staged_s += sync() - begun
            if cuda:
                sender.to_cuda(names, i)
        stage_s.append(staged_s)
        push_s.append(sync() - start)
    sender.release()
    return stage_s, push_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = qwen3_spec(args.layers)
    params = ddp_buffer_params(megatron_shapes(spec), device)
    sources = [Source(name, mapping_for(name, spec), t) for name, t in params.items()]
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {name}, torch {torch.__version__}: "
             f"python bench/megatron_stage.py {' '.join(sys.argv[1:])}".rstrip(),
             f"parameters: {len(params)} megatron bf16 tensors, {nbytes / 1e9:.3f} GB, one buffer in reverse order"]
    copy_s = device_copy_s(nbytes, device=device)
    lines.append(f"device copy of the same bytes: {copy_s * 1e3:.2f} ms")
    means = {}
    for views in (False, True):
        stage_s, push_s = pushes(sources, spec, views, args.pushes, args.bucket_mb << 20)
        later = slice(1, None)  # the first push allocates and plans
        means[views] = (statistics.mean(stage_s[later]), statistics.mean(push_s[later]))
        way = ("views (push_staging.PushStaging at TP=1)" if views
               else "copies (to_hf's default, every parameter visited)")
        pushed = f", whole push {means[views][1] * 1e3:.2f} ms (vs device copy {copy_s / means[views][1]:.3f})" \
            if device == "cuda" else ""
        lines.append(f"staged as {way}: stage {means[views][0] * 1e3:.2f} ms{pushed} "
                     f"(mean of pushes 2..{args.pushes}; first push {push_s[0] * 1e3:.2f} ms)")
    which = 1 if device == "cuda" else 0
    lines.append(f"views_speedup_{'push' if which else 'stage'}: {means[False][which] / means[True][which]:.2f}x")
    emit(lines, args.out or RESULTS / f"megatron_stage_{'gpu' if device == 'cuda' else 'cpu'}.txt")


if __name__ == "__main__":
    main()
