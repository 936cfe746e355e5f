#!/usr/bin/env bash
# One node of the deepseek_v3 run (256 nodes x 8 GPUs): bash examples/deepseek_v3/launch.sh pseudo|real
# with NODE_RANK, MASTER_ADDR, DATA_PATH, TOKENIZER_MODEL, CKPT_DIR (see ../launch_phase.sh).
NNODES=${NNODES:-256} exec bash "$(dirname "$0")/../launch_phase.sh" "$(dirname "$0")" "$@"
