#!/usr/bin/env bash
# The L-ablation drafters of configs/eval_smollm2.py: SmolLM2-135M drafters with
# L draft layers, trained with the shipped drafter's recipe and step budget.
# The largest L runs first and its clean deep-layer K/V cache serves the others
# (train.deep_kv_dir), so the target's clean pass over the data runs once.
#
# usage: bash launch/train_ablation.sh [L ...]     (default: 8 6 2; the shipped one is L=4)
# env:   FLEXDRAFT_RUNS=DIR  runs root (default ../runs): regenerated data is read from
#                            DIR/regen/smollm2_135m, drafters go to DIR/smollm2_135m_L<n>
#        STEPS=N             training steps (default 400, the shipped drafter's best step)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${FLEXDRAFT_RUNS:-$(cd .. && pwd)/runs}"
layers=("$@")
[ ${#layers[@]} -gt 0 ] || layers=(8 6 2)
IFS=$'\n' layers=($(sort -rn <<<"${layers[*]}")); unset IFS
for n in "${layers[@]}"; do
  echo "== L=$n -> $RUNS/smollm2_135m_L$n"
  python -m flexdraft_jax train --config configs/smollm2_135m.py \
    --config.drafter.num_layers="$n" --config.train.num_steps="${STEPS:-400}" \
    --config.train.deep_kv_dir="$RUNS/deep_kv_smollm2_135m" \
    --workdir "$RUNS/smollm2_135m_L$n"
done
