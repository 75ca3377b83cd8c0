"""`milepost run RECIPE --dry-run`: every job a block would submit and every engine command
the fleet would launch, rendered by the code that launches them, with nothing started and
nothing written.

What is rendered by the real code: the Ray allocation's sbatch script (slurm/sbatch.py) or
the local Ray head's command (tasks/local_ray.py), the stage jobs' submitit parameters
(slurm/slurm_executor.py), the placement group's bundles (core/placement.py), each engine's
launch template (core/fleet/launcher.py: the exact argv an engine actor runs once it has
filled the `{…}` placeholders on its node) and the router's command (core/fleet/router.py).
Secrets appear as paths only. Model and data paths are not opened here: they are checked
when the campaign runs, on the machine that can read them.
"""

from __future__ import annotations

import os
import shlex

from milepost.core.config import Recipe
from milepost.core.fleet.launcher import (
    FREE_PORT,
    NODE_IP,
    PLACEHOLDERS,
    Deferred,
    engine_command,
    engine_gpus,
)
from milepost.core.fleet.router import router_command
from milepost.core.model.moe import is_moe_model
from milepost.core.placement import GROUP_NAME, Placement
from milepost.core.quant.modes import disk_form, int4_dtype
from milepost.core.records import Stage, block_path, campaign_id
from milepost.core.secrets import secret_path
from milepost.tasks.context import ENGINE_ADMIN_KEY
from milepost.tasks.ray_auth import _USER_SETTINGS, RAY_TOKEN_SECRET

RANK_CPUS = 0.25  # = core.train.torch_backend.RANK_NUM_CPUS (importing that imports torch; a test compares)


def dry_run_report(recipe: Recipe, recipe_path: str, campaign_url: str, block: int = 0) -> str:
    """The whole report as text. Raises ValueError (LaunchError) for launch parameters an
    engine cannot honour, like the real launch would."""
    root = campaign_id(campaign_url)  # where the campaign's files would be
    out = [f"milepost dry run of {recipe_path}: campaign store {root} (nothing started, nothing written)",
           f"{recipe.campaign.num_blocks} blocks of {recipe.campaign.steps_per_block} steps; block {block} shown "
           "(every block submits the same jobs; later blocks serve the last checkpoint's weights)",
           f"executor: {recipe.cluster.executor}", ""]
    out += _start_ray(recipe, root, block)
    out += _stage_jobs(recipe, root, block)
    out += fleet_lines(recipe, root, block)
    out += ["", "placeholders, filled in on the engine's node at launch:"]
    out += [f"  {name}: {meaning}" for name, meaning in PLACEHOLDERS.items()]
    return "\n".join(out) + "\n"


def _block_path(root: str, block: int, *parts: str) -> str:
    return "/".join([root.rstrip("/"), block_path(block, *parts)])


