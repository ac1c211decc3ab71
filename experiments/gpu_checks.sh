#!/usr/bin/env bash
# The accelerator checks of issues #10 (sampler) and #11 (learner), as one script for one GPU
# (or TPU) host. Each step has its own time limit; every step's JSON and log lands in $OUT
# (default ./gpu_checks_out). Run from the repository root:
#
#   OUT=/tmp/gpu_out bash experiments/gpu_checks.sh
#
# Needs jax with an accelerator backend, flax, optax, orbax, numpy, absl, safetensors, pytest.
#
# CPU=1 runs only what a machine without an accelerator can (issue #28: the decode step's
# kernel attribution from its compiled program, and the tiny TPU compiles when libtpu is
# installed), with reduced shapes, to check the script itself:
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

# #28 item 4: kernels per decode step, sorts and converts, read from the compiled program
# (top-p off, then on: the sort must appear only when asked for).
step decode_attribution 90 python3 experiments/decode_attribution.py --preset=qwen3-0.6b --slots=8
step decode_attribution_top_p 90 python3 experiments/decode_attribution.py --preset=qwen3-0.6b \
  --slots=8 --top_p=0.9
if [ "$CPU" = 1 ]; then
  # #28 items 1+3: the tiny programs compiled for a TPU topology (skipped without libtpu).
  if python3 -c 'import libtpu' 2>/dev/null; then
    step aot_tiny 300 python3 experiments/aot_compile.py --topology=v5e:2x2 --model=tiny \
      --slots=8 --num_pages=256 --max_seq_len=256 --seq_len=64 --micro_batch_rows=4 \
      --attention_block_len=32 --learner_mesh=fsdp:4
  fi
  echo "CPU=1: accelerator steps skipped" | tee -a "$OUT/summary.txt"
  exit 0
fi

# #10: Pallas kernels natively vs the jnp reference, then decode throughput + HBM roofline.
step kernels 60 python3 experiments/bench_sampler.py --suite=kernels
step kernel_tests 60 env JAX_PLATFORMS= python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/sampler/test_kernels.py
step preset_qwen3 110 python3 experiments/bench_sampler.py --preset=qwen3-0.6b
step preset_llama32 110 python3 experiments/bench_sampler.py --preset=llama-3.2-1b
# #28 item 4: the same Qwen3 decode with the while-loop body as CUDA graphs (XLA command
# buffers); compare its ms/step with preset_qwen3's.
step preset_qwen3_cmdbuf 110 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" \
  python3 experiments/bench_sampler.py --preset=qwen3-0.6b
# #11: learner MFU at a Qwen3-0.6B shape, bf16 compute, fp32 master params and Adam.
step learner_mfu 200 python3 experiments/bench_learner.py --model=qwen3_0p6b --mesh=fsdp:1 \
  --compute_dtype=bfloat16 --seq_len=2048 --batch_size=16 --micro_batch_rows=8 --remat=full \
  --logits_chunk_len=256 --attention_block_len=512 --steps=4 --warmup=1 --skip_memory \
  --skip_collectives
# #10 point 7 on an accelerator (the replica ratio needs 2 devices and reports so on one).
step scaling 150 python3 experiments/bench_sampler.py --suite=scaling
