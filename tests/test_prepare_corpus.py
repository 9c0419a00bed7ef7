"""lab/prepare_corpus.py and its pipeline (lab/corpus.py, lab/corpus_readers.py): corpora bigger
than memory (directories, globs, .jsonl, .gz, Parquet), streamed on worker processes, split by whole
documents; one text file streamed gives prepare_data.py's files (all hermetic)."""

import glob
import gzip
import hashlib
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
from conftest import ROOT, make_text

import prepare_data
from lab import corpus, corpus_readers, dataset, prepare_corpus


def is_one_line_error(err):
    """The one-line error every script promises (README), no traceback."""
    return (err.startswith("prepare_corpus.py: error: ") and err.count("\n") == 1
            and "Traceback" not in err)


def read_both_splits(data_dir):
    return dataset.load_split(data_dir, "train"), dataset.load_split(data_dir, "val")



@pytest.fixture
def eot_encoding(tiny_encoding):
    """The tiny byte-level encoding plus an <|endoftext|> (id 256) to separate documents."""
    return tiktoken.Encoding(name="tiny_eot", pat_str=tiny_encoding._pat_str,
                             mergeable_ranks=tiny_encoding._mergeable_ranks,
                             special_tokens={"<|endoftext|>": 256})


@pytest.fixture
def use_encoding(monkeypatch):
    """use_encoding(enc): the command line's --tokenizer=<enc.name> gets this in-process
    encoding."""
    def use(encoding):
        load_encoding = dataset.load_encoding
        monkeypatch.setattr(corpus, "load_encoding",
                            lambda name: encoding if name == encoding.name else load_encoding(name))
    return use


def documents_of(n, seed=0):
    """n distinct documents of a few lines each."""
    return [f"Document {i}.\n" + make_text(n_lines=1 + i % 4, seed=seed + i) for i in range(n)]


def expected_splits(documents, encoding):
    """What a corpus of these documents, in this order, must give: each document's tokens and the
    separator, in train or val as its index decides."""
    splits = {"train": [], "val": []}
    for i, doc in enumerate(documents):
        split = "val" if corpus.is_val_document([i])[0] else "train"
        splits[split] += encoding.encode_ordinary(doc) + [encoding.eot_token]
    return splits


def write_jsonl(path, texts, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts))


def test_safe_cuts_tokenize_like_the_whole_text(monkeypatch):
    """A text is tokenized in pieces (bounded memory); cut where safe_cut says, the pieces give
    exactly the tokens of the whole, under the pre-tokenizing patterns of tiktoken's encodings and
    merges across spaces and lines."""
    from tiktoken_ext import openai_public

    ranks = {bytes([i]): i for i in range(256)}
    for merge in [b"\n\n", b".\n", b" t", b"th", b"he", b" the", b"at", b" c", b" cat", b"  ",
                  b"   ", b"\n\n\n", b"e.", b"12", b"123", b" 1", b"'s", b"\r\n", b" \n", b"s.",
                  b"t\n", b"?\n"]:
        ranks[merge] = len(ranks)
    # only the patterns are tiktoken's
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: ranks)
    monkeypatch.setattr(openai_public, "data_gym_to_mergeable_bpe_ranks",
                        lambda *args, **kwargs: ranks)
    ends = ["?\n\n", ". 123 ", "'s.\n  ", ".\r\n", "!  \n"]
    messy = "".join(make_text(50, seed).replace(".", ends[seed]) + " x1 " for seed in range(5))
    for spec in (openai_public.gpt2(), openai_public.cl100k_base(), openai_public.o200k_base()):
        encoding = tiktoken.Encoding(name="t", pat_str=spec["pat_str"], mergeable_ranks=ranks,
                                     special_tokens={})
        blocks = [messy[i:i + 7] for i in range(0, len(messy), 7)]
        pieces = list(corpus_readers.text_pieces(iter(blocks), piece_chars=20))
        assert len(pieces) > 100 and "".join(p for p, _ in pieces) == messy
        assert [last for _, last in pieces] == [False] * (len(pieces) - 1) + [True]
        tokens = sum((encoding.encode_ordinary(p) for p, _ in pieces), [])
        assert tokens == encoding.encode_ordinary(messy)


