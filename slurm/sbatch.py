"""Render the sbatch script of a block's Ray-on-Slurm allocation from typed parameters.

The allocation runs a Ray head on its first node and one Ray worker per other node, each
as its own `srun` step, waits until every node has joined, then publishes the head's
address (`IP:PORT`) to a file and holds the allocation until it is cancelled or a Ray node
dies. Its EXIT trap stops only the steps it started (slurmstepd tracks every process of
a step), never `ray stop`, which would stop every Ray cluster on the node.

Every value is quoted with `shlex.quote`, in `#SBATCH` lines too (sbatch reads them with
shell quoting). Values of `#SBATCH` lines may not contain newlines: a newline would end
the directive and start a line of shell code.
"""

from __future__ import annotations

import shlex
import sys
import zlib

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from milepost.slurm.options import SlurmOptions, check_directive_value
from milepost.slurm.slurm_executor import submitit_parameters

# Slots lie between Ray's own defaults (worker ports 10002-19999) and Linux's default
# ephemeral range (32768-60999): an outgoing connection's local port never lands in a slot.
# CI once found a slot at 44300-44599 taken by such a connection.
PORT_FIRST = 20000
PORT_SLOT_SIZE = 300
NUM_PORT_SLOTS = 42  # 20000 … 32599
NUM_NODE_PORTS = 4  # dashboard agent (listen, grpc), metrics export, runtime env agent
NODE_PORT_GROUPS = 22  # per-node port groups: distinct for nodes that share a host


class RayPorts(BaseModel):
    """The ports of one campaign's Ray cluster, distinct from other campaigns' on shared nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gcs: int = Field(ge=1024, le=65535)
    dashboard: int = Field(ge=1024, le=65535)
    client_server: int = Field(ge=1024, le=65535)
    node_base: int = Field(ge=1024, le=65535 - NUM_NODE_PORTS * NODE_PORT_GROUPS,
                           description="Node k uses node_base + 4 * (k % 22) + 0..3.")
    min_worker: int = Field(ge=1024, le=65535)
    max_worker: int = Field(ge=1024, le=65535)

    @model_validator(mode="after")
    def _no_overlap(self) -> RayPorts:
        if self.min_worker > self.max_worker:
            raise ValueError(f"min_worker {self.min_worker} > max_worker {self.max_worker}")
        ranges = [("gcs", self.gcs, self.gcs), ("dashboard", self.dashboard, self.dashboard),
                  ("client_server", self.client_server, self.client_server),
                  ("node ports", self.node_base, self.node_base + NUM_NODE_PORTS * NODE_PORT_GROUPS - 1),
                  ("worker ports", self.min_worker, self.max_worker)]
        for i, (a, a_lo, a_hi) in enumerate(ranges):
            for b, b_lo, b_hi in ranges[i + 1:]:
                if max(a_lo, b_lo) <= min(a_hi, b_hi):
                    raise ValueError(f"Ray ports overlap: {a} {a_lo}-{a_hi} and {b} {b_lo}-{b_hi}")
        return self

    @classmethod
    def for_campaign(cls, campaign_id: str) -> RayPorts:
        """A slot of 300 ports picked by a hash of the campaign id (42 slots).

        Deterministic, so a resumed block reuses its ports. Two campaigns hash to the same
        slot with probability 1/42; the second finds its ports taken (port_check) and moves
        to the next slot.
        """
        slot = zlib.crc32(campaign_id.encode()) % NUM_PORT_SLOTS
        base = PORT_FIRST + slot * PORT_SLOT_SIZE
        return cls(gcs=base, dashboard=base + 1, client_server=base + 2, node_base=base + 10,
                   min_worker=base + 100, max_worker=base + PORT_SLOT_SIZE - 1)


class RayAllocationSpec(BaseModel):
    """Everything the allocation script needs; rendered by `render_ray_allocation`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_name: str
    options: SlurmOptions
    ports: RayPorts
    log_dir: str = Field(description="Folder of the allocation's stdout/stderr (`ray-<jobid>.out`).")
    address_file: str = Field(description="Where the head's `IP:PORT` is written once all nodes joined.")
    python: str = Field(default_factory=lambda: sys.executable,
                        description="Python with ray and milepost installed, on every node.")
    ray_temp_root: str = Field("/tmp", description="Ray's temp dir is <root>/milepost-ray-<jobid>.")
    join_timeout_s: int = Field(600, ge=1)
    include_dashboard: bool = False
    env: dict[str, str] = Field(default_factory=dict, description="Exported to every Ray node.")
    campaign_url: str | None = Field(
        None, description="The campaign whose lease the allocation watches once up (tasks/lease_watch.py): "
                          "it stops itself when no run has held that lease for `orphan_grace_s`. None: no watch.")
    orphan_grace_s: int = Field(1800, ge=1)
    watch_armed: bool = Field(False, description="A live run held the lease at submission: the watch counts "
                                                 "from its start (an allocation that waited in the queue past "
                                                 "its driver's death still stops).")

    @field_validator("job_name", "log_dir")
    @classmethod
    def _one_line(cls, value: str, info) -> str:
        check_directive_value(info.field_name, value)
        return value

    @field_validator("env")
    @classmethod
    def _shell_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [k for k in env if not k.isidentifier() or not k.isascii()]
        if bad:
            raise ValueError(f"environment variable names must be shell identifiers; got {bad}")
        return env


