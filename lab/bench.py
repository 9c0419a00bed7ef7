r"""
Measure speed and memory of the arms, of LEV alone, and of generation.

    python lab/bench.py                                  # CPU, the small Tiny Shakespeare config
    python lab/bench.py --device=cuda --compile --n_layer=6 --n_head=6 --n_embd=384 \
        --block_size=256 --batch_size=64

Three tables:
  1. training step (forward + backward + clip + AdamW step) per arm: ms/step, tokens/s, model FLOPs
     per token and the GFLOP/s achieved (see model_flops_per_token: comparable with any
     implementation counted the same way), peak memory, ratio to tied. The arms are timed in the
     same process, interleaved step by step in rounds whose order rotates, and the ratio to tied is
     the median over rounds of the arm's step over tied's in the same round: machine noise hits both
     sides of a ratio alike. Beside lev, its recipe as leviathan.py writes it, compiled (what runs
     after an edit of LEV), and with --lev_recipe=PATH that of another copy of leviathan.py, with
     their ratio to lev's step and the time it took to compile them.
  2. LEV alone against nn.Embedding for N ids, forward + backward: the plain recipe (LEV.reference),
     the fast path with its C kernels (CPU: what training uses there), its torch kernels compiled
     and eager, and the one-off cost of materialising the whole V x n_embd table.
  3. generation: tokens/s for --gen_tokens new tokens (greedy, batch 1), as sample.py runs it,
     with and without the KV cache, and with the model compiled (sample.py --compile;
     --no-gen_compile skips it); with --nanogpt=PATH/model.py, karpathy/nanoGPT's generate at the
     same shape too. The variants take turns, --gen_rounds times; the median counts.
Batches come from data/<dataset>/train.bin when it exists (real text: a Tiny Shakespeare batch of
2,048 tokens holds ~800 distinct ids, which is what LEV's cost depends on), else from a Zipf(1.1)
stand-in, said so.
"""

import argparse
import copy
import importlib.util
import json
import math
import multiprocessing
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

import leviathan
from kernels.compiled_lev import CompiledRecipe
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import check_lev, install_fast_paths
from lab import cli
from lab.cli import atomic_path
from lab.dataset import load_meta, load_split
from lab.devices import resolve_device
from leviathan import EMBEDDINGS, LEV, Config

ARMS_DEFAULT = ",".join(("tied", "untied", "lev"))


def make_parser():
    p = cli.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                           epilog=__doc__.split("\n\n", 2)[2],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="autocast dtype (auto: bfloat16 on CUDA when supported, else float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the models")
    p.add_argument("--embedding", default=ARMS_DEFAULT,
                   help=f"comma-separated arms, from {', '.join(EMBEDDINGS)}")
    p.add_argument("--tables", default="train,lev,gen", help="which tables to run: train, lev, gen")
    p.add_argument("--dataset", default="shakespeare",
                   help="batches from data/DATASET/train.bin when it exists")
    p.add_argument("--vocab_size", type=int, default=50257, help="V when no dataset is found")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lev_chunk", type=int, default=64, help="ids per chunk of LEV's fast path")
    p.add_argument("--heads", default="lean,full",
                   help="table 1: the loss from the memory-lean head (lean, what train.py uses), "
                        "from full logits (full), or both")
    p.add_argument("--lev_c_kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="table 1: LEV's C kernels on CPU (kernels/lev_kernels.c; "
                        "--no-lev_c_kernels: torch's kernels); table 2 times all three")
    p.add_argument("--lev_compile", action=argparse.BooleanOptionalAction, default=True,
                   help="table 1, where the C kernels do not run: torch.compile LEV's torch "
                        "kernels, and the row 'lev, recipe compiled' (--no-lev_compile: eager, "
                        "'lev, recipe as written')")
    p.add_argument("--lev_recipe", default=None, metavar="PATH/leviathan.py",
                   help="table 1: also time the lev arm of another copy of leviathan.py (one you "
                        "edited, say) with its recipe, beside this one's")
    p.add_argument("--steps", type=int, default=10,
                   help="timed training steps per arm (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first")
    p.add_argument("--lev_ids", type=int, default=8192, help="N for table 2 (all distinct, random)")
    p.add_argument("--lev_embd", type=int, default=256, help="n_embd for table 2")
    p.add_argument("--plain_max", type=int, default=1024,
                   help="time the plain recipe on at most this many of the N ids (it needs ~1.5 GB "
                        "per 1,000)")
    p.add_argument("--gen_tokens", type=int, default=500)
    p.add_argument("--gen_rounds", type=int, default=3,
                   help="table 3: rounds, each timing every variant once")
    p.add_argument("--gen_compile", action=argparse.BooleanOptionalAction, default=True,
                   help="table 3: also time the compiled model (sample.py --compile; compiling "
                        "takes ~10-40 s per arm)")
    p.add_argument("--nanogpt", default=None, metavar="PATH/model.py",
                   help="table 3: also time karpathy/nanoGPT's generate (its model.py, not part "
                        "of this project), side by side")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    return p


