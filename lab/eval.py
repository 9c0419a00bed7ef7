"""
Compare trained checkpoints the way the paper does: Leviathan against the tied baseline, same
backbone.

    python lab/eval.py out-tied out-lev [out-untied ...] [--plot=compare.png] [--json=compare.json]

The first DIR is the baseline every other arm is compared with. Four measurements (five with
--task), one table each:

  1. Validation loss and perplexity on the *whole* validation split: non-overlapping windows of
     block_size (train.py's eval_windows, no subsampling), every target scored once, in
     fp32, so the numbers are deterministic; train.py with eval_iters=0 scores the same windows.
  2. The same, stratified by how often each target id occurs in the training split (unseen, 1-10,
     11-100, 101-1k, 1k-10k, >10k): the paper's gains concentrate on rare tokens.
  3. Token efficiency, from each run's log.jsonl: the training tokens each arm needed to first reach
     the baseline's final logged val loss, linearly interpolated between the two evaluations around
     the crossing ("never reached" if it did not), and the ratio of the baseline's tokens to reach
     it (same rule) to the arm's (the paper's "2.1x fewer tokens").
  4. LAMBADA-style last-word prediction on the validation text (the exact rule is at the end of
     --help).
  5. With --task=NAME:PATH (repeatable): zero-shot tasks from local files (LAMBADA, HellaSwag, PIQA,
     ARC, WinoGrande, or your own multiple choice), scored as lm-evaluation-harness does, in one
     table with n and 95% intervals (lab/tasks.py; the formats are at the end of --help).

All checkpoints must share one tokenizer (docs/evaluation.md says why). They may come from
different datasets (a model and its fine-tuned version): every run is scored on one dataset,
DATA_DIR/<dataset> (the first run's, or --dataset=NAME), with --data_dir (default: data, relative
to the working directory) meaning what it means to train.py; token efficiency compares the runs of
that dataset only, since each log.jsonl is of its own run's val split.
"""
# lab/evaluation.py writes the tables, the figure and the JSON file.

import argparse
import math
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from kernels.compiled_lev import CompiledRecipe
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from lab import cli, devices, tasks
from lab.checkpoints import load_checkpoint
from lab.dataset import BUCKET_LOWER, BUCKETS, get_tokenizer, train_counts
from lab.evaluation import check_args, labels, load_data, read_curve, scored_on, write_outputs
from train import eval_windows  # the windows train.py's val loss scores

LAMBADA_RULE = """\
LAMBADA-style task: the validation split is decoded with the checkpoints' tokenizer and cut into
passages at blank lines (and at <|endoftext|>, GPT-2's document separator). A passage qualifies
when, after stripping whitespace, it ends in a word of ASCII letters that follows whitespace,
optionally followed by punctuation only (so "speak." and "speak!'" qualify; "I'll." and "1623." do
not). The task: given the passage before that word, predict the word. Its tokens are those of the
passage that follow the context's tokens; the context keeps the whitespace before the word when the
tokenizer encodes it apart (characters), and drops it when the tokenizer merges it into the word
(GPT-2 BPE: " speak"). The context is cut from the left to at most block_size - (word tokens). At
most --lambada_max passages are used, evenly spaced over the split. A passage counts as correct when
greedy decoding reproduces the word: with the true tokens fed in (teacher forcing), every word token
is the model's argmax. Word perplexity is exp(mean loss over all final-word tokens)."""


def fail(msg):
    """Bad input: one clear line on stderr and exit code 2, never a traceback."""
    cli.fail("eval.py", msg)


def resolve_device(name):
    """devices.resolve_device, a missing device reported as bad input."""
    try:
        return devices.resolve_device(name)
    except ValueError as err:
        fail(str(err))


# --------------------------------------------------------------------------------------------------
# 1. Whole-split evaluation, per token


@torch.no_grad()
def evaluate_tokens(model, tokens, batch_size, device):
    """Score every target of the split once: tokens (1-D array) -> (losses, targets), flat arrays.

    Windows are train.py's eval_windows(len(tokens), block_size) with no maximum: inputs
    tokens[s:s+T], targets tokens[s+1:s+T+1]. Per-token losses are the cross-entropy of the model's
    logits (tasks.token_losses)."""
    T = model.config.block_size
    starts = eval_windows(len(tokens), T)  # raises a clear ValueError when the split is too short
    offsets = np.arange(T + 1)
    losses, targets = [], []
    for i in range(0, len(starts), batch_size):
        window = tokens[starts[i:i + batch_size, None] + offsets]  # (B, T + 1)
        window = np.asarray(window, dtype=np.int64)
        x = torch.from_numpy(window[:, :-1]).to(device)
        y = torch.from_numpy(window[:, 1:]).to(device)
        _, loss = tasks.token_losses(model, x, y)  # (B, T)
        losses.append(loss.flatten().cpu().numpy())
        targets.append(window[:, 1:].reshape(-1))
    return np.concatenate(losses), np.concatenate(targets)


