"""
Retrofit: LEV fitted to a trained tied or untied run's input table, written as a lev checkpoint
that train.py fine-tunes as any other.

    python lab/retrofit.py out-shakespeare-cpu-tied --out=retrofit-tied.pt
    python train.py config/shakespeare_cpu.py --init_from=retrofit-tied.pt --out_dir=out-retrofit-ft

The new lev model has RUN's architecture (n_layer, n_head, n_embd, block_size, its vocabulary;
LEV's own settings, the lev_* flags, default to leviathan.Config's), RUN's backbone and head (a
tied table becomes a head of its own: transplant), and a LEV fitted to RUN's input table T: Adam on
LEV's parameters alone, no backbone involved, on fit_batch ids a step drawn by fit_weights from
the training split's counts, through LEV's fast path (kernels/). The fit prints its figures, and
the checkpoint keeps them under "retrofit". With --tune_steps, LEV is then trained alone inside the
model (backbone and head frozen) on windows of the training split, to match RUN's own next-token
distribution (--tune_target=teacher) or the text's next token, with the fit's loss kept beside it
(--tune_anchor) for the ids the text never shows (docs/pretrained.md). docs/retrofit.md says more.
"""

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from kernels.compiled_lev import CompiledRecipe
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from lab import checkpoints, cli, dataset, devices
from lab.dataset import BUCKET_LOWER, BUCKETS, train_counts
from leviathan import GPT, Config
from train import check_same_tokens, get_batch, read_checkpoint

# --------------------------------------------------------------------------------------------------
# The swap, the fit and its report


