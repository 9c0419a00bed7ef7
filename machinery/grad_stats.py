"""Gradient diagnostics of train.py: clipping, and what each log.jsonl record says about the
gradients.

A record's grad_norm (the mean total norm before clipping), clip_fraction and grad_norms (the mean
norm of each part of the model) cover the optimizer steps since the previous record. The model is
passed in (a leviathan.GPT): this module reads its parameters' names, never imports it.
"""

import math

import torch

LEV_PARTS = {"codebooks": "lev.codebooks", "seed_proj": "lev.seed_proj",  # LEV's parameter -> part
             "ln_weight": "lev.ln", "ln_bias": "lev.ln", "spline": "lev.spline",
             "out_proj": "lev.out_proj"}
GRAD_PARTS = ("embedding", "embedding+head", "backbone", "head", *dict.fromkeys(LEV_PARTS.values()))


def grad_parts(model):
    """Part -> its trainable parameters, in GRAD_PARTS's order: embedding (tok_emb; the tied arm's
    table, which is the head too, as embedding+head), backbone (the blocks and the final norm), head
    (lm_head), and in the lev arm LEV's own parts as well. A part with nothing to train (frozen) is
    left out."""
    arm, parts = model.config.embedding, {}
    for name, p in model.named_parameters():  # the tied table is listed once, as tok_emb's
        if not p.requires_grad:
            continue
        module, _, rest = name.partition(".")
        if module == "tok_emb":
            names = ["embedding+head" if arm == "tied" else "embedding"]
            names += [LEV_PARTS[rest]] if arm == "lev" else []
        else:
            names = ["head" if module == "lm_head" else "backbone"]
        for part in names:
            parts.setdefault(part, []).append(p)
    return {part: parts[part] for part in GRAD_PARTS if part in parts}


def clipped(grad_norm, grad_clip):
    """Whether clipping scaled a step's gradients down, given their norm before clipping (grad_clip
    0: no clipping; a non-finite norm: a float16 step that the GradScaler skipped)."""
    return grad_clip > 0 and math.isfinite(grad_norm) and grad_norm > grad_clip


class GradStats:
    """The optimizer steps since the previous log record: their mean total gradient norm before
    clipping, the fraction of them clipped, and the mean gradient norm of each part of the model
    (grad_parts). The norms are of the unscaled gradients each process holds after DDP's all-reduce.
    The part norms add up on the device and are read once per record, so the steps in between wait
    for nothing."""

    def __init__(self, model, grad_clip):
        self.parts, self.grad_clip = grad_parts(model), grad_clip
        self.part_norms = None  # the current step's, from measure_parts()
        self.reset()

    def reset(self):
        self.steps, self.clipped, self.norm_sum, self.part_norm_sums = 0, 0, 0.0, 0.0

    def measure_parts(self):
        """Take each part's gradient norm now: after unscaling and before clipping changes the
        gradients. Parameters without a gradient are skipped."""
        norms = []
        for params in self.parts.values():
            grads = [p.grad for p in params if p.grad is not None]
            norms.append(torch.nn.utils.get_total_norm(grads) if grads else params[0].new_zeros(()))
        self.part_norms = torch.stack(norms)

    def add(self, grad_norm):
        """Count a step of total gradient norm grad_norm (before clipping), with the part norms
        measure_parts() took. A float16 step that the GradScaler skipped (inf or NaN
        gradients) changed nothing, and is not counted."""
        if not math.isfinite(grad_norm):
            return
        self.steps += 1
        self.clipped += clipped(grad_norm, self.grad_clip)
        self.norm_sum += grad_norm
        self.part_norm_sums = self.part_norm_sums + self.part_norms

    def record(self):
        """grad_norm, clip_fraction and grad_norms for a log record (None without steps,
        clip_fraction also without clipping); then start afresh."""
        n = self.steps
        part_means = (self.part_norm_sums / n).tolist() if n else None
        stats = {"grad_norm": self.norm_sum / n if n else None,
                 "clip_fraction": self.clipped / n if n and self.grad_clip > 0 else None,
                 "grad_norms": dict(zip(self.parts, part_means, strict=True)) if n else None}
        self.reset()
        return stats
