#!/usr/bin/env bash
# One multi-process RL job on a Cloud TPU VM slice (issue #12), run from a workstation with
# gcloud. Every worker (host) of the slice runs experiments/pipeline_rl.py; JAX's Cloud TPU
# detection (jax.distributed.initialize with no arguments) reads the worker number and the
# workers' addresses from the instance metadata; worker 0 is the coordinator. Workers 0..K-1
# form the learner mesh; every other worker runs one sampler replica on its own chips.
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b launch/tpu_vm.sh setup    # code + pip install .[tpu]
#   TPU_NAME=my-v4-32 ZONE=us-central2-b launch/tpu_vm.sh run --config.pipeline.num_steps=200
#   TPU_NAME=... ZONE=... RUN_DIR=gs://bucket/runs/exp1 launch/tpu_vm.sh run --config.resume
#   TPU_NAME=... ZONE=... launch/tpu_vm.sh stop                     # end a run on every worker
#
# Arguments after `run` go to experiments/pipeline_rl.py: a --config=<file>:<preset> first, the
# overrides after the ones set here (so they win).
# Environment:
#   TPU_NAME, ZONE          the TPU VM slice (required); PROJECT optional (gcloud's default)
#   NUM_LEARNER_PROCESSES   K, workers forming the learner mesh (default 1)
#   CHIPS_PER_HOST          devices of one worker (default 4: v4, v5e and v5p hosts)
#   RUN_DIR                 run directory; with K > 1 it must be shared by the learner workers
#                           (a gs:// bucket, which orbax writes directly, or an NFS mount).
#                           Default runs/tpu_vm (on worker 0's disk, enough for K = 1)
#   REMOTE_DIR              where the code lives on the workers (default ~/rlax_pipe)
#   LEARNER_MESH, SAMPLER_MESH   override the meshes set here (default: fsdp over all learner
#                           chips; tp over one worker's chips)
#   GCLOUD                  the gcloud command (default gcloud)
set -euo pipefail
cd "$(dirname "$0")/.."

CMD="${1:-}"
shift || true
: "${TPU_NAME:?set TPU_NAME to the TPU VM slice}"
: "${ZONE:?set ZONE to the slice zone}"
GCLOUD="${GCLOUD:-gcloud}"
REMOTE_DIR="${REMOTE_DIR:-~/rlax_pipe}"
K="${NUM_LEARNER_PROCESSES:-1}"
CHIPS="${CHIPS_PER_HOST:-4}"
LEARNER_MESH="${LEARNER_MESH:-(('fsdp', $(( K * CHIPS ))),)}"
SAMPLER_MESH="${SAMPLER_MESH:-(('tp', $CHIPS),)}"
RUN_DIR="${RUN_DIR:-runs/tpu_vm}"
PROJECT_FLAG=()
[[ -n "${PROJECT:-}" ]] && PROJECT_FLAG=("--project=$PROJECT")

# `--config=<file>[:<preset>]` must come before any `--config.<field>` override: the caller's
# config file goes first, then the overrides set here, then the caller's overrides (which win).
CONFIG_FILE_ARGS=()
OVERRIDE_ARGS=()
split_config_args() {
  while (( $# )); do
    case "$1" in
      --config=*) CONFIG_FILE_ARGS+=("$1") ;;
      --config) CONFIG_FILE_ARGS+=("$1" "$2"); shift ;;
      *) OVERRIDE_ARGS+=("$1") ;;
    esac
    shift
  done
}

on_all_workers() {
  "$GCLOUD" compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" "${PROJECT_FLAG[@]}" \
    --worker=all --command="$1"
}

case "$CMD" in
  setup)
    archive="$(mktemp -d)/rlax_pipe.tar.gz"
    git archive --format=tar.gz -o "$archive" HEAD
    "$GCLOUD" compute tpus tpu-vm scp "$archive" "$TPU_NAME:rlax_pipe.tar.gz" --zone="$ZONE" \
      "${PROJECT_FLAG[@]}" --worker=all
    on_all_workers "mkdir -p $REMOTE_DIR && tar -xzf rlax_pipe.tar.gz -C $REMOTE_DIR && \
cd $REMOTE_DIR && python3 -m pip install -q -e '.[tpu]'"
    ;;
  run)
    # Quote every argument for the workers' shell.
    split_config_args "$@"
    args="$(printf '%q ' --num_learner_processes="$K" "${CONFIG_FILE_ARGS[@]}" \
      --config.pipeline.mode=threaded \
      "--config.learner.mesh_axes=$LEARNER_MESH" "--config.sampler_mesh_axes=$SAMPLER_MESH" \
      --config.run_dir="$RUN_DIR" "${OVERRIDE_ARGS[@]}")"
    echo "tpu_vm.sh: $TPU_NAME: workers 0..$(( K - 1 )) learner, the others sampler replicas" \
         "($CHIPS chips each); run dir $RUN_DIR (on worker 0)"
    on_all_workers "set -o pipefail; cd $REMOTE_DIR && python3 experiments/pipeline_rl.py $args \
2>&1 | tee ~/rlax_pipe_worker.log"
    ;;
  stop)
    on_all_workers "pkill -INT -f experiments/pipeline_rl.py || true"
    ;;
  *)
    echo "usage: TPU_NAME=... ZONE=... launch/tpu_vm.sh setup | run [pipeline_rl.py flags] | stop" >&2
    exit 2
    ;;
esac
