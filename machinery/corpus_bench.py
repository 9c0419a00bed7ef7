"""prepare_data.py --bench: the corpus pipeline's speed against tiktoken's own, and its peak memory.

bench() generates a corpus of .jsonl files (passages of a given text, or of made-up English-like
text), times tiktoken's encode_ordinary on one thread over the smallest size, then runs
machinery/corpus.py's prepare_files on each size in a fresh process (so that its peak memory is the
preparation's alone), and prints one markdown table. The figures it has given are in docs/speed.md.
numpy and tiktoken only.
"""

import glob
import json
import multiprocessing
import os
import tempfile
import time

import numpy as np

from machinery.corpus import make_tokenizer, prepare_files


def synthetic_text(n_chars, seed=0):
    """English-like text from 4,000 made-up words with Zipf-like frequencies, sentences and
    paragraphs."""
    rng = np.random.default_rng(seed)
    syllables = ("ba ce di fo gu ha je ki lo mu na pe qui ro su ta ve wi xo ya ze th st an er in "
                 "on").split()
    vocab = np.array(["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(4000)])
    weights = 1 / np.arange(1, len(vocab) + 1)
    words = vocab[rng.choice(len(vocab), n_chars // 5, p=weights / weights.sum())]
    ends = rng.choice(np.array(["", "", "", "", "", ",", ".", ".\n", "?", ".\n\n"]), len(words))
    return " ".join(np.char.add(words, ends).tolist())[:n_chars]


def write_bench_corpus(folder, n_bytes, base, seed=0, file_bytes=50_000_000):
    """.jsonl files of documents (random passages of `base`, of log-normal lengths) -> their paths,
    in order."""
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
    """Run in a fresh process, so that its VmHWM is the preparation's alone. cpu_seconds: this
    process and its workers (reaped when the pool ends)."""
    import resource

    stats = {}
    meta = prepare_files(spec, tokenizer, out_dir, "bench", workers=workers, stats=stats)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    queue.put({"tokens": meta["train_tokens"] + meta["val_tokens"],
               "cpu_seconds": sum(u.ru_utime + u.ru_stime for u in usage)} | stats)


def tiktoken_single_thread(paths, encoding):
    """Seconds (wall and CPU) and tokens of encoding.encode_ordinary on each document of the .jsonl
    files, on one thread: reading and parsing the files is not counted."""
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


def read_base_text(base_path):
    """The text the bench corpus's documents are passages of: --input's, else made-up text."""
    if not base_path:
        return synthetic_text(4_000_000)
    with open(base_path, encoding="utf-8") as f:
        return f.read()


def corpus_of_size(tmp, paths, size, file_mb):
    """A folder of hard links to the first files of the bench corpus, about `size` MB
    -> (folder, its MB)."""
    corpus = os.path.join(tmp, f"corpus_{size}MB")
    os.makedirs(corpus)
    for path in paths[:-(-size // file_mb)]:
        os.link(path, os.path.join(corpus, os.path.basename(path)))
    return corpus, sum(os.path.getsize(os.path.join(corpus, p)) for p in os.listdir(corpus)) / 1e6


def tiktoken_rows(corpus, mb, encoding):
    """The table's first two rows: tiktoken on one thread, and the floor: all cores at that
    rate."""
    files = sorted(glob.glob(os.path.join(corpus, "*")))
    seconds, cpu, tokens = tiktoken_single_thread(files, encoding)
    cores = os.cpu_count()
    return [("tiktoken encode_ordinary, 1 thread", mb, tokens, seconds, cpu, "-"),
            (f"floor: {cores} cores x that", mb, tokens, seconds / cores, cpu, "-")]


def prepare_row(corpus, mb, tokenizer, out_dir, workers, context):
    """The table's row of prepare_files on one corpus size, run in a fresh process."""
    queue = context.Queue()
    child = context.Process(target=bench_prepare_child,
                            args=(corpus, tokenizer, out_dir, workers, queue))
    child.start()
    result = queue.get()
    child.join()
    memory = f"{result['main_peak_mib']} / {result.get('worker_peak_mib', '-')}"
    return (f"prepare_data.py, {workers} workers", mb, result["tokens"], result["seconds"],
            result["cpu_seconds"], memory)


def print_table(tok, rows):
    print(f"\n| {tok.name}, {os.cpu_count()} CPUs | corpus MB | tokens | seconds | MB/s | "
          f"tokens/s | CPU seconds | MB per CPU second | peak memory MiB (main / each worker) |\n"
          f"|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for what, mb, tokens, seconds, cpu, memory in rows:
        print(f"| {what} | {mb:,.0f} | {tokens:,} | {seconds:.1f} | {mb / seconds:.1f} | "
              f"{tokens / seconds:,.0f} | {cpu:.1f} | {mb / cpu:.1f} | {memory} |")


def bench(sizes_mb, tokenizer, workers, base_path=None, folder=None):
    """Print a markdown table: tiktoken's single-thread rate on the smallest corpus, the floor
    (cores x that), and prepare_data's rate and peak memory on each corpus size."""
    tok = make_tokenizer(tokenizer)
    base = read_base_text(base_path)
    # files of at most 50 MB, at least 4 of them in the smallest corpus
    file_mb = max(1, min(50, min(sizes_mb) // 4))
    with tempfile.TemporaryDirectory(prefix="prepare_bench_", dir=folder) as tmp:
        start = time.perf_counter()
        paths = write_bench_corpus(tmp, max(sizes_mb) * 1_000_000, base,
                                   file_bytes=file_mb * 1_000_000)
        print(f"generated {len(paths)} .jsonl files, {sum(map(os.path.getsize, paths)) / 1e6:,.0f} "
              f"MB, in {time.perf_counter() - start:.0f} s (documents: passages of "
              f"{base_path or 'synthetic text'})")
        rows, context = [], multiprocessing.get_context("spawn")
        for size in sorted(sizes_mb):
            corpus, mb = corpus_of_size(tmp, paths, size, file_mb)
            if not rows:
                rows += tiktoken_rows(corpus, mb, tok.encoding)
            out_dir = os.path.join(tmp, "data", "bench")
            rows.append(prepare_row(corpus, mb, tokenizer, out_dir, workers, context))
    print_table(tok, rows)