def transplant(model, source_state):
    """Give a lev model a table model's backbone and head (source_state: its state_dict). The
    weights are copied into the model's own tensors, so that a tied table becomes a head of its own,
    shared with nothing. Returns the source's input table, (V, n_embd)."""
    weights = {k: v for k, v in source_state.items() if not k.startswith("tok_emb.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = list(unexpected) + [k for k in missing if not k.startswith("tok_emb.")]
    if bad:
        raise ValueError(f"the source's weights do not fit a lev model of its architecture "
                         f"({', '.join(bad[:3])})")
    return source_state["tok_emb.weight"]


def id_weights(kind, counts):
    """fit_weights -> each id's weight, (V,) float64 summing to 1 (counts: (V,) training counts)."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    weights = {"counts": counts, "seen": (counts > 0).double(),
               "uniform": torch.ones_like(counts)}[kind]
    return weights / weights.sum()


def closeness(emb, rows):
    """Per id: the relative error ||LEV(i) - T_i|| / ||T_i|| and the cosine of LEV(i) and T_i."""
    rel_error = (emb - rows).norm(dim=-1) / rows.norm(dim=-1).clamp_min(1e-30)
    return rel_error, F.cosine_similarity(emb, rows, dim=-1, eps=1e-30)


def weighted_mean_square(weights, rows):
    """The rows' mean squared norm sum_i w_i ||T_i||^2 (weights: (V,) float64), as a float."""
    return float(weights @ rows.double().pow(2).sum(-1).cpu())


def id_losses(emb, rows, kind, mean_square):
    """fit_loss per id. mse is divided by the rows' weighted mean squared norm, so that 1 is the
    loss of an all-zero LEV whatever the table's scale."""
    if kind == "mse":
        return (emb - rows).pow(2).sum(-1) / mean_square
    cosine = F.cosine_similarity(emb, rows, dim=-1, eps=1e-30)
    norms = rows.norm(dim=-1).clamp_min(1e-30)
    return (1 - cosine) + ((emb.norm(dim=-1) - norms) / norms) ** 2


def fit_lr(step, steps, lr):
    """Linear warmup over the first 5% of the steps, then cosine decay to lr / 10: the first Adam
    steps move every parameter by about lr, and LEV's product of d_seed factors amplifies that."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def fit(lev, table, weights, loss="cosine_norm", steps=4000, lr=1e-3, batch=4096, log_interval=100,
        log=print, seed=0):
    """Fit LEV's parameters, and only those, to table (V, n_embd): Adam over `steps` steps of
    `batch` ids drawn by weights (V,), by a generator of its own seeded with seed."""
    table = table.to(lev.codebooks.device, lev.codebooks.dtype)
    mean_square = weighted_mean_square(weights, table)
    optimizer = torch.optim.Adam(lev.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    t_log, since_log = time.time(), 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = fit_lr(step, steps, lr)
        ids = torch.multinomial(weights, batch, replacement=True, generator=generator)
        ids = ids.to(table.device)
        emb, rows = lev(ids), table[ids]
        step_loss = id_losses(emb, rows, loss, mean_square).mean()
        if not torch.isfinite(step_loss):
            raise ValueError(f"the retrofit's fit loss is {step_loss.item()} at fit step {step}; "
                             f"lower --fit_lr")
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        optimizer.step()
        since_log += 1
        if (step + 1) % log_interval == 0 or step + 1 == steps:
            rel_error, cosine = closeness(emb.detach(), rows)
            ms = 1000 * (time.time() - t_log) / since_log
            log(f"fit step {step + 1}/{steps} | loss {step_loss.item():.4f} | rel error "
                f"{rel_error.mean().item():.4f} | cosine {cosine.mean().item():.4f} | {ms:.0f} "
                f"ms/step")
            t_log, since_log = time.time(), 0


@torch.no_grad()
def report(lev, table, weights, counts, loss="cosine_norm"):
    """How close LEV came to the table: over all ids, weighted by the fit's weights ({"loss",
    "rel_error", "cosine"}), and per frequency bucket (bucket_report)."""
    emb = lev.table().double().cpu()
    rows = table.double().cpu()
    mean_square = weighted_mean_square(weights, rows)
    rel_error, cosine = closeness(emb, rows)
    overall = {"loss": float(weights @ id_losses(emb, rows, loss, mean_square)),
               "rel_error": float(weights @ rel_error), "cosine": float(weights @ cosine)}
    return overall, bucket_report(rel_error.numpy(), cosine.numpy(), rows.norm(dim=-1).numpy(),
                                  np.asarray(counts))


def bucket_report(rel_error, cosine, row_norm, counts):
    """Per bucket of the training split's counts (eval.py's BUCKETS): {"bucket", "ids", "tokens"},
    the table rows' mean norm ||T_i|| over the bucket's ids ("row_norm": how much a row weighs
    in mse), and the relative error and cosine averaged two ways, over the bucket's ids
    ("rel_error", "cosine") and over its training tokens, each id weighted by its count
    ("rel_error_tokens", "cosine_tokens"); None where there is nothing to average."""
    which = np.searchsorted(BUCKET_LOWER, counts, side="right") - 1
    rows = []
    for b, name in enumerate(BUCKETS):
        mask = which == b
        n, tokens = int(mask.sum()), int(counts[mask].sum())
        row = {"bucket": name, "ids": n, "tokens": tokens,
               "row_norm": float(row_norm[mask].mean()) if n else None}
        for key, values in (("rel_error", rel_error), ("cosine", cosine)):
            row[key] = float(values[mask].mean()) if n else None
            row[f"{key}_tokens"] = (float(values[mask] @ counts[mask]) / tokens if tokens
                                    else None)
        rows.append(row)
    return rows


def format_buckets(rows):
    """bucket_report's rows as a small table, one line per bucket."""
    def number(x):
        return "-" if x is None else f"{x:.4f}"

    lines = [f"{'bucket':>8} {'ids':>8} {'tokens':>10} {'row norm':>8} | over ids: rel error, "
             f"cosine | over tokens: rel error, cosine"]
    for r in rows:
        lines.append(f"{r['bucket']:>8} {r['ids']:>8,} {r['tokens']:>10,} "
                     f"{number(r['row_norm']):>8} | "
                     f"{number(r['rel_error']):>19} {number(r['cosine']):>7} | "
                     f"{number(r['rel_error_tokens']):>22} {number(r['cosine_tokens']):>7}")
    return lines


