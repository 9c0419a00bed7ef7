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
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from leviathan import EMBEDDINGS, GPT, Config
from machinery import checkpoints, cli, retrofit, runs
from machinery.grad_stats import GradStats, clip_gradients, clipped
from machinery.runtime import set_runtime
from machinery.settings import SettingsError, help_text, parse_args

# --------------------------------------------------------------------------------------------------
# Settings: name -> (default, help). The model's come from leviathan.Config's fields, defaults and
# help; machinery/runs.py checks their ranges.

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
                  "a CPU, more a GPU"),
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
    "batch_size": (64, "sequences per micro-step, per process"),
    "gradient_accumulation_steps": (1, "micro-steps per optimizer step, over all processes "
                                    "together"),
    "max_iters": (5000, "optimizer steps"),
    "learning_rate": (1e-3, "peak learning rate (AdamW)"),
    "min_lr": (1e-4, "learning rate at the end of the cosine decay"),
    "warmup_iters": (100, "steps of linear warmup (the first step already has lr > 0)"),
    "lr_decay_iters": (0, "step at which the cosine decay reaches min_lr; 0 means max_iters (fixed "
                       "at the start of a run, so that resuming with a larger max_iters keeps the "
                       "schedule)"),
    "weight_decay": (0.1, "AdamW weight decay (matrices and tables only)"),
    "lev_lr_scale": (1.0, "lev arm: LEV's learning rate as a multiple of the schedule's (warmup, "
                     "cosine, min_lr)"),
    "lev_wd_scale": (1.0, "lev arm: LEV's weight decay (codebooks, seed_proj, out_proj) as a "
                     "multiple of weight_decay"),
    "lev_clip_apart": (False, "lev arm: clip LEV's gradient norm and the rest's each to grad_clip "
                       "on its own, so that LEV's gradients do not scale down the head's and the "
                       "backbone's"),
    "beta1": (0.9, "AdamW beta1"),
    "beta2": (0.95, "AdamW beta2"),
    "grad_clip": (1.0, "clip the gradient norm to this; 0: no clipping"),
    # evaluation and logging
    "eval_interval": (250, "evaluate, log to log.jsonl and write ckpt.pt every this many steps"),
    "eval_iters": (20, "evaluate on eval_iters * batch_size fixed windows per split; 0: the whole "
                   "val split"),
    "log_interval": (10, "print a progress line every this many steps"),
    # system
    "device": ("auto", "auto (cuda, else mps, else cpu), cpu, cuda or mps"),
    "dtype": ("auto", "float32, bfloat16 or float16 (autocast, with a GradScaler for float16); "
              "auto: bfloat16 on CUDA (float16 if unsupported), float32 elsewhere"),
    "compile": (False, "torch.compile the model"),
    "seed": (1337, "seed of the model's initialization and, separately, of the data order"),
    **retrofit.SETTINGS,  # fitting LEV to a table model's input table (fit_steps, fit_lr, ...)
}
CHOICES = {"embedding": EMBEDDINGS, "device": ("auto", "cpu", "cuda", "mps"),
           "dtype": ("auto", "float32", "bfloat16", "float16"), **retrofit.CHOICES}


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


def get_batch(data, starts, block_size, device):
    """Windows of a split at offsets starts -> inputs x, next-token targets y, (len(starts), T)."""
    rows = np.stack([data[i:i + block_size + 1] for i in starts]).astype(np.int64)
    xy = torch.from_numpy(rows)
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    else:
        xy = xy.to(device)
    return xy[:, :-1], xy[:, 1:]


# --------------------------------------------------------------------------------------------------
# Training


