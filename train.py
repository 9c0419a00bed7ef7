"""
Train a Leviathan, or one of its baselines, on a dataset prepared by prepare_data.py.

    python prepare_data.py shakespeare
    # Leviathan (LEV input embedding), on CPU
    python train.py config/shakespeare_cpu.py
    # the baseline: same data, same val tokens
    python train.py config/shakespeare_cpu.py --embedding=tied
    # continue out_dir/ckpt.pt (its settings come from the checkpoint)
    python train.py --out_dir=out-shakespeare-cpu-lev --init_from=resume
    # fine-tune a trained model on data b
    python train.py --init_from=out-a-lev --dataset=b --out_dir=out-b-lev
    # retrofit: LEV fitted to a tied (or untied) model's input table, then fine-tuning
    python train.py --init_from=out-a-tied --embedding=lev --out_dir=out-a-retrofit
    # DDP, one process per GPU
    torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_gpu.py

Settings: the defaults below, then config files (plain `key = value` lines, in the order given),
then --key=value flags. With --init_from=resume the checkpoint's settings replace the defaults, and
files and flags still apply. With --init_from=PATH (a checkpoint, or a run directory holding
ckpt.pt) a new run starts from that model's weights and architecture, with a fresh optimizer and
schedule, on any dataset of the same tokenizer; --freeze keeps parts of it fixed, to study what
transfers. --embedding=lev from a tied or untied source first fits a new LEV to its input table
(the fit_* settings; docs/training.md).

Fair comparisons: every arm with the same seed draws the same training batches (the data order has
its own generator, independent of the model's initialization), and validation always uses the same
fixed windows of the val split (machinery/dataset.py's eval_windows), so lev, tied and untied see
exactly the same tokens.

Output: out_dir/log.jsonl gets one record per evaluation (step 0 included): losses, lr, and the
gradients of the steps since the previous record (grad_norm before clipping, clip_fraction,
grad_norms of each part; docs/training.md). out_dir/ckpt.pt is the latest state (model, optimizer,
settings, data order and RNG states): it is written after every evaluation (every eval_interval
steps and at the last step) and when the run is stopped with Ctrl-C (or SIGTERM). Resuming continues
exactly: 10 steps, then 10 more with --init_from=resume, give the same losses and weights as 20
steps. A non-finite loss, gradient norm or validation loss stops the run before anything is saved,
so ckpt.pt always holds the last good state; a scratch run refuses an out_dir that already holds a
run (see --overwrite).
"""


import dataclasses
import json
import math
import os
import string
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import EMBEDDINGS, GPT, Config
from machinery import checkpoints, cli, retrofit, runs
from machinery.grad_stats import GradStats, clipped
from machinery.settings import (
    SettingsError,
    above,
    all_of,
    at_least,
    below,
    check_rules,
    help_text,
    parse_args,
    set_setting,
    within,
)

# --------------------------------------------------------------------------------------------------
# Settings: name -> (default, help) or (default, help, rule). The model's come from
# leviathan.Config's fields, defaults and help, and Config checks them; a rule (at_least, above,
# within: machinery/settings.py) bounds a number.

RETROFIT = "retrofit (--init_from=RUN of a tied or untied run, with --embedding=lev)"
MODEL = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(Config)
         if f.name != "vocab_size"}

