"""
What the scripts share: one-line failures, files written atomically, devices and dtypes, checkpoints.

Every script reports bad input the same way: one line on stderr, `script.py: error: what was wrong; what to do`,
and exit code 2, never a traceback. Every file a script writes appears whole or not at all (atomic_path), so no
failure, Ctrl-C or full disk ever leaves half a checkpoint or replaces a good one by a broken one.
"""

import argparse
import contextlib
import dataclasses
import glob
import os
import pickle
import re
import sys

import torch

from leviathan import GPT, Config

# ----------------------------------------------------------------------------------------------------------
# One-line failures


def one_line(text):
    """Any message as one line (library messages can span many)."""
    return " ".join(str(text).split())


def fail(prog, message):
    """Bad input: one actionable line on stderr and exit code 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line (not the usage block, then the error) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


# ----------------------------------------------------------------------------------------------------------
# Files: written atomically, checked up front


@contextlib.contextmanager
def atomic_path(path):
    """`with atomic_path(path) as tmp:` write the file at tmp; at the end of the block it replaces path
    (os.replace), so a reader never sees half a file and an interrupted or failed write leaves the old one whole.
    On any failure the half-written tmp is removed (a full disk is not kept full). The process id in tmp keeps
    concurrent writers (DDP ranks) apart, and lets remove_stale_temps tell a dead writer's leftovers."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_atomic(path, data):
    """Write bytes to path atomically (atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def remove_stale_temps(folder):
    """Remove the temp files (name.tmpPID) that writers killed mid-write left in folder (their process is gone)."""
    for tmp in glob.glob(os.path.join(glob.escape(folder), "*.tmp*")):
        match = re.search(r"\.tmp(\d+)$", tmp)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.remove(tmp)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def save_figure(fig, path):
    """Write a matplotlib figure as a PNG at path (atomically), and close it."""
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def check_output_file(path, flag):
    """Refuse, before any work is done, an output file that could not be written: an empty name, a directory,
    or a folder that cannot be created or written to. Raises ValueError naming the flag."""
    if not path:
        raise ValueError(f"{flag} is empty; give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag}={path} is a directory; give a file name")
    check_output_dir(os.path.dirname(path) or ".", flag)


def check_output_dir(folder, flag):
    """The folder exists (or can be made) and a file can be created in it; else ValueError naming the flag."""
    if not folder:
        raise ValueError(f"{flag} is empty; give a folder")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag}={folder} is a file, not a folder; give another path")
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-test{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{flag}: cannot write in {folder} ({e.strerror}); give a writable path") from None


# ----------------------------------------------------------------------------------------------------------
# Devices and dtypes


def resolve_device(name):
    """'auto' -> cuda if available, else mps, else cpu; an explicit device must be available (else ValueError)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but torch sees no CUDA GPU; use --device=cpu or --device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device=mps but this torch has no MPS (Apple GPU) support; use --device=cpu or auto")
    if name not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device={name}; choose auto, cpu, cuda or mps")
    return name


def resolve_dtype(name, device_type):
    """'auto' -> bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere; returns the name."""
    if name == "auto":
        if device_type != "cuda":
            return "float32"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return name


def autocast(device_type, dtype_name):
    """The autocast context of a dtype name (nothing for float32)."""
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype_name))


def pick_threads(n_params):
    """Torch threads for a model of n_params parameters on CPU. Small models gain little from threads, and when
    another process is busy, OpenMP threads that spin waiting for each other collapse decoding speed (README,
    "Sampling"): one thread for models below 50M parameters, torch's default above."""
    return 1 if n_params < 50_000_000 else torch.get_num_threads()


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: written by train.py, read by train.py (resume, fine-tune), sample.py, eval.py
#
# A checkpoint is a dict of tensors and plain values only, so it loads with weights_only=True (no arbitrary
# pickles): version, model (state_dict), model_config (Config fields), train_config, meta (the dataset's
# meta.json), step, best_val_loss, tokens_seen, elapsed_s, and for resuming: optimizer, rng (and scaler).

CHECKPOINT_VERSION = 2
RESUME_KEYS = {"train_config": dict, "step": int, "tokens_seen": int, "best_val_loss": float, "optimizer": dict,
               "rng": dict}
