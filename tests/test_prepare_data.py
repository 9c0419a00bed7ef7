"""prepare_data.py and the format it writes: a text file, downloaded or given, -> train.bin,
val.bin, meta.json; lab/dataset.py's reading helpers; the command line (all hermetic).
Corpora (lab/prepare_corpus.py): tests/test_prepare_corpus.py."""

import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
import tiktoken
from conftest import ROOT, prepare_text

import prepare_data
from lab import dataset


def is_one_line_error(err):
    """The one-line error every script promises (README), no traceback."""
    return (err.startswith("prepare_data.py: error: ") and err.count("\n") == 1
            and "Traceback" not in err)


def read_both_splits(data_dir):
    return dataset.load_split(data_dir, "train"), dataset.load_split(data_dir, "val")


def test_char_dataset_format_and_round_trip(tmp_path, text):
    data_dir = str(tmp_path / "chars")
    meta = prepare_text(text, "char", data_dir, "chars", "synthetic.txt")
    assert dataset.load_meta(data_dir) == meta
    split_at = int(len(text) * 0.9)  # nanoGPT's split: 90% of the characters
    today = {"dataset": "chars", "tokenizer": "char", "vocab_size": len(set(text)),
             "dtype": "uint16", "train_tokens": split_at, "val_tokens": len(text) - split_at,
             "chars": "".join(sorted(set(text))), "source": "synthetic.txt"}
    assert {key: meta[key] for key in today} == today  # the keys readers have always had, unchanged
    # and what a reader needs to trust the data: what went in, and how it was split
    data = text.encode("utf-8")
    (record,) = meta["inputs"]
    assert os.path.basename(record.pop("name")) == "synthetic.txt"
    assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert (meta["split"]["by"], meta["eot_token"], meta["train_documents"],
            meta["val_documents"]) == ("characters", None, 1, 1)
    train, val = read_both_splits(data_dir)
    assert train.dtype == np.uint16 and len(train) == split_at
    tok = dataset.get_tokenizer(meta)
    assert (tok.name, tok.vocab_size) == ("char", meta["vocab_size"])
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    assert tok.encode("the cat") == [meta["chars"].index(c) for c in "the cat"]
    with pytest.raises(ValueError, match=r"'#@'"):  # names the missing characters, sorted
        tok.encode("the @cat#")


def test_tiktoken_dataset_from_an_in_process_encoding(tmp_path, text, tiny_encoding):
    data_dir = str(tmp_path / "bpe")
    meta = prepare_text(text, tiny_encoding, data_dir, "bpe", "synthetic.txt")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("tiny", 256, "uint16")
    assert "chars" not in meta
    train, val = read_both_splits(data_dir)
    split_at = int(len(text) * 0.9)
    assert train.tolist() == tiny_encoding.encode_ordinary(text[:split_at])
    assert val.tolist() == tiny_encoding.encode_ordinary(text[split_at:])
    tok = dataset.get_tokenizer(meta, encoding=tiny_encoding)
    assert tok.decode(tok.encode("<|endoftext|> is text here")) == "<|endoftext|> is text here"


def test_large_vocabularies_are_stored_as_uint32(tmp_path, text):
    # a vocabulary past 65,536 ids (as o200k_base's 200,019): uint16 would wrap the large ids
    big = tiktoken.Encoding(name="big", pat_str=r""" ?\w+| ?[^\s\w]+|\s+""",
                            mergeable_ranks={bytes([i]): 69_999 - i for i in range(256)},
                            special_tokens={"<|end|>": 70_000})  # n_vocab = 70,001
    data_dir = str(tmp_path / "big")
    meta = prepare_text(text, big, data_dir, "big", "synthetic.txt")
    assert (meta["vocab_size"], meta["dtype"]) == (70_001, "uint32")
    train, val = read_both_splits(data_dir)
    assert train.dtype == np.uint32 and int(train.min()) > 65_535
    tok = dataset.get_tokenizer(meta, encoding=big)
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text


