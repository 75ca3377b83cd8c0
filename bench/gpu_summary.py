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


def _tensor_sync() -> dict:
    text = (RESULTS / "cuda_ipc_sync.txt").read_text()
    header = text.splitlines()[0]
    value = float(re.search(r"tensor_sync_vs_copy: ([0-9.]+)", text).group(1))
    date, device, command = re.match(r"# (.+ UTC), (.+?), torch [^:]+: (.+)", header).groups()
    return {"tensor_sync_vs_copy": {"value": value, "date": date, "device": device, "command": command}}


def main() -> None:
    summary = {**_engine(), **_tensor_sync()}
    pending = "not measured yet: gpu-arith has not run on the H200 (issue 18)"
    for key in ("gpu_arith_base_either_form", "gpu_arith_final_either_form", "gpu_arith_resumed_exactly_once"):
        summary[key] = {"value": None, "reason": pending}
    (RESULTS / "gpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
