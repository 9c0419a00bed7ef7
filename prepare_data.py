"""
Prepare a text for train.py, as nanoGPT's prepare.py does: tokenize it, split it into train and
val, write data/NAME/{train,val}.bin + meta.json.

    python prepare_data.py shakespeare                    # Tiny Shakespeare (downloaded), GPT-2 BPE
    python prepare_data.py shakespeare_char               # the same text, one token per character
    python prepare_data.py shakespeare --input=input.txt  # offline: a local copy, sha256-checked
    python prepare_data.py mytext --input=my.txt --tokenizer=o200k_base  # any UTF-8 text file
    python prepare_data.py mytext --input=my.txt --tokenizer=out-smollm2  # a converted model's BPE

The split is nanoGPT's: the first 90% of the characters to train, the rest to val, each part
tokenized on its own. The text is read whole into memory (Tiny Shakespeare: 1 MB); corpora (a
directory, a glob, .jsonl, Parquet, .gz) and texts bigger than memory go to `python
lab/prepare_corpus.py NAME --input=PATH`, which streams them (one text file: the same files).
train.bin and val.bin hold the token ids, flat, uint16 (uint32 past 65,536 ids); meta.json's keys
are described in docs/data.md. numpy and tiktoken only (torch only to read a run's tokenizer),
nothing else of the project.
"""

import argparse
import base64
import contextlib
import errno
import hashlib
import json
import os
import re
import sys
import urllib.request

import numpy as np
import tiktoken

# The named datasets: Tiny Shakespeare and its default tokenizers. Downloaded once, sha256-checked.
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DATASETS = {"shakespeare": "gpt2", "shakespeare_char": "char"}
TRAIN_FRACTION = 0.9  # nanoGPT's split

# --------------------------------------------------------------------------------------------------
# A text: downloaded or given, read, tokenized, split, written


def download(name, path):
    """Tiny Shakespeare to path, once (a file already there with the right sha256 is reused)."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() == SHA256:
                return
    print(f"downloading {URL}")
    try:
        with urllib.request.urlopen(URL, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts, ... are all OSError
        raise ConnectionError(f"could not download {URL} ({e}); offline, give a local copy: "
                              f"python prepare_data.py {name} --input=path/to/input.txt") from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_files({path: data})


def read_text(name, path, sha256=None):
    """The UTF-8 text of file `path` -> (text, its record for meta.json). A corpus is refused,
    naming the command that prepares it, and so is a FIFO or a device (a read may wait forever)."""
    if (os.path.isdir(path) or path.lower().endswith((".jsonl", ".parquet", ".gz"))
            or (not os.path.exists(path) and any(c in path for c in "*?["))):  # or a glob
        raise ValueError(f"--input={path} is a corpus (a directory, a glob, .jsonl, .parquet or "
                         f".gz); prepare it with: python lab/prepare_corpus.py {name} "
                         f"--input='{path}'")
    if not os.path.isfile(path):  # missing, a broken link, a FIFO, a device
        raise FileNotFoundError(f"--input={path}: no such file, or not a regular one")
    with open(path, "rb") as f:
        data = f.read()
    found = hashlib.sha256(data).hexdigest()
    if sha256 is not None and found != sha256:
        raise ValueError(f"{path} is not the expected file: its sha256 is {found}, expected "
                         f"{sha256}")
    try:
        text = data.decode("utf-8")  # bytes, not text mode: "\r\n" stays two characters
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}, line {line:,}: not UTF-8 text (byte {e.start:,}: "
                         f"{data[e.start:e.start + 4]!r}); convert the file to UTF-8") from None
    return text, {"name": path, "bytes": len(data), "sha256": found}


def load_tokenizer(name):
    """"char", tiktoken's encoding `name` (downloaded once into TIKTOKEN_CACHE_DIR, if set), or a
    run folder's BPE: its checkpoint's {"tokenizer", "bpe"} (a converted model's, lab/from_gguf.py).
    """
    if os.path.isdir(name):
        return run_tokenizer(name)
    names = tiktoken.list_encoding_names()
    if name != "char" and name not in names:
        raise ValueError(f"unknown tokenizer {name!r}; use char, a tiktoken encoding ("
                         f"{', '.join(names)}) or a run folder whose model has its own BPE")
    try:
        return name if name == "char" else tiktoken.get_encoding(name)
    except Exception as e:  # offline with nothing cached, a corrupt cache file, ...
        raise ValueError(f"tiktoken encoding {name!r} could not be loaded ({type(e).__name__}): "
                         f"offline, set TIKTOKEN_CACHE_DIR to a folder that holds it") from None


def run_tokenizer(folder):
    """A run folder -> its tokenizer's entries of meta ("tokenizer", "bpe", its "chat" format if
    any), read from its ckpt.pt (torch imported here only; memory-mapped, so the weights are not
    read) or from a prepared dataset's meta.json."""
    ckpt, meta_json = os.path.join(folder, "ckpt.pt"), os.path.join(folder, "meta.json")
    if os.path.isfile(ckpt):
        import torch

        try:
            meta = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["meta"]
        except Exception:  # not a checkpoint, damaged, no meta, ...
            meta = None
    elif os.path.isfile(meta_json):
        with open(meta_json, "rb") as f:
            meta = json.loads(f.read())
    else:
        raise ValueError(f"--tokenizer={folder} is a folder without ckpt.pt or meta.json; give a "
                         f"run folder, a prepared dataset, or a tokenizer's name")
    if not isinstance(meta, dict) or not isinstance(meta.get("bpe"), dict):
        raise ValueError(f"--tokenizer={folder}: its checkpoint or meta.json keeps no BPE of its "
                         f"own; name its tokenizer instead (e.g. gpt2), or give a run converted "
                         f"by lab/from_gguf.py")
    return {k: meta[k] for k in ("tokenizer", "bpe", "chat") if k in meta}


