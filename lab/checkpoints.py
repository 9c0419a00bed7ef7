"""A run's checkpoint for the lab's tools: read as train.py reads it (format 2, weights_only=True:
tensors and plain values, no code), then what a tool needs besides: finite weights, eval mode, a
device, the tokenizer."""

import torch

from lab import dataset
from train import build_model, read_checkpoint

CHECKPOINT_VERSION = 2  # the format train.py writes and reads


def load_checkpoint(path, device="cpu"):
    """ckpt.pt (or the ckpt.pt inside a run directory) -> (its model in eval mode, the checkpoint
    dict); ValueError or FileNotFoundError: one line saying what is wrong."""
    ckpt, path = read_checkpoint(path)
    model = build_model(ckpt, path)
    bad = [name for name, t in ckpt["model"].items()
           if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{path} holds non-finite weights (NaN or inf, e.g. in {bad[0]}): the run "
                         f"that wrote it diverged. Use an earlier checkpoint, or train again with "
                         f"a lower learning_rate")
    return model.to(device).eval(), ckpt


def load_model_and_tokenizer(path, device="cpu"):
    """A checkpoint's model, in eval mode, and its tokenizer (characters or a tiktoken encoding,
    named in the checkpoint's dataset metadata) -> (model, tokenizer); ValueError: what is wrong."""
    model, ckpt = load_checkpoint(path, device)
    meta = ckpt["meta"]
    if "tokenizer" not in meta:
        raise ValueError(f"the checkpoint in {path} has no dataset metadata (meta) naming its "
                         f"tokenizer; retrain it with this version of train.py")
    try:
        tokenizer = dataset.get_tokenizer(meta)
    except Exception as e:  # an unknown encoding name, a tiktoken file not to be had offline, ...
        raise ValueError(f"cannot build the checkpoint's tokenizer {meta['tokenizer']!r} "
                         f"({' '.join(str(e).split())[:200]})") from None
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the checkpoint's tokenizer {meta['tokenizer']!r} has "
                         f"{tokenizer.vocab_size} tokens but its model has vocab_size="
                         f"{model.config.vocab_size}; {path} is inconsistent: use an untouched "
                         f"checkpoint written by train.py")
    return model, tokenizer
