"""
Prepare a corpus for train.py: tokenize it, split it into train and val, write
data/NAME/{train,val}.bin + meta.json.

    # Tiny Shakespeare (downloaded), GPT-2 BPE
    python prepare_data.py shakespeare
    # the same text, one token per character
    python prepare_data.py shakespeare_char
    # a local copy instead of the download
    python prepare_data.py shakespeare --input=path/to/input.txt
    # any UTF-8 file, any tiktoken encoding
    python prepare_data.py mytext --input=my.txt --tokenizer=o200k_base
    # a corpus: a directory, a glob, .jsonl
    python prepare_data.py stories --input=stories/ --tokenizer=o200k_base

What --input can be:
  one text file  one document, split as in nanoGPT: the first 90% of its characters to train, the
                 rest to val, each part tokenized on its own, no end-of-text token. The only input
                 char-level accepts.
  a corpus       a directory (searched recursively for .txt, .jsonl, .parquet and their .gz forms
                 except .parquet; hidden names skipped), a glob such as "shards/*.jsonl.gz" (every
                 file it matches), or one .jsonl or .parquet file. A text file is one document, a
                 .jsonl line or a Parquet row is one (its --text_field); empty ones are skipped.
                 Files are read in sorted order, every document is followed by one <|endoftext|> of
                 the encoding, and whole documents go to val (a fixed, seeded 10%).
The input is streamed: memory stays bounded whatever its size. Tokenizing runs on --workers
processes, and the .bin files are the same whatever their number. The dataset is written into
DATA_DIR/.NAME.tmpPID and moved into DATA_DIR/NAME only when complete, so an interrupted or failed
run leaves the old dataset (or none), never half one.

The format (train.py, sample.py and eval.py read it with machinery/dataset.py's get_tokenizer,
load_meta, load_split):
  train.bin, val.bin  the token ids, flat, uint16 (uint32 when the vocabulary has more than 65,536
                      ids)
  meta.json           {"dataset", "tokenizer": "gpt2" | "char" | <tiktoken encoding>, "vocab_size",
                       "dtype", "train_tokens", "val_tokens", "chars" (char-level only: the
                       vocabulary in id order), "source", "eot_token" (the id after each document;
                       null for one text file), "train_documents", "val_documents", "split" (how),
                       "text_field" (.jsonl, Parquet), "inputs": [{"name", "bytes", "sha256"}, ...]}

Importing this file has no side effects and loads no torch: numpy and tiktoken only, as in nanoGPT.
The corpus pipeline is machinery/corpus.py (its readers: machinery/corpus_readers.py). The reading
side named above (get_tokenizer, load_meta, load_split, and eval_windows) is machinery/dataset.py.
"""

import argparse
import os
import re
import sys
import time
import urllib.request

from machinery.cli import ArgumentParser, fail, write_atomic
from machinery.corpus import prepare_files
from machinery.corpus_readers import file_sha256
from machinery.dataset import KNOWN_DATASETS  # the named datasets: their url, sha256 and tokenizer

# --------------------------------------------------------------------------------------------------
# The named datasets: downloaded once, their sha256 checked. KNOWN_DATASETS lives with the reader
# (machinery/dataset.py), whose error messages name the command that prepares a dataset.


def download(name, url, path, sha256):
    """Download dataset `name` from url to path (once: an existing file with the right sha256 is
    reused)."""
    if os.path.isfile(path) and file_sha256(path) == sha256:
        return
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts, ... are all OSError
        raise ConnectionError(f"could not download {url} ({e}); offline, pass a local copy of the "
                              f"file: python prepare_data.py {name} "
                              f"--input=path/to/input.txt") from None

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data)


