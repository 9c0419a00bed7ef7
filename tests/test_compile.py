"""LEV through torch.compile: its compiled torch kernels equal the eager ones (and so the plain
recipe), a failure to compile falls back to eager with one warning, and LEV's recipe compiled
(kernels/compiled_lev.py) equals LEV.reference and takes over where an edit sets the kernels aside.

The rest of the suite runs with torch.compile's stance "force_eager" (conftest.py); these tests
switch back to the default stance, through the same public API (no library internals are patched).
Compiling takes a few seconds per kernel and dtype, so this file takes ~30 s on 2 CPU cores.
Run:  python -m pytest -q tests/test_compile.py
"""

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import random_ids, tiny_lev, tiny_model  # noqa: E402
from test_fast_lev import assert_same_values_and_grads  # noqa: E402
from test_fast_lev import values_and_grads as weighted_values_and_grads  # noqa: E402

import leviathan  # noqa: E402
from kernels import fast_lev  # noqa: E402
from kernels.compiled_lev import CompiledRecipe  # noqa: E402
from kernels.fast_lev import FastEmbedder  # noqa: E402
from kernels.fast_paths import install_fast_paths  # noqa: E402
from leviathan import LEV, Config  # noqa: E402

# inductor's CPU backend compiles C++; without a compiler LEV warns and runs eagerly (tested below
# with a stand-in)
needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                    reason="no C++ compiler for torch.compile's CPU backend")


# conftest.py: torch.compile really on, fresh kernels
pytestmark = pytest.mark.usefixtures("compiling")


def make_lev(dtype, compile=True, normalize=True):
    torch.manual_seed(0)
    # d_seed=24: groups of 8 factors; chunk=16 with 37 distinct ids: full chunks and a
    # remainder of 5
    lev = LEV(Config(vocab_size=300, n_embd=12, n_head=1, lev_digits=3, lev_seed_dim=24,
                     lev_heads=2, lev_knots=8, lev_rank=4, lev_normalize_basis=normalize))
    # torch's kernels
    lev.fast_embed = FastEmbedder(chunk=16, c_kernels=False, compile_kernels=compile)
    with torch.no_grad():
        # away from the init, so that every knot matters
        lev.spline.add_(0.3 * torch.randn_like(lev.spline))
        # many coordinates near the ends of [0, 1], where normalising the basis matters
        lev.ln_weight.mul_(4.0)
    return lev.to(dtype)


def values_and_grads(lev, embed, idx):
    lev.zero_grad(set_to_none=True)
    E = embed(idx)
    weight = torch.randn(E.shape, dtype=E.dtype, generator=torch.Generator().manual_seed(1))
    (E * weight).sum().backward()
    return [E.detach()] + [p.grad.clone() for p in lev.parameters()]


def lev_warnings(caught):
    return [w for w in caught if str(w.message).startswith("LEV:")]


IDS = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(2))


@needs_compiler
@pytest.mark.parametrize("dtype, normalize", [
    (torch.float64, True),
    (torch.float32, True),
    (torch.float64, False),
])
def test_compiled_kernels_equal_eager_and_reference(dtype, normalize):
    """Values and the gradient of every parameter. float64 shows the algebra is the same; float32 is
    what training runs, where the compiled kernels add up in another order: compared tensor by
    tensor, relative to each tensor's norm (single elements that are sums of cancelling terms lose
    more digits)."""
    # full chunks and a remainder: two shapes
    assert IDS.unique().numel() > 16 and IDS.unique().numel() % 16
    lev, eager = (make_lev(dtype, normalize=normalize),
                  make_lev(dtype, compile=False, normalize=normalize))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = values_and_grads(lev, lev, IDS)
    assert not lev_warnings(caught) and not fast_lev._compile_failures  # no fallback to eager
    assert set(fast_lev._compiled_kernels) == {fast_lev.log_mode_chunk,
                                               fast_lev.log_mode_chunk_backward}
    # dynamo really compiled them (it runs a function eagerly when it cannot trace it): each kernel
    # for a full chunk and for the remainder
    assert counters["stats"]["unique_graphs"] >= 4
    for want in (values_and_grads(eager, eager, IDS),
                 values_and_grads(eager, eager.reference, IDS)):
        for got, expected in zip(compiled, want, strict=True):
            if dtype == torch.float64:
                torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
            else:
                assert (got - expected).norm() <= 1e-5 * expected.norm()


def with_compiled_kernels(run):
    """Stand in `run` for both compiled kernels (the compiled-kernel cache is LEV's own, emptied
    per test)."""
    for kernel in (fast_lev.log_mode_chunk, fast_lev.log_mode_chunk_backward):
        fast_lev._compiled_kernels[kernel] = run


