"""
Train a Leviathan, or one of its baselines, on a dataset prepared by prepare_data.py.

    python train.py config/shakespeare_cpu.py                    # Leviathan (LEV embedding), on CPU
    python train.py config/shakespeare_cpu.py --embedding=tied   # the baseline: the same batches
    python train.py --out_dir=out-shakespeare-cpu-lev --init_from=resume     # continue a run
    python train.py --init_from=out-a-lev --dataset=b --out_dir=out-b-lev    # fine-tune on data b
    torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_gpu.py   # DDP, one per GPU

Settings: the defaults below, then config files (`key = value` lines, parsed, never executed), then
--key=value flags; a resume takes its checkpoint's in place of the defaults, a fine-tune its model.
Every arm with the same seed draws the same batches and is evaluated on the same fixed windows.
out_dir/log.jsonl gets a record per evaluation; out_dir/ckpt.pt, written atomically at evaluations
(step 0's only if the run ends there) and on Ctrl-C, resumes the run exactly (10 + 10 steps == 20).
A non-finite loss, gradient norm or val loss stops the run before any save.
"""

import ast
import contextlib
import dataclasses
import difflib
import errno
import json
import math
import os
import shutil
import signal
import string
import sys
import time


def stopped_while_starting(signum, frame):
    print("train.py: stopped (Ctrl-C) while starting; nothing was written", file=sys.stderr,
          flush=True)
    os._exit(130)  # not SystemExit: raised inside torch's C++ import code, it aborts the process


if __name__ == "__main__":  # Ctrl-C while torch loads (a second or more): that line, no traceback
    signal.signal(signal.SIGINT, stopped_while_starting)  # until main() starts

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.compiled_lev import CompiledRecipe
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import EMBEDDINGS, GPT, Config

# --------------------------------------------------------------------------------------------------
# Settings: name -> (default, help) or (default, help, rule); a rule bounds a number. The model's
# come from leviathan.Config, which checks them itself.


def at_least(low):
    return lambda v: None if v >= low else f"must be at least {low}"


def within(low, high, said=None):
    return lambda v: None if low <= v < high else f"must be in [{low}, {said or high})"


def above(low):
    return lambda v: None if v > low else f"must be > {low}"


MODEL = {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(Config)
         if f.name != "vocab_size"}
DATA_SEED_OFFSET = 1_000_003  # the data order's seed is seed + this: a stream apart from the init's
SETTINGS = {
    "dataset": ("shakespeare", "a dataset folder under data_dir, made by prepare_data.py"),
    "data_dir": ("data", "folder that holds the datasets"),
    "out_dir": ("out-{dataset}-{embedding}", "ckpt.pt and log.jsonl go here; {name}: that setting"),
    "init_from": ("scratch", "scratch, resume (out_dir/ckpt.pt), or PATH: fine-tune its model"),
    "freeze": ("", "fine-tuning: parts kept fixed, of embedding,backbone,head (comma-separated)"),
    "overwrite": (False, "let a scratch run replace the run already in out_dir"),
    **MODEL,
    # the fast paths (kernels/): settings of the run, which change speed and memory, not results
    "lev_chunk": (64, "LEV's torch kernels: ids computed together (64 suits a CPU)", at_least(1)),
    "lev_c_kernels": (True, "LEV on CPU: the spline product in C (kernels/lev_kernels.c)"),
    "lev_compile": (True, "LEV: torch.compile its torch kernels where the C ones do not run, and "
                    "its recipe where the fast path is off or steps aside (an edit)"),
    "lean_head": (True, "the memory-lean head: logits made only when used (the loss needs none)"),
    "lev_fast": (True, "LEV's fast path; False: LEV as leviathan.py writes it (see lev_compile)"),
    # optimization
    "batch_size": (64, "sequences per micro-step, per process", at_least(1)),
    "gradient_accumulation_steps": (1, "micro-steps per step, all processes together", at_least(1)),
    "max_iters": (5000, "optimizer steps", at_least(0)),
    "learning_rate": (1e-3, "peak learning rate (AdamW)", above(0)),
    "min_lr": (1e-4, "learning rate at the end of the cosine decay", at_least(0)),
    "warmup_iters": (100, "steps of linear warmup (step 0 already has lr > 0)", at_least(0)),
    "lr_decay_iters": (0, "step where the decay reaches min_lr; 0: max_iters at the run's start",
                       at_least(0)),
    "weight_decay": (0.1, "AdamW weight decay (matrices and tables only)", at_least(0)),
    "beta1": (0.9, "AdamW beta1", within(0, 1)),
    "beta2": (0.95, "AdamW beta2", within(0, 1)),
    "grad_clip": (1.0, "clip the gradient norm to this; 0: no clipping", at_least(0)),
    "z_loss": (0.0, "z_loss * (log Z)^2 per token added to training's loss; it makes the logits "
               "(with the lean head: a second pass of the head)", within(0, 1)),
    # evaluation and logging
    "eval_interval": (250, "evaluate, log and write ckpt.pt every this many steps", at_least(1)),
    "eval_iters": (20, "eval_iters * batch_size windows per split; 0: all of val", at_least(0)),
    "log_interval": (10, "print a progress line every this many steps", at_least(1)),
    # system
    "device": ("auto", "auto (cuda, else mps, else cpu), cpu, cuda or mps"),
    "dtype": ("auto", "float32, bfloat16, float16 (with a GradScaler); auto: bf16 on CUDA"),
    "compile": (False, "torch.compile the model"),
    "seed": (1337, "seed of the initialization and, apart, of the data order",
             within(0, 2 ** 63 - 2 ** 21, "2^63 - 2^21")),  # room for the offsets: data, processes
}
CHOICES = {"embedding": EMBEDDINGS, "device": ("auto", "cpu", "cuda", "mps"),
           "dtype": ("auto", "float32", "bfloat16", "float16")}


