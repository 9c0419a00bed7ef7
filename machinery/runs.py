"""Setting up a train.py run: its settings' ranges, out_dir and checkpoint, processes and device,
data, log.jsonl, the start report and the stop signals.

train.py passes in what this needs of it: its settings table (machinery/settings.py), the model's
part of the table (model_table) and the model's Config class. Nothing here imports the model file or
the script.
"""

import contextlib
import errno
import json
import math
import os
import signal
import string
import sys

import torch
import torch.distributed as dist

from machinery import checkpoints, cli, dataset, devices, retrofit
from machinery.settings import SettingsError, check_rules, set_setting

PARTS = ("embedding", "backbone", "head")  # what --freeze can name
DATA_SEED_OFFSET = 1_000_003  # the data order's seed is seed + this: a stream apart from the init's
SEED_LIMIT = 2 ** 63 - 2 ** 21  # seeds below it leave room for the offsets (data order, processes)

# --------------------------------------------------------------------------------------------------
# The settings' ranges, the run's out_dir, and the checkpoint it resumes or fine-tunes


def check_settings(s, table, model_table, Config):
    """Each setting's rule in the table (machinery/settings.py), then what one setting alone does
    not say; the model's are checked by Config itself."""
    def need(ok, msg):
        if not ok:
            raise SettingsError(msg)

    for key, value in s.items():
        need(not isinstance(value, float) or math.isfinite(value),
             f"{key}={value} must be a finite number")
    check_rules(s, table)
    need(s["min_lr"] <= s["learning_rate"], f"min_lr={s['min_lr']} must not exceed learning_rate="
                                            f"{s['learning_rate']} (the decay goes down to min_lr)")
    bad_parts = set(filter(None, s["freeze"].split(","))) - set(PARTS)
    need(not bad_parts,
         f"freeze={s['freeze']!r}: choose among {', '.join(PARTS)} (comma-separated)")
    need(s["init_from"] != "",
         "init_from is empty; use scratch, resume, or the path of a checkpoint to fine-tune")
    need(os.path.basename(s["dataset"]) == s["dataset"] and s["dataset"] not in ("", ".", ".."),
         f"dataset={s['dataset']!r} must be a folder name under data_dir (use --data_dir for "
         f"another folder)")
    try:  # the model's own checks, before any work
        Config(vocab_size=2, **{key: s[key] for key in model_table})
    except ValueError as e:
        raise SettingsError(str(e).removeprefix("Config: ")) from None


def resolve_run(given, explicit, table, choices, model_table, Config):
    """The run's settings, built once from those given (defaults, config files, flags; explicit: the
    names that files or flags set) -> (settings, the checkpoint to resume or fine-tune, None for a
    scratch run). The given dict is not changed. What the run's settings take besides:
      - a fine-tune, its source's architecture (read_source);
      - a resume, its checkpoint's settings, with files and flags on top (resumed_settings);
      - out_dir's {name}s filled in, and a new run's lr_decay_iters=0 fixed as its max_iters (a
        resume keeps its schedule)."""
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
        source, architecture = read_source(s, explicit, model_table)
        s.update(architecture)
        check_settings(s, table, model_table, Config)
    fit_flags = [key for key in retrofit.SETTINGS if key in explicit]
    if fit_flags and not (source is not None and source["retrofit"]):  # refused, not ignored
        raise SettingsError(f"{fit_flags[0]}={s[fit_flags[0]]} applies to a {retrofit.WHEN} "
                            f"only, which this run is not (a resumed run does not fit again); "
                            f"drop --{fit_flags[0]}")
    s["out_dir"] = formatted_out_dir(s, table)
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
    s.update(resumed_settings(ckpt, path, s, explicit, table, choices, model_table))
    check_settings(s, table, model_table, Config)
    return s, ckpt


def resumed_settings(ckpt, path, s, explicit, table, choices, model_table):
    """What a resumed run takes from its checkpoint: its run settings, unless a file or flag set
    them (one newer than the checkpoint keeps its default; each checked, as a hand-edit could hold
    any type), and its architecture, which a flag may not change."""
    taken = {}
    for key, value in ckpt["train_config"].items():
        if (key in table and key not in model_table and key not in explicit
                and key not in ("out_dir", "init_from")):
            set_setting(taken, key, value, f"{path} (train_config)", table, choices)
    for key, value in saved_architecture(ckpt["model_config"], model_table).items():
        if key in explicit and s[key] != value:  # the checkpoint's model; a flag may not change it
            raise SettingsError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; a "
                                f"resumed run keeps its model (drop --{key}, or use another "
                                f"out_dir)")
        taken[key] = value
    return taken


