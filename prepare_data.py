"""
Prepare a text dataset for train.py: tokenize it, split it 90/10, and write data/NAME/{train,val}.bin + meta.json.

    python prepare_data.py shakespeare                 # Tiny Shakespeare (downloaded), GPT-2 BPE
    python prepare_data.py shakespeare_char            # the same text, one token per character
    python prepare_data.py shakespeare --input=path/to/input.txt           # a local copy instead of the download
    python prepare_data.py mytext --input=my.txt --tokenizer=o200k_base    # any UTF-8 file, any tiktoken encoding

The format (train.py, sample.py and eval.py read it with this file's get_tokenizer, load_meta, load_split):
  train.bin, val.bin  the token ids, flat, uint16 (uint32 when the vocabulary has more than 65,536 ids)
  meta.json           {"dataset", "tokenizer": "gpt2" | "char" | <tiktoken encoding>, "vocab_size", "dtype",
                       "train_tokens", "val_tokens", "chars" (char-level only: the vocabulary in id order),
                       "source"}
As in nanoGPT, the text is split at 90% of its characters and each part is tokenized on its own.

Importing this file has no side effects; the reading side is get_tokenizer, load_meta, load_split, eval_windows.
"""

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import urllib.request

import numpy as np

# Datasets this script knows by name: where to download them, their sha256, and their default tokenizer.
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
KNOWN_DATASETS = {
    "shakespeare": {"url": SHAKESPEARE_URL, "sha256": SHAKESPEARE_SHA256, "tokenizer": "gpt2"},
    "shakespeare_char": {"url": SHAKESPEARE_URL, "sha256": SHAKESPEARE_SHA256, "tokenizer": "char"},
}
TRAIN_FRACTION = 0.9
UINT16_VOCAB = 65536  # ids 0..65535 fit in uint16


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
    return meta


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
# Writing a dataset


@contextlib.contextmanager
def atomic_path(path):
    """`with atomic_path(path) as tmp:` write the file at tmp; at the end of the block it replaces path
    (os.replace), so a reader never sees half a file and an interrupted write leaves the old one whole. The
    process id in tmp keeps concurrent writers (DDP ranks) apart. Every script writes its files this way."""
    tmp = f"{path}.tmp{os.getpid()}"
    yield tmp
    os.replace(tmp, path)


def write_atomic(path, data):
    """Write bytes to path atomically (atomic_path)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def prepare(text, tokenizer, out_dir, dataset, source):
    """Tokenize `text`, split it 90/10 and write out_dir/{train.bin, val.bin, meta.json}; returns meta.

    tokenizer: "char", the name of a tiktoken encoding, or a tiktoken.Encoding object (used in-process, e.g.
    by tests, without registering it with tiktoken)."""
    if tokenizer == "char":
        tok = CharTokenizer("".join(sorted(set(text))))
    elif isinstance(tokenizer, str):
        tok = TiktokenTokenizer(load_encoding(tokenizer))
    else:
        tok = TiktokenTokenizer(tokenizer)
    n = len(text)
    split_at = int(n * TRAIN_FRACTION)
    train_ids, val_ids = tok.encode(text[:split_at]), tok.encode(text[split_at:])
    if not train_ids or not val_ids:
        raise ValueError(f"{source} is too short ({n} characters) to split into train and val")
    dtype = np.uint16 if tok.vocab_size <= UINT16_VOCAB else np.uint32
    meta = {"dataset": dataset, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
            "train_tokens": len(train_ids), "val_tokens": len(val_ids)}
    if tok.name == "char":
        meta["chars"] = tok.chars
    meta["source"] = source

    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # until the new meta.json is written, the folder reads as "not prepared"
    write_atomic(os.path.join(out_dir, "train.bin"), np.array(train_ids, dtype=dtype).tobytes())
    write_atomic(os.path.join(out_dir, "val.bin"), np.array(val_ids, dtype=dtype).tobytes())
    write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return meta


def read_text(path, sha256=None):
    """The UTF-8 text of a file, checked against sha256 when given."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input={path}: no such file")
    with open(path, "rb") as f:
        data = f.read()
    found = hashlib.sha256(data).hexdigest() if sha256 is not None else None
    if found != sha256:
        raise ValueError(f"{path} is not the expected file: its sha256 is {found}, expected {sha256}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None


def download(name, url, path, sha256):
    """Download dataset `name` from url to path (once: an existing file with the right sha256 is reused)."""
    if os.path.isfile(path):
        try:
            read_text(path, sha256)
            return
        except ValueError:
            pass  # a corrupt or foreign file: download again
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
    except OSError as e:  # URLError, timeouts, ... are all OSError
        raise ConnectionError(f"could not download {url} ({e}); offline, pass a local copy of the file: "
                              f"python prepare_data.py {name} --input=path/to/input.txt") from None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\nImporting")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Known datasets (downloaded unless --input is given): {', '.join(KNOWN_DATASETS)}. "
        "Any other NAME needs --input.")
    parser.add_argument("name", help="dataset name: the folder DATA_DIR/NAME, and train.py's --dataset")
    parser.add_argument("--input", metavar="PATH", help="a UTF-8 text file to prepare (for a known dataset: a "
                        "local copy, checked against its sha256, instead of downloading)")
    parser.add_argument("--tokenizer", metavar="NAME", help="char, gpt2, or any tiktoken encoding, e.g. "
                        "o200k_base (default: the known dataset's, else gpt2)")
    parser.add_argument("--data_dir", default="data", metavar="DIR",
                        help="folder that holds the datasets (default: data)")
    args = parser.parse_args(argv)

    try:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name) or args.name in (".", ".."):
            raise ValueError(f"dataset name {args.name!r} must be a plain folder name (letters, digits, _ . -)")
        known = KNOWN_DATASETS.get(args.name)
        if known is None and args.input is None:
            raise ValueError(f"unknown dataset {args.name!r} (known: {', '.join(KNOWN_DATASETS)}); to prepare your "
                             f"own text: python prepare_data.py {args.name} --input=path/to/text.txt")
        tokenizer = args.tokenizer or (known["tokenizer"] if known else "gpt2")
        out_dir = os.path.join(args.data_dir, args.name)
        sha256 = known["sha256"] if known else None
        if args.input is not None:
            text, source = read_text(args.input, sha256), args.input
        else:  # a known dataset: download it once, next to its .bin files
            path = os.path.join(out_dir, "input.txt")
            download(args.name, known["url"], path, sha256)
            text, source = read_text(path, sha256), known["url"]
        print(f"length of dataset in characters: {len(text):,}")
        meta = prepare(text, tokenizer, out_dir, args.name, source)
    except (OSError, ValueError) as e:  # FileNotFoundError and ConnectionError are OSErrors
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if meta["tokenizer"] == "char":
        print(f"all the unique characters: {meta['chars']!r}")
    print(f"tokenizer: {meta['tokenizer']}, vocab size: {meta['vocab_size']:,}, dtype: {meta['dtype']}")
    print(f"train has {meta['train_tokens']:,} tokens")
    print(f"val has {meta['val_tokens']:,} tokens")
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json")


if __name__ == "__main__":
    main()