# --------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = ArgumentParser(
        prog="prepare_data.py", description=__doc__.split("\n\nImporting")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Known datasets (downloaded unless --input is given): {', '.join(KNOWN_DATASETS)}. "
        "Any other NAME needs --input.")
    parser.add_argument("name", nargs="?",
                        help="dataset name: the folder DATA_DIR/NAME, and train.py's --dataset")
    parser.add_argument("--input", metavar="PATH",
                        help="a UTF-8 text file, a directory or a glob of .txt/.jsonl/.parquet "
                        "(.gz) files (for a known dataset: a local copy of its file, "
                        "sha256-checked)")
    parser.add_argument("--tokenizer", metavar="NAME",
                        help="char, gpt2, or any tiktoken encoding, e.g. o200k_base (default: the "
                        "known dataset's, else gpt2)")
    parser.add_argument("--text_field", default="text", metavar="NAME",
                        help="the text of a .jsonl record or a Parquet row (default: text)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), metavar="N",
                        help="tokenizing processes (default: all cores); the result does not "
                        "depend on it")
    parser.add_argument("--data_dir", default="data", metavar="DIR",
                        help="folder that holds the datasets (default: data)")
    return parser.parse_args(argv)


def check_args(args):
    """One-line errors for arguments that argparse accepts."""
    if args.tokenizer == "":
        raise ValueError("--tokenizer is empty; give char, gpt2 or a tiktoken encoding such as "
                         "o200k_base")
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers}; give at least 1")
    if args.name is None:
        raise ValueError("no dataset name; e.g. python prepare_data.py shakespeare")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name in (".", ".."):
        raise ValueError(f"dataset name {args.name!r} must be a plain folder name (letters, "
                         f"digits, _ . -)")
    if args.name not in KNOWN_DATASETS and args.input is None:
        raise ValueError(f"unknown dataset {args.name!r} (known: {', '.join(KNOWN_DATASETS)}); to "
                         f"prepare your own text: python prepare_data.py {args.name} "
                         f"--input=path/to/text.txt")


def run(args):
    """Prepare the dataset the arguments name -> (meta, out_dir)."""
    known = KNOWN_DATASETS.get(args.name)
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = known["tokenizer"] if known else "gpt2"
    out_dir = os.path.join(args.data_dir, args.name)
    sha256 = known["sha256"] if known else None
    spec, source = args.input, args.input
    if spec is None:  # a known dataset: download it once, next to its .bin files
        spec, source = os.path.join(out_dir, "input.txt"), known["url"]
        download(args.name, known["url"], spec, sha256)
    meta = prepare_files(spec, tokenizer, out_dir, args.name, source, args.text_field, args.workers,
                         sha256, show_progress=True)
    return meta, out_dir


def peak_memory_mib():
    """Peak resident memory of this process and of its largest ended child (a tokenizing worker; 0
    without one), in MiB, from getrusage (ru_maxrss counts KiB on Linux, bytes on macOS); (None,
    None) on Windows, which has no resource module."""
    try:
        import resource
    except ImportError:
        return None, None
    unit = 2**20 if sys.platform == "darwin" else 1024
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // unit,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // unit)


def print_summary(meta, out_dir, seconds):
    """What nanoGPT's prepare.py prints (the counts), and where the dataset went."""
    if meta["tokenizer"] == "char":
        print(f"all the unique characters: {meta['chars']!r}")
    print(f"tokenizer: {meta['tokenizer']}, vocab size: {meta['vocab_size']:,}, "
          f"dtype: {meta['dtype']}")
    if meta["split"]["by"] == "documents":
        print(f"documents: {meta['train_documents']:,} train, {meta['val_documents']:,} val, each "
              f"followed by <|endoftext|> ({meta['eot_token']})")
    print(f"train has {meta['train_tokens']:,} tokens")
    print(f"val has {meta['val_tokens']:,} tokens")
    main, worker = peak_memory_mib()
    memory = f", peak memory {main} MiB" if main else ""
    memory += f" (+ {worker} MiB per worker)" if worker else ""
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json in {seconds:.1f} s{memory}")


def main(argv=None):
    args = parse_args(argv)
    try:
        check_args(args)
        start = time.perf_counter()
        meta, out_dir = run(args)
    except (OSError, ValueError) as e:  # FileNotFoundError and ConnectionError are OSErrors
        fail("prepare_data.py", e)
    except MemoryError:  # e.g. a .jsonl line of many GB, read whole
        fail("prepare_data.py", "out of memory (a document larger than the memory left?); split "
             "the input, or use fewer --workers")
    except KeyboardInterrupt:
        print(f"interrupted: {os.path.join(args.data_dir, args.name or '')} is as it was",
              file=sys.stderr)
        sys.exit(130)
    print_summary(meta, out_dir, time.perf_counter() - start)


if __name__ == "__main__":
    main()