# --------------------------------------------------------------------------------------------------
# The run, top to bottom (how settings, data and checkpoints are read and checked: after it)


def train(s, explicit):
    """One run -> its exit code: 0 done, 1 diverged (nothing saved), 130 stopped by Ctrl-C or
    SIGTERM (saved)."""
    s, ckpt, source = resolve(s, explicit)
    resuming, out_dir = s["init_from"] == "resume", s["out_dir"]
    ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")
    B, T, accum = s["batch_size"], s["block_size"], s["gradient_accumulation_steps"]
    tokens_per_step = accum * B * T

    # processes (torchrun sets RANK and WORLD_SIZE), device and dtype
    ddp = "RANK" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    master, local_rank = rank == 0, int(os.environ.get("LOCAL_RANK", 0))
    log = print if master else (lambda *args, **kwargs: None)
    device, dtype = pick_device(s["device"], s["dtype"], ddp, local_rank)
    autocast = (contextlib.nullcontext() if dtype == "float32"
                else torch.autocast(device.type, dtype=getattr(torch, dtype)))
    if accum % world:
        raise ValueError(f"gradient_accumulation_steps={accum} must be divisible by the number "
                         f"of processes ({world})")
    local_accum = accum // world

    # data: the splits, and fixed evaluation windows (as many of the train split as of val)
    data_dir = os.path.join(s["data_dir"], s["dataset"])
    meta, train_data, val_data = load_data(data_dir)
    val_starts = eval_windows(len(val_data), T, s["eval_iters"] * B or None)
    train_starts = eval_windows(len(train_data), T, len(val_starts))
    if ckpt:
        check_same_tokens(ckpt["meta"], meta, source, data_dir, "use data of the same tokens")

    # the model: resumed, fine-tuned from a checkpoint's, or new; the data order's own generator
    data_order, origin = torch.Generator(), None
    step, tokens_seen, best_val_loss, elapsed_before = 0, 0, math.inf, 0.0
    if resuming:
        model = build_model(ckpt, source)
        step, tokens_seen, best_val_loss, elapsed_before = restore_run(ckpt, source, data_order,
                                                                       device)
        origin = ckpt.get("origin")
        if rank > 0:  # only rank 0's dropout stream is saved
            torch.manual_seed(s["seed"] + rank + step)
    else:
        torch.manual_seed(s["seed"])  # the model's initialization
        if ckpt:
            ckpt["model_config"]["dropout"] = s["dropout"]
            origin = {"checkpoint": source, "step": ckpt.get("step"), "embedding": s["embedding"],
                      "dataset": ckpt["meta"].get("dataset")}
            model = build_model(ckpt, source)
        else:
            model = GPT(Config(vocab_size=meta["vocab_size"], **{k: s[k] for k in MODEL}))
        data_order.manual_seed(s["seed"] + DATA_SEED_OFFSET)
        torch.manual_seed(s["seed"] + rank)  # dropout masks: a stream per process
    freeze(model, s["freeze"])
    model.to(device)
    # the fast paths, each checked against leviathan.py as it stands; one that differs (an edit)
    # steps aside in one line: LEV's recipe then runs compiled, else as written
    lev = []
    if s["lev_fast"]:
        lev.append(FastEmbedder(s["lev_chunk"], s["lev_c_kernels"], s["lev_compile"]))
    if s["lev_compile"]:
        lev.append(CompiledRecipe())
    install_fast_paths(model, lev=lev, lean_head=s["lean_head"],
                       say=lambda line: log(line, file=sys.stderr, flush=True))
    optimizer = torch.optim.AdamW(model.param_groups(s["weight_decay"]), lr=s["learning_rate"],
                                  betas=(s["beta1"], s["beta2"]), fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    if resuming:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            if "scaler" in ckpt:
                scaler.load_state_dict(ckpt["scaler"])
        except (KeyError, TypeError, ValueError, RuntimeError):
            raise ValueError(f"{source}: its optimizer state does not fit this train.py's "
                             f"parameter groups (another version wrote it); fine-tune from it "
                             f"with a fresh optimizer: --init_from={source} and another "
                             f"--out_dir") from None
    del ckpt

    # log.jsonl: a resume keeps the records up to its step, and does not evaluate that step again
    records = read_log(log_path, step) if resuming else []
    evaluated = step if any(r["step"] == step for r in records) else None
    if ddp:  # joining waits for every process: all have read the log before it is rewritten
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if master:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot write in {out_dir} ({e.strerror}); train into a "
                          f"folder you can write to (--out_dir)") from None
        write_atomic(log_path, "".join(json.dumps(r) + "\n" for r in records))
    log(describe_run(s, meta, model, data_dir, train_data, val_data, len(val_starts), origin,
                     device, dtype, world, tokens_per_step, resuming, step, ckpt_path))

    # torch.compile, then DDP; model stays the plain module (checkpoints, the finiteness check)
    train_model = torch.compile(model) if s["compile"] else model
    if ddp:
        train_model = DDP(train_model, device_ids=[local_rank] if device.type == "cuda" else None)
    eval_model = train_model.module if ddp else train_model

    def save():  # ckpt.pt: what a resume needs to go on exactly; rank 0 writes it
        if master:
            write_atomic(ckpt_path, {
                "version": 2, "model": model.state_dict(), "train_config": dict(s),
                "model_config": dataclasses.asdict(model.config), "meta": meta, "step": step,
                "tokens_seen": tokens_seen, "best_val_loss": best_val_loss,
                "rng": {"data": data_order.get_state(), "torch": torch.get_rng_state()}
                | ({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {}),
                "optimizer": optimizer.state_dict(),
                "elapsed_s": elapsed_before + time.time() - t_start}
                | ({"origin": origin} if origin else {})
                | ({"scaler": scaler.state_dict()} if scaler.is_enabled() else {}))

    stop = StopRequest()  # Ctrl-C or SIGTERM: finish the step, save, stop (main() undoes it)
    norms, clipped = [], 0  # the gradient norms read since the last record, the clipped ones
    t_start = t_line = time.time()
    eval_s, steps_since_line = 0.0, 0
    while True:
        # evaluate, log and save every eval_interval steps and at the last
        if (step % s["eval_interval"] == 0 or step == s["max_iters"]) and step != evaluated:
            t_eval = time.time()
            metrics = {f"{split}_{name}": value for split, data, starts in (
                ("train", train_data, train_starts), ("val", val_data, val_starts))
                for name, value in estimate_loss(eval_model, data, starts, s, device,
                                                 autocast).items()}
            eval_s = time.time() - t_eval
            val_loss = metrics["val_loss"]
            if not (math.isfinite(val_loss + metrics["train_loss"])
                    and all(torch.isfinite(p).all() for p in model.parameters())):
                return diverged(f"the val loss is {val_loss} at step {step}", ckpt_path, log)
            best_val_loss = min(best_val_loss, val_loss)
            record = {"step": step, "tokens": tokens_seen, **metrics, "lr": get_lr(step, s),
                      "grad_norm": sum(norms) / len(norms) if norms else None,
                      "clip_fraction": clipped / len(norms) if norms and s["grad_clip"] else None,
                      "elapsed_s": round(elapsed_before + time.time() - t_start, 3),
                      "embedding": s["embedding"]}
            if origin:
                record["init_from"] = origin["checkpoint"]
            norms, clipped = [], 0
            # step 0's state is what the same command builds again: saved only if the run ends
            # there, so that a run that fails in its first steps can be run again as it was
            saved = step > 0 or step == s["max_iters"]
            if saved:
                save()
            if master:  # after the save: the log never names a state that was not saved
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
            said = ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in
                             metrics.items())
            log(f"step {step}: {said} (best val loss {best_val_loss:.4f}), eval {eval_s:.1f} s"
                + (f", saved {ckpt_path}" if saved else ""))
            t_line = time.time()  # progress lines time the training steps only
        if step >= s["max_iters"]:
            return 0

        # one optimizer step: accum * B windows, drawn for all processes together
        lr = get_lr(step, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(train_data) - T, (accum * B,), generator=data_order).numpy()
        for micro_step in range(local_accum):
            first = (rank * local_accum + micro_step) * B
            X, Y = get_batch(train_data, starts[first:first + B], T, device)
            if ddp:  # average the gradients across processes at the last micro-step only
                train_model.require_backward_grad_sync = micro_step == local_accum - 1
            with autocast:
                logits, loss = train_model(X, Y)
                if s["z_loss"]:  # PaLM's z-loss: keeps log Z, the softmax's normaliser, near 0
                    loss = loss + s["z_loss"] * logits.float().logsumexp(-1).pow(2).mean()
                loss = loss / local_accum  # the step's gradient: the mean of its micro-steps'
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"] or math.inf)
        steps_since_line += 1

        # a progress line every log_interval steps and at a stop: the device is read here only,
        # before the optimizer step, so that a non-finite loss stops with the weights intact.
        # DDP: each process may see Ctrl-C at another step, so they stop at progress lines only,
        # if any of them was asked to (all_mean below)
        line = (step + 1) % s["log_interval"] == 0 or (stop.requested and not ddp)
        if line:
            lossf = loss.item() * local_accum  # the last micro-step's loss, as nanoGPT's
            normf = grad_norm.item()  # before clipping
            stopping = stop.requested
            if ddp:
                lossf = all_mean(lossf, device)
                stopping = all_mean(float(stopping), device) > 0
            if not math.isfinite(lossf):
                return diverged(f"the loss is {lossf} at step {step}", ckpt_path, log)
            if not math.isfinite(normf) and not scaler.is_enabled():  # float16: a skipped step
                return diverged(f"the gradient norm is {normf} at step {step}", ckpt_path, log)
            if math.isfinite(normf):
                norms.append(normf)
                if s["grad_clip"] and normf > s["grad_clip"]:
                    clipped += 1
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        if line:
            step_s = (time.time() - t_line) / steps_since_line
            evals_left = math.ceil(s["max_iters"] / s["eval_interval"]) - step // s["eval_interval"]
            eta = int((s["max_iters"] - step) * step_s + evals_left * eval_s)
            clip = (f" | clipped {100 * clipped / max(1, len(norms)):.0f}%" if s["grad_clip"]
                    else "")
            # lr at `step`, as its log.jsonl record has it (the one the next update uses)
            log(f"step {step}/{s['max_iters']} | loss {lossf:.4f} | lr {get_lr(step, s):.2e} | "
                f"grad norm {normf:.3f}{clip} | {1000 * step_s:.0f} ms/step | "
                f"{tokens_per_step / step_s:,.0f} tok/s | ETA {eta // 60}m{eta % 60:02d}s")
            t_line, steps_since_line = time.time(), 0
            if stopping:
                save()
                log(f"stopped at step {step}; saved {ckpt_path}. Continue with: python train.py "
                    f"--out_dir={out_dir} --init_from=resume")
                return 130


