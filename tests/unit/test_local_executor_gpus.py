"""Local stage jobs see the GPUs their driver sees (slurm/local.machine_gpu_view): submitit's
local executor would otherwise set CUDA_VISIBLE_DEVICES='' for a job that asked for none,
which hid the GPU from the block's Ray head on the lent H100."""

from __future__ import annotations

import os

from milepost.slurm import local
from milepost.slurm.local import LocalExecutor, machine_gpu_view
from milepost.slurm.options import Resources


def test_an_integer_device_list_is_passed_through(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert machine_gpu_view() == {"gpus_per_node": 2, "visible_gpus": (2, 3)}


def test_no_visible_device_stays_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_gpu_view() == {"gpus_per_node": 0, "visible_gpus": ()}


def test_uuids_are_exported_before_the_job(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-9c40,MIG-1")
    assert machine_gpu_view() == {"gpus_per_node": 0, "setup": ["export CUDA_VISIBLE_DEVICES=GPU-9c40,MIG-1"]}


def test_unset_counts_what_nvidia_smi_lists(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(local, "nvidia_smi_gpu_count", lambda: 2)
    assert machine_gpu_view() == {"gpus_per_node": 2}


def test_a_real_local_job_sees_the_drivers_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    job = LocalExecutor(tmp_path).submit(os.getenv, "CUDA_VISIBLE_DEVICES", "<unset>",
                                          resources=Resources())
    assert job.result(timeout_s=120) == "1,0"