SETTINGS = {
    # data and output
    "dataset": ("shakespeare", "a dataset folder under data_dir, made by prepare_data.py"),
    "data_dir": ("data", "folder that holds the datasets"),
    "out_dir": ("out-{dataset}-{embedding}",
                "where ckpt.pt and log.jsonl go; {name} is replaced by that setting"),
    "init_from": ("scratch", "scratch (a new model), resume (continue out_dir/ckpt.pt), or PATH: "
                  "fine-tune the model of a checkpoint file or run directory (fresh optimizer, "
                  "schedule, data order)"),
    "freeze": ("", "fine-tuning: parts kept fixed, comma-separated among embedding (LEV or the "
               "input table), backbone, head; the tied arm's table is both embedding and head"),
    "overwrite": (False, "let a scratch run replace the ckpt.pt and log.jsonl of a run already in "
                  "out_dir"),
    **MODEL,
    # LEV's fast path: settings of the run, not the model's (they change speed and memory only)
    "lev_chunk": (64, "LEV, torch kernels: ids computed together (memory and speed only); 64 suits "
                  "a CPU, more a GPU", at_least(1)),
    "lev_c_kernels": (True, "LEV on CPU: its spline product in machinery/lev_kernels.c, built "
                      "with the system's C compiler on first use, ~3x faster than torch's kernels "
                      "(speed only, not results)"),
    "lev_compile": (True, "LEV: torch.compile its two torch kernels, where the C ones do not run "
                    "(speed only, not results)"),
    "lean_head": (True, "the loss from the memory-lean head: logits a chunk of tokens at a time "
                  "(memory and speed only, not results)"),
    "lev_fast": (True, "LEV's fast path (machinery/fast_lev.py); False: LEV's recipe exactly as "
                 "leviathan.py writes it, slower (the same function: tests/test_fast_paths.py)"),
    # optimization
    "batch_size": (64, "sequences per micro-step, per process", at_least(1)),
    "gradient_accumulation_steps": (1, "micro-steps per optimizer step, over all processes "
                                    "together", at_least(1)),
    "max_iters": (5000, "optimizer steps", at_least(0)),
    "learning_rate": (1e-3, "peak learning rate (AdamW)", above(0)),
    "min_lr": (1e-4, "learning rate at the end of the cosine decay", at_least(0)),
    "warmup_iters": (100, "steps of linear warmup (the first step already has lr > 0)",
                     at_least(0)),
    "lr_decay_iters": (0, "step at which the cosine decay reaches min_lr; 0 means max_iters (fixed "
                       "at the start of a run, so that resuming with a larger max_iters keeps the "
                       "schedule)", at_least(0)),
    "weight_decay": (0.1, "AdamW weight decay (matrices and tables only)", at_least(0)),
    "beta1": (0.9, "AdamW beta1", within(0, 1)),
    "beta2": (0.95, "AdamW beta2", within(0, 1)),
    "grad_clip": (1.0, "clip the gradient norm to this; 0: no clipping", at_least(0)),
    "z_loss": (0.0, "weight of the z-loss, z_loss * (log Z)^2 per token (log Z: the log-sum-exp "
               "of its logits), added to training's loss, not to the val loss", at_least(0)),
    # evaluation and logging
    "eval_interval": (250, "evaluate, log to log.jsonl and write ckpt.pt every this many steps",
                      at_least(1)),
    "eval_iters": (20, "evaluate on eval_iters * batch_size fixed windows per split; 0: the whole "
                   "val split", at_least(0)),
    "log_interval": (10, "print a progress line every this many steps", at_least(1)),
    # system
    "device": ("auto", "auto (cuda, else mps, else cpu), cpu, cuda or mps"),
    "dtype": ("auto", "float32, bfloat16 or float16 (autocast, with a GradScaler for float16); "
              "auto: bfloat16 on CUDA (float16 if unsupported), float32 elsewhere"),
    "compile": (False, "torch.compile the model"),
    "seed": (1337, "seed of the model's initialization and, separately, of the data order",
             within(0, runs.SEED_LIMIT, "2^63 - 2^21")),
    # a retrofit: LEV fitted to a table model's input table first (machinery/retrofit.py)
    "fit_steps": (4000, f"{RETROFIT}: Adam steps fitting LEV alone to the source's input table, "
                        f"before the whole model fine-tunes", at_least(0)),
    "fit_lr": (1e-3, "retrofit: the fit's peak learning rate (linear warmup over its first 5% of "
                     "steps, then cosine decay to a tenth)", above(0)),
    "fit_batch": (4096, "retrofit: ids per fit step, drawn (with replacement) by fit_weights",
                  all_of(at_least(1), below(2 ** 31, "2^31 (the default is 4096)"))),
    "fit_loss": ("cosine_norm", "retrofit: what LEV(i) minimises against table row i: cosine_norm "
                                "(1 - cosine, plus the squared relative error of the norm) or mse "
                                "(squared error, relative to the rows' mean squared norm)"),
    "fit_weights": ("counts", "retrofit: how ids count in the fit: counts (their training-split "
                              "counts), seen (uniform over ids seen in the training split), "
                              "uniform (all ids)"),
}
CHOICES = {"embedding": EMBEDDINGS, "device": ("auto", "cpu", "cuda", "mps"),
           "dtype": ("auto", "float32", "bfloat16", "float16"),
           "fit_loss": ("cosine_norm", "mse"), "fit_weights": ("counts", "seen", "uniform")}
FIT_SETTINGS = [key for key in SETTINGS if key.startswith("fit_")]  # the retrofit's, in order