def _ray_auth_env(root: str) -> dict[str, str]:
    """tasks.ray_auth.ray_auth_env's answer, without creating the token file."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token" or any(os.environ.get(name) for name in _USER_SETTINGS):
        return {"RAY_AUTH_MODE": mode}
    return {"RAY_AUTH_MODE": mode, "RAY_AUTH_TOKEN_PATH": str(secret_path(root, RAY_TOKEN_SECRET))}


def _start_ray(recipe: Recipe, root: str, block: int) -> list[str]:
    from milepost.slurm.sbatch import RayAllocationSpec, RayPorts, render_ray_allocation

    ports = RayPorts.for_campaign(root)
    if recipe.cluster.executor == "local":
        from milepost.tasks.local_ray import head_command

        cmd = head_command(ports, "/tmp/mp-ray-{random}")
        return [f"== {Stage.START_RAY}: a local Ray head (ports: the campaign's slot, or the next free one)",
                "  " + shlex.join(cmd), ""]
    cluster = recipe.cluster
    import sys

    spec = RayAllocationSpec(
        job_name=f"mp-ray-b{block}", options=cluster.slurm.model_copy(update={"nodes": cluster.num_nodes}),
        ports=ports, log_dir=_block_path(root, block, "logs"), address_file=_block_path(root, block, "ray-address"),
        python=sys.executable, ray_temp_root="/tmp", join_timeout_s=900, env=_ray_auth_env(root))
    script = render_ray_allocation(spec).split("# --- body ---")[0].rstrip()
    return [f"== {Stage.START_RAY}: sbatch {_block_path(root, block, 'ray.sbatch')} (the block's Ray allocation, "
            f"{cluster.num_nodes} node(s)); its directives and values (the body that follows is "
            "slurm/sbatch.py's fixed script):", *("  | " + line for line in script.splitlines()), ""]


def _stage_jobs(recipe: Recipe, root: str, block: int) -> list[str]:
    out = ["== stage jobs (each waits for the one before; teardown runs whatever happened)"]
    for stage in Stage:
        name = f"mp-{stage}-b{block}"
        call = shlex.join(["python", "-m", "milepost.tasks.stage", "--campaign", root, "--block", str(block),
                           "--stage", stage.value])
        out.append(f"  {stage}: job {name}: milepost.tasks.stage.run_stage (by hand: {call})")
    if recipe.cluster.executor == "slurm":
        from milepost.slurm.slurm_executor import submitit_parameters

        params = submitit_parameters(recipe.cluster.slurm.model_copy(update={"nodes": 1}), "mp-<stage>-b<N>")
        out.append(f"  each a Slurm job through submitit (folder {root}/jobs), parameters: "
                   + ", ".join(f"{k}={v}" for k, v in params.items()))
    else:
        out.append(f"  each a local process through submitit's local executor (folder {root}/jobs)")
    return out + [""]


def fleet_lines(recipe: Recipe, root: str, block: int = 0) -> list[str]:
    """The start_engines stage's fleet: placement bundles, each engine's launch command, the router."""
    r = recipe.rollout
    placement = Placement(recipe.cluster.placement, recipe.train.num_ranks, r.num_engines, RANK_CPUS, engine_gpus(r))
    colocated = placement.mode == "colocated"
    host = "127.0.0.1" if recipe.cluster.executor == "local" else None
    model = recipe.model.path
    if model.startswith("builtin:"):
        model = Deferred(f"{{{model} model, built and cached at first use}}")
    if disk_form(r.engine, recipe.precision.rollout) == "fp8":  # SGLang loads fp8 copies (fp8_folder.py)
        model = Deferred(f"{{{model.strip('{}')}: its block-wise fp8 copy, written at start under {root}/served}}")
    # int4's --dtype is the trainer's (modes.int4_dtype): known once the stage sees the cluster's devices
    on_gpus, on_cpus = int4_dtype(recipe.train.backend, True), int4_dtype(recipe.train.backend, False)
    int4 = on_cpus if on_gpus == on_cpus else Deferred(f"{{{on_gpus} on GPUs, {on_cpus} on CPUs}}")
    template = engine_command(r, model, "0", colocated=colocated, host=host, admin_key=True, lora=recipe.train.lora,
                              moe=is_moe_model(recipe.model.path), precision=recipe.precision.rollout, int4_dtype=int4)
    bundles = placement.bundles()
    out = [f"== {Stage.START_ENGINES}: {r.num_engines} × {r.engine} engine (TP {r.engine_tensor_parallel}), "
           f"{placement.mode}, as detached Ray actors; placement group {GROUP_NAME} (PACK), bundles: {bundles}",
           f"  trainer: {recipe.train.num_ranks} {recipe.train.backend} ranks, rank r on bundle r"]
    gpus = engine_gpus(r)
    for i in range(r.num_engines):
        b = placement.engine_bundle(i)
        where = (f"bundle {b} {bundles[b]}, actor num_gpus={gpus}: Ray sets its CUDA_VISIBLE_DEVICES, the engine "
                 f"starts at --base-gpu-id 0" if gpus else f"bundle {b} {bundles[b]}, no GPU")
        out += [f"  engine {i}: log {_block_path(root, block, 'logs', f'engine-{i}.0.log')}; {where}",
                f"    {template.render()}"]
    out.append(f"  admin key: {{admin_config_yaml}} holds the key of {secret_path(root, ENGINE_ADMIN_KEY)} "
               "(the key itself is never on a command line nor printed)")
    out.append(f"  readiness: each engine is admitted at its first 200 from /health_generate within "
               f"rollout.engine_startup_timeout_s={r.engine_startup_timeout_s:g}s (cold start), after its "
               "/server_info version and weight-update routes are probed")
    node = NODE_IP if host is None else host
    workers = [f"http://{node}:{FREE_PORT}" for _ in range(r.num_engines)]
    router = router_command(Deferred(node), Deferred("{free_port}"), Deferred("{free_port}"), r.router_policy,
                            [Deferred(w) for w in workers], python=Deferred("python"))
    out += ["  router (once every engine is admitted; each engine's URL as registered):",
            "    " + " ".join(w if isinstance(w, Deferred) else shlex.quote(w) for w in router),
            "  a restarted engine is registered with the running router: POST {router}/workers "
            '{"url": "http://' + f'{node}:{FREE_PORT}", "worker_type": "regular"}}, then waited for in GET /workers']
    if gpus and placement.engine_gpus > (recipe.cluster.slurm.gpus_per_node or placement.engine_gpus):
        out.append(f"  WARNING: an engine's {gpus} GPUs exceed cluster.slurm.gpus_per_node="
                   f"{recipe.cluster.slurm.gpus_per_node}: one bundle cannot span nodes, and the fleet does not "
                   "launch multi-node engines yet (the launcher renders --dist-init-addr/--nnodes/--node-rank)")
    return out