# --------------------------------------------------------------------------------------------------
# What the loop calls


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
    xy = torch.from_numpy(np.stack([data[i:i + block_size + 1] for i in starts]).astype(np.int64))
    xy = xy.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else xy.to(device)
    return xy[:, :-1], xy[:, 1:]


@torch.no_grad()
def estimate_loss(model, data, starts, s, device, autocast):
    """Metrics over a split's fixed windows (each process takes every world-th), the model in eval
    mode meanwhile -> {name: mean per target token}. "loss" is the cross-entropy of the model's
    logits, computed here, not taken from the model's loss: whatever term training adds, it stays
    the cross-entropy (under the lean head, without holding all the logits). A new metric is one
    entry of `batch` below: logged as train_NAME and val_NAME, and printed."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    model.eval()
    totals, count, mine = {}, 0, starts[rank::world]
    for i in range(0, len(mine), s["batch_size"]):
        x, y = get_batch(data, mine[i:i + s["batch_size"]], s["block_size"], device)
        with autocast:
            logits, _ = model(x)
            batch = {  # each: its mean over the batch's target tokens
                "loss": F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1),
                                        ignore_index=-1)}
        for name, value in batch.items():
            totals[name] = totals.get(name, 0.0) + value.item() * y.numel()
        count += y.numel()
    model.train()
    if world > 1:
        sums = torch.tensor([*totals.values(), count], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        *values, count = sums.tolist()
        totals = dict(zip(totals, values, strict=True))
    return {name: total / count for name, total in totals.items()}


def all_mean(value, device):
    """A number's mean over the DDP processes."""
    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def diverged(what, ckpt_path, log):
    kept = ("no checkpoint was written" if not os.path.exists(ckpt_path)
            else f"{ckpt_path} keeps the last good state")
    log(f"train.py: error: {what}; stopping without saving, {kept}. Lower learning_rate (or "
        f"grad_clip), or use dtype=float32 or bfloat16", file=sys.stderr)
    return 1


