#!/usr/bin/env bash
# What only a GPU can show, in order of priority, for a session lent one for about 15 minutes:
#
#     bash bench/gpu_checks.sh            # the whole list, about 14 minutes on an H100
#     bash bench/gpu_checks.sh b d        # only the named steps (a rerun of the failed ones)
#
# Each step has a time limit of its own; a failed or timed-out step is recorded and the next one runs.
# Logs and one JSON summary (bench/results/gpu/summary.json: the commit, the GPU's name, each step's
# command, status and seconds) go under bench/results/gpu/. Without a GPU the steps that need one are
# listed as such and the CPU-able ones run in a small form (which checks this script: the suite runs it
# so), and the script exits 0.
#
#   a  the multi-rank CUDA scenarios (bench/multi_rank_cuda.py: 2 ranks sharing the GPU through gloo)
#   b  CUDA branches since 2026-11-23: vocabulary padding's gain; the divergence stop under fp16 with a
#      GradScaler (one line, exit 1, no snapshot of the ruined weights); the step clock's CUDA events
#      and the hang watchdog on 2 ranks (part of a). NCCL's flight recorder needs 2 GPUs: not here.
#   c  the planner's per-rank peak against torch.cuda.max_memory_allocated (gpt2 bf16 batch 8 block
#      1024; the tutorial's default in fp16 at batch 216), DDP, and FSDP under torchrun
#   d  gpt2 124M with GPT-2's vocabulary, bf16, compiled, block 1024: MFU (target 45%)
#   e  nanoGPT's shakespeare-char recipe with main.py: best validation loss and wall time (target 1.47
#      or lower in 90 s or less)
#   f  generation with and without the key/value cache on the GPU
#   g  plan.py --check's figures against a real step (bench/bench_check_gpu.py): what the check's simulated
#      rank 0 holds against what the GPU's rank holds after two steps (target: equal within 2%), and the
#      planner's peak on this GPU against torch.cuda.max_memory_allocated (target 10%); gpt2, bf16, batch 8,
#      block 1024, DDP, and FSDP under torchrun
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python}
if $PYTHON -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then GPU=1; else GPU=0; fi
# A GPU's figures are committed; a CPU's check of this script goes to a folder of its own.
if [[ $GPU == 1 ]]; then OUT=${GPU_CHECKS_OUT:-bench/results/gpu}; else OUT=${GPU_CHECKS_OUT:-$(mktemp -d)}; fi
mkdir -p "$OUT"
echo "logs and summary: $OUT"
WANTED=" ${*:-a b c d e f g} "
STEPS=()  # name|status|seconds|command, for the summary

# run STEP LIMIT_S NEEDS_GPU LOG -- COMMAND...: the command under its time limit, its output in LOG.
run() {
    local step=$1 limit=$2 needs_gpu=$3 log=$4
    shift 5
    if [[ $WANTED != *" ${step} "* ]]; then return; fi
    if [[ $needs_gpu == 1 && $GPU == 0 ]]; then
        echo "[$step] needs a GPU: $*"
        STEPS+=("$step|needs a GPU|0|$*")
        return
    fi
    echo "[$step] $* (limit ${limit} s)"
    local start=$SECONDS status
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
    case $? in
        0) status=passed ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    echo "[$step] $status after $((SECONDS - start)) s: $OUT/$log"
    STEPS+=("$step|$status|$((SECONDS - start))|$*")
}

# expect_divergence: a fp16 run with a learning rate that ruins it ends in one line, exit status 1.
expect_divergence() {
    local folder
    folder=$(mktemp -d)
    $PYTHON mingpt/main.py trainer_config.snapshot_path="$folder/snap.pt" trainer_config.max_steps=30 \
        trainer_config.save_every_steps=5 trainer_config.use_amp=true trainer_config.amp_dtype=float16 \
        optimizer_config.learning_rate=1e6 trainer_config.grad_norm_clip=1e9 gpt_config.n_layer=2 \
        gpt_config.n_head=2 gpt_config.n_embd=64 trainer_config.batch_size=32 trainer_config.log_every=1
    local status=$?
    rm -rf "$folder"
    [[ $status == 1 ]]
}
export -f expect_divergence  # run by `timeout bash -c`, in a shell of its own

