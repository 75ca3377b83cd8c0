"""Fault injection: SIGKILL a process the campaign owns at a seeded-random moment, rerun,
and lose or repeat nothing (see fault_kinds.py for the kinds, moments and checks).

By default a small fixed set runs (bounded for CI). `--soak` runs the whole matrix (every
kind × sync/async, `--soak-runs` seeded runs in all) and writes tests/faults/RESULTS.md
(table + `total:` line) and tests/faults/results.csv (one row per run).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fault_campaign as cp
import fault_kinds as faults
import pytest

HERE = Path(__file__).resolve().parent
RESULTS_MD, RESULTS_CSV = HERE / "RESULTS.md", HERE / "results.csv"

# The bounded set (CI: driver and router; the trainer case is in `-m extended`), async (no reference run
# needed; sync mode and its sha equality are the soak's). The driver case is the
# known defect of issue 16: a kill while the start_engines stage launches its engines once cost the
# rerun 2 x 243 s; the router case once cost the block two 240 s stage timeouts and a relaunch.
CI_CASES = [
    pytest.param("driver", "async", 1, "start_engines:engines", id="driver-async"),
    pytest.param("trainer", "async", 1, "step:0", id="trainer-async", marks=pytest.mark.extended),
    pytest.param("router", "async", 1, "step:0", id="router-async"),
]


def _explain(r: faults.Result) -> str:
    return (f"{r.kind}/{r.mode} seed {r.seed} at {r.anchor}+{r.delay_s}s, killed {r.killed or 'nothing'} "
            f"(stage {r.stage_at_kill}, step {r.killed_at_step}); runs {r.runs} rc {r.exit_codes}; resumed "
            f"{r.resumed}, lost {r.lost}, repeated {r.repeated}, steps ok {r.steps_ok}, sha equal {r.sha_equal}; "
            f"{r.problem}; log {r.log}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("kind,mode,seed,anchor", CI_CASES)
def test_fault_is_recovered(kind, mode, seed, anchor, fault_root, fault_cache, fault_shape, references, request):
    if cp.option(request.config, "--soak", False):
        pytest.skip("--soak runs the whole matrix instead")
    p = faults.plan(kind, mode, seed, fault_shape, anchor)
    ref = references(mode, p.executor) if mode == "sync" else None
    r = faults.run_fault(p, fault_root, fault_cache, fault_shape, ref, on_event=print)
    assert r.killed, _explain(r)
    assert r.ok, _explain(r)


def soak_plans(num_runs: int, shape: cp.Shape, first_seed: int, kinds: tuple[str, ...] = faults.KINDS
               ) -> list[faults.Plan]:
    """Round-robin over every (kind, mode) cell, so that any prefix covers the matrix evenly."""
    cells = [(k, m) for k in kinds for m in cp.MODES]
    return [faults.plan(*cells[i % len(cells)], first_seed + i // len(cells), shape) for i in range(num_runs)]


def _deadline(text: str | None) -> float | None:
    if not text:
        return None
    hh, mm = map(int, text.split(":"))
    now = dt.datetime.now()
    at = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
    return at.timestamp()


@pytest.mark.timeout(0)
def test_soak(request, fault_root, fault_cache, fault_shape, references):
    config = request.config
    if not cp.option(config, "--soak", False):
        pytest.skip("the soak runs with --soak")
    kinds = tuple((cp.option(config, "--soak-kinds") or ",".join(faults.KINDS)).split(","))
    all_plans = soak_plans(cp.option(config, "--soak-runs", 60), fault_shape, cp.option(config, "--soak-seed", 1),
                           kinds)
    plans = all_plans
    workers = cp.option(config, "--soak-workers", 1)
    deadline = _deadline(cp.option(config, "--soak-deadline"))
    if any(p.executor == "slurm" for p in plans):
        from milepost.slurm.devcluster import check_dev_cluster
        problem = check_dev_cluster(min_nodes=2)
        if problem:
            pytest.fail(problem, pytrace=False)

    started, lock, slurm_lock = time.monotonic(), threading.Lock(), threading.Lock()
    # --soak-resume: keep the runs results.csv already holds (an interrupted soak), run the rest
    results: list[faults.Result] = faults.load_results(RESULTS_CSV) if cp.option(config, "--soak-resume") else []
    done = {(r.kind, r.mode, r.seed) for r in results}
    plans = [p for p in all_plans if (p.kind, p.mode, p.seed) not in done]
    skipped: list[str] = []
    begun = dt.datetime.now().strftime("%Y-%m-%d %H:%M")

    def header() -> str:
        wall = time.monotonic() - started
        return "\n".join([
            "# Fault-injection soak (tests/faults)", "",
            f"Command: `python -m pytest tests/faults -k soak --soak --soak-runs {len(all_plans)} "
            f"--soak-workers {workers} --soak-steps {fault_shape.steps_per_block}"
            + (f" --soak-deadline {cp.option(config, '--soak-deadline')}`" if deadline else "`"),
            f"(started {begun}, {len(results)} of {len(all_plans)} runs done, wall {wall / 60:.1f} min,"
            f" {workers} at once, 2-core machine shared with other work)"
            + (f"; product code of commit {os.environ['MILEPOST_FAULTS_COMMIT']} (a snapshot: the shared working"
               " tree's uncommitted edits stay out)." if os.environ.get("MILEPOST_FAULTS_COMMIT") else "."),
            f"Each run: one campaign of tiny-arith, {fault_shape.num_blocks} block x {fault_shape.steps_per_block}"
            f" steps x {fault_shape.prompts_per_step} prompts (one epoch, {fault_shape.num_prompts} prompts),"
            f" checkpoint every {fault_shape.checkpoint_every} steps; one SIGKILL at a seeded-random moment;"
            f" `milepost run` again (at most {faults.MAX_RERUNS} times) until the campaign is complete.",
            "sync: loop.max_staleness=0 (final model_sha256 compared with an uninterrupted reference run of the"
            " same executor); async: loop.max_staleness=1, cluster.placement=disaggregated.",
            "lost: prompts of the epoch never trained; repeated: extra trainings of a prompt (metrics"
            " `data/prompt_indices`); failed checks: runs with any check failed (also a step gap or duplicate, a"
            " sha mismatch, a hang, or a kill that never landed)."
            + (f" Not run (deadline): {len(skipped)}." if skipped else "")])

    def one(p: faults.Plan) -> None:
        if deadline is not None and time.time() > deadline:
            skipped.append(p.name)
            return
        try:
            ref = references(p.mode, p.executor) if p.mode == "sync" else None
        except Exception as e:  # noqa: BLE001 - recorded against the run, the soak goes on
            r = faults.Result(p.kind, p.mode, p.seed, p.executor, p.anchor, p.delay_s, p.variant,
                              problem=f"no reference run: {e}"[:500])
            with lock:
                results.append(r)
                faults.write_results(results, RESULTS_MD, RESULTS_CSV, header())
            return
        if p.executor == "slurm":
            with slurm_lock:  # the dev cluster's 2 nodes hold one block's allocation and jobs
                r = faults.run_fault(p, fault_root, fault_cache, fault_shape, ref, on_event=print)
        else:
            r = faults.run_fault(p, fault_root, fault_cache, fault_shape, ref, on_event=print)
        with lock:
            results.append(r)
            print(("OK   " if r.ok else "FAIL ") + _explain(r), flush=True)
            faults.write_results(results, RESULTS_MD, RESULTS_CSV, header())

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(one, p) for p in plans]:
            future.result()
    faults.write_results(results, RESULTS_MD, RESULTS_CSV, header())
    bad = [_explain(r) for r in results if not r.ok]
    assert not bad, "\n".join(bad)
