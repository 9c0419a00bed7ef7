"""
Time and memory of the LM head + loss: the usual one (N x V logits, then F.cross_entropy) against lean_head's.

    python bench_head.py                                           # both tables at V = 50,257 and 200,376
    python bench_head.py --tables=head --variants=full,lean:256,lean:1024,recompute:512

Variants: `full` is GPT.forward's head (logits = head(x), F.cross_entropy on all N x V of them); `lean:C` is
linear_cross_entropy with chunks of C tokens, gradients computed during forward (its default); `recompute:C`
the same with recompute=True (forward keeps only the log-sum-exp, backward recomputes the logits); `lean` and
`recompute` alone use the default chunk size. Two tables, per V:
  1. head: the head + loss alone, forward + backward, on random hidden states (N = batch_size x block_size).
  2. step: a whole training step of leviathan.GPT (forward + backward + clip + AdamW), with GPT.forward's body
     reproduced in gpt_loss so that only the loss computation differs.
Times are medians of variants interleaved repeat by repeat in one process (machine noise hits all alike). Peak
memory is measured for each variant in a fresh process (VmHWM, peak resident memory, after two iterations):
for the head table, "head MiB" is that peak minus the process's resident memory just before the first one.
"""

import argparse
import json
import multiprocessing
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lean_head import default_chunk_size, linear_cross_entropy
from leviathan import GPT, Config


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="head,step", help="which tables: head, step")
    p.add_argument("--vocab_sizes", default="50257,200376")
    p.add_argument("--variants", default="full,lean,recompute", help="full, lean[:C], recompute[:C]")
    p.add_argument("--embedding", default="tied", help="the arm of the step table: tied, untied, lev")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per variant (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per variant first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure peak memory (a fresh process per variant and table)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    args.tables = args.tables.split(",")
    if not set(args.tables) <= set(SETUPS):
        p.error(f"--tables={','.join(args.tables)}: choose among head, step")
    args.vocab_sizes = [int(v) for v in args.vocab_sizes.split(",")]
    args.variants = args.variants.split(",")
    for v in args.variants:
        if v.split(":")[0] not in ("full", "lean", "recompute") or (v.startswith("full") and v != "full"):
            p.error(f"--variants: {v!r} is not full, lean[:C] or recompute[:C]")
    return args


def head_loss(variant, x, weight, targets):
    """The mean cross-entropy of x @ weight^T, as `variant` computes it. x: (B, T, D) or (N, D)."""
    if variant == "full":  # GPT.forward's two lines
        logits = F.linear(x, weight)  # (..., V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
    kind, _, chunk = variant.partition(":")
    return linear_cross_entropy(x, weight, targets, chunk_size=int(chunk) if chunk else None,
                                recompute=kind == "recompute")


def gpt_loss(model, idx, targets, variant):
    """GPT.forward(idx, targets)'s loss (leviathan.py, training path: no KV cache, no id check), with the head +
    loss computed by `variant`. GPT.forward itself is left as it is; tests/test_lean_head.py checks that both agree."""
    T = idx.shape[1]
    x = model.drop(model.tok_emb(idx))  # (B, T, n_embd)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for block in model.blocks:
        x = block(x, cos, sin)
    return head_loss(variant, model.norm(x), model.head.weight, targets)


def head_setup(V, args):
    """Random hidden states and head at the model's scale, and uniform targets -> a forward + backward closure."""
    gen = torch.Generator().manual_seed(args.seed)
    N, D = args.batch_size * args.block_size, args.n_embd
    x = torch.randn(N, D, generator=gen).requires_grad_()  # (N, D), like RMSNorm's output
    weight = (0.02 * torch.randn(V, D, generator=gen)).requires_grad_()  # (V, D), GPT's init
    targets = torch.randint(V, (N,), generator=gen)  # (N,)

    def run(variant):
        head_loss(variant, x, weight, targets).backward()
        x.grad = weight.grad = None
    return run


def step_setup(V, args):
    """A GPT and its AdamW per variant (same init, built at the variant's first step, a warm-up one by default),
    one batch of uniform ids -> a training-step closure."""
    config = Config(vocab_size=V, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd, embedding=args.embedding)
    gen = torch.Generator().manual_seed(args.seed)
    idx, targets = (torch.randint(V, (args.batch_size, args.block_size), generator=gen) for _ in range(2))
    models = {}

    def run(variant):
        if variant not in models:
            torch.manual_seed(args.seed)
            model = GPT(config)
            models[variant] = model, model.configure_optimizers(0.1, 1e-3)
        model, optimizer = models[variant]
        gpt_loss(model, idx, targets, variant).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


SETUPS = {"head": head_setup, "step": step_setup}


def resident_mib(field):
    """VmRSS (now) or VmHWM (peak so far) of this process, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def peak_memory_child(table, V, variant, args, queue):
    if args.threads:
        torch.set_num_threads(args.threads)
    run = SETUPS[table](V, args)
    before = resident_mib("VmRSS")
    for _ in range(2):
        run(variant)
    queue.put((resident_mib("VmHWM"), before))


def peak_memory_mib(table, V, variant, args):
    """(peak resident MiB, resident MiB before the first iteration) of `variant`, alone in a fresh process."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=peak_memory_child, args=(table, V, variant, args, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def interleaved_ms(run, args):
    """variant -> median ms of run(variant), the variants taking turns at every repeat."""
    times = {v: [] for v in args.variants}
    for i in range(args.warmup + args.repeats):
        for v in args.variants:
            t0 = time.perf_counter()
            run(v)
            if i >= args.warmup:
                times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(t) * 1000 for v, t in times.items()}


def table(name, V, args):
    N = args.batch_size * args.block_size
    what = "head + loss alone, forward + backward" if name == "head" else \
        f"training step of GPT {args.embedding} ({args.n_layer} x {args.n_head} x {args.n_embd}), AdamW"
    print(f"\n## {what}: V = {V:,}, N = {N:,} tokens, float32, default chunk {default_chunk_size(V)} tokens\n")
    ms = interleaved_ms(SETUPS[name](V, args), args)
    print("| variant | ms | vs full | peak MiB | head MiB |\n|---|---:|---:|---:|---:|")
    rows = {}
    for v in args.variants:
        peak, before = peak_memory_mib(name, V, v, args) if args.memory else (float("nan"), float("nan"))
        rows[v] = {"ms": ms[v], "peak_mib": peak, "before_mib": before,
                   "over_full": ms[v] / ms["full"] if "full" in ms else float("nan")}
        own = f"{peak - before:,.0f}" if name == "head" and args.memory else "-"
        print(f"| {v} | {ms[v]:,.0f} | {rows[v]['over_full']:.2f} | {f'{peak:,.0f}' if args.memory else '-'} | {own} |")
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for name in args.tables:
        results[name] = {V: table(name, V, args) for V in args.vocab_sizes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