def bucket_stats(losses, targets, counts):
    """Group per-token losses by the training count of their target id (BUCKETS).

    losses, targets: flat arrays of equal length; counts: (V,) training counts per id. Returns one
    dict per bucket: {"bucket", "tokens", "share" (of all targets), "loss", "ppl"}; loss and ppl are
    None when empty."""
    # the bucket index of each target
    which = np.searchsorted(BUCKET_LOWER, counts[targets], side="right") - 1
    stats = []
    for b, name in enumerate(BUCKETS):
        mask = which == b
        n = int(mask.sum())
        loss = float(np.mean(losses[mask], dtype=np.float64)) if n else None
        stats.append({"bucket": name, "tokens": n, "share": n / len(targets), "loss": loss,
                      "ppl": math.exp(loss) if n else None})
    return stats


# --------------------------------------------------------------------------------------------------
# 2. Token efficiency, from log.jsonl (read by lab/evaluation.py's read_curve)


def tokens_to_reach(curve, target_loss):
    """The training tokens at which val loss first reaches target_loss (loss <= target), or None.

    curve: [(tokens, val_loss), ...] in training order. When the crossing happens between two
    evaluations, the tokens are linearly interpolated between them (loss is assumed to fall linearly
    in between). None if it never reaches target_loss."""
    previous = None
    for tokens, loss in curve:
        if loss <= target_loss:
            if previous is None:
                return tokens
            t0, l0 = previous  # l0 > target_loss >= loss
            return t0 + (tokens - t0) * (l0 - target_loss) / (l0 - loss)
        previous = (tokens, loss)
    return None


def token_efficiency(curves, at_checkpoint):
    """curves: one per arm, baseline first (None where an arm has no log); at_checkpoint: whether
    each ends at its checkpoint -> (target loss, rows), where each row is {"final_val_loss",
    "tokens_to_reach", "fewer_tokens"} (None where unknown or never reached) and fewer_tokens =
    baseline's tokens to reach its own final loss / the arm's. The target is the baseline's logged
    val loss at its checkpoint, the model eval.py scores: (None, None) without a baseline log, or
    when its checkpoint is not in it (a run stopped between evaluations; its last record would be
    an earlier model's loss)."""
    if curves[0] is None or not at_checkpoint[0]:
        return None, None
    target = curves[0][-1][1]
    base_tokens = tokens_to_reach(curves[0], target)
    rows = []
    for curve, complete in zip(curves, at_checkpoint, strict=True):
        reach = tokens_to_reach(curve, target) if curve else None
        final = curve[-1][1] if curve and complete else None
        rows.append({"final_val_loss": final, "tokens_to_reach": reach,
                     "fewer_tokens": base_tokens / reach if reach else None})
    return target, rows


def token_efficiency_among(curves, at_checkpoint, here):
    """token_efficiency among the runs trained on the scored dataset (here[i]): a log.jsonl curve is
    of its run's own val split, so those of other datasets are left out -> (target loss, a row per
    run: all None for the runs left out and where unknown)."""
    unknown = dict.fromkeys(("final_val_loss", "tokens_to_reach", "fewer_tokens"))
    picked = [(c, a) for c, a, h in zip(curves, at_checkpoint, here, strict=True) if h]
    target, rows = token_efficiency(*zip(*picked, strict=True)) if picked else (None, None)
    rows = iter(rows or [unknown] * len(picked))
    return target, [next(rows) if h else unknown for h in here]


# --------------------------------------------------------------------------------------------------
# 3. LAMBADA-style last-word prediction (rule: LAMBADA_RULE)

FINAL_WORD = re.compile(r"\s([A-Za-z]+)[^\w\s]*\Z")


