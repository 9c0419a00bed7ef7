"""Tests of lab/tasks.py (zero-shot tasks) and eval.py --task, on small files in each format.

The files are written here, in each published format. Scoring logic is checked against a stub with
GPT's interface whose log-probabilities are known (a bigram table), and against a tiny real GPT:
batched and padded scores equal unpadded forward passes, and a GPT overfit on the right answers gets
every task right through the command line."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tiktoken
import torch
import torch.nn.functional as F
from conftest import make_tiny_encoding

from lab import eval as ev
from lab import tasks
from lab.checkpoints import CHECKPOINT_VERSION
from lab.dataset import CharTokenizer, TiktokenTokenizer
from leviathan import GPT, Config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def write_jsonl(path, records):
    """Records (dicts, or raw strings written as they are) one per line -> path (a str)."""
    lines = [(r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records]
    Path(path).write_text("".join(lines))
    return str(path)


def load(name, path):
    return list(tasks.LOADERS[name](str(path)))


# --------------------------------------------------------------------------------------------------
# loaders: each published format -> (context, continuation) pairs, label, acc_norm lengths


def test_lambada_loader(tmp_path):
    path = write_jsonl(tmp_path / "lambada_test.jsonl", [{"text": "he said  hello to the old man"},
                                                         "", {"text": "in the end, it was\nyours"}])
    # split at the last space only, as the harness does
    assert [(e.pairs, e.label, e.lengths) for e in load("lambada", path)] == [
        ([("he said  hello to the old", " man")], 0, None),
        ([("in the end, it", " was\nyours")], 0, None)]
    # blank lines are skipped
    assert [e.where for e in load("lambada", path)] == [f"{path}:1", f"{path}:3"]


def test_hellaswag_loader_preprocesses_like_the_harness(tmp_path):
    record = {"ind": 4, "activity_label": "Removing ice from car",
              "ctx_a": "Then, the man writes over the snow.", "ctx_b": "then", "label": 3,
              "split": "val",
              "endings": [", the man adds wax to the windshield.",
                          "[header] How to  clean. [title] Use soap.", " [step] A woman  wipes it.",
                          ", the man continues removing the snow on his car."]}
    joined = {"ctx": "A cat [sits] down.", "label": "0", "endings": ["It naps.", "It  runs."]}
    path = write_jsonl(tmp_path / "hellaswag_val.jsonl", [record, joined])
    first, second = load("hellaswag", path)
    context = "Removing ice from car: Then, the man writes over the snow. Then"
    endings = [", the man adds wax to the windshield.", " How to clean.. Use soap.",
               " A woman wipes it.", ", the man continues removing the snow on his car."]
    assert first.pairs == [(context, " " + e) for e in endings]
    assert first.label == 3 and first.lengths == [len(e) for e in endings]
    # a copy with only "ctx" (and the label as a string, as the HF copy stores it)
    assert second.pairs == [("A cat down.", " It naps."), ("A cat down.", " It runs.")]
    assert second.label == 0


def test_piqa_loader_labels_file_or_field(tmp_path):
    goals = [{"goal": "To open a jar", "sol1": "twist the lid", "sol2": "eat the lid"},
             {"goal": "To dry hair", "sol1": "use a fan", "sol2": "use a towel"}]
    path = write_jsonl(tmp_path / "valid.jsonl", goals)
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    first, second = load("piqa", path)
    assert first.pairs == [("Question: To open a jar\nAnswer:", " twist the lid"),
                           ("Question: To open a jar\nAnswer:", " eat the lid")]
    assert (first.label, second.label) == (0, 1) and first.lengths == [13, 11]
    # a label in the line is used as it is, without a labels file
    path = write_jsonl(tmp_path / "piqa_labelled.jsonl", [{**goals[0], "label": 1}])
    assert [e.label for e in load("piqa", path)] == [1]


def test_arc_loader_letter_and_digit_keys(tmp_path):
    path = write_jsonl(tmp_path / "ARC-Easy-Test.jsonl", [
        {"id": "q1", "question": {"stem": "What melts ice?", "choices": [
            {"text": "heat", "label": "A"}, {"text": "cold air", "label": "B"},
            {"text": "salt", "label": "C"}]},
         "answerKey": "C"},
        {"id": "q2", "question": {"stem": "Which is a gas?", "choices": [
            {"text": "steam", "label": "1"}, {"text": "rock", "label": "2"}]}, "answerKey": "1"}])
    first, second = load("arc", path)
    assert first.pairs[1] == ("Question: What melts ice?\nAnswer:", " cold air")
    assert (first.label, second.label) == (2, 0) and first.lengths == [4, 8, 4]


def test_winogrande_loader_partial_evaluation(tmp_path):
    path = write_jsonl(tmp_path / "dev.jsonl", [
        {"qID": "x", "sentence": "The cup fell off the table because _ was wobbly.",
         "option1": "the cup", "option2": "the table", "answer": "2"}])
    [example] = load("winogrande", path)
    assert example.pairs == [("The cup fell off the table because the cup", " was wobbly."),
                             ("The cup fell off the table because the table", " was wobbly.")]
    assert example.label == 1 and example.lengths is None  # acc only, as in the harness


def test_mc_loader(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl",
                       [{"context": "2 + 2 =", "choices": [" 4", " five"], "label": 0}])
    [example] = load("mc", path)
    assert example.pairs == [("2 + 2 =", " 4"), ("2 + 2 =", " five")] and example.lengths == [1, 4]
    # the space at the end of the context instead: the same tokens and lengths
    path = write_jsonl(tmp_path / "mine2.jsonl",
                       [{"context": "2 + 2 = ", "choices": ["4", "five"], "label": 0}])
    [other] = load("mc", path)
    tok = CharTokenizer(" +24=efiv")
    assert ([tasks.encode_pair(tok, *p) for p in other.pairs]
            == [tasks.encode_pair(tok, *p) for p in example.pairs])
    assert other.lengths == example.lengths


MALFORMED = [  # (task, file name, lines, message after the file name)
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c"], "label": 0}', '{"context": '],
     ":2: not valid JSON"),
    ("mc", "a.jsonl", ['["a", "b"]'], ":1: expected a JSON object, got list"),
    ("mc", "a.jsonl", ['{"context": "a", "label": 0}'], ":1: missing field 'choices'"),
    ("mc", "a.jsonl", ['{"context": "a", "choices": "b c", "label": 0}'],
     ":1: field 'choices' must be a list, not"),
    ("mc", "a.jsonl", ['{"context": "a", "choices": [], "label": 0}'],
     ":1: field 'choices' must be a non-empty"),
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c"]}'], ":1: missing field 'label'"),
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c"], "label": 2}'],
     ":1: label 2 is out of range"),
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c"], "label": "x"}'],
     ":1: label must be an integer"),
    ("mc", "a.jsonl", ['{"context": 3, "choices": [" b", " c"], "label": 0}'],
     ":1: field 'context' must be a str"),
    ("hellaswag", "h.jsonl", [], ": no examples (the file is empty)"),
    ("hellaswag", "h.jsonl",
     ['{"activity_label": "a", "ctx_a": "b", "endings": ["c"], "label": 0}'],
     ":1: missing field 'ctx_b'"),
    ("lambada", "l.jsonl", ['{"text": "hello"}'],
     ":1: the text needs a context, a space and a last word"),
    ("lambada", "l.jsonl", ['{"txt": "a b"}'], ":1: missing field 'text'"),
    ("arc", "c.jsonl",
     ['{"question": {"stem": "q", "choices": [{"text": "a", "label": "A"}, {"text": "b", "label": '
      '"B"}]}, "answerKey": "C"}'],
     ":1: answerKey 'C' is not one of the choice labels A, B"),
    ("arc", "c.jsonl", ['{"question": "q", "answerKey": "B"}'],
     ":1: field 'question' must be a dict"),
    ("arc", "c.jsonl",
     ['{"question": {"stem": "q", "choices": [{"text": "a", "label": null}]}, "answerKey": "A"}'],
     ":1: field 'label' must be a str or int, not NoneType"),
    ("winogrande", "w.jsonl",
     ['{"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}'],
     ":1: the sentence has no '_'"),
    ("winogrande", "w.jsonl",
     ['{"sentence": "a _ b", "option1": "a", "option2": "b", "answer": "3"}'],
     ":1: answer 3 is out of range for 2 choices (1..2)"),
    ("piqa", "valid.jsonl", ['{"goal": "g", "sol1": "a", "sol2": "b"}'],
     ":1: no 'label' field, and no labels file"),
]


def assert_refused(tmp_path, name, file, lines, message):
    """The file of lines, read as task name, is refused: one line that starts with its path and
    message."""
    path = write_jsonl(tmp_path / file, lines) if lines else str(tmp_path / file)
    if not lines:
        Path(path).write_text("\n")
    with pytest.raises(tasks.TaskError) as err:
        load(name, path)
    assert str(err.value).startswith(path + message) and "\n" not in str(err.value), err.value
    return str(err.value)


@pytest.mark.parametrize("name, file, lines, message", MALFORMED)
def test_malformed_files_are_one_line_errors(tmp_path, name, file, lines, message):
    assert_refused(tmp_path, name, file, lines, message)


def arc_row(*choices, answer="A"):
    """An ARC line whose choices are (label, text) pairs."""
    return json.dumps({"question": {"stem": "q", "choices": [{"text": t, "label": k}
                                                             for k, t in choices]},
                       "answerKey": answer})


BAD_CHOICES = [  # (task, file name, lines, message after the file name), for every format
    # fewer than two: with one choice, every model scores acc 1
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b"], "label": 0}'],
     ":1: field 'choices' has 1 choice; a multiple-choice row needs two or more"),
    ("hellaswag", "h.jsonl",
     ['{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["d"], "label": 0}'],
     ":1: field 'endings' has 1 choice"),
    ("arc", "c.jsonl", [arc_row(("A", "a"))], ":1: field 'question.choices' has 1 choice"),
    # two alike (as scored: whitespace at the ends aside, HellaSwag's endings as cleaned)
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c", "b "], "label": 0}'],
     ":1: choices[0] and choices[2] are the same choice 'b'; the choices of a row must differ"),
    ("hellaswag", "h.jsonl",
     ['{"ctx": "a", "endings": ["It  runs.", "x", "It runs."], "label": 0}'],
     ":1: endings[0] and endings[2] are the same choice 'It runs.'"),
    ("piqa", "valid.jsonl", ['{"goal": "g", "sol1": "a b", "sol2": "a b", "label": 0}'],
     ":1: sol1 and sol2 are the same choice 'a b'"),
    ("arc", "c.jsonl", [arc_row(("A", "x"), ("B", "y"), ("C", "x"))],
     ":1: choice A and choice C are the same choice 'x'"),
    ("arc", "c.jsonl", [arc_row(("A", "x"), ("A", "y"))],
     ":1: the choice label 'A' is given twice in question.choices"),
    ("winogrande", "w.jsonl",
     ['{"sentence": "a _ b", "option1": "the cup", "option2": "the cup", "answer": "1"}'],
     ":1: option1 and option2 are the same choice 'the cup'"),
    # a label that is not one of the choices
    ("mc", "a.jsonl", ['{"context": "a", "choices": [" b", " c"], "label": -1}'],
     ":1: label -1 is out of range for 2 choices (0..1)"),
    ("hellaswag", "h.jsonl", ['{"ctx": "a", "endings": ["b", "c"], "label": "4"}'],
     ":1: label 4 is out of range for 2 choices (0..1)"),
    ("piqa", "valid.jsonl", ['{"goal": "g", "sol1": "a", "sol2": "b", "label": 2}'],
     ":1: label 2 is out of range for 2 choices (0..1)"),
    ("arc", "c.jsonl", [arc_row(("A", "x"), ("B", "y"), answer="E")],
     ":1: answerKey 'E' is not one of the choice labels A, B"),
    ("winogrande", "w.jsonl",
     ['{"sentence": "a _ b", "option1": "x", "option2": "y", "answer": 0}'],
     ":1: answer 0 is out of range for 2 choices (1..2)"),
]


@pytest.mark.parametrize("name, file, lines, message", BAD_CHOICES)
def test_rows_without_a_real_choice_are_refused(tmp_path, name, file, lines, message):
    """A row the harness would score, but whose accuracy means nothing: refused with its line."""
    assert_refused(tmp_path, name, file, lines, message)


DEEP = 100_000  # levels of nesting: far past Python's recursion limit
BAD_VALUES = [  # any failure of the parser or of the values: the file and line, one short line
    ("arc", ['{"question": ' + "[" * DEEP + "]" * DEEP + ', "answerKey": "A"}'],
     ":1: not readable as JSON (nested too deeply: more levels than Python's recursion limit)"),
    ("mc", ['{"context": "a", "choices": [" b", " c"], "label": ' + "1" * 5000 + "}"],
     ":1: not readable as JSON (ValueError: Exceeds the limit (4300 digits) for integer string "
     "conversion: value has 5000 digits)"),
    ("mc", ['{"context": "a", "choices": [" b", " c"], "label": "\u00b2"}'],
     ":1: label must be an integer, not '\u00b2'"),  # a digit to isdigit(), not to int()
    ("mc", ['{"context": "a", "choices": [" b", " c"], "label": "' + "1" * 5000 + '"}'],
     ":1: label must be an integer, not '11111"),
    ("mc", ['{"context": "a", "choices": [" b", " c"], "label": ' + "[" * 900 + "]" * 900 + "}"],
     ":1: label must be an integer, not a list"),
    ("mc", ['{"context": "a", "choices": [' + "[" * 900 + "]" * 900 + "], \"label\": 0}"],
     ":1: field 'choices' must be a non-empty list of strings"),
    ("lambada", ['{"text": {"a": {"b": [1]}}}'], ":1: field 'text' must be a str, not dict"),
    ("winogrande", ['{"sentence": "a _ b", "option1": "x", "option2": "y", "answer": true}'],
     ":1: answer must be an integer, not True"),
]


@pytest.mark.parametrize("name, lines, message", BAD_VALUES,
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(BAD_VALUES)])
def test_any_failure_of_parser_or_values_is_one_line(tmp_path, name, lines, message):
    error = assert_refused(tmp_path, name, "t.jsonl", lines, message)
    assert len(error) < len(str(tmp_path)) + 150  # a value is quoted short, never whole


def test_unforeseen_failures_in_a_loader_name_the_line():
    """guarded: what a loader's own checks did not foresee still names the file and line."""
    def recurse(n):
        return recurse(n + 1)

    def raise_memory():
        raise MemoryError

    def raise_own():
        raise tasks.TaskError("as it was")

    for parse, message in [(lambda: recurse(0), "nested too deeply: more levels than Python's"),
                           (raise_memory, "too large to be held in memory"),
                           (lambda: len(5), "TypeError: object of type 'int' has no len()")]:
        with pytest.raises(tasks.TaskError, match=f"^x.jsonl:7: cannot be used \\({message}"):
            tasks.guarded("x.jsonl:7", parse)
    with pytest.raises(tasks.TaskError, match="^as it was$"):  # its own errors pass unchanged
        tasks.guarded("x.jsonl:7", raise_own)


