"""The status of every flag of Megatron-LM's parser that is neither a config field nor a
hand-written entry of ``config/megatron.py``, by family.

``megatron_parser.json`` (written by ``tools/megatron_parser.py`` from Megatron-LM's own
``add_megatron_arguments``) lists the flags; each family here names some of them (any spelling of
an action stands for all: ``--no-X`` and ``--disable-X``) and says what giving them does:

- ``MEANING``: what the flag asks for is how this framework works;
- ``NO_EFFECT``: accepted and reported once at start, with the reason;
- ``REFUSED``: it would change the math (or the run) and is not built: an error names it. Given
  at Megatron-LM's own default value, a refused flag asks for nothing and is accepted.

``tests/config/test_megatron_parser.py`` checks that every flag of the table has exactly one status.
"""
from __future__ import annotations

from typing import Tuple

MEANING, NO_EFFECT, REFUSED = "meaning", "no effect", "refused"
STATUSES = (MEANING, NO_EFFECT, REFUSED)

_FP8 = "fp8 needs Transformer Engine: the compute stays in --bf16/--fp16/fp32"
_CP = "context parallelism's options (--context-parallel-size above 1 is refused here)"
_RL = "reinforcement learning (--perform-rl-step, refused here): read only by its loop"
_INFERENCE = "an inference-engine option: pretrain_gpt.py trains, it serves no requests"
_OTHER_MODELS = "read only by Megatron-LM's BERT, T5, ICT/retriever and vision scripts, not pretrain_gpt.py"
_CKPT = "how Megatron's checkpoint writer works: checkpoints here are this framework's layout-free format " \
        "(docs/checkpoint.md), always reshardable"
_RESILIENCE = "NVIDIA's resiliency integrations (in-process restart, fault tolerance, straggler detection) are " \
              "not part of this framework: a failed run stops and --load resumes it (docs/checkpoint.md)"
_NOT_LOGGED = "not logged here: the log line and TensorBoard hold the loss, LR, grad norm, loss scale, " \
              "tokens/s, TFLOP/s and memory (docs/training.md)"
_MLA = "DeepSeek-V3's multi-latent attention is not built (another issue)"
_HYBRID = "hybrid Mamba models are not built here"
_MUON = "read only with --optimizer muon/dist_muon/adaptive_muon, which are not built"

