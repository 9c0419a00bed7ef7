r"""Zero-shot tasks for eval.py --task: local files, scored as lm-evaluation-harness (v0.4) does.

    python lab/eval.py out-tied out-lev --task=lambada:lambada_test.jsonl \
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
import torch.nn.functional as F

from lab import cli

# --help prints TASK_FORMATS
TASK_FORMATS = """\
task formats (--task=NAME:PATH; one JSON object per line, blank lines ignored; a multiple-choice
row needs two choices or more, all different, and a label that is one of them):
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


def parse_specs(specs):
    """Every --task as (name, path). One file given twice under one name is refused: the two would
    be the same figures under the same label."""
    parsed, seen = [], {}
    for spec in specs:
        name, path = parse_spec(spec)
        key = (name, os.path.realpath(path))
        if key in seen:
            raise TaskError(f"--task={spec} is the file of --task={seen[key]} again; give each "
                            f"task file once")
        seen[key] = spec
        parsed.append((name, path))
    return parsed


# --------------------------------------------------------------------------------------------------
# Reading: one JSON object per line, fields checked, one-line errors with the file and line

# What a value nobody foresaw can raise while a line is read or used: a list nested deeper than the
# parser's recursion limit, a line too long for memory, a number of thousands of digits, a type a
# loader did not expect. Each is reported as a bad line, with the file and line, never a traceback.
VALUE_FAILURES = (ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError,
                  MemoryError)


def failure(error):
    """What went wrong, in words, for one of VALUE_FAILURES."""
    if isinstance(error, RecursionError):
        return "nested too deeply: more levels than Python's recursion limit"
    if isinstance(error, MemoryError):
        return "too large to be held in memory"
    # the first clause of Python's message, without its advice ("use sys.set_int_max_str_digits()")
    return f"{type(error).__name__}: {cut(str(error).split('; ')[0], 100)}"


def cut(text, width=60):
    """text, cut to at most width characters for a one-line message."""
    return text if len(text) <= width else text[:width - 3] + "..."


def shown(value):
    """A value as a message quotes it: its repr, cut short; a list or object by its type only."""
    if isinstance(value, (list, dict)):
        return f"a {'list' if isinstance(value, list) else 'JSON object'}"
    return cut(repr(value))


def numbered_lines(path):
    """Yield ("path:n", text) for each line of path, decoded from UTF-8 (a byte-order mark at the
    start is no error); TaskError if the file is missing or unreadable or a line is not UTF-8."""
    if not os.path.isfile(path):
        raise TaskError(f"{path}: no such file")
    n = 0
    try:
        # decoded line by line, so that bad bytes are reported with their line
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError:
                    raise TaskError(f"{path}:{n}: not UTF-8 text") from None
                yield f"{path}:{n}", text
    except OSError as e:
        raise TaskError(f"{path}: cannot be read ({e.strerror or e})") from None
    except MemoryError:  # one line of gigabytes
        raise TaskError(f"{path}:{n + 1}: a line too long to be held in memory") from None


def parse_json(text, where):
    """One line's text -> its JSON value; any failure of the parser is a TaskError at where."""
    try:
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except VALUE_FAILURES as e:  # deep nesting, a huge line or number
        raise TaskError(f"{where}: not readable as JSON ({failure(e)})") from None


def read_jsonl(path):
    """Yield (where, record) for each non-blank line of path; TaskError if the file is missing or
    empty or a line is not a JSON object."""
    found = False
    for where, text in numbered_lines(path):
        if not text.strip():
            continue
        record = parse_json(text, where)
        if not isinstance(record, dict):
            raise TaskError(f"{where}: expected a JSON object, got {type(record).__name__}")
        found = True
        yield where, record
    if not found:
        raise TaskError(f"{path}: no examples (the file is empty)")


def guarded(where, parse, *args):
    """parse(*args), where parse builds one example from one line: a failure its checks did not
    foresee is reported as a TaskError at where, like the ones they did."""
    try:
        return parse(*args)
    except TaskError:
        raise
    except VALUE_FAILURES as e:
        raise TaskError(f"{where}: cannot be used ({failure(e)})") from None


def read_examples(path, parse):
    """Yield parse(where, record), one Example per line of path (guarded)."""
    for where, record in read_jsonl(path):
        yield guarded(where, parse, where, record)


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
    # decimal digits only (int() refuses "²"), and not thousands of them (int() refuses those too)
    if isinstance(value, str) and value.strip().isdecimal() and len(value.strip()) < 20:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskError(f"{where}: {key} must be an integer, not {shown(value)}")
    if not first <= value < n_choices + first:
        raise TaskError(f"{where}: {key} {shown(value)} is out of range for {n_choices} choices "
                        f"({first}..{n_choices + first - 1})")
    return value - first


