#!/usr/bin/env bash
# Start this node's ranks of a multi-node job with torchrun.
#
#   NNODES=64 NODE_RANK=3 MASTER_ADDR=node000 bash examples/launch_node.sh CONFIG.yaml [MORE.yaml] -- [FLAGS]
#
# Variables: NNODES (default 1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (29500),
# GPUS_PER_NODE (8), MAX_RESTARTS (0: with --save D --load D a restarted job resumes from
# the newest complete checkpoint). Every node runs the same command with its own NODE_RANK.
# The host optimizer step of offloaded layers takes each rank's share of the node's cores
# (--host-optimizer-threads auto: cores / GPUS_PER_NODE, whatever torchrun's OMP_NUM_THREADS=1);
# pass --host-optimizer-threads N after -- to set it (docs/host_optimizer.md).
set -euo pipefail
cd "$(dirname "$0")/.."
configs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do configs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#configs[@]} -gt 0 ] || { echo "usage: $0 CONFIG.yaml [MORE.yaml] -- [FLAGS]" >&2; exit 2; }
exec python -m torch.distributed.run \
    --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    pretrain_m6.py --config "${configs[@]}" "$@"