def test_a_failed_compile_warns_once_and_runs_eagerly():
    def compile_fails(*args):
        raise RuntimeError("no C++ compiler found\nmore details")

    with_compiled_kernels(compile_fails)
    lev, eager = make_lev(torch.float64), make_lev(torch.float64, compile=False)
    message = (r"torch.compile of its kernels failed on cpu \(RuntimeError: no C\+\+ "
               r"compiler found\); they run eagerly")
    with pytest.warns(UserWarning, match=message) as caught:
        got = values_and_grads(lev, lev, IDS)
        values_and_grads(lev, lev, IDS)
    assert len(lev_warnings(caught)) == 1 and set(fast_lev._compile_failures) == {"cpu"}
    for a, b in zip(got, values_and_grads(eager, eager, IDS), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_genuine_error_is_raised_not_blamed_on_compile(monkeypatch):
    def broken_kernel(*args):
        raise ValueError("a bug in the kernel")

    monkeypatch.setattr(fast_lev, "log_mode_chunk", broken_kernel)
    lev = make_lev(torch.float64)
    with (warnings.catch_warnings(record=True) as caught,
          pytest.raises(ValueError, match="a bug in the kernel")):
        warnings.simplefilter("always")
        lev(IDS)
    assert not lev_warnings(caught) and not fast_lev._compile_failures


def test_out_of_memory_is_raised_not_blamed_on_compile():
    def run_out_of_memory(*args):
        raise torch.OutOfMemoryError("out of memory")

    with_compiled_kernels(run_out_of_memory)
    lev = make_lev(torch.float64)
    with pytest.raises(torch.OutOfMemoryError):
        values_and_grads(lev, lev, IDS)
    assert not fast_lev._compile_failures


@needs_compiler
@pytest.mark.parametrize("arm", ["tied", "lev"])
def test_compiled_decoding_gives_the_eager_tokens(arm):
    """sample.py --compile: greedy tokens through the compiled model equal the eager ones, across
    several window jumps, and it compiles a bounded number of times (not once per position)."""
    torch.manual_seed(0)
    model = leviathan.GPT(Config(vocab_size=300, block_size=16, n_layer=2, n_head=2, n_embd=16,
                                 embedding=arm, lev_seed_dim=8, lev_heads=2, lev_knots=6,
                                 lev_rank=4)).eval()
    prompt = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(1))
    eager = model.generate(prompt, 40, temperature=0.0)  # the model's plain code
    model.next_logits = torch.compile(model.next_logits)  # as sample.py --compile
    compiled = model.generate(prompt, 40, temperature=0.0)
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo really compiled the step
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(compiled, eager)
    # a second call: no new compilation
    assert torch.equal(model.generate(prompt, 40, temperature=0.0), eager)
    # tied: no new compilation, 11 graphs here; lev (LEV stays eager behind a graph break) compiles
    # again on the second call, 16 graphs here: bounded either way, not one per position
    assert counters["stats"]["unique_graphs"] <= 24
    if arm == "tied":
        assert counters["stats"]["unique_graphs"] == graphs


# --------------------------------------------------------------------------------------------------
# LEV's recipe compiled


@needs_compiler
def test_compiled_recipe_equals_reference_with_one_graph():
    lev = tiny_lev(kernels=None)
    with torch.no_grad():  # coordinates at both ends of [0, 1], and negative factors
        lev.ln_weight.mul_(8)
        lev.spline[:, 0].neg_()
    lev.fast_embed = CompiledRecipe()
    lev.recipe_chunk = 16  # this LEV's chunks: 35 ids = 3 chunks, the last padded; 7 ids, padded
    for seed, size in [(1, 20), (3, 7)]:
        idx = random_ids(size, 4, seed=seed)
        weight = torch.randn(size, 4, lev.n_embd, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(seed))
        assert_same_values_and_grads(weighted_values_and_grads(lev, lev, idx, weight),
                                     weighted_values_and_grads(lev, lev.reference, idx, weight),
                                     rtol=1e-10, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 1  # through LEV.forward, kept out of compiling
    with torch.no_grad():  # evaluation: a second graph, without gradients
        torch.testing.assert_close(lev(idx), lev.reference(idx), rtol=1e-10, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 2


@needs_compiler
def test_an_edited_recipe_runs_compiled_after_the_fast_path_steps_aside():
    """The hand-written kernels no longer match an edited recipe: they step aside, with one line,
    and the compiled recipe, which follows the edit, takes over (train.py's order)."""
    class Edited(LEV):
        def recipe(self, ids):
            return 1.5 * super().recipe(ids)  # an edit the kernels do not know

    model = tiny_model("lev")
    model.tok_emb.__class__ = Edited
    lines = []
    fast = FastEmbedder(c_kernels=False, compile_kernels=False)  # (C kernels: the same lines)
    install_fast_paths(model, lev=[fast, CompiledRecipe()], say=lines.append)
    assert isinstance(model.tok_emb.fast_embed, CompiledRecipe)
    assert counters["stats"]["unique_graphs"] == 1  # the edited recipe, compiled by its check
    assert len(lines) == 1 and "LEV's fast path (kernels/fast_lev.py) differs" in lines[0]
    assert ("LEV's recipe compiled (kernels/compiled_lev.py) runs in its place, checked equal to "
            "it" in lines[0])