class StopRequest:
    """Ctrl-C or SIGTERM sets requested: the loop finishes its step, saves and stops. A second
    Ctrl-C stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request)

    def request(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)


# --------------------------------------------------------------------------------------------------
# The setup's helpers: device, model parts, resume, the run's description


def pick_device(name, dtype, ddp, local_rank):
    """--device, --dtype -> (a torch.device, a dtype name): auto is cuda, else mps, else cpu; one
    asked for must be here. dtype auto: bf16 on CUDA (float16 where it lacks bf16), else fp32."""
    here = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": 1}
    name = next(d for d in here if here[d]) if name == "auto" else name
    if not here[name] or (ddp and name == "mps"):
        raise ValueError(f"--device={name}: torch sees no such device here" if not here[name]
                         else "DDP runs on cuda (nccl) or cpu (gloo), not mps; use --device=cpu")
    device = torch.device(f"cuda:{local_rank}" if name == "cuda" and ddp else name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if dtype == "auto":
        dtype = "float32" if device.type != "cuda" else (
            "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    return device, dtype


def cpu_has_amx_bf16():
    """Whether Linux lists the CPU's AMX-BF16 unit (bfloat16 matrix products in hardware)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        return " amx_bf16" in f.read()
    return False


def freeze(model, parts):
    """--freeze: keep the named parts (embedding, backbone, head) fixed. The tied table is both the
    embedding and the head: frozen if either is."""
    frozen = set(filter(None, parts.split(",")))
    head, embedding = {id(model.lm_head.weight)}, {id(p) for p in model.tok_emb.parameters()}
    for p in model.parameters():
        in_parts = {part for part, ids in (("embedding", embedding), ("head", head))
                    if id(p) in ids}
        if not in_parts:
            in_parts = {"backbone"}
        p.requires_grad_(not in_parts & frozen)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"freeze={parts} leaves nothing to train; freeze fewer parts")