def parse_args(argv=None):
    """The flags, checked before any work: arms, tables, heads, numbers, sizes (leviathan.Config's
    own checks), the device, --json's folder, and whether the data can serve the batches."""
    p = make_parser()
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.embedding.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in EMBEDDINGS]
    if bad or not args.arms:
        p.error(f"unknown arm(s) {', '.join(bad) or repr(args.embedding)}; "
                f"choose from {', '.join(EMBEDDINGS)}")
    args.tables = set(args.tables.split(","))
    if not args.tables <= {"train", "lev", "gen"}:
        p.error(f"--tables={','.join(sorted(args.tables))}: choose among train, lev, gen")
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not args.heads or set(args.heads) - {"lean", "full"}:
        p.error(f"--heads={','.join(args.heads)}: choose lean, full or both (comma-separated)")
    lev_lean_train = "lev" in args.arms and "lean" in args.heads and "train" in args.tables
    if args.lev_recipe and not lev_lean_train:
        p.error("--lev_recipe times a row of table 1's lev arm with the lean head: it needs "
                "--tables with train, --embedding with lev and --heads with lean")
    try:
        Config(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
               n_head=args.n_head, n_embd=args.n_embd)  # the model's own checks, before any work
        Config(vocab_size=args.vocab_size, n_embd=args.lev_embd, n_head=1)
        check_numbers(p, args)
        args.device = resolve_device(args.device)
        if args.json is not None:
            cli.check_output_file(args.json, "--json")
        if args.lev_recipe is not None and not os.path.isfile(args.lev_recipe):
            raise ValueError(f"--lev_recipe={args.lev_recipe}: no such file; give the path of a "
                             f"copy of leviathan.py")
        batch_source(args)  # the data can serve the batches
    except (ValueError, OSError) as e:
        p.error(str(e).removeprefix("Config: "))
    if args.dtype == "auto":
        bf16 = args.device == "cuda" and torch.cuda.is_bf16_supported()
        args.dtype = "bfloat16" if bf16 else "float32"
    if args.device == "cuda":  # as train.py
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return args


