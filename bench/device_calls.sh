# The GPU figures of issues 18 and 21, each call self-contained (carry .gpu-pack only:
# bench/device_pack.sh; bench/device_loop_env.sh installs it). Each step has its own time limit
# and writes under $OUT, so a step that fails or runs long leaves the others' results.
# CALL_LIMIT_S (default 575) bounds a call.
#   source bench/device_calls.sh arith     gpu-arith end to end (build, 2 blocks, a kill and resume)
#   source bench/device_calls.sh figures   training: bf16 and fp8 side by side (env: FP8_RECIPES, FP8_LR_ALSO, FP8_GPU_TESTS,
#                                          FP8_CASTS, IPC_3GB)
#   source bench/device_calls.sh sync      the CUDA-format GPU tests, the CUDA-IPC push mechanism, GPU weight sync over HTTP
#                                          (on a two-GPU kind, e.g. nvidia-h100-x2, also NCCL to an engine on the second GPU);
#                                          SYNC_ROLLOUT=1: rollout precision too; SYNC_MECHANISM_ONLY=1: the tests,
#                                          bench/cuda_ipc_sync.py and megatron_stage.py only (~170 s with the install);
#                                          SYNC_3GB_ONLY=1: cuda_ipc_sync at the 3.4 GB size only (~130 s)
#   source bench/device_calls.sh tests     the GPU tests, warm-start speed
#   source bench/device_calls.sh tensor    gpu-arith's first block alone, no kill (~250 s; the recipe pushes over CUDA IPC)
#   source bench/device_calls.sh pending   what was built and not yet run on a GPU (~200 s)
#   source bench/device_calls.sh fp8       issue 21's training figures in one call (~500 s)
# Everything a call writes comes back in $OUT/results.tgz (and $OUT/steps.txt).
call=${1:?arith, figures, fp8, sync, tensor, pending or tests}
SECONDS=0
left() { echo $(( ${CALL_LIMIT_S:-575} - SECONDS )); }
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
  local name=$1 limit=$2; shift 2
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt 30 ]; then echo "$name: skipped, $(left) s left" | tee -a "$OUT/steps.txt"; return; fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc $? after ${SECONDS} s (limit ${limit} s)" | tee -a "$OUT/steps.txt"
}
source bench/device_loop_env.sh pack || return 1
echo "installed after ${SECONDS} s" | tee -a "$OUT/steps.txt"
{ date -u; nvidia-smi -L; } > "$OUT/machine.txt"
if [ "$call" = arith ]; then
  # ~10 s: which packed-attention kernel this torch gives megatron, and its speed against the old loop
  step packed_attention 40 python3 bench/packed_attention.py --out "$OUT/packed_attention_gpu.txt"
  step gpu_arith $(( $(left) - 5 )) python3 bench/gpu_arith.py --campaign /tmp/gpu-arith-campaign
  tail -n 30 "$OUT/gpu_arith.log"