def formatted_out_dir(s, table):
    """out_dir with its {name}s replaced by those settings, e.g. out-{dataset}-{embedding}: one
    folder per arm, so that arms do not overwrite each other."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(s["out_dir"])
                  if field is not None]
        if any(field not in table for field in fields):  # no {dataset.upper} or {0}: plain names
            raise KeyError(next(field for field in fields if field not in table))
        return s["out_dir"].format(**s)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise SettingsError(f"out_dir={s['out_dir']!r}: each {{...}} must name a setting, e.g. "
                            f"{{embedding}} ({type(e).__name__}: {e})") from None


def read_source(s, explicit, model_table):
    """The checkpoint a fine-tuning run starts from -> (it, the settings it gives the run: its
    architecture; flags may change dropout only). A retrofit, --embedding=lev from a tied or
    untied source, keeps LEV's settings from this run instead (source["retrofit"] says which;
    machinery/retrofit.py)."""
    source, path = checkpoints.read_checkpoint(s["init_from"], "cpu")
    source["retrofit"] = (s["embedding"] == "lev" and "embedding" in explicit
                          and source["model_config"].get("embedding") in ("tied", "untied"))
    taken = {}
    for key, value in saved_architecture(source["model_config"], model_table).items():
        if source["retrofit"] and (key == "embedding" or key.startswith("lev_")):
            continue  # the new LEV's settings: this run's flags and defaults
        if key in explicit and s[key] != value and key != "dropout":
            raise SettingsError(f"{path} has {key}={value!r}, this run asks for {s[key]!r}; "
                                f"fine-tuning keeps the source's architecture (drop --{key})")
        if key != "dropout" or key not in explicit:
            taken[key] = value
    source["path"] = path
    return source, taken


def saved_architecture(model_config, model_table):
    """A checkpoint's model settings (model_table's keys); a missing one gets its default, which is
    also what Config(**model_config) gives the model."""
    return {key: model_config.get(key, entry[0]) for key, entry in model_table.items()}


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


def ckpt_path(s):
    return os.path.join(s["out_dir"], "ckpt.pt")


def log_path(s):
    return os.path.join(s["out_dir"], "log.jsonl")


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

    def __init__(self, s):
        self.ddp = "RANK" in os.environ
        ranks = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if self.ddp else (0, 1)
        self.rank, self.world = ranks
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.master = self.rank == 0
        device_name = devices.resolve_device(s["device"])  # a ValueError: reported as a bad setting
        if self.ddp and device_name == "mps":
            raise SettingsError("DDP (torchrun) runs on cuda (nccl) or cpu (gloo), not mps; use "
                                "--device=cpu")
        on_gpus = device_name == "cuda" and self.ddp
        self.device = torch.device(f"cuda:{self.local_rank}" if on_gpus else device_name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.dtype = devices.resolve_dtype(s["dtype"], self.device.type)
        self.autocast = devices.autocast(self.device.type, self.dtype)
        if s["gradient_accumulation_steps"] % self.world:
            raise SettingsError(f"gradient_accumulation_steps={s['gradient_accumulation_steps']} "
                                f"must be divisible by the number of processes ({self.world})")
        self.local_accum = s["gradient_accumulation_steps"] // self.world

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
    """The dataset's splits and the fixed evaluation windows (the same for every arm)."""

    def __init__(self, s):
        self.dir = os.path.join(s["data_dir"], s["dataset"])
        self.meta = dataset.load_meta(self.dir)
        self.train = dataset.load_split(self.dir, "train")
        self.val = dataset.load_split(self.dir, "val")
        T, B = s["block_size"], s["batch_size"]
        if len(self.train) <= T:
            raise SettingsError(f"the train split of {self.dir} has {len(self.train)} tokens, too "
                                f"few for block_size={T}; use a smaller block_size or more text")
        # the train split's windows are as many as the val split's
        self.val_starts = dataset.eval_windows(len(self.val), T, s["eval_iters"] * B or None)
        self.train_starts = dataset.eval_windows(len(self.train), T, len(self.val_starts))


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
# log.jsonl, the start report, progress lines and the stop signals


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


def report_start(model, run, data, procs, s):
    """What the run trains on, with, where, and from which step."""
    report = model.param_report()
    tokens_per_step = s["gradient_accumulation_steps"] * s["batch_size"] * s["block_size"]
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
              f"{tokens_per_step:,} tokens per step, {where}")
    if s["init_from"] == "resume" and s["max_iters"] > s["lr_decay_iters"] > 0:
        procs.log(f"note: the cosine decay ends at step {s['lr_decay_iters']} (lr_decay_iters, "
                  f"kept from the checkpoint), then lr stays at min_lr; pass --lr_decay_iters to "
                  f"change the schedule")


def what_was_kept(s, table):
    """After a stop outside the training loop: what out_dir holds, and how to go on (s: the
    settings as given, out_dir's {name}s not yet filled in)."""
    try:
        out_dir = s and formatted_out_dir(s, table)
    except SettingsError:
        out_dir = None
    if not out_dir or not os.path.isdir(out_dir):
        return "nothing was written"
    if os.path.isfile(os.path.join(out_dir, "ckpt.pt")):
        return (f"{out_dir}/ckpt.pt keeps the last saved state; continue with --out_dir={out_dir} "
                f"--init_from=resume")
    return "no checkpoint was saved yet: the same command starts the run again"


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