# (status, reason, flags): every flag of megatron_parser.json that megatron.py does not name.
FAMILIES: Tuple[Tuple[str, str, Tuple[str, ...]], ...] = (
    (NO_EFFECT, "a kernel or communication choice of Megatron/Transformer Engine: the same math", (
        "--pipeline-model-parallel-comm-backend", "--no-async-tensor-model-parallel-allreduce", "--tp-comm-overlap",
        "--no-tp-comm-bulk-wgrad", "--no-tp-comm-bulk-dgrad", "--no-tp-comm-overlap-ag", "--no-tp-comm-overlap-rs",
        "--tp-comm-overlap-rs-dgrad", "--no-tp-comm-split-ag", "--no-tp-comm-split-rs", "--tp-comm-overlap-cfg",
        "--tp-comm-bootstrap-backend", "--cross-entropy-fusion-impl", "--delay-wgrad-compute",
        "--ep-overlap-early-attn-memory-release", "--use-ring-exchange-p2p", "--defer-embedding-wgrad-compute",
        "--wgrad-deferral-limit", "--microbatch-group-size-per-virtual-pipeline-stage",
        "--moe-use-legacy-grouped-gemm", "--moe-enable-deepep", "--moe-flex-dispatcher-backend",
        "--moe-deepep-num-sms", "--moe-hybridep-num-sms", "--moe-router-fusion", "--batch-invariant-mode",
        "--use-te-activation-func", "--symmetric-ar-type", "--disable-jit-fuser", "--apply-query-key-layer-scaling",
        "--no-align-grad-reduce", "--ddp-num-buckets", "--ddp-pad-buckets-for-high-nccl-busbw",
        "--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective",
        "--overlap-param-gather-with-optimizer-step", "--no-align-param-gather",
        "--no-scatter-gather-tensors-in-pipeline", "--disable-symmetric-registration", "--use-sharp",
        "--sharp-enabled-group", "--create-all-gather-group", "--no-gradient-reduce-div-fusion",
        "--suggested-communication-unit-size", "--nccl-communicator-config-path", "--high-priority-stream-groups",
        "--disable-gloo-process-groups", "--use-tp-pp-dp-mapping", "--num-distributed-optimizer-instances",
        "--outer-dp-sharding-strategy", "--enable-full-sharding-in-hsdp", "--torch-fsdp2-no-reshard-after-forward",
        "--te-rng-tracker", "--inference-rng-tracker", "--deterministic-mode",
    )),
    (NO_EFFECT, "CUDA graphs capture kernel launches: the same math", (
        "--enable-cuda-graph", "--cuda-graph-warmup-steps", "--external-cuda-graph", "--cuda-graph-impl",
        "--cuda-graph-scope", "--moe-pad-experts-for-cuda-graph-inference",
    )),
    (NO_EFFECT, _FP8, (
        "--fp8-format", "--fp8-recipe", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
        "--fp8-quantizer-factory", "--fp8-margin", "--fp8-interval", "--no-fp8-wgrad", "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--use-kitchen-attention",
        "--kitchen-attention-backend", "--fp4-format", "--fp4-recipe", "--fp4-param-gather", "--fp4-quantizer-factory",
        "--moe-router-padding-for-quantization", "--moe-router-padding-for-fp8", "--keep-fp8-transpose-cache",
        "--reuse-grad-buf-for-mxfp8-param-ag", "--te-precision-config-file", "--fp16-lm-cross-entropy",
    )),
    (NO_EFFECT, "memory only (which activations are kept or recomputed): the same math; recomputation here is "
                "--recompute-activations / --recompute-granularity (docs/offload.md)", (
        "--distribute-saved-activations", "--recompute-modules", "--moe-layer-recompute",
        "--no-clone-scatter-output-in-embedding", "--fine-grained-activation-offloading", "--offload-modules",
        "--min-offloaded-tensor-size", "--cpu-offloading-num-layers",
    )),
    (NO_EFFECT, "where and how the first weights are made: initialised here by this framework's own seeded "
                "code, and a --load overwrites them", ("--use-cpu-initialization", "--no-initialization")),
    (NO_EFFECT, "process bookkeeping: torchrun's environment gives the ranks here, and the timeout stays "
                "--distributed-timeout-minutes", (
        "--local-rank", "--lazy-mpu-init", "--distributed-timeout-seconds-after-init", "--fake-process-group",
    )),
    (NO_EFFECT, _CP, ("--hierarchical-context-parallel-sizes", "--max-seqlen-per-dp-cp-rank", "--cp-comm-type")),
    (NO_EFFECT, "Python garbage-collection and host-device synchronisation timing",
     ("--manual-gc-interval", "--no-manual-gc-eval", "--train-sync-interval")),
    (NO_EFFECT, _CKPT, (
        "--non-persistent-save-interval", "--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir",
        "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo", "--auto-detect-ckpt-format",
        "--use-persistent-ckpt-worker", "--ckpt-assume-constant-structure", "--no-strict-fsdp-dtensor-load",
        "--dist-ckpt-strictness", "--dist-ckpt-save-pre-mcore-014", "--dist-ckpt-optim-fully-reshardable",
        "--distrib-optim-fully-reshardable-mem-efficient", "--replication", "--replication-jump",
        "--replication-factor", "--use-dist-ckpt", "--dist-ckpt-format", "--ckpt-fully-parallel-save",
        "--load-main-params-from-ckpt", "--no-use-tokenizer-model-from-checkpoint-args",
    )),
    (NO_EFFECT, "debugging dumps and checks of Megatron's that are not integrated", (
        "--save-wgrads-interval", "--save-dgrads-interval", "--check-weight-hash-across-dp-replicas-interval",
        "--dump-param-to-param-group-map", "--config-logger-dir", "--check-for-large-grads",
        "--result-rejected-tracker-filename", "--error-injection-rate", "--error-injection-type",
        "--check-for-spiky-loss", "--enable-experimental", "--onnx-safe", "--test-mode",
    )),
    (NO_EFFECT, _NOT_LOGGED, (
        "--log-progress", "--timing-log-option", "--tensorboard-queue-size", "--no-log-loss-scale-to-tensorboard",
        "--log-memory-interval", "--log-device-memory-used", "--log-max-attention-logit",
        "--no-barrier-with-level-1-timing", "--log-world-size-to-tensorboard", "--log-energy",
        "--log-params-norm", "--log-num-zeros-in-grad", "--tensorboard-log-interval", "--log-memory-to-tensorboard",
        "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--timing-log-level",
        "--no-one-logger", "--one-logger-project", "--one-logger-run-name", "--one-logger-async",
        "--app-tag-run-name", "--app-tag-run-version", "--run-workload-inspector-server",
    )),
    (NO_EFFECT, "Megatron-LM's profiler hook is not integrated", (
        "--profile", "--profile-step-start", "--profile-step-end", "--use-pytorch-profiler", "--profile-ranks", "--record-memory-history", "--memory-snapshot-path",
    )),
    (NO_EFFECT, _RESILIENCE, (
        "--inprocess-restart", "--inprocess-max-iterations", "--inprocess-monitor-thread-interval",
        "--inprocess-monitor-process-interval", "--inprocess-progress-watchdog-interval",
        "--inprocess-heartbeat-interval", "--inprocess-soft-timeout", "--inprocess-hard-timeout",
        "--inprocess-heartbeat-timeout", "--inprocess-barrier-timeout", "--inprocess-completion-timeout",
        "--inprocess-last-call-wait", "--inprocess-termination-grace-time", "--inprocess-granularity",
        "--inprocess-active-world-size", "--inprocess-empty-cuda-cache", "--enable-ft-package",
        "--calc-ft-timeouts", "--ft-num-warmup-iters", "--log-straggler", "--straggler-ctrlr-port",
        "--straggler-minmax-count", "--disable-straggler-on-startup", "--adlr-autoresume",
        "--adlr-autoresume-interval", "--exit-signal-handler-for-dataloader", "--rerun-mode",
    )),
    (NO_EFFECT, "data loading speed (index caches, builder threads, object storage): the same samples", (
        "--per-dataset-sequences-path", "--dataloader-fast-cache-load", "--dataloader-defer-npy-index-mmap",
        "--num-dataset-builder-threads", "--object-storage-cache-path", "--disable-msc",
        "--allow-ambiguous-pad-tokens", "--legacy-tokenizer", "--tokenizer-sentencepiece-legacy",
        "--tokenizer-hf-use-fast",
    )),
    (NO_EFFECT, _INFERENCE, (
        "--flash-decode", "--inference-fuse-tp-communication", "--mlp-chunks-for-prefill",
        "--inference-batch-times-seqlen-threshold", "--max-tokens-to-oom", "--use-legacy-static-engine",
        "--inference-max-requests", "--inference-max-seq-length", "--inference-max-batch-size",
        "--inference-dynamic-batching", "--inference-dynamic-batching-buffer-size-gb",
        "--inference-dynamic-batching-paused-buffer-size-gb", "--inference-dynamic-batching-block-size",
        "--inference-dynamic-batching-max-requests", "--inference-dynamic-batching-max-tokens",
        "--inference-dynamic-batching-num-cuda-graphs", "--inference-dynamic-batching-track-paused-request-events",
        "--decode-only-cuda-graphs", "--inference-dynamic-batching-unified-memory-level",
        "--nccl-all-reduce-for-prefill", "--enable-chunked-prefill", "--disable-chunked-prefill",
        "--inference-dynamic-batching-cuda-graph-max-tokens",
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count", "--inference-logging-step-interval",
        "--inference-wandb-logging", "--inference-coordinator-port",
    )),
    (NO_EFFECT, _RL, (
        "--rl-prompts-per-eval", "--grpo-prompts-per-step", "--grpo-group-size", "--grpo-iterations",
        "--grpo-clamp-eps-lower", "--grpo-clamp-eps-upper", "--grpo-kl-beta", "--grpo-entropy-term-weight",
        "--grpo-filter-groups-with-same-reward", "--langrl-inference-server-type",
        "--langrl-inference-server-conversation-template", "--langrl-external-server", "--langrl-env-config",
        "--rl-default-temperature", "--rl-default-top-p", "--rl-default-top-k",
        "--rl-offload-optimizer-during-inference", "--rl-offload-kv-cache-during-training",
        "--rl-remove-kv-cache-during-training", "--rl-reset-cuda-graphs", "--rl-partial-rollouts",
        "--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef",
        "--rl-use-sequence-packing", "--rl-sequence-packing-max-sequences-per-bin", "--rl-sequence-packing-algo",
        "--rl-training-cuda-graphs", "--rl-inference-tensor-model-parallel-size",
        "--rl-inference-pipeline-model-parallel-size", "--rl-inference-expert-model-parallel-size",
        "--rl-inference-expert-tensor-model-parallel-size", "--rl-inference-model-unified-memory-level",
        "--rl-offload-inference-model-weights-when-idle", "--refit-method", "--rl-verify-model-weights-swap",
        "--rl-parallel-generation-tasks", "--rl-skip-bos-token", "--moe-enable-routing-replay",
    )),
    (NO_EFFECT, _OTHER_MODELS, (
        "--bert-no-binary-head", "--bert-load", "--output-bert-embeddings", "--bert-embedder-type", "--mask-prob",
        "--short-seq-prob", "--relative-attention-num-buckets", "--relative-attention-max-distance",
        "--ict-head-size", "--biencoder-projection-dim", "--biencoder-shared-query-context-model", "--ict-load",
        "--titles-data-path", "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path",
        "--retriever-report-topk-accuracies", "--retriever-score-scaling", "--block-data-path", "--embedding-path",
        "--indexer-batch-size", "--indexer-log-interval", "--num-classes", "--img-h", "--img-w", "--num-channels",
        "--patch-dim", "--classes-fraction", "--data-per-class-fraction", "--no-data-sharding", "--head-lr-mult",
        "--vision-pretraining", "--vision-pretraining-type", "--vision-backbone-type", "--swin-backbone-type",
        "--mask-type", "--mask-factor", "--iter-per-epoch", "--dino-local-img-size", "--dino-local-crops-number",
        "--dino-head-hidden-size", "--dino-bottleneck-size", "--dino-freeze-last-layer", "--dino-norm-last-layer",
        "--dino-warmup-teacher-temp", "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs",
        "--vocab-extra-ids", "--encoder-num-layers", "--decoder-num-layers", "--decoder-seq-length",
    )),
    (NO_EFFECT, "read only with a refused flag of its family (named in the same row of docs/megatron.md)", (
        "--mtp-standalone", "--mtp-loss-scaling-factor", "--moe-shared-expert-overlap",
        "--moe-router-bias-update-rate", "--moe-upcycling-granularity", "--qk-clip-alpha", "--qk-clip-threshold",
        "--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk", "--dsa-indexer-loss-coeff",
        "--dsa-indexer-use-sparse-loss", "--linear-conv-kernel-dim", "--linear-key-head-dim",
        "--linear-value-head-dim", "--linear-num-key-heads", "--linear-num-value-heads",
        "--start-weight-decay", "--end-weight-decay", "--lr-wsd-decay-style", "--lr-wsd-decay-iters",
        "--lr-wsd-decay-samples", "--fim-rate", "--fim-spm-rate", "--fim-split-sample", "--fim-fragment-rate",
        "--fim-no-prefix", "--fim-prefix-token", "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token",
        "--fim-eod-token", "--sft-tokenizer-prompt-format",
    )),
    (NO_EFFECT, _MLA + ": read only with --multi-latent-attention", (
        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim",
        "--rotary-scaling-factor", "--mscale", "--mscale-all-dim", "--cache-mla-latents",
    )),
    (NO_EFFECT, _HYBRID + ": read only by hybrid models", (
        "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
        "--disable-mamba-mem-eff-path", "--hybrid-attention-ratio", "--hybrid-mlp-ratio",
    )),
    (NO_EFFECT, _MUON, (
        "--muon-momentum", "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-scale-mode",
        "--muon-fp32-matmul-prec", "--muon-num-ns-steps", "--muon-tp-mode", "--muon-extra-scale-factor",
    )),
    (NO_EFFECT, "read only with --optimizer sgd, which is not built", ("--sgd-momentum",)),
    (MEANING, "the LR schedule on resume is always the one the command line gives (the checkpoint's iteration "
              "and samples place the run on it)", ("--override-opt-param-scheduler",)),
    # Not built: the math or the run would differ.
    (REFUSED, "DeepSeek-V3's multi-token prediction is not built (another issue)", ("--mtp-num-layers",)),
    (REFUSED, _MLA, ("--multi-latent-attention",)),
    (REFUSED, "DeepSeek-V3's routing (shared experts, expert bias, group-limited and scaled top-k) is not built "
              "(another issue)", (
        "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--moe-router-num-groups",
        "--moe-router-group-topk", "--moe-router-topk-scaling-factor", "--moe-router-enable-expert-bias",
    )),
    (REFUSED, "not built: Megatron's capacity drops tokens by router probability by default "
              "(--moe-token-drop-policy probs); this framework's --moe-capacity-factor drops by position", (
        "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy",
    )),
    (REFUSED, "not built: a change of the MoE math", (
        "--moe-router-force-load-balancing", "--moe-apply-probs-on-input", "--moe-latent-size", "--moe-extended-tp",
        "--moe-use-upcycling",
    )),
    (REFUSED, "not built: an attention or layer variant", (
        "--qk-l2-norm", "--qk-clip", "--attention-output-gate", "--experimental-attention-variant",
        "--linear-attention-freq", "--use-fused-weighted-squared-relu", "--fp32-residual-connection",
        "--mrope-section", "--no-rope-freq", "--heterogeneous-layers-config-path",
        "--heterogeneous-layers-config-encoded-json", "--embedding-init-method-std",
        "--no-weight-decay-cond-type",
    )),
    (REFUSED, _HYBRID, ("--is-hybrid-model", "--hybrid-override-pattern", "--spec")),
    (REFUSED, "layers are split evenly over the pipeline stages here", (
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
        "--pipeline-model-parallel-layout",
    )),
    (REFUSED, "context parallelism is not implemented", ("--hybrid-context-parallel",)),
    (REFUSED, "expert tensor parallelism is not built: experts are split by --tensor-model-parallel-size",
     ("--expert-tensor-parallel-size",)),
    (REFUSED, "PyTorch FSDP2 is not built: --use-distributed-optimizer shards the optimizer state (ZeRO-1)",
     ("--use-torch-fsdp2",)),
    (REFUSED, "Megatron's optimizer offload is not built: this framework's is --cpu-offload-layers with "
              "--cpu-offload-what optimizer (docs/offload.md)", (
        "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--use-torch-optimizer-for-cpu-offload",
        "--no-pin-cpu-grads", "--no-pin-cpu-params",
    )),
    (REFUSED, "reinforcement learning is not built", ("--perform-rl-step",)),
    (REFUSED, "a deprecated spelling Megatron-LM itself rewrites: give the flag it names instead "
              "(--batch-size: --micro-batch-size; --warmup: --lr-warmup-iters; --model-parallel-size: "
              "--tensor-model-parallel-size; --checkpoint-activations: --recompute-granularity full "
              "--recompute-method uniform; --encoder-seq-length: --seq-length; --use-rotary-position-embeddings: "
              "--position-embedding-type rope; --yaml-cfg: --config)", (
        "--batch-size", "--warmup", "--model-parallel-size", "--checkpoint-activations", "--encoder-seq-length",
        "--use-rotary-position-embeddings", "--yaml-cfg",
    )),
    (REFUSED, "the model is one code path here (megatron-core's GPT)", ("--use-legacy-models",)),
    (REFUSED, "not built: the data pipeline reads --data-path with --split, or each split's prefixes (docs/data.md)", (
        "--sample-rate", "--mid-level-dataset-surplus",
        "--fim-data", "--sft", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
        "--iterations-to-skip", "--phase-transition-iterations",
    )),
    (REFUSED, "not built: the tokenizer is --tokenizer-type with --vocab-file/--merge-file/--tokenizer-model "
              "(docs/data.md)", (
        "--padded-vocab-size", "--tokenizer-metadata", "--tokenizer-special-tokens",
        "--tokenizer-hf-include-special-tokens", "--trust-remote-code",
    )),
    (REFUSED, "not built: checkpoints always hold the optimizer and RNG state, --load reads the latest, and "
              "conversion is tools/convert_checkpoint.py; --keep-last N keeps the newest N checkpoints (docs/checkpoint.md)", (
        "--save-retain-interval",
        "--no-save-optim", "--no-save-rng", "--pretrained-checkpoint", "--ckpt-step", "--use-checkpoint-args",
        "--use-mp-args-from-checkpoint-args", "--ckpt-convert-format", "--ckpt-convert-save",
        "--ckpt-convert-update-legacy-dist-opt-format",
    )),
    (REFUSED, "not built: a run trains, then evaluates every --eval-interval on the one validation split", (
        "--skip-train", "--full-validation", "--multiple-validation-sets",
    )),
    (REFUSED, "the LR schedule on resume is the command line's here (--override-opt-param-scheduler's meaning), "
              "not the checkpoint's", ("--use-checkpoint-opt-param-scheduler",)),
    (REFUSED, "not built: the weight decay is constant", ("--weight-decay-incr-style",)),
    (REFUSED, "not built: every data-parallel replica starts from the same weights", ("--data-parallel-random-init",)),
)
