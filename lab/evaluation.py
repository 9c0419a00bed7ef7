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

from lab import cli, tasks
from lab.cli import atomic_path
from lab.dataset import load_meta, load_split

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
    name = args.dataset
    if name is not None and (os.path.basename(name) != name or name in ("", ".", "..")):
        raise ValueError(f"--dataset={name} must be a folder name under --data_dir, as for "
                         f"train.py (use --data_dir for the folder above it)")
    specs = tasks.parse_specs(args.task)
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


# eval.py's one-line error when the runs' tokenizers differ: the rule, for whoever tries it
TOKENIZER_RULE = ("perplexities per token and per-token buckets are not comparable across "
                  "tokenizers; zero-shot task accuracy is, but evaluate each run on its own "
                  "(python lab/eval.py RUN --task=...), since every run scores the same strings "
                  "with its own tokenizer")


def tokens_of(meta, vocab_size):
    """What runs and data must share for their perplexities to be compared: the tokenizer (for a
    char tokenizer, its characters too)."""
    return meta.get("tokenizer"), vocab_size, meta.get("chars")


def describe(tokens):
    return f"tokenizer {tokens[0]} (vocab {tokens[1]})"


def same_tokenizer(arms):
    """arms [(dir, model, ckpt)] -> the tokenizer they share (tokens_of). Runs trained on different
    datasets are compared (a model and its fine-tuned version); runs of different tokenizers are
    refused (TOKENIZER_RULE)."""
    first_dir, first_model, first_ckpt = arms[0]
    want = tokens_of(first_ckpt["meta"], first_model.config.vocab_size)
    for d, model, ckpt in arms[1:]:
        got = tokens_of(ckpt["meta"], model.config.vocab_size)
        if got[:2] == want[:2] and got != want:
            raise ValueError(f"{first_dir} and {d} both use {describe(want)}, but not the same "
                             f"characters for the same ids; {TOKENIZER_RULE}")
        if got != want:
            raise ValueError(f"{first_dir} uses {describe(want)} but {d} uses {describe(got)}; "
                             f"{TOKENIZER_RULE}")
    return want


def scored_dataset(arms, name=None):
    """The dataset whose validation split every run is scored on: name (--dataset), else the first
    run's."""
    if name is not None:
        return name
    first_dir, _, first_ckpt = arms[0]
    name = first_ckpt["meta"].get("dataset")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{first_dir}: its dataset name {name!r} is not a folder name; the "
                         f"checkpoint was edited or damaged (or name the dataset to score with "
                         f"--dataset)")
    return name


def scored_on(arms, name=None):
    """What the runs are scored on -> (their tokenizer, the dataset): same_tokenizer and
    scored_dataset."""
    return same_tokenizer(arms), scored_dataset(arms, name)


def labels(dirs, embeddings):
    """The arm name, plus the dir name where several runs share an arm (e.g. 'lev (out-lev-s2)')."""
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    out = [f"{e} ({n})" if embeddings.count(e) > 1 else e
           for e, n in zip(embeddings, names, strict=True)]
    # two runs of one arm in dirs of the same name (a/out, b/out): the paths as given tell them
    # apart
    return [f"{e} ({d})" if out.count(lab) > 1 else lab
            for lab, e, d in zip(out, embeddings, dirs, strict=True)]


def load_data(data_root, dataset, tokens):
    """The dataset the runs are scored on -> (data_dir, meta, val split, train split), checked to be
    that dataset, of tokens, the runs' tokenizer."""
    data_dir = os.path.join(data_root, dataset)
    try:
        meta = load_meta(data_dir)
        val, train = load_split(data_dir, "val"), load_split(data_dir, "train")
    except (OSError, ValueError) as e:
        raise ValueError(f"{e} (or point --data_dir at the folder that holds dataset "
                         f"{dataset!r})") from None
    got = tokens_of(meta, meta.get("vocab_size"))
    if meta.get("dataset") != dataset:
        raise ValueError(f"{data_dir} holds dataset {meta.get('dataset')!r}, not {dataset!r}; "
                         f"prepare it again or fix --data_dir")
    if got != tokens:
        runs = ("other characters than the runs'" if got[:2] == tokens[:2]
                else f"the runs use {describe(tokens)}")
        raise ValueError(f"{data_dir} holds dataset {dataset!r} of {describe(got)}, but {runs}; "
                         f"score them on a dataset of their tokenizer (--dataset) or prepare it "
                         f"again")
    if len(val) and int(np.max(val)) >= meta["vocab_size"]:
        raise ValueError(f"{data_dir}/val.bin holds ids >= vocab_size {meta['vocab_size']}; "
                         f"prepare the dataset again")
    return data_dir, meta, val, train