def retrofit(lev, table, train_tokens, fit_steps, fit_lr, fit_batch, fit_loss, fit_weights,
             log_interval, seed, log=print):
    """Fit LEV to the source's table with the fit_* settings, print the fit's figures and bucket
    table, and return them with the settings (the checkpoint's "retrofit")."""
    settings = {"fit_steps": fit_steps, "fit_lr": fit_lr, "fit_batch": fit_batch,
                "fit_loss": fit_loss, "fit_weights": fit_weights}
    counts = train_counts(train_tokens, table.shape[0])
    weights = id_weights(fit_weights, counts)
    log(f"retrofit: fitting LEV to the source's input table ({table.shape[0]:,} x "
        f"{table.shape[1]}), {', '.join(f'{k} {v}' for k, v in settings.items())}")
    t_start = time.time()
    try:
        fit(lev, table, weights, fit_loss, fit_steps, fit_lr, fit_batch, log_interval, log, seed)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise
        raise ValueError(f"the retrofit's fit ran out of memory with fit_batch={fit_batch} ids "
                         f"per step; lower --fit_batch (the default is 4096)") from None
    overall, buckets = report(lev, table, weights, counts, fit_loss)
    seconds = round(time.time() - t_start, 3)
    log(f"retrofit: LEV against the table, weighted by fit_weights: loss {overall['loss']:.4f}, "
        f"rel error {overall['rel_error']:.4f}, cosine {overall['cosine']:.4f} ({seconds:.1f} s); "
        f"per bucket of the training split:")
    for line in format_buckets(buckets):
        log(line)
    return {**settings, **overall, "seconds": seconds, "buckets": buckets}


