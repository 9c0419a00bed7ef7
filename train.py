"""
Train a Leviathan, or one of its baselines, on a dataset prepared by prepare_data.py.

    python prepare_data.py shakespeare
    python train.py config/shakespeare_cpu.py                        # Leviathan (LEV input embedding), on CPU
    python train.py config/shakespeare_cpu.py --embedding=tied       # the baseline: same data, same val tokens
    python train.py config/shakespeare_cpu.py --init_from=resume     # continue out_dir/ckpt.pt
    python train.py --init_from=out-a-lev --dataset=b --out_dir=out-b-lev   # fine-tune a trained model on data b
    torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_gpu.py     # DDP, one process per GPU

Settings: the defaults below, then config files (plain `key = value` lines, in the order given), then --key=value
flags. With --init_from=resume the checkpoint's settings replace the defaults, and files and flags still apply.
With --init_from=PATH (a checkpoint, or a run directory holding ckpt.pt) a new run starts from that model's
weights and architecture, with a fresh optimizer and schedule, on any dataset of the same tokenizer; --freeze
keeps parts of it fixed, to study what transfers.

Fair comparisons: every arm with the same seed draws the same training batches (the data order has its own
generator, independent of the model's initialization), and validation always uses the same fixed windows of the
val split (prepare_data.eval_windows), so lev, tied and untied see exactly the same tokens.

Output: out_dir/log.jsonl gets one record per evaluation (step 0 included): losses, lr, and the gradients of the
steps since the previous record (grad_norm before clipping, clip_fraction, grad_norms of each part; README).
out_dir/ckpt.pt is the latest state (model, optimizer, settings, data order and RNG states): it is written after
every evaluation (every eval_interval steps and at the last step) and when the run is stopped with Ctrl-C (or
SIGTERM). Resuming continues exactly: 10 steps, then 10 more with --init_from=resume, give the same losses and
weights as 20 steps. A non-finite loss, gradient norm or validation loss stops the run before anything is saved,
so ckpt.pt always holds the last good state; a scratch run refuses an out_dir that already holds a run (see
--overwrite).
"""

import ast
import dataclasses
import difflib
import json
import math
import os
import signal
import string
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import prepare_data
from leviathan import EMBEDDINGS, GPT, Config, set_runtime

# ----------------------------------------------------------------------------------------------------------
# Settings: name -> (default, help). The model's come from leviathan.Config's fields, defaults and help.

MODEL = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(Config) if f.name != "vocab_size"}

SETTINGS = {
    # data and output
    "dataset": ("shakespeare", "a dataset folder under data_dir, made by prepare_data.py"),
    "data_dir": ("data", "folder that holds the datasets"),
    "out_dir": ("out-{dataset}-{embedding}", "where ckpt.pt and log.jsonl go; {name} is replaced by that setting"),
    "init_from": ("scratch", "scratch (a new model), resume (continue out_dir/ckpt.pt), or PATH: fine-tune the "
                             "model of a checkpoint file or run directory (fresh optimizer, schedule, data order)"),
    "freeze": ("", "fine-tuning: parts kept fixed, comma-separated among embedding (LEV or the input table), "
                   "backbone, head; the tied arm's table is both embedding and head"),
    "overwrite": (False, "let a scratch run replace the ckpt.pt and log.jsonl of a run already in out_dir"),
    **MODEL,
    # LEV's fast path: settings of the run, not of the model (they change speed and memory, not results)
    "lev_chunk": (64, "LEV, torch kernels: ids computed together (memory and speed only); 64 suits a CPU, more a "
                      "GPU"),
    "lev_c_kernels": (True, "LEV on CPU: its spline product in lev_kernels.c, built with the system's C compiler "
                            "on first use, ~3x faster than torch's kernels (speed only, not results)"),
    "lev_compile": (True, "LEV: torch.compile its two torch kernels, where the C ones do not run (speed only, not "
                          "results)"),
    "lean_head": (True, "the loss from the memory-lean head: logits a chunk of tokens at a time (memory and speed "
                        "only, not results)"),
    # optimization
    "batch_size": (64, "sequences per micro-step, per process"),
    "gradient_accumulation_steps": (1, "micro-steps per optimizer step, over all processes together"),
    "max_iters": (5000, "optimizer steps"),
    "learning_rate": (1e-3, "peak learning rate (AdamW)"),
    "min_lr": (1e-4, "learning rate at the end of the cosine decay"),
    "warmup_iters": (100, "steps of linear warmup (the first step already has lr > 0)"),
    "lr_decay_iters": (0, "step at which the cosine decay reaches min_lr; 0 means max_iters (fixed at the start "
                          "of a run, so that resuming with a larger max_iters keeps the schedule)"),
    "weight_decay": (0.1, "AdamW weight decay (matrices and tables only)"),
    "lev_lr_scale": (1.0, "lev arm: LEV's learning rate as a multiple of the schedule's (warmup, cosine, min_lr)"),
    "lev_wd_scale": (1.0, "lev arm: LEV's weight decay (codebooks, seed_proj, out_proj) as a multiple of "
                          "weight_decay"),
    "lev_clip_apart": (False, "lev arm: clip LEV's gradient norm and the rest's each to grad_clip on its own, so "
                              "that LEV's gradients do not scale down the head's and the backbone's"),
    "beta1": (0.9, "AdamW beta1"),
    "beta2": (0.95, "AdamW beta2"),
    "grad_clip": (1.0, "clip the gradient norm to this; 0: no clipping"),
    # evaluation and logging
    "eval_interval": (250, "evaluate, log to log.jsonl and write ckpt.pt every this many steps"),
    "eval_iters": (20, "evaluate on eval_iters * batch_size fixed windows per split; 0: the whole val split"),
    "log_interval": (10, "print a progress line every this many steps"),
    # system
    "device": ("auto", "auto (cuda, else mps, else cpu), cpu, cuda or mps"),
    "dtype": ("auto", "float32, bfloat16 or float16 (autocast, with a GradScaler for float16); auto: bfloat16 "
                      "on CUDA (float16 if unsupported), float32 elsewhere"),
    "compile": (False, "torch.compile the model"),
    "seed": (1337, "seed of the model's initialization and, separately, of the data order"),
}
PARTS = ("embedding", "backbone", "head")  # what --freeze can name
CHOICES = {"embedding": EMBEDDINGS, "device": ("auto", "cpu", "cuda", "mps"),
           "dtype": ("auto", "float32", "bfloat16", "float16")}