def bpe_encoding(meta):
    """A BPE kept in a meta dict (meta["bpe"]: each id's bytes in base64, None for a special
    token; the pre-tokenizer's pattern; the special tokens) -> its tiktoken encoding, each token
    ranked by its id."""
    bpe = meta["bpe"]
    ranks = {base64.b64decode(t): i for i, t in enumerate(bpe["tokens"]) if t is not None}
    return tiktoken.Encoding(meta["tokenizer"], pat_str=bpe["pattern"], mergeable_ranks=ranks,
                             special_tokens=bpe["special_tokens"])


def prepare(path, tokenizer, out_dir, dataset, source, sha256=None):
    """Tokenize the text file at path into out_dir -> meta. tokenizer: "char", a tiktoken Encoding
    or its name, or a run folder's BPE (run_tokenizer); special tokens (<|endoftext|>) are encoded
    as text."""
    text, record = read_text(dataset, path, sha256)  # first: a bad input says so, offline too
    tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    bpe = tokenizer if isinstance(tokenizer, dict) else None
    tokenizer = bpe_encoding(bpe) if bpe else tokenizer
    print(f"length of dataset in characters: {len(text):,}")
    if tokenizer == "char":
        chars = "".join(sorted(set(text)))
        print(f"all the unique characters: {chars!r}")
        if len(chars) < 2:  # a model tells tokens apart: one token leaves nothing to learn
            raise ValueError(f"{source} has {len(chars)} distinct character(s), and dataset "
                             f"{dataset} needs at least 2 tokens; use more varied text")
        stoi = {c: i for i, c in enumerate(chars)}
        name, vocab_size, encode = "char", len(chars), lambda s: [stoi[c] for c in s]
    else:
        name, vocab_size, encode = tokenizer.name, tokenizer.n_vocab, tokenizer.encode_ordinary
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    n = int(len(text) * TRAIN_FRACTION)
    splits = {"train": np.array(encode(text[:n]), dtype), "val": np.array(encode(text[n:]), dtype)}
    for split, ids in splits.items():
        if len(ids) < 2:  # one input and its target: the least that gives train.py one window
            raise ValueError(f"{source} is too short: one text gave {len(ids)} {split} tokens, and "
                             f"a split needs at least 2 (one input and its target); use more text")
    meta = {"dataset": dataset, "tokenizer": name, "vocab_size": vocab_size, "dtype": dtype.name,
            "train_tokens": len(splits["train"]), "val_tokens": len(splits["val"]),
            **({"chars": chars} if name == "char" else {}),
            **({k: bpe[k] for k in bpe if k != "tokenizer"} if bpe else {}), "source": source,
            "split": {"by": "characters", "train_fraction": TRAIN_FRACTION}, "inputs": [record],
            "eot_token": None, "train_documents": 1, "val_documents": 1}  # as a corpus has them
    files = {os.path.join(out_dir, f"{split}.bin"): ids.tobytes() for split, ids in splits.items()}
    try:
        os.makedirs(out_dir, exist_ok=True)
        write_files(files | {os.path.join(out_dir, "meta.json"): json.dumps(meta, indent=2) + "\n"})
    except OSError as e:  # a full disk, a read-only folder: which, and what to do
        fix = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
        raise OSError(f"cannot write {out_dir} ({(e.strerror or str(e)).lower()}); {fix}, or "
                      f"prepare into another folder (--data_dir)") from None
    return meta


