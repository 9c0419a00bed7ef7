"""Reading lab/prepare_corpus.py's input as a stream of work items: text, .jsonl, Parquet, and .gz.

list_inputs turns --input (a file, a directory or a glob) into files; Corpus reads them one by one,
streamed (READ_BYTES at a time), hashing each file for meta.json, and yields WorkItems, the units
that lab/corpus.py tokenizes on its workers. Every bad input is a one-line error naming the
file and the line. The standard library only (and pyarrow, for Parquet, when installed).
"""

import codecs
import collections
import contextlib
import glob
import gzip
import hashlib
import itertools
import os
import stat
import zlib

# What a directory is searched for.
CORPUS_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
# The streaming buffer: bytes read at a time, and about the text of one worker task.
READ_BYTES = 1 << 20


# One unit of tokenizing work. kind: "text" (payload: a str, a piece of one document), "jsonl"
# (payload: bytes, whole lines, the first being `line`) or "rows" (payload: a list of Parquet
# values, the first being row `line`). A "text" piece ends its document when ends_document; a .jsonl
# line or a row is a whole document. split: "train" or "val" for the pieces of one text file (split
# by characters), None where the document's index decides (lab/corpus.py's is_val_document).
WorkItem = collections.namedtuple("WorkItem", "kind payload path line ends_document split")


# --------------------------------------------------------------------------------------------------
# The files of --input


def file_kind(path):
    """"jsonl", "parquet" or "text" (anything else: read as plain UTF-8 text), from the name; .gz is
    decompressed."""
    name = path.lower().removesuffix(".gz")
    if name.endswith(".parquet"):
        if path.lower().endswith(".gz"):
            raise ValueError(f"{path}: gzipped Parquet is not supported; gunzip it "
                             f"(Parquet compresses itself)")
        return "parquet"
    return "jsonl" if name.endswith(".jsonl") else "text"


def list_inputs(spec):
    """The files of --input, in sorted order, each real file once -> (paths, skipped): a file, a
    directory (recursively: CORPUS_SUFFIXES, hidden names skipped) or a glob (every file it matches,
    "**" included). Links are followed, but each directory is entered once (walk_dirs) and each
    file, by device and inode, listed once: under the first of its paths in sorted order, those that
    are not links first. skipped: the other paths, which reach a directory or a file already listed
    (a loop, a second link)."""
    if os.path.isdir(spec):
        paths, skipped = walk_directory(spec)
        what = f"directory {spec} holds no {', '.join(CORPUS_SUFFIXES)} files"
    elif glob.has_magic(spec):
        paths, skipped = glob_files(spec)
        what = f"--input={spec} matches no files"
    elif os.path.lexists(spec):
        paths, skipped, what = [spec], [], ""
    else:
        raise FileNotFoundError(f"--input={spec}: no such file or directory")
    if not paths:
        raise FileNotFoundError(what)
    # fail before any work, not after hours: every file must be a readable regular file
    files = {}
    for path in sorted(paths, key=lambda p: (os.path.islink(p), p)):
        key = check_input_file(path)
        if key in files:
            skipped.append(path)
        else:
            files[key] = path
    return sorted(files.values()), sorted(set(skipped))