DATA_SEED_OFFSET = 1_000_003  # the data generator's seed is seed + this: a stream apart from the model init's


class SettingsError(ValueError):
    pass


def help_text():
    lines = [__doc__.strip(), "", "settings (--key=value, default shown):"]
    for key, (default, text) in SETTINGS.items():
        lines.append(f"  --{key}={default}".ljust(38) + f" {text}")
    return "\n".join(lines)


def set_setting(settings, key, value, where):
    """Check one setting's name and type, then store it (ints are accepted where floats are expected)."""
    if key not in SETTINGS:
        close = difflib.get_close_matches(key, SETTINGS, n=1)
        hint = f"did you mean {close[0]}?" if close else "see python train.py --help"
        raise SettingsError(f"{where}: unknown setting {key!r}; {hint}")
    default = SETTINGS[key][0]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(default):
        kind = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}[type(default)]
        raise SettingsError(f"{where}: {key}={value!r} must be {kind} (default: {default!r})")
    if key in CHOICES and value not in CHOICES[key]:
        raise SettingsError(f"{where}: {key}={value!r}; choose one of {', '.join(CHOICES[key])}")
    settings[key] = value


def read_config_file(path):
    """A config file's (key, value, where) triples. Only `key = literal` lines (and comments) are allowed:
    the file is parsed, never executed."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except OSError as e:
        raise SettingsError(f"config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except (MemoryError, RecursionError):
        raise SettingsError(f"config file {path} is nested too deeply to read; only `key = value` lines are "
                            f"allowed") from None
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte
        raise SettingsError(f"config file {path}, line {getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)}; "
                            f"only `key = value` lines are allowed") from None
    for node in tree.body:
        where = f"{path} line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise SettingsError(f"{where}: only `key = value` lines are allowed in a config file")
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            raise SettingsError(f"{where}: the value of {node.targets[0].id} must be a literal "
                                f"(number, string, True or False)") from None
        yield node.targets[0].id, value, where


def parse_args(argv):
    """argv -> (settings, the names set explicitly by config files or flags)."""
    settings = {key: default for key, (default, _) in SETTINGS.items()}
    explicit = set()
    for arg in argv:
        if not arg.startswith("--"):
            for key, value, where in read_config_file(arg):
                set_setting(settings, key, value, where)
                explicit.add(key)
            continue
        key, has_value, text = arg[2:].partition("=")
        if not has_value:  # a bare --compile means --compile=True
            if not isinstance(SETTINGS.get(key, ("",))[0], bool):
                raise SettingsError(f"{arg}: expected --key=value (see python train.py --help)")
            text = "True"
        if isinstance(SETTINGS.get(key, (None,))[0], str):
            value = text  # strings need no quotes on the command line
        else:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                value = text
        set_setting(settings, key, value, arg)
        explicit.add(key)
    return settings, explicit


def check_settings(s):
    """Ranges that a type alone does not say; the model's are checked by leviathan.Config itself."""
    def need(ok, msg):
        if not ok:
            raise SettingsError(msg)

    for key, value in s.items():
        need(not isinstance(value, float) or math.isfinite(value), f"{key}={value} must be a finite number")
    for key in ("batch_size", "gradient_accumulation_steps", "eval_interval", "log_interval", "lev_chunk"):
        need(s[key] >= 1, f"{key}={s[key]} must be at least 1")
    for key in ("max_iters", "eval_iters", "warmup_iters", "lr_decay_iters", "min_lr", "weight_decay", "grad_clip"):
        need(s[key] >= 0, f"{key}={s[key]} must be >= 0")
    need(s["learning_rate"] > 0, f"learning_rate={s['learning_rate']} must be > 0")
    need(s["lev_lr_scale"] > 0, f"lev_lr_scale={s['lev_lr_scale']} must be > 0")
    need(s["lev_wd_scale"] >= 0, f"lev_wd_scale={s['lev_wd_scale']} must be >= 0")
    for key, default in (("lev_lr_scale", 1), ("lev_wd_scale", 1), ("lev_clip_apart", False)):
        need(s["embedding"] == "lev" or s[key] == default,  # refused rather than silently ignored
             f"{key}={s[key]} applies to LEV, and --embedding={s['embedding']} has none; drop --{key}")
    need(s["min_lr"] <= s["learning_rate"], f"min_lr={s['min_lr']} must not exceed learning_rate="
                                            f"{s['learning_rate']} (the decay goes down to min_lr)")
    need(0 <= s["beta1"] < 1 and 0 <= s["beta2"] < 1, "beta1 and beta2 must be in [0, 1)")
    need(0 <= s["seed"] < 2 ** 63 - DATA_SEED_OFFSET - 1024, f"seed={s['seed']} must be in [0, 2^63 - 2^21)")
    bad_parts = set(filter(None, s["freeze"].split(","))) - set(PARTS)
    need(not bad_parts, f"freeze={s['freeze']!r}: choose among {', '.join(PARTS)} (comma-separated)")
    need(s["init_from"] != "", "init_from is empty; use scratch, resume, or the path of a checkpoint to fine-tune")
    need(os.path.basename(s["dataset"]) == s["dataset"] and s["dataset"] not in ("", ".", ".."),
         f"dataset={s['dataset']!r} must be a folder name under data_dir (use --data_dir for another folder)")
    try:
        Config(vocab_size=2, **{key: s[key] for key in MODEL})  # the model's own checks, before any work
    except ValueError as e:
        raise SettingsError(str(e).removeprefix("Config: ")) from None