def check_choices(texts, where, key, names=None):
    """A multiple-choice row needs two choices or more, all different (as scored, whitespace at
    either end aside): with one, every model scores acc 1; of two alike, the first always wins.
    key: the field that holds them; names: how the format calls each (default key[i])."""
    if len(texts) < 2:
        raise TaskError(f"{where}: field {key!r} has {len(texts)} choice; a multiple-choice row "
                        f"needs two or more (with one, every model scores acc 1)")
    names = names or [f"{key}[{i}]" for i in range(len(texts))]
    first = {}
    for i, text in enumerate(texts):
        j = first.setdefault(text.strip(), i)
        if j != i:
            raise TaskError(f"{where}: {names[j]} and {names[i]} are the same choice "
                            f"{shown(text.strip())}; the choices of a row must differ (of two "
                            f"alike, the first always wins)")


def multiple_choice(context, choices, label, where):
    """One context, one continuation per choice, " " + choice; acc_norm counts the choice's
    characters (the harness's len(choice): without the space it puts in front)."""
    return Example([(context, " " + c) for c in choices], label, [len(c) for c in choices], where)


# --------------------------------------------------------------------------------------------------
# 1. LAMBADA (OpenAI's lambada_test.jsonl)


def lambada_example(where, record):
    """{"text"} -> context = the text before its last space, continuation = " " + the last word (the
    harness's text.split(' ')[:-1] joined, and ' ' + text.split(' ')[-1])."""
    context, space, word = field(record, "text", str, where).rpartition(" ")
    if not space or not context or not word:
        raise TaskError(f"{where}: the text needs a context, a space and a last word after it")
    return Example([(context, " " + word)], 0, None, where)


def load_lambada(path):
    return read_examples(path, lambada_example)


# --------------------------------------------------------------------------------------------------
# 2. HellaSwag (rowanz/hellaswag's hellaswag_{train,val}.jsonl)


def hellaswag_clean(text):
    """The harness's preprocess: WikiHow's bracketed artifacts out, double spaces collapsed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_example(where, record):
    if "ctx_a" in record or "ctx" not in record:
        ctx_b = field(record, "ctx_b", str, where).capitalize()
        ctx = field(record, "ctx_a", str, where) + " " + ctx_b
    else:
        ctx = field(record, "ctx", str, where)  # copies that keep only the joined context
    if "activity_label" in record:
        ctx = field(record, "activity_label", str, where) + ": " + ctx
    endings = [hellaswag_clean(e) for e in strings(record, "endings", where)]
    check_choices(endings, where, "endings")  # as cleaned: what is scored
    label = label_index(record.get("label"), len(endings), where)
    return multiple_choice(hellaswag_clean(ctx), endings, label, where)


def load_hellaswag(path):
    return read_examples(path, hellaswag_example)


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
    return [(where, text.strip()) for where, text in numbered_lines(lst) if text.strip()]


def piqa_example(where, record, label, label_where):
    sols = [field(record, "sol1", str, where), field(record, "sol2", str, where)]
    check_choices(sols, where, "sol1", names=["sol1", "sol2"])
    context = f"Question: {field(record, 'goal', str, where)}\nAnswer:"
    return multiple_choice(context, sols, label_index(label, 2, label_where), where)


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
        yield guarded(where, piqa_example, where, record, label, label_where)
    if used and len(labels) > used:
        raise TaskError(f"{labels[used][0]}: {len(labels)} labels for {used} examples in {path}")


# --------------------------------------------------------------------------------------------------
# 4. ARC-Easy / ARC-Challenge (AI2's ARC-V1-Feb2018: ARC-{Easy,Challenge}-{Train,Dev,Test}.jsonl)


def arc_example(where, record):
    question = field(record, "question", dict, where)
    choices = field(question, "choices", list, where)
    if not choices or not all(isinstance(c, dict) for c in choices):
        raise TaskError(f"{where}: question.choices must be a non-empty list of "
                        f"{{\"text\", \"label\"}}")
    texts = [field(c, "text", str, where) for c in choices]
    keys = [str(field(c, "label", (str, int), where)) for c in choices]  # "A".."E", or "1".."5"
    twice = [k for i, k in enumerate(keys) if k in keys[:i]]
    if twice:  # the answer key would not say which
        raise TaskError(f"{where}: the choice label {shown(twice[0])} is given twice in "
                        f"question.choices")
    check_choices(texts, where, "question.choices", names=[f"choice {k}" for k in keys])
    answer = str(field(record, "answerKey", (str, int), where))
    if answer not in keys:
        raise TaskError(f"{where}: answerKey {shown(answer)} is not one of the choice labels "
                        f"{cut(', '.join(keys))}")
    context = f"Question: {field(question, 'stem', str, where)}\nAnswer:"
    return multiple_choice(context, texts, keys.index(answer), where)


def load_arc(path):
    return read_examples(path, arc_example)


# --------------------------------------------------------------------------------------------------
# 5. WinoGrande (AI2's winogrande_1.1: train_{xs..xl}.jsonl, dev.jsonl)


def winogrande_example(where, record):
    """Partial evaluation: two contexts (the sentence up to "_", each option in its place), one
    continuation (the rest after "_"), so that both options are scored on the same tokens."""
    sentence = field(record, "sentence", str, where)
    blank = sentence.find("_")
    if blank < 0:
        raise TaskError(f"{where}: the sentence has no '_' to fill")
    rest = " " + sentence[blank + 1:].strip()
    options = [field(record, "option1", str, where), field(record, "option2", str, where)]
    check_choices(options, where, "option1", names=["option1", "option2"])
    answer = label_index(record.get("answer"), 2, where, key="answer", first=1)
    return Example([(sentence[:blank] + o, rest) for o in options], answer, None, where)


def load_winogrande(path):
    return read_examples(path, winogrande_example)


# --------------------------------------------------------------------------------------------------
# 6. mc: a generic multiple-choice / cloze task, for your own data


def mc_example(where, record):
    choices = strings(record, "choices", where)
    check_choices(choices, where, "choices")
    label = label_index(record.get("label"), len(choices), where)
    context = field(record, "context", str, where)
    # the choice as written; acc_norm does not count leading whitespace, wherever the space was put
    lengths = [len(c.lstrip()) for c in choices]
    return Example([(context, c) for c in choices], label, lengths, where)


def load_mc(path):
    return read_examples(path, mc_example)


LOADERS = {"lambada": load_lambada, "hellaswag": load_hellaswag, "piqa": load_piqa, "arc": load_arc,
           "winogrande": load_winogrande, "mc": load_mc}


# --------------------------------------------------------------------------------------------------
# Tokens: the harness's boundary rule, the --task_max cap, what cannot be scored


class NoContinuationTokens(ValueError):
    """A continuation that the tokenizer merges into its context's last token: it has no token of
    its own, and nothing can be scored (lm_eval's own models refuse it too)."""


def token_losses(model, x, y):
    """x, y: (B, T) -> (the model's logits (B, T, V), the cross-entropy of each target (B, T), 0
    where y = -1): what train.py's val loss averages, whatever the model adds to its training loss.
    Under the lean head the logits are made only if used (GPT.forward)."""
    logits, _ = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1,
                           reduction="none")
    return logits, loss.view(y.shape)


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
        eot = end_of_text(tokenizer)
        if eot is None:
            raise ValueError("empty context, and the tokenizer has no end-of-text token to start "
                             "from")
        return [eot], tokenizer.encode(continuation)
    context_ids = tokenizer.encode(context)
    continuation_ids = tokenizer.encode(context + continuation)[len(context_ids):]
    if continuation and not continuation_ids:
        raise NoContinuationTokens(f"the continuation {continuation!r} merges into the last token "
                                   f"of its context (...{context[-20:]!r}) and has no token of its "
                                   f"own to score; lm_eval's models refuse it too: drop or reword "
                                   f"the example")
    return context_ids, continuation_ids