elif [ "$call" = figures ]; then
  # each mode in its own process (bench/fp8_training.py): mb=4 fits an 80 GB H100 (bf16 peak 49 GiB);
  # bf16 and fp8 side by side in one run (the ratio): ~90 s a mode. int4_qat (fp32
  # parameters) ran out of memory at mb=4 on an 80 GB H100 (2026-12-06): add it with
  # FP8_ARGS="--other-modes int4_qat --other-mb 1" (its own micro-batch; tokens/s stays comparable).
  # FP8_LR_ALSO: the same pair again at that lr (is the NLL gap fp8's rounding of small updates?);
  # FP8_GPU_TESTS: then the fp8 and packed-attention GPU tests.
  fp8() {  # fp8 NAME LIMIT ARGS...: one run of the bench, bf16 and FP8_RECIPES side by side
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/fp8_training.py \
        --variant fuse=1,mb=4 --fp8-recipes "${FP8_RECIPES:-tensorwise-fast}" --out "$OUT/$name.txt" "$@"
  }
  # FP8_ARGS: more bench arguments (e.g. --steps 30); FP8_NO_PROFILE: no profiled step (it costs ~20 s a mode)
  profile=(--profile "$OUT/fp8_profile.txt"); [ -n "${FP8_NO_PROFILE:-}" ] && profile=()
  # shellcheck disable=SC2086  # FP8_ARGS is split on purpose
  fp8 fp8_training $(( $(left) - ${AFTER_FP8_S:-10} )) "${profile[@]}" ${FP8_ARGS:-}
  [ -n "${FP8_LR_ALSO:-}" ] && fp8 fp8_training_lr "$(( $(left) - ${AFTER_LR_S:-10} ))" --lr "$FP8_LR_ALSO"
  [ -n "${FP8_GPU_TESTS:-}" ] && step gpu_tests 150 python3 -m pytest -q -m gpu ${FP8_GPU_TESTS/#1/tests/gpu/test_fp8_linear_gpu.py \
      tests/gpu/test_packed_attention_gpu.py} -s
  # FP8_CASTS: one tensorwise cast in both layouts, the library's against other compilations of it
  [ -n "${FP8_CASTS:-}" ] && step fp8_casts 100 python3 bench/fp8_casts.py --out "$OUT/fp8_casts_gpu.txt"
  # the CUDA-IPC push at the 1.7 B shape (issue 18)
  [ -n "${IPC_3GB:-}" ] && step cuda_ipc_sync_3gb 80 python3 bench/cuda_ipc_sync.py --params-gb 3.4 --bucket-mb 1024 \
      --pushes 6 --out "$OUT/cuda_ipc_sync_3gb.txt"
elif [ "$call" = sync ]; then
  # the CUDA format's kept plans, the engine's packed weights and its memory release, first (correctness)
  step gpu_sync_tests 120 python3 -m pytest -q -m gpu tests/gpu/test_cuda_buffers_gpu.py tests/gpu/test_engine_gpu.py -s
  # the mechanism without HTTP at the 1.7 B and the 0.5 B shapes (the figure: the 1.7 B one)
  step cuda_ipc_sync_3gb 160 python3 bench/cuda_ipc_sync.py --params-gb 3.4 --bucket-mb 1024 --pushes 6 \
      --out "$OUT/cuda_ipc_sync_3gb.txt"
  # Megatron's staging at TP=1: copies against views of the parameters, each whole push timed (~30 s)
  step megatron_stage 60 python3 bench/megatron_stage.py --out "$OUT/megatron_stage_gpu.txt"
  [ -z "${SYNC_3GB_ONLY:-}" ] && step cuda_ipc_sync 100 python3 bench/cuda_ipc_sync.py --pushes 6 --out "$OUT/cuda_ipc_sync.txt"
  if [ -z "${SYNC_MECHANISM_ONLY:-}" ]; then  # SYNC_MECHANISM_ONLY=1: the tests and cuda_ipc_sync only (~150 s)
    # the trainer's copy into bucket buffers, by the ways there are (issue 18: most of a copied push)
    step bucket_fill 45 python3 bench/bucket_fill.py --out "$OUT/bucket_fill_gpu.txt"
    step gpu_weight_sync 100 python3 bench/gpu_weight_sync.py --out "$OUT/gpu_weight_sync.txt"
  fi
  if [ -n "${SYNC_ROLLOUT:-}" ]; then
    step rollout_precision 90 python3 bench/rollout_precision.py
    cp bench/results/rollout_precision_gpu.* "$OUT/" 2>/dev/null
  fi
elif [ "$call" = tensor ]; then
  # ~250 s: gpu-arith's first block (one epoch of 1,280 prompts) with the loop's own weight push over
  # CUDA IPC (colocated, Megatron's layout; the recipe's transport), no kill. Its $OUT/gpu_arith.json is
  # a one-block run with no kill: keep it as its own result file, never as bench/results/gpu_arith.json
  # (gpu_summary.py's source: `arith`'s two blocks with a kill)
  step gpu_arith_tensor $(( $(left) - 5 )) python3 bench/gpu_arith.py --campaign /tmp/gpu-arith-tensor \
      --set sync.transport=tensor --set campaign.num_blocks=1 --set data.num_train_rows=1280 --no-kill
  tail -n 30 "$OUT/gpu_arith_tensor.log"