def test_reading_helpers_say_how_to_fix_a_missing_or_broken_dataset(tmp_path, text):
    with pytest.raises(FileNotFoundError, match=r"python prepare_data\.py shakespeare$"):
        dataset.load_meta(str(tmp_path / "shakespeare"))
    with pytest.raises(FileNotFoundError,
                       match=r"python prepare_data\.py mine --input=path/to/text\.txt"):
        dataset.load_split(str(tmp_path / "mine"), "train")
    data_dir = str(tmp_path / "mine")
    prepare_text(text, "char", data_dir, "mine", "synthetic.txt")
    with open(os.path.join(data_dir, "val.bin"), "ab") as f:
        f.write(b"\0\0")  # one token too many: not what meta.json says
    with pytest.raises(ValueError, match=r"val\.bin is .* bytes, meta\.json expects"):
        dataset.load_split(data_dir, "val")
    meta = dataset.load_meta(data_dir)
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump({"tokenizer": "char"}, f)
    with pytest.raises(ValueError,
                       match="lacks vocab_size, dtype, train_tokens, val_tokens; prepare"):
        dataset.load_meta(data_dir)
    meta["vocab_size"] += 1
    with pytest.raises(ValueError, match="prepare the dataset again"):
        dataset.get_tokenizer(meta)


def test_unavailable_tiktoken_encodings_give_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*o200k_base"):
        dataset.load_encoding("nope")

    def offline(name):
        raise ConnectionError("no network")

    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*o200k_base"):
        prepare_data.load_tokenizer("nope")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    for load in (dataset.load_encoding, prepare_data.load_tokenizer):
        with pytest.raises(ValueError, match="'o200k_base' could not be loaded.*TIKTOKEN_CACHE"):
            load("o200k_base")


