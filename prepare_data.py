"""
Prepare a corpus for train.py: tokenize it, split it into train and val, write data/NAME/{train,val}.bin + meta.json.

    python prepare_data.py shakespeare                 # Tiny Shakespeare (downloaded), GPT-2 BPE
    python prepare_data.py shakespeare_char            # the same text, one token per character
    python prepare_data.py shakespeare --input=path/to/input.txt           # a local copy instead of the download
    python prepare_data.py mytext --input=my.txt --tokenizer=o200k_base    # any UTF-8 file, any tiktoken encoding
    python prepare_data.py stories --input=stories/ --tokenizer=o200k_base # a corpus: a directory, a glob, .jsonl
    python prepare_data.py --bench                     # throughput and peak memory on a generated corpus

What --input can be:
  one text file  one document, split as in nanoGPT: the first 90% of its characters to train, the rest to val,
                 each part tokenized on its own, no end-of-text token. The only input char-level accepts.
  a corpus       a directory (searched recursively for .txt, .jsonl, .parquet and their .gz forms except .parquet;
                 hidden names skipped), a glob such as "shards/*.jsonl.gz" (every file it matches), or one .jsonl
                 or .parquet file. A text file is one document, a .jsonl line or a Parquet row is one (its
                 --text_field); empty ones are skipped. Files are read in sorted order, every document is followed
                 by one <|endoftext|> of the encoding, and whole documents go to val (a fixed, seeded 10%).
The input is streamed: memory stays bounded whatever its size. Tokenizing runs on --workers processes, and the
.bin files are the same whatever their number. The dataset is written into DATA_DIR/.NAME.tmpPID and moved into
DATA_DIR/NAME only when complete, so an interrupted or failed run leaves the old dataset (or none), never half one.

The format (train.py, sample.py and eval.py read it with this file's get_tokenizer, load_meta, load_split):
  train.bin, val.bin  the token ids, flat, uint16 (uint32 when the vocabulary has more than 65,536 ids)
  meta.json           {"dataset", "tokenizer": "gpt2" | "char" | <tiktoken encoding>, "vocab_size", "dtype",
                       "train_tokens", "val_tokens", "chars" (char-level only: the vocabulary in id order),
                       "source", "eot_token" (the id after each document; null for one text file),
                       "train_documents", "val_documents", "split" (how), "text_field" (.jsonl, Parquet),
                       "inputs": [{"name", "bytes", "sha256"}, ...]}

Importing this file has no side effects; the reading side is get_tokenizer, load_meta, load_split, eval_windows.
"""

import argparse
import codecs
import collections
import contextlib
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
import zlib

import numpy as np

# Datasets this script knows by name: where to download them, their sha256, and their default tokenizer.
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
KNOWN_DATASETS = {
    "shakespeare": {"url": SHAKESPEARE_URL, "sha256": SHAKESPEARE_SHA256, "tokenizer": "gpt2"},
    "shakespeare_char": {"url": SHAKESPEARE_URL, "sha256": SHAKESPEARE_SHA256, "tokenizer": "char"},
}
TRAIN_FRACTION = 0.9  # one text: its first 90% of characters; a corpus: each document with probability 0.9
SPLIT_SEED = 1337  # which documents of a corpus go to val: fixed, so that the same corpus always splits the same way
UINT16_VOCAB = 65536  # ids 0..65535 fit in uint16
MIN_SPLIT_TOKENS = 2  # one input and its target: the least a split needs to give train.py and eval.py one window
CORPUS_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")  # what a directory is searched for
READ_BYTES = 1 << 20  # the streaming buffer: bytes read at a time, and about the text of one worker task
PROGRESS_INTERVAL_S = 2.0  # at most one progress line on stderr per this many seconds
SPLITS = ("train", "val")


# ----------------------------------------------------------------------------------------------------------
# Tokenizers: the same small interface for characters and for tiktoken BPE


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters of the prepared text."""

    name = "char"

    def __init__(self, chars):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}

    def encode(self, text):
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise ValueError(f"characters not in this dataset's {self.vocab_size}-character vocabulary: "
                             f"{''.join(missing)!r}")
        return [self.stoi[c] for c in text]

    def encode_array(self, text):
        return np.array(self.encode(text), dtype=np.uint32)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class TiktokenTokenizer:
    """A tiktoken BPE encoding. Special tokens such as <|endoftext|> are encoded as ordinary text."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.name = encoding.name
        self.vocab_size = encoding.n_vocab

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text):
        """encode(text) as a numpy array. tiktoken >= 0.8's encode_to_numpy skips building a list of Python ints
        (~10% faster); with nothing allowed or disallowed as special, it encodes special tokens as text too."""
        if hasattr(self.encoding, "encode_to_numpy"):
            return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        return np.array(self.encode(text), dtype=np.uint32)

    def decode(self, ids):
        return self.encoding.decode(list(ids))


def load_encoding(name):
    """tiktoken.get_encoding(name), with errors that say what to do. tiktoken downloads an encoding's files
    once and caches them (in TIKTOKEN_CACHE_DIR, if set); offline, only cached encodings load."""
    import tiktoken

    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"unknown tokenizer {name!r}; use char or a tiktoken encoding: "
                         f"{', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # requests' ConnectionError offline, a corrupt cache file, ...
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "tiktoken's default cache")
        raise ValueError(f"tiktoken encoding {name!r} could not be loaded ({type(e).__name__}); its files are "
                         f"neither in {cache} nor downloadable. Connect once, or set TIKTOKEN_CACHE_DIR to a "
                         f"folder that holds them") from None