# ----------------------------------------------------------------------------------------------------------
# Small helpers


def get_lr(step, s):
    """Linear warmup (lr > 0 at step 0), then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = s["lr_decay_iters"] or s["max_iters"]
    if step < s["warmup_iters"]:
        return s["learning_rate"] * (step + 1) / (s["warmup_iters"] + 1)
    if step >= decay_iters:
        return s["min_lr"]
    progress = (step - s["warmup_iters"]) / max(1, decay_iters - s["warmup_iters"])
    return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * progress)) * (s["learning_rate"] - s["min_lr"])


def get_batch(data, starts, block_size, device):
    """Windows of a split at the given start offsets -> inputs x and next-token targets y, (len(starts), T)."""
    rows = np.stack([data[i:i + block_size + 1] for i in starts]).astype(np.int64)
    xy = torch.from_numpy(rows)
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    else:
        xy = xy.to(device)
    return xy[:, :-1], xy[:, 1:]


def format_seconds(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def read_log(path, before_step):
    """The records of log.jsonl for steps before `before_step` (a resumed run redoes the rest)."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line) if line.strip() else None
                if record is not None and record["step"] < before_step:
                    records.append(record)
            except (ValueError, KeyError, TypeError):
                raise SettingsError(f"{path}:{n} is not a log record; fix or delete that line, then resume") from None
    return records


def same_tokens(meta_a, meta_b):
    return all(meta_a.get(k) == meta_b.get(k) for k in ("tokenizer", "vocab_size", "chars"))


def describe_tokens(meta):
    return f"{meta.get('tokenizer')} tokens (vocab_size {meta.get('vocab_size')})"


def all_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------
# Setting up a run: output folder, processes and device, data, model


def resolve_run(s, explicit):
    """Fill in out_dir, check it, and for a resumed run load the checkpoint and take its settings (files and
    flags on top). Returns the checkpoint to resume or fine-tune (None for a scratch run)."""
    if s["init_from"] != "resume" and 0 < s["lr_decay_iters"] < s["warmup_iters"]:  # a resume keeps its schedule
        raise SettingsError(f"warmup_iters={s['warmup_iters']} must not exceed lr_decay_iters={s['lr_decay_iters']}")
    # a fine-tuning run takes its architecture from the source first, so that out_dir's {embedding} is the source's
    source = read_source(s, explicit) if s["init_from"] not in ("scratch", "resume") else None
    try:  # e.g. out-{dataset}-{embedding}: one folder per arm, so arms do not overwrite each other
        fields = [field for _, field, _, _ in string.Formatter().parse(s["out_dir"]) if field is not None]
        if any(field not in SETTINGS for field in fields):  # no {dataset.upper} or {0}: plain names only
            raise KeyError(next(field for field in fields if field not in SETTINGS))
        s["out_dir"] = s["out_dir"].format(**s)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise SettingsError(f"out_dir={s['out_dir']!r}: each {{...}} must name a setting, e.g. {{embedding}} "
                            f"({type(e).__name__}: {e})") from None
    common.check_output_dir(s["out_dir"], "out_dir")
    ckpt_path = os.path.join(s["out_dir"], "ckpt.pt")
    if s["init_from"] != "resume":  # a new run: from scratch, or fine-tuning a checkpoint
        held = [name for name in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(s["out_dir"], name))]
        if held and not s["overwrite"]:
            raise SettingsError(f"{s['out_dir']} already holds a run ({' and '.join(held)}); continue it with "
                                f"--init_from=resume, train into another --out_dir, or pass --overwrite to replace it")
        s["lr_decay_iters"] = s["lr_decay_iters"] or s["max_iters"]  # fixed now: a resume keeps this schedule
        if source is not None and os.path.realpath(os.path.dirname(source["path"])) == os.path.realpath(s["out_dir"]):
            raise SettingsError(f"--init_from={s['init_from']} is this run's own out_dir; fine-tune into another "
                                f"--out_dir (or continue that run with --init_from=resume)")
        return source
    ckpt, _ = common.read_checkpoint(ckpt_path, "cpu", for_resume=True)
    for key, value in ckpt["train_config"].items():
        if key in SETTINGS and key not in MODEL and key not in explicit and key not in ("out_dir", "init_from"):
            set_setting(s, key, value, f"{ckpt_path} (train_config)")  # a hand-edit could hold any type
    for key, value in saved_architecture(ckpt["model_config"]).items():  # the checkpoint's; a flag may not change it
        if key in explicit and s[key] != value:
            raise SettingsError(f"{ckpt_path} has {key}={value!r}, this run asks for {s[key]!r}; a resumed run "
                                f"keeps its model (drop --{key}, or use another out_dir)")
        s[key] = value
    check_settings(s)
    return ckpt


