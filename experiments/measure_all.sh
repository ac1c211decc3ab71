#!/usr/bin/env bash
# The measurements of issue #13, in order, for a quiet machine (each prints one JSON line; the
# lead moves the numbers into WORKSPACE_NOTES.md with the date and the machine's load).
#   bash experiments/measure_all.sh [OUT]          (OUT defaults to runs/measure)
# Expect ~30-60 minutes on 2 idle CPU cores. Run from the repository root.
set -euo pipefail
OUT=${1:-runs/measure}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
date | tee "$OUT/date.txt"; uptime | tee "$OUT/load_before.txt"

# 1. Honest driver comparison: threaded runs in fresh processes (compile_s apart, steady state),
#    one cost model fitted to their timed operations ($OUT/drivers/cost_fit.json), virtual clock
#    and simulator against the measurements, accelerator prediction (8B on 8 H200s).
python3 experiments/bench_pipeline.py --suite=drivers --out_dir="$OUT/drivers" \
  --config.pipeline.num_steps=20 --config.pipeline.eval_problems=32 --steady_warmup_steps=4 \
  | tail -1 | tee "$OUT/drivers.json"

# 2. Control plane at 10k live groups (admission, retirement, learner host work, timeline).
python3 experiments/bench_pipeline.py --suite=control_plane | tail -1 | tee "$OUT/control_plane.json"

# 3. README command 1 with the measured cost model on the virtual clock (replaces the hand-set
#    clock's device time of the notebook).
python3 experiments/pipeline_rl.py --config.run_dir="$OUT/readme_cmd1" \
  --config.pipeline.cost_model_file="$OUT/drivers/cost_fit.json" | tail -1 | tee "$OUT/readme_cmd1.json"

# 4. Device-time comparison to a target accuracy with the measured cost model.
python3 experiments/bench_pipeline.py --suite=accuracy --out_dir="$OUT/accuracy" \
  --config.pipeline.num_steps=16 --config.pipeline.eval_every=2 \
  --config.pipeline.cost_model_file="$OUT/drivers/cost_fit.json" --target_accuracy=0.6 \
  | tail -1 | tee "$OUT/accuracy.json"

# 5. Cluster what-if on the analytic model (no measurement: predictions from chip specs).
python3 experiments/sim_whatif.py --png="$OUT/whatif.png" | tail -1 | tee "$OUT/whatif.json"
uptime | tee "$OUT/load_after.txt"
