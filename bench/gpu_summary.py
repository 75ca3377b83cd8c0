"""Collect the latest GPU figures of issue 18 into bench/results/gpu_summary.json.

Each figure keeps the date, device and command of the run it comes from; a figure not yet
measured is null with the reason. Run after copying a device run's results into
bench/results/:  python bench/gpu_summary.py
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_ipc_sync import ROWS

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


# bench/cuda_ipc_sync.py's rows (ROWS: id → the words its lines describe the row with)
MEGATRON_ROW = "milepost-reversed-colocated"
OTHER_ROWS = {  # row id → how the detail names it
    "milepost-packed-colocated": "colocated, packed trainer weights (the torch backend)",
    "milepost-copied-colocated": "colocated, copied into bucket buffers (megatron at TP > 1, a sender that quantises)",
    "milepost-copied": "served (not released): copied",
    "milepost-packed": "packed",
    "milepost-reversed": "Megatron's layout",
    "sglang-reopen": "SGLang's format",
}


def _tensor_sync_run(name: str) -> dict:
    """The newest run in one of bench/cuda_ipc_sync.py's result files (newest section first).
    The figure is the row the loop's recipes push by: colocated, the megatron backend's
    layout (its weights in one buffer, not in HF order, read in place); the other rows go in
    the detail. Read from the row lines, so runs printed before the figure line named this row
    read the same way."""
    text = (RESULTS / name).read_text()
    first_run = text.split("\n# 20", 1)[0]
    rows = dict(re.findall(r"push by CUDA IPC, (.+?): best of .* vs device copy ([0-9.]+)", first_run))
    rows = {row: rows[described] for row, described in ROWS.items() if described in rows}
    date, device, command = re.match(r"# (.+ UTC), (.+?), torch [^:]+: (.+)", text.splitlines()[0]).groups()
    detail = "colocated, Megatron's layout (the megatron backend's push at TP=1: its weights in one buffer, not in " \
             "HF order, read in place); " + "; ".join(f"{label}: {rows[row]}" for row, label in OTHER_ROWS.items())
    return {"value": float(rows[MEGATRON_ROW]), "date": date, "device": device, "command": command, "detail": detail}


def _tensor_sync() -> dict:
    """The newest of the 0.99 GB and 3.4 GB runs, the other beside it as `other_size`; where
    both come from one device call (within 15 minutes), the 3.4 GB one (the Qwen3-1.7B shape)."""
    runs = {name: _tensor_sync_run(name) for name in ("cuda_ipc_sync.txt", "cuda_ipc_sync_3gb.txt")}
    when = {name: datetime.datetime.strptime(run["date"], "%Y-%m-%d %H:%M UTC") for name, run in runs.items()}
    newest = max(runs, key=when.__getitem__)
    same_call = abs(when["cuda_ipc_sync.txt"] - when["cuda_ipc_sync_3gb.txt"]) <= datetime.timedelta(minutes=15)
    latest = runs["cuda_ipc_sync_3gb.txt" if same_call else newest]
    other = next(run for run in runs.values() if run is not latest)
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