def tune(model, teacher, train_tokens, table, weights, target="teacher", anchor=0.0, steps=200,
         lr=1e-3, batch_size=4, block_size=512, fit_loss="cosine_norm", fit_batch=4096,
         autocast=None, log_interval=100, log=print, seed=0):
    """Train LEV alone, in the model (backbone and head frozen), on windows of the training split:
        loss = KL(teacher || model) per position  (target "teacher": the source's next-token
               distribution), or the cross-entropy of the next token (target "text"),
             + anchor * the fit's loss on fit_batch ids drawn by weights (V,)
    The anchor keeps the ids the text never shows near their table rows: LEV is one function of
    all ids, and a step on the text's ids moves the others too. Adam, fit_lr's schedule."""
    lev = model.tok_emb
    model.requires_grad_(False)
    lev.requires_grad_(True)
    table = table.to(lev.codebooks.device, lev.codebooks.dtype)
    mean_square = weighted_mean_square(weights, table)
    optimizer = torch.optim.Adam(lev.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    autocast = autocast or contextlib.nullcontext()
    t_log, since_log = time.time(), 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = fit_lr(step, steps, lr)
        starts = torch.randint(len(train_tokens) - block_size, (batch_size,), generator=generator)
        X, Y = get_batch(train_tokens, starts.numpy(), block_size, table.device)
        with autocast:
            logits, text_loss = model(X, Y)  # (B, T, V)
            if target == "teacher":
                with torch.no_grad():
                    teacher_logits, _ = teacher(X)
                V = logits.size(-1)
                text_loss = F.kl_div(F.log_softmax(logits.float().view(-1, V), -1),
                                     F.log_softmax(teacher_logits.float().view(-1, V), -1),
                                     log_target=True, reduction="batchmean")
        ids = torch.multinomial(weights, fit_batch, replacement=True, generator=generator)
        ids = ids.to(table.device)
        row_loss = id_losses(lev(ids), table[ids], fit_loss, mean_square).mean()
        loss = text_loss + anchor * row_loss
        if not torch.isfinite(loss):
            raise ValueError(f"the retrofit's tuning loss is {loss.item()} at step {step}; lower "
                             f"--tune_lr")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        since_log += 1
        if (step + 1) % log_interval == 0 or step + 1 == steps:
            ms = 1000 * (time.time() - t_log) / since_log
            log(f"tune step {step + 1}/{steps} | {target} loss {text_loss.item():.4f} | fit loss "
                f"{row_loss.item():.4f} | {ms:.0f} ms/step")
            t_log, since_log = time.time(), 0
    model.requires_grad_(True)


# --------------------------------------------------------------------------------------------------
# The script: a run's checkpoint in, a lev checkpoint out

FIT_LOSSES, FIT_WEIGHTS = ("cosine_norm", "mse"), ("counts", "seen", "uniform")
LEV_SETTINGS = [f for f in dataclasses.fields(Config) if f.name.startswith("lev_")]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def true_or_false(text):
    if text not in ("True", "False"):
        raise argparse.ArgumentTypeError(f"{text!r} is not True or False")
    return text == "True"


def parse_args(argv):
    p = cli.ArgumentParser(prog="retrofit.py", description=__doc__.strip(), allow_abbrev=False,
                           formatter_class=HelpFormatter)  # no --fit_step for --fit_steps
    p.add_argument("run", metavar="RUN", help="a tied or untied run: its directory (ckpt.pt) or a "
                   "checkpoint file")
    p.add_argument("--out", required=True, default=argparse.SUPPRESS, metavar="PATH",
                   help="the lev checkpoint to write")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--data_dir", default="data", help="folder that holds the datasets")
    p.add_argument("--dataset", default=None, metavar="NAME", help="the dataset whose training "
                   "split's counts weight the fit (same tokenizer as RUN's); None: RUN's own")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"),
                   help="where the fit runs; auto: cuda, else mps, else cpu")
    p.add_argument("--seed", type=int, default=1337, help="LEV's initialisation and the fit's "
                   "draws of ids")
    p.add_argument("--log_interval", type=int, default=100, help="a progress line every this "
                   "many fit steps")
    p.add_argument("--fit_steps", type=int, default=4000, help="Adam steps fitting LEV alone to "
                   "RUN's input table (0: LEV stays at its initialisation)")
    p.add_argument("--fit_lr", type=float, default=1e-3, help="the fit's peak learning rate "
                   "(linear warmup over its first 5%% of steps, then cosine decay to a tenth)")
    p.add_argument("--fit_batch", type=int, default=4096, help="ids per fit step, drawn (with "
                   "replacement) by fit_weights")
    p.add_argument("--fit_loss", default="cosine_norm", choices=FIT_LOSSES, help="what LEV(i) "
                   "minimises against table row i: cosine_norm (1 - cosine, plus the squared "
                   "relative error of the norm) or mse (squared error, relative to the rows' mean "
                   "squared norm)")
    p.add_argument("--fit_weights", default="counts", choices=FIT_WEIGHTS, help="how ids count "
                   "in the fit: counts (their training-split counts), seen (uniform over ids seen "
                   "in the training split), uniform (all ids)")
    p.add_argument("--lev_from", default=None, metavar="PATH", help="start from this retrofit's "
                   "LEV (its fit) instead of a new one: e.g. --fit_steps=0 and other tunings")
    p.add_argument("--tune_steps", type=int, default=0, help="after the fit, Adam steps training "
                   "LEV alone inside the model (backbone and head frozen) on windows of the "
                   "training split (0: none)")
    p.add_argument("--tune_target", default="teacher", choices=("teacher", "text"), help="what "
                   "the tuning matches: teacher (RUN's next-token distribution, by KL) or text "
                   "(the next token)")
    p.add_argument("--tune_anchor", type=float, default=1.0, help="weight of the fit's loss (on "
                   "fit_batch ids drawn by fit_weights) added to the tuning's, which keeps ids the "
                   "text never shows near their rows")
    p.add_argument("--tune_lr", type=float, default=1e-3, help="the tuning's peak learning rate "
                   "(the fit's schedule)")
    p.add_argument("--tune_batch", type=int, default=4, help="windows per tuning step")
    p.add_argument("--tune_block", type=int, default=512, help="tokens per window (at most RUN's "
                   "block_size)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the "
                   "tuning's autocast (the fit runs in float32)")
    for f in LEV_SETTINGS:  # LEV's architecture: leviathan.Config's fields, defaults and help
        kind = true_or_false if isinstance(f.default, bool) else type(f.default)
        p.add_argument(f"--{f.name}", type=kind, default=f.default,
                       help=f.metadata["help"].replace("%", "%%"))
    args = p.parse_args(argv)
    for ok, problem in [
            (args.fit_steps >= 0, f"--fit_steps={args.fit_steps} must be >= 0"),
            (math.isfinite(args.fit_lr) and args.fit_lr > 0,
             f"--fit_lr={args.fit_lr} must be a finite number > 0"),
            (1 <= args.fit_batch < 2 ** 31, f"--fit_batch={args.fit_batch} must be in [1, 2^31) "
             f"(the default is 4096)"),
            (args.tune_steps >= 0, f"--tune_steps={args.tune_steps} must be >= 0"),
            (math.isfinite(args.tune_lr) and args.tune_lr > 0,
             f"--tune_lr={args.tune_lr} must be a finite number > 0"),
            (math.isfinite(args.tune_anchor) and args.tune_anchor >= 0,
             f"--tune_anchor={args.tune_anchor} must be a finite number >= 0"),
            (args.tune_batch >= 1, f"--tune_batch={args.tune_batch} must be at least 1"),
            (args.tune_block >= 1, f"--tune_block={args.tune_block} must be at least 1"),
            (args.log_interval >= 1, f"--log_interval={args.log_interval} must be at least 1"),
            (0 <= args.seed < 2 ** 63, f"--seed={args.seed} must be in [0, 2^63)")]:
        if not ok:
            cli.fail("retrofit.py", problem)
    return args