def read_source(s, explicit):
    """The checkpoint a fine-tuning run starts from; its architecture becomes this run's (flags may change
    dropout only)."""
    source, path = common.read_checkpoint(s["init_from"], "cpu")
    for key, value in saved_architecture(source["model_config"]).items():
        if key in explicit and s[key] != value and key != "dropout":
            raise SettingsError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; fine-tuning keeps the "
                                f"source's architecture (drop --{key})")
        if key != "dropout" or key not in explicit:
            s[key] = value
    source["path"] = path
    check_settings(s)
    return source


def saved_architecture(model_config):
    """A checkpoint's model settings (MODEL's keys). A field added to Config after the checkpoint was written is
    filled in by common.read_checkpoint with the value its model was made with, when common.FIELDS_ADDED lists
    it; any other missing field gets its default, which is also what Config(**model_config) gives the model."""
    return {key: model_config.get(key, default) for key, (default, _) in MODEL.items()}


def freeze(model, parts):
    """Keep the named parts (PARTS) fixed: no gradient, not in the optimizer."""
    head_params = {id(model.lm_head.weight)}
    embedding_params = {id(p) for p in model.tok_emb.parameters()}
    for p in model.parameters():
        part = "embedding" if id(p) in embedding_params else "head" if id(p) in head_params else "backbone"
        if part in parts or (id(p) in embedding_params and id(p) in head_params and "head" in parts):
            p.requires_grad_(False)