def check_numbers(p, args):
    """Ranges of the numeric flags (the model's sizes are checked by leviathan.Config)."""
    minimum = {"batch_size": 1, "lev_chunk": 1, "steps": 1, "warmup": 0, "lev_ids": 1,
               "plain_max": 1, "gen_tokens": 1, "gen_rounds": 1, "seed": 0}
    for name, low in minimum.items():
        if getattr(args, name) < low:
            p.error(f"--{name}={getattr(args, name)} must be >= {low}")
    if args.seed >= 2 ** 63:
        p.error(f"--seed={args.seed} must be < 2^63")
    if "lev" in args.tables and args.lev_ids > args.vocab_size:
        p.error(f"--lev_ids={args.lev_ids} distinct ids need --vocab_size >= {args.lev_ids}")


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def timed(device, fn, *args):
    """Seconds one call fn(*args) takes, the device's queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - t0


def batch_source(args):
    """(vocab_size, get_batch(generator) -> (x, y), description)."""
    path = os.path.join("data", args.dataset, "train.bin")
    if os.path.exists(path):
        meta = load_meta(os.path.join("data", args.dataset))
        data = load_split(os.path.join("data", args.dataset), "train")
        vocab_size, what = meta["vocab_size"], path
    else:
        rng = np.random.default_rng(args.seed)
        data = rng.zipf(1.1, size=2_000_000) - 1
        data = data[data < args.vocab_size]  # rejection, not clamping: no pile-up on the last id
        vocab_size = args.vocab_size
        what = f"Zipf(1.1) ids over V={args.vocab_size} ({path} not found)"
    T = args.block_size
    if len(data) <= T + 1:
        raise ValueError(f"--block_size={T} is longer than the {len(data):,} tokens of {what}")

    def get_batch(gen):
        ix = torch.randint(len(data) - T - 1, (args.batch_size,), generator=gen).tolist()
        x = torch.stack([torch.from_numpy(np.asarray(data[i:i + T], dtype=np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(np.asarray(data[i + 1:i + 1 + T], dtype=np.int64))
                         for i in ix])
        return x.to(args.device), y.to(args.device)

    return vocab_size, get_batch, what


def install(model, args, head="lean", lev_runs="fast"):
    """The fast paths of table 1's arms: as train.py installs them (lev_runs="fast"), or LEV's
    recipe alone, compiled where --lev_compile (lev_runs="recipe", where an edit puts it)."""
    recipe = [CompiledRecipe()] if args.lev_compile else []
    fast = [FastEmbedder(args.lev_chunk, args.lev_c_kernels, args.lev_compile)] + recipe
    return install_fast_paths(model, lev=fast if lev_runs == "fast" else recipe,
                              lean_head=head == "lean")


def new_model(arm, vocab_size, args, model_file=None):
    """A model of leviathan.py, or of the copy of it at model_file."""
    module = leviathan
    if model_file is not None:
        spec = importlib.util.spec_from_file_location("leviathan_copy", model_file)
        module = sys.modules["leviathan_copy"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # (registered: torch.compile looks its code up by name)
    torch.manual_seed(args.seed)
    config = module.Config(vocab_size=vocab_size, block_size=args.block_size,
                           n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           embedding=arm)
    return module.GPT(config).to(args.device)


def train_variants(args):
    """Table 1's rows: name -> (arm, head, LEV's fast path as install() takes it, model file)."""
    rows = {arm if head == "lean" else f"{arm} (full head)": (arm, head, "fast", None)
            for arm in args.arms for head in args.heads}
    if "lev" in args.arms and "lean" in args.heads:  # where an edit of LEV puts it
        how = "compiled" if args.lev_compile else "as written"
        rows[f"lev, recipe {how}"] = ("lev", "lean", "recipe", None)
        if args.lev_recipe:
            rows[f"lev of {args.lev_recipe}, recipe {how}"] = ("lev", "lean", "recipe",
                                                               args.lev_recipe)
    return rows


def build(arm, vocab_size, args, head="lean", lev_runs="fast", model_file=None):
    """A model with train.py's fast paths (or LEV's recipe compiled), and its optimizer."""
    model = new_model(arm, vocab_size, args, model_file)
    install(model, args, head, lev_runs)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95),
                                  fused=args.device == "cuda")  # as train.py
    return model, optimizer


def train_step(model, optimizer, x, y, args):
    dtype = getattr(torch, args.dtype)
    ctx = torch.autocast(args.device, dtype=dtype, enabled=args.dtype != "float32")
    with ctx:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def backbone_flops_per_token(model):
    """6 * backbone parameters + attention's 12 * n_layer * block_size * n_embd (PaLM appendix B):
    the backbone's forward + backward FLOPs per token, excluding the embedding and the head."""
    c = model.config
    return 6 * model.param_report()["backbone"] + 12 * c.n_layer * c.block_size * c.n_embd


