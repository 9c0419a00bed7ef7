"""The machinery of a train.py run: the checkpoint it continues (tokens, counters, random states,
optimizer), processes and device, data, frozen parts, log.jsonl and the stop signals.

train.py resolves the run's settings and passes each function the values it needs. Nothing here
imports the model file or the script.
"""

import contextlib
import errno
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from machinery import cli, dataset, devices
from machinery.settings import SettingsError

PARTS = ("embedding", "backbone", "head")  # what --freeze can name
DATA_SEED_OFFSET = 1_000_003  # the data order's seed is seed + this: a stream apart from the init's
SEED_LIMIT = 2 ** 63 - 2 ** 21  # seeds below it leave room for the offsets (data order, processes)

# --------------------------------------------------------------------------------------------------
# The checkpoint a run continues or fine-tunes


def check_same_tokens(meta, data, path, advice):
    """The checkpoint at path (of the dataset meta) must have been trained on data's tokens."""
    if all(meta.get(k) == data.meta.get(k) for k in ("tokenizer", "vocab_size")):
        if meta.get("chars") == data.meta.get("chars"):
            return
        how = describe_chars(meta.get("chars"), data.meta.get("chars"))
        raise SettingsError(f"{path} was trained on {describe_tokens(meta)}, and {data.dir} has as "
                            f"many, but {how}; {advice}")
    raise SettingsError(f"{path} was trained on {describe_tokens(meta)}, but {data.dir} has "
                        f"{describe_tokens(data.meta)}; {advice}")


def describe_tokens(meta):
    return f"{meta.get('tokenizer')} tokens (vocab_size {meta.get('vocab_size')})"


def describe_chars(trained, data):
    """How two char vocabularies of one size differ: characters of one only, or their order."""
    trained, data = trained or "", data or ""
    only_trained, only_data = sorted(set(trained) - set(data)), sorted(set(data) - set(trained))
    if not (only_trained or only_data):
        return "the same characters have other ids"
    sides = (("the checkpoint", only_trained), ("the data", only_data))
    parts = [f"{name} has {''.join(chars)!r} and the other has not"
             for name, chars in sides if chars]
    return "other characters: " + "; ".join(parts)


def resumed_state(ckpt, data_generator, procs, path, seed):
    """A resumed run's counters (step, tokens_seen, best_val_loss, elapsed_before, origin), with the
    data order's and torch's random states restored from the checkpoint (data_generator's too;
    seed: the run's, which the other processes' dropout streams start from)."""
    restore_rng(ckpt, data_generator, procs.device, path)
    step, tokens_seen = ckpt["step"], ckpt["tokens_seen"]
    if step < 0 or tokens_seen < 0:
        raise SettingsError(f"{path}: step={step}, tokens_seen={tokens_seen} must be >= 0; it was "
                            f"edited or damaged")
    if procs.ddp and procs.rank > 0:  # only rank 0's dropout stream is saved
        torch.manual_seed(seed + procs.rank + step)
    return {"step": step, "tokens_seen": tokens_seen, "best_val_loss": ckpt["best_val_loss"],
            "elapsed_before": float(ckpt.get("elapsed_s", 0.0)), "origin": ckpt.get("origin")}


def rng_states(data_generator, procs):
    """The random states a checkpoint keeps: the data order's and torch's (CUDA's too)."""
    rng = {"data": data_generator.get_state(), "torch": torch.get_rng_state()}
    if procs.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(procs.device)
    return rng


def load_optimizer_state(ckpt, optimizer, scaler, path):
    """The checkpoint's optimizer (and GradScaler) state into this run's."""
    groups = ckpt["optimizer"].get("param_groups")
    if isinstance(groups, list) and len(groups) == 4 and len(optimizer.param_groups) == 2:
        # LEV's own two groups beside the usual two: written with a retired setting
        raise SettingsError(f"{path} has LEV's own optimizer groups (--lev_lr_scale or "
                            f"--lev_wd_scale, retired); commit 66d9f67 resumes it, or fine-tune "
                            f"from it with --init_from={path} (a fresh optimizer)")
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SettingsError(f"{path}: its optimizer state does not fit the model "
                            f"({cli.one_line(e)[:200]}); it was edited or damaged") from None


