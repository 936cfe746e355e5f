#!/usr/bin/env bash
# One node of the m6_10t run on 64 nodes x 8 GPUs: `bash examples/m6_10t/launch.sh pseudo|real`
# with NNODES, NODE_RANK, MASTER_ADDR set (see examples/launch_node.sh). DATA_PATH, TOKENIZER_MODEL
# and CKPT_DIR point at the corpus, the tokenizer and the checkpoint root.
#   pseudo: trains the shared-parameter model, saving to $CKPT_DIR/pseudo
#   real:   resumes from $CKPT_DIR/real (make it first with
#           python tools/convert_checkpoint.py delink $CKPT_DIR/pseudo $CKPT_DIR/real --target-... per real.yaml)
set -euo pipefail
PHASE=${1:?usage: $0 pseudo|real}
HERE=$(cd "$(dirname "$0")" && pwd)
: "${DATA_PATH:?set DATA_PATH to the preprocessed corpus prefix}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model}"
: "${CKPT_DIR:?set CKPT_DIR to the checkpoint root}"
NNODES=${NNODES:-64} GPUS_PER_NODE=${GPUS_PER_NODE:-8} MAX_RESTARTS=${MAX_RESTARTS:-3} \
exec bash "$HERE/../launch_node.sh" "$HERE/model.yaml" "$HERE/$PHASE.yaml" -- \
    --data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL" \
    --save "$CKPT_DIR/$PHASE" --load "$CKPT_DIR/$PHASE" \
    --log-file "$CKPT_DIR/$PHASE.jsonl" --tensorboard-dir "$CKPT_DIR/tb_$PHASE" "${@:2}"
