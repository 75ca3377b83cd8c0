"""Engine launch commands (core/fleet/launcher.py): golden files with hostile values, the
shell round trip, what the built-in engine refuses, and SGLang's own argument parser.

Regenerate the golden files after an intended change with
`MILEPOST_UPDATE_GOLDEN=1 pytest tests/unit/test_engine_launcher.py` and review their diff.

SGLang's parser: sglang 0.5.23 cannot run on CPU machines, but its Python source imports far
enough to build its argument parser (`ServerArgs.add_cli_args`) and to merge a --config file
(`ConfigArgumentMerger`). The test uses the installed wheel (`.ci/run`: `pip install
--no-deps sglang==0.5.23` and the test extra), or an unpacked one on MILEPOST_SGLANG_PYTHONPATH:

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl && python -m zipfile -e /tmp/sgl/sglang-*.whl /tmp/sglx
    pip install --no-deps --target /tmp/sgldeps pybase64 pillow pyzmq
    MILEPOST_SGLANG_PYTHONPATH=/tmp/sglx:/tmp/sgldeps pytest tests/unit/test_engine_launcher.py

Without either it fails, naming the install (as the conformance tests do).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from milepost.core.config import RolloutConfig
from milepost.core.fleet.launcher import (
    PLACEHOLDERS,
    EngineCommand,
    LaunchError,
    engine_command,
    engine_gpus,
    write_admin_config,
)

EXPECTED = Path(__file__).parent / "expected"
HOSTILE = "it's a \"path\" with $(touch /tmp/pwned) `id` ; & | * ~ \\ {node_ip} and spaces"
HOSTILE_VERSION = "v'1; rm -rf ~"


def sglang_command() -> EngineCommand:
    cfg = RolloutConfig(engine="sglang", engine_tensor_parallel=4, max_batch_size=256,
                        sglang={"mem_fraction_static": 0.55, "dp_size": 2, "ep_size": 8,
                                "enable_return_routed_experts": True,
                                "extra_args": ["--attention-backend", "fa3", "--served-model-name=q $(id)"]})
    template = engine_command(cfg, HOSTILE, HOSTILE_VERSION, colocated=True, admin_key=True)
    return template.resolve(host="10.1.2.3", port=30001, nccl_port=30002, python="/shared/venv/bin/python",
                            config_path="/tmp/milepost-engine-x y/engine-admin.yaml",
                            dist_init_addr="10.1.2.3:29555", nnodes=2, node_rank=1)


def builtin_command() -> EngineCommand:
    template = engine_command(RolloutConfig(max_batch_size=64), HOSTILE, HOSTILE_VERSION, colocated=True,
                              host="127.0.0.1", admin_key=True, load_delay_s=1.5)
    return template.resolve(port=40001, python="/venv/bin/python", config_path="/tmp/k/engine-admin.yaml")


def _golden(name: str, text: str) -> None:
    path = EXPECTED / name
    if os.environ.get("MILEPOST_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; regenerate with MILEPOST_UPDATE_GOLDEN=1 and review"


@pytest.mark.parametrize("name,make", [("engine_sglang.txt", sglang_command),
                                       ("engine_builtin.txt", builtin_command)])
def test_rendered_command_matches_the_golden_file(name, make) -> None:
    _golden(name, make().render() + "\n")


@pytest.mark.parametrize("make", [sglang_command, builtin_command])
def test_the_shell_reads_back_exactly_the_argv(make) -> None:
    cmd = make()
    assert shlex.split(cmd.render()) == cmd.argv()
    assert cmd.argv()[cmd.argv().index("--model-path") + 1] == HOSTILE


def test_templates_leave_node_values_as_placeholders() -> None:
    cfg = RolloutConfig(engine="sglang", engine_tensor_parallel=2)
    text = engine_command(cfg, "/m", "0", colocated=False, admin_key=True).render()
    for placeholder in PLACEHOLDERS:
        assert placeholder in text
    assert "--enable-memory-saver" not in text  # disaggregated: nothing to give back
    with pytest.raises(LaunchError, match="placeholders"):
        engine_command(cfg, "/m", "0", colocated=False).resolve(port=1)


def test_newlines_and_bad_ports_are_refused() -> None:
    base = dict(engine="sglang", model_path="/m", host="10.0.0.1", port=1, weight_version="0",
                max_running_requests=1, python="python")
    with pytest.raises(LaunchError, match="newline"):
        EngineCommand(**{**base, "model_path": "/m\n--tp-size 8"})
    with pytest.raises(LaunchError, match="TCP port"):
        EngineCommand(**{**base, "port": 70000})
    with pytest.raises(LaunchError, match="dist_init_addr"):
        EngineCommand(**{**base, "nnodes": 2})
    with pytest.raises(ValidationError, match="set by milepost"):
        RolloutConfig(sglang={"extra_args": ["--tp-size=2"]})
    with pytest.raises(ValidationError, match="ps"):
        RolloutConfig(sglang={"extra_args": ["--api-key", "k"]})


def test_builtin_refuses_what_it_cannot_honour_before_launch() -> None:
    with pytest.raises(LaunchError, match="tp_size=2"):
        engine_command(RolloutConfig(engine_tensor_parallel=2), "/m", "0", colocated=True)
    assert engine_gpus(RolloutConfig(engine_tensor_parallel=1)) == 0
    assert engine_gpus(RolloutConfig(engine="sglang", engine_tensor_parallel=4)) == 4


def test_builtin_server_parses_its_launch_command(tmp_path) -> None:
    """The built-in engine's own parser reads the launcher's argv (with --config) and refuses
    SGLang flags it cannot honour, naming them."""
    from milepost.core.engine import server

    config = write_admin_config("s3cret key", str(tmp_path / "private"))
    assert oct(os.stat(config).st_mode & 0o777) == "0o600"
    cmd = builtin_command().resolve(config_path=config)
    args = server.parse_args(cmd.argv()[3:])
    assert (args.model_path, args.port, args.weight_version, args.max_batch_size, args.admin_api_key,
            args.load_delay_s) == (HOSTILE, 40001, HOSTILE_VERSION, 64, "s3cret key", 1.5)
    with pytest.raises(SystemExit):
        server.parse_args(["--model-path", "/m", "--port", "1", "--tp-size", "2"])


SGLANG_PARSE = r"""
import argparse, importlib.util, json, sys, types
# As tests/integration/sglang_oracle.py: sglang/__init__.py is not run (it imports the
# frontend and, through srt/utils/common.py, triton); the package is a bare namespace and
# triton an empty module while common.py imports (it uses triton only in kernel helpers that
# argument parsing never calls). The parser and the --config merger are SGLang's, unchanged.
spec = importlib.util.find_spec("sglang")
pkg = types.ModuleType("sglang"); pkg.__path__ = list(spec.submodule_search_locations); pkg.__file__ = spec.origin
sys.modules["sglang"] = pkg
if importlib.util.find_spec("triton") is None:
    sys.modules["triton"] = types.ModuleType("triton")
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
argv = json.loads(sys.argv[1])
if "--config" in argv:  # exactly what sglang's prepare_server_args does with --config
    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