def test_bytes_that_are_not_utf8_and_byte_order_marks(tmp_path):
    path = tmp_path / "a.jsonl"
    # a byte-order mark: read as usual
    path.write_bytes(b'\xef\xbb\xbf{"context": "a", "choices": [" b", " c"], "label": 0}\n')
    assert load("mc", path)[0].pairs == [("a", " b"), ("a", " c")]
    path.write_bytes(b'{"context": "a", "choices": [" b", " c"], "label": 0}\n'
                     b'{"context": "\xff"}\n')
    with pytest.raises(tasks.TaskError, match=f"^{path}:2: not UTF-8 text$"):
        load("mc", path)
    # PIQA's labels file too
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2)
    (tmp_path / "valid-labels.lst").write_bytes(b"0\n\xff\n")
    with pytest.raises(tasks.TaskError, match=f"^{tmp_path}/valid-labels.lst:2: not UTF-8 text$"):
        load("piqa", valid)


def test_a_lone_surrogate_is_encoded_as_encode_ordinary_does(tmp_path):
    """JSON may escape half a surrogate pair ("\\ud800"): BPE encodes it as tiktoken's
    encode_ordinary does (as U+FFFD), a character vocabulary skips the example, with its line."""
    row = '{"context": "a", "choices": [" b \\ud800", " c"], "label": 0}'
    path = write_jsonl(tmp_path / "mine.jsonl", [row])
    bpe = TiktokenTokenizer(merge_encoding())
    [(rows, _, _)] = tasks.load_task("mc", path, bpe, 0, 16)["examples"]
    assert rows[0][1] == bpe.encode(" b \ufffd") == bpe.encoding.encode_ordinary(" b \ud800")
    with pytest.raises(tasks.TaskError, match=f"none of its 1 examples can be scored "
                                              f"\\({path}:1: characters not in"):
        tasks.load_task("mc", path, CharTokenizer(" abc"), 0, 16)


