"""Reading a prepared dataset: its tokenizer, meta.json, the train and val splits.

prepare_data.py writes the format (lab/corpus.py too; docs/data.md describes it);
the lab's tools read it with get_tokenizer, load_meta and load_split (train.py and sample.py
read it themselves). numpy and tiktoken only: no torch.
"""

import os

import numpy as np

from lab.cli import parse_json
from prepare_data import DATASETS, bpe_encoding

UINT16_VOCAB = 65536  # ids 0..65535 fit in uint16


# --------------------------------------------------------------------------------------------------
# Tokenizers: the same small interface for characters and for tiktoken BPE


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of characters of the prepared
    text."""

    name = "char"

    def __init__(self, chars):
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}

    def encode(self, text):
        missing = sorted(set(text) - self.stoi.keys())
        if missing:
            raise ValueError(f"characters not in this dataset's {self.vocab_size}-character "
                             f"vocabulary: {''.join(missing)!r}")
        return [self.stoi[c] for c in text]

    def encode_array(self, text):
        return np.array(self.encode(text), dtype=np.uint32)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class TiktokenTokenizer:
    """A tiktoken BPE encoding. Special tokens such as <|endoftext|> are encoded as ordinary
    text."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.name = encoding.name
        self.vocab_size = encoding.n_vocab

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text):
        """encode(text) as a numpy array. tiktoken >= 0.8's encode_to_numpy skips building a list of
        Python ints (docs/LOG.md, 2026-11-30); with nothing allowed or disallowed as special, it
        encodes special tokens as text too. Surrogates (a JSON "\\ud800" decodes to one) are not
        UTF-8, and encode_to_numpy refuses them: they are replaced here as encode_ordinary replaces
        them (a pair by its character, a lone one by U+FFFD), so the tokens are encode's."""
        if not hasattr(self.encoding, "encode_to_numpy"):
            return np.array(self.encode(text), dtype=np.uint32)
        try:
            return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids):
        return self.encoding.decode(list(ids))


def load_encoding(name):
    """tiktoken.get_encoding(name), with errors that say what to do. tiktoken downloads an
    encoding's files once and caches them (in TIKTOKEN_CACHE_DIR, if set); offline, only cached
    encodings load."""
    import tiktoken

    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"unknown tokenizer {name!r}; use char or a tiktoken encoding: "
                         f"{', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # requests' ConnectionError offline, a corrupt cache file, ...
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "tiktoken's default cache")
        raise ValueError(f"tiktoken encoding {name!r} could not be loaded ({type(e).__name__}); "
                         f"its files are neither in {cache} nor downloadable. Connect once, or set "
                         f"TIKTOKEN_CACHE_DIR to a folder that holds them") from None


def get_tokenizer(meta, encoding=None):
    """The tokenizer a dataset was prepared with, from its meta.json dict. `encoding`: a
    tiktoken.Encoding to use instead of looking meta["tokenizer"] up by name (for encodings built
    in-process, e.g. in tests)."""
    if meta["tokenizer"] == "char":
        tok = CharTokenizer(meta["chars"])
    else:
        if encoding is None:  # a converted model's own BPE, or tiktoken's by name
            encoding = bpe_encoding(meta) if "bpe" in meta else load_encoding(meta["tokenizer"])
        tok = TiktokenTokenizer(encoding)
    if tok.vocab_size != meta["vocab_size"]:
        raise ValueError(f"dataset {meta.get('dataset')!r} has vocab_size {meta['vocab_size']} but "
                         f"tokenizer {tok.name!r} has {tok.vocab_size}; prepare the dataset again")
    return tok


def stream_text(tokenizer, ids):
    """Decode a stream of token ids into text pieces whose concatenation is exactly
    tokenizer.decode(all ids) (the harness adapter's generation prints them as they come).

    A BPE token can end inside a multi-byte UTF-8 character, which decodes as U+FFFD until its
    remaining bytes arrive; so a trailing U+FFFD is held back until a later token completes (or, at
    the end, confirms) it. The ids not yet fully shown are decoded together; once they decode to
    complete characters they are dropped, as decoding from a character boundary does not depend on
    what came before."""
    # the ids since the last character boundary, and how much of their text is shown
    pending, shown = [], 0
    for i in ids:
        pending.append(i)
        text = tokenizer.decode(pending)
        ready = len(text.rstrip("\ufffd"))
        if ready > shown:
            yield text[shown:ready]
            shown = ready
        if ready == len(text):
            pending, shown = [], 0
    text = tokenizer.decode(pending)
    if len(text) > shown:
        yield text[shown:]  # replacement characters at the end are part of the decoded text too


# --------------------------------------------------------------------------------------------------
# Reading a prepared dataset


def prepare_command(name):
    """The command that prepares dataset `name`, for error messages."""
    if name in DATASETS:  # prepare_data.py's named datasets
        return f"python prepare_data.py {name}"
    return f"python prepare_data.py {name} --input=path/to/text.txt"


def load_meta(data_dir):
    """Read data_dir/meta.json (data_dir is one dataset's folder, e.g. data/shakespeare) -> dict."""
    path = os.path.join(data_dir, "meta.json")
    name = os.path.basename(os.path.normpath(data_dir))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no prepared dataset in {data_dir} (no meta.json); prepare it "
                                f"first: {prepare_command(name)}")
    with open(path, "rb") as f:
        meta = parse_json(f.read(), path, f"prepare the dataset again: {prepare_command(name)}")
    required = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens")
    missing = [key for key in required if key not in meta] if isinstance(meta, dict) else required
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; prepare the dataset again: "
                         f"{prepare_command(name)}")
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
                                            and len(set(meta["chars"])) == meta["vocab_size"]
                                            and len(meta["chars"]) == meta["vocab_size"]):
        return "a char dataset needs 'chars', a string of vocab_size distinct characters"
    if meta["tokenizer"] == "char" and any("\ud800" <= c <= "\udfff" for c in meta["chars"]):
        return "'chars' holds a surrogate (an escape \\ud800 to \\udfff), which is no character"
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
        command = prepare_command(os.path.basename(os.path.normpath(data_dir)))
        raise ValueError(f"{path} is {found}, meta.json expects {n_tokens:,} {meta['dtype']} "
                         f"tokens; prepare the dataset again: {command}")
    if n_tokens == 0:
        return np.zeros(0, dtype=meta["dtype"])  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=meta["dtype"], mode="r")


# The frequency buckets of eval.py's table and of a retrofit's fit (lab/retrofit.py); an id is
# in bucket i when its training count is in [BUCKET_LOWER[i], BUCKET_LOWER[i + 1])
BUCKETS = ("unseen", "1-10", "11-100", "101-1k", "1k-10k", ">10k")
BUCKET_LOWER = (0, 1, 11, 101, 1001, 10001)


def train_counts(train_tokens, vocab_size, chunk=1 << 24):
    """How often each id occurs in the training split: (vocab_size,) int64, counted a chunk at a
    time so that a split of billions of tokens never has to fit in memory."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(0, len(train_tokens), chunk):
        chunk_counts = np.bincount(np.asarray(train_tokens[i:i + chunk]), minlength=vocab_size)
        counts += chunk_counts[:vocab_size]
    return counts