print(json.dumps({k: v for k, v in vars(parser.parse_args(argv)).items()
                  if isinstance(v, (str, int, float, bool, type(None), list))}))
"""


def _sglang_env() -> dict[str, str]:
    """The environment whose Python imports SGLang 0.5.23's source: the installed wheel
    (`.ci/run`: pip install --no-deps sglang==0.5.23 plus the test extra), or an unpacked
    one on MILEPOST_SGLANG_PYTHONPATH (module docstring)."""
    extra = os.environ.get("MILEPOST_SGLANG_PYTHONPATH")
    env = {**os.environ, **({"PYTHONPATH": extra} if extra else {})}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                           env=env, capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.fail("SGLang 0.5.23's source is not importable, so its own parser cannot check the launch "
                    "command: pip install --no-deps sglang==0.5.23 (as .ci/run does), or set "
                    "MILEPOST_SGLANG_PYTHONPATH (module docstring)")
    return env


def test_sglang_own_parser_reads_the_rendered_command(tmp_path) -> None:
    env = _sglang_env()
    config = write_admin_config("s3cret key", str(tmp_path / "private"))
    cmd = sglang_command().resolve(config_path=config)
    reply = subprocess.run([sys.executable, "-c", SGLANG_PARSE, json.dumps(cmd.argv()[3:])],
                           env=env, capture_output=True, text=True, timeout=300)
    assert reply.returncode == 0, reply.stderr[-3000:]
    a = json.loads(reply.stdout.strip().splitlines()[-1])
    assert (a["model_path"], a["host"], a["port"], a["nccl_port"]) == (HOSTILE, "10.1.2.3", 30001, 30002)
    assert (a["tp_size"], a["dp_size"], a["ep_size"], a["base_gpu_id"]) == (4, 2, 8, 0)
    assert (a["mem_fraction_static"], a["max_running_requests"], a["weight_version"]) == (0.55, 256, HOSTILE_VERSION)
    assert a["enable_memory_saver"] and a["skip_server_warmup"] and a["enable_return_routed_experts"]
    assert (a["dist_init_addr"], a["nnodes"], a["node_rank"]) == ("10.1.2.3:29555", 2, 1)
    assert a["admin_api_key"] == "s3cret key"  # from the owner-only --config YAML, not argv
    assert (a["attention_backend"], a["served_model_name"]) == ("fa3", "q $(id)")  # extra_args verbatim


def test_moe_models_engines_return_their_routes(tmp_path) -> None:
    """MoE routing replay: an MoE model's engines get --enable-return-routed-experts (told from
    its config.json, or given), a dense model's do not; both engines accept the flag."""
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    for engine in ("builtin", "sglang"):
        cfg = RolloutConfig(engine=engine)
        assert "--enable-return-routed-experts" in engine_command(cfg, str(tmp_path), "0", colocated=False).argv()
        assert "--enable-return-routed-experts" not in engine_command(cfg, "/m", "0", colocated=False).argv()
        placeholder = engine_command(cfg, "{builtin model}", "0", colocated=False, moe=True)
        assert "--enable-return-routed-experts" in placeholder.argv()
