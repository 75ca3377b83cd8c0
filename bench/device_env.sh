# Source on the lent GPU machine (the device tool), from the repository root:
#   source bench/device_env.sh WHEEL_DIR
# Installs the carried wheels into /tmp/site (nothing can be downloaded there) and makes the
# working tree importable as `milepost` (the package maps core/, tasks/, slurm/, dags/ into
# milepost.*, as pyproject's package-dir does), without building or installing it.
wheels=${1:-.gpu-wheels}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || return 1
for part in core tasks slurm dags; do ln -sfn "../$part" "milepost/$part"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, milepost.core.engine.server; print('torch', torch.__version__, torch.cuda.get_device_name())"