def get_tokenizer(meta, encoding=None):
    """The tokenizer a dataset was prepared with, from its meta.json dict. `encoding`: a tiktoken.Encoding to
    use instead of looking meta["tokenizer"] up by name (for encodings built in-process, e.g. in tests)."""
    if meta["tokenizer"] == "char":
        tok = CharTokenizer(meta["chars"])
    else:
        tok = TiktokenTokenizer(encoding if encoding is not None else load_encoding(meta["tokenizer"]))
    if tok.vocab_size != meta["vocab_size"]:
        raise ValueError(f"dataset {meta.get('dataset')!r} has vocab_size {meta['vocab_size']} but tokenizer "
                         f"{tok.name!r} has {tok.vocab_size}; prepare the dataset again")
    return tok


# ----------------------------------------------------------------------------------------------------------
# Reading a prepared dataset


def prepare_command(name):
    """The command that prepares dataset `name`, for error messages."""
    if name in KNOWN_DATASETS:
        return f"python prepare_data.py {name}"
    return f"python prepare_data.py {name} --input=path/to/text.txt"


def load_meta(data_dir):
    """Read data_dir/meta.json (data_dir is one dataset's folder, e.g. data/shakespeare) -> dict."""
    path = os.path.join(data_dir, "meta.json")
    name = os.path.basename(os.path.normpath(data_dir))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prepared dataset in {data_dir} (no meta.json); prepare it first: "
                                f"{prepare_command(name)}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path} is not valid JSON ({e}); prepare the dataset again: "
                         f"{prepare_command(name)}") from None
    required = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")
    missing = [key for key in required if key not in meta] if isinstance(meta, dict) else required
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; prepare the dataset again: {prepare_command(name)}")
    problem = meta_problem(meta)
    if problem:
        raise ValueError(f"{path}: {problem}; it was edited or damaged. Prepare the dataset again: "
                         f"{prepare_command(name)}")
    return meta


def meta_problem(meta):
    """What is wrong with the values of a meta.json dict, or None."""
    def count(key):
        return type(meta[key]) is int and meta[key] >= 0

    if not (isinstance(meta["tokenizer"], str) and meta["tokenizer"]):
        return f"tokenizer={meta['tokenizer']!r} is not a tokenizer name"
    if not (type(meta["vocab_size"]) is int and meta["vocab_size"] >= 2):
        return f"vocab_size={meta['vocab_size']!r} is not an integer >= 2"
    if meta["dtype"] not in ("uint16", "uint32"):
        return f"dtype={meta['dtype']!r} is not uint16 or uint32"
    if meta["dtype"] == "uint16" and meta["vocab_size"] > UINT16_VOCAB:
        return f"vocab_size={meta['vocab_size']} does not fit dtype uint16"
    if not (count("train_tokens") and count("val_tokens")):
        return "train_tokens and val_tokens must be non-negative integers"
    if meta["tokenizer"] == "char" and not (isinstance(meta.get("chars"), str)
                                            and len(meta["chars"]) == meta["vocab_size"]):
        return "a char dataset needs 'chars', a string of vocab_size characters"
    return None


