"""SGLang's own code, imported on CPU, as the oracle of the conformance tests.

SGLang 0.5.23 cannot run here (CUDA 13, sglang-kernel), but the pieces of its protocol are
Python and import on CPU when installed with `pip install --no-deps sglang==0.5.23` plus
`pybase64 pyzmq pillow` (the test extra; `.ci/run` installs both). What is imported, and
what had to be worked around (nothing else is stubbed or changed):

- `sglang/__init__.py` is NOT run: it imports the frontend language, transformers patches
  and, through `sglang.srt.utils.common`, triton. The package is registered as a bare
  namespace (its folder as `__path__`), so `sglang.srt.…` modules load from the wheel's
  files as they are.
- `triton` is stubbed (an empty module) only while `sglang.srt.utils.common` is imported,
  and removed again: common.py uses triton only inside two kernel-caching helpers
  (`CachedKernel`, `cached_triton_kernel`) that nothing here calls. Left in place, the stub
  would make torch._dynamo and transformers believe triton is installed.
- `sglang.srt.managers.schedule_batch` is stubbed: io_struct imports five names from it,
  and the real module pulls the model layers (MoE runners, DeepGEMM, triton kernels). The
  stub holds `Modality` (the real one, sglang.srt.multimodal.modality), the two type
  aliases copied verbatim (`ReturnHiddenStatesMode`, `SamplingLogprobsMode`,
  schedule_batch.py:179-180), `get_return_hidden_states_mode` with the real validation
  but returning names instead of `CaptureHiddenMode` members (schedule_batch.py:183), and
  an empty `MultimodalProcessorOutput` struct (only in annotations of scheduler-side
  requests, never built here).

Real SGLang code used as the oracle: `Fp8LinearMethod.validate_block_quant_shapes` (taken
from its module's source and run alone: `fp8_block_check`), `init_custom_process_group` and
`MultiprocessingSerializer` (srt/utils/common.py), `FlattenedTensorBucket`
(srt/weight_sync/tensor_bucket.py), the request classes of srt/managers/io_struct.py
validated exactly as the HTTP server does (pydantic, FastAPI's Body), and
`generate_contract_error` (srt/entrypoints/api_contract.py), the /generate schema gate.

Run as a script, it is an engine's side of the weight-update group built by SGLang's own
`init_custom_process_group` (see `main`).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union

SGLANG_VERSION = "0.5.23"
INSTALL = (f"pip install --no-deps sglang=={SGLANG_VERSION} && pip install -e '.[test]' "
           "(pybase64, pyzmq, pillow); .ci/run does both")


class SGLangMissing(RuntimeError):
    pass


def load() -> types.SimpleNamespace:
    """The oracle's pieces; SGLangMissing (a failure, never a skip) if SGLang is absent."""
    _check_installed()
    if "sglang.srt.managers.io_struct" not in sys.modules:
        _import_pieces()
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import io_struct
    from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    return types.SimpleNamespace(io_struct=io_struct, generate_contract_error=generate_contract_error,
                                 MultiprocessingSerializer=MultiprocessingSerializer,
                                 init_custom_process_group=init_custom_process_group,
                                 FlattenedTensorBucket=FlattenedTensorBucket)


def load_weight_pieces() -> types.SimpleNamespace:
    """Only what a TP rank uses to take a tensor payload (no request classes): the
    serializer, the flattened bucket and the torch reductions patch (CUDA devices by UUID),
    which SGLang's TP worker applies before it unpickles. What the GPU tests import."""
    _check_installed()
    _import_common()
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    return types.SimpleNamespace(MultiprocessingSerializer=MultiprocessingSerializer,
                                 FlattenedTensorBucket=FlattenedTensorBucket,
                                 monkey_patch_torch_reductions=monkey_patch_torch_reductions)


def fp8_block_check() -> Any:
    """SGLang's own `Fp8LinearMethod.validate_block_quant_shapes` (srt/layers/quantization/fp8.py),
    the rule its block-wise fp8 linears impose on their shapes. The module imports triton
    kernels, so the function is taken from the wheel's source (ast) and run alone: its body
    uses its arguments, `print_warning_once` (only when the check is skipped) and nothing else."""
    import ast
    _check_installed()
    path = Path(_package_spec().submodule_search_locations[0], "srt/layers/quantization/fp8.py")
    tree = ast.parse(path.read_text())
    method = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Fp8LinearMethod"
                  for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "validate_block_quant_shapes")
    method.decorator_list = []
    namespace: dict[str, Any] = {"List": list, "print_warning_once": print}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)  # the wheel's own code
    return namespace["validate_block_quant_shapes"]


def _package_spec() -> importlib.machinery.ModuleSpec:
    """The installed package's spec, found without running sglang/__init__.py, whether or not
    an earlier test put this module's bare stand-in for the package in sys.modules."""
    loaded = sys.modules.get("sglang")
    spec = loaded.__spec__ if loaded is not None and loaded.__spec__ is not None \
        else importlib.machinery.PathFinder.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not an installed package"
    return spec