def read_source(args):
    """RUN's checkpoint, checked: a tied or untied model whose weights fit its settings ->
    (checkpoint, its path, the lev model's Config: RUN's architecture with the lev_* flags)."""
    source, path = read_checkpoint(args.run)
    checkpoints.load_checkpoint(path)  # its settings and weights fit, all finite
    arm = source["model_config"]["embedding"]
    if arm == "lev":
        raise ValueError(f"{path} is a lev model already: nothing to retrofit. Fine-tune it as it "
                         f"is with python train.py --init_from={args.run}")
    if arm not in ("tied", "untied"):
        raise ValueError(f"{path} has embedding={arm!r}, which has no input table to fit LEV to; "
                         f"give a tied or untied run")
    lev_settings = {f.name: getattr(args, f.name) for f in LEV_SETTINGS}
    config = Config(**{**source["model_config"], "embedding": "lev", **lev_settings})
    return source, path, config


def check_out(args, source_path):
    """--out must be a new file (or --overwrite), in a folder we can write to, and not RUN's own."""
    cli.check_output_file(args.out, "--out")
    if os.path.realpath(args.out) == os.path.realpath(source_path):
        raise ValueError(f"--out={args.out} is RUN's own checkpoint; give another path")
    if os.path.exists(args.out) and not args.overwrite:
        raise ValueError(f"--out={args.out} already exists; give another path, or pass "
                         f"--overwrite to replace it")


def read_train_split(args, source, path):
    """The dataset's meta and training split, which must have RUN's tokens."""
    name = args.dataset or source["meta"].get("dataset")
    if not name:
        raise ValueError(f"{path} names no dataset; give the one it was trained on, --dataset=NAME")
    folder = os.path.join(args.data_dir, name)
    meta = dataset.load_meta(folder)
    check_same_tokens(source["meta"], meta, path, folder,
                      "give a dataset of RUN's tokens (--dataset, --data_dir)")
    return meta, dataset.load_split(folder, "train")