def restore_run(ckpt, source, data_order, device):
    """A resume: its counters -> (step, tokens_seen, best_val_loss, elapsed_s), and its random
    states put back (the data order, torch's, CUDA's)."""
    try:  # a counter or an rng state missing, of another type (TypeError) or negative
        step, tokens_seen, best_val_loss = ckpt["step"], ckpt["tokens_seen"], ckpt["best_val_loss"]
        assert min(step, tokens_seen, best_val_loss) >= 0, "a counter is negative"
        data_order.set_state(ckpt["rng"]["data"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    except (AssertionError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{source}: its counters or random states (rng) are unusable ({e}); "
                         f"it was edited or damaged") from None
    return step, tokens_seen, best_val_loss, ckpt.get("elapsed_s", 0.0)


def describe_run(s, meta, model, data_dir, train_data, val_data, n_windows, origin, device,
                 dtype, world, tokens_per_step, resuming, step, ckpt_path):
    """The lines a run starts with: its data, model, device and what it writes."""
    sizes = ", ".join(f"{k} {v:,}" for k, v in model.param_report().items())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lines = [f"data: {data_dir}, {meta['tokenizer']} tokens, vocab {meta['vocab_size']:,}, train "
             f"{len(train_data):,}, val {len(val_data):,} tokens ({n_windows} eval windows)",
             f"model: {s['embedding']}, parameters: {sizes}"
             + (f", trainable {trainable:,} (frozen: {s['freeze']})" if s["freeze"] else "")]
    if origin:
        lines.append(f"fine-tuning {origin['checkpoint']} (step {origin['step']}, dataset "
                     f"{origin['dataset']}) with a fresh optimizer and schedule")
    lines.append(f"device {device}, dtype {dtype}, {world} process(es), {tokens_per_step:,} "
                 f"tokens per step, " + (f"resuming at step {step}" if resuming
                                         else f"writing {ckpt_path}"))
    if device.type == "cpu" and s["dtype"] == "auto" and cpu_has_amx_bf16():
        lines.append("note: this CPU multiplies bfloat16 matrices in hardware (AMX): "
                     "--dtype=bfloat16 trains a model of n_embd 576 (SmolLM2-135M) ~2x faster; "
                     "auto keeps float32 on CPU, whose results reproduce on any machine "
                     "(docs/pretrained.md)")
    if resuming and s["max_iters"] > s["lr_decay_iters"]:
        lines.append(f"note: the cosine decay ends at step {s['lr_decay_iters']} (kept from the "
                     f"checkpoint), then lr stays at min_lr; pass --lr_decay_iters to change the "
                     f"schedule")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Settings: config files and flags read and checked, a resume or fine-tune resolved

def read_config(path):
    """A config file's (key, value, where) triples: `key = literal` lines, parsed, never run."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, ValueError, SyntaxError, MemoryError, RecursionError) as e:
        what = ("nested too deeply to read" if isinstance(e, (MemoryError, RecursionError))
                else one_line(e))  # a SyntaxError's names its line
        raise ValueError(f"config file {path}: {what}; only UTF-8 `key = value` lines are "
                         f"allowed") from None
    for node in tree.body:
        where = f"{path} line {node.lineno}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{where}: only `key = value` lines are allowed in a config file")
        try:
            value = ast.literal_eval(node.value)
        except (ValueError, TypeError, RecursionError, MemoryError):  # TypeError: {[]: 1}
            raise ValueError(f"{where}: the value of {node.targets[0].id} must be a literal "
                             f"(number, string, True or False)") from None
        yield node.targets[0].id, value, where


def parse_args(argv):
    """Config files and --key=value flags, in order -> (settings, the names they set). Each
    overrides those before it; a name twice in one file is a mistake, twice in the flags a note."""
    s, explicit, given = {key: entry[0] for key, entry in SETTINGS.items()}, set(), {}
    for arg in argv:
        flag = arg.startswith("--")
        for key, value, where in [read_flag(arg)] if flag else read_config(arg):
            earlier = given.get(key, "")
            if not flag and earlier.startswith(f"{arg} line"):
                raise ValueError(f"{where}: {key} is given twice in {arg}; give it once")
            if flag and earlier.startswith("--") and os.environ.get("RANK", "0") == "0":
                print(f"note: {key} is given twice ({earlier}, then {arg}): the last one counts")
            given[key] = where
            set_setting(s, key, value, where)
            explicit.add(key)
    return s, explicit


def read_flag(arg):
    """--key=value -> (key, value, arg); a string needs no quotes, a bare --compile is True."""
    key, has_value, text = arg[2:].partition("=")
    if key not in SETTINGS:
        return key, text, arg  # set_setting names it an unknown setting
    default = SETTINGS[key][0]
    if not has_value and not isinstance(default, bool):
        raise ValueError(f"{arg}: expected --key=value (see python train.py --help)")
    try:
        if isinstance(default, float):
            return key, float(text), arg  # also inf and nan, which check_settings refuses
        return key, text if isinstance(default, str) else ast.literal_eval(text or "True"), arg
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return key, text, arg


def set_setting(s, key, value, where):
    """Check a setting's name, type (an int is taken where a float is expected) and choice."""
    if key not in SETTINGS:
        close = difflib.get_close_matches(key, SETTINGS, n=1, cutoff=0.8)  # a typo, not a guess
        hint = f"did you mean {close[0]}?" if close else "see python train.py --help"
        raise ValueError(f"{where}: unknown setting {key!r}; {hint}")
    default = SETTINGS[key][0]
    value = float(value) if isinstance(default, float) and type(value) is int else value
    if type(value) is not type(default):
        kind = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
        raise ValueError(f"{where}: {key}={value!r} must be {kind[type(default)]} (default: "
                         f"{default!r})")
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(f"{where}: {key}={value!r}; choose one of {', '.join(CHOICES[key])}")
    s[key] = value


def check_settings(s):
    """Each setting's rule, then what no single setting says; Config checks the model's."""
    for key, (_, _, *rule) in SETTINGS.items():
        if isinstance(s[key], float) and not math.isfinite(s[key]):
            raise ValueError(f"{key}={s[key]} must be a finite number")
        if rule and rule[0](s[key]):
            raise ValueError(f"{key}={s[key]} {rule[0](s[key])}")
    problems = [
        (s["min_lr"] > s["learning_rate"],
         f"min_lr={s['min_lr']} must not exceed learning_rate={s['learning_rate']}"),
        (set(filter(None, s["freeze"].split(","))) - {"embedding", "backbone", "head"},
         f"freeze={s['freeze']!r}: choose among embedding, backbone, head (comma-separated)"),
        (not s["init_from"], "init_from is empty; use scratch, resume, or a checkpoint's path"),
        (os.path.basename(s["dataset"]) != s["dataset"] or s["dataset"] in ("", ".", ".."),
         f"dataset={s['dataset']!r} must be a folder name under data_dir (see --data_dir)")]
    for bad, message in problems:
        if bad:
            raise ValueError(message)
    try:
        Config(vocab_size=2, **{key: s[key] for key in MODEL})
    except ValueError as e:
        raise ValueError(str(e).removeprefix("Config: ")) from None


def resolve(s, explicit):
    """The run's settings -> (settings, the checkpoint it resumes or fine-tunes or None, its path).
    A resume takes its checkpoint's run settings that no file or flag gives; resume and fine-tune
    take its model, which a flag may repeat, not change (a fine-tune's dropout aside)."""
    if "lev_c_kernels" in explicit and not s["lev_fast"]:  # refused rather than silently ignored
        raise ValueError(f"lev_c_kernels={s['lev_c_kernels']} is a setting of LEV's fast path, and "
                         f"lev_fast=False runs none; drop --lev_c_kernels")
    resuming, ckpt, path = s["init_from"] == "resume", None, None
    if not resuming and 0 < s["lr_decay_iters"] < s["warmup_iters"]:
        raise ValueError(f"warmup_iters={s['warmup_iters']} must not exceed lr_decay_iters="
                         f"{s['lr_decay_iters']}")
    if resuming:
        s["out_dir"] = formatted_out_dir(s)
        check_resumable(s["out_dir"])
        ckpt, path = read_checkpoint(s["out_dir"], for_resume=True)
        trained = set(filter(None, str(ckpt["train_config"].get("freeze", "")).split(",")))
        if "freeze" in explicit and set(filter(None, s["freeze"].split(","))) != trained:
            raise ValueError(f"{path} was trained with {','.join(sorted(trained)) or 'nothing'} "
                             f"frozen, this resume asks for --freeze={s['freeze']}: its optimizer "
                             f"state is of the parts it trained; drop --freeze, or fine-tune from "
                             f"it into another --out_dir")
        for key, value in ckpt["train_config"].items():  # a retired or unknown key: left out
            if key in SETTINGS.keys() - MODEL.keys() - explicit - {"out_dir", "init_from"}:
                set_setting(s, key, value, f"{path} (train_config)")
    elif s["init_from"] not in ("scratch", ""):  # "": said by check_settings
        if not os.path.exists(s["init_from"]) and os.sep not in s["init_from"]:
            hint = ("did you mean --init_from=resume?" if s["init_from"].lower() == "resume" else
                    "no pretrained weights are loaded by name")
            raise ValueError(f"init_from={s['init_from']!r} is not a checkpoint ({hint}); use "
                             f"scratch, resume, or the path of a run or of its ckpt.pt")
        ckpt, path = read_checkpoint(s["init_from"])
    for key in MODEL if ckpt else ():  # a setting the checkpoint predates: its default
        value = ckpt["model_config"].get(key, MODEL[key][0])
        if key in explicit and s[key] != value and (resuming or key != "dropout"):
            fix = (f"a resumed run keeps its model (drop --{key}, or use another out_dir)"
                   if resuming else f"fine-tuning keeps the source's architecture (drop --{key})")
            if key == "embedding" and not resuming:
                fix += "; a retrofit of LEV onto a table model is python lab/retrofit.py"
            raise ValueError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; {fix}")
        s[key] = s[key] if key == "dropout" and key in explicit else value
    check_settings(s)
    if not resuming:
        s["out_dir"] = formatted_out_dir(s)  # a fine-tune's {embedding} is its source's
        s["lr_decay_iters"] = s["lr_decay_iters"] or s["max_iters"]  # fixed: a resume keeps it
        if ckpt and os.path.isdir(s["out_dir"]) and os.path.samefile(  # the run read, unlinked
                os.path.dirname(os.path.realpath(path)), s["out_dir"]):
            raise ValueError(f"out_dir={s['out_dir']} holds the checkpoint being fine-tuned "
                             f"({path}); fine-tune into another --out_dir (--overwrite cannot "
                             f"replace a run that is being read)")
        if os.path.exists(s["out_dir"]) and not os.path.isdir(s["out_dir"]):
            raise ValueError(f"out_dir={s['out_dir']} is a file, not a folder; give another path")
        ckpt_file = os.path.join(s["out_dir"], "ckpt.pt")
        if os.path.exists(ckpt_file) and not os.path.isfile(ckpt_file):
            raise ValueError(f"{ckpt_file} is not a file (a folder?); move it out of the way, or "
                             f"train into another --out_dir")
        if os.path.exists(ckpt_file) and not s["overwrite"]:
            raise ValueError(f"{s['out_dir']} already holds a run (ckpt.pt); continue it with "
                             f"--init_from=resume, train into another --out_dir, or pass "
                             f"--overwrite to replace it")
    return s, ckpt, path


def check_resumable(out_dir):
    """A resume's out_dir must be a folder holding ckpt.pt: else say what is there, what to do."""
    if os.path.isfile(out_dir):
        raise ValueError(f"out_dir={out_dir} is a file, not a folder; give another path")
    if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
        return
    if os.path.exists(os.path.join(out_dir, "ckpt.pt")):
        raise ValueError(f"{out_dir}/ckpt.pt is not a file (a folder?); move it out of the way, "
                         f"then start the run again without --init_from=resume")
    if os.path.isfile(os.path.join(out_dir, "log.jsonl")):
        raise ValueError(f"{out_dir} holds a log.jsonl but no ckpt.pt: its run stopped before "
                         f"its first save (at step eval_interval); start it again with the same "
                         f"command without --init_from=resume")
    raise ValueError(f"{out_dir} holds no run to resume (no ckpt.pt); train one first "
                     f"(init_from=scratch) or fix --out_dir")


def formatted_out_dir(s):
    """out_dir with each {name} replaced by that setting: out-{dataset}-{embedding} by default."""
    fields = [f for _, f, _, _ in string.Formatter().parse(s["out_dir"]) if f is not None]
    if not s["out_dir"] or any(field not in SETTINGS for field in fields):
        raise ValueError("out_dir is empty; give a folder" if not s["out_dir"] else
                         f"out_dir={s['out_dir']!r}: each {{...}} must name a setting, e.g. "
                         f"{{embedding}}")
    return s["out_dir"].format(**s)


# --------------------------------------------------------------------------------------------------
# Data, checkpoints and files


def load_data(folder):
    """A dataset folder made by prepare_data.py -> (meta, train split, val split), each split a
    read-only np.memmap of token ids, checked against meta.json."""
    name = os.path.basename(os.path.normpath(folder))
    again = f"prepare it: python prepare_data.py {name}" + (
        "" if name in ("shakespeare", "shakespeare_char") else " --input=path/to/text.txt")
    path = os.path.join(folder, "meta.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prepared dataset in {folder} (no meta.json); {again}")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError, MemoryError):  # a UnicodeDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON, or not UTF-8; {again}") from None
    counts = ("vocab_size", "train_tokens", "val_tokens")
    well_formed = isinstance(meta, dict) and "tokenizer" in meta and all(
        type(meta.get(k)) is int and meta[k] >= 0 for k in counts)
    if not well_formed or meta.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{path} needs a tokenizer, dtype uint16 or uint32, and vocab_size, "
                         f"train_tokens and val_tokens non-negative integers; {again}")
    splits = []
    for split in ("train", "val"):
        path, n = os.path.join(folder, f"{split}.bin"), meta[f"{split}_tokens"]
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != n * np.dtype(meta["dtype"]).itemsize:
            raise ValueError(f"{path} is {'missing' if size is None else f'{size:,} bytes'}, "
                             f"meta.json expects {n:,} {meta['dtype']} tokens; {again}")
        # np.memmap cannot map an empty file
        splits.append(np.memmap(path, meta["dtype"], "r") if n else np.zeros(0, meta["dtype"]))
    return meta, *splits