def test_one_text_file_streamed_in_small_pieces_gives_todays_tokens(tmp_path, text, tiny_encoding,
                                                                    monkeypatch):
    """One text file: nanoGPT's split by characters, no separator, whatever the buffer size (.gz
    too)."""
    # many blocks and pieces, cut across the split point
    monkeypatch.setattr(corpus_readers, "READ_BYTES", 64)
    split_at = int(len(text) * 0.9)
    for name, opener in (("one.txt", open), ("one.txt.gz", gzip.open)):
        with opener(tmp_path / name, "wt", encoding="utf-8") as f:
            f.write(text)
        meta = corpus.prepare_files(str(tmp_path / name), tiny_encoding, str(tmp_path / name[:-4]),
                                    "one")
        train, val = read_both_splits(str(tmp_path / name[:-4]))
        assert train.tolist() == tiny_encoding.encode_ordinary(text[:split_at])
        assert val.tolist() == tiny_encoding.encode_ordinary(text[split_at:])
        sha256 = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        assert meta["inputs"][0]["sha256"] == sha256


def test_one_text_file_gives_prepare_data_files_byte_for_byte(tmp_path, tiny_encoding, run_cli,
                                                             monkeypatch):
    """prepare_data.py reads a text whole; lab/prepare_corpus.py streams it in pieces (here many,
    cut across the split point): the same train.bin, val.bin and meta.json, char-level (both
    command lines) and BPE, with "\r\n" line ends and characters of several bytes."""
    monkeypatch.setattr(corpus_readers, "READ_BYTES", 64)
    text = make_text(seed=3).replace(".\n", ".\r\n", 50).replace("cat", "café ☕ cat")
    path = tmp_path / "one.txt"
    path.write_bytes(text.encode("utf-8"))

    def same_files(a, b):
        return all((a / f).read_bytes() == (b / f).read_bytes()
                   for f in ("train.bin", "val.bin", "meta.json"))

    argv = ["one", f"--input={path}", "--tokenizer=char"]
    assert run_cli(prepare_data.main, argv + [f"--data_dir={tmp_path / 'a'}"])[0] == 0
    assert run_cli(prepare_corpus.main, argv + [f"--data_dir={tmp_path / 'b'}", "--workers=1"]
                   )[0] == 0
    assert same_files(tmp_path / "a" / "one", tmp_path / "b" / "one")
    assert dataset.load_meta(str(tmp_path / "a" / "one"))["vocab_size"] == len(set(text))
    prepare_data.prepare(str(path), tiny_encoding, str(tmp_path / "c"), "one", "one.txt")
    corpus.prepare_files(str(path), tiny_encoding, str(tmp_path / "d"), "one", "one.txt")
    assert same_files(tmp_path / "c", tmp_path / "d")
    train, _ = read_both_splits(str(tmp_path / "c"))
    assert train.tolist() == tiny_encoding.encode_ordinary(text[:int(len(text) * 0.9)])


