"""eval.py's plumbing: its inputs read and checked, its tables, figure and JSON file written.

eval.py says what is measured and how. This module reads what it needs besides the checkpoints (the
dataset they were trained on, each run's log.jsonl), checks that they belong together, and writes
what eval.py found: the markdown tables on stdout, --json and --plot. Bad input is raised as a
ValueError whose message is the one line eval.py reports.
"""

import json
import math
import os

import numpy as np

from machinery import cli, tasks
from machinery.cli import atomic_path
from machinery.dataset import load_meta, load_split

# --------------------------------------------------------------------------------------------------
# Inputs: the flags, what must agree between the runs and the data, each run's log.jsonl


def check_args(args):
    """eval.py's flags, checked beyond what argparse checks -> the --task specs as (name, path)."""
    if args.batch_size < 1:
        raise ValueError(f"--batch_size={args.batch_size} must be at least 1")
    if args.lambada_max < 0:
        raise ValueError(f"--lambada_max={args.lambada_max} must be >= 0 (0 skips the last-word "
                         f"task)")
    if args.task_max < 0:
        raise ValueError(f"--task_max={args.task_max} must be >= 0 (0: every example)")
    specs = [tasks.parse_spec(spec) for spec in args.task]
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib, which is not installed: pip install "
                             "matplotlib (or drop --plot)") from None
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:  # refused now, not after the whole evaluation
            cli.check_output_file(path, flag)
    return specs


def identity(meta, vocab_size):
    """What must agree between checkpoints and data: dataset, tokenizer, vocabulary."""
    return meta.get("dataset"), meta.get("tokenizer"), vocab_size, meta.get("chars")


def same_data(arms):
    """arms [(dir, model, ckpt)] -> the identity of their data, the same for every arm."""
    first_dir, first_model, first_ckpt = arms[0]
    want = identity(first_ckpt["meta"], first_model.config.vocab_size)
    for d, model, ckpt in arms[1:]:
        got = identity(ckpt["meta"], model.config.vocab_size)
        if got != want:
            raise ValueError(f"{first_dir} was trained on dataset {want[0]!r} (tokenizer "
                             f"{want[1]}, vocab {want[2]}) but {d} on {got[0]!r} (tokenizer "
                             f"{got[1]}, vocab {got[2]}); compare checkpoints of one dataset and "
                             f"tokenizer only")
    if not isinstance(want[0], str) or not want[0]:
        raise ValueError(f"{first_dir}: its dataset name {want[0]!r} is not a folder name; the "
                         f"checkpoint was edited or damaged")
    return want


def labels(dirs, embeddings):
    """The arm name, plus the dir name where several runs share an arm (e.g. 'lev (out-lev-s2)')."""
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    out = [f"{e} ({n})" if embeddings.count(e) > 1 else e
           for e, n in zip(embeddings, names, strict=True)]
    # two runs of one arm in dirs of the same name (a/out, b/out): the paths as given tell them
    # apart
    return [f"{e} ({d})" if out.count(lab) > 1 else lab
            for lab, e, d in zip(out, embeddings, dirs, strict=True)]


def load_data(data_root, want):
    """The dataset the runs were trained on -> (data_dir, meta, val split, train split), checked
    against want, the runs' identity."""
    data_dir = os.path.join(data_root, want[0])
    try:
        meta = load_meta(data_dir)
        val, train = load_split(data_dir, "val"), load_split(data_dir, "train")
    except (OSError, ValueError) as e:
        raise ValueError(f"{e} (or point --data_dir at the folder that holds dataset "
                         f"{want[0]!r})") from None
    got = identity(meta, meta.get("vocab_size"))
    if got != want:
        raise ValueError(f"{data_dir} holds dataset {got[0]!r} (tokenizer {got[1]}, vocab "
                         f"{got[2]}) but the checkpoints were trained on {want[0]!r} (tokenizer "
                         f"{want[1]}, vocab {want[2]}); prepare it again or fix --data_dir")
    if len(val) and int(np.max(val)) >= meta["vocab_size"]:
        raise ValueError(f"{data_dir}/val.bin holds ids >= vocab_size {meta['vocab_size']}; "
                         f"prepare the dataset again")
    return data_dir, meta, val, train


