# The RL loop's packages on the lent GPU machine (the device tool). Nothing can be downloaded
# there and a call carries at most 64 MiB, which Ray's and sglang-router's wheels overflow
# together (81 MB), so:
#   one call  (carry .gpu-pack):           source bench/device_loop_env.sh pack && python3 bench/...
#             .gpu-pack/wheels.tar.xz (bench/device_pack.sh) holds every wheel unpacked and
#             xz-compressed (52 MB); each wheel is rebuilt here, stored, and installed.
#   two calls (carry .loop-a .gpu-wheels, then .loop-b .gpu-wheels on the still-warm machine):
#             source bench/device_loop_env.sh a;  source bench/device_loop_env.sh b && python3 bench/...
# .loop-a: ray 2.60.0 (cp312, ray/jars removed), megatron-core 0.16.1 (cp312).
# .loop-b: sglang-router 0.3.2 and the small packages Ray, the router and milepost import.
# `bash bench/device_wheels.sh` (here, with network) fills the wheel folders.
part=${1:?pack, a or b}
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
if [ "$part" = pack ]; then
  rm -rf /tmp/pack-src /tmp/pack-wheels && mkdir -p /tmp/pack-src /tmp/pack-wheels
  tar -xJf .gpu-pack/wheels.tar.xz -C /tmp/pack-src || return 1
  python3 - <<'PY' || return 1
import os, zipfile
src, out = "/tmp/pack-src", "/tmp/pack-wheels"
for name in sorted(os.listdir(src)):  # each folder is one wheel's members, named after the wheel
    with zipfile.ZipFile(os.path.join(out, name), "w", zipfile.ZIP_STORED) as wheel:
        root = os.path.join(src, name)
        for folder, _, files in os.walk(root):
            for f in files:
                path = os.path.join(folder, f)
                wheel.write(path, os.path.relpath(path, root))  # keeps each member's mode
PY
  install /tmp/pack-wheels/*.whl || return 1
  rm -rf /tmp/pack-src /tmp/pack-wheels
elif [ "$part" = a ]; then
  install .loop-a/*.whl .gpu-wheels/*.whl || return 1
  echo "installed part a into /tmp/site"; return 0
else
  [ -d /tmp/site/ray ] || { echo "part a is missing: the machine was not warm (run part a again)"; return 1; }
  install .loop-b/*.whl || return 1
fi
for piece in core tasks slurm dags; do ln -sfn "../$piece" "milepost/$piece"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
python3 -c "import ray, megatron.core, sglang_router, milepost.tasks.stage; print('ray', ray.__version__)"
