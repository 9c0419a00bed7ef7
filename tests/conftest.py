"""Shared fixtures: a small synthetic text, tiny prepared datasets (char-level and BPE) in tmp_path,
one_thread; and spoil_training_loss, a divergence injected at a known training step."""

import os
import random
import shutil
import signal
import sys
import tempfile

import pytest
import tiktoken
import torch

# The suite runs everything torch.compile would compile eagerly (LEV's kernels, train.py --compile):
# compiling takes seconds per new shape, and these tests use dozens. tests/test_compile.py switches
# compiling back on, with the same public API, to check that the compiled kernels equal the eager
# ones. Subprocesses do not inherit the stance: the tests that start train.py in one pass
# --lev_compile=False.
torch.compiler.set_stance("force_eager")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's scripts import as modules: prepare_data, train, leviathan

import leviathan  # noqa: E402
import prepare_data  # noqa: E402


def make_text(n_lines=400, seed=0):
    """Deterministic English-like lines from a small word list (about 25 characters per line)."""
    words = "the cat sat on a mat and dog ran far to see it was not my old red hat but his".split()
    rng = random.Random(seed)
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n_lines))
    return "".join(line.capitalize() + ".\n" for line in lines)


def lev_param_count(vocab_size, n_embd, lev_digits=3, lev_seed_dim=128, lev_heads=8, lev_knots=16,
                    lev_rank=64):
    """LEV's size by the paper's formula, k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r +
    r*n_embd): codebooks, then per head the seed map, its LayerNorm, the spline coefficients and the
    output map."""
    from leviathan import digit_base

    d, r = lev_seed_dim, lev_rank
    per_head = d * d + 2 * d + d * lev_knots * r + r * n_embd
    return lev_digits * digit_base(vocab_size, lev_digits) * d + lev_heads * per_head


# The tiny models of the model's tests (test_leviathan.py, test_fast_lev.py, test_fast_paths.py)

# not a perfect cube: base 4, so digits 4**3 = 64 > 61 ids leave some digit combinations unused
V = 61
BLOCK = 16


def tiny_config(arm, **overrides):
    settings = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, embedding=arm,
                    lev_seed_dim=16, lev_heads=2, lev_rank=8)
    return leviathan.Config(**{**settings, **overrides})


def tiny_model(arm, seed=0, **overrides):
    """A tiny GPT as leviathan.py builds it: its plain code, no fast path installed."""
    torch.manual_seed(seed)
    return leviathan.GPT(tiny_config(arm, **overrides))


def lev_config(vocab_size=V, n_embd=12, **lev):
    """A Config for LEV alone (the backbone settings do not matter to it)."""
    return leviathan.Config(vocab_size=vocab_size, n_embd=n_embd, n_head=1, **lev)


def tiny_lev(seed=0, dtype=torch.float64, d_seed=16, chunk=5, vocab_size=V, normalize=True,
             kernels="c", rank=4):
    """A small LEV in float64 (so that fast path and recipe agree to ~1e-15). kernels: its fast
    path's, "c" (lev_kernels.c; the test is skipped without a C compiler) or "torch" (torch's
    kernels, with a chunk smaller than most batches so that chunking is exercised by default); None:
    no fast path, the recipe as leviathan.py writes it."""
    from kernels.fast_lev import FastEmbedder

    torch.manual_seed(seed)
    lev = leviathan.LEV(lev_config(vocab_size, lev_digits=3, lev_seed_dim=d_seed, lev_heads=2,
                                   lev_knots=8, lev_rank=rank, lev_normalize_basis=normalize))
    if kernels == "c":
        skip_without_c_kernels()
    if kernels is not None:
        lev.fast_embed = FastEmbedder(chunk=chunk, c_kernels=kernels == "c")
    return lev.to(dtype)


def random_ids(*shape, seed=0, high=V):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def skip_without_c_kernels():
    from kernels.c_kernels import c_library

    if c_library() is None:
        pytest.skip("no C compiler for lev_kernels.c")


def make_tiny_encoding():
    """A byte-level tiktoken encoding (256 ids) built in-process: registered nowhere, needs no
    download."""
    return tiktoken.Encoding(name="tiny", pat_str=r"""'s|'t| ?\w+| ?[^\s\w]+|\s+""",
                             mergeable_ranks={bytes([i]): i for i in range(256)}, special_tokens={})


def fast_path_check_running(monkeypatch):
    """A list that is non-empty while the fast paths' check at install runs (install_fast_paths's
    check_fast_paths, kernels/fast_paths.py): it runs the model on its probes, and a test that
    counts the model's calls leaves those out."""
    from kernels import fast_paths

    check, running = fast_paths.check_fast_paths, []

    def marked_check(*args, **kwargs):
        running.append(1)
        try:
            return check(*args, **kwargs)
        finally:
            running.pop()

    monkeypatch.setattr(fast_paths, "check_fast_paths", marked_check)
    return running