def word_tokens(tokenizer, context, word):
    """(context ids, word ids) such that context ids + word ids are the tokens of context + word;
    the whitespace before the word moves into the word when the tokenizer merges the two. None if
    neither split is a prefix of the passage's tokens."""
    full = tokenizer.encode(context + word)
    for ctx in (context, context[:-1]):  # context ends in one whitespace character, by FINAL_WORD
        ctx_ids = tokenizer.encode(ctx)
        if ctx_ids and full[:len(ctx_ids)] == ctx_ids and len(full) > len(ctx_ids):
            return ctx_ids, full[len(ctx_ids):]
    return None


def lambada_passages(text, tokenizer, max_passages):
    """text -> up to max_passages (context ids, word ids, word), evenly spaced over the qualifying
    passages (LAMBADA_RULE). Deterministic: the same text always gives the same passages."""
    found = []
    # passages end at blank lines and at GPT-2's document separators
    for passage in re.split(r"\n\s*\n|<\|endoftext\|>", text):
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
    """Teacher-forced greedy last-word prediction -> {passages, accuracy, word_ppl, word_loss}.

    Each passage becomes one row: context (cut from the left to block_size - word tokens) + word,
    the inputs right-padded (causal attention: padding after a position cannot change it), targets
    -1 except at the word's tokens; rows are batched by length. Passages whose word alone fills
    block_size are skipped."""
    T = model.config.block_size
    rows = [(ctx[max(0, len(ctx) - (T - len(w))):], w) for ctx, w, _ in passages if len(w) < T]
    # similar lengths share a batch: less padding
    rows.sort(key=lambda row: len(row[0]) + len(row[1]))
    correct, loss_sum, n_word_tokens = 0, 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        width = max(len(c) + len(w) - 1 for c, w in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        y = torch.full((len(batch), width), -1, dtype=torch.long)
        for r, (c, w) in enumerate(batch):
            seq = c + w
            x[r, :len(seq) - 1] = torch.tensor(seq[:-1])
            # the word's tokens, token j predicted from c and w[:j]
            y[r, len(c) - 1:len(seq) - 1] = torch.tensor(w)
        x, y = x.to(device), y.to(device)
        logits, loss = tasks.token_losses(model, x, y)  # loss 0 where y = -1
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


# --------------------------------------------------------------------------------------------------
# main


def parse_args(argv):
    p = cli.ArgumentParser(prog="eval.py", description=__doc__.strip(),
                           epilog=LAMBADA_RULE + "\n\n" + tasks.TASK_FORMATS,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", metavar="DIR", help="checkpoint dirs (ckpt.pt, and log.jsonl "
                   "for token efficiency); the first is the baseline")
    p.add_argument("--data_dir", default="data", help="folder that holds the prepared datasets, as "
                   "for train.py; the dataset read is DATA_DIR/<dataset> (default: data)")
    p.add_argument("--dataset", default=None, metavar="NAME", help="the dataset every run is "
                   "scored on, a folder under --data_dir as for train.py; it must have the runs' "
                   "tokenizer (default: the first run's)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"),
                   help="auto: cuda if available, else mps, else cpu (default: auto)")
    p.add_argument("--batch_size", type=int, default=16, help="windows (or last-word passages) per "
                   "forward pass; lower it if memory is short: logits take batch_size * block_size "
                   "* vocab_size floats (default: 16)")
    p.add_argument("--lambada_max", type=int, default=500, help="at most this many last-word "
                   "passages (default: 500); 0 skips the task")
    p.add_argument("--task", action="append", default=[], metavar="NAME:PATH", help="a zero-shot "
                   f"task to score every run on, from a local file; NAME: {', '.join(tasks.TASKS)} "
                   "(repeatable)")
    p.add_argument("--task_max", type=int, default=0, help="at most this many examples per task, "
                   "evenly spaced (default: 0, all)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write val-loss curves and "
                   "per-bucket perplexity bars (needs matplotlib)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plain", action="store_true", help="run the models exactly as leviathan.py "
                   "writes them, without LEV's fast path (kernels/fast_paths.py): slower, the "
                   "same figures")
    args = p.parse_args(argv)
    try:  # the flags argparse cannot check, refused before anything is loaded
        args.task = check_args(args)
    except ValueError as e:
        fail(str(e))
    return args


def load_runs(dirs, device, plain=False, dataset=None):
    """Every checkpoint, loaded first so that a mismatch is refused before any time is spent
    evaluating -> (arms [(dir, model, ckpt)], their tokenizer, the dataset to score them on)."""
    arms = []
    for d in dirs:
        try:
            model, ckpt = load_checkpoint(d, device)
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        # eval.py's run settings: LEV's fast path, or its recipe compiled where an edit sets the
        # kernels aside (unless --plain), and the plain head
        install_fast_paths(model, lev=None if plain else [FastEmbedder(), CompiledRecipe()])
        ckpt.pop("optimizer", None)  # the largest part, unused here
        arms.append((d, model, ckpt))
    try:
        return (arms, *scored_on(arms, dataset))
    except ValueError as e:
        fail(str(e))


def load_text_tasks(args, meta, data_dir, val, arms):
    """The last-word passages of the val text and the --task files, read before any arm is
    evaluated, so that a bad file costs no time -> (passages, task_sets)."""
    passages, task_sets = [], []
    if not (args.lambada_max or args.task):
        return passages, task_sets
    try:
        tokenizer = get_tokenizer(meta)
    except Exception as e:  # a tiktoken file that cannot be fetched offline, an unknown encoding...
        fail(f"cannot build the tokenizer {meta.get('tokenizer')!r} of {data_dir} for the "
             f"last-word task and --task ({type(e).__name__}: {e}); or skip them with "
             f"--lambada_max=0 and no --task")
    if args.lambada_max:
        val_text = tokenizer.decode(np.asarray(val).tolist())
        passages = lambada_passages(val_text, tokenizer, args.lambada_max)
    block_size = min(model.config.block_size for _, model, _ in arms)  # every arm can score them
    try:
        if args.task:
            task_sets = tasks.load_tasks(args.task, tokenizer, args.task_max, block_size)
    except ValueError as e:
        fail(str(e))
    return passages, task_sets


def evaluate_run(d, model, ckpt, label, val, counts, passages, task_sets, args, device):
    """Every measurement of one run, as one result dict (main adds token efficiency, the curve)."""
    try:
        losses, targets = evaluate_tokens(model, val, args.batch_size, device)
    except ValueError as e:
        fail(str(e))
    val_loss = float(np.mean(losses, dtype=np.float64))
    if not math.isfinite(val_loss):
        fail(f"{d} gives a val loss of {val_loss} (its weights overflow on this data); use an "
             f"earlier checkpoint")
    # progress, while the tables wait
    print(f"evaluated {d}: val loss {val_loss:.4f}", file=sys.stderr)
    lambada = lambada_eval(model, passages, args.batch_size, device) if args.lambada_max else None
    return {"label": label, "dir": d, "dataset": ckpt["meta"].get("dataset"),
            "embedding": ckpt["model_config"]["embedding"],
            "model_config": ckpt["model_config"], "step": ckpt.get("step"),
            "tokens_seen": ckpt.get("tokens_seen"), "params": model.param_report(),
            "val_targets": len(targets), "val_loss": val_loss, "val_ppl": math.exp(val_loss),
            "buckets": bucket_stats(losses, targets, counts), "lambada": lambada,
            "origin": ckpt.get("origin"),
            "tasks": tasks.score_tasks(model, task_sets, args.batch_size, device)}


def main(argv=None):
    args = parse_args(argv)
    device = resolve_device(args.device)
    arms, tokens, dataset = load_runs(args.dirs, device, args.plain, args.dataset)
    try:
        data_dir, meta, val, train = load_data(args.data_dir, dataset, tokens)
    except ValueError as e:
        fail(str(e))
    counts = train_counts(train, meta["vocab_size"])
    passages, task_sets = load_text_tasks(args, meta, data_dir, val, arms)
    try:
        curves, at_checkpoint = zip(*[read_curve(d, ckpt.get("step")) for d, _, ckpt in arms],
                                    strict=True)
    except ValueError as e:
        fail(str(e))
    here = [ckpt["meta"].get("dataset") == dataset for _, _, ckpt in arms]
    target_loss, efficiency = token_efficiency_among(curves, at_checkpoint, here)
    names = labels(args.dirs, [ckpt["model_config"]["embedding"] for _, _, ckpt in arms])
    results = []
    for i, (d, model, ckpt) in enumerate(arms):
        result = evaluate_run(d, model, ckpt, names[i], val, counts, passages, task_sets, args,
                              device)
        result["token_efficiency"] = efficiency[i]
        result["curve"], result["curve_at_checkpoint"] = curves[i], at_checkpoint[i]
        results.append(result)
    write_outputs(results, target_loss, (data_dir, dataset, tokens[0]), task_sets, args.json,
                  args.plot)


if __name__ == "__main__":
    main()
