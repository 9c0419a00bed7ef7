# The paper's comparison at the smallest scale where it can plausibly show, on one 80 GB GPU (H100
# class): o200k_base (the paper's tokenizer family, V = 200,019), FineWeb-Edu text, a backbone of
# 26M parameters.
#   python lab/prepare_corpus.py fineweb_edu_o200k --input='fineweb-edu/sample/10BT/*.parquet' \
#       --tokenizer=o200k_base
#   python train.py config/fineweb_gpu.py                     # Leviathan -> out-fineweb-gpu-lev/
#   python train.py config/fineweb_gpu.py --embedding=tied    # baseline: same batches, val tokens
#   python train.py config/fineweb_gpu.py --embedding=untied  # control: untying alone
#   python lab/eval.py out-fineweb-gpu-tied out-fineweb-gpu-lev out-fineweb-gpu-untied \
#       --plot=fineweb.png
# docs/gpu.md has the whole recipe. NOTHING HERE HAS RUN: no GPU was at hand when it was written;
# every time and memory figure below is an estimate, and tests/gpu_check.sh is the prepared first
# check on a GPU.
#
# Parameters (GPT(Config(...)).param_report() on the meta device; the command is in docs/gpu.md),
# V = 200,019:
#   arm      input embedding   backbone     head          total
#   lev          1,466,496    25,698,816   102,409,728   129,575,040
#   tied       102,409,728    25,698,816             0   128,108,544
#   untied     102,409,728    25,698,816   102,409,728   230,518,272
# The vocabulary dominates: the V x 512 head (or tied table) is 4x the backbone, as in the paper's
# smallest models; this is the regime where an input table is a large share of the model and LEV's
# saving shows.
#
# Token budget: "parameter" here means a model's total of the two arms the paper compares (lev
# 129.6M, tied 128.1M; the untied control has 230.5M and gets the same tokens, 11 per parameter). 20
# tokens per parameter = 2.59B tokens; 5,000 steps of 524,288 tokens = 2.62B tokens = 20.2 per lev
# parameter, 102 per backbone one.
#
# Time per step (ESTIMATE, not measured): training FLOPs per token = 6 x (backbone + head) +
# attention 12 x n_layer x block_size x n_embd = 6 x 128,108,544 + 50,331,648 = 0.819 GFLOP (the
# table lookup is free, LEV adds ~5 MFLOP per distinct id, <1%). 524,288 tokens x 0.819 GFLOP =
# 4.29e14 FLOP per step: 1.24 s at 35% MFU of an H100's 989 TFLOP/s bf16 (1.08-1.45 s at 40-30%). On
# top of that the head's softmax is memory-bound at V = 200k: the lean head reads and writes each
# fp32 logit ~15 times (~60 bytes), 6.3 TB per step, ~1.9 s at H100's 3.35 TB/s (~1.3 s on an H200's
# 4.8 TB/s). So ~3.1 s per step, ~4.4 GPU-hours per arm on an H100 (~2.5 s, ~3.5 h on an H200), ~13
# for the three arms. LEV's own overhead over tied is unmeasured on a GPU (1.01x on 2 CPU cores with
# its C kernels, docs/bench_cpu.json; its compiled torch kernels, which a GPU runs: docs/speed.md).
#
# Memory per micro-batch of 64 x 1,024 tokens (ESTIMATE): weights + grads + AdamW 16 bytes per
# parameter (2.1 GB lev and tied, 3.7 GB untied); bf16 activations ~40 bytes x n_embd per token and
# layer, ~11 GB; the lean head ~1.4 GB (a 335 x V fp32 chunk, its bf16 copy, dL/dW in fp32);
# LEV < 0.5 GB. ~15-20 GB of 80: batch_size = 128 with gradient_accumulation_steps = 4 likely
# fits too (tests/gpu_check.sh step 5 measures 16 x 1,024 tokens at V = 200,376). The plain head
# would hold 64 x 1,024 x V logits: 26 GB in bf16, 52 GB more in fp32: hence lean_head.

dataset = "fineweb_edu_o200k"
out_dir = "out-fineweb-gpu-{embedding}"
device = "cuda"
dtype = "bfloat16"
compile = True
lean_head = True

n_layer = 8
n_head = 8
n_embd = 512
block_size = 1024
dropout = 0.0  # one pass over fresh web text: nothing to regularise
# LEV's ids per chunk: untuned guess (a 65k-token micro-batch holds tens of thousands of distinct
# o200k ids); tests/gpu_check.sh step 4 times 256, 1024 and 4096
lev_chunk = 1024

# 64 x 1,024 x 8 = 524,288 tokens per step, 5,000 steps = 2.62B tokens (see the budget above)
batch_size = 64
gradient_accumulation_steps = 8
max_iters = 5000
learning_rate = 1e-3  # smaller models take larger rates; nanoGPT's 124M uses 6e-4
min_lr = 1e-4
warmup_iters = 250
lr_decay_iters = 5000
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0

# every 250 steps (131M tokens): 20 x 64 = 1,280 fixed windows per split, 1.3M tokens each, forward
# only: <1% of the 250 training steps' work; eval.py afterwards scores the whole val split
eval_interval = 250
eval_iters = 20
log_interval = 10