def file_key(path):
    """What a path leads to, links followed: (device, inode)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def walk_dirs(top):
    """The directories of a tree, hidden ones skipped, each entered once (by device and inode), even
    through links -> ([(directory, names of its other entries), ...], skipped: the paths that lead
    to a directory already entered). The tree is walked without links first, then each link to a
    directory not yet entered, in sorted order, and so on: a directory is reached by its own path
    where it has one. (os.walk would follow a link to "." 40 levels deep, and two such links 2**40
    paths deep.)"""
    def fail(e):
        raise OSError(f"cannot read directory {e.filename}: {e.strerror}")

    entered, dirs, skipped, roots = set(), [], [], [top]
    while roots:
        links = []
        for root in roots:
            for folder, subdirs, files in os.walk(root, onerror=fail):  # links not followed
                key = file_key(folder)
                if key in entered:  # a link's target, entered before
                    skipped.append(folder)
                    subdirs[:] = []
                    continue
                entered.add(key)
                dirs.append((folder, files))
                visible = [d for d in subdirs if not d.startswith(".")]
                links += [os.path.join(folder, d) for d in visible
                          if os.path.islink(os.path.join(folder, d))]
                subdirs[:] = [d for d in visible if not os.path.islink(os.path.join(folder, d))]
        roots = sorted(links)
    return dirs, skipped


def walk_directory(folder):
    """The corpus files of a directory tree (CORPUS_SUFFIXES, hidden names skipped) -> (paths,
    skipped), as walk_dirs walks it."""
    dirs, skipped = walk_dirs(folder)
    paths = [os.path.join(d, name) for d, files in dirs for name in files
             if not name.startswith(".") and name.lower().endswith(CORPUS_SUFFIXES)]
    return paths, skipped


def glob_files(pattern):
    """The files a glob matches (glob.glob(pattern, recursive=True), directories left out) ->
    (paths, skipped). A "**" is walked by walk_dirs (each directory once), not by glob, which
    follows links into loops as os.walk does."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return [p for p in glob.glob(pattern) if not os.path.isdir(p)], []
    i = parts.index("**")
    base = os.sep.join(parts[:i]) or (os.sep if pattern.startswith(os.sep) else "")
    rest = os.sep.join(parts[i + 1:]) if i + 1 < len(parts) else "*"  # "a/**": all below a
    tops = glob.glob(base) if glob.has_magic(base) else [base or os.curdir]
    paths, skipped = [], []
    for top in filter(os.path.isdir, tops):
        dirs, skipped_here = walk_dirs(top)
        dirs = [d for d, _ in dirs]
        if not base:  # named as glob names them: "a/x.txt", not "./a/x.txt"
            dirs = ["" if d == os.curdir else d.removeprefix(os.curdir + os.sep) for d in dirs]
            skipped_here = [d.removeprefix(os.curdir + os.sep) for d in skipped_here]
        skipped += skipped_here
        for d in dirs:
            found, skipped_here = glob_files(os.path.join(glob.escape(d), rest))
            paths += found
            skipped += skipped_here
    return paths, skipped


# What each kind of file that is not a regular file is called, in errors.
SPECIAL_FILES = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                 (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                 (stat.S_ISBLK, "block device"))


def check_input_file(path):
    """Refuse, in one line, what cannot be read as a corpus file: a broken link, an unreadable file,
    and special files (FIFOs, sockets, devices), which could be read forever or block -> the file's
    (device, inode)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if os.path.islink(path):  # its target is missing, or a loop of links
            raise OSError(f"cannot read {path}: a link to {os.readlink(path)} ({e.strerror}); "
                          f"remove the link or restore its target") from None
        raise OSError(f"cannot read {path}: {e.strerror}; fix its permissions or remove it from "
                      f"the input") from None
    special_file_error(path, st.st_mode)
    if not os.access(path, os.R_OK):
        raise OSError(f"cannot read {path}: not readable; fix its permissions or remove it from "
                      f"the input")
    file_kind(path)
    return st.st_dev, st.st_ino


def special_file_error(path, mode):
    """Raise the one-line error for a path that is not a regular file (mode: its st_mode)."""
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in SPECIAL_FILES if test(mode)), "special file")
    raise OSError(f"cannot read {path}: a {kind}, not a regular file; remove it from the input "
                  f"(or save its content to a file and give that)")


def skipped_note(skipped, shown=3):
    """One line on the paths list_inputs skipped, naming a few, or None."""
    if not skipped:
        return None
    names = ", ".join(skipped[:shown])
    if len(skipped) > shown:
        names += f" and {len(skipped) - shown:,} more"
    if len(skipped) == 1:
        return (f"skipped 1 path that reaches a directory or a file already read (a link or a "
                f"loop), so that each file is read once: {names}")
    return (f"skipped {len(skipped):,} paths that reach directories or files already read (links "
            f"or loops), so that each file is read once: {names}")


# --------------------------------------------------------------------------------------------------
# Bytes and text, streamed


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
        """Read what is left (gzip may stop before the end), close -> the whole file's sha256."""
        while self.read(READ_BYTES):
            pass
        self.f.close()
        return self.sha256.hexdigest()


def open_input(path, on_read=None):
    """-> (HashingFile of the file, stream of its content: decompressed for .gz)."""
    try:
        # non-blocking: opening a FIFO to read would otherwise wait for a writer, maybe forever
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise OSError(f"cannot read {path}: {e.strerror}; fix its permissions or remove it from "
                      f"the input") from None
    try:
        special_file_error(path, os.fstat(fd).st_mode)  # it may have changed since list_inputs
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    hashing = HashingFile(os.fdopen(fd, "rb"), on_read)
    if path.lower().endswith(".gz"):
        return hashing, gzip.GzipFile(fileobj=hashing, mode="rb")
    return hashing, hashing