def get_lr(step, s):
    """Linear warmup (lr > 0 at step 0), cosine decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = s["lr_decay_iters"] or s["max_iters"]
    if step < s["warmup_iters"]:
        return s["learning_rate"] * (step + 1) / (s["warmup_iters"] + 1)
    if step >= decay_iters:
        return s["min_lr"]
    progress = (step - s["warmup_iters"]) / max(1, decay_iters - s["warmup_iters"])
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return s["min_lr"] + cosine * (s["learning_rate"] - s["min_lr"])


def make_optimizer(model, s, device_type):
    """AdamW in two groups: weight decay on matrices and tables (dim >= 2), none on norms' gains
    and biases (LEV's per-head LayerNorm ones are 2-D) nor on LEV's spline coefficients S: decay
    pulls each factor towards 0, and so a 128-factor product much faster still."""
    not_decayed = ("tok_emb.spline", "tok_emb.ln_weight", "tok_emb.ln_bias")
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:  # frozen parts (--freeze) are not trained
            (decay if p.dim() >= 2 and name not in not_decayed else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": s["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s["learning_rate"], betas=(s["beta1"], s["beta2"]),
                             fused=device_type == "cuda")


def get_batch(data, starts, block_size, device):
    """Windows of a split at offsets starts -> inputs x, next-token targets y, (len(starts), T)."""
    rows = np.stack([data[i:i + block_size + 1] for i in starts]).astype(np.int64)
    xy = torch.from_numpy(rows)
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    else:
        xy = xy.to(device)
    return xy[:, :-1], xy[:, 1:]


@torch.no_grad()
def estimate_loss(model, split, starts, s, procs):
    """Mean loss per target token over a split's fixed windows, each process taking every
    world-th. model: the module the run trains (torch.compile'd or not), in eval mode meanwhile."""
    B, T = s["batch_size"], s["block_size"]
    model.eval()
    total, count = 0.0, 0
    mine = starts[procs.rank::procs.world]
    for i in range(0, len(mine), B):
        x, y = get_batch(split, mine[i:i + B], T, procs.device)
        with procs.autocast:
            _, loss = model(x, y)
        total += loss.item() * y.numel()
        count += y.numel()
    model.train()
    total, count = procs.sum([total, count])
    return total / count


# --------------------------------------------------------------------------------------------------
# A run's settings, resolved once, top to bottom: a scratch run takes them as given (defaults,
# then config files, then flags); a resume takes its checkpoint's, files and flags on top; a
# fine-tune takes its source's architecture (a retrofit keeps this run's LEV settings). Every
# problem is a SettingsError of one line.


def resolve_run(given, explicit):
    """The run's settings from those given (explicit: the names that files or flags set) ->
    (settings, the checkpoint to resume or fine-tune, None for a scratch run). out_dir's {name}s
    are filled in, and a new run's lr_decay_iters=0 is fixed as its max_iters (a resume keeps its
    schedule)."""
    s = dict(given)
    for key in ("lev_c_kernels", "lev_compile"):  # refused rather than silently ignored
        if key in explicit and not s["lev_fast"]:
            raise SettingsError(f"{key}={s[key]} is a setting of LEV's fast path, and "
                                f"lev_fast=False runs none; drop --{key}")
    warmup, decay = s["warmup_iters"], s["lr_decay_iters"]
    if s["init_from"] != "resume" and 0 < decay < warmup:  # a resume keeps its own schedule
        raise SettingsError(f"warmup_iters={warmup} must not exceed lr_decay_iters={decay}")
    # a fine-tuning run takes the source's architecture first: out_dir's {embedding} is the source's
    source = None
    if s["init_from"] not in ("scratch", "resume"):
        source, architecture = read_source(s, explicit)
        s.update(architecture)
        check_settings(s)
    fit_flags = [key for key in FIT_SETTINGS if key in explicit]
    if fit_flags and not (source is not None and source["retrofit"]):  # refused, not ignored
        raise SettingsError(f"{fit_flags[0]}={s[fit_flags[0]]} applies to a {RETROFIT} only, "
                            f"which this run is not (a resumed run does not fit again); drop "
                            f"--{fit_flags[0]}")
    s["out_dir"] = formatted_out_dir(s)
    cli.check_output_dir(s["out_dir"], "out_dir")
    path = ckpt_path(s)
    if s["init_from"] != "resume":  # a new run: from scratch, or fine-tuning a checkpoint
        # a run is a checkpoint: a log.jsonl alone is a run that stopped before its first save
        # (Ctrl-C or a failure during the retrofit's fit, say), and the same command starts anew
        if os.path.exists(path) and not s["overwrite"]:
            raise SettingsError(f"{s['out_dir']} already holds a run (ckpt.pt); continue it with "
                                f"--init_from=resume, train into another --out_dir, or pass "
                                f"--overwrite to replace it")
        s["lr_decay_iters"] = s["lr_decay_iters"] or s["max_iters"]  # fixed now: a resume keeps it
        if source is not None and (os.path.realpath(os.path.dirname(source["path"]))
                                   == os.path.realpath(s["out_dir"])):
            raise SettingsError(f"--init_from={s['init_from']} is this run's own out_dir; "
                                f"fine-tune into another --out_dir (or continue that run with "
                                f"--init_from=resume)")
        return s, source
    if not os.path.isfile(path):
        raise SettingsError(f"{s['out_dir']} holds no ckpt.pt to resume (a run stopped before its "
                            f"first save keeps none); start it again without --init_from=resume, "
                            f"or fix --out_dir")
    ckpt, _ = checkpoints.read_checkpoint(path, "cpu", for_resume=True)
    s.update(resumed_settings(ckpt, path, s, explicit))
    check_settings(s)
    return s, ckpt


def check_settings(s):
    """Each setting's rule in the table, then what one setting alone does not say; the model's are
    checked by Config itself."""
    for key, value in s.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SettingsError(f"{key}={value} must be a finite number")
    check_rules(s, SETTINGS)
    if s["min_lr"] > s["learning_rate"]:
        raise SettingsError(f"min_lr={s['min_lr']} must not exceed learning_rate="
                            f"{s['learning_rate']} (the decay goes down to min_lr)")
    if set(filter(None, s["freeze"].split(","))) - set(runs.PARTS):
        raise SettingsError(f"freeze={s['freeze']!r}: choose among {', '.join(runs.PARTS)} "
                            f"(comma-separated)")
    if s["init_from"] == "":
        raise SettingsError("init_from is empty; use scratch, resume, or the path of a checkpoint "
                            "to fine-tune")
    if os.path.basename(s["dataset"]) != s["dataset"] or s["dataset"] in ("", ".", ".."):
        raise SettingsError(f"dataset={s['dataset']!r} must be a folder name under data_dir (use "
                            f"--data_dir for another folder)")
    try:  # the model's own checks, before any work
        Config(vocab_size=2, **{key: s[key] for key in MODEL})
    except ValueError as e:
        raise SettingsError(str(e).removeprefix("Config: ")) from None


def resumed_settings(ckpt, path, s, explicit):
    """What a resumed run takes from its checkpoint: its run settings, unless a file or flag set
    them (one newer than the checkpoint keeps its default; each checked, as a hand-edit could hold
    any type), and its architecture, which a flag may not change."""
    taken = {}
    for key, value in ckpt["train_config"].items():
        if (key in SETTINGS and key not in MODEL and key not in explicit
                and key not in ("out_dir", "init_from")):
            set_setting(taken, key, value, f"{path} (train_config)", SETTINGS, CHOICES)
    for key, value in saved_architecture(ckpt["model_config"]).items():
        if key in explicit and s[key] != value:  # the checkpoint's model; a flag may not change it
            raise SettingsError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; a "
                                f"resumed run keeps its model (drop --{key}, or use another "
                                f"out_dir)")
        taken[key] = value
    return taken


def read_source(s, explicit):
    """The checkpoint a fine-tuning run starts from -> (it, the settings it gives the run: its
    architecture; flags may change dropout only). A retrofit, --embedding=lev from a tied or
    untied source, keeps LEV's settings from this run instead (source["retrofit"] says which)."""
    source, path = checkpoints.read_checkpoint(s["init_from"], "cpu")
    source["retrofit"] = (s["embedding"] == "lev" and "embedding" in explicit
                          and source["model_config"].get("embedding") in ("tied", "untied"))
    taken = {}
    for key, value in saved_architecture(source["model_config"]).items():
        if source["retrofit"] and (key == "embedding" or key.startswith("lev_")):
            continue  # the new LEV's settings: this run's flags and defaults
        if key in explicit and s[key] != value and key != "dropout":
            raise SettingsError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; "
                                f"fine-tuning keeps the source's architecture (drop --{key})")
        if key != "dropout" or key not in explicit:
            taken[key] = value
    source["path"] = path
    return source, taken


