"""Retrofitting LEV onto a trained table model: LEV's parameters fitted to the source's input table.

train.py --init_from=RUN --embedding=lev, with RUN a tied or untied run, builds a lev model of RUN's
architecture, gives it RUN's backbone and head (transplant), fits its LEV to RUN's input table
(retrofit: fit, then report), and then fine-tunes the whole model as any run. The fit needs LEV
alone, no backbone, and goes through LEV's forward: the run's fast path when one is installed
(machinery/fast_paths.py), as in training. Nothing here imports the model file: the LEV module
and the table are passed in.
"""

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from machinery.dataset import BUCKET_LOWER, BUCKETS, train_counts


def transplant(model, source_state):
    """Give a lev model a table model's backbone and head (source_state: its state_dict). The
    weights are copied into the model's own tensors, so that a tied table becomes a head of its own,
    shared with nothing. Returns the source's input table, (V, n_embd)."""
    weights = {k: v for k, v in source_state.items() if not k.startswith("tok_emb.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = list(unexpected) + [k for k in missing if not k.startswith("tok_emb.")]
    if bad:
        raise ValueError(f"the source's weights do not fit a lev model of its architecture "
                         f"({', '.join(bad[:3])})")
    return source_state["tok_emb.weight"]


def id_weights(kind, counts):
    """fit_weights -> each id's weight, (V,) float64 summing to 1 (counts: (V,) training counts)."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    weights = {"counts": counts, "seen": (counts > 0).double(),
               "uniform": torch.ones_like(counts)}[kind]
    return weights / weights.sum()


def closeness(emb, rows):
    """Per id: the relative error ||LEV(i) - T_i|| / ||T_i|| and the cosine of LEV(i) and T_i."""
    rel_error = (emb - rows).norm(dim=-1) / rows.norm(dim=-1).clamp_min(1e-30)
    return rel_error, F.cosine_similarity(emb, rows, dim=-1, eps=1e-30)


def weighted_mean_square(weights, rows):
    """The rows' mean squared norm sum_i w_i ||T_i||^2 (weights: (V,) float64), as a float."""
    return float(weights @ rows.double().pow(2).sum(-1).cpu())


def id_losses(emb, rows, kind, mean_square):
    """fit_loss per id. mse is divided by the rows' weighted mean squared norm, so that 1 is the
    loss of an all-zero LEV whatever the table's scale."""
    if kind == "mse":
        return (emb - rows).pow(2).sum(-1) / mean_square
    cosine = F.cosine_similarity(emb, rows, dim=-1, eps=1e-30)
    norms = rows.norm(dim=-1).clamp_min(1e-30)
    return (1 - cosine) + ((emb.norm(dim=-1) - norms) / norms) ** 2


def fit_lr(step, steps, lr):
    """Linear warmup over the first 5% of the steps, then cosine decay to lr / 10: the first Adam
    steps move every parameter by about lr, and LEV's product of d_seed factors amplifies that."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def fit(lev, table, weights, loss="cosine_norm", steps=4000, lr=1e-3, batch=4096, log_interval=100,
        log=print, seed=0):
    """Fit LEV's parameters, and only those, to table (V, n_embd): Adam over `steps` steps of
    `batch` ids drawn by weights (V,). A frozen LEV (--freeze=embedding) is fitted all the same."""
    params = list(lev.parameters())
    trainable = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    table = table.to(lev.codebooks.device, lev.codebooks.dtype)
    mean_square = weighted_mean_square(weights, table)
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    t_log, since_log = time.time(), 0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = fit_lr(step, steps, lr)
        ids = torch.multinomial(weights, batch, replacement=True, generator=generator)
        ids = ids.to(table.device)
        emb, rows = lev(ids), table[ids]
        step_loss = id_losses(emb, rows, loss, mean_square).mean()
        if not torch.isfinite(step_loss):
            raise ValueError(f"the retrofit's fit loss is {step_loss.item()} at fit step {step}; "
                             f"lower --fit_lr")
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        optimizer.step()
        since_log += 1
        if (step + 1) % log_interval == 0 or step + 1 == steps:
            rel_error, cosine = closeness(emb.detach(), rows)
            ms = 1000 * (time.time() - t_log) / since_log
            log(f"fit step {step + 1}/{steps} | loss {step_loss.item():.4f} | rel error "
                f"{rel_error.mean().item():.4f} | cosine {cosine.mean().item():.4f} | {ms:.0f} "
                f"ms/step")
            t_log, since_log = time.time(), 0
    for p, flag in zip(params, trainable, strict=True):
        p.requires_grad_(flag)


@torch.no_grad()
def report(lev, table, weights, counts, loss="cosine_norm"):
    """How close LEV came to the table: over all ids, weighted by the fit's weights ({"loss",
    "rel_error", "cosine"}), and per frequency bucket (bucket_report)."""
    emb = lev.table().double().cpu()
    rows = table.double().cpu()
    mean_square = weighted_mean_square(weights, rows)
    rel_error, cosine = closeness(emb, rows)
    overall = {"loss": float(weights @ id_losses(emb, rows, loss, mean_square)),
               "rel_error": float(weights @ rel_error), "cosine": float(weights @ cosine)}
    return overall, bucket_report(rel_error.numpy(), cosine.numpy(), rows.norm(dim=-1).numpy(),
                                  np.asarray(counts))


def bucket_report(rel_error, cosine, row_norm, counts):
    """Per bucket of the training split's counts (eval.py's BUCKETS): {"bucket", "ids", "tokens"},
    the table rows' mean norm ||T_i|| over the bucket's ids ("row_norm": how much a row weighs
    in mse), and the relative error and cosine averaged two ways, over the bucket's ids
    ("rel_error", "cosine") and over its training tokens, each id weighted by its count
    ("rel_error_tokens", "cosine_tokens"); None where there is nothing to average."""
    which = np.searchsorted(BUCKET_LOWER, counts, side="right") - 1
    rows = []
    for b, name in enumerate(BUCKETS):
        mask = which == b
        n, tokens = int(mask.sum()), int(counts[mask].sum())
        row = {"bucket": name, "ids": n, "tokens": tokens,
               "row_norm": float(row_norm[mask].mean()) if n else None}
        for key, values in (("rel_error", rel_error), ("cosine", cosine)):
            row[key] = float(values[mask].mean()) if n else None
            row[f"{key}_tokens"] = (float(values[mask] @ counts[mask]) / tokens if tokens
                                    else None)
        rows.append(row)
    return rows


def format_buckets(rows):
    """bucket_report's rows as a small table, one line per bucket."""
    def number(x):
        return "-" if x is None else f"{x:.4f}"

    lines = [f"{'bucket':>8} {'ids':>8} {'tokens':>10} {'row norm':>8} | over ids: rel error, "
             f"cosine | over tokens: rel error, cosine"]
    for r in rows:
        lines.append(f"{r['bucket']:>8} {r['ids']:>8,} {r['tokens']:>10,} "
                     f"{number(r['row_norm']):>8} | "
                     f"{number(r['rel_error']):>19} {number(r['cosine']):>7} | "
                     f"{number(r['rel_error_tokens']):>22} {number(r['cosine_tokens']):>7}")
    return lines


