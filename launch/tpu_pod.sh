#!/usr/bin/env bash
# Train and sweep a Qwen3 drafter (configs/qwen3_*.py) on a Cloud TPU VM slice.
# Untested here (no gcloud, no TPU): the commands follow the TPU VM docs.
#
# usage: [ENV=…] bash launch/tpu_pod.sh STEP…
#   create      create the TPU VM slice
#   setup       clone REPO_URL@BRANCH and install it (+ jax[tpu]) on every worker
#   data        copy the benchmark/prompt files (DATA_DIR) to every worker
#   regenerate  the target answers the training prompts (worker 0; generate is one host)
#   train       train the drafter on all workers (jax.distributed over the slice)
#   train-ablation  the same with L = 2, 4, 6, 8 draft layers (the sweep's ablation rows)
#   sweep       evaluation sweep on worker 0 (one chip holds an 8B target in bf16)
#   delete      delete the slice
# e.g.  REPO_URL=https://github.com/ORG/flexdraft_jax.git MODEL=qwen3_8b \
#       bash launch/tpu_pod.sh create setup data regenerate train sweep
#
# env (default):
#   TPU_NAME (flexdraft)  ZONE (us-central2-b)  PROJECT (gcloud's default)
#   ACCELERATOR (v4-32)   RUNTIME (tpu-ubuntu2204-base; v5p: v2-alpha-tpuv5)
#   REPO_URL (required by setup)  BRANCH (main)
#   MODEL (qwen3_8b): configs/$MODEL.py; TARGET_DIR: its HF checkpoint on every
#     worker (default $SHARED/models/<Qwen3-8B|Qwen3-4B|Qwen3-1.7B>)
#   SHARED (/mnt/shared): a directory every worker sees (Filestore/NFS or a gcsfuse
#     mount, set up beforehand); regenerated data, checkpoints and results go there
#   DATA_DIR (../shared/data): local benchmark files, copied by `data`
set -euo pipefail
cd "$(dirname "$0")/.."

TPU_NAME="${TPU_NAME:-flexdraft}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-32}"
RUNTIME="${RUNTIME:-tpu-ubuntu2204-base}"
BRANCH="${BRANCH:-main}"
MODEL="${MODEL:-qwen3_8b}"
SHARED="${SHARED:-/mnt/shared}"
DATA_DIR="${DATA_DIR:-../shared/data}"
case "$MODEL" in
  qwen3_8b) HF=Qwen3-8B ;; qwen3_4b) HF=Qwen3-4B ;; qwen3_1_7b) HF=Qwen3-1.7B ;;
  *) echo "MODEL must be qwen3_8b, qwen3_4b or qwen3_1_7b" >&2; exit 2 ;;
esac
TARGET_DIR="${TARGET_DIR:-$SHARED/models/$HF}"
RUN="$SHARED/runs/$MODEL"
GC=(--zone "$ZONE")
[ -n "${PROJECT:-}" ] && GC+=(--project "$PROJECT")

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

# remote WORKER SCRIPT: runs SCRIPT in the installed checkout on WORKER (0 or all).
remote() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC[@]}" --worker="$1" --command "
    set -euo pipefail
    . ~/venv/bin/activate && cd ~/flexdraft_jax
    export FLEXDRAFT_DATA=~/flexdraft_data FLEXDRAFT_RUNS='$SHARED/runs'
    $2"
}

# jax.distributed through the trainer's env: process id and worker list from
# the TPU VM metadata server, coordinator = worker 0.
DISTRIBUTED='MD=http://metadata.google.internal/computeMetadata/v1/instance/attributes
  EP=$(curl -sf -H Metadata-Flavor:Google $MD/worker-network-endpoints)
  export FLEXDRAFT_PROCESS_ID=$(curl -sf -H Metadata-Flavor:Google $MD/agent-worker-number)
  export FLEXDRAFT_NUM_PROCESSES=$(echo "$EP" | tr , "\n" | wc -l)
  export FLEXDRAFT_COORDINATOR=$(echo "$EP" | cut -d, -f1 | awk -F: "{print \$NF}"):8476'

ABLATION=""
for L in 2 4 6 8; do
  ABLATION+=" --config.ablation.layer_drafters.L$L='$RUN/train_L$L/best_drafter'"
done

[ $# -ge 1 ] || { usage; exit 2; }
for step in "$@"; do
  echo "== $step ($TPU_NAME, $ACCELERATOR, $MODEL)"
  case "$step" in
    create)
      gcloud compute tpus tpu-vm create "$TPU_NAME" "${GC[@]}" \
        --accelerator-type="$ACCELERATOR" --version="$RUNTIME" ;;
    setup)
      : "${REPO_URL:?set REPO_URL to the git URL of this repository}"
      gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GC[@]}" --worker=all --command "
        set -euo pipefail
        [ -d ~/flexdraft_jax ] || git clone -q '$REPO_URL' ~/flexdraft_jax
        cd ~/flexdraft_jax && git fetch -q origin && git checkout -q '$BRANCH' && git pull -q
        [ -x ~/venv/bin/python ] || python3 -m venv ~/venv
        . ~/venv/bin/activate && pip install -q -U pip && pip install -q -e . 'jax[tpu]'" ;;
    data)
      gcloud compute tpus tpu-vm scp --recurse "$DATA_DIR" "$TPU_NAME":flexdraft_data \
        "${GC[@]}" --worker=all ;;
    regenerate)
      remote 0 "python -m flexdraft_jax regenerate --config configs/$MODEL.py \
        --config.target='$TARGET_DIR' --config.data.regen_dir='$RUN/regen'" ;;
    train)
      remote all "$DISTRIBUTED
        python -m flexdraft_jax train --config configs/$MODEL.py \
          --config.target='$TARGET_DIR' --config.data.regen_dir='$RUN/regen' \
          --workdir '$RUN/train'" ;;
    train-ablation)
      for L in 2 4 6 8; do
        remote all "$DISTRIBUTED
          python -m flexdraft_jax train --config configs/$MODEL.py \
            --config.target='$TARGET_DIR' --config.data.regen_dir='$RUN/regen' \
            --config.drafter.num_layers=$L --workdir '$RUN/train_L$L'"
      done ;;
    sweep)  # ablation drafters not trained are skipped rows (with a note)
      remote 0 "python -m flexdraft_jax eval --config configs/eval_smollm2.py \
        --config.target='$TARGET_DIR' --config.dtype=bfloat16 \
        --config.drafter='$RUN/train/best_drafter' --config.random_drafter.allow=False \
        --config.eval.max_new_tokens=256 --config.eval.limit=80 $ABLATION \
        --workdir '$RUN/eval'" ;;
    delete)
      gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GC[@]}" --quiet ;;
    *) echo "unknown step $step" >&2; usage; exit 2 ;;
  esac
done
