"""Checkpoints: written by train.py, read by train.py (resume, fine-tune), sample.py and eval.py.

The model's classes (leviathan.GPT and leviathan.Config) are passed in by the scripts: this package
never imports the model file.
"""

import dataclasses
import os
import pickle

import torch

from lab import dataset
from lab.cli import atomic_path, one_line

# --------------------------------------------------------------------------------------------------
# Checkpoints: written by train.py, read by train.py (resume, fine-tune), sample.py, eval.py
#
# A checkpoint is a dict of tensors and plain values only, so it loads with weights_only=True (no
# arbitrary pickles): version, model (state_dict), model_config (Config fields), train_config, meta
# (the dataset's meta.json), step, best_val_loss, tokens_seen, elapsed_s, and for resuming:
# optimizer, rng (and scaler).

CHECKPOINT_VERSION = 2
RESUME_KEYS = {"train_config": dict, "step": int, "tokens_seen": int, "best_val_loss": float,
               "optimizer": dict, "rng": dict}
# the last commit that reads a checkpoint of format version 1
READS_VERSION_1 = "66d9f67"


def save_checkpoint(ckpt, path):
    """Write ckpt to path atomically. A failure (a full disk, a folder removed) is an OSError naming
    the path; the previous file at path is left whole."""
    try:
        with atomic_path(path) as tmp:
            torch.save(ckpt, tmp)
    except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
        raise OSError(f"could not write {path} ({one_line(e)[:200]}); the previous "
                      f"{os.path.basename(path)}, if any, is unchanged. Free disk space or use "
                      f"another --out_dir") from None


def read_checkpoint(path, device="cpu", for_resume=False):
    """The checkpoint dict at path (a file, or a run directory holding ckpt.pt), checked: ValueError
    or FileNotFoundError with one line saying what is wrong. for_resume also checks what a resumed
    run needs."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first (python train.py ...) "
                                f"or fix the path")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message advises loading the file unsafely: not passed on
        if "GLOBAL" not in str(e):  # not a pickle of tensors at all
            raise ValueError(f"{path} is not a readable leviathan checkpoint (not a torch.save "
                             f"file of tensors and plain values)") from None
        raise ValueError(f"{path} is not a leviathan checkpoint: it holds Python objects other "
                         f"than tensors and plain values, which could run code when loaded; it was "
                         f"refused unread") from None
    except Exception as e:  # a truncated file, not a zip archive, ...
        raise ValueError(f"{path} is not a readable leviathan checkpoint ({type(e).__name__}: "
                         f"{one_line(e)[:200]})") from None
    version = ckpt.get("version") if isinstance(ckpt, dict) else None
    if version == 1:
        raise ValueError(f"{path} is a checkpoint of format version 1; this code reads version "
                         f"{CHECKPOINT_VERSION}. Commit {READS_VERSION_1} of leviathan reads both")
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"{path} is a checkpoint of format version {version!r}; this code reads "
                         f"version {CHECKPOINT_VERSION}. Use the leviathan version that wrote it, "
                         f"or retrain")
    need = {"model": dict, "model_config": dict, "meta": dict,
            **(RESUME_KEYS if for_resume else {})}
    for key, kind in need.items():
        if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool):
            found = "missing" if key not in ckpt else f"a {type(ckpt[key]).__name__}"
            raise ValueError(f"{path}: {key!r} is {found}, not a {kind.__name__}; this file was "
                             f"not written by train.py, or was edited. Use an untouched checkpoint")
    return ckpt, path


def build_model(ckpt, path, GPT, Config, device="cpu"):
    """The model a checked checkpoint describes, with its weights, in eval mode (GPT, Config:
    leviathan's)."""
    unknown = set(ckpt["model_config"]) - {f.name for f in dataclasses.fields(Config)}
    if unknown:
        raise ValueError(f"{path} has model settings this code does not know: "
                         f"{', '.join(sorted(unknown))}")
    try:
        model = GPT(Config(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, ValueError) as e:
        # it lists every tensor that does not fit: one line
        raise ValueError(f"{path}: the weights do not fit its model settings "
                         f"({one_line(e)[:300]})") from None
    bad = [name for name, t in ckpt["model"].items()
           if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{path} holds non-finite weights (NaN or inf, e.g. in {bad[0]}): the run "
                         f"that wrote it diverged. Use an earlier checkpoint, or train again with "
                         f"a lower learning_rate")
    return model.to(device).eval()


def load_checkpoint(path, GPT, Config, device="cpu", for_resume=False):
    """Load ckpt.pt (or the ckpt.pt inside a directory) -> (model in eval mode, checkpoint dict)."""
    ckpt, path = read_checkpoint(path, device, for_resume)
    return build_model(ckpt, path, GPT, Config, device), ckpt


def load_model_and_tokenizer(path, GPT, Config, device="cpu"):
    """A checkpoint's model, in eval mode, and its tokenizer (characters or a tiktoken encoding,
    named in the checkpoint's dataset metadata) -> (model, tokenizer); ValueError: what is wrong."""
    model, ckpt = load_checkpoint(path, GPT, Config, device)
    meta = ckpt["meta"]
    if "tokenizer" not in meta:
        raise ValueError(f"the checkpoint in {path} has no dataset metadata (meta) naming its "
                         f"tokenizer; retrain it with this version of train.py")
    try:
        tokenizer = dataset.get_tokenizer(meta)
    except Exception as e:  # an unknown encoding name, a tiktoken file not to be had offline, ...
        raise ValueError(f"cannot build the checkpoint's tokenizer {meta['tokenizer']!r} "
                         f"({type(e).__name__}: {e})") from None
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the checkpoint's tokenizer {meta['tokenizer']!r} has "
                         f"{tokenizer.vocab_size} tokens but its model has vocab_size="
                         f"{model.config.vocab_size}; the checkpoint is inconsistent")
    return model, tokenizer