def sbatch_directives(spec: RayAllocationSpec) -> list[str]:
    """`#SBATCH` lines: the campaign's options, one task per node, our log paths."""
    params = submitit_parameters(spec.options, spec.job_name)
    flags: dict[str, object] = {
        "job-name": params["job_name"], "time": params["time"], "nodes": params["nodes"],
        # One task per node: the Ray node; it gets every CPU of the allocation on that node.
        "ntasks-per-node": 1,
    }
    for key in ("partition", "account", "qos", "constraint", "cpus_per_task", "mem", "gpus_per_node"):
        if key in params:
            flags[key.replace("_", "-")] = params[key]
    flags.update(params.get("additional_parameters", {}))
    log = spec.log_dir.rstrip("/") or "/"
    flags["output"] = f"{log}/ray-%j.out"
    flags["error"] = f"{log}/ray-%j.err"
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}"
            for k, v in flags.items()]


def shell_values(spec: RayAllocationSpec) -> list[str]:
    """The script's inputs as shell assignments, each value quoted."""
    p = spec.ports
    values: dict[str, object] = {
        "PYTHON": spec.python, "ADDRESS_FILE": spec.address_file, "RAY_TEMP_ROOT": spec.ray_temp_root,
        "GCS_PORT": p.gcs, "DASHBOARD_PORT": p.dashboard, "CLIENT_SERVER_PORT": p.client_server,
        "NODE_PORT_BASE": p.node_base, "MIN_WORKER_PORT": p.min_worker, "MAX_WORKER_PORT": p.max_worker,
        "NUM_GPUS_PER_NODE": spec.options.gpus_per_node, "JOIN_TIMEOUT_S": spec.join_timeout_s,
        "INCLUDE_DASHBOARD": str(spec.include_dashboard).lower(), "CAMPAIGN_URL": spec.campaign_url or "",
        "ORPHAN_GRACE_S": spec.orphan_grace_s, "WATCH_ARMED": "1" if spec.watch_armed else "",
    }
    lines = [f"{k}={shlex.quote(str(v))}" for k, v in values.items()]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
    return lines


def render_ray_allocation(spec: RayAllocationSpec) -> str:
    return "\n".join(["#!/bin/bash", *sbatch_directives(spec), "",
                      "# Rendered by milepost.slurm.sbatch: a Ray cluster on this allocation.",
                      "# --- values ---", *shell_values(spec), "", RAY_BODY])


