"""Collect the latest GPU figures of issue 18 into bench/results/gpu_summary.json.

Each figure keeps the date, device and command of the run it comes from; a figure not yet
measured is null with the reason. Run after copying a device run's results into
bench/results/:  python bench/gpu_summary.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _engine() -> dict:
    run = json.loads((RESULTS / "engine_gpu.json").read_text())
    src = {"date": run["date"], "device": run["device"], "command": run["command"]}
    rows = run["rows"]
    return {
        "engine_vs_hf_compiled_b64": {"value": rows["64"]["engine_vs_hf_compiled"], **src},
        "engine_vs_hf_compiled_b256": {"value": rows["256"]["engine_vs_hf_compiled"], **src},
        "engine_fraction_of_floor_b256": {"value": rows["256"]["fraction_of_floor"], **src},
    }


def _tensor_sync_run(name: str) -> dict:
    """The newest run in one of bench/cuda_ipc_sync.py's result files (newest section first)."""
    text = (RESULTS / name).read_text()
    line = re.search(r"tensor_sync_vs_copy: ([0-9.]+)(.*)", text)
    date, device, command = re.match(r"# (.+ UTC), (.+?), torch [^:]+: (.+)", text.splitlines()[0]).groups()
    return {"value": float(line.group(1)), "date": date, "device": device, "command": command,
            "detail": line.group(2).strip(" ()")}


def _tensor_sync() -> dict:
    """The newest of the 0.99 GB and 3.4 GB runs; the other stays beside it as `other_size`."""
    runs = sorted((_tensor_sync_run(name) for name in ("cuda_ipc_sync.txt", "cuda_ipc_sync_3gb.txt")),
                  key=lambda run: run["date"])
    latest, other = runs[-1], runs[0]
    latest["other_size"] = {k: other[k] for k in ("value", "date", "device", "command")}
    return {"tensor_sync_vs_copy": latest}


GPU_ARITH_KEYS = ("gpu_arith_base_either_form", "gpu_arith_final_either_form", "gpu_arith_resumed_exactly_once")


def _gpu_arith() -> dict:
    """From bench/gpu_arith.py's JSON (copied from the device run's $OUT into bench/results/)."""
    path = RESULTS / "gpu_arith.json"
    if not path.exists():
        pending = "not measured yet: gpu-arith has not run on a GPU (issue 18)"
        return {key: {"value": None, "reason": pending} for key in GPU_ARITH_KEYS}
    run = json.loads(path.read_text())
    if run.get("device", "cpu").startswith("cpu"):
        raise SystemExit(f"{path} is a CPU run ({run.get('command')}); copy the device run's gpu_arith.json there")
    src = {"date": run["date"], "device": run["device"], "command": run["command"]}
    stopped = f"the run stopped before this was measured ({run.get('error', 'no error recorded')})"
    return {key: {"value": run.get(key), **src, **({} if run.get(key) is not None else {"reason": stopped})}
            for key in GPU_ARITH_KEYS}


def main() -> None:
    summary = {**_engine(), **_tensor_sync(), **_gpu_arith()}
    (RESULTS / "gpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