class Processes:
    """This process's place in the run (under torchrun each process runs this script with RANK/WORLD_SIZE set),
    its device and its autocast dtype."""

    def __init__(self, s):
        self.ddp = "RANK" in os.environ
        self.rank, self.world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.master = self.rank == 0
        device_name = common.resolve_device(s["device"])  # a ValueError, reported like a bad setting
        if self.ddp and device_name == "mps":
            raise SettingsError("DDP (torchrun) runs on cuda (nccl) or cpu (gloo), not mps; use --device=cpu")
        self.device = torch.device(f"cuda:{self.local_rank}" if device_name == "cuda" and self.ddp else device_name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.dtype = common.resolve_dtype(s["dtype"], self.device.type)
        self.autocast = common.autocast(self.device.type, self.dtype)
        if s["gradient_accumulation_steps"] % self.world:
            raise SettingsError(f"gradient_accumulation_steps={s['gradient_accumulation_steps']} must be divisible "
                                f"by the number of processes ({self.world})")
        self.local_accum = s["gradient_accumulation_steps"] // self.world

    def log(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)


class Data:
    """The dataset's splits and the fixed evaluation windows (the same for every arm)."""

    def __init__(self, s):
        self.dir = os.path.join(s["data_dir"], s["dataset"])
        self.meta = prepare_data.load_meta(self.dir)
        self.train, self.val = prepare_data.load_split(self.dir, "train"), prepare_data.load_split(self.dir, "val")
        T, B = s["block_size"], s["batch_size"]
        if len(self.train) <= T:
            raise SettingsError(f"the train split of {self.dir} has {len(self.train)} tokens, too few for "
                                f"block_size={T}; use a smaller block_size or more text")
        # the train split's windows are as many as the val split's
        self.val_starts = prepare_data.eval_windows(len(self.val), T, s["eval_iters"] * B or None)
        self.train_starts = prepare_data.eval_windows(len(self.train), T, len(self.val_starts))


def restore_rng(ckpt, data_generator, device, path):
    """The data order's and torch's random states of a resumed run."""
    try:
        data_generator.set_state(ckpt["rng"]["data"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    except (KeyError, TypeError, RuntimeError) as e:
        raise SettingsError(f"{path}: its random states (rng) are unusable ({type(e).__name__}); it was edited "
                            f"or damaged. Resume from an untouched checkpoint") from None


# ----------------------------------------------------------------------------------------------------------
# Gradient diagnostics: what each log.jsonl record says about the gradients since the previous one

LEV_PARTS = {"codebooks": "lev.codebooks", "seed_proj": "lev.seed_proj", "ln_weight": "lev.ln", "ln_bias": "lev.ln",
             "spline": "lev.spline", "out_proj": "lev.out_proj"}  # LEV's parameter -> its part
GRAD_PARTS = ("embedding", "embedding+head", "backbone", "head", *dict.fromkeys(LEV_PARTS.values()))


def grad_parts(model):
    """Part -> its trainable parameters, in GRAD_PARTS's order: embedding (tok_emb; the tied arm's table, which is
    the head too, as embedding+head), backbone (the blocks and the final norm), head (lm_head), and in the lev arm
    LEV's own parts as well. A part with nothing to train (frozen) is left out."""
    arm, parts = model.config.embedding, {}
    for name, p in model.named_parameters():  # the tied table is listed once, as tok_emb's
        if not p.requires_grad:
            continue
        module, _, rest = name.partition(".")
        if module == "tok_emb":
            names = ["embedding+head" if arm == "tied" else "embedding"] + ([LEV_PARTS[rest]] if arm == "lev" else [])
        else:
            names = ["head" if module == "lm_head" else "backbone"]
        for part in names:
            parts.setdefault(part, []).append(p)
    return {part: parts[part] for part in GRAD_PARTS if part in parts}


def clip_gradients(model, grad_clip, lev_apart):
    """Clip the gradients' norm to grad_clip (0: no clipping) -> (the total norm before clipping, the largest norm
    that was compared with grad_clip), both 0-dim tensors. lev_apart (the lev arm's lev_clip_apart): LEV's
    parameters and the rest are clipped each by its own norm, so that LEV's gradients, most of the total norm in
    the lev arm at the CPU config, no longer scale down the head's and the backbone's at every clipped step."""
    limit = grad_clip or float("inf")
    if not lev_apart:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        return total, total
    lev = {id(p) for p in model.tok_emb.parameters()}
    norms = torch.stack([torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if (id(p) in lev) == inside],
                                                        limit) for inside in (True, False)])
    return torch.linalg.vector_norm(norms), norms.max()


def clipped(clip_norm, grad_clip):
    """Whether clipping scaled a step's gradients down, given the largest norm compared with grad_clip
    (clip_gradients; grad_clip 0: no clipping; a non-finite norm: a float16 step that the GradScaler skipped)."""
    return grad_clip > 0 and math.isfinite(clip_norm) and clip_norm > grad_clip


class GradStats:
    """The optimizer steps since the previous log record: their mean total gradient norm before clipping, the
    fraction of them clipped, and the mean gradient norm of each part of the model (grad_parts). The norms are of
    the unscaled gradients each process holds after DDP's all-reduce. The part norms add up on the device and are
    read once per record, so the steps in between wait for nothing."""

    def __init__(self, model, grad_clip):
        self.parts, self.grad_clip = grad_parts(model), grad_clip
        self.part_norms = None  # the current step's, from measure_parts()
        self.reset()

    def reset(self):
        self.steps, self.clipped, self.norm_sum, self.part_norm_sums = 0, 0, 0.0, 0.0

    def measure_parts(self):
        """Take each part's gradient norm now: after unscaling and before clipping changes the gradients.
        Parameters without a gradient are skipped."""
        norms = []
        for params in self.parts.values():
            grads = [p.grad for p in params if p.grad is not None]
            norms.append(torch.nn.utils.get_total_norm(grads) if grads else params[0].new_zeros(()))
        self.part_norms = torch.stack(norms)

    def add(self, grad_norm, clip_norm):
        """Count a step of total gradient norm grad_norm (clip_norm: see clip_gradients), with the part norms
        measure_parts() took. A float16 step that the GradScaler skipped (inf or NaN gradients) changed nothing,
        and is not counted."""
        if not math.isfinite(grad_norm):
            return
        self.steps += 1
        self.clipped += clipped(clip_norm, self.grad_clip)
        self.norm_sum += grad_norm
        self.part_norm_sums = self.part_norm_sums + self.part_norms

    def record(self):
        """grad_norm, clip_fraction and grad_norms for a log record (None without steps, clip_fraction also
        without clipping); then start afresh."""
        n = self.steps
        part_means = (self.part_norm_sums / n).tolist() if n else None
        stats = {"grad_norm": self.norm_sum / n if n else None,
                 "clip_fraction": self.clipped / n if n and self.grad_clip > 0 else None,
                 "grad_norms": dict(zip(self.parts, part_means, strict=True)) if n else None}
        self.reset()
        return stats


# ----------------------------------------------------------------------------------------------------------
# Training


class Trainer:
    """One run: the model, its optimizer and the counters that a checkpoint saves and a resume restores."""

    def __init__(self, s, procs, data, ckpt):
        self.s, self.procs, self.data = s, procs, data
        self.ckpt_path = os.path.join(s["out_dir"], "ckpt.pt")
        self.log_path = os.path.join(s["out_dir"], "log.jsonl")
        self.data_generator = torch.Generator()  # the data order's own stream: the model's init does not shift it
        self.origin = None  # the checkpoint a fine-tuning run started from
        if ckpt is None or s["init_from"] != "resume":
            torch.manual_seed(s["seed"])  # the model's initialization
            self.model = (GPT(Config(vocab_size=data.meta["vocab_size"], **{key: s[key] for key in MODEL}))
                          if ckpt is None else self.fine_tune(ckpt))
            self.data_generator.manual_seed(s["seed"] + DATA_SEED_OFFSET)
            torch.manual_seed(s["seed"] + procs.rank)  # dropout masks: a stream per process
            self.step, self.tokens_seen, self.best_val_loss, self.elapsed_before = 0, 0, float("inf"), 0.0
        else:
            self.resume(ckpt)
        freeze(self.model, set(filter(None, s["freeze"].split(","))))
        if not any(p.requires_grad for p in self.model.parameters()):
            raise SettingsError(f"freeze={s['freeze']} leaves nothing to train; freeze fewer parts")
        set_runtime(self.model, lev_chunk=s["lev_chunk"], lev_compile=s["lev_compile"],
                    lev_c_kernels=s["lev_c_kernels"], lean_head=s["lean_head"])
        self.model.to(procs.device)
        self.grad_stats = GradStats(self.model, s["grad_clip"])  # empty at a resume too: not in checkpoints
        self.optimizer = self.new_optimizer(s["lev_lr_scale"], s["lev_wd_scale"])
        self.scaler = torch.amp.GradScaler(procs.device.type, enabled=procs.dtype == "float16")
        if s["init_from"] == "resume":
            try:
                self.load_optimizer_state(ckpt)
                if "scaler" in ckpt:
                    self.scaler.load_state_dict(ckpt["scaler"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise SettingsError(f"{self.ckpt_path}: its optimizer state does not fit the model "
                                    f"({common.one_line(e)[:200]}); it was edited or damaged") from None
        self.t_start = time.time()

    def new_optimizer(self, lev_lr_scale, lev_wd_scale):
        s = self.s
        return self.model.configure_optimizers(s["weight_decay"], s["learning_rate"], (s["beta1"], s["beta2"]),
                                               self.procs.device.type, lev_lr_scale, lev_wd_scale)

    def load_optimizer_state(self, ckpt):
        """The checkpoint's optimizer state, read into the groups its run had (they depend on its lev_lr_scale and
        lev_wd_scale, 1 in checkpoints older than them), then handed over parameter by parameter: a resume may
        change those settings, and with them whether LEV has groups of its own. The groups keep this run's settings."""
        saved = ckpt["train_config"]
        as_saved = self.new_optimizer(saved.get("lev_lr_scale", 1.0), saved.get("lev_wd_scale", 1.0))
        as_saved.load_state_dict(ckpt["optimizer"])
        for p, state in as_saved.state.items():
            self.optimizer.state[p] = state

    def fine_tune(self, source):
        """The source checkpoint's model, with its weights (dropout as this run asks)."""
        if not same_tokens(source["meta"], self.data.meta):
            raise SettingsError(f"{source['path']} was trained on {describe_tokens(source['meta'])}, but "
                                f"{self.data.dir} has {describe_tokens(self.data.meta)}; fine-tune on data prepared "
                                f"with the source's tokenizer")
        source["model_config"]["dropout"] = self.s["dropout"]
        self.origin = {"checkpoint": source["path"], "step": source.get("step"),
                       "dataset": source["meta"].get("dataset"), "embedding": source["model_config"]["embedding"]}
        return common.build_model(source, source["path"]).train()

    def resume(self, ckpt):
        s, procs = self.s, self.procs
        self.origin = ckpt.get("origin")
        if not same_tokens(ckpt["meta"], self.data.meta):
            raise SettingsError(f"{self.ckpt_path} was trained on {describe_tokens(ckpt['meta'])}, but "
                                f"{self.data.dir} has {describe_tokens(self.data.meta)}; resume on data with the "
                                f"same tokenizer, or train from scratch in another out_dir")
        self.model = common.build_model(ckpt, self.ckpt_path).train()
        restore_rng(ckpt, self.data_generator, procs.device, self.ckpt_path)
        self.step, self.tokens_seen = ckpt["step"], ckpt["tokens_seen"]
        if self.step < 0 or self.tokens_seen < 0:
            raise SettingsError(f"{self.ckpt_path}: step={self.step}, tokens_seen={self.tokens_seen} must be >= 0; "
                                f"it was edited or damaged")
        self.best_val_loss, self.elapsed_before = ckpt["best_val_loss"], float(ckpt.get("elapsed_s", 0.0))
        if procs.ddp and procs.rank > 0:
            torch.manual_seed(s["seed"] + procs.rank + self.step)  # only rank 0's dropout stream is saved

    def elapsed(self):
        return self.elapsed_before + time.time() - self.t_start

    @torch.no_grad()
    def evaluate(self, fast_model, split, starts):
        """Mean loss per target token over the fixed windows; each process takes every world-th window."""
        procs, B, T = self.procs, self.s["batch_size"], self.s["block_size"]
        self.model.eval()
        total, count = 0.0, 0
        mine = starts[procs.rank::procs.world]
        for i in range(0, len(mine), B):
            x, y = get_batch(split, mine[i:i + B], T, procs.device)
            with procs.autocast:
                _, loss = fast_model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
        self.model.train()
        if procs.ddp:
            sums = torch.tensor([total, count], dtype=torch.float64, device=procs.device)
            dist.all_reduce(sums)
            total, count = sums.tolist()
        return total / count

    def save(self):
        """ckpt.pt, atomically; never with non-finite weights (the last good one stays instead)."""
        if not self.procs.master:
            return
        device = self.procs.device
        rng = {"data": self.data_generator.get_state(), "torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        ckpt = {"version": common.CHECKPOINT_VERSION, "model": self.model.state_dict(),
                "model_config": dataclasses.asdict(self.model.config), "train_config": dict(self.s),
                "meta": self.data.meta, "step": self.step, "tokens_seen": self.tokens_seen,
                "best_val_loss": self.best_val_loss, "elapsed_s": self.elapsed(),
                "optimizer": self.optimizer.state_dict(), "rng": rng}
        if self.origin is not None:
            ckpt["origin"] = self.origin
        if self.scaler.is_enabled():
            ckpt["scaler"] = self.scaler.state_dict()
        common.save_checkpoint(ckpt, self.ckpt_path)

    def evaluate_and_save(self, fast_model):
        """Evaluate both splits, append to log.jsonl, save ckpt.pt. Returns False (nothing saved) when the model
        has diverged: a non-finite val loss or non-finite weights."""
        s, data = self.s, self.data
        t_eval = time.time()
        train_loss = self.evaluate(fast_model, data.train, data.train_starts)
        val_loss = self.evaluate(fast_model, data.val, data.val_starts)
        self.last_eval_s = time.time() - t_eval
        if not (math.isfinite(val_loss) and math.isfinite(train_loss) and all_finite(self.model)):
            self.diverged(f"the val loss is {val_loss} at step {self.step}")
            return False
        self.best_val_loss = min(self.best_val_loss, val_loss)
        record = {"step": self.step, "tokens": self.tokens_seen, "train_loss": train_loss, "val_loss": val_loss,
                  "lr": get_lr(self.step, s), **self.grad_stats.record(), "elapsed_s": round(self.elapsed(), 3),
                  "embedding": s["embedding"]}
        if self.origin is not None:
            record["init_from"] = self.origin["checkpoint"]
        if self.procs.master:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        self.save()
        self.procs.log(f"step {self.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} (best "
                       f"{self.best_val_loss:.4f}), eval {self.last_eval_s:.1f} s, saved {self.ckpt_path}")
        return True

    def diverged(self, what):
        if self.procs.master:
            kept = (f"{self.ckpt_path} keeps the last good state" if os.path.exists(self.ckpt_path)
                    else "no checkpoint was written")
            print(f"train.py: error: {what}; stopping without saving, {kept}. Lower learning_rate (or "
                  f"grad_clip), or use dtype=float32 or bfloat16", file=sys.stderr)

    def train_step(self, train_model, stop_signal):
        """One optimizer step over gradient_accumulation_steps * batch_size windows, drawn for all processes
        together so that the data order does not depend on how many processes share the work.
        Returns (mean loss, gradient norm, whether clipping scaled it down, whether any process was asked to stop,
        lr), or None when the loss or the gradient is not finite (then no weight was changed)."""
        s, procs = self.s, self.procs
        T, B = s["block_size"], s["batch_size"]
        lr = get_lr(self.step, s)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]  # LEV's groups: lev_lr_scale
        starts = torch.randint(len(self.data.train) - T, (s["gradient_accumulation_steps"] * B,),
                               generator=self.data_generator).numpy()
        loss_sum = torch.zeros((), device=procs.device)
        for micro in range(procs.local_accum):
            first = (procs.rank * procs.local_accum + micro) * B
            x, y = get_batch(self.data.train, starts[first:first + B], T, procs.device)
            if procs.ddp:  # average gradients across processes only after the last micro-step
                train_model.require_backward_grad_sync = micro == procs.local_accum - 1
            with procs.autocast:
                _, loss = train_model(x, y)
            loss_sum += loss.detach()
            self.scaler.scale(loss / procs.local_accum).backward()
        self.scaler.unscale_(self.optimizer)
        self.grad_stats.measure_parts()  # before clipping changes the gradients
        grad_norm, clip_norm = clip_gradients(self.model, s["grad_clip"], s["lev_clip_apart"])
        # one all-reduce: the step's mean loss, and whether any process was asked to stop
        stop_requested = torch.tensor(float(bool(stop_signal)), device=procs.device)  # a signal during this step
        shared = torch.stack([loss_sum / procs.local_accum, stop_requested])
        if procs.ddp:
            dist.all_reduce(shared)
        step_loss, stop = shared[0].item() / procs.world, shared[1].item() > 0
        # float16's GradScaler skips a step with inf gradients by itself; elsewhere such a step would write NaNs
        if not math.isfinite(step_loss) or (not self.scaler.is_enabled() and not torch.isfinite(grad_norm)):
            what = "loss" if not math.isfinite(step_loss) else "gradient norm"
            value = step_loss if what == "loss" else grad_norm.item()
            self.diverged(f"the {what} is {value} at step {self.step}")
            return None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += s["gradient_accumulation_steps"] * B * T
        grad_norm, clip_norm = torch.stack([grad_norm, clip_norm]).tolist()
        self.grad_stats.add(grad_norm, clip_norm)
        return step_loss, grad_norm, clipped(clip_norm, s["grad_clip"]), stop, lr


def start_log(trainer, s):
    """log.jsonl: a resumed run keeps the records before its step; a scratch run starts a new one."""
    if trainer.procs.master:
        records = read_log(trainer.log_path, trainer.step) if s["init_from"] == "resume" else []
        with common.atomic_path(trainer.log_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def report_start(trainer, s):
    procs, data, report = trainer.procs, trainer.data, trainer.model.param_report()
    tokens_per_step = s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]
    procs.log(f"data: {data.dir}, {data.meta['tokenizer']} tokens, vocab {data.meta['vocab_size']:,}, train "
              f"{len(data.train):,}, val {len(data.val):,} tokens ({len(data.val_starts)} eval windows per split)")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    procs.log(f"model: {s['embedding']}, parameters: input embedding {report['input_embedding']:,}, backbone "
              f"{report['backbone']:,}, head {report['head']:,}, total {report['total']:,}"
              + (f", trainable {trainable:,} (frozen: {s['freeze']})" if s["freeze"] else ""))
    if trainer.origin is not None:
        procs.log(f"fine-tuning {trainer.origin['checkpoint']} (step {trainer.origin['step']}, dataset "
                  f"{trainer.origin['dataset']}) with a fresh optimizer and schedule")
    procs.log(f"device {procs.device}, dtype {procs.dtype}, {procs.world} process(es), {tokens_per_step:,} tokens "
              f"per step, " + (f"resuming at step {trainer.step}" if s["init_from"] == "resume"
                               else f"writing {trainer.ckpt_path}"))
    if s["init_from"] == "resume" and s["max_iters"] > s["lr_decay_iters"] > 0:
        procs.log(f"note: the cosine decay ends at step {s['lr_decay_iters']} (lr_decay_iters, kept from the "
                  f"checkpoint), then lr stays at min_lr; pass --lr_decay_iters to change the schedule")


def train_loop(trainer, fast_model, train_model, stop_signal):
    """Evaluate + save every eval_interval steps, step, print progress; returns the exit code."""
    s, procs = trainer.s, trainer.procs
    max_iters, eval_interval = s["max_iters"], s["eval_interval"]
    tokens_per_step = s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]
    t_log, steps_since_log, clipped_since_log, trainer.last_eval_s = time.time(), 0, 0, 0.0
    while True:
        if trainer.step % eval_interval == 0 or trainer.step == max_iters:
            if not trainer.evaluate_and_save(fast_model):
                return 1
            t_log = time.time()  # progress lines time the training steps only
        if trainer.step >= max_iters:
            return 0
        result = trainer.train_step(train_model, stop_signal)
        if result is None:
            return 1
        step_loss, grad_norm, was_clipped, stop, lr = result
        steps_since_log += 1
        clipped_since_log += was_clipped
        if trainer.step % s["log_interval"] == 0 or stop:
            step_s = (time.time() - t_log) / steps_since_log
            evals_left = max_iters // eval_interval - trainer.step // eval_interval + (max_iters % eval_interval > 0)
            eta = (max_iters - trainer.step) * step_s + evals_left * trainer.last_eval_s
            clip = f" | clipped {100 * clipped_since_log / steps_since_log:.0f}%" if s["grad_clip"] > 0 else ""
            procs.log(f"step {trainer.step}/{max_iters} | loss {step_loss:.4f} | lr {lr:.2e} | grad norm "
                      f"{grad_norm:.3f}{clip} | {1000 * step_s:.0f} ms/step | {tokens_per_step / step_s:,.0f} tok/s | "
                      f"ETA {format_seconds(eta)}")
            t_log, steps_since_log, clipped_since_log = time.time(), 0, 0
        if stop:
            trainer.save()
            procs.log(f"stopped at step {trainer.step}; saved {trainer.ckpt_path}. Continue with: python train.py "
                      f"--out_dir={s['out_dir']} --init_from=resume")
            return 130


def train(s, explicit):
    ckpt = resolve_run(s, explicit)
    procs = Processes(s)
    data = Data(s)
    if procs.master:
        common.remove_stale_temps(s["out_dir"])  # half-written files of runs killed mid-save
    trainer = Trainer(s, procs, data, ckpt)
    del ckpt
    # wrap: torch.compile, then DDP; trainer.model stays the plain module, for checkpoints and evaluation
    if procs.ddp:
        dist.init_process_group(backend="nccl" if procs.device.type == "cuda" else "gloo")
    fast_model = torch.compile(trainer.model) if s["compile"] else trainer.model
    train_model = (DDP(fast_model, device_ids=[procs.local_rank] if procs.device.type == "cuda" else None)
                   if procs.ddp else fast_model)
    start_log(trainer, s)
    report_start(trainer, s)

    # Ctrl-C (SIGINT) or SIGTERM: finish the current step, save, stop. A second Ctrl-C stops at once.
    stop_signal = []

    def request_stop(signum, frame):
        stop_signal.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous_handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return train_loop(trainer, fast_model, train_model, stop_signal)
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if procs.ddp:
            del train_model  # DDP uses the process group: release it first
            dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        settings, explicit = parse_args(argv)
        check_settings(settings)
        return train(settings, explicit)
    except (ValueError, OSError) as e:  # bad settings, data or checkpoint (SettingsError is a ValueError)
        message = common.one_line(e)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise  # a bug, not the machine's limit: its traceback is what a report needs
        message = (f"out of memory ({common.one_line(e)[:150]}); use a smaller batch_size, block_size or model, "
                   f"or gradient_accumulation_steps")
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
