"""
Train a Leviathan, or one of its baselines, on a dataset prepared by prepare_data.py.

    python prepare_data.py shakespeare
    python train.py config/shakespeare_cpu.py                        # Leviathan (LEV input embedding), on CPU
    python train.py config/shakespeare_cpu.py --embedding=tied       # the baseline: same data, same val tokens
    python train.py config/shakespeare_cpu.py --init_from=resume     # continue out_dir/ckpt.pt
    torchrun --standalone --nproc_per_node=8 train.py config/shakespeare_gpu.py     # DDP, one process per GPU

Settings: the defaults below, then config files (plain `key = value` lines, in the order given), then --key=value
flags. With --init_from=resume the checkpoint's settings replace the defaults, and files and flags still apply.

Fair comparisons: every arm with the same seed draws the same training batches (the data order has its own
generator, independent of the model's initialization), and validation always uses the same fixed windows of the
val split (prepare_data.eval_windows), so lev, tied and untied see exactly the same tokens.

Output: out_dir/log.jsonl gets one record per evaluation (step 0 included). out_dir/ckpt.pt is the latest state
(model, optimizer, settings, data order and RNG states): it is written after every evaluation (every
eval_interval steps and at the last step) and when the run is stopped with Ctrl-C (or SIGTERM). Resuming continues
exactly: 10 steps, then 10 more with --init_from=resume, give the same losses and weights as 20 steps. A NaN or
infinite loss stops the run and leaves ckpt.pt at its last good state.
"""

import ast
import dataclasses
import difflib
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from leviathan import CHECKPOINT_VERSION, EMBEDDINGS, GPT, Config, load_checkpoint, resolve_device

# ----------------------------------------------------------------------------------------------------------
# Settings: name -> (default, help). The model's come from leviathan.Config, the one source of their defaults.

MODEL = {f.name: f.default for f in dataclasses.fields(Config) if f.name != "vocab_size"}  # V: from the data

