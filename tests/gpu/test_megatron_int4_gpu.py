"""precision.train int4_qat in the megatron backend on one GPU: bf16 parameters (fp32 masters in
megatron's optimizer) and fake-quantised linears, served by a built-in engine at `--dtype
bfloat16 --quantization int4` bit for bit (core/quant/modes.py int4_dtype).

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_megatron_int4_gpu.py`.
One worker per process (megatron's parallel state is global), so everything is one test.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int4_qat_trains_bf16_parameters_and_the_bf16_int4_engine_serves_them_bit_for_bit(tmp_path):
    from tests.gpu.test_megatron_gpu import make_samples, tiny_qwen3
    model_dir = tmp_path / "model"
    tiny_qwen3(model_dir, num_layers=2)
    from safetensors.torch import load_file

    from milepost.core.config import AlgoConfig, TrainConfig
    from milepost.core.engine.quantized import Int4Linear, load_model
    from milepost.core.quant.int4 import fake_quantize_int4
    from milepost.core.train.megatron.converter import write_index
    from milepost.core.train.megatron.worker import MegatronRankWorker

    samples = make_samples(6, seed=1)
    train = TrainConfig(backend="megatron", num_ranks=1, micro_batch_size=2, lr=1e-3, grad_clip=1.0,
                        megatron={"pack_sequences": True, "micro_batch_tokens": 64})
    w = MegatronRankWorker(0, 1, str(model_dir), train, AlgoConfig(), temperature=1.0, seed=0, total_steps=None,
                           precision="int4_qat")
    w.setup(w.free_port())
    try:
        assert w.dtype == torch.bfloat16
        before = w.logprobs(samples)
        for _ in range(3):
            result = w.train(samples, float(sum(len(s.response_ids) for s in samples)))
            assert torch.isfinite(torch.tensor(result["metrics"]["train/loss"]))
        assert w.logprobs(samples) != before  # the policy moved
        export = tmp_path / "export"
        export.mkdir()
        write_index(str(export), w.export_shards(str(export), 2**30))
    finally:
        w.shutdown()
    exported = load_file(str(export / "model.safetensors"))
    assert exported["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).exists():
            (export / name).write_text((model_dir / name).read_text())
    engine = load_model(str(export), torch.device("cuda"), torch.bfloat16, "int4", lambda: 0)
    served = {name: m for name, m in engine.named_modules() if isinstance(m, Int4Linear)}
    assert len(served) == 2 * 7  # q, k, v, o, gate, up, down in each layer; not the head
    for name, layer in served.items():
        trained = fake_quantize_int4(exported[f"{name}.weight"].cuda())  # what the trainer's forward multiplies by
        assert torch.equal(layer.served_weight(), trained), name