def test_a_directory_of_mixed_files(tmp_path, eot_encoding, use_encoding, run_cli):
    """Text files, .jsonl, their .gz forms and Parquet (with pyarrow), recursively, in sorted order:
    the tokens of each document and one <|endoftext|> after each, hidden and other files ignored."""
    docs = documents_of(12)
    docs[4] += "A text may hold <|endoftext|>, which is text, not a separator."
    folder = tmp_path / "corpus"
    (folder / "sub" / ".git").mkdir(parents=True)
    (folder / "a.txt").write_text(docs[0], encoding="utf-8")
    with gzip.open(folder / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(docs[1])
    (folder / "notes.md").write_text("not a corpus file")
    (folder / ".hidden.txt").write_text("hidden")
    (folder / "sub" / ".git" / "c.txt").write_text("hidden too")
    # blank lines and an empty text: skipped
    records = "".join(json.dumps({"text": t}) + "\n\n" for t in docs[2:6])
    (folder / "sub" / "c.jsonl").write_text(records + json.dumps({"text": ""}) + "\n")
    write_jsonl(folder / "sub" / "d.jsonl.gz", docs[6:9], opener=gzip.open)
    (folder / "sub" / "e_empty.txt").write_text("")
    expected_docs = docs[:9]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": docs[9:12], "n": [1, 2, 3]}), folder / "sub" / "f.parquet")
        expected_docs = docs
    except ImportError:
        pass
    use_encoding(eot_encoding)
    code, out, err = run_cli(prepare_corpus.main, ["mixed", f"--input={folder}",
                                                 "--tokenizer=tiny_eot", "--workers=2",
                                                 f"--data_dir={tmp_path / 'data'}"])
    assert code == 0, err
    assert err == ""  # no progress lines in a short run
    data_dir = str(tmp_path / "data" / "mixed")
    train, val = read_both_splits(data_dir)
    expected = expected_splits(expected_docs, eot_encoding)
    assert train.tolist() == expected["train"] and val.tolist() == expected["val"] and len(val) > 0
    meta = dataset.load_meta(data_dir)
    n_documents = meta["train_documents"] + meta["val_documents"]
    assert (meta["eot_token"], meta["split"]["by"], n_documents) == (256, "documents",
                                                                     len(expected_docs))
    names = [os.path.relpath(record["name"], folder) for record in meta["inputs"]]
    all_names = ["a.txt", "b.txt.gz", "sub/c.jsonl", "sub/d.jsonl.gz", "sub/e_empty.txt",
                 "sub/f.parquet"]
    assert names == all_names[:len(names)] and len(names) >= 5
    for record in meta["inputs"]:
        data = open(record["name"], "rb").read()
        assert (record["bytes"], record["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert f"documents: {meta['train_documents']:,} train" in out
    # the summary's peak memory: this process's, and its largest worker's (ended children)
    assert re.search(r"in [\d.]+ s, peak memory \d+ MiB \(\+ \d+ MiB per worker\)$", out.strip())


def test_split_is_by_whole_documents_fixed_and_seeded(tmp_path, eot_encoding):
    docs = documents_of(400)
    write_jsonl(tmp_path / "docs.jsonl", docs)
    meta = corpus.prepare_files(str(tmp_path / "docs.jsonl"), eot_encoding, str(tmp_path / "d"),
                                "d")
    train, val = read_both_splits(str(tmp_path / "d"))
    val_docs = eot_encoding.decode(val.tolist()).split("<|endoftext|>")
    # whole documents, never a cut one
    assert val_docs[-1] == "" and set(val_docs[:-1]) <= set(docs)
    assert 0.05 < meta["val_documents"] / len(docs) < 0.15
    assert meta["val_documents"] == len(val_docs) - 1
    assert meta["split"] == {"by": "documents", "val_fraction": 0.1, "seed": 1337}
    # which documents go to val is fixed: a change of the rule would silently change every corpus's
    # val split
    assert np.flatnonzero(corpus.is_val_document(np.arange(40))).tolist() == [6, 18, 20, 22, 27, 28]


def test_one_and_several_workers_write_identical_files(tmp_path, eot_encoding, text, monkeypatch):
    monkeypatch.setattr(corpus_readers, "READ_BYTES", 256)  # many work items in flight
    write_jsonl(tmp_path / "a.jsonl", documents_of(60))
    (tmp_path / "b.txt").write_text(text * 3, encoding="utf-8")  # one document in many pieces
    write_jsonl(tmp_path / "c.jsonl", documents_of(40, seed=7))
    files = {}
    for workers in (1, 3):
        out_dir = tmp_path / f"w{workers}"
        corpus.prepare_files(str(tmp_path / "*.*"), eot_encoding, str(out_dir), "w",
                             workers=workers)
        files[workers] = [(out_dir / name).read_bytes() for name in ("train.bin", "val.bin")]
    assert files[1] == files[3] and len(files[1][0]) > 2 * len(text) * 3


def test_vocabularies_past_65536_give_uint32_corpora(tmp_path):
    big = tiktoken.Encoding(name="big", pat_str=r""" ?\w+| ?[^\s\w]+|\s+""",
                            mergeable_ranks={bytes([i]): 69_999 - i for i in range(256)},
                            special_tokens={"<|endoftext|>": 70_000})
    # (o200k_base's 200,019 ids are uint32 too)
    write_jsonl(tmp_path / "docs.jsonl", documents_of(20))
    meta = corpus.prepare_files(str(tmp_path / "docs.jsonl"), big, str(tmp_path / "big"), "big")
    train, _ = read_both_splits(str(tmp_path / "big"))
    assert (meta["dtype"], train.dtype, int(train.max())) == ("uint32", np.uint32, 70_000)


def test_an_interrupted_or_failed_preparation_leaves_the_old_dataset(tmp_path, eot_encoding,
                                                                     monkeypatch):
    data = tmp_path / "data"
    write_jsonl(tmp_path / "docs.jsonl", documents_of(50))
    corpus.prepare_files(str(tmp_path / "docs.jsonl"), eot_encoding, str(data / "d"), "d")
    old = {name: (data / "d" / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    # a killed run's folder (no such process): removed by the next run
    (data / ".d.tmp999999999").mkdir()
    calls = []
    tokenize_item = corpus.tokenize_item

    def interrupted(item):
        calls.append(item)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the corpus
        return tokenize_item(item)

    monkeypatch.setattr(corpus_readers, "READ_BYTES", 512)
    monkeypatch.setattr(corpus, "tokenize_item", interrupted)
    write_jsonl(tmp_path / "more.jsonl", documents_of(80, seed=3))
    with pytest.raises(KeyboardInterrupt):
        corpus.prepare_files(str(tmp_path / "more.jsonl"), eot_encoding, str(data / "d"), "d")
    assert len(calls) == 3
    assert {name: (data / "d" / name).read_bytes() for name in old} == old
    assert sorted(os.listdir(data)) == ["d"]  # no temporary folder left, the stale one removed
    with open(tmp_path / "more.jsonl", "a") as f:
        f.write('{"text": "fine"}\n{"txt": "the last line is bad"}\n')
    monkeypatch.setattr(corpus, "tokenize_item", tokenize_item)
    with pytest.raises(ValueError, match=r"more\.jsonl, line 82: no 'text' field"):
        corpus.prepare_files(str(tmp_path / "more.jsonl"), eot_encoding, str(data / "d"), "d")
    assert {name: (data / "d" / name).read_bytes() for name in old} == old
    assert sorted(os.listdir(data)) == ["d"]
    corpus.prepare_files(str(tmp_path / "docs.jsonl"), eot_encoding, str(data / "e"), "e")
    # a new dataset: one rename
    assert sorted(os.listdir(data / "e")) == ["meta.json", "train.bin", "val.bin"]


def test_bad_corpus_inputs_give_one_line_errors_naming_file_and_line(tmp_path, eot_encoding,
                                                                     use_encoding, run_cli):
    use_encoding(eot_encoding)
    good = [json.dumps({"text": t}) for t in documents_of(20)]

    def folder_of(name, files):
        folder = tmp_path / name
        folder.mkdir()
        for file_name, content in files.items():
            (folder / file_name).write_bytes(content)
        return folder

    def lines(records):
        return "\n".join(records).encode()

    broken = folder_of("broken_link", {"a.jsonl": lines(good)})
    os.symlink(tmp_path / "nowhere.txt", broken / "b.txt")
    corrupt_gz = gzip.compress(lines(good))
    cases = [
        (broken, r"cannot read .*broken_link/b\.txt"),
        (folder_of("no_field", {"a.jsonl": lines(good[:5] + ['{"body": "x"}'] + good)}),
         r"no_field/a\.jsonl, line 6: no 'text' field \(found: body\); choose the field with "
         r"--text_field"),
        (folder_of("bad_json", {"a.jsonl": lines(good[:3] + ['{"text": "unterminated'] + good)}),
         r"bad_json/a\.jsonl, line 4: not valid JSON"),
        (folder_of("not_text", {"a.jsonl": lines(good[:2] + ['{"text": 7}'])}),
         r"not_text/a\.jsonl, line 3: field 'text' is int, not text"),
        (folder_of("corrupt_gz", {"a.jsonl.gz": corrupt_gz[:len(corrupt_gz) // 2]}),
         r"corrupt_gz/a\.jsonl\.gz: corrupt or truncated gzip data"),
        (folder_of("not_gz", {"a.txt.gz": b"plain text, not gzip"}),
         r"not_gz/a\.txt\.gz: corrupt or truncated gzip"),
        (folder_of("latin1", {"a.jsonl": lines(good),
                              "b.txt": "line one\ncaf\xe9\n".encode("latin-1")}),
         r"latin1/b\.txt, line 2: not UTF-8 text \(byte 12: b'\\xe9\\n'\)"),
        (folder_of("latin1_jsonl",
                   {"a.jsonl": ('{"text": "ok"}\n{"text": "caf\xe9"}\n').encode("latin-1")}),
         r"latin1_jsonl/a\.jsonl, line 2: not UTF-8"),
        (folder_of("few", {"a.jsonl": b'{"text": "one"}\n{"text": "two"}\n'}),
         r"too short: 2 documents \(val takes a fixed ~10% of them\) gave 0 val tokens.*"
         r"use more documents$"),
        (folder_of("empty", {"notes.md": b"x"}), r"holds no \.txt, \.txt\.gz, \.jsonl"),
        (tmp_path / "*.nothing", r"matches no files"),
    ]
    for spec, message in cases:
        argv = ["d", f"--input={spec}", "--tokenizer=tiny_eot", "--workers=1",
                f"--data_dir={tmp_path / 'data'}"]
        code, _, err = run_cli(prepare_corpus.main, argv)
        assert code == 2 and is_one_line_error(err), (spec, err)
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "data" / "d").exists() and os.listdir(tmp_path / "data") == []


def test_unusable_inputs_and_tokenizers_are_refused(tmp_path, tiny_encoding, use_encoding, run_cli):
    use_encoding(tiny_encoding)
    # 3 characters: 2 train tokens, 1 val token, no window to score
    (tmp_path / "abc.txt").write_text("abc")
    write_jsonl(tmp_path / "docs.jsonl", documents_of(20))
    data = f"--data_dir={tmp_path / 'data'}"
    cases = [
        (["abc", f"--input={tmp_path / 'abc.txt'}", "--tokenizer=char"],
         r"too short: one text gave 1 val tokens"),
        (["abc", f"--input={tmp_path / 'abc.txt'}", "--tokenizer="], r"--tokenizer is empty"),
        (["d", f"--input={tmp_path / 'docs.jsonl'}", "--tokenizer=char"],
         r"--tokenizer=char prepares one text"),
        (["d", f"--input={tmp_path / 'docs.jsonl'}", "--tokenizer=tiny"],
         r"'tiny' has no <\|endoftext\|>"),
        (["d", f"--input={tmp_path / 'docs.jsonl'}", "--workers=0"], r"--workers=0"),
        (["d"], r"no --input; e\.g\. python lab/prepare_corpus\.py d --input="),
        (["../up", f"--input={tmp_path / 'docs.jsonl'}"], r"plain folder name"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(prepare_corpus.main, argv + [data])
        assert code == 2 and is_one_line_error(err), (argv, err)
        assert re.search(message, err), (message, err)
    assert not (tmp_path / "data").exists() or os.listdir(tmp_path / "data") == []


def test_preparing_a_corpus_loads_no_torch(tmp_path, text):
    """Issue 21: data preparation needs numpy and tiktoken only, as in nanoGPT. Every process the
    command starts (the main one and its --workers) logs its imports (PYTHONPROFILEIMPORTTIME, which
    the spawned workers inherit): none may import torch, not even indirectly."""
    (tmp_path / "my.txt").write_text(text, encoding="utf-8")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "lab", "prepare_corpus.py"), "my",
                             "--input=my.txt", "--tokenizer=char", "--workers=2"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=os.environ | {"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    # the log covers the main process and the workers that tokenized (at least one did; a second one
    # may be stopped before it has started, when the first has done all the work)
    assert imported.count("lab.corpus") >= 2
    assert [name for name in imported if name.split(".")[0] == "torch"] == []


def test_parquet_errors(tmp_path, eot_encoding):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'text' \(its columns: body\)"):
        corpus.prepare_files(str(tmp_path / "a.parquet"), eot_encoding, str(tmp_path / "d"), "d")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b\.parquet, row 2: 'text' is null"):
        corpus.prepare_files(str(tmp_path / "b.parquet"), eot_encoding, str(tmp_path / "d"), "d")
    (tmp_path / "c.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: not a readable Parquet file"):
        corpus.prepare_files(str(tmp_path / "c.parquet"), eot_encoding, str(tmp_path / "d"), "d")


def test_progress_lines_on_stderr(tmp_path, eot_encoding, monkeypatch, capsys):
    monkeypatch.setattr(corpus, "PROGRESS_INTERVAL_S", 0.0)  # every work item, instead of every 2 s
    monkeypatch.setattr(corpus_readers, "READ_BYTES", 1024)
    write_jsonl(tmp_path / "docs.jsonl", documents_of(100))
    corpus.prepare_files(str(tmp_path / "docs.jsonl"), eot_encoding, str(tmp_path / "d"), "d",
                               show_progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 3
    assert re.fullmatch(r"tokenizing: [\d.]+ of [\d.]+ MB read \(\d+%\), [\d,]+ documents read, "
                        r"[\d,]+ tokens "
                        r"written, [\d.]+ MB/s, ETA \d\d:\d\d:\d\d", lines[-1]), lines[-1]


def test_work_in_flight_is_bounded(eot_encoding):
    """Memory stays bounded: the input is read at most 2 tasks per worker ahead of the results
    (Pool.imap would read all of it ahead)."""
    read = []

    def items():
        for i in range(40):
            read.append(i)
            yield corpus_readers.WorkItem("text", f"Document {i}.", "mem.txt", 0, True, None)

    worker_args = (dataset.TiktokenTokenizer(eot_encoding), 256, np.dtype(np.uint16), "text")
    results = corpus.tokenized_in_order(items(), worker_args, 2)
    for done, (_, (tokens, _, _)) in enumerate(results, start=1):
        assert len(read) <= done + 4
        assert eot_encoding.decode(tokens.tolist()) == f"Document {done - 1}.<|endoftext|>"
    assert done == 40


# --------------------------------------------------------------------------------------------------
# Bad input at the edges (issue 22): links and loops, special files, deep or huge JSON, surrogates

DEEP = 100_000  # levels of nested lists: far past Python's recursion limit


def deeply_nested(levels=DEEP):
    return "[" * levels + "]" * levels


@pytest.fixture
def linked_corpus(tmp_path):
    """A corpus folder with a loop (again -> .), two more links to ".", which a plain walk follows
    2**40 paths deep, a second link to a subfolder, a link to one of its files and a link out of
    it -> (folder, the documents of its real files in sorted order of their paths)."""
    docs = documents_of(30)
    folder, outside = tmp_path / "corpus", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    for i, doc in enumerate(docs[:20]):
        (folder / f"{i:02d}.txt").write_text(doc)
    write_jsonl(folder / "sub" / "d.jsonl", docs[20:29])
    (outside / "o.txt").write_text(docs[29])
    for name, target in [("again", "."), ("loop1", "."), ("loop2", "."), ("also_sub", "sub"),
                         ("00_link.txt", "05.txt"), ("sub/out", str(outside)),
                         ("sub/up", "..")]:
        os.symlink(target, folder / name)
    return folder, docs


@pytest.mark.usefixtures("fails_after_a_minute")
def test_links_are_followed_but_each_file_is_read_once(tmp_path, linked_corpus, eot_encoding,
                                                       use_encoding, run_cli):
    """Issue 22: `again -> .` gave every file 41 times (and two such links never end). Each real
    file is read once, under its own path (not a link's), the other paths are one note on stderr,
    and meta.json lists what was read."""
    folder, docs = linked_corpus
    use_encoding(eot_encoding)
    for spec in [folder, f"{folder}/**/*.*", f"{folder}/**"]:
        out = tmp_path / "data"
        code, _, err = run_cli(prepare_corpus.main, ["linked", f"--input={spec}", "--workers=1",
                                                   "--tokenizer=tiny_eot", f"--data_dir={out}"])
        assert code == 0, err
        assert err.startswith("prepare_corpus.py: note: skipped 6 paths that reach directories or "
                              "files already read (links or loops), so that each file is read "
                              f"once: {folder}/00_link.txt, {folder}/again, {folder}/also_sub "
                              "and 3 more\n") and err.count("\n") == 1, err
        meta = dataset.load_meta(str(out / "linked"))
        names = [os.path.relpath(r["name"], folder) for r in meta["inputs"]]
        assert names == [f"{i:02d}.txt" for i in range(20)] + ["sub/d.jsonl", "sub/out/o.txt"]
        train, val = read_both_splits(str(out / "linked"))
        expected = expected_splits(docs, eot_encoding)
        assert (train.tolist(), val.tolist()) == (expected["train"], expected["val"])


def test_the_walk_and_the_glob_find_what_glob_finds_without_links(tmp_path, monkeypatch):
    """walk_dirs replaces glob's "**" only to enter each directory once: on a tree without links
    the files are glob.glob's, hidden names left out as glob leaves them out."""
    for path in ["a.txt", "b.jsonl", "s/c.txt", "s/t/d.txt", "s/.h/e.txt", ".f.txt", "s/t/g.md"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    monkeypatch.chdir(tmp_path)
    for pattern in ["**", "**/*.txt", "s/**", "s/**/*.txt", "*/**/d.txt", "**/t/*", "s/**/",
                    f"{tmp_path}/**/*.txt", "*.txt", "s/*/*"]:
        found, skipped = corpus_readers.glob_files(pattern)
        expected = [p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p)]
        assert (sorted(found), skipped) == (sorted(expected), []), pattern
    paths, skipped = corpus_readers.list_inputs(str(tmp_path))
    assert [os.path.relpath(p, tmp_path) for p in paths] == ["a.txt", "b.jsonl", "s/c.txt",
                                                             "s/t/d.txt"] and skipped == []


@pytest.mark.usefixtures("fails_after_a_minute")
def test_special_files_are_refused_never_read(tmp_path, eot_encoding, use_encoding, run_cli):
    """A FIFO, a socket or a device in a corpus (a folder, a glob, or the --input itself) is refused
    with one line naming it, before anything is read: opening a FIFO to read waits for a writer,
    maybe forever. open_input, which reads a file listed before, refuses one too, at once. So is a
    loop of links to files."""
    use_encoding(eot_encoding)
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", documents_of(20))
    os.mkfifo(folder / "pipe.jsonl")
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sockets / "s.txt"))
    links = tmp_path / "links"  # a loop of links: a.txt -> b.txt -> a.txt
    links.mkdir()
    os.symlink("b.txt", links / "a.txt")
    os.symlink("a.txt", links / "b.txt")
    fifo_says = "a FIFO (named pipe), not a regular file; remove it from the input"
    cases = [(folder, f"{folder}/pipe.jsonl: {fifo_says}"),
             (f"{folder}/*.jsonl", f"{folder}/pipe.jsonl: {fifo_says}"),
             (folder / "pipe.jsonl", f"{folder}/pipe.jsonl: {fifo_says}"),
             (sockets, f"{sockets}/s.txt: a socket, not a regular file"),
             ("/dev/null", "/dev/null: a character device, not a regular file"),
             (links, f"{links}/a.txt: a link to b.txt (Too many levels of symbolic links); "
                     f"remove the link or restore its target")]
    for spec, message in cases:
        code, _, err = run_cli(prepare_corpus.main, ["d", f"--input={spec}", "--workers=1",
                                                   "--tokenizer=tiny_eot",
                                                   f"--data_dir={tmp_path / 'data'}"])
        assert code == 2 and is_one_line_error(err), (spec, err)
        assert f"error: cannot read {message}" in err, (spec, err)
    with pytest.raises(OSError, match=f"pipe.jsonl: {re.escape(fifo_says)}"):
        corpus_readers.open_input(str(folder / "pipe.jsonl"))
    server.close()
    assert not (tmp_path / "data").exists() or os.listdir(tmp_path / "data") == []


@pytest.mark.parametrize("workers", [1, 2])
def test_deep_or_huge_json_lines_are_one_line_errors(tmp_path, eot_encoding, use_encoding,
                                                     run_cli, workers):
    """Issue 22: a valid line of 100,000 nested lists ended in a 49-line traceback from the worker
    pool (RecursionError). Every failure of the parser is one line naming the file and line, on
    the main process and on workers."""
    use_encoding(eot_encoding)
    good = [json.dumps({"text": t}) for t in documents_of(20)]
    cases = [
        ('{"text": ' + deeply_nested() + "}",
         r"deep\.jsonl, line 4: nested too deeply to read \(.*\); fix or remove the line$"),
        ('{"text": "a", "n": ' + "7" * 5000 + "}",
         r"deep\.jsonl, line 4: not valid JSON \(Exceeds the limit \(4300 digits\) for integer "
         r"string conversion.*\); fix or remove the line$"),
        ('{"text": ' + "[" * DEEP, r"deep\.jsonl, line 4: not valid JSON|nested too deeply"),
    ]
    for line, message in cases:
        (tmp_path / "deep.jsonl").write_text("\n".join(good[:3] + [line] + good) + "\n")
        code, _, err = run_cli(prepare_corpus.main, ["d", f"--input={tmp_path / 'deep.jsonl'}",
                                                   "--tokenizer=tiny_eot", f"--workers={workers}",
                                                   f"--data_dir={tmp_path / 'data'}"])
        assert code == 2 and is_one_line_error(err), err[-2000:]
        assert re.search(message, err), (message, err)


def test_lone_surrogates_are_tokenized_as_encode_ordinary_does(tmp_path, tiny_encoding,
                                                               eot_encoding):
    """Issue 22: {"text": "a \\ud800 b"} stopped the run ("'utf-8' codec can't encode character",
    no file, no line): encode_to_numpy refuses surrogates, which encode_ordinary replaces (a pair by
    its character, a lone one by U+FFFD). encode_array gives encode_ordinary's tokens."""
    texts = ["a \ud800 b", "\udfff", "x\ud83d\ude00y", "\ud800\ud800 z", "tail \udc80", "plain",
             "Document 1.\n" + "\ud834" * 3]
    for encoding in (tiny_encoding, eot_encoding):
        tok = dataset.TiktokenTokenizer(encoding)
        for text in texts:
            array = tok.encode_array(text)
            assert array.dtype == np.uint32 and array.tolist() == encoding.encode_ordinary(text)
    assert eot_encoding.decode(dataset.TiktokenTokenizer(eot_encoding).encode_array("a \ud800 b")
                               .tolist()) == "a \ufffd b"
    docs = documents_of(20)
    docs[3] += " a \ud800 b"
    (tmp_path / "s.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    corpus.prepare_files(str(tmp_path / "s.jsonl"), eot_encoding, str(tmp_path / "d"), "d")
    train, val = read_both_splits(str(tmp_path / "d"))
    expected = expected_splits(docs, eot_encoding)
    assert (train.tolist(), val.tolist()) == (expected["train"], expected["val"])


