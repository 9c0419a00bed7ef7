"""lab/prepare_corpus.py's pipeline: tokenize on worker processes, split, write a dataset.

prepare_files(spec, ...) prepares --input: lab/corpus_readers.py lists and reads the files as
work items, tokenize_item tokenizes each (on --workers processes, the results kept in input order,
so the .bin files are the same whatever their number), write_tokens sends each document to train or
val, and DatasetWriter writes the files into a temporary folder that becomes DATA_DIR/NAME only when
complete. The format is prepare_data.py's (docs/data.md describes it); lab/dataset.py reads
it. numpy and tiktoken only: no torch.
"""

import collections
import contextlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time

import numpy as np

from lab.cli import one_line, parse_json, pid_alive
from lab.corpus_readers import (
    Corpus,
    decoded_blocks,
    file_kind,
    list_inputs,
    open_input,
    raw_blocks,
    scan_text,
    single_text_items,
    skipped_note,
)
from lab.dataset import UINT16_VOCAB, CharTokenizer, TiktokenTokenizer, load_encoding

# One text: its first 90% of characters to train; a corpus: each document with probability 0.9.
TRAIN_FRACTION = 0.9
# Which documents of a corpus go to val: fixed, so that the same corpus always splits the same way.
SPLIT_SEED = 1337
# One input and its target: the least a split needs to give train.py and eval.py one window.
MIN_SPLIT_TOKENS = 2
PROGRESS_INTERVAL_S = 2.0  # at most one progress line on stderr per this many seconds
SPLITS = ("train", "val")


# --------------------------------------------------------------------------------------------------
# Writing a dataset: atomic files, and a dataset folder that appears only when complete


