r"""Zero-shot tasks for eval.py --task: local files, scored as lm-evaluation-harness (v0.4) does.

    python eval.py out-tied out-lev --task=lambada:lambada_test.jsonl \
        --task=hellaswag:hellaswag_val.jsonl

Each task is read from a local file in the format it is published in (TASK_FORMATS). An example is a
list of (context, continuation) strings and the index of the right one; LAMBADA has one pair, its
last word. Scoring, as the harness does it:

  - loglikelihood of a pair: the sum over the continuation's tokens of log p(token | everything
    before it), from fp32 logits;
  - multiple choice: acc = the choice of highest loglikelihood is the labelled one; acc_norm = the
    same with each loglikelihood divided by its choice's length in characters (the harness's
    len(choice) on the choice text, without the space put in front of it), which removes the bias
    towards short choices;
  - LAMBADA: acc = greedy decoding reproduces the word (with teacher forcing, every word token is
    the argmax), ppl = exp(-mean over examples of the word's loglikelihood) (the harness's
    "perplexity": per word, not per token);
  - each accuracy comes with n and a 95% interval, +-1.96 * sqrt(p(1 - p) / n), so that a difference
    smaller than the intervals is not read as a win.

Token boundary (the harness's _encode_pair): whitespace at the end of the context moves to the front
of the continuation; then context ids = encode(context) and continuation ids = encode(context +
continuation) minus that many leading ids. So context ids + continuation ids are exactly the tokens
of the whole text, and with GPT-2 BPE the word " Paris" stays one token instead of " " + "Paris".
The model is fed the last block_size + 1 tokens of context + continuation (the context cut from the
left, the continuation always whole), the same way for every arm; an example whose continuation
alone does not fit the smallest block_size of the arms is skipped for all arms, and so is one the
tokenizer cannot encode (a character-level vocabulary lacks most characters of real text); the table
says how many.
"""

import json
import math
import os
import re
from collections import namedtuple

import numpy as np
import torch

from machinery import cli

# --help prints TASK_FORMATS
TASK_FORMATS = """\
task formats (--task=NAME:PATH; one JSON object per line, blank lines ignored):
  lambada     {"text": ...}; the target is the text after its last space (OpenAI's
              lambada_test.jsonl)
  hellaswag   {"activity_label", "ctx_a", "ctx_b" (or "ctx"), "endings": [4 str], "label"}; context
              "{activity_label}: {ctx_a} {ctx_b.capitalize()}", choices " {ending}", both cleaned as
              the harness does (" [title]" -> ". ", "[header]"-style tags removed, double spaces
              collapsed)
  piqa        {"goal", "sol1", "sol2"} with "label" in the line or in PATH's labels file beside it
              (valid.jsonl -> valid-labels.lst, one 0/1 per line); context
              "Question: {goal}\\nAnswer:"
  arc         AI2's {"question": {"stem", "choices": [{"text", "label"}]}, "answerKey"} (ARC-Easy
              and ARC-Challenge); context "Question: {stem}\\nAnswer:", choices " {text}"; keys
              letters or digits
  winogrande  {"sentence" with one "_", "option1", "option2", "answer": "1" | "2"}; partial
              evaluation: the context is the sentence up to "_" with an option in its place, the
              continuation the rest after "_", scored alike for both options (acc only, as in the
              harness)
  mc          your own task: {"context": str, "choices": [str, ...], "label": int}; each choice is
              the continuation as written (put the space in front of it, or at the end of the
              context: the same tokens and scores either way)"""

TASKS = ("lambada", "hellaswag", "piqa", "arc", "winogrande", "mc")

# pairs: [(context, continuation), ...]; label: index of the right pair; lengths: the characters
# each choice counts for acc_norm (None: no acc_norm); where: "path:line", for messages
Example = namedtuple("Example", "pairs label lengths where")


class TaskError(ValueError):
    """A task file that cannot be used: the message is one line, with the file and line."""


def parse_spec(spec):
    """'NAME:PATH' -> (name, path); the path may itself contain ':'."""
    name, sep, path = spec.partition(":")
    if not sep or not path:
        raise TaskError(f"--task={spec} must be NAME:PATH, e.g. "
                        f"--task=hellaswag:hellaswag_val.jsonl")
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r} in --task={spec}; NAME is one of "
                        f"{', '.join(TASKS)}")
    return name, path


