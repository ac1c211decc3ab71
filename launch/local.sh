#!/usr/bin/env bash
# Starts the RL job on this machine. Extra arguments are passed to experiments/pipeline_rl.py.
#   launch/local.sh                               # defaults (8 virtual CPU devices, 4 + 4)
#   launch/local.sh --config.pipeline.driver=sync --config.pipeline.num_steps=20
#                                                 # any --config override of pipeline_rl.py
#   RUN_DIR=runs/exp1 launch/local.sh --config.resume    # continue a killed run
# On a GPU/TPU host JAX uses the accelerators; size the split with --config.sampler_mesh_axes
# and --config.learner.mesh_axes (their device counts must not exceed the devices found).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 experiments/pipeline_rl.py --config.run_dir="${RUN_DIR:-runs/pipeline_rl}" "$@"