def read_curve(run_dir):
    """run_dir/log.jsonl -> [(training tokens, val loss), ...] sorted by tokens, or None when there
    is no log."""
    path = os.path.join(run_dir, "log.jsonl")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is not a file; move it away (token efficiency needs train.py's "
                         f"log)")
    if not os.path.isfile(path):
        return None
    curve = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                curve.append((float(record["tokens"]), float(record["val_loss"])))
                if not all(math.isfinite(v) for v in curve[-1]):
                    raise ValueError("not finite")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n} is not a log record with 'tokens' and 'val_loss' "
                                 f"({e}); fix or delete that line") from None
    return sorted(curve) or None


# --------------------------------------------------------------------------------------------------
# Tables


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def rel(x, base):
    """Relative difference of x against base, as a signed percentage."""
    return "-" if x is None or base is None else f"{100 * (x / base - 1):+.1f}%"


def table(header, rows):
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def loss_table(results, data_dir):
    """Measurement 1: val loss and perplexity per arm, with its parameter counts."""
    base = results[0]
    scored = " / ".join(sorted({f"{r['val_targets']:,}" for r in results}))
    header = ["arm", "input embedding", "backbone", "head", "val loss", "perplexity",
              f"ppl vs {base['label']}"]
    rows = [[r["label"], f"{r['params']['input_embedding']:,}", f"{r['params']['backbone']:,}",
             f"{r['params']['head']:,}", fmt(r["val_loss"]), fmt(r["val_ppl"], ".3f"),
             "(baseline)" if r is base else rel(r["val_ppl"], base["val_ppl"])] for r in results]
    return (f"## Validation loss: whole split of {data_dir} ({scored} targets scored per arm)\n\n"
            + table(header, rows))


def bucket_table(results):
    """Measurement 2: loss and perplexity per training-count bucket of the target."""
    base = results[0]
    header = ["train count", "val tokens", "share"]
    for r in results:
        header += [f"{r['label']} loss", f"{r['label']} ppl"]
    header += [f"{r['label']} ppl vs {base['label']}" for r in results[1:]]
    rows = []
    for b, stats in enumerate(base["buckets"]):
        row = [stats["bucket"], f"{stats['tokens']:,}", f"{100 * stats['share']:.1f}%"]
        for r in results:
            row += [fmt(r["buckets"][b]["loss"]), fmt(r["buckets"][b]["ppl"], ".3f")]
        row += [rel(r["buckets"][b]["ppl"], base["buckets"][b]["ppl"]) for r in results[1:]]
        rows.append(row)
    return ("\n## Perplexity by how often the target token occurs in the training split\n\n"
            + table(header, rows))


def efficiency_table(results, target_loss):
    """Measurement 3: the training tokens each arm needed to reach the baseline's final val loss."""
    base = results[0]
    if target_loss is None:
        return f"\n## Token efficiency: skipped, the baseline {base['label']} has no log.jsonl"
    rows = []
    for r in results:
        e = r["token_efficiency"]
        reach = e["tokens_to_reach"]
        if r["curve"] is None:
            cells = ["no log.jsonl", "-"]
        elif reach is None:
            cells = ["never reached", "-"]
        else:
            cells = [f"{reach:,.0f}", f"{e['fewer_tokens']:.2f}x" if e["fewer_tokens"] else "-"]
        rows.append([r["label"], fmt(e["final_val_loss"]), *cells])
    header = ["arm", "final val loss (log)", "tokens to reach",
              f"fewer tokens than {base['label']}"]
    return (f"\n## Token efficiency: training tokens to first reach {base['label']}'s final val "
            f"loss {target_loss:.4f} (log.jsonl, interpolated between evaluations)\n\n"
            + table(header, rows))