def file_sha256(path):
    hashing, _ = open_input(path)
    return hashing.finish()


def raw_blocks(path, stream):
    """The bytes of a stream, READ_BYTES at a time; corrupt gzip data is an error naming the
    file."""
    done = 0
    try:
        while block := stream.read(READ_BYTES):
            yield block
            done += len(block)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: corrupt or truncated gzip data after {done:,} bytes ({e}); get "
                         f"the file again or remove it from the input") from None


def decoded_blocks(blocks, path):
    """UTF-8 text from a stream of byte blocks; bytes that are not UTF-8 are an error naming the
    file and line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    for block in itertools.chain(blocks, [None]):
        data = b"" if block is None else block
        try:
            text = decoder.decode(data, final=block is None)
        except UnicodeDecodeError as e:
            # e.object: the bytes of a character begun in the last block, then data
            at = offset - (len(e.object) - len(data)) + e.start
            line += e.object[:e.start].count(b"\n")
            bad = e.object[e.start:e.start + 4]
            raise ValueError(f"{path}, line {line:,}: not UTF-8 text (byte {at:,}: {bad!r}); "
                             f"convert the file to UTF-8") from None
        yield text
        line, offset = line + data.count(b"\n"), offset + len(data)


# --------------------------------------------------------------------------------------------------
# One document in pieces: cut where tokenizing each piece gives the tokens of the whole


def safe_cut(text):
    """The last point where `text` can be cut so that tokenizing both sides gives the tokens of the
    whole, or 0: after a newline, or before a space, that follows a non-space character and precedes
    a letter or digit. The pre-tokenizing patterns of tiktoken's encodings (gpt2, r50k, p50k,
    cl100k, o200k) start a new piece at such a point, and match the pieces on either side without
    looking across it (tests/test_prepare_corpus.py checks it)."""
    for sep, cut_after in (("\n", 1), (" ", 0)):
        i = text.rfind(sep, 1, len(text) - 1)
        while i > 0:
            if not text[i - 1].isspace() and text[i + 1].isalnum():
                return i + cut_after
            i = text.rfind(sep, 1, i)
    return 0


def text_pieces(blocks, piece_chars=None):
    """One document from a stream of str blocks, cut at safe_cut points into pieces of about
    piece_chars characters or more -> (piece, is_last). Memory stays bounded: a text with no safe
    point in 16 x piece_chars characters (no whitespace at all) is cut there anyway, which may
    tokenize that one point differently."""
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


def single_text_items(blocks, split_at, path):
    """The work items of one text: its first split_at characters to train, the rest to val
    (nanoGPT's split), each part cut into pieces on its own."""
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


def scan_text(path, want_chars=False):
    """One pass over a text file before tokenizing it: -> (its characters count, set of characters
    (when want_chars, for char-level), input record for meta.json)."""
    hashing, stream = open_input(path)
    n_chars, chars = 0, set()
    with contextlib.closing(hashing.f):
        for block in decoded_blocks(raw_blocks(path, stream), path):
            n_chars += len(block)
            if want_chars:
                chars.update(block)
        found = hashing.finish()
    return n_chars, chars, {"name": path, "bytes": os.path.getsize(path), "sha256": found}


# --------------------------------------------------------------------------------------------------
# A corpus: many documents, in files of three kinds


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
    """Batches of the text column of a Parquet file (needs pyarrow); on_rows(fraction of the file
    read)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, ...) share no base class with OSError
        first_line = str(e).splitlines()[0]
        raise ValueError(f"{path}: not a readable Parquet file ({first_line})") from None
    if text_field not in parquet.schema_arrow.names:
        columns = ", ".join(parquet.schema_arrow.names)
        raise ValueError(f"{path}: no column {text_field!r} (its columns: {columns}); choose one "
                         f"with --text_field=NAME")
    row, n_rows = 1, max(parquet.metadata.num_rows, 1)
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_field]):
        values = batch.column(0).to_pylist()
        yield WorkItem("rows", values, path, row, True, None)
        row += len(values)
        on_rows((row - 1) / n_rows)


class Corpus:
    """The files of a corpus as a stream of work items, counting the bytes read (for progress) and
    recording each file's name, size and sha256 (for meta.json) once it has been read."""

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
                        blocks = decoded_blocks(raw_blocks(path, stream), path)
                        for piece, is_last in text_pieces(blocks):
                            yield WorkItem("text", piece, path, 0, is_last, None)
                    sha256 = hashing.finish()
            self.bytes_read = before + size
            self.inputs.append({"name": path, "bytes": size, "sha256": sha256})