def read_curve(run_dir, checkpoint_step=None):
    """run_dir/log.jsonl -> ([(training tokens, val loss), ...] sorted by tokens, or None when there
    is no log; whether it holds a record of checkpoint_step). A run stopped between evaluations
    (Ctrl-C) saved a checkpoint that its log has no record of: its last state is not in the curve.
    Records after checkpoint_step (of a run that went on, then was resumed from an earlier
    checkpoint) are left out."""
    path = os.path.join(run_dir, "log.jsonl")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is not a file; move it away (token efficiency needs train.py's "
                         f"log)")
    if not os.path.isfile(path):
        return None, False
    curve, steps = [], set()
    with open(path, encoding="utf-8", errors="replace") as f:  # as train.py's read_log reads it
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                point = (float(record["tokens"]), float(record["val_loss"]))
                if not all(math.isfinite(v) for v in point):
                    raise ValueError("not finite")
                step = record.get("step")
                if checkpoint_step is None or step is None or step <= checkpoint_step:
                    curve.append(point)
                    steps.add(step)
            # RecursionError: nested too deeply to parse; OverflowError: an int past float's range
            except (ValueError, KeyError, TypeError, RecursionError, MemoryError,
                    OverflowError) as e:
                raise ValueError(f"{path}:{n} is not a log record with 'tokens' and 'val_loss' "
                                 f"({str(e) or type(e).__name__}); fix or delete that "
                                 f"line") from None
    return sorted(curve) or None, checkpoint_step is not None and checkpoint_step in steps


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
    header = ["arm", "step", "tokens seen", "input embedding", "backbone", "head", "val loss",
              "perplexity", f"ppl vs {base['label']}"]
    rows = [[r["label"], fmt(r["step"], ","), fmt(r["tokens_seen"], ","),
             f"{r['params']['input_embedding']:,}", f"{r['params']['backbone']:,}",
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


def efficiency_runs(results, dataset):
    """The runs that token efficiency compares: those trained on the scored dataset (a log.jsonl
    curve is of its run's own val split); the first of them is the reference."""
    return [r for r in results if r["dataset"] == dataset]


def efficiency_table(results, target_loss, dataset):
    """Measurement 3: the training tokens each run of the scored dataset needed to reach the val
    loss at its checkpoint of the first of them (the baseline, unless --dataset chose another
    dataset)."""
    runs = efficiency_runs(results, dataset)
    others = [f"{r['label']} (on {r['dataset']!r})" for r in results if r["dataset"] != dataset]
    note = (f"\n\n- left out: {', '.join(others)}: trained on another dataset (a log.jsonl "
            f"curve is of its own run's val split)") if others else ""
    if not runs:
        return f"\n## Token efficiency: skipped, no run was trained on {dataset!r}" + note
    base = runs[0]
    if target_loss is None:
        who = "the baseline " if base is results[0] else ""
        why = ("has no log.jsonl" if base["curve"] is None else
               f"has no log.jsonl record of its checkpoint (step {fmt(base['step'], ',')}): it "
               f"stopped between evaluations, so its final loss is not on its curve (resume it "
               f"to its next evaluation)")
        return f"\n## Token efficiency: skipped, {who}{base['label']} {why}" + note
    rows = []
    for r in runs:
        e = r["token_efficiency"]
        reach = e["tokens_to_reach"]
        if r["curve"] is None:
            cells = ["no log.jsonl", "-"]
        elif not r["curve_at_checkpoint"] and reach is None:
            cells = ["not within its log (it ends before the checkpoint)", "-"]
        elif reach is None:
            cells = ["never reached", "-"]
        else:
            cells = [f"{reach:,.0f}", f"{e['fewer_tokens']:.2f}x" if e["fewer_tokens"] else "-"]
        rows.append([r["label"], fmt(e["final_val_loss"]), *cells])
    header = ["arm", "val loss at its checkpoint (log)", "tokens to reach",
              f"fewer tokens than {base['label']}"]
    return (f"\n## Token efficiency: training tokens to first reach {base['label']}'s val loss at "
            f"its checkpoint, {target_loss:.4f} (log.jsonl, interpolated between evaluations)\n\n"
            + table(header, rows) + note)


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


def scored_line(results, data_dir, dataset):
    """The report's first line: the dataset every run was scored on, and the runs trained on
    another."""
    others = [f"{r['label']} on {r['dataset']!r}" for r in results if r["dataset"] != dataset]
    trained = (f"runs trained on another dataset (same tokenizer): {', '.join(others)}" if others
               else "every run was trained on it")
    return (f"Scored on dataset {dataset!r} ({data_dir}: its val split, and its train split's "
            f"counts for the frequency buckets); {trained}.\n")


def unequal_training_line(results):
    """One line when the runs trained on different numbers of tokens (their losses then compare
    more than the arms), else None."""
    if len({r["tokens_seen"] for r in results}) < 2:
        return None
    seen = ", ".join(f"{r['label']} {fmt(r['tokens_seen'], ',')} (step {fmt(r['step'], ',')})"
                     for r in results)
    return (f"Note: the runs trained on different numbers of tokens: {seen}; the loss differences "
            f"below are not the arms' alone.\n")


def report(results, target_loss, data_dir, dataset):
    """All tables as one markdown string."""
    out = [scored_line(results, data_dir, dataset), unequal_training_line(results),
           loss_table(results, data_dir),
           bucket_table(results), efficiency_table(results, target_loss, dataset)]
    if results[0]["lambada"] is not None:
        out.append(lambada_table(results))
    return "\n".join(line for line in out if line is not None)


# --------------------------------------------------------------------------------------------------
# Figure and files


def plot(results, target_loss, path, dataset):
    """Two panels: val loss against training tokens (from log.jsonl, for the runs of the scored
    dataset) and per-bucket perplexity bars."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    runs = efficiency_runs(results, dataset)
    for r in runs:
        if r["curve"]:
            tokens, loss = zip(*r["curve"], strict=True)
            curves.plot(tokens, loss, marker=".", label=r["label"])
    if target_loss is not None:
        curves.axhline(target_loss, color="gray", linestyle="--", linewidth=1,
                       label=f"{runs[0]['label']} final ({target_loss:.3f})")
    curves.set(xlabel="training tokens", ylabel="val loss", title="validation loss during training")
    if any(r["curve"] for r in runs):
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


def write_outputs(results, target_loss, data, task_sets, json_path, plot_path):
    """The tables on stdout; the JSON file (json_path) and the figures (plot_path) where asked
    for. data: (data_dir, dataset, tokenizer) of the scored dataset."""
    data_dir, dataset, tokenizer = data
    print(report(results, target_loss, data_dir, dataset))
    for r in results:
        if r["origin"]:
            print(f"\n{r['label']} was fine-tuned from {r['origin']['checkpoint']} (step "
                  f"{r['origin']['step']}, dataset {r['origin']['dataset']})")
    task_results = [(r["label"], r["tasks"]) for r in results]
    if task_sets:
        print("\n" + tasks.report(task_sets, task_results))
    if json_path:
        runs = efficiency_runs(results, dataset)
        write_json({"data_dir": data_dir, "dataset": dataset, "tokenizer": tokenizer,
                    "buckets": [s["bucket"] for s in results[0]["buckets"]],
                    "baseline": results[0]["label"], "baseline_final_val_loss": target_loss,
                    "token_efficiency_reference": runs[0]["label"] if runs else None,
                    "tasks": tasks.summary(task_sets), "arms": results}, json_path)
        print(f"\nwrote {json_path}")
    if plot_path:
        plot(results, target_loss, plot_path, dataset)
        print(f"wrote {plot_path}")
        if task_sets:  # a figure of its own, beside the first: FILE_tasks.png
            task_plot = "{}_tasks{}".format(*os.path.splitext(plot_path))
            tasks.plot(task_sets, task_results, task_plot)
            print(f"wrote {task_plot}")
