"""prepare_data.py: the format it writes, the reading helpers, and its command line (all hermetic)."""

import json
import os
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
import tiktoken
from conftest import ROOT

import prepare_data


def read_both_splits(data_dir):
    return prepare_data.load_split(data_dir, "train"), prepare_data.load_split(data_dir, "val")


def test_char_dataset_format_and_round_trip(tmp_path, text):
    data_dir = str(tmp_path / "chars")
    meta = prepare_data.prepare(text, "char", data_dir, "chars", "synthetic.txt")
    assert prepare_data.load_meta(data_dir) == meta
    split_at = int(len(text) * 0.9)  # nanoGPT's split: 90% of the characters
    assert meta == {"dataset": "chars", "tokenizer": "char", "vocab_size": len(set(text)), "dtype": "uint16",
                    "train_tokens": split_at, "val_tokens": len(text) - split_at,
                    "chars": "".join(sorted(set(text))), "source": "synthetic.txt"}
    train, val = read_both_splits(data_dir)
    assert train.dtype == np.uint16 and len(train) == split_at
    tok = prepare_data.get_tokenizer(meta)
    assert (tok.name, tok.vocab_size) == ("char", meta["vocab_size"])
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    assert tok.encode("the cat") == [meta["chars"].index(c) for c in "the cat"]
    with pytest.raises(ValueError, match=r"'#@'"):  # names the missing characters, sorted
        tok.encode("the @cat#")


def test_tiktoken_dataset_from_an_in_process_encoding(tmp_path, text, tiny_encoding):
    data_dir = str(tmp_path / "bpe")
    meta = prepare_data.prepare(text, tiny_encoding, data_dir, "bpe", "synthetic.txt")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("tiny", 256, "uint16")
    assert "chars" not in meta
    train, val = read_both_splits(data_dir)
    split_at = int(len(text) * 0.9)
    assert train.tolist() == tiny_encoding.encode_ordinary(text[:split_at])
    assert val.tolist() == tiny_encoding.encode_ordinary(text[split_at:])
    tok = prepare_data.get_tokenizer(meta, encoding=tiny_encoding)
    assert tok.decode(tok.encode("<|endoftext|> is text here")) == "<|endoftext|> is text here"


def test_large_vocabularies_are_stored_as_uint32(tmp_path, text):
    # a vocabulary past 65,536 ids (as o200k_base's 200,019): uint16 would wrap the large ids
    big = tiktoken.Encoding(name="big", pat_str=r""" ?\w+| ?[^\s\w]+|\s+""",
                            mergeable_ranks={bytes([i]): 69_999 - i for i in range(256)},
                            special_tokens={"<|end|>": 70_000})  # n_vocab = 70,001
    data_dir = str(tmp_path / "big")
    meta = prepare_data.prepare(text, big, data_dir, "big", "synthetic.txt")
    assert (meta["vocab_size"], meta["dtype"]) == (70_001, "uint32")
    train, val = read_both_splits(data_dir)
    assert train.dtype == np.uint32 and int(train.min()) > 65_535
    tok = prepare_data.get_tokenizer(meta, encoding=big)
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text


def test_reading_helpers_say_how_to_fix_a_missing_or_broken_dataset(tmp_path, text):
    with pytest.raises(FileNotFoundError, match=r"python prepare_data\.py shakespeare$"):
        prepare_data.load_meta(str(tmp_path / "shakespeare"))
    with pytest.raises(FileNotFoundError, match=r"python prepare_data\.py mine --input=path/to/text\.txt"):
        prepare_data.load_split(str(tmp_path / "mine"), "train")
    data_dir = str(tmp_path / "mine")
    prepare_data.prepare(text, "char", data_dir, "mine", "synthetic.txt")
    with open(os.path.join(data_dir, "val.bin"), "ab") as f:
        f.write(b"\0\0")  # one token too many: not what meta.json says
    with pytest.raises(ValueError, match=r"val\.bin is .* bytes, meta\.json expects"):
        prepare_data.load_split(data_dir, "val")
    meta = prepare_data.load_meta(data_dir)
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump({"tokenizer": "char"}, f)
    with pytest.raises(ValueError, match="lacks vocab_size, dtype, train_tokens, val_tokens; prepare"):
        prepare_data.load_meta(data_dir)
    meta["vocab_size"] += 1
    with pytest.raises(ValueError, match="prepare the dataset again"):
        prepare_data.get_tokenizer(meta)


def test_eval_windows():
    assert prepare_data.eval_windows(101, 10).tolist() == list(range(0, 100, 10))  # 10 windows, 100 targets
    assert prepare_data.eval_windows(100, 10).tolist() == list(range(0, 90, 10))  # the last target is missing
    assert prepare_data.eval_windows(1001, 10, max_windows=4).tolist() == [0, 250, 500, 750]  # evenly spaced
    assert prepare_data.eval_windows(101, 10, max_windows=50).tolist() == list(range(0, 100, 10))
    with pytest.raises(ValueError, match="too short"):
        prepare_data.eval_windows(10, 10)


def test_unavailable_tiktoken_encodings_give_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*o200k_base"):
        prepare_data.load_encoding("nope")

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(ValueError, match="'o200k_base' could not be loaded.*TIKTOKEN_CACHE_DIR"):
        prepare_data.load_encoding("o200k_base")


def test_command_line_errors_are_one_line_with_exit_code_2(tmp_path, run_cli, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", offline)
    data = f"--data_dir={tmp_path}"
    not_shakespeare = tmp_path / "not_shakespeare.txt"
    not_shakespeare.write_text("To be or not to be.\n" * 100)
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("café\n".encode("latin-1") * 100)
    cases = [
        (["shakespeare", data], "--input=path/to/input.txt"),  # offline: says how to pass a local file
        (["mine", data], "unknown dataset 'mine'"),
        (["shakespeare", data, f"--input={not_shakespeare}"], "expected 86c4e6aa"),  # the sha256 is checked
        (["mine", data, f"--input={tmp_path / 'missing.txt'}"], "no such file"),
        (["mine", data, f"--input={not_utf8}"], "not UTF-8"),
        (["mine", data, f"--input={not_shakespeare}", "--tokenizer=nope"], "unknown tokenizer"),
        (["../up", data, f"--input={not_shakespeare}"], "plain folder name"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(prepare_data.main, argv)
        assert code == 2, argv
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "mine").exists()


def test_command_line_prepares_a_local_file(tmp_path, text):
    """The script as a user runs it: a text file in, the counts nanoGPT prints out."""
    (tmp_path / "my.txt").write_text(text, encoding="utf-8")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "my", "--input=my.txt",
                             "--tokenizer=char"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    split_at = int(len(text) * 0.9)
    assert f"train has {split_at:,} tokens" in result.stdout
    assert f"val has {len(text) - split_at:,} tokens" in result.stdout
    meta = json.loads((tmp_path / "data" / "my" / "meta.json").read_text())
    assert (meta["train_tokens"], meta["source"]) == (split_at, "my.txt")
    assert sorted(os.listdir(tmp_path / "data" / "my")) == ["meta.json", "train.bin", "val.bin"]  # no temp files
