#!/usr/bin/env bash
# One node of a P2R phase of an example run: `bash examples/launch_phase.sh EXAMPLE_DIR pseudo|real [FLAGS]`
# with NNODES, NODE_RANK, MASTER_ADDR set (see launch_node.sh). The example folder holds
# model.yaml, pseudo.yaml and real.yaml. DATA_PATH, TOKENIZER_MODEL and CKPT_DIR point at the
# corpus prefix, the tokenizer and the checkpoint root:
#   pseudo: trains the shared-parameter model into $CKPT_DIR/pseudo (restarts resume from it)
#   real:   resumes from $CKPT_DIR/real; make it first with
#           python tools/convert_checkpoint.py delink $CKPT_DIR/pseudo $CKPT_DIR/real --target-... (see real.yaml)
set -euo pipefail
EXAMPLE=${1:?usage: $0 EXAMPLE_DIR pseudo|real [FLAGS]}
PHASE=${2:?usage: $0 EXAMPLE_DIR pseudo|real [FLAGS]}
: "${DATA_PATH:?set DATA_PATH to the preprocessed corpus prefix}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model}"
: "${CKPT_DIR:?set CKPT_DIR to the checkpoint root}"
NNODES=${NNODES:-64} GPUS_PER_NODE=${GPUS_PER_NODE:-8} MAX_RESTARTS=${MAX_RESTARTS:-3} \
exec bash "$(dirname "$0")/launch_node.sh" "$EXAMPLE/model.yaml" "$EXAMPLE/$PHASE.yaml" -- \
    --data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL" \
    --save "$CKPT_DIR/$PHASE" --load "$CKPT_DIR/$PHASE" \
    --log-file "$CKPT_DIR/$PHASE.jsonl" --tensorboard-dir "$CKPT_DIR/tb_$PHASE" "${@:3}"
