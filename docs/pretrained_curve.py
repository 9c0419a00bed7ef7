"""docs/pretrained_retrofit.png: the retrofit's curve, from its stages' log.jsonl (pretrained.md).

    python docs/pretrained_curve.py EXP_DIR docs/pretrained_retrofit.png

Tiny Shakespeare val perplexity (train.py's 16 fixed windows of 512) against training tokens and
minutes, stage 1 then stage 2, for LEV (its fit's minutes first) and the control; the original model
as a line."""

import json
import math
import os
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def records(run):
    with open(os.path.join(run, "log.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(exp, out):
    fit = torch.load(os.path.join(exp, "lev-fit.pt"), mmap=True, weights_only=True)["retrofit"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    arms = (("lev", "tab:red", fit["seconds"] / 60), ("ctl", "tab:blue", 0))
    for arm, color, start_minutes in arms:
        tokens, minutes, ppl = [], [], []
        t0, m0 = 0, start_minutes
        for stage in ("s1", "s2"):
            for r in records(os.path.join(exp, f"{arm}-{stage}")):
                tokens.append(t0 + r["tokens"])
                minutes.append(m0 + r["elapsed_s"] / 60)
                ppl.append(math.exp(r["val_loss"]))
            t0, m0 = tokens[-1], minutes[-1]
        label = {"lev": "LEV: fit, stage 1 (LEV alone), stage 2 (all)",
                 "ctl": "control: the table, trained the same way"}[arm]
        for ax, x in zip(axes, (tokens, minutes), strict=True):
            ax.plot(x, ppl, "o-", color=color, label=label, ms=3)
    original = math.exp(records(os.path.join(exp, "ctl-s1"))[0]["val_loss"])
    xlabels = ("training tokens (stage 2 from 409,600)",
               "minutes, one thread each (LEV's from its fit's end)")
    for ax, xlabel in zip(axes, xlabels, strict=True):
        ax.axhline(original, color="gray", ls="--", label=f"original model ({original:.1f})")
        ax.set_xlabel(xlabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("Tiny Shakespeare val perplexity (16 windows of 512)")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M: LEV in place of its 49,152 x 576 table, and the table trained the "
                 "same way")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