class DatasetWriter:
    """train.bin and val.bin, appended to as tokens come, in a temporary sibling folder
    DATA_DIR/.NAME.tmpPID that commit() moves into place. Until then DATA_DIR/NAME is untouched; on
    any error or Ctrl-C (`with` block) the temporary folder is removed, and the folder of a killed
    run is removed by the next run."""

    def __init__(self, out_dir, dtype):
        self.out_dir, self.dtype = os.path.normpath(out_dir), dtype
        parent, name = os.path.split(self.out_dir)
        os.makedirs(parent or ".", exist_ok=True)

        stale = re.compile(rf"\.{re.escape(name)}\.tmp(\d+)")
        for entry in os.listdir(parent or "."):
            match = stale.fullmatch(entry)
            if match and (int(match[1]) == os.getpid() or not pid_alive(int(match[1]))):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        self.tmp_dir = os.path.join(parent, f".{name}.tmp{os.getpid()}")
        os.makedirs(self.tmp_dir)
        self.files = {split: open(os.path.join(self.tmp_dir, f"{split}.bin"), "wb")
                      for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # BaseException included: KeyboardInterrupt leaves no temporary folder either
        if exc_type is not None:
            for f in self.files.values():
                f.close()
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def append(self, split, tokens):
        tokens.astype(self.dtype, copy=False).tofile(self.files[split])
        self.tokens[split] += len(tokens)

    def commit(self, meta):
        """Write meta.json and move the dataset into out_dir. Files are fsynced first, so that after
        a crash the renamed files hold their data."""
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
        # out_dir exists (it may hold other files, e.g. a known dataset's downloaded input.txt):
        # replace the three files, meta.json last, after removing the old one, so that in between
        # the folder reads as "not prepared" (load_meta) rather than as a mix of old and new files
        meta_path = os.path.join(self.out_dir, "meta.json")
        if os.path.exists(meta_path):
            os.remove(meta_path)
        for name in ("train.bin", "val.bin", "meta.json"):
            os.replace(os.path.join(self.tmp_dir, name), os.path.join(self.out_dir, name))
        os.rmdir(self.tmp_dir)


# --------------------------------------------------------------------------------------------------
# Tokenizing: worker processes, results in input order


# A tokenizing process's settings: tokenizer, eot_token, dtype, text_field (init_worker).
_worker = {}


def init_worker(tokenizer, eot_token, dtype, text_field):
    _worker.update(tokenizer=tokenizer, eot_token=eot_token, dtype=dtype, text_field=text_field)


def init_pool_worker(*worker_args):
    # Ctrl-C is the main process's to handle: it ends the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(*worker_args)


def parse_json_line(raw, where):
    """One .jsonl line (bytes) -> (its value, None), or (None, cli.parse_json's one-line error)."""
    try:
        return parse_json(raw, where, "fix or remove the line"), None
    except ValueError as e:
        return None, str(e)


def jsonl_documents(block, path, first_line, text_field):
    """The texts of a block of .jsonl lines (blank lines skipped) -> (texts, None), or
    (None, one-line error)."""
    texts = []
    for i, raw in enumerate(block.split(b"\n")):
        if not raw.strip():
            continue
        where = f"{path}, line {first_line + i:,}"
        record, error = parse_json_line(raw, where)
        if error:
            return None, error
        if not isinstance(record, dict) or text_field not in record:
            if isinstance(record, dict):
                keys = ", ".join(list(record)[:8])
            else:
                keys = type(record).__name__
            return None, (f"{where}: no {text_field!r} field (found: {keys}); choose the field "
                          f"with --text_field=NAME")
        if not isinstance(record[text_field], str):
            what = type(record[text_field]).__name__
            return None, f"{where}: field {text_field!r} is {what}, not text"
        texts.append(record[text_field])
    return texts, None


def item_texts(item):
    """The texts of a work item and whether its last one ends a document -> (texts, ends, None), or
    (None, None, one-line error)."""
    if item.kind == "text":
        return [item.payload], item.ends_document, None
    if item.kind == "jsonl":
        texts, error = jsonl_documents(item.payload, item.path, item.line, _worker["text_field"])
        return texts, True, error
    for i, value in enumerate(item.payload):
        if not isinstance(value, str):
            return None, None, (f"{item.path}, row {item.line + i:,}: {_worker['text_field']!r} is "
                                f"{'null' if value is None else type(value).__name__}, not text")
    return item.payload, True, None


def tokenize_item(item):
    """Tokens of one work item, with this process's tokenizer -> (tokens as one array, token count
    of each document (or of the one piece, for "text"), None), or (None, None, one-line error). Each
    finished document is followed by eot_token, when there is one; empty documents give nothing."""
    try:
        return tokenize_texts(item)
    except MemoryError:  # an error line, not a traceback from the worker pool
        where = {"text": "", "jsonl": f", lines from {item.line:,}",
                 "rows": f", rows from {item.line:,}"}[item.kind]
        return None, None, (f"{item.path}{where}: too large to tokenize in the memory left; use "
                            f"fewer --workers, or split the documents")


def tokenize_texts(item):
    """tokenize_item, but a MemoryError is raised."""
    texts, ends, error = item_texts(item)
    if error:
        return None, None, error
    tokenizer, eot_token = _worker["tokenizer"], _worker["eot_token"]
    separator = np.array([eot_token] if ends and eot_token is not None else [], dtype=np.uint32)
    arrays, lengths = [np.zeros(0, dtype=np.uint32)], []
    for text in texts:
        if not text and item.kind != "text":
            continue
        # "<|endoftext|>" inside a text is encoded as text
        arrays += [tokenizer.encode_array(text), separator]
        lengths.append(len(arrays[-2]) + len(separator))
    return np.concatenate(arrays).astype(_worker["dtype"]), lengths, None


def tokenized_in_order(items, worker_args, workers):
    """(item, tokenize_item(item)) for each item, in input order, on `workers` processes. At most 2
    tasks per worker are in flight, so memory stays bounded (Pool.imap would read the whole input
    ahead). The items kept for the results lose their payload."""
    if workers == 1:
        init_worker(*worker_args)
        for item in items:
            yield item, tokenize_item(item)
        return
    # spawn, not fork: the caller may hold threads (torch, tests), and forking a threaded process
    # can deadlock
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


# --------------------------------------------------------------------------------------------------
# The split, progress, and the tokens written


def is_val_document(indices, seed=SPLIT_SEED):
    """Whether documents (by index in the corpus) go to val: a fixed pseudo-random share of them,
    1 - TRAIN_FRACTION. A hash of (seed, index) (splitmix64), so the choice depends on nothing else,
    e.g. not on the worker count."""
    z = np.asarray(indices, dtype=np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 >= TRAIN_FRACTION


def split_description(by_documents):
    if by_documents:
        return {"by": "documents", "val_fraction": round(1 - TRAIN_FRACTION, 6), "seed": SPLIT_SEED}
    return {"by": "characters", "train_fraction": TRAIN_FRACTION}


class Progress:
    """Progress lines on stderr, at most one per PROGRESS_INTERVAL_S: bytes and documents read,
    tokens written, MB/s, ETA. Silent in short runs (and so in tests)."""

    def __init__(self, what, total_bytes, enabled=True):
        self.what, self.total, self.enabled = what, total_bytes, enabled
        self.start = self.last = time.monotonic()

    def update(self, bytes_read, documents=None, tokens=None):
        now = time.monotonic()
        if not self.enabled or now - self.last < PROGRESS_INTERVAL_S:
            return
        self.last, elapsed = now, now - self.start
        rate = bytes_read / elapsed
        eta = "?"
        if rate > 0:
            eta = time.strftime("%H:%M:%S", time.gmtime((self.total - bytes_read) / rate))
        counts = ""
        if documents is not None:
            counts = f", {documents:,} documents read, {tokens:,} tokens written"
        print(f"{self.what}: {bytes_read / 1e6:,.1f} of {self.total / 1e6:,.1f} MB read "
              f"({100 * bytes_read / max(self.total, 1):.0f}%){counts}, {rate / 1e6:.1f} MB/s, "
              f"ETA {eta}", file=sys.stderr, flush=True)


def write_tokens(items, writer, worker_args, workers, progress=None, bytes_read=None):
    """Tokenize work items and append their tokens to the writer's splits -> documents per split. A
    piece with a split goes there; the other documents go by their index (is_val_document).
    bytes_read(): for progress."""
    documents, next_document = dict.fromkeys(SPLITS, 0), 0
    for item, (tokens, lengths, error) in tokenized_in_order(items, worker_args, workers):
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


# --------------------------------------------------------------------------------------------------
# Preparing a dataset


def make_tokenizer(tokenizer, chars=()):
    """tokenizer: "char" (its vocabulary: the sorted `chars`), the name of a tiktoken encoding, or a
    tiktoken.Encoding object (used in-process, e.g. by tests, without registering it with
    tiktoken)."""
    if tokenizer == "char":
        return CharTokenizer("".join(sorted(chars)))
    if isinstance(tokenizer, str):
        return TiktokenTokenizer(load_encoding(tokenizer))
    return TiktokenTokenizer(tokenizer)


def eot_token_of(tok):
    """The id that follows every document of a corpus: the encoding's <|endoftext|>."""
    if tok.name == "char":
        raise ValueError("--tokenizer=char prepares one text file; a corpus (a directory, a glob, "
                         ".jsonl or .parquet) needs a tiktoken encoding, whose <|endoftext|> "
                         "separates documents, e.g. --tokenizer=gpt2")
    eot = tok.encoding._special_tokens.get("<|endoftext|>")
    if eot is None:
        raise ValueError(f"encoding {tok.name!r} has no <|endoftext|> token to separate documents; "
                         f"use another encoding, or prepare one text file")
    return eot


def check_split_sizes(writer, documents, source, eot_token):
    """Refuse a split too short to give one window."""
    for split in SPLITS:
        if writer.tokens[split] < MIN_SPLIT_TOKENS:
            what = ("one text" if eot_token is None else
                    f"{sum(documents.values()):,} documents (val takes a fixed ~10% of them)")
            more = "text" if eot_token is None else "documents"
            raise ValueError(f"{source} is too short: {what} gave {writer.tokens[split]} {split} "
                             f"tokens, and a split needs at least {MIN_SPLIT_TOKENS} (one input "
                             f"and its target) to be of any use; use more {more}")


def write_dataset(items, tok, out_dir, meta, eot_token=None, workers=1, text_field="text",
                  progress=None, bytes_read=None):
    """Tokenize the work items into out_dir, atomically (DatasetWriter) -> the complete meta: `meta`
    (dataset, source, split, inputs, ...) with the tokenizer's keys and the counts added. Refuses a
    split too short to use."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= UINT16_VOCAB else np.uint32)
    worker_args = (tok, eot_token, dtype, text_field)
    with DatasetWriter(out_dir, dtype) as writer:
        documents = write_tokens(items, writer, worker_args, workers, progress, bytes_read)
        check_split_sizes(writer, documents, meta["source"], eot_token)
        full = {"dataset": meta.pop("dataset"), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "dtype": dtype.name, "train_tokens": writer.tokens["train"],
                "val_tokens": writer.tokens["val"]}
        if tok.name == "char":
            full["chars"] = tok.chars
        full.update(meta, eot_token=eot_token, train_documents=documents["train"],
                    val_documents=documents["val"])
        writer.commit(full)
    return full


def prepare_files(spec, tokenizer, out_dir, dataset, source=None, text_field="text", workers=1,
                  show_progress=False):
    """Prepare the files of --input `spec` (a file, a directory or a glob: list_inputs, whose
    skipped paths are one note on stderr) into out_dir; returns meta. One text file (.gz too) is
    split by characters as prepare_data.py splits it (prepare_one_text), streamed; anything else is
    a corpus of documents."""
    paths, skipped = list_inputs(spec)
    if skipped:
        print(f"prepare_corpus.py: note: {one_line(skipped_note(skipped))}", file=sys.stderr,
              flush=True)
    single_text = len(paths) == 1 and paths[0] == spec and file_kind(spec) == "text"
    meta = {"dataset": dataset, "source": spec if source is None else source,
            "split": split_description(not single_text)}
    if single_text:
        return prepare_one_text(spec, tokenizer, out_dir, meta, workers, text_field, show_progress)
    tok = make_tokenizer(tokenizer)
    corpus = Corpus(paths, text_field)
    meta.update(text_field=text_field, inputs=corpus.inputs)  # inputs: filled in as files are read
    progress = Progress("tokenizing", corpus.total_bytes, show_progress)
    return write_dataset(corpus.items(), tok, out_dir, meta, eot_token_of(tok), workers,
                         text_field, progress, lambda: corpus.bytes_read)


def prepare_one_text(path, tokenizer, out_dir, meta, workers, text_field, show_progress):
    """prepare_files for one text file, in two passes: the split point and a char vocabulary need
    the whole text."""
    n_chars, chars, record = scan_text(path, want_chars=tokenizer == "char")
    tok = make_tokenizer(tokenizer, chars)
    if show_progress:
        print(f"length of dataset in characters: {n_chars:,}")
    counter = Corpus([path], text_field)  # only for its byte count
    hashing, stream = open_input(path, counter.count)
    with contextlib.closing(hashing.f):
        blocks = decoded_blocks(raw_blocks(path, stream), path)
        items = single_text_items(blocks, int(n_chars * TRAIN_FRACTION), path)
        progress = Progress("tokenizing", counter.total_bytes, show_progress)
        return write_dataset(items, tok, out_dir, meta | {"inputs": [record]}, None, workers,
                             text_field, progress, lambda: counter.bytes_read)