elif [ "$call" = fp8 ]; then
  # issue 21 in one call (~500 s): the fp8 GPU tests; bf16 beside tensorwise-fast at micro-batch 4 on random
  # tokens, 30 steps, profiled (comparable with runs 1-8); then micro-batch FP8_MB (default 8, 16 on an H200) on arithmetic
  # text, 50 steps, a new batch each step (the loss curve), with int4_qat beside it at micro-batch 4.
  # FP8_TESTS=0 / FP8_MB4=0 / FP8_INT4=0 leave those out; FP8_PROFILE=1 profiles the second run too;
  # FP8_STEPS: its steps (default 50); FP8_ARITH_RECIPES: its fp8 recipes (default tensorwise-fast;
  # bench/fp8_training.py names, each with +edgeN); FP8_OTHER: its other modes instead of int4_qat
  # (e.g. bf16@mb4, bf16's own noise floor).
  # FP8_TESTS_K: only the GPU tests whose names match (pytest -k); FP8_TESTS_ALSO: other GPU test files, whole
  [ "${FP8_TESTS:-1}" != 0 ] && step gpu_tests 100 python3 -m pytest -q -m gpu tests/gpu/test_fp8_linear_gpu.py -s \
      ${FP8_TESTS_K:+-k "$FP8_TESTS_K"}
  [ -n "${FP8_TESTS_ALSO:-}" ] && step gpu_tests_also 60 python3 -m pytest -q -m gpu $FP8_TESTS_ALSO
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  [ "${FP8_MB4:-1}" != 0 ] && step fp8_mb4 200 python3 bench/fp8_training.py --variant fuse=1,mb=4 \
      --fp8-recipes tensorwise-fast --steps 30 --profile "$OUT/fp8_profile_mb4.txt" --out "$OUT/fp8_mb4.txt"
  # micro-batch 16 (one micro-batch a step: half the host's launches) where it fits: an H200's 139 GiB, not
  # an H100's 80 (bf16 peaks at 69 GiB at 8)
  big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print ($1 > 100000)}')
  mb=${FP8_MB:-$([ "$big" = 1 ] && echo 16 || echo 8)} more=()
  if [ -n "${FP8_OTHER:-}" ]; then more+=(--other-modes "$FP8_OTHER" --other-steps 50)
  elif [ "${FP8_INT4:-1}" != 0 ]; then more+=(--other-modes int4_qat --other-mb 4 --other-steps 50); fi
  [ -n "${FP8_PROFILE:-}" ] && more+=(--profile "$OUT/fp8_profile_mb$mb.txt")
  step "fp8_mb${mb}_arith" $(( $(left) - 5 )) python3 bench/fp8_training.py --variant "fuse=1,mb=$mb" \
      --fp8-recipes "${FP8_ARITH_RECIPES:-tensorwise-fast}" --data arith --batches 50 --steps "${FP8_STEPS:-50}" "${more[@]}" --time-budget-s $(( $(left) - 25 )) --out "$OUT/fp8_mb${mb}_arith.txt"
elif [ "$call" = pending ]; then
  # what was built and not yet timed on a GPU; now only a rerun of the Megatron checkpoint against a
  # raw write (~90 s with Ray's start; 12-07: bench/results/checkpoint_write_gpu.txt)
  step checkpoint_write 150 python3 bench/checkpoint_write.py --backend megatron --shape gpu-arith --rounds 3 \
      --out "$OUT/checkpoint_write_gpu.txt"
else
  step gpu_tests 150 python3 -m pytest -q -m gpu tests/gpu/test_fp8_linear_gpu.py tests/gpu/test_engine_gpu.py \
      tests/gpu/test_packed_attention_gpu.py \
      tests/gpu/test_cuda_buffers_gpu.py -s
  step warmstart_speed 150 python3 bench/warmstart_speed.py --out "$OUT/warmstart_speed_gpu.txt"
fi
tail -n 4 "$OUT"/*.log
cat "$OUT/steps.txt"
# A call brings back at most 8 files: everything but steps.txt travels as one archive.
tar -C "$OUT" --exclude steps.txt -czf /tmp/results.tgz . && find "$OUT" -mindepth 1 ! -name steps.txt -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
