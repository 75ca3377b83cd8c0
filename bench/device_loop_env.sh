# The RL loop's packages on the lent GPU machine (the device tool), in two calls: Ray's wheel
# alone is over one call's 64 MiB, so it travels without its Java jars (ray/jars, unused by
# Python) and the rest follows in a second call while the machine is still warm (30 s).
#   call 1 (carry .loop-a .gpu-wheels):  source bench/device_loop_env.sh a
#   call 2 (carry .loop-b .gpu-wheels):  source bench/device_loop_env.sh b && python3 bench/...
# .loop-a: ray 2.60.0 (cp312, ray/jars removed), megatron-core 0.16.1 (cp312).
# .loop-b: sglang-router 0.3.2 and the small packages Ray, the router and milepost import.
# `bash bench/device_wheels.sh` (here, with network) fills both, and .gpu-wheels.
part=${1:?a or b}
if [ "$part" = a ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .loop-a/*.whl .gpu-wheels/*.whl || return 1
  echo "installed part a into /tmp/site"; return 0
fi
[ -d /tmp/site/ray ] || { echo "part a is missing: the machine was not warm (run part a again)"; return 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .loop-b/*.whl || return 1
for piece in core tasks slurm dags; do ln -sfn "../$piece" "milepost/$piece"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -c "import ray, megatron.core, sglang_router, milepost.tasks.stage; print('ray', ray.__version__)"
