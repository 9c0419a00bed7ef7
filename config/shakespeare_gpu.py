# Tiny Shakespeare with GPT-2 BPE on one GPU (or several with torchrun): nanoGPT's 6 x 6 x 384
# Shakespeare model.
#   python prepare_data.py shakespeare
#   python train.py config/shakespeare_gpu.py                       # Leviathan
#   python train.py config/shakespeare_gpu.py --embedding=tied      # baseline
#   torchrun --standalone --nproc_per_node=4 train.py config/shakespeare_gpu.py
# 302k training tokens are few for this model: it overfits after a few passes, hence dropout and a
# short run.

dataset = "shakespeare"
out_dir = "out-shakespeare-gpu-{embedding}"
device = "cuda"
dtype = "bfloat16"
compile = True

n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
dropout = 0.2
# LEV's ids per chunk: the default 64 suits a CPU's caches; a GPU is only filled by far more work
# per kernel (a 16,384-token batch holds a few thousand distinct ids). Not tuned: no GPU was at hand
# to measure it.
lev_chunk = 1024

# 2,000 steps of 64 x 256 = 16,384 tokens: 33M tokens, about 100 passes over the training split
batch_size = 64
gradient_accumulation_steps = 1
max_iters = 2000
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
lr_decay_iters = 2000
beta2 = 0.99
weight_decay = 0.1
grad_clip = 1.0

eval_interval = 100
eval_iters = 0  # the whole val split: 140 windows of 256
log_interval = 10