def spoil_training_loss(monkeypatch, spoil, at_call=4):
    """Make GPT.forward return spoil(loss) instead of the loss at its at_call-th call in training
    mode (evaluation calls are not counted, nor those of the fast paths' check): a divergence
    injected at a known step, in this project's own model, not in torch."""
    forward = leviathan.GPT.forward
    training_calls, checking = [], fast_path_check_running(monkeypatch)

    def spoiled_forward(self, *args, **kwargs):
        logits, loss = forward(self, *args, **kwargs)
        if self.training and not checking:
            training_calls.append(1)
            if len(training_calls) == at_call:
                loss = spoil(loss)
        return logits, loss

    monkeypatch.setattr(leviathan.GPT, "forward", spoiled_forward)


@pytest.fixture
def run_cli(capsys):
    """run_cli(main, argv) calls a script's main(argv) in-process -> (exit code, stdout, stderr)."""
    def run(main, argv):
        try:
            code = main([str(a) for a in argv]) or 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def fails_after_a_minute():
    """A test that could hang where the code is wrong (a walk into 2**40 paths, a FIFO opened to
    read) fails instead."""
    def fail(*_):
        pytest.fail("still running after 60 s: a walk that does not end, or a read that waits")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def one_thread():
    """Torch on one thread, restored afterwards so that other test files are unaffected. Tiny models
    gain nothing from threads, and on a busy machine OpenMP's waiting threads make them 10-100x
    slower. A test file opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def exact_fp32():
    """Plain fp32 matmuls on CUDA (no TF32), so that fp32 comparisons mean fp32. train.py turns TF32
    on for speed; the flags are put back after each test, so that the files run after this one are
    unaffected. (Set by hand: monkeypatch cannot undo these properties of torch.backends.)"""
    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
    saved = [getattr(module, name) for module, name in flags]
    for module, name in flags:
        setattr(module, name, False)
    yield
    for (module, name), value in zip(flags, saved, strict=True):
        setattr(module, name, value)


@pytest.fixture
def compiling(monkeypatch):
    """torch.compile really on (the suite's stance is force_eager), with fresh compiled kernels for
    each test (LEV's cache of compiled kernels and of compile failures is emptied; dynamo's counters
    too, so that a test can check that it really compiled)."""
    from torch._dynamo.utils import counters

    from kernels import fast_lev

    monkeypatch.setattr(fast_lev, "_compiled_kernels", {})
    monkeypatch.setattr(fast_lev, "_compile_failures", {})
    torch.compiler.reset()
    counters.clear()
    with torch.compiler.set_stance("default"):
        yield
    torch.compiler.reset()


@pytest.fixture
def text():
    return make_text()


@pytest.fixture
def tiny_encoding():
    return make_tiny_encoding()


def prepare_text(text, tokenizer, out_dir, dataset, source):
    """Prepare a text (one document, split by characters as nanoGPT's) into out_dir as
    prepare_data.py --input=FILE does, from a file named source in a folder of its own -> meta.
    tokenizer: "char" or a tiktoken.Encoding (an in-process one, e.g. tiny_encoding)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, source)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        return prepare_data.prepare(path, tokenizer, out_dir, dataset, source)


@pytest.fixture
def char_data(tmp_path, text):
    """A prepared char-level dataset: returns the data folder (tmp_path/data); the dataset is
    "tiny_char"."""
    prepare_text(text, "char", str(tmp_path / "data" / "tiny_char"), "tiny_char", "synthetic")
    return tmp_path / "data"


@pytest.fixture
def bpe_data(tmp_path, text, tiny_encoding):
    """A prepared BPE dataset with the tiny encoding: returns the data folder; the dataset is
    "tiny_bpe"."""
    prepare_text(text, tiny_encoding, str(tmp_path / "data" / "tiny_bpe"), "tiny_bpe",
                   "synthetic")
    return tmp_path / "data"


def copy_project(folder, names):
    """The project's files and folders names (scripts, kernels/, lab/, config/) copied into
    folder, a new directory -> folder."""
    folder.mkdir()
    for name in names:
        source = os.path.join(ROOT, name)
        if os.path.isdir(source):
            shutil.copytree(source, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, folder / name)
    return folder


def adamw(model, learning_rate=3e-3, weight_decay=0.1):
    """train.py's optimizer for a model, with these settings."""
    return torch.optim.AdamW(model.param_groups(weight_decay), lr=learning_rate, betas=(0.9, 0.95),
                             fused=next(model.parameters()).device.type == "cuda")
