"""gpu-arith end to end on one machine without Airflow (the lent H200 has neither Airflow nor
Slurm): build the model, run every block's stages in order as stage jobs, SIGKILL the
run_steps stage once mid-block and run it again so it resumes, then check that every prompt
of the epoch was trained exactly once.

    python bench/gpu_arith.py [RECIPE] [--campaign DIR] [--set KEY=VALUE ...] [--kill-block N | --no-kill]

Writes $OUT/gpu_arith.json (OUT defaults to ./out), rewritten after every phase so a run cut
short still leaves what it measured, and each stage job's log under $OUT/logs/.

The stages run as `python -m milepost.tasks.stage --campaign URL --block N --stage NAME`,
the stage runner every executor and the Airflow DAG run, submitted and waited on by the block
driver (tasks/block_driver.py, through bench/stage_jobs.py); the campaign store is made by
`prepare_campaign`, as `milepost run` makes it. A killed run_steps is run again on the
block's live Ray cluster and fleet, which is what an Airflow retry of the task does (the
stage then serves its checkpoint to the engines first: tasks/run_steps._serve_checkpoint).
teardown runs after each block whatever happened. The kill comes once a checkpoint of the
block is committed and the step after it is recorded, so the resumed stage redoes that step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage_jobs import KillPlan, StageJobs, write_json_atomic

from milepost.core.data.epoch import epoch_coverage
from milepost.core.recipe_io import load_recipe
from milepost.core.records import BLOCK_STAGES, Stage

DEFAULT_RECIPE = "recipes/gpu-arith.yaml"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE)
    parser.add_argument("--campaign", default=None, help="campaign folder (default: a new one under the temp dir)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kill-block", type=int, default=0, help="the block whose run_steps is killed once")
    parser.add_argument("--no-kill", action="store_true", help="run every block straight through")
    return parser.parse_args(argv)


def _device() -> str:
    """The GPU's name from nvidia-smi (this process never touches CUDA: the stages own the GPU)."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
    return out.strip().splitlines()[0] if out.strip() else "cpu (nvidia-smi lists no GPU)"


def _figures(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures (bench/gpu_summary.py reads them by these names)."""
    base = (result.get("base_eval") or {}).get("either_form")
    final = ((result["blocks"] or [{}])[-1].get("eval") or {}).get("either_form")
    return {"gpu_arith_base_either_form": base, "gpu_arith_final_either_form": final,
            "either_form_gain": None if base is None or final is None else final - base,
            "gpu_arith_resumed_exactly_once": result.get("resumed_exactly_once")}


def _run_blocks(jobs: StageJobs, recipe: Any, result: dict[str, Any], save: Callable[[], None],
                kill: KillPlan | None) -> None:
    """Each block's stages in order, run_steps killed once where `kill` says, teardown after
    each block whatever happened; `result` and its file updated after every stage."""
    for block in range(recipe.campaign.num_blocks):
        began = time.monotonic()
        entry: dict[str, Any] = {"block": block, "stages_s": {}}
        result["blocks"].append(entry)
        try:
            for stage in BLOCK_STAGES:
                plan = kill if kill is not None and kill.block == block and stage is Stage.RUN_STEPS else None
                entry["stages_s"][stage.value] = jobs.run(block, stage, kill=plan)
                _progress(f"block {block} {stage.value}: {entry['stages_s'][stage.value]}")
                save()
        finally:
            entry["stages_s"][Stage.TEARDOWN.value] = jobs.run(block, Stage.TEARDOWN)
            entry["wall_s"] = time.monotonic() - began
            entry["eval"] = jobs.store.block_eval(block)
            entry["where"] = jobs.where(block)
            entry["steps"] = [_step_figures(row) for row in jobs.store.read_metrics(block)]
            if jobs.store.exists("base_eval.json"):  # start_engines of block 0 measured the base policy
                result["base_eval"] = jobs.store.read_json("base_eval.json")
            save()


def _step_figures(row: dict[str, Any]) -> dict[str, Any]:
    """What a step's metrics say of its time and reward (the run's per-phase split)."""
    kept = ("step", "rollout/reward_mean", "rollout/staleness", "rollout/num_generations")
    return {k: v for k, v in row.items() if k in kept or k.startswith("timing/")}


def _progress(line: str) -> None:
    """A line on stdout with the time since the run began (the device tool shows the tail)."""
    print(f"[{time.monotonic() - _BEGAN:6.0f} s] {line}", flush=True)


_BEGAN = time.monotonic()


def _check_epoch(jobs: StageJobs, recipe: Any, result: dict[str, Any]) -> None:
    c = recipe.campaign
    rows = [r for b in range(c.num_blocks) for r in jobs.store.read_metrics(b)]
    num_prompts = c.num_blocks * c.steps_per_block * recipe.rollout.prompts_per_step
    coverage = epoch_coverage(rows, c.num_blocks * c.steps_per_block, num_prompts)
    result["coverage"] = {"lost": coverage.lost, "repeated": coverage.repeated, "steps_ok": coverage.steps_ok,
                          "one_epoch": recipe.data.num_train_rows == num_prompts}
    killed = bool(result["kill"] and result["kill"].get("killed_at_step"))
    result["resumed_exactly_once"] = killed and coverage.exactly_once and recipe.data.num_train_rows == num_prompts


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum} (a time limit) while the run was in progress")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(os.environ.get("OUT", "out"))
    recipe = load_recipe(args.recipe, args.overrides)
    campaign = args.campaign or tempfile.mkdtemp(prefix="gpu-arith-")
    result: dict[str, Any] = {"recipe": args.recipe, "overrides": args.overrides, "campaign": campaign,
                              "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": _device(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "blocks": [],
                              "kill": None, "phases_s": {}}
    started = time.monotonic()

    def save() -> None:
        result["wall_s"] = time.monotonic() - started
        result.update(_figures(result))
        write_json_atomic(out / "gpu_arith.json", result)

    signal.signal(signal.SIGTERM, _stop)  # a time limit (`timeout`) unwinds: stage logs are kept, teardown runs
    try:
        jobs = StageJobs(recipe, args.overrides, args.recipe, campaign, out / "logs")
        save()  # a run cut short in the build still says what it is
        result["model"] = jobs.build_model()
        result["phases_s"]["build"] = result["model"]["wall_s"]
        _progress(f"model built: {result['model']['report']}")
        save()
        kill = None if args.no_kill else KillPlan(block=args.kill_block)
        result["kill"] = kill.report if kill else None
        _run_blocks(jobs, recipe, result, save, kill)
        result["phases_s"].update({f"block_{b['block']}": b["wall_s"] for b in result["blocks"]})
        _check_epoch(jobs, recipe, result)
    except (Exception, KeyboardInterrupt) as e:  # the JSON says what failed; the stage logs say why
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        save()
    print(f"gpu-arith: either form {result['gpu_arith_base_either_form']} -> {result['gpu_arith_final_either_form']}; "
          f"resumed exactly once: {result['resumed_exactly_once']}; {result['wall_s']:.0f} s; {out / 'gpu_arith.json'}")
    return 0 if result["resumed_exactly_once"] or args.no_kill else 1


if __name__ == "__main__":
    sys.exit(main())
