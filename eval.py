"""
Compare trained checkpoints the way the paper does: Leviathan against the tied baseline, same backbone.

    python eval.py out-tied out-lev [out-untied ...] [--plot=compare.png] [--json=compare.json]

The first DIR is the baseline every other arm is compared with. Four measurements (five with --task), one table
each:

  1. Validation loss and perplexity on the *whole* validation split: non-overlapping windows of block_size
     (prepare_data.eval_windows, no subsampling), every target scored once, in fp32, so the numbers are
     deterministic; train.py with eval_iters=0 scores the same windows.
  2. The same, stratified by how often each target id occurs in the training split (unseen, 1-10, 11-100,
     101-1k, 1k-10k, >10k): the paper's gains concentrate on rare tokens.
  3. Token efficiency, from each run's log.jsonl: the training tokens each arm needed to first reach the
     baseline's final logged val loss, linearly interpolated between the two evaluations around the crossing
     ("never reached" if it did not), and the ratio of the baseline's tokens to reach it (same rule) to the
     arm's (the paper's "2.1x fewer tokens").
  4. LAMBADA-style last-word prediction on the validation text (the exact rule is at the end of --help).
  5. With --task=NAME:PATH (repeatable): zero-shot tasks from local files (LAMBADA, HellaSwag, PIQA, ARC,
     WinoGrande, or your own multiple choice), scored as lm-evaluation-harness does, in one table with n
     and 95% intervals (tasks.py; the formats are at the end of --help).

All checkpoints must come from one dataset and tokenizer; it is read from DATA_DIR/<dataset>, with --data_dir
(default: data, relative to the working directory) meaning what it means to train.py.
"""

import argparse
import json
import math
import os
import re
import sys

import numpy as np
import torch

import common
import tasks
from common import atomic_path, load_checkpoint
from prepare_data import eval_windows, get_tokenizer, load_meta, load_split

# a target falls in bucket i when its id's training count is in [lower[i], lower[i + 1])
BUCKETS = ("unseen", "1-10", "11-100", "101-1k", "1k-10k", ">10k")
BUCKET_LOWER = (0, 1, 11, 101, 1001, 10001)

LAMBADA_RULE = """\
LAMBADA-style task: the validation split is decoded with the checkpoints' tokenizer and cut into passages at
blank lines (and at <|endoftext|>, GPT-2's document separator). A passage qualifies when, after stripping
whitespace, it ends in a word of ASCII letters that follows whitespace, optionally followed by punctuation only
(so "speak." and "speak!'" qualify; "I'll." and "1623." do not). The task: given the passage before that
word, predict the word. Its tokens are those of the passage that follow the context's tokens; the context
keeps the whitespace before the word when the tokenizer encodes it apart (characters), and drops it when the
tokenizer merges it into the word (GPT-2 BPE: " speak"). The context is cut from the left to at most
block_size - (word tokens). At most --lambada_max passages are used, evenly spaced over the split. A passage
counts as correct when greedy decoding reproduces the word: with the true tokens fed in (teacher forcing),
every word token is the model's argmax. Word perplexity is exp(mean loss over all final-word tokens)."""


def fail(msg):
    """Bad input: one clear line on stderr and exit code 2, never a traceback."""
    common.fail("eval.py", msg)


def resolve_device(name):
    """common.resolve_device, a missing device reported as bad input."""
    try:
        return common.resolve_device(name)
    except ValueError as err:
        fail(str(err))


# ----------------------------------------------------------------------------------------------------------
# 1. Whole-split evaluation, per token


@torch.no_grad()
def evaluate_tokens(model, tokens, batch_size, device):
    """Score every target of the split once: tokens (1-D array) -> (losses, targets), both flat numpy arrays.

    Windows are prepare_data.eval_windows(len(tokens), block_size) with no maximum: inputs tokens[s:s+T],
    targets tokens[s+1:s+T+1]. Per-token losses are the model's own (GPT.forward, reduction="none": the
    cross-entropy of fp32 logits)."""
    T = model.config.block_size
    starts = eval_windows(len(tokens), T)  # raises a clear ValueError when the split is too short
    offsets = np.arange(T + 1)
    losses, targets = [], []
    for i in range(0, len(starts), batch_size):
        window = np.asarray(tokens[starts[i:i + batch_size, None] + offsets], dtype=np.int64)  # (B, T + 1)
        x = torch.from_numpy(window[:, :-1]).to(device)
        y = torch.from_numpy(window[:, 1:]).to(device)
        _, loss = model(x, y, reduction="none")  # (B, T)
        losses.append(loss.flatten().cpu().numpy())
        targets.append(window[:, 1:].reshape(-1))
    return np.concatenate(losses), np.concatenate(targets)


