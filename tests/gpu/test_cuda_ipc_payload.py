"""SGLang's tensor payload on a GPU: a CUDA bucket shared by IPC handle between two processes.

The trainer (a spawned process) writes a flattened bucket on the GPU and pickles it;
another process decodes it. Both directions are checked against SGLang 0.5.23's own code
(tests/integration/sglang_oracle.py, `load_weight_pieces`): milepost's payload must decode
with SGLang's `MultiprocessingSerializer` after SGLang's reductions patch (what a TP worker
does), and SGLang's payload must decode through milepost's allow-list (what the built-in
engine does). SGLang's wheel is not installed on the GPU machine: carry it (with the few
packages its utils import) and install it with --no-deps, as bench/results/gpu_ipc.txt says.

Run through the device tool: `python -m pytest -q -m gpu tests/gpu/test_cuda_ipc_payload.py`.
"""

from __future__ import annotations

import base64
import io
import multiprocessing as mp
import pickletools
import sys
from pathlib import Path

import pytest
import torch

TIMEOUT_S = 120
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPECS = [{"name": "embed.weight", "dtype": "bfloat16", "shape": [256, 64]},
         {"name": "norm.weight", "dtype": "float32", "shape": [64]},
         {"name": "lm_head.weight", "dtype": "float16", "shape": [3, 5, 8]},
         {"name": "layers.0.mlp.up.weight", "dtype": "bfloat16", "shape": [128, 64]}]


def _expected(seed: int) -> dict[str, torch.Tensor]:
    from milepost.core.weight_sync import wire
    g = torch.Generator().manual_seed(seed)
    return {s["name"]: torch.randn(s["shape"], generator=g).to(wire.parse_dtype(s["dtype"])) for s in SPECS}


def _oracle():  # a namespace of SGLang's functions
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    import sglang_oracle
    return sglang_oracle.load_weight_pieces()


def _trainer(conn, seed: int, writer: str, fake_uuid: str | None) -> None:  # a Pipe end
    """The producing process: a CUDA bucket, pickled by milepost (`ours`) or by SGLang's
    serializer after its patch (`sglang`); kept alive until the reader says it is done."""
    from milepost.core.weight_sync import cuda_ipc, sglang_wire, wire
    tensors = {n: t.cuda() for n, t in _expected(seed).items()}
    if writer == "ours":
        if fake_uuid:
            cuda_ipc.device_uuid = lambda index: fake_uuid
        offs, total = wire.offsets(SPECS)
        flat = sglang_wire.shared_buffer(total, "cuda")
        for spec, off in zip(SPECS, offs):
            wire.view(flat, off, spec).copy_(tensors[spec["name"]])
        payload = sglang_wire.encode(flat, SPECS)
    else:
        sgl = _oracle()
        sgl.monkey_patch_torch_reductions()
        bucket = sgl.FlattenedTensorBucket(named_tensors=list(tensors.items()))
        flat = bucket.get_flattened_tensor()
        payload = sgl.MultiprocessingSerializer.serialize(
            {"flattened_tensor": flat, "metadata": bucket.get_metadata()}, output_str=True)
    conn.send(payload)
    conn.recv()  # the reader copied the bucket out: only now may it go
    conn.close()


def _read_with_sglang(conn) -> None:
    """A TP rank's side, in its own process (SGLang's patch is process-wide)."""
    sgl = _oracle()
    sgl.monkey_patch_torch_reductions()
    data = sgl.MultiprocessingSerializer.deserialize(conn.recv())
    bucket = sgl.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    out = io.BytesIO()  # torch.save, not the pipe's pickler: SGLang's patch breaks CPU tensor reductions
    torch.save({n: t.cpu().clone() for n, t in bucket.reconstruct_tensors()}, out)
    conn.send_bytes(out.getvalue())
    conn.close()


def _receive(conn, proc, raw: bool = False):
    """What the other process sent, or a failure naming its exit (never a hang)."""
    if not conn.poll(TIMEOUT_S):
        raise AssertionError(f"no answer from {proc.name} within {TIMEOUT_S} s (exit code {proc.exitcode})")
    return conn.recv_bytes() if raw else conn.recv()


def _produce(seed: int, writer: str, fake_uuid: str | None = None):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_trainer, args=(theirs, seed, writer, fake_uuid), daemon=True, name="trainer")
    proc.start()
    return proc, ours, _receive(ours, proc)


def _finish(proc, conn) -> None:
    conn.send("done")
    proc.join(60)
    assert proc.exitcode == 0


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].cpu(), tensor), name


def test_our_cuda_payload_names_the_device_by_uuid_and_decodes_through_the_allow_list():
    from milepost.core.weight_sync import cuda_ipc, sglang_wire, wire
    proc, conn, payload = _produce(7, "ours")
    raw = base64.b64decode(payload)
    strings = [arg for op, arg, _ in pickletools.genops(raw) if isinstance(arg, str)]
    assert cuda_ipc.device_uuid(0) in strings and "rebuild_cuda_tensor" in strings
    flat, specs = sglang_wire.decode(raw)
    assert flat.is_cuda and flat.dtype == torch.uint8
    got = {s["name"]: wire.view(flat, s["offset"], s).clone() for s in specs}
    _finish(proc, conn)
    _assert_same(got, _expected(7))


def test_our_cuda_payload_decodes_with_sglangs_own_serializer():
    proc, conn, payload = _produce(8, "ours")
    ctx = mp.get_context("spawn")
    mine, reader_end = ctx.Pipe()
    reader = ctx.Process(target=_read_with_sglang, args=(reader_end,), daemon=True, name="sglang reader")
    reader.start()
    mine.send(payload)
    got = torch.load(io.BytesIO(_receive(mine, reader, raw=True)))
    reader.join(60)
    _finish(proc, conn)
    assert reader.exitcode == 0
    _assert_same(got, _expected(8))


def test_sglangs_cuda_payload_decodes_through_our_allow_list():
    from milepost.core.weight_sync import sglang_wire, wire
    proc, conn, payload = _produce(9, "sglang")
    flat, specs = sglang_wire.decode(base64.b64decode(payload))
    got = {s["name"]: wire.view(flat, s["offset"], s).clone() for s in specs}
    _finish(proc, conn)
    _assert_same(got, _expected(9))


def test_a_payload_from_a_gpu_this_process_cannot_see_is_refused_with_the_reason():
    from milepost.core.weight_sync import sglang_wire
    proc, conn, payload = _produce(10, "ours", fake_uuid="GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(ValueError, match="not visible to this process.*colocated"):
        sglang_wire.decode(base64.b64decode(payload))
    _finish(proc, conn)
