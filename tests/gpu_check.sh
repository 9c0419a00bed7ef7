#!/usr/bin/env bash
# The GPU check: one prepared command for a lent GPU machine (H100/H200 class), ~9 minutes at most
# in all.
#
#   bash tests/gpu_check.sh     # from the repository root; logs go to $OUT, else gpu_check_out/
#
# Steps, each under its own `timeout` so that a hang or a slow compile cannot eat the others' time:
#   1. the machine: nvidia-smi, torch / CUDA / Triton versions                         (<= 30 s)
#   2. the CUDA tests, with the lean-head and compile tests (they include CUDA
#      cases too)                                                                      (<= 210 s)
#   3. lab/bench.py at config/shakespeare_gpu.py's shape: training step of every arm
#      with both heads, and generation; compiled, bf16                                 (<= 120 s)
#   4. LEV's ids per chunk (lev_chunk, untuned: the GPU configs guess 1024): 256,
#      1024, 4096                                                                      (<= 3 x 35 s)
#   5. lab/bench.py at the paper's vocabulary, V = 200,376, at config/fineweb_gpu.py's
#      shape (8 x 8 x 512, block 1024): step time and peak memory per arm with the
#      lean head                                                                       (<= 75 s)
# A step that fails or times out is reported and the next one still runs; the exit status is that
# of the first failed step (0 if none). Every step's output is in $OUT/NN-name.log, and bench.py's
# figures in $OUT/*.json.

set -u -o pipefail
# logs as they happen, so that a step cut by its timeout still shows how far it got
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python}"
STATUS=0
SUMMARY=()

# step NAME SECONDS COMMAND...: run COMMAND under a timeout, its output both on the terminal and in
# the log
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (timeout ${limit}s): $*" | tee "$OUT/$name.log"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=$?
    local line="$name: rc=$rc in $((SECONDS - start)) s"
    [ "$rc" = 124 ] && line="$line (timed out)"
    echo "=== $line" | tee -a "$OUT/$name.log"
    SUMMARY+=("$line")
    [ "$rc" != 0 ] && [ "$STATUS" = 0 ] && STATUS=$rc
    return 0
}

# 1. the machine
VERSIONS='import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,'
VERSIONS+=' "triton", triton.__version__, "device", torch.cuda.get_device_name(0),'
VERSIONS+=' "bf16", torch.cuda.is_bf16_supported())'
step 01-machine 30 bash -c "nvidia-smi; $PYTHON -c '$VERSIONS'"

# 2. the tests that run on CUDA (the rest of the suite is CPU-only and runs anywhere). -rs lists the
#    skips: none of test_cuda.py's may skip here.
step 02-pytest 210 "$PYTHON" -m pytest -q -rs tests/test_cuda.py tests/test_lean_head.py \
    tests/test_compile.py

# 3. the GPU config's shape (config/shakespeare_gpu.py), Zipf stand-in batches (--dataset=none: no
#    data needed) at GPT-2's V. Few steps: the medians are for a first look, not for a table.
GPU_SHAPE=(--device=cuda --n_layer=6 --n_head=6 --n_embd=384 --block_size=256 --batch_size=64
           --dataset=none --vocab_size=50257)
step 03-bench-gpu 120 "$PYTHON" lab/bench.py "${GPU_SHAPE[@]}" --compile --tables=train,gen \
    --heads=lean,full --steps=5 --warmup=2 --gen_tokens=200 --json="$OUT/bench_gpu.json"

# 4. lev_chunk: the GPU is filled only by enough ids per kernel call (a 16,384-token batch holds a
#    few thousand distinct ids). LEV's kernels are compiled in every run; the model itself eager, to
#    fit the time.
for chunk in 256 1024 4096; do
    step "04-lev_chunk-$chunk" 35 "$PYTHON" lab/bench.py "${GPU_SHAPE[@]}" --tables=train \
        --embedding=tied,lev --heads=lean --lev_chunk="$chunk" --steps=3 --warmup=1 \
        --json="$OUT/bench_lev_chunk_$chunk.json"
done

# 5. the paper's vocabulary at config/fineweb_gpu.py's shape, one micro-batch of 16 x 1024 tokens
#    (the config uses 64): peak memory and step time of each arm with the lean head, eager model,
#    LEV kernels compiled
step 05-bench-v200k 75 "$PYTHON" lab/bench.py --device=cuda --n_layer=8 --n_head=8 --n_embd=512 \
    --block_size=1024 --batch_size=16 --dataset=none --vocab_size=200376 --tables=train \
    --heads=lean --lev_chunk=1024 --steps=3 --warmup=1 --json="$OUT/bench_v200k.json"

echo
echo "=== summary (logs in $OUT/)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$STATUS"
