# The GPU figures of issues 18 and 21 in two device calls on one warm machine (see
# bench/device_loop_env.sh for why two). Each step has its own time limit and writes under
# $OUT, so a step that fails or runs long leaves the others' results; whatever time call 2
# has left after gpu-arith goes to bench/rollout_precision.py and bench/fp8_training.py (its
# table is rewritten after every line). CALL_LIMIT_S (default 575) bounds a call.
#   call 1 (carry .loop-a .gpu-wheels):  source bench/device_calls.sh 1
#   call 2 (carry .loop-b .gpu-wheels):  source bench/device_calls.sh 2
call=${1:?1 or 2}
SECONDS=0
left() { echo $(( ${CALL_LIMIT_S:-575} - SECONDS )); }
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt 30 ]; then echo "$name: skipped, $(left) s left" | tee -a "$OUT/steps.txt"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc $? after ${SECONDS} s (limit ${limit} s)" | tee -a "$OUT/steps.txt"
}
if [ "$call" = 1 ]; then
  source bench/device_loop_env.sh a || return 1
  for p in core tasks slurm dags; do ln -sfn "../$p" "milepost/$p"; done
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  { date -u; nvidia-smi -L; } > "$OUT/machine.txt"
  step gpu_tests 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_engine_gpu.py \
      tests/gpu/test_cuda_buffers_gpu.py -s
  step cuda_ipc_sync 60 python3 bench/cuda_ipc_sync.py --pushes 6
  cp bench/results/cuda_ipc_sync.txt "$OUT/" 2>/dev/null
  step gpu_weight_sync 100 python3 bench/gpu_weight_sync.py --out "$OUT/gpu_weight_sync.txt"
else
  source bench/device_loop_env.sh b || return 1
  step gpu_arith 560 python3 bench/gpu_arith.py --campaign /tmp/gpu-arith-campaign
  step rollout_precision 90 python3 bench/rollout_precision.py
  cp bench/results/rollout_precision_gpu.* "$OUT/" 2>/dev/null
  step fp8_training 600 python3 bench/fp8_training.py --fp8-recipes tensorwise,rowwise,rowwise-gw-bf16 \
      --out "$OUT/fp8_training.txt"
fi
tail -n 4 "$OUT"/*.log; cat "$OUT/steps.txt"