def saved_architecture(model_config):
    """A checkpoint's model settings; a missing one gets its default, which is also what
    Config(**model_config) gives the model."""
    return {key: model_config.get(key, entry[0]) for key, entry in MODEL.items()}


def formatted_out_dir(s):
    """out_dir with its {name}s replaced by those settings, e.g. out-{dataset}-{embedding}: one
    folder per arm, so that arms do not overwrite each other."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(s["out_dir"])
                  if field is not None]
        if any(field not in SETTINGS for field in fields):  # no {dataset.upper} or {0}: plain names
            raise KeyError(next(field for field in fields if field not in SETTINGS))
        return s["out_dir"].format(**s)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise SettingsError(f"out_dir={s['out_dir']!r}: each {{...}} must name a setting, e.g. "
                            f"{{embedding}} ({type(e).__name__}: {e})") from None


def ckpt_path(s):
    return os.path.join(s["out_dir"], "ckpt.pt")


def log_path(s):
    return os.path.join(s["out_dir"], "log.jsonl")


def tokens_per_step(s):
    return s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]


# --------------------------------------------------------------------------------------------------
# The run: a model to train, from scratch, a checkpoint to fine-tune or one to resume


def start_run(s, ckpt, data, procs):
    """The model and the run's counters -> (model, run): run is a dict of step, tokens_seen,
    best_val_loss, elapsed_before, data_order (the data order's own torch.Generator, apart from the
    init), origin (the checkpoint a fine-tuning run started from) and fit_table (a retrofit's source
    table, which train() fits LEV to)."""
    run = {"step": 0, "tokens_seen": 0, "best_val_loss": float("inf"), "elapsed_before": 0.0,
           "data_order": torch.Generator(), "origin": None, "fit_table": None}
    if ckpt is not None and s["init_from"] == "resume":
        path = ckpt_path(s)
        runs.check_same_tokens(ckpt["meta"], data, path, "resume on data with the same "
                               "tokenizer, or train from scratch in another out_dir")
        model = checkpoints.build_model(ckpt, path, GPT, Config).train()
        run.update(runs.resumed_state(ckpt, run["data_order"], procs, path, s["seed"]))
        return model, run
    torch.manual_seed(s["seed"])  # the model's initialization
    config = Config(vocab_size=data.meta["vocab_size"], **{key: s[key] for key in MODEL})
    fresh = GPT(config) if ckpt is None or ckpt["retrofit"] else None  # a retrofit: a new lev model
    model = fresh if ckpt is None else fine_tuned(ckpt, fresh, s, data, run)
    run["data_order"].manual_seed(s["seed"] + runs.DATA_SEED_OFFSET)
    torch.manual_seed(s["seed"] + procs.rank)  # dropout masks: a stream per process
    return model, run


def fine_tuned(source, lev_model, s, data, run):
    """The source checkpoint's model, with its weights (dropout as this run asks); a retrofit:
    lev_model, with the source's backbone and head (train() then fits its LEV)."""
    runs.check_same_tokens(source["meta"], data, source["path"],
                           "fine-tune on data prepared with the source's tokenizer")
    source["model_config"]["dropout"] = s["dropout"]
    run["origin"] = {"checkpoint": source["path"], "step": source.get("step"),
                     "dataset": source["meta"].get("dataset"),
                     "embedding": source["model_config"]["embedding"]}
    # built also for a retrofit: building checks the source (its settings, weights, finiteness)
    model = checkpoints.build_model(source, source["path"], GPT, Config)
    if not source["retrofit"]:
        return model.train()
    run["fit_table"] = retrofit.transplant(lev_model, source["model"])
    return lev_model.train()


