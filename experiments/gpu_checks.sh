#!/usr/bin/env bash
# The accelerator checks of issue #28 items 4-6 (decode fixed cost, learner MFU, weight push in
# s/GB), then issues #10 (sampler) and #11 (learner), as one script for one GPU (or TPU) host,
# under 8 minutes in all (BUDGET_S=450: a step's limit is cut to what is left; later steps are
# skipped). Each step has its own time limit; every step's JSON and log lands in $OUT
# (default ./gpu_checks_out). Run from the repository root:
#
#   OUT=/tmp/gpu_out bash experiments/gpu_checks.sh
#
# Needs jax with an accelerator backend, flax, optax, orbax, numpy, absl, safetensors, pytest.
#
# CPU=1 runs the same steps on CPU with reduced shapes (a dry run of the script itself: the
# decode attribution from the compiled program, the tiny TPU compiles when libtpu is installed,
# a 4-slot Qwen3 decode, the weight push on one CPU device, a tiny learner step):
#
#   CPU=1 OUT=/tmp/cpu_out bash experiments/gpu_checks.sh
set -u
CPU=${CPU:-0}
OUT=${OUT:-gpu_checks_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${secs}s): $*" | tee -a "$OUT/summary.txt"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "rc=$rc wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
  grep -E '^\{' "$OUT/$name.log" | tail -1 >> "$OUT/results.jsonl"
  tail -3 "$OUT/$name.log" | cut -c1-400
}

{ date -u; nvidia-smi -L 2>/dev/null; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } \
  > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-450}  # the whole script stays under 8 minutes: later steps are skipped
budget_left() { echo $(( BUDGET_S - ($(date +%s) - T_START) )); }
run() {  # run NAME SECONDS COMMAND...: a step, its limit cut to what is left of the budget
  local name=$1 secs=$2 left; shift 2
  left=$(budget_left)
  if [ "$left" -lt 20 ]; then
    echo "=== $name skipped: ${BUDGET_S}s budget spent" | tee -a "$OUT/summary.txt"; return
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  step "$name" "$secs" "$@"
}
if [ "$CPU" = 1 ]; then
  PRESET_ARGS="--preset_slots=4"
  PUSH_ARGS="--models=qwen3-0.6b --warmup=1 --repeats=1"
  LEARNER_ARGS="--model=tiny --seq_len=256 --batch_size=4 --micro_batch_rows=4"
else
  PRESET_ARGS=""
  PUSH_ARGS="--models=qwen3-0.6b,llama-3.2-1b --warmup=1 --repeats=3"
  LEARNER_ARGS="--model=qwen3_0p6b --seq_len=2048 --batch_size=16 --micro_batch_rows=8"
fi

# Issue #28, items 4-6 first (goals: <= 1.5 ms/step at 8 slots and >= 0.35 of the HBM roofline
# at 256 slots; MFU >= 0.30; weight push <= 0.12 s/GB).
# Item 4: kernels per decode step, sorts and converts, read from the compiled program.
if [ "$CPU" = 1 ]; then ATTR_IMPL=reference; else ATTR_IMPL=${ATTR_IMPL:-pallas_gpu}; fi
run decode_attribution 60 python3 experiments/decode_attribution.py --preset=qwen3-0.6b --slots=8 \
  --attention_impl=$ATTR_IMPL
if [ "$CPU" = 1 ]; then
  run decode_attribution_top_p 60 python3 experiments/decode_attribution.py \
    --preset=qwen3-0.6b --slots=8 --top_p=0.9
  # Items 1+3: the tiny programs compiled for a TPU topology (skipped without libtpu).
  if python3 -c 'import libtpu' 2>/dev/null; then
    run aot_tiny 240 python3 experiments/aot_compile.py --topology=v5e:2x2 --model=tiny \
      --slots=8 --num_pages=256 --max_seq_len=256 --seq_len=64 --micro_batch_rows=4 \
      --attention_block_len=32 --learner_mesh=fsdp:4
  fi
fi
# Item 4: Qwen3-0.6B decode at 8 and 256 slots, then 8 slots with the while-loop body as CUDA
# graphs (XLA command buffers): the fixed cost per step with and without launches.
if [ "$CPU" = 1 ]; then
  run preset_qwen3_s8 90 python3 experiments/bench_sampler.py --preset=qwen3-0.6b $PRESET_ARGS
else
  run preset_qwen3_s8 80 python3 experiments/bench_sampler.py --preset=qwen3-0.6b --preset_slots=8
  run preset_qwen3_s256 80 python3 experiments/bench_sampler.py --preset=qwen3-0.6b \
    --preset_slots=256
  run preset_qwen3_s8_cmdbuf 80 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" \
    python3 experiments/bench_sampler.py --preset=qwen3-0.6b --preset_slots=8
fi
# Item 6: weight push in s/GB on this host's own devices (one GPU: learner and sampler share
# it); 8B predicted from the rate.
run weight_push 60 python3 experiments/bench_weight_push.py --accelerator $PUSH_ARGS
# Item 5: learner MFU at the Qwen3-0.6B shape, bf16 compute, fp32 master params and Adam.
run learner_mfu 120 python3 experiments/bench_learner.py $LEARNER_ARGS --mesh=fsdp:1 \
  --compute_dtype=bfloat16 --remat=full --logits_chunk_len=256 --attention_block_len=512 \
  --steps=3 --warmup=1 --skip_memory --skip_collectives
# The same with JAX's Pallas flash kernel for training attention (on TPU it cut the compiled
# step's bytes by 47% at this shape).
if [ "$CPU" != 1 ]; then
  run learner_mfu_flash 120 python3 experiments/bench_learner.py $LEARNER_ARGS --mesh=fsdp:1 \
    --compute_dtype=bfloat16 --remat=full --logits_chunk_len=256 --attention_block_len=512 \
    --attention_impl=flash --steps=3 --warmup=1 --skip_memory --skip_collectives
fi
if [ "$CPU" = 1 ]; then
  echo "CPU=1: accelerator-only steps skipped; $(( $(date +%s) - T_START ))s" | tee -a "$OUT/summary.txt"
  exit 0
fi

# Issue #10 extras, while the budget lasts: Pallas kernels natively vs the jnp reference, the
# Llama-3.2-1B decode, the scaling suite.
run kernels 40 python3 experiments/bench_sampler.py --suite=kernels
run kernel_tests 40 env JAX_PLATFORMS= python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/sampler/test_kernels.py
run preset_llama32 60 python3 experiments/bench_sampler.py --preset=llama-3.2-1b
run scaling 60 python3 experiments/bench_sampler.py --suite=scaling
echo "done in $(( $(date +%s) - T_START ))s (budget ${BUDGET_S}s)" | tee -a "$OUT/summary.txt"