def load_split(data_dir, split):
    """data_dir/{split}.bin as a read-only np.memmap of token ids (split: "train" or "val")."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}; choose train or val")
    meta = load_meta(data_dir)
    path = os.path.join(data_dir, f"{split}.bin")
    n_tokens = meta[f"{split}_tokens"]
    itemsize = np.dtype(meta["dtype"]).itemsize
    size = os.path.getsize(path) if os.path.isfile(path) else None
    if size != n_tokens * itemsize:
        found = "missing" if size is None else f"{size:,} bytes"
        raise ValueError(f"{path} is {found}, meta.json expects {n_tokens:,} {meta['dtype']} tokens; prepare "
                         f"the dataset again: {prepare_command(os.path.basename(os.path.normpath(data_dir)))}")
    if n_tokens == 0:
        return np.zeros(0, dtype=meta["dtype"])  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=meta["dtype"], mode="r")


def eval_windows(n_tokens, block_size, max_windows=None):
    """Start offsets of the fixed evaluation windows of a split of n_tokens tokens.

    Window i has inputs tokens[s:s+block_size] and targets tokens[s+1:s+block_size+1], s = i * block_size,
    for i in range((n_tokens - 1) // block_size): non-overlapping, every target token counted once. With
    max_windows smaller than that, an evenly spaced subset. train.py and eval.py both use these windows, so
    their losses are measured on the same tokens."""
    n_windows = (n_tokens - 1) // block_size
    if n_windows < 1:
        raise ValueError(f"a split of {n_tokens} tokens is too short for one window of block_size={block_size} "
                         f"(needs {block_size + 1}); use a smaller block_size or more text")
    starts = np.arange(n_windows, dtype=np.int64) * block_size
    if max_windows is not None and max_windows < n_windows:
        if max_windows < 1:
            raise ValueError(f"max_windows={max_windows} must be at least 1")
        starts = starts[np.arange(max_windows) * n_windows // max_windows]
    return starts



# ----------------------------------------------------------------------------------------------------------
# Writing a dataset: atomic files, and a dataset folder that appears only when complete


class DatasetWriter:
    """train.bin and val.bin, appended to as tokens come, in a temporary sibling folder DATA_DIR/.NAME.tmpPID that
    commit() moves into place. Until then DATA_DIR/NAME is untouched; on any error or Ctrl-C (`with` block) the
    temporary folder is removed, and the folder of a killed run is removed by the next run."""

    def __init__(self, out_dir, dtype):
        self.out_dir, self.dtype = os.path.normpath(out_dir), dtype
        parent, name = os.path.split(self.out_dir)
        os.makedirs(parent or ".", exist_ok=True)
        from common import pid_alive  # here, not at the top: common imports torch, which workers need not load

        stale = re.compile(rf"\.{re.escape(name)}\.tmp(\d+)")
        for entry in os.listdir(parent or "."):
            match = stale.fullmatch(entry)
            if match and (int(match[1]) == os.getpid() or not pid_alive(int(match[1]))):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        self.tmp_dir = os.path.join(parent, f".{name}.tmp{os.getpid()}")
        os.makedirs(self.tmp_dir)
        self.files = {split: open(os.path.join(self.tmp_dir, f"{split}.bin"), "wb") for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # BaseException included: KeyboardInterrupt leaves no temporary folder either
            for f in self.files.values():
                f.close()
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def append(self, split, tokens):
        tokens.astype(self.dtype, copy=False).tofile(self.files[split])
        self.tokens[split] += len(tokens)

    def commit(self, meta):
        """Write meta.json and move the dataset into out_dir. Files are fsynced first, so that after a crash the
        renamed files hold their data."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(os.path.join(self.tmp_dir, "meta.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if not os.path.exists(self.out_dir):
            os.rename(self.tmp_dir, self.out_dir)  # one atomic step
            return
        # out_dir exists (it may hold other files, e.g. a known dataset's downloaded input.txt): replace the three
        # files, meta.json last, after removing the old one, so that in between the folder reads as "not prepared"
        # (load_meta) rather than as a mix of old and new files
        meta_path = os.path.join(self.out_dir, "meta.json")
        if os.path.exists(meta_path):
            os.remove(meta_path)
        for name in ("train.bin", "val.bin", "meta.json"):
            os.replace(os.path.join(self.tmp_dir, name), os.path.join(self.out_dir, name))
        os.rmdir(self.tmp_dir)


# ----------------------------------------------------------------------------------------------------------
# Reading the input as a stream of work items


# One unit of tokenizing work. kind: "text" (payload: a str, a piece of one document), "jsonl" (payload: bytes, whole
# lines, the first being `line`) or "rows" (payload: a list of Parquet values, the first being row `line`). A "text"
# piece ends its document when ends_document; a .jsonl line or a row is a whole document. split: "train" or "val"
# for the pieces of one text file (split by characters), None where the document's index decides (is_val_document).
WorkItem = collections.namedtuple("WorkItem", "kind payload path line ends_document split")


def file_kind(path):
    """"jsonl", "parquet" or "text" (anything else: read as plain UTF-8 text), from the name; .gz is decompressed."""
    name = path.lower().removesuffix(".gz")
    if name.endswith(".parquet"):
        if path.lower().endswith(".gz"):
            raise ValueError(f"{path}: gzipped Parquet is not supported; gunzip it (Parquet compresses itself)")
        return "parquet"
    return "jsonl" if name.endswith(".jsonl") else "text"


def list_inputs(spec):
    """The files of --input, in sorted order: a file, a directory (recursively: CORPUS_SUFFIXES, hidden names
    skipped) or a glob (every file it matches, "**" included)."""
    if os.path.isdir(spec):
        def fail(e):
            raise OSError(f"cannot read directory {e.filename}: {e.strerror}")

        paths = []
        for folder, dirs, files in os.walk(spec, onerror=fail, followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            paths += [os.path.join(folder, f) for f in files
                      if not f.startswith(".") and f.lower().endswith(CORPUS_SUFFIXES)]
        what = f"directory {spec} holds no {', '.join(CORPUS_SUFFIXES)} files"
    elif glob.has_magic(spec):
        paths = [p for p in glob.glob(spec, recursive=True) if not os.path.isdir(p)]
        what = f"--input={spec} matches no files"
    elif os.path.lexists(spec):
        paths, what = [spec], ""
    else:
        raise FileNotFoundError(f"--input={spec}: no such file or directory")
    if not paths:
        raise FileNotFoundError(what)
    for path in paths:  # fail before any work, not after hours: every file must exist and be readable
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise OSError(f"cannot read {path}: {'not readable' if os.path.isfile(path) else 'not a file'}; "
                          f"fix its permissions or remove it from the input")
        file_kind(path)
    return sorted(paths)


class HashingFile:
    """A binary file that hashes the bytes read from it and reports their count (for progress)."""

    def __init__(self, f, on_read=None):
        self.f, self.sha256, self.on_read = f, hashlib.sha256(), on_read

    def read(self, size=-1):
        data = self.f.read(size)
        self.sha256.update(data)
        if self.on_read is not None:
            self.on_read(len(data))
        return data

    def finish(self):
        """Read what is left (gzip may stop before the end), close, and return the whole file's sha256."""
        while self.read(READ_BYTES):
            pass
        self.f.close()
        return self.sha256.hexdigest()


def open_input(path, on_read=None):
    """-> (HashingFile of the file, stream of its content: decompressed for .gz)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise OSError(f"cannot read {path}: {e.strerror}; fix its permissions or remove it from the input") from None
    hashing = HashingFile(f, on_read)
    return hashing, (gzip.GzipFile(fileobj=hashing, mode="rb") if path.lower().endswith(".gz") else hashing)


def raw_blocks(path, stream):
    """The bytes of a stream, READ_BYTES at a time; corrupt gzip data is an error naming the file."""
    done = 0
    try:
        while block := stream.read(READ_BYTES):
            yield block
            done += len(block)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: corrupt or truncated gzip data after {done:,} bytes ({e}); get the file "
                         f"again or remove it from the input") from None


def decoded_blocks(blocks, path):
    """UTF-8 text from a stream of byte blocks; bytes that are not UTF-8 are an error naming the file and line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    for block in itertools.chain(blocks, [None]):
        data = b"" if block is None else block
        try:
            text = decoder.decode(data, final=block is None)
        except UnicodeDecodeError as e:  # e.object: the bytes of a character begun in the last block, then data
            at = offset - (len(e.object) - len(data)) + e.start
            line += e.object[:e.start].count(b"\n")
            raise ValueError(f"{path}, line {line:,}: not UTF-8 text (byte {at:,}: {e.object[e.start:e.start + 4]!r}"
                             f"); convert the file to UTF-8") from None
        yield text
        line, offset = line + data.count(b"\n"), offset + len(data)


def safe_cut(text):
    """The last point where `text` can be cut so that tokenizing both sides gives the tokens of the whole, or 0:
    after a newline, or before a space, that follows a non-space character and precedes a letter or digit. The
    pre-tokenizing patterns of tiktoken's encodings (gpt2, r50k, p50k, cl100k, o200k) start a new piece at such a
    point, and match the pieces on either side without looking across it (tests/test_prepare_data.py checks it)."""
    for sep, cut_after in (("\n", 1), (" ", 0)):
        i = text.rfind(sep, 1, len(text) - 1)
        while i > 0:
            if not text[i - 1].isspace() and text[i + 1].isalnum():
                return i + cut_after
            i = text.rfind(sep, 1, i)
    return 0


def text_pieces(blocks, piece_chars=None):
    """One document from a stream of str blocks, cut at safe_cut points into pieces of about piece_chars characters
    or more -> (piece, is_last). Memory stays bounded: a text with no safe point in 16 x piece_chars characters (no
    whitespace at all) is cut there anyway, which may tokenize that one point differently."""
    piece_chars = piece_chars or READ_BYTES
    pending = ""
    for block in blocks:
        pending += block
        if len(pending) >= piece_chars:
            cut = safe_cut(pending)
            if cut == 0 and len(pending) >= 16 * piece_chars:
                cut = len(pending) - 1
            if cut:
                yield pending[:cut], False
                pending = pending[cut:]  # never empty: a cut is before the last character
    if pending:
        yield pending, True


def single_text_items(blocks, n_chars, path):
    """The work items of one text: its first TRAIN_FRACTION of characters to train, the rest to val (nanoGPT's
    split), each part cut into pieces on its own."""
    split_at = int(n_chars * TRAIN_FRACTION)

    def blocks_with_split():
        seen = 0
        for block in blocks:
            if seen < split_at < seen + len(block):
                yield "train", block[:split_at - seen]
                yield "val", block[split_at - seen:]
            else:
                yield ("train" if seen < split_at else "val"), block
            seen += len(block)

    for split, group in itertools.groupby(blocks_with_split(), key=lambda pair: pair[0]):
        for piece, is_last in text_pieces(block for _, block in group):
            yield WorkItem("text", piece, path, 0, is_last, split)


def jsonl_items(path, stream):
    """Blocks of whole .jsonl lines (parsed by the workers, which know the line numbers)."""
    carry, line = b"", 1
    for block in raw_blocks(path, stream):
        end = block.rfind(b"\n") + 1
        if end == 0:  # a line longer than the block: keep reading
            carry += block
            continue
        lines, carry = carry + block[:end], block[end:]
        yield WorkItem("jsonl", lines, path, line, True, None)
        line += lines.count(b"\n")
    if carry:
        yield WorkItem("jsonl", carry, path, line, True, None)


def parquet_items(path, text_field, on_rows):
    """Batches of the text column of a Parquet file (needs pyarrow); on_rows(fraction of the file read)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, ...) share no base class with OSError
        raise ValueError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: no column {text_field!r} (its columns: {', '.join(parquet.schema_arrow.names)}); "
                         f"choose one with --text_field=NAME")
    row, n_rows = 1, max(parquet.metadata.num_rows, 1)
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        values = batch.column(0).to_pylist()
        yield WorkItem("rows", values, path, row, True, None)
        row += len(values)
        on_rows((row - 1) / n_rows)


class Corpus:
    """The files of a corpus as a stream of work items, counting the bytes read (for progress) and recording each
    file's name, size and sha256 (for meta.json) once it has been read."""

    def __init__(self, paths, text_field):
        self.paths, self.text_field = paths, text_field
        self.total_bytes = sum(os.path.getsize(p) for p in paths)
        self.bytes_read, self.inputs = 0, []

    def count(self, n):
        self.bytes_read += n

    def items(self):
        for path in self.paths:
            size, before = os.path.getsize(path), self.bytes_read
            if file_kind(path) == "parquet":
                def on_rows(fraction, before=before, size=size):
                    self.bytes_read = before + int(fraction * size)

                yield from parquet_items(path, self.text_field, on_rows)
                sha256 = file_sha256(path)
            else:
                hashing, stream = open_input(path, self.count)
                with contextlib.closing(hashing.f):
                    if file_kind(path) == "jsonl":
                        yield from jsonl_items(path, stream)
                    else:  # a text file: one document
                        for piece, is_last in text_pieces(decoded_blocks(raw_blocks(path, stream), path)):
                            yield WorkItem("text", piece, path, 0, is_last, None)
                    sha256 = hashing.finish()
            self.bytes_read = before + size
            self.inputs.append({"name": path, "bytes": size, "sha256": sha256})


def file_sha256(path):
    hashing, _ = open_input(path)
    return hashing.finish()


def scan_text(path, sha256=None, want_chars=False):
    """One pass over a text file before tokenizing it: -> (its characters count, set of characters (when
    want_chars, for char-level), input record for meta.json); sha256, when given, is checked."""
    hashing, stream = open_input(path)
    n_chars, chars = 0, set()
    with contextlib.closing(hashing.f):
        for block in decoded_blocks(raw_blocks(path, stream), path):
            n_chars += len(block)
            if want_chars:
                chars.update(block)
        found = hashing.finish()
    if sha256 is not None and found != sha256:
        raise ValueError(f"{path} is not the expected file: its sha256 is {found}, expected {sha256}")
    return n_chars, chars, {"name": path, "bytes": os.path.getsize(path), "sha256": found}


# ----------------------------------------------------------------------------------------------------------
# Tokenizing: worker processes, results in input order


_worker = {}  # a tokenizing process's settings: tokenizer, eot_token, dtype, text_field (init_worker)


def init_worker(tokenizer, eot_token, dtype, text_field):
    _worker.update(tokenizer=tokenizer, eot_token=eot_token, dtype=dtype, text_field=text_field)


def init_pool_worker(*worker_args):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle: it ends the pool
    init_worker(*worker_args)


def jsonl_documents(block, path, first_line, text_field):
    """The texts of a block of .jsonl lines (blank lines skipped) -> (texts, None), or (None, one-line error)."""
    texts = []
    for i, raw in enumerate(block.split(b"\n")):
        if not raw.strip():
            continue
        where = f"{path}, line {first_line + i:,}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            return None, f"{where}: not UTF-8 text (byte {e.start:,} of the line); convert the file to UTF-8"
        except json.JSONDecodeError as e:
            return None, f"{where}: not valid JSON ({e.msg}, column {e.colno}); fix or remove the line"
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(list(record)[:8]) if isinstance(record, dict) else type(record).__name__
            return None, (f"{where}: no {text_field!r} field (found: {keys}); choose the field with "
                          f"--text_field=NAME")
        if not isinstance(record[text_field], str):
            return None, f"{where}: field {text_field!r} is {type(record[text_field]).__name__}, not text"
        texts.append(record[text_field])
    return texts, None


def tokenize_item(item):
    """Tokens of one work item, with this process's tokenizer -> (tokens as one array, token count of each document
    (or of the one piece, for "text"), None), or (None, None, one-line error). Each finished document is followed
    by eot_token, when there is one; empty documents give nothing."""
    if item.kind == "text":
        texts, ends = [item.payload], item.ends_document
    elif item.kind == "jsonl":
        texts, error = jsonl_documents(item.payload, item.path, item.line, _worker["text_field"])
        if error:
            return None, None, error
        ends = True
    else:
        texts, ends = item.payload, True
        for i, value in enumerate(texts):
            if not isinstance(value, str):
                return None, None, (f"{item.path}, row {item.line + i:,}: {_worker['text_field']!r} is "
                                    f"{'null' if value is None else type(value).__name__}, not text")
    tokenizer, eot_token = _worker["tokenizer"], _worker["eot_token"]
    separator = np.array([eot_token] if ends and eot_token is not None else [], dtype=np.uint32)
    arrays, lengths = [np.zeros(0, dtype=np.uint32)], []
    for text in texts:
        if not text and item.kind != "text":
            continue
        arrays += [tokenizer.encode_array(text), separator]  # "<|endoftext|>" inside a text is encoded as text
        lengths.append(len(arrays[-2]) + len(separator))
    return np.concatenate(arrays).astype(_worker["dtype"]), lengths, None


def vmhwm_mib(pid="self"):
    """A process's peak resident memory (VmHWM) in MiB, or None where /proc is not available."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def tokenized_in_order(items, worker_args, workers, stats):
    """(item, tokenize_item(item)) for each item, in input order, on `workers` processes. At most 2 tasks per
    worker are in flight, so memory stays bounded (Pool.imap would read the whole input ahead). The items kept
    for the results lose their payload. stats["worker_peak_mib"]: the workers' largest VmHWM."""
    if workers == 1:
        init_worker(*worker_args)
        for item in items:
            yield item, tokenize_item(item)
        return
    # spawn, not fork: the caller may hold threads (torch, tests), and forking a threaded process can deadlock
    with multiprocessing.get_context("spawn").Pool(workers, init_pool_worker, worker_args) as pool:
        pending = collections.deque()
        for item in items:
            pending.append((item._replace(payload=None), pool.apply_async(tokenize_item, (item,))))
            if len(pending) >= 2 * workers:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()
        peaks = [vmhwm_mib(process.pid) for process in pool._pool]  # before the pool ends them
        stats["worker_peak_mib"] = max((p for p in peaks if p is not None), default=None)


def is_val_document(indices, seed=SPLIT_SEED):
    """Whether documents (by index in the corpus) go to val: a fixed pseudo-random 1 - TRAIN_FRACTION of them.
    A hash of (seed, index) (splitmix64), so the choice depends on nothing else, e.g. not on the worker count."""
    z = np.asarray(indices, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 >= TRAIN_FRACTION


class Progress:
    """Progress lines on stderr, at most one per PROGRESS_INTERVAL_S: bytes and documents read, tokens written,
    MB/s, ETA. Silent in short runs (and so in tests)."""

    def __init__(self, what, total_bytes, enabled=True):
        self.what, self.total, self.enabled = what, total_bytes, enabled
        self.start = self.last = time.monotonic()

    def update(self, bytes_read, documents=None, tokens=None):
        now = time.monotonic()
        if not self.enabled or now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last, elapsed = now, now - self.start
        rate = bytes_read / elapsed
        eta = time.strftime("%H:%M:%S", time.gmtime((self.total - bytes_read) / rate)) if rate > 0 else "?"
        counts = "" if documents is None else f", {documents:,} documents read, {tokens:,} tokens written"
        print(f"{self.what}: {bytes_read / 1e6:,.1f} of {self.total / 1e6:,.1f} MB read "
              f"({100 * bytes_read / max(self.total, 1):.0f}%){counts}, {rate / 1e6:.1f} MB/s, ETA {eta}",
              file=sys.stderr, flush=True)


def write_tokens(items, writer, worker_args, workers, progress=None, bytes_read=None, stats=None):
    """Tokenize work items and append their tokens to the writer's splits -> documents per split. A piece with a
    split goes there; the other documents go by their index (is_val_document). bytes_read(): for progress."""
    documents, next_document = dict.fromkeys(SPLITS, 0), 0
    stats = {} if stats is None else stats
    for item, (tokens, lengths, error) in tokenized_in_order(items, worker_args, workers, stats):
        if error:
            raise ValueError(error)
        n_ended = len(lengths) if item.kind != "text" else int(item.ends_document)
        if item.split is not None:
            val = np.full(len(lengths), item.split == "val")
        else:
            val = is_val_document(np.arange(next_document, next_document + len(lengths)))
        next_document += n_ended
        documents["val"] += int(val[:n_ended].sum())
        documents["train"] += n_ended - int(val[:n_ended].sum())
        in_val = np.repeat(val, lengths)
        writer.append("train", tokens[~in_val])
        writer.append("val", tokens[in_val])
        if progress is not None:
            progress.update(bytes_read(), sum(documents.values()), sum(writer.tokens.values()))
    return documents


# ----------------------------------------------------------------------------------------------------------
# Preparing a dataset


def make_tokenizer(tokenizer, chars=()):
    """tokenizer: "char" (its vocabulary: the sorted `chars`), the name of a tiktoken encoding, or a
    tiktoken.Encoding object (used in-process, e.g. by tests, without registering it with tiktoken)."""
    if tokenizer == "char":
        return CharTokenizer("".join(sorted(chars)))
    if isinstance(tokenizer, str):
        return TiktokenTokenizer(load_encoding(tokenizer))
    return TiktokenTokenizer(tokenizer)


def eot_token_of(tok):
    """The id that follows every document of a corpus: the encoding's <|endoftext|>."""
    if tok.name == "char":
        raise ValueError("--tokenizer=char prepares one text file; a corpus (a directory, a glob, .jsonl or .parquet) "
                         "needs a tiktoken encoding, whose <|endoftext|> separates documents, e.g. --tokenizer=gpt2")
    eot = tok.encoding._special_tokens.get("<|endoftext|>")
    if eot is None:
        raise ValueError(f"encoding {tok.name!r} has no <|endoftext|> token to separate documents; use another "
                         f"encoding, or prepare one text file")
    return eot


def write_dataset(items, tok, out_dir, meta, eot_token=None, workers=1, text_field="text", progress=None,
                  bytes_read=None, stats=None):
    """Tokenize the work items into out_dir, atomically (DatasetWriter) -> the complete meta: `meta` (dataset,
    source, split, inputs, ...) with the tokenizer's keys and the counts added. Refuses a split too short to use."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= UINT16_VOCAB else np.uint32)
    worker_args = (tok, eot_token, dtype, text_field)
    with DatasetWriter(out_dir, dtype) as writer:
        documents = write_tokens(items, writer, worker_args, workers, progress, bytes_read, stats)
        for split in SPLITS:
            if writer.tokens[split] < MIN_SPLIT_TOKENS:
                what = ("one text" if eot_token is None else
                        f"{sum(documents.values()):,} documents (val takes a fixed ~10% of them)")
                raise ValueError(f"{meta['source']} is too short: {what} gave {writer.tokens[split]} {split} "
                                 f"tokens, and a split needs at least {MIN_SPLIT_TOKENS} (one input and its target) "
                                 f"to be of any use; use more {'text' if eot_token is None else 'documents'}")
        full = {"dataset": meta.pop("dataset"), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "dtype": dtype.name, "train_tokens": writer.tokens["train"], "val_tokens": writer.tokens["val"]}
        if tok.name == "char":
            full["chars"] = tok.chars
        full.update(meta, eot_token=eot_token, train_documents=documents["train"], val_documents=documents["val"])
        writer.commit(full)
    return full


def split_description(by_documents):
    if by_documents:
        return {"by": "documents", "val_fraction": round(1 - TRAIN_FRACTION, 6), "seed": SPLIT_SEED}
    return {"by": "characters", "train_fraction": TRAIN_FRACTION}


def prepare(text, tokenizer, out_dir, dataset, source, workers=1):
    """Tokenize `text` (one document), split it as nanoGPT does (the first 90% of its characters to train, the rest
    to val) and write out_dir/{train.bin, val.bin, meta.json}; returns meta. tokenizer: see make_tokenizer."""
    tok = make_tokenizer(tokenizer, set(text) if tokenizer == "char" else ())
    data = text.encode("utf-8")
    inputs = [{"name": source, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    blocks = (text[i:i + READ_BYTES] for i in range(0, len(text), READ_BYTES))
    meta = {"dataset": dataset, "source": source, "split": split_description(False), "inputs": inputs}
    return write_dataset(single_text_items(blocks, len(text), source), tok, out_dir, meta, workers=workers)


def prepare_files(spec, tokenizer, out_dir, dataset, source=None, text_field="text", workers=1, sha256=None,
                  show_progress=False, stats=None):
    """Prepare the files of --input `spec` (a file, a directory or a glob: list_inputs) into out_dir; returns meta.
    One text file is split by characters (prepare); anything else is a corpus of documents. sha256: the one text
    file's expected sha256 (a known dataset). stats: filled with the run's peak memory and time."""
    start = time.perf_counter()
    paths = list_inputs(spec)
    single_text = len(paths) == 1 and paths[0] == spec and file_kind(spec) == "text"
    if sha256 is not None and not single_text:
        raise ValueError(f"--input={spec} must be a local copy of the dataset's one text file")
    meta = {"dataset": dataset, "source": spec if source is None else source,
            "split": split_description(not single_text)}
    stats = {} if stats is None else stats
    if single_text:  # two passes: the split point and a char vocabulary need the whole text
        n_chars, chars, record = scan_text(spec, sha256, want_chars=tokenizer == "char")
        tok = make_tokenizer(tokenizer, chars)
        if show_progress:
            print(f"length of dataset in characters: {n_chars:,}")
        counter = Corpus([spec], text_field)  # only for its byte count
        hashing, stream = open_input(spec, counter.count)
        with contextlib.closing(hashing.f):
            items = single_text_items(decoded_blocks(raw_blocks(spec, stream), spec), n_chars, spec)
            progress = Progress("tokenizing", counter.total_bytes, show_progress)
            meta = write_dataset(items, tok, out_dir, meta | {"inputs": [record]}, None, workers, text_field,
                                 progress, lambda: counter.bytes_read, stats)
    else:
        tok = make_tokenizer(tokenizer)
        corpus = Corpus(paths, text_field)
        meta.update(text_field=text_field, inputs=corpus.inputs)  # inputs: filled in as the files are read
        progress = Progress("tokenizing", corpus.total_bytes, show_progress)
        meta = write_dataset(corpus.items(), tok, out_dir, meta, eot_token_of(tok), workers, text_field, progress,
                             lambda: corpus.bytes_read, stats)
    stats.update(seconds=time.perf_counter() - start, main_peak_mib=vmhwm_mib())
    return meta


def download(name, url, path, sha256):
    """Download dataset `name` from url to path (once: an existing file with the right sha256 is reused)."""
    if os.path.isfile(path) and file_sha256(path) == sha256:
        return
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts, ... are all OSError
        raise ConnectionError(f"could not download {url} ({e}); offline, pass a local copy of the file: "
                              f"python prepare_data.py {name} --input=path/to/input.txt") from None
    from common import write_atomic  # here, not at the top: common imports torch, which workers need not load

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data)


# ----------------------------------------------------------------------------------------------------------
# --bench: preparation speed against tiktoken's own, and peak memory against corpus size


def synthetic_text(n_chars, seed=0):
    """English-like text from 4,000 made-up words with Zipf-like frequencies, sentences and paragraphs."""
    rng = np.random.default_rng(seed)
    syllables = "ba ce di fo gu ha je ki lo mu na pe qui ro su ta ve wi xo ya ze th st an er in on".split()
    vocab = np.array(["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(4000)])
    weights = 1 / np.arange(1, len(vocab) + 1)
    words = vocab[rng.choice(len(vocab), n_chars // 5, p=weights / weights.sum())]
    ends = rng.choice(np.array(["", "", "", "", "", ",", ".", ".\n", "?", ".\n\n"]), len(words))
    return " ".join(np.char.add(words, ends).tolist())[:n_chars]


def write_bench_corpus(folder, n_bytes, base, seed=0, file_bytes=50_000_000):
    """.jsonl files of documents (random passages of `base`, ~3 KB on average) -> their paths, in order."""
    rng, paths = np.random.default_rng(seed), []
    while sum(os.path.getsize(p) for p in paths) < n_bytes:
        paths.append(os.path.join(folder, f"part-{len(paths):04d}.jsonl"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            while f.tell() < file_bytes:
                length = int(rng.lognormal(7.5, 0.8))
                start = int(rng.integers(0, max(len(base) - length, 1)))
                f.write(json.dumps({"text": base[start:start + length]}) + "\n")
    return paths


def bench_prepare_child(spec, tokenizer, out_dir, workers, queue):
    """Run in a fresh process, so that its VmHWM is the preparation's alone. cpu_seconds: this process and its
    workers (reaped when the pool ends)."""
    import resource

    stats = {}
    meta = prepare_files(spec, tokenizer, out_dir, "bench", workers=workers, stats=stats)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    queue.put({"tokens": meta["train_tokens"] + meta["val_tokens"],
               "cpu_seconds": sum(u.ru_utime + u.ru_stime for u in usage)} | stats)


def tiktoken_single_thread(paths, encoding):
    """Seconds (wall and CPU) and tokens of encoding.encode_ordinary on each document of the .jsonl files, on one
    thread: reading and parsing the files is not counted."""
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                start, cpu_start = time.perf_counter(), time.process_time()
                tokens += len(encoding.encode_ordinary(text))
                seconds += time.perf_counter() - start
                cpu_seconds += time.process_time() - cpu_start
    return seconds, cpu_seconds, tokens


def bench(sizes_mb, tokenizer, workers, base_path=None, folder=None):
    """Print a markdown table: tiktoken's single-thread rate on the smallest corpus, the floor (cores x that), and
    prepare_data's rate and peak memory on each corpus size."""
    tok = make_tokenizer(tokenizer)
    if base_path:
        with open(base_path, encoding="utf-8") as f:
            base = f.read()
    else:
        base = synthetic_text(4_000_000)
    file_mb = max(1, min(50, min(sizes_mb) // 4))  # files of at most 50 MB, at least 4 in the smallest corpus
    with tempfile.TemporaryDirectory(prefix="prepare_bench_", dir=folder) as tmp:
        start = time.perf_counter()
        paths = write_bench_corpus(tmp, max(sizes_mb) * 1_000_000, base, file_bytes=file_mb * 1_000_000)
        print(f"generated {len(paths)} .jsonl files, {sum(map(os.path.getsize, paths)) / 1e6:,.0f} MB, in "
              f"{time.perf_counter() - start:.0f} s (documents: passages of {base_path or 'synthetic text'})")
        rows, context = [], multiprocessing.get_context("spawn")
        for size in sorted(sizes_mb):
            corpus = os.path.join(tmp, f"corpus_{size}MB")
            os.makedirs(corpus)
            for path in paths[:-(-size // file_mb)]:
                os.link(path, os.path.join(corpus, os.path.basename(path)))
            mb = sum(os.path.getsize(os.path.join(corpus, p)) for p in os.listdir(corpus)) / 1e6
            if not rows:
                seconds, cpu, tokens = tiktoken_single_thread(sorted(glob.glob(os.path.join(corpus, "*"))),
                                                              tok.encoding)
                rows.append(("tiktoken encode_ordinary, 1 thread", mb, tokens, seconds, cpu, "-"))
                cores = os.cpu_count()
                rows.append((f"floor: {cores} cores x that", mb, tokens, seconds / cores, cpu, "-"))
            queue = context.Queue()
            child = context.Process(target=bench_prepare_child,
                                    args=(corpus, tokenizer, os.path.join(tmp, "data", "bench"), workers, queue))
            child.start()
            result = queue.get()
            child.join()
            rows.append((f"prepare_data.py, {workers} workers", mb, result["tokens"], result["seconds"],
                         result["cpu_seconds"], f"{result['main_peak_mib']} / {result.get('worker_peak_mib', '-')}"))
    print(f"\n| {tok.name}, {os.cpu_count()} CPUs | corpus MB | tokens | seconds | MB/s | tokens/s | CPU seconds | "
          f"MB per CPU second | peak memory MiB (main / each worker) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for what, mb, tokens, seconds, cpu, memory in rows:
        print(f"| {what} | {mb:,.0f} | {tokens:,} | {seconds:.1f} | {mb / seconds:.1f} | {tokens / seconds:,.0f} | "
              f"{cpu:.1f} | {mb / cpu:.1f} | {memory} |")


# ----------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    from common import ArgumentParser  # here, not at the top: common imports torch, which workers need not load

    parser = ArgumentParser(prog="prepare_data.py",
        description=__doc__.split("\n\nImporting")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Known datasets (downloaded unless --input is given): {', '.join(KNOWN_DATASETS)}. "
        "Any other NAME needs --input.")
    parser.add_argument("name", nargs="?", help="dataset name: the folder DATA_DIR/NAME, and train.py's --dataset")
    parser.add_argument("--input", metavar="PATH", help="a UTF-8 text file, a directory or a glob of .txt/.jsonl/"
                        ".parquet (.gz) files (for a known dataset: a local copy of its file, sha256-checked)")
    parser.add_argument("--tokenizer", metavar="NAME", help="char, gpt2, or any tiktoken encoding, e.g. "
                        "o200k_base (default: the known dataset's, else gpt2)")
    parser.add_argument("--text_field", default="text", metavar="NAME",
                        help="the text of a .jsonl record or a Parquet row (default: text)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), metavar="N",
                        help="tokenizing processes (default: all cores); the result does not depend on it")
    parser.add_argument("--data_dir", default="data", metavar="DIR",
                        help="folder that holds the datasets (default: data)")
    parser.add_argument("--bench", action="store_true", help="measure speed and peak memory on a generated corpus "
                        "(passages of --input, if given, else made-up text) and prepare nothing")
    parser.add_argument("--bench_mb", default="200,400", metavar="MB,MB",
                        help="--bench's corpus sizes in MB (default: 200,400)")
    return parser.parse_args(argv)


def check_args(args):
    """One-line errors for arguments that argparse accepts."""
    if args.tokenizer == "":
        raise ValueError("--tokenizer is empty; give char, gpt2 or a tiktoken encoding such as o200k_base")
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers}; give at least 1")
    if args.bench:
        if not re.fullmatch(r"\d+(,\d+)*", args.bench_mb) or "0" in args.bench_mb.split(","):
            raise ValueError(f"--bench_mb={args.bench_mb!r}; give sizes in MB, e.g. 200,400")
        return
    if args.name is None:
        raise ValueError("no dataset name; e.g. python prepare_data.py shakespeare (or --bench)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name in (".", ".."):
        raise ValueError(f"dataset name {args.name!r} must be a plain folder name (letters, digits, _ . -)")
    if args.name not in KNOWN_DATASETS and args.input is None:
        raise ValueError(f"unknown dataset {args.name!r} (known: {', '.join(KNOWN_DATASETS)}); to prepare your "
                         f"own text: python prepare_data.py {args.name} --input=path/to/text.txt")


def run(args):
    """Prepare the dataset the arguments name -> (meta, out_dir, stats)."""
    known = KNOWN_DATASETS.get(args.name)
    tokenizer = args.tokenizer if args.tokenizer is not None else (known["tokenizer"] if known else "gpt2")
    out_dir = os.path.join(args.data_dir, args.name)
    sha256 = known["sha256"] if known else None
    spec, source = args.input, args.input
    if spec is None:  # a known dataset: download it once, next to its .bin files
        spec, source = os.path.join(out_dir, "input.txt"), known["url"]
        download(args.name, known["url"], spec, sha256)
    stats = {}
    meta = prepare_files(spec, tokenizer, out_dir, args.name, source, args.text_field, args.workers, sha256,
                         show_progress=True, stats=stats)
    return meta, out_dir, stats


def main(argv=None):
    args = parse_args(argv)
    try:
        check_args(args)
        if args.bench:
            bench([int(mb) for mb in args.bench_mb.split(",")], args.tokenizer or "gpt2", args.workers, args.input)
            return
        meta, out_dir, stats = run(args)
    except (OSError, ValueError) as e:  # FileNotFoundError and ConnectionError are OSErrors
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted: {os.path.join(args.data_dir, args.name or '')} is as it was", file=sys.stderr)
        sys.exit(130)
    if meta["tokenizer"] == "char":
        print(f"all the unique characters: {meta['chars']!r}")
    print(f"tokenizer: {meta['tokenizer']}, vocab size: {meta['vocab_size']:,}, dtype: {meta['dtype']}")
    if meta["split"]["by"] == "documents":
        print(f"documents: {meta['train_documents']:,} train, {meta['val_documents']:,} val, each followed by "
              f"<|endoftext|> ({meta['eot_token']})")
    print(f"train has {meta['train_tokens']:,} tokens")
    print(f"val has {meta['val_tokens']:,} tokens")
    memory = f", peak memory {stats['main_peak_mib']} MiB" if stats.get("main_peak_mib") else ""
    workers = f" (+ {stats['worker_peak_mib']} MiB per worker)" if stats.get("worker_peak_mib") else ""
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json in {stats['seconds']:.1f} s{memory}{workers}")


if __name__ == "__main__":
    main()
