"""
Prepare a corpus bigger than memory for train.py: stream it, tokenize it on worker processes, split
it into train and val by whole documents, write data/NAME/{train,val}.bin + meta.json, in
prepare_data.py's format. Run it from the project's root:

    # a directory, a glob (quoted), one .jsonl or .parquet file
    python lab/prepare_corpus.py stories --input=stories/ --tokenizer=o200k_base
    python lab/prepare_corpus.py web --input='shards/*.parquet' --tokenizer=o200k_base
    # one text file too large to read into memory (.gz too): prepare_data.py's split and tokens
    python lab/prepare_corpus.py big --input=big.txt

What --input can be:
  one text file  one document, split as prepare_data.py splits it: the first 90% of its characters
                 to train, the rest to val, no end-of-text token; the same train.bin, val.bin and
                 meta.json as prepare_data.py writes. The only input char-level accepts.
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

meta.json holds prepare_data.py's keys; for a corpus "eot_token" is the id after each document,
"train_documents" and "val_documents" count them, "split" says how, "text_field" is the field read,
and "inputs" lists every file read, with its size and sha256.

Importing this file has no side effects and loads no torch: numpy and tiktoken only.
The pipeline is lab/corpus.py (its readers: lab/corpus_readers.py).
"""

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from lab.cli import ArgumentParser, fail  # noqa: E402
from lab.corpus import prepare_files  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = ArgumentParser(
        prog="prepare_corpus.py", description=__doc__.split("\n\nmeta.json")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?",
                        help="dataset name: the folder DATA_DIR/NAME, and train.py's --dataset")
    parser.add_argument("--input", metavar="PATH",
                        help="a directory, a glob or a file: .txt/.jsonl/.parquet (and .gz)")
    parser.add_argument("--tokenizer", default="gpt2", metavar="NAME",
                        help="gpt2, any tiktoken encoding, e.g. o200k_base, or char (one text "
                        "file only) (default: gpt2)")
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
        raise ValueError("--tokenizer is empty; give gpt2, char or a tiktoken encoding such as "
                         "o200k_base")
    if args.workers < 1:
        raise ValueError(f"--workers={args.workers}; give at least 1")
    if args.name is None:
        raise ValueError("no dataset name; e.g. python lab/prepare_corpus.py stories "
                         "--input=stories/")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name in (".", ".."):
        raise ValueError(f"dataset name {args.name!r} must be a plain folder name (letters, "
                         f"digits, _ . -)")
    if args.input is None:
        raise ValueError(f"no --input; e.g. python lab/prepare_corpus.py {args.name} "
                         f"--input=path/to/corpus/ (the named datasets: python prepare_data.py)")


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
        out_dir = os.path.join(args.data_dir, args.name)
        meta = prepare_files(args.input, args.tokenizer, out_dir, args.name, args.input,
                             args.text_field, args.workers, show_progress=True)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        fail("prepare_corpus.py", e)
    except MemoryError:  # e.g. a .jsonl line of many GB, read whole
        fail("prepare_corpus.py", "out of memory (a document larger than the memory left?); "
             "split the input, or use fewer --workers")
    except KeyboardInterrupt:
        print(f"interrupted: {os.path.join(args.data_dir, args.name or '')} is as it was",
              file=sys.stderr)
        sys.exit(130)
    print_summary(meta, out_dir, time.perf_counter() - start)


if __name__ == "__main__":
    main()
