"""`milepost run RECIPE --dry-run`: the jobs and the exact engine commands, nothing started or
written; and the built-in engine a real fleet launches runs exactly the dry run's command
with its placeholders filled in (one launcher code path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tinymodels import save_tiny_qwen2

from milepost.core.config import RolloutConfig
from milepost.core.fleet.launcher import PLACEHOLDERS
from milepost.tasks.dry_run import RANK_CPUS

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milepost.cli", "run", *args, "--dry-run"], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent)})


def test_sglang_recipe_prints_the_sglang_commands_on_gpu_bundles(tmp_path) -> None:
    campaign = tmp_path / "campaign"
    done = _dry_run(str(ROOT / "recipes/qwen3-8b-gsm8k.yaml"), "--set", "rollout.engine=sglang",
                    "--set", "rollout.sglang.mem_fraction_static=0.5", "--campaign", str(campaign), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    engines = [line.strip() for line in out.splitlines() if "-m sglang.launch_server" in line]
    assert len(engines) == 4  # rollout.num_engines
    for line in engines:
        assert line.startswith("python -m sglang.launch_server --model-path /shared/models/Qwen/Qwen3-8B ")
        for part in ("--host {node_ip}", "--port {free_port}", "--nccl-port {free_nccl_port}", "--tp-size 2",
                     "--base-gpu-id 0", "--mem-fraction-static 0.5", "--max-running-requests 256",
                     "--weight-version 0", "--enable-memory-saver", "--skip-server-warmup",
                     "--config {admin_config_yaml}"):
            assert part in line, (part, line)
        assert "--enable-return-routed-experts" not in line  # dense model
    assert out.count("actor num_gpus=2: Ray sets its CUDA_VISIBLE_DEVICES") == 4
    assert "{'CPU': 0.75, 'GPU': 2.0}" in out  # GPU bundles, TP 2 each
    assert "sglang_router.launch_router" in out and "--worker-urls http://{node_ip}:{free_port}" in out
    assert "POST {router}/workers" in out
    assert "#SBATCH --gpus-per-node=8" in out and "gpus_per_node=8" in out  # allocation and stage jobs
    assert str(campaign / "secrets" / "engine_admin_key") in out  # the key's path, never a key
    for placeholder in PLACEHOLDERS:
        assert placeholder in out
    assert not campaign.exists() and not (tmp_path / "runs").exists()  # nothing written


def test_builtin_engine_cannot_take_tp2_and_bad_recipes_exit_2(tmp_path) -> None:
    refused = _dry_run(str(ROOT / "recipes/qwen3-8b-gsm8k.yaml"), "--set", "rollout.engine=builtin", cwd=tmp_path)
    assert refused.returncode == 2 and "rollout.engine: sglang" in refused.stderr
    bad = _dry_run(str(ROOT / "recipes/tiny-arith.yaml"), "--set", 'rollout.sglang.extra_args=["--port=1"]',
                   cwd=tmp_path)
    assert bad.returncode == 2 and "set by milepost itself" in bad.stderr
    assert not (tmp_path / "runs").exists()


def test_rank_cpus_match_the_trainer() -> None:
    from milepost.core.train.torch_backend import RANK_NUM_CPUS

    assert RANK_CPUS == RANK_NUM_CPUS


def test_a_real_fleet_runs_the_dry_run_command(tmp_path) -> None:
    """tiny-arith's dry run shows the built-in engine's command; a fleet started with the same
    rollout settings (and the admin key, as the start_engines stage) runs exactly that argv."""
    import ray

    from milepost.core.fleet.fleet import Fleet

    done = _dry_run(str(ROOT / "recipes/tiny-arith.yaml"), "--campaign", str(tmp_path / "c"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    template = next(line.strip() for line in done.stdout.splitlines() if "-m milepost.core.engine.server" in line)
    model = save_tiny_qwen2(tmp_path / "m", 0)
    key = tmp_path / "secrets" / "engine_admin_key"
    key.parent.mkdir(mode=0o700)
    key.write_text("k" * 32)
    (tmp_path / "logs").mkdir()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        fleet = Fleet.start(model, 1, RolloutConfig(engine_startup_timeout_s=120.0), log_dir=str(tmp_path / "logs"),
                            admin_key_path=str(key))
        try:
            version = fleet.describe()["engines"][0]["version"]
        finally:
            fleet.stop()
    finally:
        ray.shutdown()
    launched = re.search(r"engine pid \d+ serving .*?: (.*)$", (tmp_path / "logs" / "engine-0.0.log").read_text(),
                         re.M).group(1)
    expected = re.escape(template.replace("{builtin:tiny-arith model, built and cached at first use}", "@MODEL@"))
    for placeholder, pattern in (("python", r"\S+/python\S*"), ("\\{free_port\\}", r"\d+"),
                                 ("\\{admin_config_yaml\\}", r"/\S+/engine-admin\.yaml"),
                                 ("@MODEL@", re.escape(model))):
        expected = expected.replace(placeholder, pattern, 1)
    assert re.fullmatch(expected, launched), (template, launched)
    assert version == "milepost built-in"  # read by the admission probe
    config = launched.split("--config ")[1].split()[0]
    assert not os.path.exists(config)  # the key's config is gone once the engine listens