def test_piqa_labels_file_errors(tmp_path):
    path = write_jsonl(tmp_path / "valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2)
    labels = tmp_path / "valid-labels.lst"
    for content, message in [("0\n", f"{path}:2: the labels file has only 1 labels"),
                             ("0\n1\n1\n", f"{labels}:3: 3 labels for 2 examples in {path}"),
                             ("0\nx\n", f"{labels}:2: label must be an integer, not 'x'"),
                             ("0\n2\n", f"{labels}:2: label 2 is out of range")]:
        labels.write_text(content)
        with pytest.raises(tasks.TaskError, match=f"^{message}"):
            load("piqa", path)
    # labels in the lines: the labels file is not used, whatever its length
    labelled = {"goal": "g", "sol1": "a", "sol2": "b", "label": 1}
    path = write_jsonl(tmp_path / "valid.jsonl", [labelled] * 2)
    assert [e.label for e in load("piqa", path)] == [1, 1]


def test_task_specs():
    assert tasks.parse_spec("arc:data/ARC-Easy-Test.jsonl") == ("arc", "data/ARC-Easy-Test.jsonl")
    assert tasks.parse_spec("mc:C:/x.jsonl") == ("mc", "C:/x.jsonl")  # the path may hold ':'
    with pytest.raises(tasks.TaskError,
                       match="unknown task 'squad' in --task=squad:x; NAME is one of lambada"):
        tasks.parse_spec("squad:x")
    with pytest.raises(tasks.TaskError, match="must be NAME:PATH"):
        tasks.parse_spec("mc")
    with pytest.raises(tasks.TaskError, match="x.jsonl: no such file"):
        load("mc", "x.jsonl")


# --------------------------------------------------------------------------------------------------
# tokens: the harness's boundary, the cap, skipped examples


def merge_encoding(*merges):
    """A byte-level tiktoken encoding with a few merges (ids 256, 257, ...), built in-process."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({m: 256 + i for i, m in enumerate(merges)})
    return tiktoken.Encoding(name="merges", pat_str=r"""'s|'t| ?\w+| ?[^\s\w]+|\s+""",
                             mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 256 + len(merges)})


def test_encode_pair_moves_the_space_into_the_continuation():
    tok = TiktokenTokenizer(merge_encoding(b" P", b" Pa"))
    for context, continuation in [("The capital is ", "Paris"), ("The capital is", " Paris")]:
        ctx, cont = tasks.encode_pair(tok, context, continuation)
        assert ctx == tok.encode("The capital is")
        assert cont[0] == 257 and tok.decode(cont) == " Paris"
        # exactly the tokens of the whole text
        assert ctx + cont == tok.encode("The capital is Paris")
    # encoding the two apart would have given a lone space token and "P": not what the model saw in
    # training
    assert tok.encode("The capital is ") + tok.encode("Paris") != tok.encode("The capital is Paris")
    # an empty context starts from end-of-text where the tokenizer has it; a character vocabulary
    # has none
    assert tasks.encode_pair(tok, "", "Paris") == ([257 + 1], tok.encode("Paris"))
    char = CharTokenizer(" Pacirst")
    assert tasks.encode_pair(char, "cat ", "Paris") == (char.encode("cat"), char.encode(" Paris"))
    with pytest.raises(ValueError, match="empty context"):
        tasks.encode_pair(char, " ", "Paris")
    # nor has a tiktoken encoding built without <|endoftext|> (its eot_token raises a KeyError)
    bare = TiktokenTokenizer(make_tiny_encoding())
    with pytest.raises(ValueError, match="empty context"):
        tasks.encode_pair(bare, "", "Paris")


def test_task_max_and_skipped_examples(tmp_path):
    records = [{"context": f"{c}", "choices": [" a", " bb" * (i % 3 + 1)], "label": 0} for i, c in
               enumerate("abcdefghij")]
    records[4]["context"] = "Z"  # a character the vocabulary lacks
    path = write_jsonl(tmp_path / "mine.jsonl", records)
    tok = CharTokenizer(" abcdefghij")
    task = tasks.load_task("mc", path, tok, max_examples=0, block_size=16)
    assert (task["total"], task["used"], task["skipped"], len(task["examples"])) == (10, 10, 1, 9)
    assert task["first_skip"].startswith(f"{path}:5: characters not in")
    capped = tasks.load_task("mc", path, tok, max_examples=4, block_size=16)
    # examples 0, 2, (5 = 'Z'), 7
    assert [tok.decode(ex[0][0][0]) for ex in capped["examples"]] == ["a", "c", "f", "h"]
    assert (capped["used"], capped["skipped"]) == (4, 0)
    assert capped == tasks.load_task("mc", path, tok, 4, 16)
    # a continuation longer than the (smallest) block cannot be scored whole: skipped, and said so
    short = tasks.load_task("mc", path, tok, max_examples=0, block_size=6)
    assert short["skipped"] == 1 + 3  # 'Z', and " bb bb bb" three times
    assert short["first_skip"] == f"{path}:3: a continuation of 9 tokens does not fit block_size 6"
    with pytest.raises(tasks.TaskError, match=f"{path}: none of its 10 examples can be scored"):
        tasks.load_task("mc", path, tok, max_examples=0, block_size=1)
    os.makedirs(tmp_path / "b")
    other = write_jsonl(tmp_path / "b" / "mine.jsonl", records)
    two = tasks.load_tasks([("mc", path), ("mc", other)], tok, 0, 16)
    assert [t["label"] for t in two] == [f"mc ({tmp_path.name}/mine.jsonl)", "mc (b/mine.jsonl)"]
    assert tasks.load_tasks([("mc", path)], tok, 0, 16)[0]["label"] == "mc"


def test_task_labels_tell_files_of_one_name_apart(tmp_path):
    """The name alone where it is used once; else the shortest end of the path that differs."""
    assert tasks.task_labels([("arc", "ARC-Easy-Test.jsonl"), ("arc", "x/ARC-Challenge-Test.jsonl"),
                              ("mc", "mine.jsonl")]) == [
        "arc (ARC-Easy-Test.jsonl)", "arc (ARC-Challenge-Test.jsonl)", "mc"]
    assert tasks.task_labels([("arc", "a/test.jsonl"), ("arc", "b/test.jsonl")]) == [
        "arc (a/test.jsonl)", "arc (b/test.jsonl)"]
    assert tasks.task_labels([("arc", "x/a/t.jsonl"), ("arc", "y/a/t.jsonl"), ("arc", "a/t.jsonl"),
                              ("arc", "t.jsonl"), ("mc", "t.jsonl")]) == [
        "arc (x/a/t.jsonl)", "arc (y/a/t.jsonl)", "arc (a/t.jsonl)", "arc (t.jsonl)", "mc"]
    # one file given twice under one name: the same figures twice, refused (by its real path)
    Path(tmp_path / "t.jsonl").write_text("")
    os.symlink(tmp_path / "t.jsonl", tmp_path / "link.jsonl")
    for again in (f"{tmp_path}/./t.jsonl", f"{tmp_path}/link.jsonl"):
        with pytest.raises(tasks.TaskError, match=f"^--task=arc:{again} is the file of "
                                                  f"--task=arc:{tmp_path}/t.jsonl again"):
            tasks.parse_specs([f"arc:{tmp_path}/t.jsonl", f"arc:{again}"])
    assert tasks.parse_specs([f"arc:{tmp_path}/t.jsonl", f"mc:{tmp_path}/t.jsonl"]) == [
        ("arc", f"{tmp_path}/t.jsonl"), ("mc", f"{tmp_path}/t.jsonl")]


# --------------------------------------------------------------------------------------------------
# scoring


class Bigram(torch.nn.Module):
    """GPT's interface (config.block_size; forward(idx) -> (logits of every position, None)) with
    logits that depend only on the current token: log p(next | prev) = log_softmax(table)[prev,
    next]."""

    def __init__(self, table, block_size):
        super().__init__()
        self.config = SimpleNamespace(block_size=block_size)
        self.table = table
        self.inputs = []  # every batch it was fed

    def forward(self, idx, targets=None):
        assert targets is None  # the per-token losses are tasks.token_losses'
        assert idx.shape[1] <= self.config.block_size
        self.inputs.append(idx.clone())
        return self.table[idx], None


def bigram_loglik(table, ids):
    logp = F.log_softmax(table.double(), dim=-1)
    return float(sum(logp[a, b] for a, b in zip(ids[:-1], ids[1:], strict=True)))


def test_loglikelihoods_of_a_known_model():
    torch.manual_seed(0)
    table = torch.randn(6, 6)
    model = Bigram(table, block_size=4)
    # the last row is cut to 5 tokens
    rows = [([1, 2], [3]), ([5], [4, 4, 0]), ([1, 2, 3, 4, 5, 0], [2, 1])]
    ll, greedy = tasks.loglikelihoods(model, rows, batch_size=2, device="cpu")
    want = [bigram_loglik(table, [2, 3]), bigram_loglik(table, [5, 4, 4, 0]),
            bigram_loglik(table, [0, 2, 1])]
    assert ll == pytest.approx(want, abs=1e-5)
    argmax = table.argmax(-1)
    assert greedy.tolist() == [bool(argmax[2] == 3),
                               bool(argmax[5] == 4 and argmax[4] == 4 and argmax[4] == 0),
                               bool(argmax[0] == 2 and argmax[2] == 1)]
    # sorted by length, right-padded with 0, and the long row cut from the left to block_size + 1
    # = 5 tokens
    assert [x.tolist() for x in model.inputs] == [[[1, 2, 0], [5, 4, 4]], [[4, 5, 0, 2]]]


def test_acc_and_acc_norm_differ_when_lengths_differ(tmp_path):
    """'a' after 'a' is almost certain: ' aaaa' costs little more than ' a' in total (acc picks
    ' a') but much less per character (acc_norm picks ' aaaa')."""
    tok = CharTokenizer(" abx")
    table = torch.zeros(4, 4)
    table[1, 1] = 8.0  # a -> a
    table[2, 0] = table[3, 0] = 4.0  # b -> ' ', x -> ' '
    table[0, 1] = 1.0  # ' ' -> a
    model = Bigram(table, block_size=16)
    path = write_jsonl(tmp_path / "mine.jsonl",
                       [{"context": "x", "choices": [" a", " aaaa"], "label": 1},
                        {"context": "b", "choices": [" a", " aaaa"], "label": 0}])
    [result] = tasks.score_tasks(model, tasks.load_tasks([("mc", path)], tok, 0, 16), 4, "cpu")
    assert result["n"] == 2 and result["acc"] == 0.5 and result["acc_norm"] == 0.5
    ll = [bigram_loglik(table, tok.encode(s)) for s in ("x a", "x aaaa")]
    # the premise: acc and acc_norm disagree on each example
    assert ll[0] > ll[1] and ll[0] / 1 < ll[1] / 4
    assert result["acc_ci95"] == pytest.approx(1.96 * math.sqrt(0.25 / 2)) and result["ppl"] is None
    # on the first example alone acc is 0 and acc_norm is 1; on the second, the other way round
    path = write_jsonl(tmp_path / "one.jsonl",
                       [{"context": "x", "choices": [" a", " aaaa"], "label": 1}])
    [result] = tasks.score_tasks(model, tasks.load_tasks([("mc", path)], tok, 0, 16), 4, "cpu")
    assert (result["acc"], result["acc_norm"], result["acc_ci95"]) == (0.0, 1.0, 0.0)


def test_lambada_accuracy_and_word_perplexity(tmp_path):
    tok = CharTokenizer(" abx")
    table = torch.zeros(4, 4)
    table[3, 0] = table[0, 1] = table[1, 1] = 3.0  # x -> ' ' -> a -> a: greedy " aa", not " ab"
    model = Bigram(table, block_size=16)
    path = write_jsonl(tmp_path / "lambada.jsonl",
                       [{"text": "xx aa"}, {"text": "bx ab"}, {"text": "x aaa"}])
    [result] = tasks.score_tasks(model, tasks.load_tasks([("lambada", path)], tok, 0, 16), 2, "cpu")
    words = [bigram_loglik(table, tok.encode(s)) for s in ("x aa", "x ab", "x aaa")]
    assert result["n"] == 3 and result["acc"] == pytest.approx(2 / 3)
    # per word, as the harness
    assert result["ppl"] == pytest.approx(math.exp(-np.mean(words)), rel=1e-6)
    assert result["acc_norm"] is None and result["acc_norm_ci95"] is None


def test_winogrande_scores_the_same_continuation_after_each_option(tmp_path):
    tok = CharTokenizer(" _abx")
    table = torch.zeros(5, 5)
    table[2, 0] = 5.0  # a -> ' ' is likely, b -> ' ' is not: option "a" wins
    path = write_jsonl(tmp_path / "dev.jsonl",
                       [{"sentence": "x _ x", "option1": "b", "option2": "a", "answer": "2"}])
    task_sets = tasks.load_tasks([("winogrande", path)], tok, 0, 16)
    [result] = tasks.score_tasks(Bigram(table, 16), task_sets, 2, "cpu")
    assert (result["n"], result["acc"], result["acc_norm"]) == (1, 1.0, None)


def tiny_gpt(vocab_size, block_size=16, seed=0):
    torch.manual_seed(seed)
    return GPT(Config(vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_embd=32,
                      embedding="untied")).eval()


def test_real_gpt_batched_equals_unpadded():
    """Right padding and batching change nothing: each row scores as its own unpadded forward."""
    model = tiny_gpt(vocab_size=20)
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 20, c).tolist(), rng.integers(0, 20, w).tolist())
            for c, w in [(3, 1), (1, 4), (10, 2), (30, 5), (5, 16), (2, 2)]]  # (30, 5), (5, 16) cut
    ll, greedy = tasks.loglikelihoods(model, rows, batch_size=4, device="cpu")
    with torch.no_grad():
        for (c, w), got, got_greedy in zip(rows, ll, greedy, strict=True):
            seq = torch.tensor((c + w)[-17:])
            logits, _ = model(seq[None, :-1], seq[None, 1:])
            logp = F.log_softmax(logits[0, -len(w):].double(), dim=-1)
            assert got == pytest.approx(float(logp[range(len(w)), w].sum()), abs=1e-4)
            assert got_greedy == bool((logp.argmax(-1) == torch.tensor(w)).all())
    unbatched, _ = tasks.loglikelihoods(model, rows, batch_size=1, device="cpu")
    assert np.allclose(unbatched, ll, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# the command: a tiny GPT overfit on the right answers, every format, every error in one line

TASK_FILES = {  # one small file per format; the first example of each is right in TRAIN_TEXT
    "lambada": [{"text": "the cat sat on the mat"}, {"text": "a dog ran to the park"}],
    "hellaswag": [{"activity_label": "Cats", "ctx_a": "the cat sat.", "ctx_b": "it", "label": 1,
                   "endings": ["ran to the [title] park.", "sat on the mat."]}],
    "piqa": [{"goal": "how to open a door?", "sol1": "eat the door", "sol2": "turn the knob"}],
    "arc": [{"question": {"stem": "what do cows drink?",
                          "choices": [{"text": "water", "label": "1"},
                                      {"text": "rocks", "label": "2"}]},
             "answerKey": "1"}],
    "winogrande": [{"sentence": "the man hid because _ was afraid.", "option1": "the dog",
                    "option2": "the man", "answer": "2"}],
    "mc": [{"context": "the sun is", "choices": [" hot.", " cold and wet."], "label": 0},
           # 'Z': not in the vocabulary
           {"context": "the Zebra is", "choices": [" hot.", " cold."], "label": 0}],
}
TRAIN_TEXT = ("the cat sat on the mat\na dog ran to the park\n"
              "Cats: the cat sat. It sat on the mat.\n"
              "Question: how to open a door?\nAnswer: turn the knob\n"
              "Question: what do cows drink?\nAnswer: water\n"
              "the man hid because the man was afraid.\nthe man hid because the dog was barking.\n"
              "the sun is hot.\n")


def save_run(path, model, chars):
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": len(chars), "chars": chars}
    os.makedirs(path, exist_ok=True)
    torch.save({"version": CHECKPOINT_VERSION, "model": model.state_dict(),
                "model_config": asdict(model.config), "meta": meta, "step": 0, "tokens_seen": 0},
               os.path.join(path, "ckpt.pt"))
    return meta


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """tmp/data/tiny (char-level), tmp/out-tied (a GPT overfit on TRAIN_TEXT), tmp/out-lev
    (untrained), and the task files in tmp/tasks -> tmp."""
    root = tmp_path_factory.mktemp("world")
    # every character but 'Z'
    chars = "".join(sorted(set(TRAIN_TEXT + json.dumps(TASK_FILES)) - {"Z"}))
    tok = CharTokenizer(chars)
    ids = torch.tensor(tok.encode(TRAIN_TEXT * 8))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=len(chars), block_size=64, n_layer=2, n_head=2, n_embd=64,
                       embedding="tied"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(250):
        starts = torch.randint(0, len(ids) - 65, (16,))
        batch = torch.stack([ids[s:s + 65] for s in starts])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(previous)
    assert loss.item() < 0.1, loss.item()  # overfit: the right answers are what it learnt
    meta = save_run(root / "out-tied", model.eval(), chars)
    torch.manual_seed(1)
    untrained = GPT(Config(vocab_size=len(chars), block_size=32, n_layer=1, n_head=2, n_embd=32,
                           embedding="lev", lev_seed_dim=16, lev_heads=2, lev_rank=8))
    save_run(root / "out-lev", untrained, chars)
    data = root / "data" / "tiny"
    os.makedirs(data)
    for split, text in [("train", TRAIN_TEXT * 4), ("val", TRAIN_TEXT)]:
        np.array(tok.encode(text), dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({**meta, "dtype": "uint16", "source": "synthetic",
                                                "train_tokens": 4 * len(TRAIN_TEXT),
                                                "val_tokens": len(TRAIN_TEXT)}))
    os.makedirs(root / "tasks")
    for name, records in TASK_FILES.items():
        file = "valid.jsonl" if name == "piqa" else f"{name}.jsonl"
        write_jsonl(root / "tasks" / file, records)
    (root / "tasks" / "valid-labels.lst").write_text("1\n")
    return root


def task_flags(root):
    files = {n: "valid.jsonl" if n == "piqa" else n + ".jsonl" for n in TASK_FILES}
    return [f"--task={n}:{root / 'tasks' / files[n]}" for n in TASK_FILES]


def test_end_to_end_every_format(world, run_cli, monkeypatch):
    monkeypatch.chdir(world)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    plot = ["--plot=res/compare.png"] if has_matplotlib else []
    code, out, err = run_cli(ev.main, ["out-tied", "out-lev", "--device=cpu", "--lambada_max=0",
                                       "--json=res/compare.json", *task_flags(world), *plot])
    assert code == 0, err
    assert "| task | arm | n | acc | acc_norm | word ppl |" in out
    assert "| lambada | tied | 2 | 1.000 ± 0.000 | - | " in out
    for name in ("hellaswag", "piqa", "arc"):
        assert f"| {name} | tied | 1 | 1.000 ± 0.000 | 1.000 ± 0.000 | - |" in out
    assert "| winogrande | tied | 1 | 1.000 ± 0.000 | - | - |" in out
    assert "| mc | tied | 1 | 1.000 ± 0.000 | 1.000 ± 0.000 | - |" in out
    assert "| mc | lev | 1 | " in out
    assert "- mc: 1 of 2 examples skipped for every arm (first: " in out
    assert "mc.jsonl:2: characters not in" in out

    result = json.loads(Path("res/compare.json").read_text())
    assert [t["label"] for t in result["tasks"]] == list(TASK_FILES)
    tied, lev = result["arms"]
    assert [r["task"] for r in tied["tasks"]] == list(TASK_FILES)
    assert all(r["acc"] == 1.0 for r in tied["tasks"]) and tied["tasks"][0]["ppl"] < 1.5
    assert lev["tasks"][0]["ppl"] > 100  # untrained: a word of several characters is far from sure
    assert {r["n"] for r in lev["tasks"]} == {1, 2}
    if has_matplotlib:
        assert Path("res/compare_tasks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sorted(os.listdir("res")) == ["compare.json", "compare.png", "compare_tasks.png"]
    # the cap: one lambada example of two, the first; the table says so
    code, out, err = run_cli(ev.main, ["out-tied", "--lambada_max=0", "--task_max=1",
                                       task_flags(world)[0]])
    assert code == 0 and "| lambada | tied | 1 | " in out
    assert "- lambada: 1 of 2 examples, evenly spaced" in out


def test_command_errors_are_one_line(world, run_cli, monkeypatch):
    monkeypatch.chdir(world)
    Path("tasks/bad.jsonl").write_text('{"context": "a", "choices": [" b", " c"], "label": 0}\n'
                                       '{"context": "a"\n')
    Path("tasks/empty.jsonl").write_text("")
    Path("tasks/nolabel.jsonl").write_text('{"context": "a", "choices": [" b", " c"]}\n')
    Path("tasks/range.jsonl").write_text('{"context": "a", "choices": [" b", " c"], "label": 2}\n')
    Path("tasks/one.jsonl").write_text('{"context": "a", "choices": [" b"], "label": 0}\n')
    cases = [
        ("--task=mc:tasks/bad.jsonl", "tasks/bad.jsonl:2: not valid JSON"),
        ("--task=mc:tasks/empty.jsonl", "tasks/empty.jsonl: no examples (the file is empty)"),
        ("--task=mc:tasks/nolabel.jsonl", "tasks/nolabel.jsonl:1: missing field 'label'"),
        ("--task=mc:tasks/range.jsonl",
         "tasks/range.jsonl:1: label 2 is out of range for 2 choices"),
        ("--task=piqa:tasks/none.jsonl", "tasks/none.jsonl: no such file"),
        ("--task=squad:tasks/bad.jsonl", "unknown task 'squad' in --task=squad:tasks/bad.jsonl"),
        ("--task=tasks/bad.jsonl", "--task=tasks/bad.jsonl must be NAME:PATH"),
        ("--task_max=-1", "--task_max=-1 must be >= 0"),
        ("--task=mc:tasks/one.jsonl", "tasks/one.jsonl:1: field 'choices' has 1 choice"),
    ]
    for flag, message in cases:
        code, out, err = run_cli(ev.main, ["out-tied", "--lambada_max=0", flag])
        assert code == 2, (flag, err)
        assert err.startswith("eval.py: error: " + message) and err.count("\n") == 1, (flag, err)
    # the script itself: exit code 2, no traceback
    bad = subprocess.run([sys.executable, str(ROOT / "lab" / "eval.py"), "out-tied",
                          "--task=mc:tasks/bad.jsonl"], cwd=world, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == ("eval.py: error: tasks/bad.jsonl:2: not valid JSON (Expecting ',' "
                          "delimiter at column 16)\n")


def test_the_cases_of_issue_22_at_the_command(world, run_cli, monkeypatch):
    """A line of 100,000 nested lists (a traceback of 33 lines before); one file given twice; two
    files of one name in two folders (one label for both before)."""
    monkeypatch.chdir(world)
    Path("tasks/deep.jsonl").write_text('{"question": ' + "[" * DEEP + "]" * DEEP
                                        + ', "answerKey": "A"}\n')
    deep = subprocess.run([sys.executable, str(ROOT / "lab" / "eval.py"), "out-tied",
                           "--lambada_max=0", "--task=arc:tasks/deep.jsonl"], cwd=world,
                          capture_output=True, text=True)
    assert deep.returncode == 2 and deep.stdout == ""
    assert deep.stderr == ("eval.py: error: tasks/deep.jsonl:1: not readable as JSON (nested too "
                           "deeply: more levels than Python's recursion limit)\n")
    code, out, err = run_cli(ev.main, ["out-tied", "--lambada_max=0", "--task=arc:tasks/arc.jsonl",
                                       "--task=arc:./tasks/arc.jsonl"])
    assert code == 2 and not out and err == ("eval.py: error: --task=arc:./tasks/arc.jsonl is the "
                                             "file of --task=arc:tasks/arc.jsonl again; give each "
                                             "task file once\n")
    for folder in ("easy", "challenge"):
        os.makedirs(f"tasks/{folder}", exist_ok=True)
        write_jsonl(f"tasks/{folder}/test.jsonl", TASK_FILES["arc"])
    code, out, err = run_cli(ev.main, ["out-tied", "out-lev", "--lambada_max=0", "--json=two.json",
                                       "--task=arc:tasks/easy/test.jsonl",
                                       "--task=arc:tasks/challenge/test.jsonl"])
    assert code == 0, err
    for label in ("arc (easy/test.jsonl)", "arc (challenge/test.jsonl)"):
        assert f"| {label} | tied | 1 | 1.000 ± 0.000 |" in out and f"| {label} | lev | 1 |" in out
    result = json.loads(Path("two.json").read_text())
    assert [t["label"] for t in result["tasks"]] == ["arc (easy/test.jsonl)",
                                                     "arc (challenge/test.jsonl)"]
    assert [r["task"] for r in result["arms"][0]["tasks"]] == [t["label"] for t in result["tasks"]]


def test_help_documents_the_formats(run_cli):
    code, out, _ = run_cli(ev.main, ["--help"])
    assert code == 0 and "--task NAME:PATH" in out and "--task_max" in out
    for name in tasks.TASKS:
        assert f"\n  {name} " in out