SETTINGS = {
    # data and output
    "dataset": ("shakespeare", "a dataset folder under data_dir, made by prepare_data.py"),
    "data_dir": ("data", "folder that holds the datasets"),
    "out_dir": ("out-{dataset}-{embedding}", "where ckpt.pt and log.jsonl go; {name} is replaced by that setting"),
    "init_from": ("scratch", "scratch (a new model; replaces out_dir/ckpt.pt) or resume (continue out_dir/ckpt.pt)"),
    # model (leviathan.Config)
    "embedding": (MODEL["embedding"], "lev (Leviathan: LEV input + untied head), tied or untied (baselines)"),
    "n_layer": (MODEL["n_layer"], "Transformer blocks"),
    "n_head": (MODEL["n_head"], "attention heads"),
    "n_embd": (MODEL["n_embd"], "model width"),
    "block_size": (MODEL["block_size"], "context length in tokens"),
    "dropout": (MODEL["dropout"], "dropout probability"),
    "n_digits": (MODEL["n_digits"], "LEV: digits k of a token id, in base ceil(V^(1/k))"),
    "d_seed": (MODEL["d_seed"], "LEV: width of the seed vector"),
    "n_lev_heads": (MODEL["n_lev_heads"], "LEV: separable modes, summed"),
    "n_knots": (MODEL["n_knots"], "LEV: knots of each quadratic B-spline"),
    "lev_rank": (MODEL["lev_rank"], "LEV: outputs of each spline (length of a mode)"),
    "lev_chunk": (MODEL["lev_chunk"], "LEV: ids computed together (memory only, not results)"),
    "lev_compile": (MODEL["lev_compile"], "LEV: torch.compile its two kernels (speed only, not results)"),
    # optimization
    "batch_size": (64, "sequences per micro-step, per process"),
    "gradient_accumulation_steps": (1, "micro-steps per optimizer step, over all processes together"),
    "max_iters": (5000, "optimizer steps"),
    "learning_rate": (1e-3, "peak learning rate (AdamW)"),
    "min_lr": (1e-4, "learning rate at the end of the cosine decay"),
    "warmup_iters": (100, "steps of linear warmup (the first step already has lr > 0)"),
    "lr_decay_iters": (0, "step at which the cosine decay reaches min_lr; 0 means max_iters"),
    "weight_decay": (0.1, "AdamW weight decay (matrices and tables only)"),
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
CHOICES = {"init_from": ("scratch", "resume"), "embedding": EMBEDDINGS, "device": ("auto", "cpu", "cuda", "mps"),
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
    except SyntaxError as e:
        raise SettingsError(f"{path} line {e.lineno}: {e.msg}") from None
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
            except (ValueError, SyntaxError):
                value = text
        set_setting(settings, key, value, arg)
        explicit.add(key)
    return settings, explicit


def check_settings(s):
    """Ranges that a type alone does not say (the model's are checked by leviathan.Config)."""
    def need(ok, msg):
        if not ok:
            raise SettingsError(msg)

    for key in ("batch_size", "gradient_accumulation_steps", "eval_interval", "log_interval"):
        need(s[key] >= 1, f"{key}={s[key]} must be at least 1")
    for key in ("max_iters", "eval_iters", "warmup_iters", "lr_decay_iters", "min_lr", "weight_decay", "grad_clip"):
        need(s[key] >= 0, f"{key}={s[key]} must be >= 0")
    need(s["learning_rate"] > 0, f"learning_rate={s['learning_rate']} must be > 0")
    need(0 <= s["beta1"] < 1 and 0 <= s["beta2"] < 1, "beta1 and beta2 must be in [0, 1)")
    need(os.path.basename(s["dataset"]) == s["dataset"] and s["dataset"] not in ("", ".", ".."),
         f"dataset={s['dataset']!r} must be a folder name under data_dir (use --data_dir for another folder)")


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
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["step"] < before_step]


def same_tokens(meta_a, meta_b):
    return all(meta_a.get(k) == meta_b.get(k) for k in ("tokenizer", "vocab_size", "chars"))


# ----------------------------------------------------------------------------------------------------------
# Training


def train(s, explicit):
    # -- a resumed run: the checkpoint's settings, with this command's config files and flags on top --
    try:  # e.g. out-{dataset}-{embedding}: one folder per arm, so arms do not overwrite each other
        s["out_dir"] = s["out_dir"].format(**s)
    except (KeyError, IndexError, ValueError) as e:
        raise SettingsError(f"out_dir={s['out_dir']!r}: each {{...}} must name a setting, e.g. {{embedding}} "
                            f"({type(e).__name__}: {e})") from None
    ckpt_path = os.path.join(s["out_dir"], "ckpt.pt")
    ckpt = None
    if s["init_from"] == "resume":
        model, ckpt = load_checkpoint(ckpt_path, "cpu")
        for key, value in ckpt["train_config"].items():
            if key in SETTINGS and key not in explicit and key not in ("out_dir", "init_from"):
                s[key] = value
        check_settings(s)
        for key in MODEL:  # model.config: the checkpoint's, with defaults for settings added since
            if s[key] != getattr(model.config, key):
                raise SettingsError(f"{ckpt_path} has {key}={getattr(model.config, key)!r}, this run asks for "
                                    f"{s[key]!r}; a resumed run keeps its model (drop --{key}, or use another out_dir)")

    # -- processes and device: under torchrun each process runs this script with RANK/WORLD_SIZE set --
    ddp = "RANK" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    master = rank == 0
    log = print if master else (lambda *args, **kwargs: None)
    device_name = resolve_device(s["device"])  # a ValueError, reported like a bad setting
    if ddp and device_name == "mps":
        raise SettingsError("DDP (torchrun) runs on cuda (nccl) or cpu (gloo), not mps; use --device=cpu")
    device = torch.device(f"cuda:{local_rank}" if device_name == "cuda" and ddp else device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype_name = s["dtype"]
    if dtype_name == "auto":
        dtype_name = "float32" if device.type != "cuda" else (
            "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    ptdtype = getattr(torch, dtype_name)
    autocast = nullcontext() if ptdtype == torch.float32 else torch.autocast(device.type, dtype=ptdtype)
    if s["gradient_accumulation_steps"] % world:
        raise SettingsError(f"gradient_accumulation_steps={s['gradient_accumulation_steps']} must be divisible by "
                            f"the number of processes ({world})")
    local_accum = s["gradient_accumulation_steps"] // world

    # -- data --
    data_dir = os.path.join(s["data_dir"], s["dataset"])
    meta = prepare_data.load_meta(data_dir)
    train_data, val_data = prepare_data.load_split(data_dir, "train"), prepare_data.load_split(data_dir, "val")
    T, B = s["block_size"], s["batch_size"]
    if len(train_data) <= T:
        raise SettingsError(f"the train split of {data_dir} has {len(train_data)} tokens, too few for "
                            f"block_size={T}; use a smaller block_size or more text")
    # fixed evaluation windows, the same for every arm; the train split's as many as the val split's
    val_starts = prepare_data.eval_windows(len(val_data), T, s["eval_iters"] * B or None)
    train_starts = prepare_data.eval_windows(len(train_data), T, len(val_starts))

    # -- model, optimizer, and the state of a resumed run --
    data_generator = torch.Generator()  # the data order's own stream: the model's init does not shift it
    if ckpt is not None:
        if not same_tokens(ckpt["meta"], meta):
            raise SettingsError(f"{ckpt_path} was trained on {ckpt['meta']['tokenizer']} tokens (vocab_size "
                                f"{ckpt['meta']['vocab_size']}), but {data_dir} has {meta['tokenizer']} tokens "
                                f"(vocab_size {meta['vocab_size']}); resume on data with the same tokenizer, or "
                                f"train from scratch in another out_dir")
        model.train()
        data_generator.set_state(ckpt["rng"]["data"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        step, tokens_seen, best_val_loss = ckpt["step"], ckpt["tokens_seen"], ckpt["best_val_loss"]
        elapsed_before = ckpt.get("elapsed_s", 0.0)
    else:
        torch.manual_seed(s["seed"])  # the model's initialization
        model = GPT(Config(vocab_size=meta["vocab_size"], **{key: s[key] for key in MODEL}))
        data_generator.manual_seed(s["seed"] + DATA_SEED_OFFSET)
        torch.manual_seed(s["seed"] + rank)  # dropout masks: a stream per process
        step, tokens_seen, best_val_loss, elapsed_before = 0, 0, float("inf"), 0.0
    if ddp and ckpt is not None and rank > 0:
        torch.manual_seed(s["seed"] + rank + step)  # only rank 0's dropout stream is in the checkpoint
    model.to(device)
    optimizer = model.configure_optimizers(s["weight_decay"], s["learning_rate"], (s["beta1"], s["beta2"]),
                                           device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=ptdtype == torch.float16)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        del ckpt

    # -- wrap: torch.compile, then DDP; `model` is the plain module, for checkpoints and evaluation --
    if ddp:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    fast_model = torch.compile(model) if s["compile"] else model
    train_model = DDP(fast_model, device_ids=[local_rank] if device.type == "cuda" else None) if ddp else fast_model

    # -- output --
    log_path = os.path.join(s["out_dir"], "log.jsonl")
    if master:
        os.makedirs(s["out_dir"], exist_ok=True)
        records = read_log(log_path, step) if s["init_from"] == "resume" else []
        with prepare_data.atomic_path(log_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    tokens_per_step = s["gradient_accumulation_steps"] * B * T
    report = model.param_report()
    log(f"data: {data_dir}, {meta['tokenizer']} tokens, vocab {meta['vocab_size']:,}, train {len(train_data):,}, "
        f"val {len(val_data):,} tokens ({len(val_starts)} eval windows per split)")
    log(f"model: {s['embedding']}, parameters: input embedding {report['input_embedding']:,}, backbone "
        f"{report['backbone']:,}, head {report['head']:,}, total {report['total']:,}")
    log(f"device {device}, dtype {dtype_name}, {world} process(es), {tokens_per_step:,} tokens per step, "
        + (f"resuming at step {step}" if s["init_from"] == "resume" else f"writing {ckpt_path}"))

    @torch.no_grad()
    def evaluate(data, starts):
        """Mean loss per target token over the fixed windows; each process takes every world-th window."""
        model.eval()
        total, count = 0.0, 0
        mine = starts[rank::world]
        for i in range(0, len(mine), B):
            x, y = get_batch(data, mine[i:i + B], T, device)
            with autocast:
                _, loss = fast_model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
        model.train()
        if ddp:
            sums = torch.tensor([total, count], dtype=torch.float64, device=device)
            dist.all_reduce(sums)
            total, count = sums.tolist()
        return total / count

    def save_checkpoint():
        if not master:
            return
        rng = {"data": data_generator.get_state(), "torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        ckpt = {"version": CHECKPOINT_VERSION, "model": model.state_dict(),
                "model_config": dataclasses.asdict(model.config), "train_config": dict(s), "meta": meta,
                "step": step, "tokens_seen": tokens_seen, "best_val_loss": best_val_loss,
                "elapsed_s": elapsed_before + time.time() - t_start, "optimizer": optimizer.state_dict(), "rng": rng}
        if scaler.is_enabled():
            ckpt["scaler"] = scaler.state_dict()
        with prepare_data.atomic_path(ckpt_path) as tmp:
            torch.save(ckpt, tmp)

    # Ctrl-C (SIGINT) or SIGTERM: finish the current step, save, stop. A second Ctrl-C stops at once.
    stop_signal = []

    def request_stop(signum, frame):
        stop_signal.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous_handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    # -- the loop --
    t_start = time.time()
    t_log, steps_since_log, last_eval_s = time.time(), 0, 0.0
    max_iters, eval_interval = s["max_iters"], s["eval_interval"]
    try:
        while True:
            if step % eval_interval == 0 or step == max_iters:
                t_eval = time.time()
                train_loss, val_loss = evaluate(train_data, train_starts), evaluate(val_data, val_starts)
                last_eval_s = time.time() - t_eval
                best_val_loss = min(best_val_loss, val_loss)
                record = {"step": step, "tokens": tokens_seen, "train_loss": train_loss, "val_loss": val_loss,
                          "lr": get_lr(step, s), "elapsed_s": round(elapsed_before + time.time() - t_start, 3),
                          "embedding": s["embedding"]}
                if master:
                    with open(log_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
                save_checkpoint()
                log(f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f} (best {best_val_loss:.4f}), "
                    f"eval {last_eval_s:.1f} s, saved {ckpt_path}")
                t_log = time.time()  # progress lines time the training steps only
            if step >= max_iters:
                break

            # one optimizer step over gradient_accumulation_steps * batch_size windows, drawn for all processes
            # together so that the data order does not depend on how many processes share the work
            lr = get_lr(step, s)
            for group in optimizer.param_groups:
                group["lr"] = lr
            starts = torch.randint(len(train_data) - T, (s["gradient_accumulation_steps"] * B,),
                                   generator=data_generator).numpy()
            loss_sum = torch.zeros((), device=device)
            for micro in range(local_accum):
                first = (rank * local_accum + micro) * B
                x, y = get_batch(train_data, starts[first:first + B], T, device)
                if ddp:  # average gradients across processes only after the last micro-step
                    train_model.require_backward_grad_sync = micro == local_accum - 1
                with autocast:
                    _, loss = train_model(x, y)
                loss_sum += loss.detach()
                scaler.scale(loss / local_accum).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"] or float("inf"))
            # one all-reduce: the step's mean loss, and whether any process was asked to stop
            shared = torch.stack([loss_sum / local_accum, torch.tensor(float(bool(stop_signal)), device=device)])
            if ddp:
                dist.all_reduce(shared)
            step_loss, stop = shared[0].item() / world, shared[1].item() > 0
            if not math.isfinite(step_loss):
                if master:
                    print(f"error: the loss is {step_loss} at step {step}; stopping. {ckpt_path} keeps the last "
                          f"good state; lower learning_rate, or use dtype=float32 or bfloat16", file=sys.stderr)
                return 1
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            steps_since_log += 1

            if step % s["log_interval"] == 0 or stop:
                step_s = (time.time() - t_log) / steps_since_log
                evals_left = max_iters // eval_interval - step // eval_interval + (max_iters % eval_interval > 0)
                eta = (max_iters - step) * step_s + evals_left * last_eval_s
                log(f"step {step}/{max_iters} | loss {step_loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                    f"{1000 * step_s:.0f} ms/step | {tokens_per_step / step_s:,.0f} tok/s | ETA {format_seconds(eta)}")
                t_log, steps_since_log = time.time(), 0
            if stop:
                save_checkpoint()
                log(f"stopped at step {step}; saved {ckpt_path}. Continue with: python train.py "
                    f"--out_dir={s['out_dir']} --init_from=resume")
                return 130
        return 0
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if ddp:
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
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