def lambada_table(results):
    """Measurement 4: last-word accuracy and word perplexity per arm."""
    base = results[0]
    header = ["arm", "passages", "accuracy", "word perplexity", f"word ppl vs {base['label']}"]
    rows = [[r["label"], r["lambada"]["passages"], fmt(r["lambada"]["accuracy"], ".3f"),
             fmt(r["lambada"]["word_ppl"], ".3f"),
             "(baseline)" if r is base else rel(r["lambada"]["word_ppl"],
                                                base["lambada"]["word_ppl"])]
            for r in results]
    return ("\n## Last-word prediction (LAMBADA-style, greedy, on the validation text)\n\n"
            + table(header, rows))


def report(results, target_loss, data_dir):
    """All tables as one markdown string."""
    out = [loss_table(results, data_dir), bucket_table(results),
           efficiency_table(results, target_loss)]
    if results[0]["lambada"] is not None:
        out.append(lambada_table(results))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# Figure and files


def plot(results, target_loss, path):
    """Two panels: val loss against training tokens (from log.jsonl) and per-bucket perplexity
    bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in results:
        if r["curve"]:
            tokens, loss = zip(*r["curve"], strict=True)
            curves.plot(tokens, loss, marker=".", label=r["label"])
    if target_loss is not None:
        curves.axhline(target_loss, color="gray", linestyle="--", linewidth=1,
                       label=f"{results[0]['label']} final ({target_loss:.3f})")
    curves.set(xlabel="training tokens", ylabel="val loss", title="validation loss during training")
    if any(r["curve"] for r in results):
        curves.legend()
    else:
        curves.text(0.5, 0.5, "no log.jsonl", ha="center", transform=curves.transAxes)

    base = results[0]["buckets"]
    present = [b for b, s in enumerate(base) if s["tokens"]]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ppl = [r["buckets"][b]["ppl"] or float("nan") for b in present]  # nan: no bar
        x = np.arange(len(present)) + (i - (len(results) - 1) / 2) * width
        bars.bar(x, ppl, width, label=r["label"])
    bars.set_xticks(range(len(present)),
                    [f"{base[b]['bucket']}\n{100 * base[b]['share']:.1f}%" for b in present])
    bars.set_yscale("log")  # rare-token perplexities are orders of magnitude above frequent ones
    bars.set(xlabel="training count of the target (share of val tokens)", ylabel="perplexity",
             title="validation perplexity by token frequency")
    bars.legend(fontsize="small")
    fig.tight_layout()
    cli.save_figure(fig, path)


def write_json(obj, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)


def write_outputs(results, target_loss, data_dir, want, task_sets, json_path, plot_path):
    """The tables on stdout; the JSON file (json_path) and the figures (plot_path) where asked
    for."""
    print(report(results, target_loss, data_dir))
    for r in results:
        if r["origin"]:
            print(f"\n{r['label']} was fine-tuned from {r['origin']['checkpoint']} (step "
                  f"{r['origin']['step']}, dataset {r['origin']['dataset']})")
    task_results = [(r["label"], r["tasks"]) for r in results]
    if task_sets:
        print("\n" + tasks.report(task_sets, task_results))
    if json_path:
        write_json({"data_dir": data_dir, "dataset": want[0], "tokenizer": want[1],
                    "buckets": [s["bucket"] for s in results[0]["buckets"]],
                    "baseline": results[0]["label"], "baseline_final_val_loss": target_loss,
                    "tasks": tasks.summary(task_sets), "arms": results}, json_path)
        print(f"\nwrote {json_path}")
    if plot_path:
        plot(results, target_loss, plot_path)
        print(f"wrote {plot_path}")
        if task_sets:  # a figure of its own, beside the first: FILE_tasks.png
            task_plot = "{}_tasks{}".format(*os.path.splitext(plot_path))
            tasks.plot(task_sets, task_results, task_plot)
            print(f"wrote {task_plot}")
