#!/usr/bin/env bash
# One node of the m6_1t run (64 nodes x 8 GPUs): bash examples/m6_1t/launch.sh pseudo|real
# with NNODES, NODE_RANK, MASTER_ADDR, DATA_PATH, TOKENIZER_MODEL, CKPT_DIR (see ../launch_phase.sh).
exec bash "$(dirname "$0")/../launch_phase.sh" "$(dirname "$0")" "$@"