def train_counts(train_tokens, vocab_size, chunk=1 << 24):
    """How often each id occurs in the training split: (vocab_size,) int64, counted a chunk at a time so that
    a split of billions of tokens never has to fit in memory."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(0, len(train_tokens), chunk):
        counts += np.bincount(np.asarray(train_tokens[i:i + chunk]), minlength=vocab_size)[:vocab_size]
    return counts


def bucket_stats(losses, targets, counts):
    """Group per-token losses by the training count of their target id (BUCKETS).

    losses, targets: flat arrays of equal length; counts: (V,) training counts per id. Returns one dict per
    bucket: {"bucket", "tokens", "share" (of all targets), "loss", "ppl"}; loss and ppl are None when empty."""
    which = np.searchsorted(BUCKET_LOWER, counts[targets], side="right") - 1  # bucket index of each target
    stats = []
    for b, name in enumerate(BUCKETS):
        mask = which == b
        n = int(mask.sum())
        loss = float(np.mean(losses[mask], dtype=np.float64)) if n else None
        stats.append({"bucket": name, "tokens": n, "share": n / len(targets), "loss": loss,
                      "ppl": math.exp(loss) if n else None})
    return stats


# ----------------------------------------------------------------------------------------------------------
# 2. Token efficiency, from log.jsonl


def read_curve(run_dir):
    """run_dir/log.jsonl -> [(training tokens, val loss), ...] sorted by tokens, or None when there is no log."""
    path = os.path.join(run_dir, "log.jsonl")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{path} is not a file; move it away (token efficiency needs train.py's log)")
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
                raise ValueError(f"{path}:{n} is not a log record with 'tokens' and 'val_loss' ({e}); "
                                 f"fix or delete that line") from None
    return sorted(curve) or None


def tokens_to_reach(curve, target_loss):
    """The training tokens at which val loss first reaches target_loss (loss <= target), or None if never.

    curve: [(tokens, val_loss), ...] in training order. When the crossing happens between two evaluations,
    the tokens are linearly interpolated between them (loss is assumed to fall linearly in between)."""
    previous = None
    for tokens, loss in curve:
        if loss <= target_loss:
            if previous is None:
                return tokens
            t0, l0 = previous  # l0 > target_loss >= loss
            return t0 + (tokens - t0) * (l0 - target_loss) / (l0 - loss)
        previous = (tokens, loss)
    return None


def token_efficiency(curves):
    """curves: one per arm, baseline first (None where an arm has no log) -> (target loss, rows), where each
    row is {"final_val_loss", "tokens_to_reach", "fewer_tokens"} (None where unknown or never reached) and
    fewer_tokens = baseline's tokens to reach its own final loss / the arm's. (None, None) without a baseline
    log."""
    if curves[0] is None:
        return None, None
    target = curves[0][-1][1]
    base_tokens = tokens_to_reach(curves[0], target)
    rows = []
    for curve in curves:
        reach = tokens_to_reach(curve, target) if curve else None
        rows.append({"final_val_loss": curve[-1][1] if curve else None, "tokens_to_reach": reach,
                     "fewer_tokens": base_tokens / reach if reach else None})
    return target, rows


# ----------------------------------------------------------------------------------------------------------
# 3. LAMBADA-style last-word prediction (rule: LAMBADA_RULE)

FINAL_WORD = re.compile(r"\s([A-Za-z]+)[^\w\s]*\Z")


def word_tokens(tokenizer, context, word):
    """(context ids, word ids) such that context ids + word ids are the tokens of context + word; the
    whitespace before the word moves into the word when the tokenizer merges the two. None if neither split
    is a prefix of the passage's tokens."""
    full = tokenizer.encode(context + word)
    for ctx in (context, context[:-1]):  # context ends in one whitespace character, by FINAL_WORD
        ctx_ids = tokenizer.encode(ctx)
        if ctx_ids and full[:len(ctx_ids)] == ctx_ids and len(full) > len(ctx_ids):
            return ctx_ids, full[len(ctx_ids):]
    return None