def eval_windows(n_tokens, block_size, max_windows=None):
    """Start offsets s of a split's fixed evaluation windows, s = i * block_size for i < (n_tokens
    - 1) // block_size: window i scores targets tokens[s+1:s+block_size+1], each target once. With
    max_windows fewer than that, an evenly spaced subset. lab/eval.py scores these too."""
    n_windows = (n_tokens - 1) // block_size
    if n_windows < 1:
        raise ValueError(f"a split of {n_tokens} tokens is too short for one window of "
                         f"block_size={block_size}; use a smaller block_size or more text")
    starts = np.arange(n_windows, dtype=np.int64) * block_size
    if max_windows is not None and max_windows < n_windows:
        starts = starts[np.arange(max_windows) * n_windows // max_windows]
    return starts


def check_same_tokens(meta, data_meta, path, data_dir, advice):
    """The checkpoint at path (of dataset meta) was trained on the tokens of data_dir's data."""
    said = [f"{m.get('tokenizer')} tokens (vocab_size {m.get('vocab_size')})" + (
        f", characters {''.join(sorted(m['chars']))!r}" if m.get("chars") else "")
        for m in (meta, data_meta)]
    if any(meta.get(k) != data_meta.get(k) for k in ("tokenizer", "vocab_size", "chars", "bpe")):
        other = "the same characters with other ids" if said[0] == said[1] else said[1]
        raise ValueError(f"{path} was trained on {said[0]}, but {data_dir} has {other}; {advice}")


def read_checkpoint(path, for_resume=False):
    """A checkpoint (a file, or a run directory holding ckpt.pt) -> (it, its path): loaded with
    weights_only=True (tensors and plain values: no code runs) and checked."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first or fix the path")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's advice to load it unsafely is not passed on
        why = ("it holds Python objects, which could run code when loaded; it was refused unread"
               if "GLOBAL" in str(e) else "not a torch.save file, or a damaged one")
        raise ValueError(f"{path} is not a readable leviathan checkpoint: {why}. Use an "
                         f"untouched checkpoint written by train.py") from None
    version = ckpt.get("version") if isinstance(ckpt, dict) else None
    if version != 2:
        raise ValueError(f"{path} is a checkpoint of format {version!r}, and this leviathan "
                         f"reads format 2: train the run again, or use the leviathan version that "
                         f"wrote it")
    tables = ["model", "model_config", "meta"]
    if for_resume:
        tables += ["train_config", "optimizer", "rng"]
    if bad := [key for key in tables if not isinstance(ckpt.get(key), dict)]:  # counters: train()
        raise ValueError(f"{path}: {', '.join(bad)} missing or not a dict; it was edited or not "
                         f"written by train.py. Use an untouched checkpoint")
    return ckpt, path


def build_model(ckpt, path):
    """The model of a checkpoint, with its weights, in training mode."""
    try:
        model = GPT(Config(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, ValueError) as e:  # TypeError: a setting Config lacks
        raise ValueError(f"{path}: the weights do not fit its model settings "
                         f"({one_line(e)[:300]})") from None
    return model.train()


def write_atomic(path, obj):
    """obj (text, or what torch.save writes) to path.tmp, which then replaces path: no reader sees
    half a file, and a failure leaves path whole and no tmp behind (a writer killed mid-write
    leaves path.tmp, which the next write of path replaces)."""
    tmp = f"{path}.tmp"
    try:
        if isinstance(obj, str):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(obj)
        else:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        # torch.save reports a write that failed midway (a full disk) as a RuntimeError
        if isinstance(e, (OSError, RuntimeError)):
            raise OSError(cannot_write(path, e, "; the previous file, if any, is unchanged")
                          ) from None
        raise


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def cannot_write(path, e, kept=""):
    """What a failed write of path says: why (e, an OSError or torch's RuntimeError), what was
    kept, what to do."""
    reason = getattr(e, "strerror", None) or one_line(e)[:150]
    if not isinstance(e, OSError) and shutil.disk_usage(os.path.dirname(path) or ".").free < 2**20:
        reason = "no space left on device"  # torch's text names no cause; the disk's space does
    fix = "free disk space" if getattr(e, "errno", errno.ENOSPC) in (
        errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return f"could not write {path} ({reason.lower()}){kept}; {fix} or use another --out_dir"


def read_log(path, last_step):
    """log.jsonl's records up to last_step (a later one is of a run that went on, redone now)."""
    records = []
    with (contextlib.suppress(FileNotFoundError),
          open(path, encoding="utf-8", errors="replace") as f):
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line) if line.strip() else {"step": math.inf}
                records += [record] if record["step"] <= last_step else []
            except (ValueError, KeyError, TypeError, RecursionError, MemoryError):
                raise ValueError(f"{path}:{n} is not a log record; fix or delete that line, then "
                                 f"resume") from None
    return records


def one_line(text):
    return " ".join(str(text).split())


def main(argv=None):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a KeyboardInterrupt, said below
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nsettings (--key=value, default shown):")
        for key, (default, text, *_) in SETTINGS.items():
            print(f"  --{key}={default}".ljust(38) + f" {text}")
        return 0
    s, code = None, 2
    try:
        s, explicit = parse_args(argv)
        return train(s, explicit)
    except KeyboardInterrupt:  # outside the loop (which saves, then stops): at once
        try:
            path = os.path.join(formatted_out_dir(s), "ckpt.pt")
        except (TypeError, ValueError):  # no settings yet, or a bad out_dir
            path = ""
        message, code = "stopped (Ctrl-C); " + (
            f"{path} keeps the last saved state" if os.path.isfile(path) else
            "no checkpoint was saved yet: the same command starts the run again"), 130
    except (ValueError, OSError) as e:  # bad settings, data or checkpoint; a refusal to write
        failed_write = getattr(e, "filename", None) and e.errno in WRITE_ERRORS
        message = cannot_write(e.filename, e) if failed_write else one_line(e)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise  # a bug, not the machine's limit: its traceback is what a report needs
        message = (f"out of memory ({one_line(e)[:150]}); use a smaller batch_size, block_size or "
                   f"model, or gradient_accumulation_steps")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if dist.is_initialized():
            dist.destroy_process_group()
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {'error: ' if code == 2 else ''}{message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
