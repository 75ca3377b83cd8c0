"""bench/gpu_summary.py's `tensor_sync_vs_copy`: the colocated row in the megatron backend's
layout, read from bench/cuda_ipc_sync.py's row lines (older runs printed another row in their
figure line), the 3.4 GB run where both sizes come from one device call."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

VALUES = {  # bench/cuda_ipc_sync.py's row id → vs device copy
    "sglang-reopen": 0.05, "sglang-keep": 0.05, "milepost-copied": 0.17, "milepost-packed": 0.28,
    "milepost-copied-colocated": 0.18, "milepost-packed-colocated": 0.33, "milepost-reversed": 0.25,
    "milepost-reversed-colocated": 0.35,
}


def _summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("gpu_summary", BENCH / "gpu_summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


def _run(rows: dict[str, str], when: str, gb: float, scale: float, older: str = "") -> str:
    """One run's section as bench/cuda_ipc_sync.py prints it; `rows`: its ROWS (id → words)."""
    lines = [f"# {when} UTC, NVIDIA H100 80GB HBM3, torch 2.11.0+cu130: python bench/cuda_ipc_sync.py "
             f"--params-gb {gb}", "weights: 841 bf16 tensors"]
    lines += [f"push by CUDA IPC, {rows[row]}: best of 6 (first 0.1 s): 0.01 s = 300.0 GB/s, vs device copy "
              f"{value * scale:.3f}" for row, value in VALUES.items()]
    lines.append("tensor_sync_vs_copy: 0.180 (colocated, copied)")  # the old figure line: not what is read
    return "\n".join(lines) + "\n" + older


def test_the_figure_is_the_megatron_layouts_colocated_row_of_the_3gb_run_of_one_call(tmp_path, monkeypatch):
    summary = _summary(tmp_path, monkeypatch)
    older = _run(summary.ROWS, "2026-12-06 18:44", 3.4, 0.5)  # an earlier run below the newest: never read
    (tmp_path / "cuda_ipc_sync_3gb.txt").write_text(_run(summary.ROWS, "2026-12-07 08:14", 3.4, 1.0, older))
    (tmp_path / "cuda_ipc_sync.txt").write_text(_run(summary.ROWS, "2026-12-07 08:15", 0.99, 1.2))
    figure = summary._tensor_sync()["tensor_sync_vs_copy"]
    assert figure["value"] == 0.35 and "--params-gb 3.4" in figure["command"]
    assert "(the torch backend): 0.330" in figure["detail"] and "megatron at TP > 1" in figure["detail"]
    assert figure["other_size"]["value"] == pytest.approx(0.42)


def test_runs_of_separate_calls_give_the_newest(tmp_path, monkeypatch):
    summary = _summary(tmp_path, monkeypatch)
    (tmp_path / "cuda_ipc_sync_3gb.txt").write_text(_run(summary.ROWS, "2026-12-06 18:44", 3.4, 1.0))
    (tmp_path / "cuda_ipc_sync.txt").write_text(_run(summary.ROWS, "2026-12-07 08:15", 0.99, 1.2))
    figure = summary._tensor_sync()["tensor_sync_vs_copy"]
    assert figure["value"] == pytest.approx(0.42) and "--params-gb 0.99" in figure["command"]