def retrofit(lev, table, train_tokens, fit_steps, fit_lr, fit_batch, fit_loss, fit_weights,
             log_interval, seed, log=print):
    """train.py's part: fit LEV to the source's table with the run's fit_* settings, print the
    fit's figures and bucket table, and return them with the settings (the record kept in ckpt.pt's
    origin and in log.jsonl's step-0 record)."""
    settings = {"fit_steps": fit_steps, "fit_lr": fit_lr, "fit_batch": fit_batch,
                "fit_loss": fit_loss, "fit_weights": fit_weights}
    counts = train_counts(train_tokens, table.shape[0])
    weights = id_weights(fit_weights, counts)
    log(f"retrofit: fitting LEV to the source's input table ({table.shape[0]:,} x "
        f"{table.shape[1]}), {', '.join(f'{k} {v}' for k, v in settings.items())}")
    t_start = time.time()
    try:
        fit(lev, table, weights, fit_loss, fit_steps, fit_lr, fit_batch, log_interval, log, seed)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise
        raise ValueError(f"the retrofit's fit ran out of memory with fit_batch={fit_batch} ids "
                         f"per step; lower --fit_batch (the default is 4096)") from None
    overall, buckets = report(lev, table, weights, counts, fit_loss)
    seconds = round(time.time() - t_start, 3)
    log(f"retrofit: LEV against the table, weighted by fit_weights: loss {overall['loss']:.4f}, "
        f"rel error {overall['rel_error']:.4f}, cosine {overall['cosine']:.4f} ({seconds:.1f} s); "
        f"per bucket of the training split:")
    for line in format_buckets(buckets):
        log(line)
    return {**settings, **overall, "seconds": seconds, "buckets": buckets}
