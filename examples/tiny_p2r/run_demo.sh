#!/usr/bin/env bash
# The whole Pseudo-to-Real recipe on a 2-core CPU, in minutes:
#   demo corpus -> SentencePiece tokenizer -> indexed dataset -> pseudo phase (8 ranks,
#   TP2 x PP2 x DP2, EP2, share-pattern all) -> delink into another layout -> real phase
#   (4 ranks, TP1 x PP2 x DP2, EP2) -> eval before/after delinking -> loss plot + summary.
# Re-running reuses every output that exists (delete $DEMO_OUT to start over).
# DEMO_PSEUDO_ITERS / DEMO_REAL_ITERS / DEMO_CORPUS_BYTES shorten the run and DEMO_EXTRA_ARGS
# adds flags to every training launch (the integration test uses them).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=examples/tiny_p2r
OUT=${DEMO_OUT:-demo_out}
PSEUDO_ITERS=${DEMO_PSEUDO_ITERS:-120}
REAL_ITERS=${DEMO_REAL_ITERS:-120}
CORPUS_BYTES=${DEMO_CORPUS_BYTES:-6000000}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
start=$(date +%s)
step() { echo; echo "==> $*"; }
launch() {  # launch NPROC ARGS...: torchrun on this machine
    local n=$1; shift
    python -m torch.distributed.run --nproc-per-node "$n" --master-port "$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')" pretrain_m6.py "$@"
}
read -r -a EXTRA <<< "${DEMO_EXTRA_ARGS:-}"
COMMON=(--tokenizer-model "$OUT/tokenizer.model" --data-path "$OUT/corpus_text_document" "${EXTRA[@]}")

step "1/8 demo corpus from the Python standard library"
[ -s "$OUT/corpus.jsonl" ] || python tools/build_demo_corpus.py --output "$OUT/corpus.jsonl" --max-bytes "$CORPUS_BYTES"

step "2/8 SentencePiece tokenizer"
[ -s "$OUT/tokenizer.model" ] || python tools/train_tokenizer.py --input "$OUT/corpus.jsonl" \
    --model-prefix "$OUT/tokenizer" --vocab-size 4000 --model-type bpe --input-sentence-size 200000

step "3/8 preprocess into a Megatron indexed dataset"
[ -s "$OUT/corpus_text_document.idx" ] || python tools/preprocess_data.py --input "$OUT/corpus.jsonl" \
    --output-prefix "$OUT/corpus" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/tokenizer.model" --workers 2 --append-eod

step "4/8 pseudo phase: 8 ranks (TP2 x PP2 x DP2, EP2), every layer shares one slot"
if [ ! -s "$OUT/pseudo/latest_checkpointed_iteration.txt" ] || \
   [ "$(cat "$OUT/pseudo/latest_checkpointed_iteration.txt")" -lt "$PSEUDO_ITERS" ]; then
    launch 8 "${COMMON[@]}" --config "$HERE/model.yaml" "$HERE/pseudo.yaml" \
        --train-iters "$PSEUDO_ITERS" --save "$OUT/pseudo" --load "$OUT/pseudo" --log-file "$OUT/pseudo.jsonl"
fi

step "5/8 delink pseudo -> real, into TP1 x PP2 x EP2"
[ -s "$OUT/real_init/latest_checkpointed_iteration.txt" ] || python tools/convert_checkpoint.py delink \
    "$OUT/pseudo" "$OUT/real_init" --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2 \
    --target-expert-parallel-size 2 --optimizer-state rescale

step "6/8 eval-only: the pseudo model (8 ranks) and the delinked real model (4 ranks)"
launch 8 "${COMMON[@]}" --config "$HERE/model.yaml" "$HERE/pseudo.yaml" --load "$OUT/pseudo" --eval-only \
    --log-file "$OUT/eval_pseudo.jsonl" > "$OUT/eval_pseudo.log" 2>&1
launch 4 "${COMMON[@]}" --config "$HERE/model.yaml" "$HERE/real.yaml" --load "$OUT/real_init" --eval-only \
    --log-file "$OUT/eval_real_init.jsonl" > "$OUT/eval_real_init.log" 2>&1

step "7/8 real phase: 4 ranks, resumed from the delinked checkpoint"
TOTAL=$((PSEUDO_ITERS + REAL_ITERS))
if [ ! -s "$OUT/real/latest_checkpointed_iteration.txt" ] || \
   [ "$(cat "$OUT/real/latest_checkpointed_iteration.txt")" -lt "$TOTAL" ]; then
    LOAD="$OUT/real_init"; [ -s "$OUT/real/latest_checkpointed_iteration.txt" ] && LOAD="$OUT/real"
    launch 4 "${COMMON[@]}" --config "$HERE/model.yaml" "$HERE/real.yaml" --train-iters "$TOTAL" \
        --lr-decay-iters "$TOTAL" --load "$LOAD" --save "$OUT/real" --log-file "$OUT/real.jsonl"
fi
launch 4 "${COMMON[@]}" --config "$HERE/model.yaml" "$HERE/real.yaml" --load "$OUT/real" --eval-only \
    --log-file "$OUT/eval_real_final.jsonl" > "$OUT/eval_real_final.log" 2>&1

step "8/8 plot and summary"
python tools/plot_logs.py --log-file "$OUT/pseudo.jsonl" "$OUT/real.jsonl" --output "$OUT/loss.png"
python "$HERE/summary.py" "$OUT" "$(( $(date +%s) - start ))"