def lev_forward_flops_per_id(config):
    """LEV's forward arithmetic for one distinct id, as the fast path does it: the seed maps 2 h
    d^2, the 3-knot splines 6 h d r (3 multiply-adds per value), their product h d r, and W_out 2 h
    r n_embd (the seed sums, LayerNorm, sigmoid and logs are O(h d) and left out)."""
    h, d, r = config.lev_heads, config.lev_seed_dim, config.lev_rank
    return 2 * h * d * d + 6 * h * d * r + h * d * r + 2 * h * r * config.n_embd


def model_flops_per_token(model, distinct_per_token):
    """Training FLOPs per token (forward + backward = 3x forward, recomputation not counted, as in
    MFU): the backbone (backbone_flops_per_token), the head 6 V n_embd, and the input embedding: 0
    for a table (a lookup), 3x LEV's forward per distinct id for lev, times the distinct ids per
    token of the batch, and for digits and factorized their linear map's 6 x its size per token
    (its input's width d_seed or E, times n_embd)."""
    c = model.config
    flops = backbone_flops_per_token(model) + 6 * c.vocab_size * c.n_embd
    if c.embedding == "lev":
        flops += 3 * lev_forward_flops_per_id(c) * distinct_per_token
    if c.embedding in ("digits", "factorized"):
        flops += 6 * model.tok_emb.proj.numel()
    return flops


def peak_memory_child(variant, args, queue):
    """In a fresh process, this arm alone: two training steps, then the peak memory in MiB (CUDA:
    the most allocated; CPU: peak resident memory, VmHWM, as ru_maxrss would carry the parent's peak
    across exec)."""
    torch.set_num_threads(1)
    vocab_size, get_batch, _ = batch_source(args)
    model, optimizer = build(variant[0], vocab_size, args, *variant[1:])
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(2):
        train_step(model, optimizer, *get_batch(gen), args)
    if args.device == "cuda":
        queue.put(torch.cuda.max_memory_allocated() / 2**20)
        return
    with open("/proc/self/status") as f:
        hwm = [line for line in f if line.startswith("VmHWM:")]
    if hwm:
        queue.put(int(hwm[0].split()[1]) / 1024)
    else:
        queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def peak_memory_mib(variant, args):
    """Peak memory of a training step of one arm, measured in a fresh process so that arms do not
    mix."""
    if args.device not in ("cpu", "cuda"):
        return float("nan")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=peak_memory_child, args=(variant, args, queue))
    child.start()
    peak = queue.get()
    child.join()
    return peak


KERNEL_NAMES = {"c": "C (lev_kernels.c)", "compiled": "torch, compiled", "eager": "torch, eager"}


def kernels_in_training(lev, device):
    """Which of its kernels a LEV with its fast path uses in training on device
    (FastEmbedder.kernels)."""
    with torch.enable_grad():
        return lev.fast_embed.kernels(torch.empty(0, 1, 1, device=device), lev.spline)


def lev_kernels(args):
    """What table 1's LEV runs, named: a tiny LEV with table 1's settings asks
    FastEmbedder.kernels."""
    probe = LEV(Config(vocab_size=2, n_embd=8, n_head=1, lev_seed_dim=2, lev_heads=1, lev_knots=3,
                       lev_rank=1))
    probe.fast_embed = FastEmbedder(c_kernels=args.lev_c_kernels, compile_kernels=args.lev_compile)
    return KERNEL_NAMES[kernels_in_training(probe, args.device)]


def time_steps(steppers, get_batch, args):
    """Rounds of one training step of each variant on the same batch, the order rotating from round
    to round -> ({variant: seconds of each step after the warmup}, distinct ids of each batch,
    {variant: seconds of its first step})."""
    gen = torch.Generator().manual_seed(args.seed)
    times = {key: [] for key in steppers}
    first, distinct = {}, []
    keys = list(steppers)
    for i in range(args.warmup + args.steps):
        x, y = get_batch(gen)  # every arm gets the same batch
        distinct.append(len(torch.unique(x)))
        for arm in keys[i % len(keys):] + keys[:i % len(keys)]:
            model, opt = steppers[arm]
            t = timed(args.device, train_step, model, opt, x, y, args)
            if i >= args.warmup:
                times[arm].append(t)
            first.setdefault(arm, t)
    return times, distinct, first


