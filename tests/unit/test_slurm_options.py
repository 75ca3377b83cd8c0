"""SlurmOptions: validated at the door, mapped to submitit's parameters."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from milepost.slurm.options import Resources, SlurmOptions
from milepost.slurm.slurm_executor import submitit_parameters


def test_unknown_field_is_rejected():
    with pytest.raises(ValidationError, match="partitoin"):
        SlurmOptions(partitoin="gpu")


def test_unknown_extra_directive_lists_the_valid_ones():
    with pytest.raises(ValidationError) as err:
        SlurmOptions(extra={"reservaton": "demo"})
    message = str(err.value)
    assert "unknown sbatch option 'reservaton'" in message
    assert "reservation" in message and "mail-type" in message


def test_extra_directive_with_a_typed_field_names_the_field():
    with pytest.raises(ValidationError, match="set `time_min` instead of `extra.time`"):
        SlurmOptions(extra={"time": "01:00:00"})


@pytest.mark.parametrize("name", ["output", "job-name", "signal"])
def test_extra_cannot_override_what_the_executor_sets(name):
    with pytest.raises(ValidationError, match="set by milepost itself"):
        SlurmOptions(extra={name: "x"})


@pytest.mark.parametrize("field, value", [("partition", "gpu\n#SBATCH --uid=0"),
                                          ("account", "a\rb"), ("qos", "x\0")])
def test_newlines_in_directive_values_are_rejected(field, value):
    with pytest.raises(ValidationError, match="newline or NUL"):
        SlurmOptions(**{field: value})


def test_newline_in_extra_value_is_rejected():
    with pytest.raises(ValidationError, match="newline or NUL"):
        SlurmOptions(extra={"comment": "ok\nrm -rf /"})


def test_resources_override_only_what_they_set():
    options = SlurmOptions(partition="gpu", nodes=1, gpus_per_node=8, time_min=120)
    merged = options.with_resources(Resources(nodes=2, time_min=30))
    assert (merged.partition, merged.nodes, merged.gpus_per_node, merged.time_min) == ("gpu", 2, 8, 30)
    assert options.with_resources(None) is options


def test_resources_reject_nonsense():
    with pytest.raises(ValidationError):
        Resources(nodes=0)
    with pytest.raises(ValidationError):
        Resources(gpus=1)


def test_submitit_parameters_map_every_option():
    options = SlurmOptions(partition="gpu", account="proj", qos="high", constraint="h200",
                           time_min=90, nodes=2, tasks_per_node=4, cpus_per_task=16,
                           gpus_per_node=8, mem_gb=512, extra={"reservation": "demo", "exclusive": True})
    params = submitit_parameters(options, "train")
    assert params == {
        "job_name": "train", "time": 90, "nodes": 2, "ntasks_per_node": 4, "use_srun": True,
        "wckey": None, "partition": "gpu", "account": "proj", "qos": "high", "constraint": "h200",
        "cpus_per_task": 16, "mem": "512G", "gpus_per_node": 8,
        "additional_parameters": {"reservation": "demo", "exclusive": True},
    }


def test_submitit_parameters_leave_out_what_is_unset():
    params = submitit_parameters(SlurmOptions(mem_gb=1.5), "x")
    assert params["mem"] == "1536M"
    assert not {"partition", "account", "gpus_per_node", "additional_parameters"} & params.keys()


def test_rendered_submitit_script_has_no_wckey_and_our_options(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    params = submitit_parameters(SlurmOptions(partition="p q", extra={"comment": "it's"}), "n")
    text = _make_sbatch_string(command="true", folder=tmp_path, **params)
    assert "--wckey" not in text
    assert "#SBATCH --partition='p q'" in text
    assert "#SBATCH --comment='it'\"'\"'s'" in text