def restore_rng(ckpt, data_generator, device, path):
    """The data order's and torch's random states of a resumed run."""
    try:
        data_generator.set_state(ckpt["rng"]["data"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
    except (KeyError, TypeError, RuntimeError) as e:
        raise SettingsError(f"{path}: its random states (rng) are unusable ({type(e).__name__}); "
                            f"it was edited or damaged. Resume from an untouched "
                            f"checkpoint") from None


# --------------------------------------------------------------------------------------------------
# Processes and device, data, frozen parts


class Processes:
    """This process's place in the run (under torchrun each process runs the script with RANK and
    WORLD_SIZE set), its device and its autocast dtype."""

    def __init__(self, device, dtype, gradient_accumulation_steps):
        self.ddp = "RANK" in os.environ
        ranks = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        self.rank, self.world = ranks
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.master = self.rank == 0
        device_name = devices.resolve_device(device)  # a ValueError: reported as a bad setting
        if self.ddp and device_name == "mps":
            raise SettingsError("DDP (torchrun) runs on cuda (nccl) or cpu (gloo), not mps; use "
                                "--device=cpu")
        on_gpus = device_name == "cuda" and self.ddp
        self.device = torch.device(f"cuda:{self.local_rank}" if on_gpus else device_name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.dtype = devices.resolve_dtype(dtype, self.device.type)
        self.autocast = devices.autocast(self.device.type, self.dtype)
        if gradient_accumulation_steps % self.world:
            raise SettingsError(f"gradient_accumulation_steps={gradient_accumulation_steps} must "
                                f"be divisible by the number of processes ({self.world})")
        self.local_accum = gradient_accumulation_steps // self.world

    def log(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)

    def note(self, line):
        """One line on stderr, from the first process only."""
        self.log(line, file=sys.stderr, flush=True)

    def from_master(self, value):
        """The first process's value, on every process (a decision they must share)."""
        if not self.ddp:
            return value
        shared = [value]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def sum(self, values):
        """Python numbers summed over the processes (float64), as floats; as given with one."""
        if not self.ddp:
            return values
        sums = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        return sums.tolist()

    def mean(self, values):
        """Numbers (0-dim tensors or floats, fp32) averaged over the processes in one all-reduce,
        as floats."""
        shared = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device)
                              for v in values])
        if self.ddp:
            dist.all_reduce(shared)
        return [v / self.world for v in shared.tolist()]


class Data:
    """The dataset's splits and the fixed evaluation windows (the same for every arm): eval_windows
    per split, None for the whole val split."""

    def __init__(self, data_dir, dataset_name, block_size, eval_windows):
        self.dir = os.path.join(data_dir, dataset_name)
        self.meta = dataset.load_meta(self.dir)
        self.train = dataset.load_split(self.dir, "train")
        self.val = dataset.load_split(self.dir, "val")
        if len(self.train) <= block_size:
            raise SettingsError(f"the train split of {self.dir} has {len(self.train)} tokens, "
                                f"too few for block_size={block_size}; use a smaller block_size "
                                f"or more text")
        # the train split's windows are as many as the val split's
        self.val_starts = dataset.eval_windows(len(self.val), block_size, eval_windows)
        self.train_starts = dataset.eval_windows(len(self.train), block_size, len(self.val_starts))


def freeze(model, parts):
    """Keep the named parts (PARTS) fixed: no gradient, not in the optimizer."""
    head_params = {id(model.lm_head.weight)}
    embedding_params = {id(p) for p in model.tok_emb.parameters()}
    for p in model.parameters():
        in_embedding, in_head = id(p) in embedding_params, id(p) in head_params
        part = "embedding" if in_embedding else "head" if in_head else "backbone"
        if part in parts or (in_embedding and in_head and "head" in parts):
            p.requires_grad_(False)


def all_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# log.jsonl, progress lines and the stop signals


def start_log(path, resuming, step):
    """log.jsonl: a resumed run keeps the records up to its step (a record of a later step belongs
    to a run that went on after this checkpoint, and the resumed run redoes it); a new run starts
    anew."""
    records = read_log(path, step + 1) if resuming else []
    with cli.atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def logged(path, step):
    """Whether log.jsonl holds a record of this step: a resumed run does not evaluate it again (the
    record keeps its gradient statistics, which a resume does not have)."""
    return any(r["step"] == step for r in read_log(path, step + 1))


def read_log(path, before_step):
    """The records of log.jsonl for steps before `before_step`."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line) if line.strip() else None
                if record is not None and record["step"] < before_step:
                    records.append(record)
            # RecursionError: values nested too deeply for the parser; MemoryError: a huge line
            except (ValueError, KeyError, TypeError, RecursionError, MemoryError):
                raise SettingsError(f"{path}:{n} is not a log record; fix or delete that line, "
                                    f"then resume") from None
    return records


def advice_for_os_error(e):
    """What to do about the machine's refusal to write (a read-only folder, no permission, a full
    disk), after its message; "" for other errors (they say what to do themselves)."""
    if getattr(e, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "; train into a folder you can write to (--out_dir)"
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return "; free disk space or train into another --out_dir (the last ckpt.pt is intact)"
    return ""


def format_seconds(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


@contextlib.contextmanager
def stop_requests():
    """Ctrl-C (SIGINT) or SIGTERM, while inside: noted in the list this yields (the training loop
    finishes its step, saves and stops); a second Ctrl-C stops at once. The handlers of before come
    back on leaving."""
    stop_signal = []

    def request_stop(signum, frame):
        stop_signal.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous_handlers = {sig: signal.signal(sig, request_stop)
                         for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop_signal
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