# --------------------------------------------------------------------------------------------------
# Reading: one JSON object per line, fields checked, one-line errors with the file and line


def read_jsonl(path):
    """Yield (where, record) for each non-blank line of path; TaskError if the file is missing or
    empty or a line is not a JSON object."""
    if not os.path.isfile(path):
        raise TaskError(f"{path}: no such file")
    try:
        f = open(path, "rb")  # decoded line by line, so that bad bytes are reported with their line
    except OSError as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror})") from None
    found = False
    with f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                # a byte-order mark is no error
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise TaskError(f"{where}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise TaskError(f"{where}: expected a JSON object, got {type(record).__name__}")
            found = True
            yield where, record
    if not found:
        raise TaskError(f"{path}: no examples (the file is empty)")


def field(record, key, kind, where):
    """record[key], checked to be of type kind (a type, or a tuple of types)."""
    if key not in record:
        raise TaskError(f"{where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, kind):
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TaskError(f"{where}: field {key!r} must be a {kinds}, not {type(value).__name__}")
    return value


def strings(record, key, where):
    """record[key] as a non-empty list of strings."""
    values = field(record, key, list, where)
    if not values or not all(isinstance(v, str) for v in values):
        raise TaskError(f"{where}: field {key!r} must be a non-empty list of strings")
    return values


def label_index(value, n_choices, where, key="label", first=0):
    """A label (an int, or a string of digits as some copies store it) -> 0-based index,
    range-checked. first=1 for 1-based labels (WinoGrande's answer)."""
    if value is None:
        raise TaskError(f"{where}: missing field {key!r}")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"{where}: {key} must be an integer, not {value!r}")
    if not first <= value < n_choices + first:
        raise TaskError(f"{where}: {key} {value} is out of range for {n_choices} choices "
                        f"({first}..{n_choices + first - 1})")
    return value - first


def multiple_choice(context, choices, label, where):
    """One context, one continuation per choice, " " + choice; acc_norm counts the choice's
    characters (the harness's len(choice): without the space it puts in front)."""
    return Example([(context, " " + c) for c in choices], label, [len(c) for c in choices], where)


# --------------------------------------------------------------------------------------------------
# 1. LAMBADA (OpenAI's lambada_test.jsonl)


def load_lambada(path):
    """{"text"} -> context = the text before its last space, continuation = " " + the last word (the
    harness's text.split(' ')[:-1] joined, and ' ' + text.split(' ')[-1])."""
    for where, record in read_jsonl(path):
        context, space, word = field(record, "text", str, where).rpartition(" ")
        if not space or not context or not word:
            raise TaskError(f"{where}: the text needs a context, a space and a last word after it")
        yield Example([(context, " " + word)], 0, None, where)


# --------------------------------------------------------------------------------------------------
# 2. HellaSwag (rowanz/hellaswag's hellaswag_{train,val}.jsonl)


def hellaswag_clean(text):
    """The harness's preprocess: WikiHow's bracketed artifacts out, double spaces collapsed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def load_hellaswag(path):
    for where, record in read_jsonl(path):
        if "ctx_a" in record or "ctx" not in record:
            ctx_b = field(record, "ctx_b", str, where).capitalize()
            ctx = field(record, "ctx_a", str, where) + " " + ctx_b
        else:
            ctx = field(record, "ctx", str, where)  # copies that keep only the joined context
        if "activity_label" in record:
            ctx = field(record, "activity_label", str, where) + ": " + ctx
        endings = [hellaswag_clean(e) for e in strings(record, "endings", where)]
        label = label_index(record.get("label"), len(endings), where)
        yield multiple_choice(hellaswag_clean(ctx), endings, label, where)


# --------------------------------------------------------------------------------------------------
# 3. PIQA (yonatanbisk/piqa: train.jsonl + train-labels.lst, valid.jsonl + valid-labels.lst)


def piqa_labels_path(path):
    """The labels file published beside a PIQA split: valid.jsonl -> valid-labels.lst."""
    return re.sub(r"\.jsonl?$", "", path) + "-labels.lst"


def piqa_labels(path):
    """The labels file beside path -> [(where, label)], or None if there is none."""
    lst = piqa_labels_path(path)
    if not os.path.isfile(lst):
        return None
    with open(lst, encoding="utf-8") as f:
        return [(f"{lst}:{n}", line.strip()) for n, line in enumerate(f, 1) if line.strip()]


def load_piqa(path):
    labels = piqa_labels(path)
    used = 0  # labels taken from the labels file
    for i, (where, record) in enumerate(read_jsonl(path)):
        if "label" in record:
            label_where, label = where, record["label"]
        elif labels is None:
            raise TaskError(f"{where}: no 'label' field, and no labels file "
                            f"{piqa_labels_path(path)}")
        elif i >= len(labels):
            raise TaskError(f"{where}: the labels file has only {len(labels)} labels")
        else:
            (label_where, label), used = labels[i], i + 1
        sols = [field(record, "sol1", str, where), field(record, "sol2", str, where)]
        context = f"Question: {field(record, 'goal', str, where)}\nAnswer:"
        yield multiple_choice(context, sols, label_index(label, 2, label_where), where)
    if used and len(labels) > used:
        raise TaskError(f"{labels[used][0]}: {len(labels)} labels for {used} examples in {path}")


# --------------------------------------------------------------------------------------------------
# 4. ARC-Easy / ARC-Challenge (AI2's ARC-V1-Feb2018: ARC-{Easy,Challenge}-{Train,Dev,Test}.jsonl)


def load_arc(path):
    for where, record in read_jsonl(path):
        question = field(record, "question", dict, where)
        choices = field(question, "choices", list, where)
        if not choices or not all(isinstance(c, dict) for c in choices):
            raise TaskError(f"{where}: question.choices must be a non-empty list of "
                            f"{{\"text\", \"label\"}}")
        texts = [field(c, "text", str, where) for c in choices]
        keys = [str(field(c, "label", (str, int), where)) for c in choices]  # "A".."E", or "1".."5"
        answer = str(field(record, "answerKey", (str, int), where))
        if answer not in keys:
            raise TaskError(f"{where}: answerKey {answer!r} is not one of the choice labels "
                            f"{', '.join(keys)}")
        context = f"Question: {field(question, 'stem', str, where)}\nAnswer:"
        yield multiple_choice(context, texts, keys.index(answer), where)


# --------------------------------------------------------------------------------------------------
# 5. WinoGrande (AI2's winogrande_1.1: train_{xs..xl}.jsonl, dev.jsonl)


def load_winogrande(path):
    """Partial evaluation: two contexts (the sentence up to "_", each option in its place), one
    continuation (the rest after "_"), so that both options are scored on the same tokens."""
    for where, record in read_jsonl(path):
        sentence = field(record, "sentence", str, where)
        blank = sentence.find("_")
        if blank < 0:
            raise TaskError(f"{where}: the sentence has no '_' to fill")
        rest = " " + sentence[blank + 1:].strip()
        options = [field(record, "option1", str, where), field(record, "option2", str, where)]
        answer = label_index(record.get("answer"), 2, where, key="answer", first=1)
        yield Example([(sentence[:blank] + o, rest) for o in options], answer, None, where)


# --------------------------------------------------------------------------------------------------
# 6. mc: a generic multiple-choice / cloze task, for your own data


def load_mc(path):
    for where, record in read_jsonl(path):
        choices = strings(record, "choices", where)
        label = label_index(record.get("label"), len(choices), where)
        context = field(record, "context", str, where)
        # the choice as written; acc_norm does not count leading whitespace, wherever the space
        # was put
        lengths = [len(c.lstrip()) for c in choices]
        yield Example([(context, c) for c in choices], label, lengths, where)


LOADERS = {"lambada": load_lambada, "hellaswag": load_hellaswag, "piqa": load_piqa, "arc": load_arc,
           "winogrande": load_winogrande, "mc": load_mc}


# --------------------------------------------------------------------------------------------------
# Tokens: the harness's boundary rule, the --task_max cap, what cannot be scored


def encode_pair(tokenizer, context, continuation):
    """(context, continuation) -> (context ids, continuation ids), the harness's _encode_pair:
    trailing whitespace of the context moves into the continuation, and the continuation's ids are
    those of the whole text after the context's, so that the two concatenated are the tokens of
    context + continuation. An empty context starts from the end-of-text token where the tokenizer
    has one (as the harness does)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        # tiktoken encodings have one
        eot = getattr(getattr(tokenizer, "encoding", None), "eot_token", None)
        if eot is None:
            raise ValueError("empty context, and the tokenizer has no end-of-text token to start "
                             "from")
        return [eot], tokenizer.encode(continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, tokenizer.encode(context + continuation)[len(context_ids):]


def evenly_spaced(items, k):
    """At most k items, evenly spaced over the list, always the same ones (the first included)."""
    if not k or len(items) <= k:
        return items
    return [items[i * len(items) // k] for i in range(k)]


def load_task(name, path, tokenizer, max_examples, block_size):
    """Read, cap and tokenize one task -> a dict: name, path, examples [(rows, label, lengths)]
    where rows are (context ids, continuation ids) per choice, total (examples in the file), used
    (after the cap), skipped, first_skip (the first skipped example's reason). block_size: the
    smallest of the arms'."""
    loaded = list(LOADERS[name](path))
    picked = evenly_spaced(loaded, max_examples)
    examples, skips = [], []
    for ex in picked:
        if not all(w.strip() for _, w in ex.pairs):
            raise TaskError(f"{ex.where}: an empty choice or continuation: there is nothing to "
                            f"score")
        try:
            rows = [encode_pair(tokenizer, c, w) for c, w in ex.pairs]
        except ValueError as e:  # a character-level vocabulary without the characters of this text
            skips.append(f"{ex.where}: {e}")
            continue
        longest = max(len(w) for _, w in rows)
        if longest > block_size:  # it could not be scored whole: skipped for every arm alike
            skips.append(f"{ex.where}: a continuation of {longest} tokens does not fit block_size "
                         f"{block_size}")
            continue
        examples.append((rows, ex.label, ex.lengths))
    if not examples:
        raise TaskError(f"{path}: none of its {len(picked)} examples can be scored ({skips[0]})")
    return {"name": name, "path": path, "examples": examples, "total": len(loaded),
            "used": len(picked), "skipped": len(skips), "first_skip": skips[0] if skips else None}


def load_tasks(specs, tokenizer, max_examples, block_size):
    """[(name, path)] -> one task dict each, labelled by name, plus the file name where a name
    repeats (two ARC files: 'arc (ARC-Easy-Test.jsonl)')."""
    tasks = [load_task(name, path, tokenizer, max_examples, block_size) for name, path in specs]
    names = [t["name"] for t in tasks]
    for t in tasks:
        repeated = names.count(t["name"]) > 1
        t["label"] = f"{t['name']} ({os.path.basename(t['path'])})" if repeated else t["name"]
    return tasks


# --------------------------------------------------------------------------------------------------
# Scoring


@torch.no_grad()
def loglikelihoods(model, rows, batch_size, device):
    """rows: [(context ids, continuation ids)] -> (summed log-probability of each continuation given
    its context, float64; greedy: whether every continuation token is the argmax).

    Each row is the last block_size + 1 tokens of context + continuation; rows of similar length
    share a forward pass, right-padded (causal attention: padding after a position cannot change
    it), with targets -1 except at the continuation's tokens. Log-probabilities are the model's own
    per-token losses (GPT.forward, reduction="none": the cross-entropy of fp32 logits)."""
    T = model.config.block_size
    # cut from the left; the continuation stays whole
    seqs = [((c + w)[-(T + 1):], len(w)) for c, w in rows]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))  # less padding
    ll, greedy = np.zeros(len(rows)), np.zeros(len(rows), dtype=bool)
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        x = torch.zeros(len(batch), max(len(seqs[i][0]) for i in batch) - 1, dtype=torch.long)
        y = torch.full_like(x, -1)
        for r, i in enumerate(batch):
            seq, n = seqs[i]
            x[r, :len(seq) - 1] = torch.tensor(seq[:-1])
            # token j is predicted at j - 1
            y[r, len(seq) - 1 - n:len(seq) - 1] = torch.tensor(seq[-n:])
        # per-token losses: -log p of each target (0 where y = -1), and the logits of every position
        logits, loss = model(x.to(device), y.to(device), reduction="none")  # (B, T, V), (B, T)
        ll[batch] = -loss.double().sum(1).cpu().numpy()
        misses = ((logits.argmax(-1).cpu() != y) & (y >= 0)).sum(1)
        greedy[batch] = (misses == 0).numpy()
    return ll, greedy


def ci95(p, n):
    """Half-width of the normal-approximation 95% interval of accuracy p measured on n examples."""
    return 1.96 * math.sqrt(p * (1 - p) / n)


def score_task(model, task, batch_size, device):
    """One arm on one task -> {"task", "n", "acc", "acc_ci95", "acc_norm", "acc_norm_ci95", "ppl"}
    (None where a figure does not apply: acc_norm for lambada and winogrande, ppl for multiple
    choice)."""
    examples = task["examples"]
    all_rows = [r for rows, _, _ in examples for r in rows]
    ll, greedy = loglikelihoods(model, all_rows, batch_size, device)
    n = len(examples)
    out = {"task": task["label"], "n": n, "acc_norm": None, "acc_norm_ci95": None, "ppl": None}
    if task["name"] == "lambada":  # one row per example: the word
        out["acc"] = float(greedy.mean())
        out["ppl"] = math.exp(-ll.mean())
    else:
        correct, correct_norm, start = [], [], 0
        for rows, label, lengths in examples:
            choice_ll = ll[start:start + len(rows)]
            start += len(rows)
            # ties: the first, as np.argmax in the harness
            correct.append(np.argmax(choice_ll) == label)
            if lengths is not None:
                correct_norm.append(np.argmax(choice_ll / np.maximum(lengths, 1)) == label)
        out["acc"] = float(np.mean(correct))
        if correct_norm:
            out["acc_norm"] = float(np.mean(correct_norm))
            out["acc_norm_ci95"] = ci95(out["acc_norm"], n)
    out["acc_ci95"] = ci95(out["acc"], n)
    return out


def score_tasks(model, tasks, batch_size, device):
    return [score_task(model, t, batch_size, device) for t in tasks]


# --------------------------------------------------------------------------------------------------
# Output: one table for every task and arm, the figure


def pm(p, half):
    return "-" if p is None else f"{p:.3f} ± {half:.3f}"


def report(tasks, arms):
    """tasks: load_tasks' dicts; arms: [(arm label, score_tasks' results)] -> a markdown section."""
    lines = ["## Zero-shot tasks (lm-evaluation-harness scoring; ± is the 95% interval, "
             "1.96 * sqrt(p(1-p)/n))",
             "", "| task | arm | n | acc | acc_norm | word ppl |", "|---|---|---:|---|---|---:|"]
    for i, t in enumerate(tasks):
        for label, results in arms:
            r = results[i]
            ppl = "-" if r["ppl"] is None else f"{r['ppl']:.3f}"
            lines.append(f"| {t['label']} | {label} | {r['n']:,} | {pm(r['acc'], r['acc_ci95'])} | "
                         f"{pm(r['acc_norm'], r['acc_norm_ci95'])} | {ppl} |")
    notes = []
    for t in tasks:
        if t["used"] < t["total"]:
            notes.append(f"{t['label']}: {t['used']:,} of {t['total']:,} examples, evenly spaced "
                         f"(--task_max)")
        if t["skipped"]:
            notes.append(f"{t['label']}: {t['skipped']:,} of {t['used']:,} examples skipped for "
                         f"every arm (first: {t['first_skip']})")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def summary(tasks):
    """What the JSON keeps of each task (not its tokens)."""
    keys = ("label", "name", "path", "total", "used", "skipped", "first_skip")
    return [{k: t[k] for k in keys} for t in tasks]


def plot(tasks, arms, path):
    """One group of bars per task, one bar per arm: accuracy (acc_norm where the task has it, as the
    harness reports HellaSwag, PIQA and ARC) with its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(tasks) * len(arms) ** 0.5), 4.2))
    width = 0.8 / len(arms)
    for a, (label, results) in enumerate(arms):
        acc = [r["acc_norm"] if r["acc_norm"] is not None else r["acc"] for r in results]
        err = [r["acc_norm_ci95"] if r["acc_norm"] is not None else r["acc_ci95"] for r in results]
        x = np.arange(len(tasks)) + (a - (len(arms) - 1) / 2) * width
        ax.bar(x, acc, width, yerr=err, capsize=3, label=label)
    scored = ["acc_norm" if r["acc_norm"] is not None else "acc" for r in arms[0][1]]
    ticks = [f"{t['label']}\n({s})" for t, s in zip(tasks, scored, strict=True)]
    ax.set_xticks(range(len(tasks)), ticks)
    ax.set(ylabel="accuracy (95% interval)", ylim=(0, 1), title="zero-shot tasks")
    ax.legend(fontsize="small")
    fig.tight_layout()
    cli.save_figure(fig, path)