if [[ $GPU == 1 ]]; then
    run a 240 1 multi_rank_cuda.log -- $PYTHON bench/multi_rank_cuda.py --out "$OUT/multi_rank_cuda.json"
    run b 90 1 vocab_padding.log -- $PYTHON bench/bench_vocab_padding.py --json "$OUT/vocab_padding.json"
    run b 60 0 divergence_fp16.log -- bash -c expect_divergence
    run c 120 1 memory_ddp.log -- $PYTHON bench/bench_gpu_memory.py --method ddp
    run c 120 1 memory_fsdp.log -- $PYTHON -m torch.distributed.run --standalone --nproc_per_node=1 \
        bench/bench_gpu_memory.py --method fsdp
    run d 150 1 gpt2_mfu.log -- $PYTHON bench/bench_train.py --models gpt2 --vocab-size 50257 --amp \
        --compile --batch-size 32 --block-size 1024 --warmup 10 --steps 20 --json "$OUT/gpt2_mfu.json"
    run e 150 1 shakespeare_char.log -- $PYTHON mingpt/main.py trainer_config.snapshot_path="$OUT/shakespeare_char.pt" \
        data_config.truncate=1.0 data_config.split=contiguous data_config.block_size=256 gpt_config.n_layer=6 \
        gpt_config.n_head=6 gpt_config.n_embd=384 gpt_config.embd_pdrop=0.2 gpt_config.resid_pdrop=0.2 \
        gpt_config.attn_pdrop=0.2 trainer_config.batch_size=64 trainer_config.max_steps=5000 \
        trainer_config.eval_every_steps=250 trainer_config.eval_batches=200 trainer_config.compile=true \
        trainer_config.amp_dtype=bfloat16 trainer_config.data_loader_workers=2 \
        optimizer_config.learning_rate=1e-3 optimizer_config.lr_schedule=cosine \
        optimizer_config.warmup_steps=100 trainer_config.save_every=1000
    run f 120 1 generate.log -- $PYTHON bench/bench_generate.py --device cuda --threads 1 \
        --json "$OUT/generate.json"
    run g 180 1 check_ddp.log -- $PYTHON bench/bench_check_gpu.py --json "$OUT/check_ddp.json"
    run g 180 1 check_fsdp.log -- $PYTHON -m torch.distributed.run --standalone --nproc_per_node=1 \
        bench/bench_check_gpu.py --method fsdp --json "$OUT/check_fsdp.json"
else  # the CPU-able parts, small: they check this script, not the GPU
    run a 240 1 multi_rank_cuda.log -- $PYTHON bench/multi_rank_cuda.py
    run b 90 1 vocab_padding.log -- $PYTHON bench/bench_vocab_padding.py
    run b 120 0 divergence_fp16.log -- bash -c expect_divergence
    run c 120 0 memory_ddp.log -- $PYTHON bench/bench_gpu_memory.py --cases tiny --json "$OUT/memory.json"
    run d 150 1 gpt2_mfu.log -- $PYTHON bench/bench_train.py --models gpt2 --vocab-size 50257
    run e 240 0 shakespeare_char.log -- $PYTHON mingpt/main.py trainer_config.snapshot_path="$OUT/shakespeare_char.pt" \
        data_config.truncate=0.05 data_config.split=contiguous data_config.block_size=32 gpt_config.n_layer=1 \
        gpt_config.n_head=2 gpt_config.n_embd=32 trainer_config.batch_size=8 trainer_config.max_steps=4 \
        trainer_config.eval_batches=2 trainer_config.data_loader_workers=0
    run f 120 0 generate.log -- $PYTHON bench/bench_generate.py --models default --prompts 1 --threads 1 \
        --new-tokens 4 --repeats 1 --json "$OUT/generate.json"
    run g 180 1 check_ddp.log -- $PYTHON bench/bench_check_gpu.py  # its CPU half: run by hand, minutes here
fi
rm -f "$OUT/shakespeare_char.pt" "$OUT/shakespeare_char.metrics.jsonl" "$OUT/shakespeare_char.lease.json"

printf '%s\n' "${STEPS[@]}" | $PYTHON -c "
import json, subprocess, sys, torch
steps = [dict(zip(('step', 'status', 'seconds', 'command'), line.rstrip('\n').split('|', 3))) for line in sys.stdin if line.strip()]
commit = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
json.dump({'commit': commit, 'gpu': gpu, 'torch': torch.__version__, 'steps': steps}, open('$OUT/summary.json', 'w'), indent=2)
print(f'summary: {len(steps)} steps on {gpu or \"no GPU\"}: ' + ', '.join(s['step'] + ' ' + s['status'] for s in steps))
"
exit 0
