"""One tensorwise fp8 cast in both layouts (q [M, K] and q^T [K, M], one scale), the way
core/quant/fp8_cast.py casts every activation and gradient of a `tensorwise` recipe, against
ways it could be compiled, side by side in one run at the Qwen3-1.7B shape's operands.

Why: on the H100 the fp8 step's casts took 107 ms of GPU time (bench/results/fp8_profile_h100.txt:
the amax 32 ms, the cast 37 ms, a separate transposed copy 38 ms) and each cast is a compiled
call whose host time counts where the step is host-bound. Ways:
- library: `fp8_cast.cast(x, E4M3, None, recipe, "both")` as the library casts now (eager amax,
  then one Triton kernel writing both layouts from one read: core/quant/fp8_triton.py);
- inductor: the same through torch.compile (`Fp8Recipe.cast_kernel="inductor"`, the library's
  cast before the Triton kernel: q, then q^T copied from q; inductor made two kernels of it);
- from_x: q and q^T each computed from x in the compiled function (one read of x each, no
  read of q back);
- from_x_nd / library_nd: the same with inductor's `triton.prefer_nd_tiling` (one 2-D tiled
  kernel may write both layouts);
- library_static: the library's graph compiled for each shape (dynamic=False): pytorch issue
  130015 shows inductor fusing this very pattern into one kernel at static shapes, where the
  library's dynamic-shape compile made two;
- row_only: q alone (what the transposed copy adds on top).
Every way's q, q^T and scale are checked equal to the eager cast's (`quantize_t`), bit for bit. Printed per
shape: GPU time per call (CUDA events over `--calls` back-to-back calls), host time to issue
one call, and each way's GPU time against the bandwidth floor: bytes read and written (2 B
read, 1 + 1 B written per element, the amax's 2 B read) over one device copy's rate.

    python bench/fp8_casts.py [--tokens 8192 16384] [--out bench/results/fp8_casts_gpu.txt]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from cuda_ipc_sync import device_copy_s, emit  # bench/ on the path first

from milepost.core.quant.fp8_cast import (
    E4M3,
    Fp8Recipe,
    _eager_division_option,
    cast,
    quantize,
    quantize_t,
    tensor_amax,
)

Cast = Callable[[Tensor], tuple[Tensor, ...]]
FEATURES = (2048, 6144, 12288)  # qkv/fc1/proj inputs, fc2's input, fc1's output gradient at 1.7 B


def _from_x(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, s = quantize(x, E4M3, None, amax)
    q_t, _ = quantize(x.t(), E4M3, None, amax)
    return q, q_t.contiguous(), s


def _library_graph(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, s = quantize(x, E4M3, None, amax)
    return q, q.t().contiguous(), s


def _row_only(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    return quantize(x, E4M3, None, amax)


def ways() -> dict[str, Cast]:
    """name -> a cast of x (eager amax first, as the library's default recipe does)."""
    recipe = Fp8Recipe("tensorwise")
    plain = _eager_division_option()
    nd = plain | {"triton.prefer_nd_tiling": True}
    made: list[Callable[..., tuple[Tensor, ...]]] = []

    def compiled(fn: Callable[..., tuple[Tensor, ...]], options: dict[str, object], dynamic: bool = True) -> Cast:
        # a code object of its own per way: dynamo keeps its compiled graphs, and its recompile limit, per code object
        own = types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{len(made)}"), fn.__globals__)
        made.append(own)
        c = torch.compile(own, dynamic=dynamic, options=options)
        return lambda x: c(x, tensor_amax(x))
    inductor = Fp8Recipe("tensorwise", cast_kernel="inductor")
    return {"library": lambda x: cast(x, E4M3, None, recipe, "both"),
            "inductor": lambda x: cast(x, E4M3, None, inductor, "both"),
            "library_static": compiled(_library_graph, plain, dynamic=False),
            "library_nd": compiled(_library_graph, nd),
            "from_x": compiled(_from_x, plain),
            "from_x_nd": compiled(_from_x, nd),
            "row_only": compiled(_row_only, plain)}


def time_way(way: Cast, x: Tensor, calls: int) -> tuple[float, float]:
    """(GPU seconds a call, host seconds to issue a call) over `calls` back-to-back calls."""
    for _ in range(3):
        way(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        way(x)
    host = (time.perf_counter() - t0) / calls
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls, host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="M: tokens of a micro-batch")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="bench/results/fp8_casts_gpu.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_casts.py times CUDA kernels: run it on a GPU (device)")
    lines = [f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}: python bench/fp8_casts.py --tokens {' '.join(map(str, args.tokens))}"]
    casts = ways()
    for m in args.tokens:
        for k in FEATURES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = x.numel() * x.element_size()
            bw = 2 * nbytes / device_copy_s(nbytes, repeats=20)  # bytes read + written per second
            want = quantize_t(x, E4M3, None, "both")  # eager: every way must give its bytes
            floor = {"both": (2 + 2 + 1 + 1) * x.numel() / bw, "row": (2 + 2 + 1) * x.numel() / bw}
            cells = []
            for name, way in casts.items():
                try:
                    got = way(x)
                except Exception as exc:  # noqa: BLE001 - one way's failure (an inductor option this torch lacks)
                    cells.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                same = all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                                       b.view(torch.uint8) if b.dtype == E4M3 else b)
                           for a, b in zip(got, want if len(got) == 3 else (want[0], want[2])))
                gpu, host = time_way(way, x, args.calls)
                bound = floor["row" if name == "row_only" else "both"]
                cells.append(f"{name} {gpu * 1e6:.0f} us (floor/this {bound / gpu:.2f}, host {host * 1e6:.0f} us"
                             f"{'' if same else ', DIFFERS'})")
            lines.append(f"[{m}, {k}] copy {bw / 1e9:.0f} GB/s | " + " | ".join(cells))
    emit(lines, Path(args.out))


if __name__ == "__main__":
    main()
