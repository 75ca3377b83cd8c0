"""The Ray-on-Slurm allocation script: golden file, hostile values, port choice.

Regenerate the golden file after an intended change with
`MILEPOST_UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch.py` and review its diff.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from milepost.slurm.options import SlurmOptions
from milepost.slurm.sbatch import (
    NUM_PORT_SLOTS,
    PORT_FIRST,
    PORT_SLOT_SIZE,
    RayAllocationSpec,
    RayPorts,
    render_ray_allocation,
)

GOLDEN = Path(__file__).parent / "expected" / "ray_allocation.sbatch"
HOSTILE = "it's a \"path\" with $(touch /tmp/pwned) `id` ; & | * ~ \\ and\nnewline"


def golden_spec() -> RayAllocationSpec:
    options = SlurmOptions(partition="gpu", account="proj-42", qos="high", constraint="h200&ib",
                           time_min=240, nodes=4, cpus_per_task=32, gpus_per_node=8, mem_gb=900,
                           extra={"reservation": "rl-demo", "exclusive": True})
    return RayAllocationSpec(
        job_name="milepost-tiny-arith-b000003", options=options,
        ports=RayPorts.for_campaign("tiny-arith"), log_dir="/shared/campaigns/tiny-arith/logs",
        address_file="/shared/campaigns/tiny-arith/blocks/000003/ray-address",
        python="/shared/venvs/milepost/bin/python", ray_temp_root="/tmp", join_timeout_s=900,
        env={"HF_HOME": "/shared/hf", "NCCL_DEBUG": "WARN"}, campaign_url="/shared/campaigns/tiny-arith",
        orphan_grace_s=1800, watch_armed=True)


def test_rendered_script_matches_the_golden_file():
    text = render_ray_allocation(golden_spec())
    if os.environ.get("MILEPOST_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "rendering changed: see the module docstring to update"


def test_rendered_script_is_valid_bash():
    subprocess.run(["bash", "-n"], input=render_ray_allocation(golden_spec()), text=True, check=True)


def values_block(script: str) -> str:
    start = script.index("# --- values ---\n")
    return script[start:script.index("# --- body ---")]


def eval_values(script: str, names: list[str]) -> list[str]:
    """Run the script's values block in bash and read back the named variables exactly."""
    printer = "".join(f'printf "%s\\0" "${name}"\n' for name in names)
    out = subprocess.run(["bash", "-c", values_block(script) + printer], capture_output=True,
                         check=True, cwd="/", env={"PATH": os.environ["PATH"]}).stdout
    return out.decode().split("\0")[:-1]


def test_hostile_values_round_trip_through_the_shell_exactly(tmp_path):
    spec = golden_spec().model_copy(update={
        "python": "/opt/my venv/it's/bin/python", "address_file": HOSTILE,
        "ray_temp_root": str(tmp_path / "a b'c"), "env": {"WEIRD": HOSTILE}})
    script = render_ray_allocation(spec)
    assert eval_values(script, ["PYTHON", "ADDRESS_FILE", "RAY_TEMP_ROOT", "WEIRD"]) == [
        spec.python, HOSTILE, spec.ray_temp_root, HOSTILE]
    assert not Path("/tmp/pwned").exists()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def sbatch_directives(script: str) -> dict[str, str]:
    """#SBATCH lines as sbatch reads them: shell quoting, one option per line."""
    found = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            (word,) = shlex.split(line[len("#SBATCH "):])
            key, _, value = word.partition("=")
            found[key] = value
    return found


def test_hostile_directive_values_stay_one_quoted_word():
    name = "a'b \"c\" $(touch /tmp/pwned) ; x"
    spec = golden_spec().model_copy(update={"job_name": name, "log_dir": "/logs/it's here"})
    spec = RayAllocationSpec.model_validate(spec.model_dump())
    directives = sbatch_directives(render_ray_allocation(spec))
    assert directives["--job-name"] == name
    assert directives["--output"] == "/logs/it's here/ray-%j.out"
    assert directives["--exclusive"] == ""


@pytest.mark.parametrize("field", ["job_name", "log_dir"])
def test_newline_in_a_directive_value_is_rejected(field):
    data = golden_spec().model_dump()
    data[field] = "x\n#SBATCH --uid=0\ntouch /tmp/pwned"
    with pytest.raises(ValidationError, match="newline"):
        RayAllocationSpec.model_validate(data)


def test_env_names_must_be_shell_identifiers():
    data = golden_spec().model_dump()
    data["env"] = {"A;touch /tmp/pwned": "1"}
    with pytest.raises(ValidationError, match="shell identifiers"):
        RayAllocationSpec.model_validate(data)


def test_directives_carry_the_options_and_one_task_per_node():
    directives = sbatch_directives(render_ray_allocation(golden_spec()))
    assert directives["--nodes"] == "4" and directives["--ntasks-per-node"] == "1"
    assert directives["--gpus-per-node"] == "8" and directives["--mem"] == "900G"
    assert directives["--constraint"] == "h200&ib" and directives["--reservation"] == "rl-demo"
    assert "--wckey" not in directives and "--signal" not in directives


def test_campaign_ports_are_deterministic_and_in_range():
    ports = RayPorts.for_campaign("tiny-arith")
    assert ports == RayPorts.for_campaign("tiny-arith")
    assert ports.gcs >= PORT_FIRST and ports.max_worker < PORT_FIRST + NUM_PORT_SLOTS * PORT_SLOT_SIZE
    assert (ports.gcs - PORT_FIRST) % PORT_SLOT_SIZE == 0


def test_different_campaigns_mostly_get_different_ports():
    slots = {RayPorts.for_campaign(f"campaign-{i}").gcs for i in range(200)}
    assert len(slots) == NUM_PORT_SLOTS  # the hash reaches every slot


def test_every_slot_lies_outside_rays_defaults_and_the_ephemeral_range():
    """An outgoing connection's local port (Linux default 32768-60999) must never take a
    slot's port, nor a default `ray start`'s workers (10002-19999)."""
    last = PORT_FIRST + NUM_PORT_SLOTS * PORT_SLOT_SIZE - 1
    assert PORT_FIRST >= 20000 and last < 32768


def test_overlapping_ports_are_rejected():
    with pytest.raises(ValidationError, match="overlap"):
        RayPorts(gcs=30000, dashboard=30001, client_server=30002, node_base=30010,
                 min_worker=30050, max_worker=30100)
