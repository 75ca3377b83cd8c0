#!/usr/bin/env bash
# Packs every wheel the RL loop needs on the lent GPU machine into ONE carry that fits a call's
# 64 MiB, so one device call installs and runs the loop (no second call racing the machine's
# 30 s idle release). Wheels are zip files of individually deflated members; unpacked and
# compressed together with xz they shrink from 81 MB to about 52 MB (Ray's binaries compress
# far better as one stream). Run here after `bash bench/device_wheels.sh`, from the repository root:
#   bash bench/device_pack.sh          # writes .gpu-pack/wheels.tar.xz (about 2 min)
# On the device: `source bench/device_loop_env.sh pack` (carry .gpu-pack) rebuilds each wheel
# (stored, not deflated) and installs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for wheel in .loop-a/*.whl .loop-b/*.whl .gpu-wheels/*.whl; do
  mkdir "$stage/$(basename "$wheel")"
  unzip -q "$wheel" -d "$stage/$(basename "$wheel")"  # unzip keeps the members' modes (raylet, gcs_server)
done
mkdir -p .gpu-pack
tar -cf - -C "$stage" . | xz -9e -T2 > .gpu-pack/wheels.tar.xz.tmp
mv .gpu-pack/wheels.tar.xz.tmp .gpu-pack/wheels.tar.xz
du -sh .gpu-pack/wheels.tar.xz