def save_checkpoint(s, model, optimizer, scaler, run, data, procs):
    """ckpt.pt, atomically (machinery/checkpoints.py), from the first process: what a resume needs
    to go on exactly (model, optimizer, settings, counters, data order and random states)."""
    if not procs.master:
        return
    ckpt = {"version": checkpoints.CHECKPOINT_VERSION, "model": model.state_dict(),
            "model_config": dataclasses.asdict(model.config), "train_config": dict(s),
            "meta": data.meta, "step": run["step"], "tokens_seen": run["tokens_seen"],
            "best_val_loss": run["best_val_loss"], "elapsed_s": elapsed(run),
            "optimizer": optimizer.state_dict(), "rng": runs.rng_states(run["data_order"], procs)}
    if run["origin"] is not None:
        ckpt["origin"] = run["origin"]
    if scaler.is_enabled():
        ckpt["scaler"] = scaler.state_dict()
    checkpoints.save_checkpoint(ckpt, ckpt_path(s))


def elapsed(run):
    return run["elapsed_before"] + time.time() - run["t_start"]


def diverged(what, s, procs):
    if procs.master:
        path = ckpt_path(s)
        kept = (f"{path} keeps the last good state" if os.path.exists(path)
                else "no checkpoint was written")
        print(f"train.py: error: {what}; stopping without saving, {kept}. Lower learning_rate "
              f"(or grad_clip), or use dtype=float32 or bfloat16", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# Training


def train_loop(s, model, train_model, optimizer, scaler, run, data, procs, stop_signal,
               evaluated=None):
    """Evaluate and save every eval_interval steps (and at the last, but not at step `evaluated`,
    whose record the log already holds); between, one optimizer step at a time, with a progress
    line every log_interval steps. model: the plain module (evaluation, checkpoints); train_model:
    what steps (torch.compile'd, DDP-wrapped). Returns the exit code: 0 done, 1 diverged (nothing
    saved: a non-finite loss, gradient norm, val loss or weight), 130 stopped by Ctrl-C or SIGTERM
    (saved after the step)."""
    grad_stats = GradStats(model, s["grad_clip"])  # the steps since the previous record
    t_log, steps_since_log, clipped_since_log, eval_s = time.time(), 0, 0, 0.0
    while True:
        step = run["step"]
        if (step % s["eval_interval"] == 0 or step == s["max_iters"]) and step != evaluated:
            eval_s = evaluate_and_save(s, model, train_model, optimizer, scaler, run, data, procs,
                                       grad_stats)
            if eval_s is None:
                return 1
            t_log = time.time()  # progress lines time the training steps only
        if step >= s["max_iters"]:
            return 0
        stepped = optimizer_step(s, model, train_model, optimizer, scaler, run, data, procs,
                                 grad_stats, stop_signal)
        if stepped is None:  # diverged
            return 1
        step_loss, lr, grad_norm, stop = stepped
        steps_since_log += 1
        clipped_since_log += clipped(grad_norm, s["grad_clip"])
        if run["step"] % s["log_interval"] == 0 or stop:
            step_s = (time.time() - t_log) / steps_since_log
            evals_left = (s["max_iters"] // s["eval_interval"] - run["step"] // s["eval_interval"]
                          + (s["max_iters"] % s["eval_interval"] > 0))
            eta = (s["max_iters"] - run["step"]) * step_s + evals_left * eval_s
            clip = (f" | clipped {100 * clipped_since_log / steps_since_log:.0f}%"
                    if s["grad_clip"] > 0 else "")
            procs.log(f"step {run['step']}/{s['max_iters']} | loss {step_loss:.4f} | lr {lr:.2e} | "
                      f"grad norm {grad_norm:.3f}{clip} | {1000 * step_s:.0f} ms/step | "
                      f"{tokens_per_step(s) / step_s:,.0f} tok/s | ETA {runs.format_seconds(eta)}")
            t_log, steps_since_log, clipped_since_log = time.time(), 0, 0
        if stop:
            save_checkpoint(s, model, optimizer, scaler, run, data, procs)
            procs.log(f"stopped at step {run['step']}; saved {ckpt_path(s)}. Continue with: "
                      f"python train.py --out_dir={s['out_dir']} --init_from=resume")
            return 130


def evaluate_and_save(s, model, train_model, optimizer, scaler, run, data, procs, grad_stats):
    """Estimate both splits' losses, append a record to log.jsonl and write ckpt.pt -> the seconds
    the evaluation took, or None (said) where the model diverged."""
    step, t_eval = run["step"], time.time()
    fast_model = train_model.module if procs.ddp else train_model  # no DDP in evaluation
    train_loss = estimate_loss(fast_model, data.train, data.train_starts, s, procs)
    val_loss = estimate_loss(fast_model, data.val, data.val_starts, s, procs)
    eval_s = time.time() - t_eval
    if not (math.isfinite(val_loss) and math.isfinite(train_loss) and runs.all_finite(model)):
        diverged(f"the val loss is {val_loss} at step {step}", s, procs)
        return None
    run["best_val_loss"] = min(run["best_val_loss"], val_loss)
    record = {"step": step, "tokens": run["tokens_seen"], "train_loss": train_loss,
              "val_loss": val_loss, "lr": get_lr(step, s), **grad_stats.record(),
              "elapsed_s": round(elapsed(run), 3), "embedding": s["embedding"]}
    if run["origin"] is not None:
        record["init_from"] = run["origin"]["checkpoint"]
        if step == 0 and "retrofit" in run["origin"]:  # the fit's figures, once
            record["retrofit"] = run["origin"]["retrofit"]
    if procs.master:
        with open(log_path(s), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    save_checkpoint(s, model, optimizer, scaler, run, data, procs)
    procs.log(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} (best "
              f"{run['best_val_loss']:.4f}), eval {eval_s:.1f} s, saved {ckpt_path(s)}")
    return eval_s


def optimizer_step(s, model, train_model, optimizer, scaler, run, data, procs, grad_stats,
                   stop_signal):
    """One optimizer step over gradient_accumulation_steps * batch_size windows, drawn for all
    processes together so that the data order does not depend on how many share the work -> (the
    step's mean loss, its learning rate, its gradient norm before clipping, whether any process was
    asked to stop), or None (said) where the loss or the gradient norm is not finite."""
    T, B, accum = s["block_size"], s["batch_size"], s["gradient_accumulation_steps"]
    lr = get_lr(run["step"], s)
    for group in optimizer.param_groups:
        group["lr"] = lr
    starts = torch.randint(len(data.train) - T, (accum * B,), generator=run["data_order"]).numpy()
    loss_sum = torch.zeros((), device=procs.device)
    for micro in range(procs.local_accum):
        first = (procs.rank * procs.local_accum + micro) * B
        x, y = get_batch(data.train, starts[first:first + B], T, procs.device)
        if procs.ddp:  # average gradients across processes only after the last micro-step
            train_model.require_backward_grad_sync = micro == procs.local_accum - 1
        with procs.autocast:
            _, loss = train_model(x, y, z_loss=s["z_loss"])
        loss_sum += loss.detach()
        scaler.scale(loss / procs.local_accum).backward()
    scaler.unscale_(optimizer)
    grad_stats.measure_parts()  # before clipping changes the gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"] or math.inf)
    # the mean over processes, in one all-reduce: the step's loss, and whether a signal asked any
    # process to stop
    step_loss, stopping = procs.mean([loss_sum / procs.local_accum, float(bool(stop_signal))])
    # float16's GradScaler skips an inf-gradient step itself; elsewhere the step writes NaNs
    bad_grad = not scaler.is_enabled() and not torch.isfinite(grad_norm)
    if not math.isfinite(step_loss) or bad_grad:
        what = "loss" if not math.isfinite(step_loss) else "gradient norm"
        value = step_loss if what == "loss" else grad_norm.item()
        diverged(f"the {what} is {value} at step {run['step']}", s, procs)
        return None
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    run["step"] += 1
    run["tokens_seen"] += tokens_per_step(s)
    grad_norm = grad_norm.item()
    grad_stats.add(grad_norm)
    return step_loss, lr, grad_norm, stopping > 0


def train(given, explicit):
    """One run: its settings, data and model, then train_loop -> the exit code."""
    s, ckpt = resolve_run(given, explicit)
    resuming = s["init_from"] == "resume"
    procs = runs.Processes(s["device"], s["dtype"], s["gradient_accumulation_steps"])
    data = runs.Data(s["data_dir"], s["dataset"], s["block_size"],
                     s["eval_iters"] * s["batch_size"] or None)
    if procs.master:
        cli.remove_stale_temps(s["out_dir"])  # half-written files of runs killed mid-save
    model, run = start_run(s, ckpt, data, procs)
    runs.freeze(model, set(filter(None, s["freeze"].split(","))))
    if not any(p.requires_grad for p in model.parameters()):
        raise SettingsError(f"freeze={s['freeze']} leaves nothing to train; freeze fewer parts")
    model.to(procs.device)
    # the fast paths, each checked against leviathan.py as it stands on this device (an edited
    # model runs as written where they differ, said in one line)
    lev = None
    if s["lev_fast"]:
        lev = FastEmbedder(s["lev_chunk"], s["lev_c_kernels"], s["lev_compile"])
    install_fast_paths(model, lev=lev, lean_head=s["lean_head"], say=procs.note)
    optimizer = make_optimizer(model, s, procs.device.type)
    scaler = torch.amp.GradScaler(procs.device.type, enabled=procs.dtype == "float16")
    if resuming:
        runs.load_optimizer_state(ckpt, optimizer, scaler, ckpt_path(s))
    del ckpt
    run["t_start"] = time.time()
    # joining the group waits for every process: all have checked out_dir before log.jsonl exists
    if procs.ddp:
        dist.init_process_group(backend="nccl" if procs.device.type == "cuda" else "gloo")
    log_file = log_path(s)
    logged = procs.from_master(resuming and runs.logged(log_file, run["step"]))
    evaluated = run["step"] if logged else None  # its record is in the log: not evaluated again
    if procs.master:
        runs.start_log(log_file, resuming, run["step"])
    report_start(model, run, data, procs, s)
    if run["fit_table"] is not None:  # a retrofit: fit LEV to the source's table, then free it
        fit = {key: s[key] for key in FIT_SETTINGS}
        run["origin"]["retrofit"] = retrofit.retrofit(model.tok_emb, run.pop("fit_table"),
                                                      data.train, **fit,
                                                      log_interval=s["log_interval"],
                                                      seed=s["seed"], log=procs.log)
    # wrap: torch.compile, then DDP; model stays the plain module (checkpoints, evaluation)
    train_model = torch.compile(model) if s["compile"] else model
    if procs.ddp:
        on_gpu = procs.device.type == "cuda"
        train_model = DDP(train_model, device_ids=[procs.local_rank] if on_gpu else None)
    try:
        with runs.stop_requests() as stop_signal:  # Ctrl-C or SIGTERM: finish the step, save, stop
            return train_loop(s, model, train_model, optimizer, scaler, run, data, procs,
                              stop_signal, evaluated)
    finally:
        if procs.ddp:
            del train_model  # DDP uses the process group: release it first
            dist.destroy_process_group()


def report_start(model, run, data, procs, s):
    """What the run trains on, with, where, and from which step."""
    report = model.param_report()
    procs.log(f"data: {data.dir}, {data.meta['tokenizer']} tokens, vocab "
              f"{data.meta['vocab_size']:,}, train {len(data.train):,}, val {len(data.val):,} "
              f"tokens ({len(data.val_starts)} eval windows per split)")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    procs.log(f"model: {s['embedding']}, parameters: input embedding "
              f"{report['input_embedding']:,}, backbone {report['backbone']:,}, head "
              f"{report['head']:,}, total {report['total']:,}"
              + (f", trainable {trainable:,} (frozen: {s['freeze']})" if s["freeze"] else ""))
    if run["origin"] is not None:
        procs.log(f"fine-tuning {run['origin']['checkpoint']} (step {run['origin']['step']}, "
                  f"dataset {run['origin']['dataset']}) with a fresh optimizer and schedule")
    where = (f"resuming at step {run['step']}" if s["init_from"] == "resume"
             else f"writing {ckpt_path(s)}")
    procs.log(f"device {procs.device}, dtype {procs.dtype}, {procs.world} process(es), "
              f"{tokens_per_step(s):,} tokens per step, {where}")
    if s["init_from"] == "resume" and s["max_iters"] > s["lr_decay_iters"] > 0:
        procs.log(f"note: the cosine decay ends at step {s['lr_decay_iters']} (lr_decay_iters, "
                  f"kept from the checkpoint), then lr stays at min_lr; pass --lr_decay_iters to "
                  f"change the schedule")


def what_was_kept(s):
    """After a stop outside the training loop: what out_dir holds, and how to go on (s: the
    settings as given, out_dir's {name}s not yet filled in)."""
    try:
        out_dir = s and formatted_out_dir(s)
    except SettingsError:
        out_dir = None
    if not out_dir or not os.path.isdir(out_dir):
        return "nothing was written"
    if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
        return (f"{out_dir}/ckpt.pt keeps the last saved state; continue with --out_dir={out_dir} "
                f"--init_from=resume")
    return "no checkpoint was saved yet: the same command starts the run again"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text(__doc__, SETTINGS))
        return 0
    settings = None
    try:
        settings, explicit = parse_args(argv, SETTINGS, CHOICES, "train.py")
        check_settings(settings)
        return train(settings, explicit)
    except KeyboardInterrupt:  # outside the training loop (which saves, then stops): at once
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: stopped (Ctrl-C); {what_was_kept(settings)}",
                  file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad settings, data or checkpoint (SettingsError included)
        message = cli.one_line(e) + runs.advice_for_os_error(e)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise  # a bug, not the machine's limit: its traceback is what a report needs
        message = (f"out of memory ({cli.one_line(e)[:150]}); use a smaller batch_size, block_size "
                   f"or model, or gradient_accumulation_steps")
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
