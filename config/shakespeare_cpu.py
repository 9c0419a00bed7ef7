# Tiny Shakespeare with GPT-2 BPE (V = 50,257), small enough for a laptop CPU. The arm is a flag:
#   python prepare_data.py shakespeare
#   python train.py config/shakespeare_cpu.py                     # Leviathan (LEV, untied head)
#   python train.py config/shakespeare_cpu.py --embedding=tied    # baseline: one shared table
#   python train.py config/shakespeare_cpu.py --embedding=untied  # baseline: table + separate head
# Every arm draws the same batches and is validated on the same tokens. LEV keeps leviathan.Config's
# (the paper's) settings: lev_digits=3, lev_seed_dim=128, lev_heads=8, lev_knots=16, lev_rank=64.

dataset = "shakespeare"
out_dir = "out-shakespeare-cpu-{embedding}"
device = "cpu"

# model: a 4 x 4 x 128 Transformer over 128-token contexts
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0

# 300 steps of 16 x 128 = 2,048 tokens: 614k tokens, about 2 passes over the 302k training tokens
# (the README's quick start says how long an arm takes). The cosine decay ends at max_iters
# (lr_decay_iters left at 0), so that --max_iters=20 shortens the decay; the 30 warmup steps stay
# (a run of 20 steps never leaves them): shorten them too with --warmup_iters.
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 300
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 30
weight_decay = 0.1
grad_clip = 1.0

# the val split is only 36,059 tokens (281 windows of 128): evaluate on all of it
eval_interval = 50
eval_iters = 0
log_interval = 10