def _check_installed() -> None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = version("sglang")
    except PackageNotFoundError:
        raise SGLangMissing(f"SGLang {SGLANG_VERSION} is not installed, so the conformance tests have no "
                            f"oracle: {INSTALL}") from None
    if found != SGLANG_VERSION:
        raise SGLangMissing(f"SGLang {found} is installed; the protocol was read from {SGLANG_VERSION}: {INSTALL}")


def _import_pieces() -> None:
    _import_common()
    sys.modules["sglang.srt.managers.schedule_batch"] = _schedule_batch_stub()
    importlib.import_module("sglang.srt.managers.io_struct")


def _import_common() -> None:
    if "sglang.srt.utils.common" in sys.modules:
        return
    spec = _package_spec()
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__, pkg.__spec__ = spec.origin, spec  # find_spec("sglang") reads __spec__ from here on
        sys.modules["sglang"] = pkg  # sglang/__init__.py is not run (module docstring)
    # import these first, while no triton stub exists, so they see the truth
    import torch._dynamo  # noqa: F401
    import transformers.models.auto.image_processing_auto
    import transformers.models.auto.processing_auto  # noqa: F401
    had_triton = "triton" in sys.modules or importlib.util.find_spec("triton") is not None  # the GPU machine has it
    if not had_triton:
        sys.modules["triton"] = types.ModuleType("triton")
    try:
        importlib.import_module("sglang.srt.utils.common")
    finally:
        if not had_triton:
            del sys.modules["triton"]


def _schedule_batch_stub() -> types.ModuleType:
    import msgspec
    from sglang.srt.multimodal.modality import Modality

    stub = types.ModuleType("sglang.srt.managers.schedule_batch")

    class MultimodalProcessorOutput(msgspec.Struct, kw_only=True):
        """Stub: only named in annotations of scheduler-side requests."""

    def get_return_hidden_states_mode(return_hidden_states: Any) -> str:
        """schedule_batch.py:183, returning names for CaptureHiddenMode members."""
        if return_hidden_states is True:
            return "FULL"
        if return_hidden_states == "last":
            return "LAST"
        if return_hidden_states is False:
            return "NULL"
        raise ValueError("return_hidden_states must be a boolean or the string literal 'last'.")

    stub.Modality, stub.MultimodalProcessorOutput = Modality, MultimodalProcessorOutput
    stub.ReturnHiddenStatesMode = Union[bool, Literal["last"]]  # noqa: UP007 - SGLang's alias as it writes it
    stub.SamplingLogprobsMode = Literal["selected", "support"]
    stub.get_return_hidden_states_mode = get_return_hidden_states_mode
    return stub


def request(sgl: types.SimpleNamespace, cls_name: str, body: dict[str, Any]) -> Any:
    """`body` (JSON) parsed into SGLang's request class as its HTTP server parses it
    (FastAPI Body → pydantic; for the msgspec requests, SGLang's own
    msgspec_struct_pydantic_core_schema). Raises pydantic's ValidationError if it does not fit."""
    import json

    import pydantic
    return pydantic.TypeAdapter(getattr(sgl.io_struct, cls_name)).validate_json(json.dumps(body))


def decode_main(out: str) -> None:
    """python sglang_oracle.py decode OUT: read one `serialized_named_tensors` entry (base64)
    from stdin, decode it exactly as an SGLang TP rank does with load_format
    flattened_bucket (MultiprocessingSerializer.deserialize through its SafeUnpickler, then
    FlattenedTensorBucket.reconstruct_tensors), save the named tensors to OUT."""
    import torch
    sgl = load()
    data = sgl.MultiprocessingSerializer.deserialize(sys.stdin.readline().strip())
    bucket = sgl.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    torch.save({name: t.clone() for name, t in bucket.reconstruct_tensors()}, out)


def main() -> None:
    """python sglang_oracle.py HOST PORT RANK WORLD GROUP OUT: join the group with SGLang's
    `init_custom_process_group` (gloo), receive one broadcast of the tensors described in
    OUT.specs.json from rank 0, save them to OUT (torch.save). `decode OUT`: decode_main."""
    import datetime
    import json

    import torch
    import torch.distributed as dist
    if sys.argv[1] == "decode":
        decode_main(sys.argv[2])
        return
    host, port, rank, world, group, out = sys.argv[1:7]
    sgl = load()
    pg = sgl.init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}", world_size=int(world),
                                       rank=int(rank), group_name=group, timeout=datetime.timedelta(seconds=60))
    with open(out + ".specs.json") as f:
        specs = json.load(f)
    received = {}
    for s in specs:  # as SGLang's update_weights_from_distributed: one broadcast per tensor, src 0
        t = torch.empty(s["shape"], dtype=getattr(torch, s["dtype"]))
        dist.broadcast(t, src=0, group=pg)
        received[s["name"]] = t
    torch.save(received, out)
    dist.destroy_process_group(pg)


if __name__ == "__main__":
    main()