def lambada_passages(text, tokenizer, max_passages):
    """text -> up to max_passages (context ids, word ids, word), evenly spaced over the qualifying passages
    (LAMBADA_RULE). Deterministic: the same text always gives the same passages."""
    found = []
    for passage in re.split(r"\n\s*\n|<\|endoftext\|>", text):  # blank lines, GPT-2 document separators
        m = FINAL_WORD.search(passage.strip())
        if m:
            found.append((passage.strip()[:m.start(1)], m.group(1)))
    if len(found) > max_passages:
        found = [found[i * len(found) // max_passages] for i in range(max_passages)]
    passages = []
    for context, word in found:
        split = word_tokens(tokenizer, context, word)
        if split is not None:
            passages.append((*split, word))
    return passages


@torch.no_grad()
def lambada_eval(model, passages, batch_size, device):
    """Teacher-forced greedy last-word prediction -> {"passages", "accuracy", "word_ppl", "word_loss"}.

    Each passage becomes one row: context (cut from the left to block_size - word tokens) + word, the inputs
    right-padded (causal attention: padding after a position cannot change it), targets -1 except at the
    word's tokens; rows are batched by length. Passages whose word alone fills block_size are skipped."""
    T = model.config.block_size
    rows = [(ctx[max(0, len(ctx) - (T - len(w))):], w) for ctx, w, _ in passages if len(w) < T]
    rows.sort(key=lambda row: len(row[0]) + len(row[1]))  # similar lengths share a batch: less padding
    correct, loss_sum, n_word_tokens = 0, 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        width = max(len(c) + len(w) - 1 for c, w in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        y = torch.full((len(batch), width), -1, dtype=torch.long)
        for r, (c, w) in enumerate(batch):
            seq = c + w
            x[r, :len(seq) - 1] = torch.tensor(seq[:-1])
            y[r, len(c) - 1:len(seq) - 1] = torch.tensor(w)  # the word's tokens, predicted from c and w[:j]
        x, y = x.to(device), y.to(device)
        logits, loss = model(x, y, reduction="none")  # loss 0 where y = -1
        is_word = y >= 0
        hit = (logits.argmax(-1) == y) | ~is_word
        correct += int(hit.all(dim=1).sum())
        loss_sum += float(loss.sum())
        n_word_tokens += int(is_word.sum())
    if not rows:
        return {"passages": 0, "accuracy": None, "word_loss": None, "word_ppl": None}
    word_loss = loss_sum / n_word_tokens
    return {"passages": len(rows), "accuracy": correct / len(rows), "word_loss": word_loss,
            "word_ppl": math.exp(word_loss)}


# ----------------------------------------------------------------------------------------------------------
# 4. Output: tables, figure, json


def fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def rel(x, base):
    """Relative difference of x against base, as a signed percentage."""
    return "-" if x is None or base is None else f"{100 * (x / base - 1):+.1f}%"


def table(header, rows):
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def report(results, target_loss, data_dir):
    """All tables as one markdown string."""
    base = results[0]
    scored = " / ".join(sorted({f"{r['val_targets']:,}" for r in results}))
    out = [f"## Validation loss: whole split of {data_dir} ({scored} targets scored per arm)\n"]
    out.append(table(
        ["arm", "input embedding", "backbone", "head", "val loss", "perplexity", f"ppl vs {base['label']}"],
        [[r["label"], f"{r['params']['input_embedding']:,}", f"{r['params']['backbone']:,}",
          f"{r['params']['head']:,}", fmt(r["val_loss"]), fmt(r["val_ppl"], ".3f"),
          "(baseline)" if r is base else rel(r["val_ppl"], base["val_ppl"])] for r in results]))

    out.append("\n## Perplexity by how often the target token occurs in the training split\n")
    header = ["train count", "val tokens", "share"]
    for r in results:
        header += [f"{r['label']} loss", f"{r['label']} ppl"]
    header += [f"{r['label']} ppl vs {base['label']}" for r in results[1:]]
    rows = []
    for b, name in enumerate(BUCKETS):
        row = [name, f"{base['buckets'][b]['tokens']:,}", f"{100 * base['buckets'][b]['share']:.1f}%"]
        for r in results:
            row += [fmt(r["buckets"][b]["loss"]), fmt(r["buckets"][b]["ppl"], ".3f")]
        row += [rel(r["buckets"][b]["ppl"], base["buckets"][b]["ppl"]) for r in results[1:]]
        rows.append(row)
    out.append(table(header, rows))

    if target_loss is None:
        out.append(f"\n## Token efficiency: skipped, the baseline {base['label']} has no log.jsonl")
    else:
        out.append(f"\n## Token efficiency: training tokens to first reach {base['label']}'s final val loss "
                   f"{target_loss:.4f} (log.jsonl, interpolated between evaluations)\n")
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
        out.append(table(["arm", "final val loss (log)", "tokens to reach", f"fewer tokens than {base['label']}"],
                         rows))

    lam = [r["lambada"] for r in results]
    if lam[0] is not None:
        out.append("\n## Last-word prediction (LAMBADA-style, greedy, on the validation text)\n")
        out.append(table(["arm", "passages", "accuracy", "word perplexity", f"word ppl vs {base['label']}"],
                         [[r["label"], r["lambada"]["passages"], fmt(r["lambada"]["accuracy"], ".3f"),
                           fmt(r["lambada"]["word_ppl"], ".3f"),
                           "(baseline)" if r is base else rel(r["lambada"]["word_ppl"], base["lambada"]["word_ppl"])]
                          for r in results]))
    return "\n".join(out)


def plot(results, target_loss, path):
    """Two panels: val loss against training tokens (from log.jsonl) and per-bucket perplexity bars."""
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

    present = [b for b, s in enumerate(results[0]["buckets"]) if s["tokens"]]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ppl = [r["buckets"][b]["ppl"] or float("nan") for b in present]  # nan: no bar
        bars.bar(np.arange(len(present)) + (i - (len(results) - 1) / 2) * width, ppl, width, label=r["label"])
    bars.set_xticks(range(len(present)),
                    [f"{BUCKETS[b]}\n{100 * results[0]['buckets'][b]['share']:.1f}%" for b in present])
    bars.set_yscale("log")  # rare-token perplexities are orders of magnitude above frequent ones
    bars.set(xlabel="training count of the target (share of val tokens)", ylabel="perplexity",
             title="validation perplexity by token frequency")
    bars.legend(fontsize="small")
    fig.tight_layout()
    common.save_figure(fig, path)


def write_json(obj, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=1)


# ----------------------------------------------------------------------------------------------------------
# main


def identity(meta, vocab_size):
    """What must agree between checkpoints and data: dataset, tokenizer, vocabulary."""
    return meta.get("dataset"), meta.get("tokenizer"), vocab_size, meta.get("chars")


def labels(dirs, embeddings):
    """The arm name, plus the dir name where several runs share an arm (e.g. 'lev (out-lev-s2)')."""
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    out = [f"{e} ({n})" if embeddings.count(e) > 1 else e for e, n in zip(embeddings, names, strict=True)]
    # two runs of one arm in dirs of the same name (a/out, b/out): the path as given is what tells them apart
    return [f"{e} ({d})" if out.count(lab) > 1 else lab for lab, e, d in zip(out, embeddings, dirs, strict=True)]


def parse_args(argv):
    p = common.ArgumentParser(prog="eval.py", description=__doc__.strip(),
                              epilog=LAMBADA_RULE + "\n\n" + tasks.TASK_FORMATS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", metavar="DIR", help="checkpoint dirs (ckpt.pt, and log.jsonl for token "
                   "efficiency); the first is the baseline")
    p.add_argument("--data_dir", default="data", help="folder that holds the prepared datasets, as for train.py; "
                   "the dataset read is DATA_DIR/<dataset of the checkpoints> (default: data)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"),
                   help="auto: cuda if available, else mps, else cpu (default: auto)")
    p.add_argument("--batch_size", type=int, default=16, help="windows (or last-word passages) per forward "
                   "pass; lower it if memory is short: logits take batch_size * block_size * vocab_size floats "
                   "(default: 16)")
    p.add_argument("--lambada_max", type=int, default=500, help="at most this many last-word passages (default: "
                   "500); 0 skips the task")
    p.add_argument("--task", action="append", default=[], metavar="NAME:PATH", help="a zero-shot task to "
                   f"score every run on, from a local file; NAME: {', '.join(tasks.TASKS)} (repeatable)")
    p.add_argument("--task_max", type=int, default=0, help="at most this many examples per task, evenly spaced "
                   "(default: 0, all)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write val-loss curves and per-bucket "
                   "perplexity bars (needs matplotlib)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        fail(f"--batch_size={args.batch_size} must be at least 1")
    if args.lambada_max < 0:
        fail(f"--lambada_max={args.lambada_max} must be >= 0 (0 skips the last-word task)")
    if args.task_max < 0:
        fail(f"--task_max={args.task_max} must be >= 0 (0: every example)")
    try:
        args.task = [tasks.parse_spec(spec) for spec in args.task]
    except ValueError as e:
        fail(str(e))
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib, which is not installed: pip install matplotlib (or drop --plot)")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:  # refused now, not after the whole evaluation
            try:
                common.check_output_file(path, flag)
            except ValueError as e:
                fail(str(e))
    return args


def load_runs(dirs, device):
    """Every checkpoint, loaded first so that a mismatch is refused before any time is spent evaluating ->
    (arms [(dir, model, ckpt)], identity of their data)."""
    arms = []
    for d in dirs:
        try:
            model, ckpt = load_checkpoint(d, device)
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        ckpt.pop("optimizer", None)  # the largest part, unused here
        arms.append((d, model, ckpt))
    first_dir, first_model, first_ckpt = arms[0]
    want = identity(first_ckpt["meta"], first_model.config.vocab_size)
    for d, model, ckpt in arms[1:]:
        got = identity(ckpt["meta"], model.config.vocab_size)
        if got != want:
            fail(f"{first_dir} was trained on dataset {want[0]!r} (tokenizer {want[1]}, vocab {want[2]}) but {d} "
                 f"on {got[0]!r} (tokenizer {got[1]}, vocab {got[2]}); compare checkpoints of one dataset and "
                 f"tokenizer only")
    if not isinstance(want[0], str) or not want[0]:
        fail(f"{first_dir}: its dataset name {want[0]!r} is not a folder name; the checkpoint was edited or damaged")
    return arms, want


def load_data(data_root, want):
    """The dataset the runs were trained on -> (data_dir, meta, val split, train split), checked against them."""
    data_dir = os.path.join(data_root, want[0])
    try:
        meta = load_meta(data_dir)
        val, train = load_split(data_dir, "val"), load_split(data_dir, "train")
    except (OSError, ValueError) as e:
        fail(f"{e} (or point --data_dir at the folder that holds dataset {want[0]!r})")
    got = identity(meta, meta.get("vocab_size"))
    if got != want:
        fail(f"{data_dir} holds dataset {got[0]!r} (tokenizer {got[1]}, vocab {got[2]}) but the checkpoints were "
             f"trained on {want[0]!r} (tokenizer {want[1]}, vocab {want[2]}); prepare it again or fix --data_dir")
    if len(val) and int(np.max(val)) >= meta["vocab_size"]:
        fail(f"{data_dir}/val.bin holds ids >= vocab_size {meta['vocab_size']}; prepare the dataset again")
    return data_dir, meta, val, train


def load_text_tasks(args, meta, data_dir, val, arms):
    """The last-word passages of the val text and the --task files, read before any arm is evaluated, so that a
    bad file costs no time -> (passages, task_sets)."""
    passages, task_sets = [], []
    if not (args.lambada_max or args.task):
        return passages, task_sets
    try:
        tokenizer = get_tokenizer(meta)
    except Exception as e:  # a tiktoken file that cannot be fetched offline, an unknown encoding, ...
        fail(f"cannot build the tokenizer {meta.get('tokenizer')!r} of {data_dir} for the last-word task "
             f"and --task ({type(e).__name__}: {e}); or skip them with --lambada_max=0 and no --task")
    if args.lambada_max:
        passages = lambada_passages(tokenizer.decode(np.asarray(val).tolist()), tokenizer, args.lambada_max)
    try:
        task_sets = tasks.load_tasks(args.task, tokenizer, args.task_max,
                                     min(model.config.block_size for _, model, _ in arms)) if args.task else []
    except ValueError as e:
        fail(str(e))
    return passages, task_sets


def evaluate_run(d, model, ckpt, label, val, counts, passages, task_sets, args, device):
    """Every measurement of one run, as one result dict (token efficiency and the curve are added by main)."""
    try:
        losses, targets = evaluate_tokens(model, val, args.batch_size, device)
    except ValueError as e:
        fail(str(e))
    val_loss = float(np.mean(losses, dtype=np.float64))
    if not math.isfinite(val_loss):
        fail(f"{d} gives a val loss of {val_loss} (its weights overflow on this data); use an earlier checkpoint")
    print(f"evaluated {d}: val loss {val_loss:.4f}", file=sys.stderr)  # progress, while the tables wait
    return {"label": label, "dir": d, "embedding": ckpt["model_config"]["embedding"],
            "model_config": ckpt["model_config"], "step": ckpt.get("step"), "tokens_seen": ckpt.get("tokens_seen"),
            "params": model.param_report(), "val_targets": len(targets), "val_loss": val_loss,
            "val_ppl": math.exp(val_loss), "buckets": bucket_stats(losses, targets, counts),
            "lambada": lambada_eval(model, passages, args.batch_size, device) if args.lambada_max else None,
            "origin": ckpt.get("origin"), "tasks": tasks.score_tasks(model, task_sets, args.batch_size, device)}


def write_outputs(args, results, target_loss, data_dir, want, task_sets):
    """The tables on stdout; --json and --plot."""
    print(report(results, target_loss, data_dir))
    for r in results:
        if r["origin"]:
            print(f"\n{r['label']} was fine-tuned from {r['origin']['checkpoint']} (step {r['origin']['step']}, "
                  f"dataset {r['origin']['dataset']})")
    if task_sets:
        print("\n" + tasks.report(task_sets, [(r["label"], r["tasks"]) for r in results]))
    if args.json:
        write_json({"data_dir": data_dir, "dataset": want[0], "tokenizer": want[1], "buckets": list(BUCKETS),
                    "baseline": results[0]["label"], "baseline_final_val_loss": target_loss,
                    "tasks": tasks.summary(task_sets), "arms": results}, args.json)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(results, target_loss, args.plot)
        print(f"wrote {args.plot}")
        if task_sets:  # a figure of its own, beside the first: FILE_tasks.png
            task_plot = "{}_tasks{}".format(*os.path.splitext(args.plot))
            tasks.plot(task_sets, [(r["label"], r["tasks"]) for r in results], task_plot)
            print(f"wrote {task_plot}")


def main(argv=None):
    args = parse_args(argv)
    device = resolve_device(args.device)
    arms, want = load_runs(args.dirs, device)
    data_dir, meta, val, train = load_data(args.data_dir, want)
    counts = train_counts(train, meta["vocab_size"])
    passages, task_sets = load_text_tasks(args, meta, data_dir, val, arms)
    curves = []
    for d, _, _ in arms:
        try:
            curves.append(read_curve(d))
        except ValueError as e:
            fail(str(e))
    target_loss, efficiency = token_efficiency(curves)
    names = labels(args.dirs, [ckpt["model_config"]["embedding"] for _, _, ckpt in arms])
    results = []
    for i, (d, model, ckpt) in enumerate(arms):
        result = evaluate_run(d, model, ckpt, names[i], val, counts, passages, task_sets, args, device)
        result["token_efficiency"] = efficiency[i] if efficiency else {"final_val_loss": None,
                                                                      "tokens_to_reach": None, "fewer_tokens": None}
        result["curve"] = curves[i]
        results.append(result)
    write_outputs(args, results, target_loss, data_dir, want, task_sets)


if __name__ == "__main__":
    main()