def train_table(args, results):
    vocab_size, get_batch, what = batch_source(args)
    print(f"\n## Training step: forward + backward + AdamW, "
          f"batch {args.batch_size} x {args.block_size} tokens, "
          f"{args.n_layer} layers x {args.n_head} heads x {args.n_embd}, {args.device} {args.dtype}"
          f"{' compiled' if args.compile else ''}, LEV kernels {lev_kernels(args)}"
          f"\nbatches: {what}")
    # each arm with each head: "tied" (the lean head, what train.py uses), "tied (full head)", ...
    variants = train_variants(args)
    models, built_in = {}, {}
    for key, (arm, *rest) in variants.items():
        start = time.perf_counter()
        models[key] = build(arm, vocab_size, args, *rest)  # (model, optimizer)
        built_in[key] = time.perf_counter() - start  # with the fast paths' check (and compiling)
    if args.compile:
        # the models share GPT.forward's code: dynamo keeps an entry per model (more where grad mode
        # or shapes differ) and, past its limit (8), silently runs the rest eager as "compiled"
        torch._dynamo.config.cache_size_limit = max(8, 4 * len(models))
    steppers = {key: (torch.compile(m) if args.compile else m, opt)
                for key, (m, opt) in models.items()}
    times, distinct, first = time_steps(steppers, get_batch, args)
    tokens = args.batch_size * args.block_size
    print(f"distinct ids per batch: {statistics.median(distinct):.0f} of {tokens}\n")
    print("| arm | params (input / backbone / head) | ms/step | tokens/s | MFLOP/token | GFLOP/s "
          "| peak memory (MiB) | vs tied, same head |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for key, (_, head, *_) in variants.items():
        ms = statistics.median(times[key]) * 1000
        tied = "tied" if head == "lean" else "tied (full head)"
        # paired: the median over rounds of this arm's step over tied's in the same round, so that a
        # slow spell of the machine, which lasts seconds, slows both sides of a ratio alike
        if tied in times:
            ratio = statistics.median(a / b for a, b in zip(times[key], times[tied], strict=True))
        else:
            ratio = float("nan")
        mem = peak_memory_mib(variants[key], args)
        rep = models[key][0].param_report()
        flops = model_flops_per_token(models[key][0], statistics.median(distinct) / tokens)
        rows[key] = {"params": rep, "head": head, "ms_per_step": ms, "peak_memory_mib": mem,
                     "over_tied": ratio, "tokens_per_s": tokens / ms * 1e3,
                     "model_flops_per_token": flops, "gflop_per_s": flops * tokens / ms * 1e3 / 1e9}
        print(f"| {key} | {rep['input_embedding']:,} / {rep['backbone']:,} / {rep['head']:,} | "
              f"{ms:.0f} | {rows[key]['tokens_per_s']:,.0f} | {flops / 1e6:.1f} | "
              f"{rows[key]['gflop_per_s']:.1f} | {mem:,.0f} | "
              f"{'-' if math.isnan(ratio) else f'{ratio:.3f}'} |")
    if args.device == "cuda":
        peak = 989e12  # H100/H200 dense bf16 tensor-core peak; other GPUs: scale by their own
        for arm, row in rows.items():
            flops = backbone_flops_per_token(models[arm][0])
            row["backbone_mfu"] = flops * row["tokens_per_s"] / peak
            print(f"{arm}: backbone MFU {row['backbone_mfu']:.1%} (of 989 TFLOP/s bf16)")
    results["train"] = rows
    for key in (k for k in rows if k.startswith("lev") and ", recipe " in k):
        ratio = statistics.median(a / b for a, b in zip(times[key], times["lev"], strict=True))
        rows[key]["over_lev"] = ratio
        print(f"{key}: {ratio:.3f} x lev's step (paired rounds); built and checked in "
              f"{built_in[key]:.1f} s (compiling, where compiled), its first step "
              f"{first[key]:.1f} s")
    if "lev" in rows and "tied" in rows:
        results["lev_over_tied"] = rows["lev"]["over_tied"]


def lev_modules(args):
    """Three LEVs of the same weights, their fast path on torch's compiled kernels, torch's eager
    ones and the C kernels -> (compiled, eager, c, whether the fast path is on, whether C runs)."""
    config = Config(vocab_size=args.vocab_size, n_embd=args.lev_embd, n_head=1)
    torch.manual_seed(args.seed)
    lev = LEV(config).to(args.device)
    eager, c = LEV(config).to(args.device), LEV(config).to(args.device)
    eager.load_state_dict(lev.state_dict())
    c.load_state_dict(lev.state_dict())
    lev.fast_embed = FastEmbedder(args.lev_chunk, c_kernels=False)  # torch's kernels, compiled
    eager.fast_embed = FastEmbedder(args.lev_chunk, c_kernels=False, compile_kernels=False)
    c.fast_embed = FastEmbedder()  # the C kernels where they build
    # an edited recipe: the fast path steps aside (one line), and only the plain rows are timed;
    # the compiled and the C kernels compute what the eager ones do (tests/test_fast_lev.py)
    check_lev(eager, say=print)
    fast = eager.fast_embed is not None
    return lev, eager, c, fast, fast and kernels_in_training(c, args.device) == "c"


def lev_table(args, results):
    N, D, V = args.lev_ids, args.lev_embd, args.vocab_size
    print(f"\n## LEV alone: N ids -> (N, {D}), forward + backward, V = {V:,}, {args.device}")
    lev, eager, c, fast, with_c = lev_modules(args)
    emb = torch.nn.Embedding(V, D).to(args.device)
    ids = torch.randperm(V, device=args.device)[:N]  # all distinct: the worst case for LEV
    _, get_batch, what = batch_source(argparse.Namespace(**{**vars(args), "vocab_size": V}))
    text_ids = get_batch(torch.Generator().manual_seed(args.seed))[0].flatten() % V

    def fwd_bwd(fn, x):
        fn(x).square().mean().backward()
        # no gradient accumulation into old .grad between repeats
        for module in (lev, eager, c, emb):
            module.zero_grad(set_to_none=True)

    def median_ms(repeats, fn, *fn_args):
        fn(*fn_args)  # warm-up (and, for compiled kernels, compilation)
        return statistics.median(timed(args.device, fn, *fn_args) for _ in range(repeats)) * 1000

    text = f"a text batch ({len(text_ids):,} ids, {len(text_ids.unique()):,} distinct)"
    fast_ones = [("C", c)] if with_c else []
    fast_ones += [("compiled torch", lev), ("eager torch", eager)] if fast else []
    rows = {f"nn.Embedding, {N:,} ids": median_ms(5, fwd_bwd, emb, ids)}
    for kernels, module in fast_ones:
        ms = median_ms(3, fwd_bwd, module, ids)
        rows[f"LEV fast path, {kernels} kernels, {N:,} distinct ids"] = ms
    rows[f"nn.Embedding, {text}"] = median_ms(5, fwd_bwd, emb, text_ids)
    for kernels, module in fast_ones:
        ms = median_ms(5, fwd_bwd, module, text_ids)
        rows[f"LEV fast path, {kernels} kernels, {text}"] = ms
    n_plain = min(N, args.plain_max)
    ms = median_ms(1, fwd_bwd, lev.reference, ids[:n_plain])
    rows[f"LEV plain recipe (LEV.reference), {n_plain:,} distinct ids"] = ms
    if n_plain < N and fast:
        ms = median_ms(3, fwd_bwd, c if with_c else lev, ids[:n_plain])
        rows[f"LEV fast path, {'C' if with_c else 'compiled torch'} kernels, "
             f"the same {n_plain:,} ids"] = ms
    ms = median_ms(1, (c if with_c else lev if fast else eager).table)
    rows[f"LEV materialise the whole {V:,} x {D} table (no grad)"] = ms
    print(f"text batch: {what}\n\n| what | ms |\n|---|---:|")
    for k, v in rows.items():
        print(f"| {k} | {v:,.1f} |")
    results["lev"] = rows


def gen_table(args, results):
    vocab_size, _, _ = batch_source(args)
    n = args.gen_tokens
    print(f"\n## Generation: {n} new tokens, greedy, batch 1, block_size {args.block_size}, "
          f"{args.device}, float32, {torch.get_num_threads()} threads, median of "
          f"{args.gen_rounds} interleaved rounds (random-init models; speed does not depend on the "
          f"weights)")
    print("| model | KV cache | steps | tokens/s |" + (" vs nanoGPT |" if args.nanogpt else "")
          + "\n|---|---|---|---:|" + ("---:|" if args.nanogpt else ""))
    prompt = torch.zeros(1, 1, dtype=torch.long, device=args.device)
    variants = []  # (name, KV cache, steps, generate(max_new_tokens))
    if args.nanogpt:
        nano = nanogpt_model(args, vocab_size)
        variants.append(("nanoGPT", False, "eager", lambda k: nano.generate(prompt, k, top_k=1)))
    for arm in args.arms:
        model = new_model(arm, vocab_size, args).eval()
        install_fast_paths(model, lev=FastEmbedder(compile_kernels=False))  # as sample.py
        for kv in (True, False):
            variants.append((arm, kv, "eager", lambda k, m=model, kv=kv: m.generate(
                prompt, k, 0.0, use_cache=kv)))
        if args.gen_compile:  # sample.py --compile: the same weights, the model compiled
            compiled = copy.copy(model)
            compiled.next_logits = torch.compile(compiled.next_logits)
            variants.append((arm, True, "compiled", lambda k, m=compiled: m.generate(
                prompt, k, 0.0)))
    for *_, generate in variants:  # warm-up: all n tokens, so that a compiled model meets every
        generate(n)                # shape (the window's jumps) before it is timed
    seconds = [[] for _ in variants]
    for _ in range(args.gen_rounds):
        for i, (*_, generate) in enumerate(variants):
            seconds[i].append(timed(args.device, generate, n))
    rows = []
    for (name, kv, steps, _), s in zip(variants, seconds, strict=True):
        tokens_per_s = n / statistics.median(s)
        rows.append({"model": name, "kv_cache": kv, "steps": steps, "tokens_per_s": tokens_per_s})
    nano_rate = rows[0]["tokens_per_s"] if args.nanogpt else None
    for row in rows:
        ratio = f" {row['tokens_per_s'] / nano_rate:.2f}x |" if nano_rate else ""
        print(f"| {row['model']} | {'on' if row['kv_cache'] else 'off'} | {row['steps']} | "
              f"{row['tokens_per_s']:,.0f} |{ratio}")
    results["generation"] = rows


def nanogpt_model(args, vocab_size):
    """karpathy/nanoGPT's GPT from the model.py at --nanogpt, at table 3's shape (no bias, no
    dropout, as this project's backbone), in eval mode."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", args.nanogpt)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.GPTConfig(block_size=args.block_size, vocab_size=vocab_size,
                              n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                              dropout=0.0, bias=False)
    torch.manual_seed(args.seed)
    return module.GPT(config).to(args.device).eval()


def main(argv=None):
    args = parse_args(argv)
    flags = {k: v if not isinstance(v, set) else sorted(v) for k, v in vars(args).items()}
    results = {"args": flags, "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}")
    if "train" in args.tables:
        train_table(args, results)
    if "lev" in args.tables:
        lev_table(args, results)
    if "gen" in args.tables:
        gen_table(args, results)
    if "lev_over_tied" in results:
        print(f"\nlev_over_tied (training step time ratio): {results['lev_over_tied']:.3f}")
    if args.json:
        with atomic_path(args.json) as tmp, open(tmp, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