class Trainer:
    """One run: the model, its optimizer, the counters a checkpoint saves and a resume restores."""

    def __init__(self, s, procs, data, ckpt):
        self.s, self.procs, self.data = s, procs, data
        self.ckpt_path = os.path.join(s["out_dir"], "ckpt.pt")
        self.log_path = os.path.join(s["out_dir"], "log.jsonl")
        self.data_generator = torch.Generator()  # the data order's own stream, apart from the init
        self.origin = None  # the checkpoint a fine-tuning run started from
        self.fit_table = None  # a retrofit's source input table, which train() fits LEV to
        if ckpt is None or s["init_from"] != "resume":
            torch.manual_seed(s["seed"])  # the model's initialization
            config = Config(vocab_size=data.meta["vocab_size"], **{key: s[key] for key in MODEL})
            # a retrofit: a new lev model, which fine_tune gives the source's weights
            fresh = GPT(config) if ckpt is None or ckpt["retrofit"] else None
            self.model = fresh if ckpt is None else self.fine_tune(ckpt, fresh)
            self.data_generator.manual_seed(s["seed"] + runs.DATA_SEED_OFFSET)
            torch.manual_seed(s["seed"] + procs.rank)  # dropout masks: a stream per process
            self.step, self.tokens_seen, self.best_val_loss = 0, 0, float("inf")
            self.elapsed_before = 0.0
        else:
            self.resume(ckpt)
        runs.freeze(self.model, set(filter(None, s["freeze"].split(","))))
        if not any(p.requires_grad for p in self.model.parameters()):
            raise SettingsError(f"freeze={s['freeze']} leaves nothing to train; freeze fewer parts")
        self.model.to(procs.device)
        # the fast paths, each checked against leviathan.py as it stands on this device (an edited
        # model runs as written where they differ, said in one line); training does not generate
        set_runtime(self.model, lev_fast=s["lev_fast"], lev_chunk=s["lev_chunk"],
                    lev_compile=s["lev_compile"], lev_c_kernels=s["lev_c_kernels"],
                    lean_head=s["lean_head"], fast_decoding=False, say=procs.note)
        self.grad_stats = GradStats(self.model, s["grad_clip"])  # empty at a resume: not saved
        self.optimizer = self.new_optimizer(s["lev_lr_scale"], s["lev_wd_scale"])
        self.scaler = torch.amp.GradScaler(procs.device.type, enabled=procs.dtype == "float16")
        if s["init_from"] == "resume":
            try:
                self.load_optimizer_state(ckpt)
                if "scaler" in ckpt:
                    self.scaler.load_state_dict(ckpt["scaler"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise SettingsError(f"{self.ckpt_path}: its optimizer state does not fit the "
                                    f"model ({cli.one_line(e)[:200]}); it was edited or "
                                    f"damaged") from None
        self.t_start = time.time()

    def new_optimizer(self, lev_lr_scale, lev_wd_scale):
        s = self.s
        return self.model.configure_optimizers(s["weight_decay"], s["learning_rate"],
                                               (s["beta1"], s["beta2"]), self.procs.device.type,
                                               lev_lr_scale, lev_wd_scale)

    def load_optimizer_state(self, ckpt):
        """The checkpoint's optimizer state, read into the groups its run had (they depend on its
        lev_lr_scale and lev_wd_scale, 1 in checkpoints older than them), then handed over
        parameter by parameter: a resume may change those settings, and with them whether LEV has
        groups of its own. The groups keep this run's settings."""
        saved = ckpt["train_config"]
        as_saved = self.new_optimizer(saved.get("lev_lr_scale", 1.0),
                                      saved.get("lev_wd_scale", 1.0))
        as_saved.load_state_dict(ckpt["optimizer"])
        for p, state in as_saved.state.items():
            self.optimizer.state[p] = state

    def fine_tune(self, source, lev_model):
        """The source checkpoint's model, with its weights (dropout as this run asks); a retrofit:
        lev_model, with the source's backbone and head (train() then fits its LEV)."""
        runs.check_same_tokens(source["meta"], self.data, source["path"],
                               "fine-tune on data prepared with the source's tokenizer")
        source["model_config"]["dropout"] = self.s["dropout"]
        self.origin = {"checkpoint": source["path"], "step": source.get("step"),
                       "dataset": source["meta"].get("dataset"),
                       "embedding": source["model_config"]["embedding"]}
        # built also for a retrofit: building checks the source (its settings, weights, finiteness)
        model = checkpoints.build_model(source, source["path"], GPT, Config)
        if not source["retrofit"]:
            return model.train()
        self.fit_table = retrofit.transplant(lev_model, source["model"])
        return lev_model.train()

    def resume(self, ckpt):
        s, procs = self.s, self.procs
        self.origin = ckpt.get("origin")
        runs.check_same_tokens(ckpt["meta"], self.data, self.ckpt_path, "resume on data with the "
                               "same tokenizer, or train from scratch in another out_dir")
        self.model = checkpoints.build_model(ckpt, self.ckpt_path, GPT, Config).train()
        runs.restore_rng(ckpt, self.data_generator, procs.device, self.ckpt_path)
        self.step, self.tokens_seen = ckpt["step"], ckpt["tokens_seen"]
        if self.step < 0 or self.tokens_seen < 0:
            raise SettingsError(f"{self.ckpt_path}: step={self.step}, "
                                f"tokens_seen={self.tokens_seen} must be >= 0; it was edited or "
                                f"damaged")
        self.best_val_loss = ckpt["best_val_loss"]
        self.elapsed_before = float(ckpt.get("elapsed_s", 0.0))
        if procs.ddp and procs.rank > 0:  # only rank 0's dropout stream is saved
            torch.manual_seed(s["seed"] + procs.rank + self.step)

    def elapsed(self):
        return self.elapsed_before + time.time() - self.t_start

    @torch.no_grad()
    def evaluate(self, fast_model, split, starts):
        """Mean loss per target token over the fixed windows, each process taking every world-th."""
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
        ckpt = {"version": checkpoints.CHECKPOINT_VERSION, "model": self.model.state_dict(),
                "model_config": dataclasses.asdict(self.model.config), "train_config": dict(self.s),
                "meta": self.data.meta, "step": self.step, "tokens_seen": self.tokens_seen,
                "best_val_loss": self.best_val_loss, "elapsed_s": self.elapsed(),
                "optimizer": self.optimizer.state_dict(), "rng": rng}
        if self.origin is not None:
            ckpt["origin"] = self.origin
        if self.scaler.is_enabled():
            ckpt["scaler"] = self.scaler.state_dict()
        checkpoints.save_checkpoint(ckpt, self.ckpt_path)

    def evaluate_and_save(self, fast_model):
        """Evaluate both splits, append to log.jsonl, save ckpt.pt. Returns False (nothing saved)
        when the model has diverged: a non-finite val loss or non-finite weights."""
        s, data = self.s, self.data
        t_eval = time.time()
        train_loss = self.evaluate(fast_model, data.train, data.train_starts)
        val_loss = self.evaluate(fast_model, data.val, data.val_starts)
        self.last_eval_s = time.time() - t_eval
        finite = math.isfinite(val_loss) and math.isfinite(train_loss)
        if not (finite and runs.all_finite(self.model)):
            self.diverged(f"the val loss is {val_loss} at step {self.step}")
            return False
        self.best_val_loss = min(self.best_val_loss, val_loss)
        record = {"step": self.step, "tokens": self.tokens_seen, "train_loss": train_loss,
                  "val_loss": val_loss, "lr": get_lr(self.step, s), **self.grad_stats.record(),
                  "elapsed_s": round(self.elapsed(), 3), "embedding": s["embedding"]}
        if self.origin is not None:
            record["init_from"] = self.origin["checkpoint"]
            if self.step == 0 and "retrofit" in self.origin:  # the fit's figures, once
                record["retrofit"] = self.origin["retrofit"]
        if self.procs.master:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        self.save()
        self.procs.log(f"step {self.step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} "
                       f"(best {self.best_val_loss:.4f}), eval {self.last_eval_s:.1f} s, saved "
                       f"{self.ckpt_path}")
        return True

    def diverged(self, what):
        if self.procs.master:
            kept = (f"{self.ckpt_path} keeps the last good state" if os.path.exists(self.ckpt_path)
                    else "no checkpoint was written")
            print(f"train.py: error: {what}; stopping without saving, {kept}. Lower learning_rate "
                  f"(or grad_clip), or use dtype=float32 or bfloat16", file=sys.stderr)

    def train_step(self, train_model, stop_signal):
        """One optimizer step over gradient_accumulation_steps * batch_size windows, drawn for all
        processes together so that the data order does not depend on how many processes share the
        work. Returns (mean loss, gradient norm, whether clipping scaled it down, whether any
        process was asked to stop, lr), or None when the loss or the gradient is not finite (then
        no weight was changed)."""
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
        # one all-reduce: the step's mean loss, and whether a signal asked any process to stop
        stop_requested = torch.tensor(float(bool(stop_signal)), device=procs.device)
        shared = torch.stack([loss_sum / procs.local_accum, stop_requested])
        if procs.ddp:
            dist.all_reduce(shared)
        step_loss, stop = shared[0].item() / procs.world, shared[1].item() > 0
        # float16's GradScaler skips an inf-gradient step itself; elsewhere the step writes NaNs
        bad_grad = not self.scaler.is_enabled() and not torch.isfinite(grad_norm)
        if not math.isfinite(step_loss) or bad_grad:
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


def train_loop(trainer, fast_model, train_model, stop_signal, evaluated=None):
    """Evaluate + save every eval_interval steps (but not at step `evaluated`, already in the log),
    step, print progress; returns the exit code."""
    s, procs = trainer.s, trainer.procs
    max_iters, eval_interval = s["max_iters"], s["eval_interval"]
    tokens_per_step = s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]
    t_log, steps_since_log, clipped_since_log, trainer.last_eval_s = time.time(), 0, 0, 0.0
    while True:
        due = trainer.step % eval_interval == 0 or trainer.step == max_iters
        if due and trainer.step != evaluated:
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
            evals_left = (max_iters // eval_interval - trainer.step // eval_interval
                          + (max_iters % eval_interval > 0))
            eta = (max_iters - trainer.step) * step_s + evals_left * trainer.last_eval_s
            clip = (f" | clipped {100 * clipped_since_log / steps_since_log:.0f}%"
                    if s["grad_clip"] > 0 else "")
            procs.log(f"step {trainer.step}/{max_iters} | loss {step_loss:.4f} | lr {lr:.2e} | "
                      f"grad norm {grad_norm:.3f}{clip} | {1000 * step_s:.0f} ms/step | "
                      f"{tokens_per_step / step_s:,.0f} tok/s | ETA {runs.format_seconds(eta)}")
            t_log, steps_since_log, clipped_since_log = time.time(), 0, 0
        if stop:
            trainer.save()
            procs.log(f"stopped at step {trainer.step}; saved {trainer.ckpt_path}. Continue with: "
                      f"python train.py --out_dir={s['out_dir']} --init_from=resume")
            return 130


def train(s, explicit):
    ckpt = runs.resolve_run(s, explicit, SETTINGS, CHOICES, MODEL, Config)
    procs = runs.Processes(s)
    data = runs.Data(s)
    if procs.master:
        cli.remove_stale_temps(s["out_dir"])  # half-written files of runs killed mid-save
    trainer = Trainer(s, procs, data, ckpt)
    del ckpt
    # joining the group waits for every process: all have checked out_dir before log.jsonl exists
    if procs.ddp:
        dist.init_process_group(backend="nccl" if procs.device.type == "cuda" else "gloo")
    resuming = s["init_from"] == "resume"
    evaluated = trainer.step if resuming and runs.logged(trainer.log_path, trainer.step) else None
    if procs.master:
        runs.start_log(trainer.log_path, resuming, trainer.step)
    runs.report_start(trainer, s)
    if trainer.fit_table is not None:  # a retrofit: fit LEV to the source's table, then free it
        trainer.origin["retrofit"] = retrofit.retrofit(trainer.model.tok_emb, trainer.fit_table,
                                                       data.train, s, procs.log)
        trainer.fit_table = None
    # wrap: torch.compile, then DDP; trainer.model stays the plain module (checkpoints, evaluation)
    fast_model = torch.compile(trainer.model) if s["compile"] else trainer.model
    on_gpu = procs.device.type == "cuda"
    train_model = (DDP(fast_model, device_ids=[procs.local_rank] if on_gpu else None)
                   if procs.ddp else fast_model)
    try:
        with runs.stop_requests() as stop_signal:  # Ctrl-C or SIGTERM: finish the step, save, stop
            return train_loop(trainer, fast_model, train_model, stop_signal, evaluated)
    finally:
        if procs.ddp:
            del train_model  # DDP uses the process group: release it first
            dist.destroy_process_group()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(help_text(__doc__, SETTINGS))
        return 0
    settings = None
    try:
        settings, explicit = parse_args(argv, SETTINGS, CHOICES, "train.py")
        runs.check_settings(settings, MODEL, Config)
        return train(settings, explicit)
    except KeyboardInterrupt:  # outside the training loop (which saves, then stops): at once
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: stopped (Ctrl-C); {runs.what_was_kept(settings)}", file=sys.stderr)
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