def test_command_line_errors_are_one_line_with_exit_code_2(tmp_path, run_cli, monkeypatch,
                                                           fails_after_a_minute):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", offline)
    data = f"--data_dir={tmp_path}"
    not_shakespeare = tmp_path / "not_shakespeare.txt"
    not_shakespeare.write_text("To be or not to be.\n" * 100)
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("line one\ncafé\n".encode("latin-1") * 100)
    (tmp_path / "abc.txt").write_text("abc")  # 3 characters: 1 val token, no window to score
    (tmp_path / "aaa.txt").write_text("a" * 1000)  # one distinct character: one token
    (tmp_path / "read_only").write_text("")  # a file where the data folder should be
    os.mkfifo(tmp_path / "pipe.txt")  # opened to read, it would wait for a writer forever
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket.txt"))
    os.symlink("nowhere.txt", tmp_path / "broken.txt")
    lab = "a corpus .*; prepare it with: python lab/prepare_corpus\\.py mine --input="
    cases = [
        # offline: says how to pass a local file
        (["shakespeare", data], "--input=path/to/input.txt"),
        (["mine", data], "unknown dataset 'mine'"),
        ([data], "the following arguments are required: name \\(see --help\\)"),
        (["mine", data, f"--input={not_shakespeare}", "--workers=2"],
         "unrecognized arguments: --workers=2"),
        # the sha256 is checked
        (["shakespeare", data, f"--input={not_shakespeare}"], "expected 86c4e6aa"),
        (["mine", data, f"--input={tmp_path / 'missing.txt'}"], "no such file"),
        (["mine", data, f"--input={tmp_path / 'broken.txt'}"], "no such file"),
        (["mine", data, f"--input={not_utf8}"],
         "latin1.txt, line 2: not UTF-8 text \\(byte 12: b'\\\\xe9\\\\nli'\\)"),
        (["mine", data, f"--input={not_shakespeare}", "--tokenizer=nope"], "unknown tokenizer"),
        (["mine", data, f"--input={not_shakespeare}", "--tokenizer="], "unknown tokenizer ''"),
        (["../up", data, f"--input={not_shakespeare}"], "plain folder name"),
        (["mine", data, f"--input={tmp_path / 'abc.txt'}", "--tokenizer=char"],
         "too short: one text gave 1 val tokens"),
        (["mine", data, f"--input={tmp_path / 'aaa.txt'}", "--tokenizer=char"],
         "has 1 distinct character.*dataset mine needs at least 2 tokens"),
        (["mine", f"--data_dir={tmp_path / 'read_only'}", f"--input={not_shakespeare}"],
         "cannot write .*read_only/mine .not a directory.; make it writable, or prepare into "
         "another folder"),
        # not one text file: a FIFO, a socket, a device; a corpus, named with its command
        (["mine", data, f"--input={tmp_path / 'pipe.txt'}"], "pipe.txt: .*not a regular one"),
        (["mine", data, f"--input={tmp_path / 'socket.txt'}"], "not a regular one"),
        (["mine", data, "--input=/dev/null"], "not a regular one"),
        (["mine", data, f"--input={tmp_path}"], lab + re.escape(f"'{tmp_path}'")),
        (["mine", data, f"--input={tmp_path}/*.txt"], lab),
        (["mine", data, f"--input={tmp_path / 'docs.jsonl'}"], lab),
        (["mine", data, f"--input={not_shakespeare}.gz"], lab),
        (["mine", data, f"--input={tmp_path / 'rows.parquet'}"], lab),
        (["shakespeare", data, f"--input={tmp_path}"], "python lab/prepare_corpus\\.py"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(prepare_data.main, argv)
        assert code == 2, argv
        assert is_one_line_error(err) and re.search(message, err), (argv, err)
    server.close()
    assert not (tmp_path / "mine").exists() and not (tmp_path / "up").exists()


def test_help_lists_every_flag(run_cli):
    code, out, _ = run_cli(prepare_data.main, ["--help"])
    assert code == 0 and "lab/prepare_corpus.py" in out
    for flag in ("name", "--input", "--tokenizer", "--data_dir"):
        assert re.search(f"\n  {flag} .*\\w", out), flag


def test_a_named_dataset_is_downloaded_once_and_checked(tmp_path, run_cli, monkeypatch, text):
    """Without --input a named dataset is downloaded next to its .bin files, its sha256 checked, and
    reused while it has the right one. (The real file's sha256 is the script's; a stand-in here.)"""
    downloads = []

    def urlopen(url, timeout):
        downloads.append(url)
        return io.BytesIO(text.encode())

    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(prepare_data, "SHA256", hashlib.sha256(text.encode()).hexdigest())
    argv = ["shakespeare_char", f"--data_dir={tmp_path}"]
    for _ in range(2):
        assert run_cli(prepare_data.main, argv)[0] == 0
    input_txt = tmp_path / "shakespeare_char" / "input.txt"
    assert downloads == [prepare_data.URL] and input_txt.read_text() == text
    meta = dataset.load_meta(str(tmp_path / "shakespeare_char"))
    assert (meta["source"], meta["tokenizer"], meta["inputs"][0]["name"]) == (
        prepare_data.URL, "char", str(input_txt))
    input_txt.write_text("damaged")  # a wrong sha256: downloaded again
    assert run_cli(prepare_data.main, argv)[0] == 0 and len(downloads) == 2
    assert input_txt.read_text() == text
    assert sorted(os.listdir(input_txt.parent)) == ["input.txt", "meta.json", "train.bin",
                                                    "val.bin"]


def test_a_failed_or_interrupted_run_leaves_the_old_dataset(tmp_path, run_cli, monkeypatch, text):
    """A full disk or Ctrl-C while the new files are written leaves the old ones whole, and no
    temporary file."""
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text(text[::-1])
    argv = ["mine", "--tokenizer=char", f"--data_dir={tmp_path / 'data'}"]
    assert run_cli(prepare_data.main, argv + [f"--input={tmp_path / 'a.txt'}"])[0] == 0
    folder = tmp_path / "data" / "mine"
    old = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    assert sorted(old) == ["meta.json", "train.bin", "val.bin"]
    for error, code, says in [(OSError(28, "No space left on device"), 2,
                               "mine .no space left on device.; free disk space"),
                              (KeyboardInterrupt(), 130, "interrupted: .*mine is as it was")]:
        def fsync(fd, error=error, calls=[]):  # noqa: B006 (a new list on each pass of the loop)
            calls.append(fd)
            if len(calls) == 2:  # train.bin is written, val.bin not yet
                raise error

        monkeypatch.setattr(os, "fsync", fsync)
        result = run_cli(prepare_data.main, argv + [f"--input={tmp_path / 'b.txt'}"])
        assert result[0] == code and re.search(says, result[2]), result
        assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == old
    monkeypatch.undo()
    assert run_cli(prepare_data.main, argv + [f"--input={tmp_path / 'b.txt'}"])[0] == 0
    assert (folder / "train.bin").read_bytes() != old["train.bin"]


def test_command_line_prepares_a_local_file(tmp_path, text):
    """The script as a user runs it: a text file in, the counts nanoGPT prints out."""
    (tmp_path / "my.txt").write_text(text, encoding="utf-8")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "my",
                             "--input=my.txt", "--tokenizer=char"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    split_at = int(len(text) * 0.9)
    assert f"train has {split_at:,} tokens" in result.stdout
    assert f"val has {len(text) - split_at:,} tokens" in result.stdout
    meta = json.loads((tmp_path / "data" / "my" / "meta.json").read_text())
    assert (meta["train_tokens"], meta["source"]) == (split_at, "my.txt")
    # no temp files
    assert sorted(os.listdir(tmp_path / "data" / "my")) == ["meta.json", "train.bin", "val.bin"]


def test_preparing_data_loads_nothing_but_numpy_and_tiktoken(tmp_path, text):
    """Issue 21 and issue 41: as nanoGPT's prepare.py, numpy and tiktoken only; no torch (not even
    indirectly), and nothing else of the project (the import log, PYTHONPROFILEIMPORTTIME)."""
    (tmp_path / "my.txt").write_text(text, encoding="utf-8")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "my",
                             "--input=my.txt", "--tokenizer=char"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=os.environ | {"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert {"numpy", "tiktoken"} <= imported
    assert imported & {"torch", "lab", "kernels", "leviathan"} == set()


def test_a_damaged_meta_json_is_one_line(tmp_path, text):
    """meta.json's every failure is one line naming the file and what to do: nesting past the
    recursion limit, bytes that are not UTF-8, an integer too long to convert, and values no
    tokenizer can use."""
    data_dir = str(tmp_path / "mine")
    prepare_text(text, "char", data_dir, "mine", "synthetic.txt")
    meta_path = os.path.join(data_dir, "meta.json")
    good = open(meta_path, "rb").read()
    meta = json.loads(good)
    nested = "[" * 100_000 + "]" * 100_000  # far past Python's recursion limit
    cases = [
        (b'{\n"tokenizer": "char",\n"x": ' + nested.encode() + b"\n}",
         r"meta\.json: nested too deeply to read \(.*\); prepare the dataset again: python "
         r"prepare_data\.py mine --input=path/to/text\.txt$"),
        (b'{"tokenizer": "char",\n"dataset": "caf\xe9"}',
         r"meta\.json: not UTF-8 text \(byte 37\); prepare the dataset again"),
        (b'{"tokenizer": "char",\n\n"n": ' + b"9" * 5000 + b"}",
         r"meta\.json: not valid JSON \(Exceeds the limit \(4300 digits\).*\); prepare"),
        (b'{"tokenizer": "char",\n"n": 1,,}',
         r"meta\.json: not valid JSON \(Expecting .*, line 2, column 8\); prepare the dataset"),
        (json.dumps({**meta, "chars": meta["chars"][:-1] + "\ud800"}).encode(),
         r"'chars' holds a surrogate .*; it was edited or damaged"),
        (json.dumps({**meta, "chars": meta["chars"][:-1] + "a"}).encode(),
         r"a string of vocab_size distinct characters"),
    ]
    for content, message in cases:
        with open(meta_path, "wb") as f:
            f.write(content)
        with pytest.raises(ValueError, match=message):
            dataset.load_meta(data_dir)