def retrofitted(args):
    """The lev checkpoint of RUN: the new model, its LEV fitted, and the fit's figures."""
    source, path, config = read_source(args)
    check_out(args, path)
    meta, train_tokens = read_train_split(args, source, path)
    device = devices.resolve_device(args.device)
    torch.manual_seed(args.seed)  # LEV's initialisation, as train.py's of a new model
    model = GPT(config)
    table = transplant(model, source["model"])
    if args.lev_from:  # an earlier retrofit's LEV, of these settings, instead of a new one
        lev_state, _ = read_checkpoint(args.lev_from)
        try:
            model.tok_emb.load_state_dict({k.removeprefix("tok_emb."): v for k, v in
                                           lev_state["model"].items() if k.startswith("tok_emb.")})
        except RuntimeError:
            raise ValueError(f"--lev_from={args.lev_from} holds no LEV of these settings (lev_*) "
                             f"and vocabulary; give a retrofit of RUN") from None
    install_fast_paths(model.to(device), lev=[FastEmbedder(), CompiledRecipe()])  # as train.py
    figures = retrofit(model.tok_emb, table, train_tokens, args.fit_steps, args.fit_lr,
                       args.fit_batch, args.fit_loss, args.fit_weights, args.log_interval,
                       args.seed)
    if args.tune_steps:
        figures["tune"] = tuned(args, model, source, train_tokens, table, device)
    # a checkpoint of format version 2, as train.py writes; "step" is RUN's (that of its backbone
    # and head), read by a fine-tune as any source's
    return {"version": checkpoints.CHECKPOINT_VERSION,
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "model_config": dataclasses.asdict(config), "meta": meta, "step": source.get("step"),
            "retrofit": {"source": path, "source_embedding": source["model_config"]["embedding"],
                         **figures}}


def tuned(args, model, source, train_tokens, table, device):
    """tune() with the tune_* settings, RUN's model as the teacher -> the settings, as recorded."""
    block = min(args.tune_block, model.config.block_size)
    if len(train_tokens) <= block:
        raise ValueError(f"the training split has {len(train_tokens)} tokens, too few for windows "
                         f"of {block}; lower --tune_block")
    teacher = None
    if args.tune_target == "teacher":  # RUN's own model, as it was
        teacher = GPT(Config(**source["model_config"]))
        teacher.load_state_dict(source["model"])
        teacher.to(device).eval()
    counts = train_counts(train_tokens, table.shape[0])
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                              enabled=args.dtype == "bfloat16")
    settings = {"steps": args.tune_steps, "target": args.tune_target, "anchor": args.tune_anchor,
                "lr": args.tune_lr, "batch": args.tune_batch, "block": block, "dtype": args.dtype}
    described = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"retrofit: tuning LEV inside the model, {described}")
    t_start = time.time()
    tune(model, teacher, train_tokens, table, id_weights(args.fit_weights, counts),
         args.tune_target, args.tune_anchor, args.tune_steps, args.tune_lr, args.tune_batch, block,
         args.fit_loss, args.fit_batch, autocast, args.log_interval, seed=args.seed)
    return {**settings, "seconds": round(time.time() - t_start, 3)}


def main(argv=None):
    args = parse_args(argv)
    try:
        ckpt = retrofitted(args)
        try:
            with cli.atomic_path(args.out) as tmp:
                torch.save(ckpt, tmp)
        except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as RuntimeError
            raise OSError(f"could not write {args.out} ({cli.one_line(e)[:200]}); free disk "
                          f"space or give another --out") from None
    except KeyboardInterrupt:
        print("retrofit.py: stopped (Ctrl-C); nothing was written", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        cli.fail("retrofit.py", str(e))
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise  # a bug, not the machine's limit: its traceback is what a report needs
        cli.fail("retrofit.py", f"out of memory ({cli.one_line(e)[:150]}); lower --fit_batch or "
                 f"use another --device")
    print(f"wrote {args.out}; fine-tune it with python train.py --init_from={args.out} "
          f"--out_dir=...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