def end_of_text(tokenizer):
    """The tokenizer's end-of-text id, or None: characters have none, and neither has a tiktoken
    encoding built without <|endoftext|> (its eot_token raises a KeyError)."""
    encoding = getattr(tokenizer, "encoding", None)
    try:
        return None if encoding is None else encoding.eot_token
    except KeyError:
        return None


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
        except NoContinuationTokens as e:  # refused, the same in harness.py
            raise TaskError(f"{ex.where}: {e}") from None
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


def task_labels(specs):
    """[(name, path)] -> a label each: the name, plus where a name repeats the shortest end of the
    path that tells its files apart (two ARC files: 'arc (ARC-Easy-Test.jsonl)'; two test.jsonl:
    'arc (easy/test.jsonl)' and 'arc (challenge/test.jsonl)'), else the whole path."""
    parts = {path: os.path.normpath(path).split(os.sep) for _, path in specs}
    labels = []
    for name, path in specs:
        same_name = [p for n, p in specs if n == name]
        if len(same_name) == 1:
            labels.append(name)
            continue
        others = [p for p in same_name if p != path]
        for k in range(1, len(parts[path]) + 1):
            end = os.sep.join(parts[path][-k:])
            if all(os.sep.join(parts[p][-k:]) != end for p in others):
                break
        else:  # every end of the path is the end of another path too: the whole of it
            end = os.path.normpath(path)
        labels.append(f"{name} ({end})")
    return labels


def load_tasks(specs, tokenizer, max_examples, block_size):
    """[(name, path)] -> one task dict each, labelled by task_labels."""
    tasks = [load_task(name, path, tokenizer, max_examples, block_size) for name, path in specs]
    for t, label in zip(tasks, task_labels(specs), strict=True):
        t["label"] = label
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
    per-token losses (token_losses: the cross-entropy of its logits)."""
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
        logits, loss = token_losses(model, x.to(device), y.to(device))  # (B, T, V), (B, T)
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