def write_files(contents):
    """Write {path: bytes or str}, each to path.tmpPID first, synced; then remove the last path and
    move the files into place in order. An error or Ctrl-C while writing leaves every old file
    whole, and no temp file; while moving (milliseconds) the folder lacks meta.json, which readers
    take for "not prepared", never a mix of old and new files."""
    temps = {path: f"{path}.tmp{os.getpid()}" for path in contents}
    try:
        for path, data in contents.items():
            with open(temps[path], "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename, so a crash never keeps half
        with contextlib.suppress(FileNotFoundError):
            os.remove(list(contents)[-1])  # meta.json: "not prepared" until the new one is in
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)


# --------------------------------------------------------------------------------------------------
# Command line


def fail(message):  # bad input: one line on stderr, exit code 2, no traceback
    print(f"prepare_data.py: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="prepare_data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: fail(f"{message} (see --help)")  # one line, not the usage
    parser.add_argument("name", help=f"{' or '.join(DATASETS)}, or any name with --input: "
                        "the folder DATA_DIR/NAME, and train.py's --dataset")
    parser.add_argument("--input", metavar="FILE", help="a UTF-8 text file (for a named "
                        "dataset: a local copy of its file, sha256-checked)")
    parser.add_argument("--tokenizer", metavar="NAME", help="char, gpt2 or any tiktoken "
                        "encoding, e.g. o200k_base, or a run folder whose model has its own BPE "
                        "(default: the named dataset's, else gpt2)")
    parser.add_argument("--data_dir", default="data", metavar="DIR",
                        help="folder that holds the datasets (default: data)")
    args = parser.parse_args(argv)
    out_dir = os.path.join(args.data_dir, args.name)
    try:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name in (".", ".."):
            raise ValueError(f"dataset name {args.name!r} must be a plain folder name (letters, "
                             f"digits, _ . -)")
        if args.name not in DATASETS and args.input is None:
            raise ValueError(f"unknown dataset {args.name!r} (known: {', '.join(DATASETS)}); to "
                             f"prepare your own text: python prepare_data.py {args.name} "
                             f"--input=path/to/text.txt")
        path = args.input or os.path.join(out_dir, "input.txt")  # downloaded beside the .bin files
        if args.input is None:
            download(args.name, path)
        sha256 = SHA256 if args.name in DATASETS else None
        tokenizer = DATASETS.get(args.name, "gpt2") if args.tokenizer is None else args.tokenizer
        meta = prepare(path, tokenizer, out_dir, args.name, args.input or URL, sha256)
    except (OSError, ValueError) as e:  # a missing file, no network, bad bytes, ...
        fail(e)
    except MemoryError:
        fail(f"out of memory; a text this large streams: python lab/prepare_corpus.py {args.name} "
             f"--input={path}")
    except KeyboardInterrupt:
        print(f"interrupted: {out_dir} is as it was", file=sys.stderr)
        sys.exit(130)
    print(f"tokenizer: {meta['tokenizer']}, vocab size: {meta['vocab_size']:,}, "
          f"dtype: {meta['dtype']}\ntrain has {meta['train_tokens']:,} tokens\n"
          f"val has {meta['val_tokens']:,} tokens\nwrote {out_dir}/train.bin, val.bin, meta.json")


if __name__ == "__main__":
    main()