# version 1 -> 2: LEV's settings renamed to one scheme, the output head renamed lm_head, the run settings lev_chunk
# and lev_compile out of the model's config, and the spline basis normalised (version 1 models were trained with
# the plain basis, so they keep it)
V1_RENAMES = {"n_digits": "lev_digits", "d_seed": "lev_seed_dim", "n_lev_heads": "lev_heads", "n_knots": "lev_knots"}
# Config fields added after checkpoints of the current format were first written, with the value that those
# checkpoints' models were made with (not today's default where it differs): W_out's init std was 0.02
FIELDS_ADDED = {"lev_out_init_std": 0.02}


def save_checkpoint(ckpt, path):
    """Write ckpt to path atomically. A failure (a full disk, a folder removed) is an OSError naming the path;
    the previous file at path is left whole."""
    try:
        with atomic_path(path) as tmp:
            torch.save(ckpt, tmp)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        raise OSError(f"could not write {path} ({one_line(e)[:200]}); the previous {os.path.basename(path)}, "
                      f"if any, is unchanged. Free disk space or use another --out_dir") from None


def migrate_v1(ckpt):
    """A version 1 checkpoint in version 2's terms (same weights, same function)."""
    def renamed(settings):
        return {V1_RENAMES.get(key, key): value for key, value in settings.items()}

    config = {k: v for k, v in renamed(ckpt["model_config"]).items() if k not in ("lev_chunk", "lev_compile")}
    config.setdefault("lev_normalize_basis", False)
    ckpt["model_config"] = config
    ckpt["model"] = {("lm_head.weight" if k == "head.weight" else k): v for k, v in ckpt["model"].items()}
    if isinstance(ckpt.get("train_config"), dict):
        ckpt["train_config"] = renamed(ckpt["train_config"])
    ckpt["version"] = CHECKPOINT_VERSION
    return ckpt


def read_checkpoint(path, device="cpu", for_resume=False):
    """The checkpoint dict at path (a file, or a run directory holding ckpt.pt), checked: ValueError or
    FileNotFoundError with one line saying what is wrong. for_resume also checks what a resumed run needs."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first (python train.py ...) or fix the path")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message advises loading the file unsafely: not passed on
        if "GLOBAL" not in str(e):  # not a pickle of tensors at all
            raise ValueError(f"{path} is not a readable leviathan checkpoint (not a torch.save file of tensors "
                             f"and plain values)") from None
        raise ValueError(f"{path} is not a leviathan checkpoint: it holds Python objects other than tensors and "
                         f"plain values, which could run code when loaded; it was refused unread") from None
    except Exception as e:  # a truncated file, not a zip archive, ...
        raise ValueError(f"{path} is not a readable leviathan checkpoint ({type(e).__name__}: "
                         f"{one_line(e)[:200]})") from None
    version = ckpt.get("version") if isinstance(ckpt, dict) else None
    if version == 1:
        ckpt = migrate_v1(ckpt)
    elif version != CHECKPOINT_VERSION:
        raise ValueError(f"{path} is a checkpoint of format version {version!r}; this code reads versions 1 and "
                         f"{CHECKPOINT_VERSION}. Use the leviathan version that wrote it, or retrain")
    need = {"model": dict, "model_config": dict, "meta": dict, **(RESUME_KEYS if for_resume else {})}
    for key, kind in need.items():
        if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool):
            found = "missing" if key not in ckpt else f"a {type(ckpt[key]).__name__}"
            raise ValueError(f"{path}: {key!r} is {found}, not a {kind.__name__}; this file was not written by "
                             f"train.py, or was edited. Use an untouched checkpoint")
    for key, value in FIELDS_ADDED.items():
        ckpt["model_config"].setdefault(key, value)
    return ckpt, path


def build_model(ckpt, path, device="cpu"):
    """The model a checked checkpoint describes, with its weights, in eval mode."""
    unknown = set(ckpt["model_config"]) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ValueError(f"{path} has model settings this code does not know: {', '.join(sorted(unknown))}")
    try:
        model = GPT(Config(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, ValueError) as e:  # it lists every tensor that does not fit: one line
        raise ValueError(f"{path}: the weights do not fit its model settings ({one_line(e)[:300]})") from None
    bad = [name for name, t in ckpt["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{path} holds non-finite weights (NaN or inf, e.g. in {bad[0]}): the run that wrote it "
                         f"diverged. Use an earlier checkpoint, or train again with a lower learning_rate")
    return model.to(device).eval()


def load_checkpoint(path, device="cpu", for_resume=False):
    """Load ckpt.pt (or the ckpt.pt inside a directory) -> (model in eval mode, checkpoint dict)."""
    ckpt, path = read_checkpoint(path, device, for_resume)
    return build_model(ckpt, path, device), ckpt