RAY_BODY = r"""# --- body ---
set -uo pipefail
export PYTHON RAY_TEMP_DIR="$RAY_TEMP_ROOT/milepost-ray-$SLURM_JOB_ID"
export GCS_PORT DASHBOARD_PORT CLIENT_SERVER_PORT NODE_PORT_BASE MIN_WORKER_PORT MAX_WORKER_PORT
export NUM_GPUS_PER_NODE INCLUDE_DASHBOARD
# Token auth (Ray's default): every node and driver must say so; the token is the file that
# RAY_AUTH_TOKEN_PATH names (exported above by milepost, on the shared store), else ~/.ray's.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
STEP_PIDS=()
ADDRESS=""
WATCH_PID=""

node_ip() {  # this host's outgoing IPv4 literal: Ray and the router need IPs, not names
  "$PYTHON" -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect(("10.255.255.255", 1)); print(s.getsockname()[0])'
}

ray_node() {  # ray_node head|worker INDEX [HEAD_ADDRESS]: one Ray node, in the foreground
  local ip k
  ip=$(node_ip) || return 1
  # Nodes that share a host (virtual nodes) need their own agent ports.
  k=$((NODE_PORT_BASE + 4 * ($2 % 22)))
  local args=(--node-ip-address="$ip" --num-cpus="${SLURM_CPUS_ON_NODE:-1}"
    --num-gpus="$NUM_GPUS_PER_NODE" --min-worker-port="$MIN_WORKER_PORT"
    --max-worker-port="$MAX_WORKER_PORT" --dashboard-agent-listen-port="$k"
    --dashboard-agent-grpc-port="$((k + 1))" --metrics-export-port="$((k + 2))"
    --runtime-env-agent-port="$((k + 3))" --disable-usage-stats --block)
  if [ "$1" = head ]; then
    exec "$PYTHON" -m ray.scripts.scripts start --head --port="$GCS_PORT" \
      --dashboard-port="$DASHBOARD_PORT" --include-dashboard="$INCLUDE_DASHBOARD" \
      --ray-client-server-port="$CLIENT_SERVER_PORT" --temp-dir="$RAY_TEMP_DIR" "${args[@]}"
  fi
  exec "$PYTHON" -m ray.scripts.scripts start --address="$3" "${args[@]}"
}
export -f node_ip ray_node

stop_ray() {  # only what this allocation started: its address file, its own srun steps
  trap - EXIT TERM INT
  echo "stopping this allocation's Ray (srun steps ${STEP_PIDS[*]})" >&2
  # First, while there is time (Slurm sends KILL KillWait seconds after TERM): a stale
  # address must never outlive the cluster. Only if it is still ours.
  if [ -n "$ADDRESS" ] && [ "$(cat -- "$ADDRESS_FILE" 2>/dev/null)" = "$ADDRESS" ]; then
    rm -f -- "$ADDRESS_FILE"
  fi
  local pid
  for pid in "${STEP_PIDS[@]}" $WATCH_PID; do kill -TERM "$pid" 2>/dev/null; done
  wait
}
trap stop_ray EXIT
trap 'exit 143' TERM INT

on_node() {  # on_node NODE CMD...: one srun step on NODE, in the background
  srun --nodes=1 --ntasks=1 --nodelist="$1" --overlap --kill-on-bad-exit=1 "${@:2}" &
  STEP_PIDS+=("$!")
}

HEAD_IP=$(node_ip) || exit 1
ADDRESS="$HEAD_IP:$GCS_PORT"
# The slot must be free on the head node before `ray start` (which fails late on a taken
# port); exit 75 tells the launcher to submit again on the next slot. Of the worker range
# only its ends, as the local launcher checks (tasks/local_ray.py): Ray skips a taken worker
# port, and on a busy node some of 200 ports in the ephemeral range are always some
# connection's local port, so checking every one failed every slot.
"$PYTHON" -m milepost.slurm.port_check "$GCS_PORT" "$DASHBOARD_PORT" "$CLIENT_SERVER_PORT" \
  "$NODE_PORT_BASE-$((NODE_PORT_BASE + 3))" "$MIN_WORKER_PORT" "$MAX_WORKER_PORT" || exit $?
on_node "${NODES[0]}" bash -c 'ray_node head 0'
for _ in $(seq "$JOIN_TIMEOUT_S"); do
  (exec 3<>"/dev/tcp/$HEAD_IP/$GCS_PORT") 2>/dev/null && break
  kill -0 "${STEP_PIDS[0]}" 2>/dev/null || { echo "Ray head exited during start-up" >&2; exit 1; }
  sleep 1
done
for i in $(seq 1 $((${#NODES[@]} - 1))); do
  on_node "${NODES[$i]}" bash -c 'ray_node worker "$1" "$2"' _ "$i" "$ADDRESS"
done
# In the background, so that a TERM (scancel) is trapped at once instead of after it.
"$PYTHON" -m milepost.slurm.ray_join --address "$ADDRESS" --num-nodes "${#NODES[@]}" \
  --timeout-s "$JOIN_TIMEOUT_S" --publish "$ADDRESS_FILE" &
JOIN_PID=$!
# A node whose step exits while the cluster forms (its raylet never registered, the node
# went down) will never join: fail now, not after JOIN_TIMEOUT_S, so the launcher retries.
while kill -0 "$JOIN_PID" 2>/dev/null; do
  for pid in "${STEP_PIDS[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$JOIN_PID" 2>/dev/null
      echo "a Ray node's srun step exited before every node joined; stopping the allocation" >&2
      exit 1
    fi
  done
  sleep 1
done
wait "$JOIN_PID" || { echo "not every Ray node joined in ${JOIN_TIMEOUT_S}s" >&2; exit 1; }
echo "Ray cluster of ${#NODES[@]} nodes up at $ADDRESS"
# Hold the allocation until it is cancelled, a Ray node dies, or no run has held the
# campaign's lease for ORPHAN_GRACE_S (its driver was killed and teardown never came:
# milepost.tasks.lease_watch exits 0). A watch that fails is logged and dropped, never a
# reason to stop a cluster in use.
if [ -n "$CAMPAIGN_URL" ]; then
  "$PYTHON" -m milepost.tasks.lease_watch --campaign "$CAMPAIGN_URL" --grace-s "$ORPHAN_GRACE_S" \
    ${WATCH_ARMED:+--armed} &
  WATCH_PID=$!
fi
while true; do
  wait -n "${STEP_PIDS[@]}" $WATCH_PID
  rc=$?
  if [ -z "$WATCH_PID" ] || kill -0 "$WATCH_PID" 2>/dev/null; then break; fi
  if [ "$rc" -eq 0 ]; then
    echo "no run holds campaign $CAMPAIGN_URL's lease; stopping the allocation" >&2
    exit 0
  fi
  echo "the lease watch exited with status $rc; holding the allocation without it" >&2
  WATCH_PID=""
done
echo "a Ray node exited; stopping the allocation" >&2
exit 1
"""
