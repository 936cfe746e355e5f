#!/usr/bin/env bash
# Tiny CPU run on mock data under torchrun (TP=2). Becomes the full Pseudo-to-Real recipe.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${DEMO_OUT:-demo_out}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
python -m torch.distributed.run --nproc-per-node 2 pretrain_m6.py \
    --tensor-model-parallel-size 2 --mock-data --vocab-size 512 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 30 --lr 3e-3 --lr-warmup-iters 3 \
    --log-interval 5 --log-file "$OUT/mock.jsonl"
