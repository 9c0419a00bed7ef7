"""Tests of LEV's fast path (kernels/fast_lev.py) and of its C kernels (kernels/c_kernels.py):
the same function as LEV's recipe (leviathan.LEV.reference), values and gradients of every parameter
in float64, through the C kernels and through torch's; the pieces of the fast path one by one; the C
library's build.

Everything is hermetic and runs on CPU: tiny LEVs (V=61) in float64 unless a test says otherwise.
The kernels' torch.compile is tested in test_compile.py (here the suite's stance runs it eagerly).
Run:  python -m pytest -q tests/test_fast_lev.py
"""

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plain `pytest` finds leviathan.py
from conftest import (  # noqa: E402
    BLOCK,
    V,
    random_ids,
    skip_without_c_kernels,
    tiny_lev,
    tiny_model,
)

from kernels import c_kernels  # noqa: E402
from kernels.fast_lev import (  # noqa: E402
    FastEmbedder,
    SplineProduct,
    bspline_weights3,
    pad_knots,
    spline_3knots,
    spline_3knots_indexing,
)
from kernels.fast_paths import install_fast_paths  # noqa: E402
from leviathan import bspline_basis, signed_log_product  # noqa: E402

KERNELS = pytest.mark.parametrize("kernels", ["c", "torch"])


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def values_and_grads(lev, embed, idx, weight):
    """E = embed(idx) and the gradient of every LEV parameter of the non-trivial loss
    (E * weight).sum()."""
    lev.zero_grad(set_to_none=True)
    E = embed(idx)
    (E * weight).sum().backward()
    return E.detach().clone(), {name: p.grad.clone() for name, p in lev.named_parameters()}


def assert_same_values_and_grads(got, want, **tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **tol,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


# --------------------------------------------------------------------------------------------------
# LEV's fast path against the recipe, in float64, values and gradients of every parameter


# partial products of gcd(d_seed, 8) = 8, 2, 1 factors
@pytest.mark.parametrize("d_seed", [16, 6, 5])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("normalize", [True, False])
@KERNELS
def test_lev_fast_path_equals_reference(d_seed, chunk, normalize, kernels):
    lev = tiny_lev(d_seed=d_seed, chunk=chunk, normalize=normalize, kernels=kernels)
    assert lev.fast_embed is not None
    # many repeated ids
    idx = torch.cat([random_ids(3, 20, seed=1), torch.tensor([[0, V - 1] * 10])])
    assert idx.unique().numel() < idx.numel()
    weight = torch.randn(*idx.shape, lev.n_embd, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2))
    fast = values_and_grads(lev, lev, idx, weight)
    reference = values_and_grads(lev, lev.reference, idx, weight)
    assert fast[0].shape == (4, 20, 12)
    assert_same_values_and_grads(fast, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalize", [True, False])
def test_lev_c_kernels_at_the_papers_rank_equal_reference(normalize):
    """r = 64, the paper's rank, which the C kernels run as a compile-time constant (other ranks as
    they come)."""
    lev = tiny_lev(d_seed=16, normalize=normalize, kernels="c", rank=64)
    idx = random_ids(2, 9, seed=1)
    weight = torch.randn(*idx.shape, lev.n_embd, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2))
    assert lev.fast_embed.kernels(torch.rand(1, 2, 16, dtype=torch.float64), lev.spline) == "c"
    assert_same_values_and_grads(values_and_grads(lev, lev, idx, weight),
                                 values_and_grads(lev, lev.reference, idx, weight),
                                 rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, big", [(torch.float32, 1e6), (torch.float64, 1e40)])
@KERNELS
def test_lev_with_extreme_spline_scales_equals_reference(dtype, big, kernels):
    """Seed dimensions alternately scaled by big and 1/big: every grouped partial product of 8
    factors over- or underflows, though the whole product stays near 1, so the fast path must take
    the per-factor fallback."""
    lev = tiny_lev(dtype=dtype, d_seed=16, kernels=kernels)
    scale = torch.tensor([big, 1 / big] * 8, dtype=torch.float64).view(1, 16, 1, 1)
    with torch.no_grad():
        lev.spline.mul_(scale.to(dtype))
    idx = random_ids(2, 15, seed=1)
    weight = torch.randn(2, 15, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fast = values_and_grads(lev, lev, idx, weight.to(dtype))
    exact = tiny_lev(dtype=torch.float64, d_seed=16, kernels=None)
    exact.load_state_dict(lev.state_dict())
    reference = values_and_grads(exact, exact.reference, idx, weight)

    def unscaled(result):  # gradients with respect to the spline before scaling, all of order 1
        values, grads = result
        grads = {n: g.double() for n, g in grads.items()}
        return values.double(), {**grads, "spline": grads["spline"] * scale}

    tol = dict(rtol=1e-3, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    assert torch.isfinite(reference[0]).all() and reference[0].abs().max() > 1e-3
    assert_same_values_and_grads(unscaled(fast), unscaled(reference), **tol)


@pytest.mark.parametrize("normalize", [True, False])
@KERNELS
def test_whole_model_with_coordinates_at_the_ends_equals_reference(normalize, kernels):
    """End to end: LayerNorm gains x8 push many coordinates t to the ends of [0, 1], where the two
    bases differ; the model's loss and every gradient with LEV's fast path (installed) equal those
    of the model's plain code (no fast path) and those with LEV.reference on the whole batch
    (float64)."""
    if kernels == "c":
        skip_without_c_kernels()
    model = install_fast_paths(tiny_model("lev", lev_normalize_basis=normalize).double(),
                               lev=FastEmbedder(c_kernels=kernels == "c"))
    lev = model.tok_emb
    assert lev.fast_embed is not None and lev.fast_embed.c_kernels == (kernels == "c")
    with torch.no_grad():
        lev.ln_weight.mul_(8.0)
    t = lev.unit_coords(lev.seed(torch.arange(V)))
    assert ((t < 1 / 30) | (t > 29 / 30)).double().mean() > 0.3  # 43% here
    idx, targets = random_ids(2, BLOCK, seed=1), random_ids(2, BLOCK, seed=2)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fast = loss_and_grads()
    install_fast_paths(model, lev=None)
    assert lev.fast_embed is None
    plain = loss_and_grads()
    lev.forward = lambda ids: lev.reference(ids)  # this instance only
    reference = loss_and_grads()
    assert_same_values_and_grads(fast, reference, rtol=1e-9, atol=1e-11)
    assert_same_values_and_grads(plain, reference, rtol=1e-9, atol=1e-11)


# None: the recipe, RECIPE_CHUNK ids at a time
@pytest.mark.parametrize("kernels", ["c", "torch", None])
def test_lev_table_equals_reference(kernels):
    lev = tiny_lev(chunk=7, kernels=kernels)
    ids = torch.arange(V)
    torch.testing.assert_close(lev.table(), lev.reference(ids).detach(), rtol=1e-10, atol=1e-12)
    assert not lev.table().requires_grad


@KERNELS
def test_fast_path_follows_a_change_of_S_between_calls(kernels):
    """FastEmbedder keeps the padded S from call to call: an in-place change of S (an optimizer
    step, a loaded state_dict) must reach the next call, with and without grad."""
    lev = tiny_lev(chunk=7, kernels=kernels)
    ids = torch.arange(V)
    with torch.no_grad():
        before = lev(ids)
        lev.spline.mul_(1.1)
        lev.spline[0, 0] += 0.5
        torch.testing.assert_close(lev(ids), lev.reference(ids), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(lev(ids), before)
    lev.load_state_dict({**lev.state_dict(), "spline": 1 + 0.1 * torch.randn_like(lev.spline)})
    torch.testing.assert_close(lev(ids), lev.reference(ids), rtol=1e-10, atol=1e-12)
    with torch.inference_mode():  # parameters made here have no version counter to follow
        lev = tiny_lev(chunk=7, kernels=kernels)
        torch.testing.assert_close(lev(ids), lev.reference(ids), rtol=1e-10, atol=1e-12)
        lev.spline.mul_(1.1)
        torch.testing.assert_close(lev(ids), lev.reference(ids), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kernels", ["c", None])
def test_lev_output_stays_float32_under_autocast(kernels):
    lev = tiny_lev(dtype=torch.float32, kernels=kernels)
    idx = random_ids(2, 9, seed=1)
    expected = lev(idx).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lev(idx)
        with torch.no_grad():
            out_no_grad = lev(idx)
    assert out.dtype == out_no_grad.dtype == torch.float32
    torch.testing.assert_close(out.detach(), expected)
    torch.testing.assert_close(out_no_grad, expected)


@pytest.mark.parametrize("grad", [True, False])
@KERNELS
def test_nan_coordinates_give_nan_modes_not_a_wild_knot_index(grad, kernels):
    """A diverged model gives NaN coordinates: they must not become a knot index far out of range (a
    crash in the gather, forward or backward), but NaN embeddings and gradients, so that the loss is
    NaN and train.py stops cleanly."""
    lev = tiny_lev(kernels=kernels)
    with torch.no_grad():
        lev.seed_proj[0, 0, 0] = float("nan")
    with torch.set_grad_enabled(grad):
        E = lev(torch.tensor([1, 2]))
    assert E.isnan().all()
    if grad:
        E.sum().backward()
        assert lev.spline.grad.isnan().all()


# --------------------------------------------------------------------------------------------------
# The fast path's pieces: the grouped log product, the 3-knot basis and gather, SplineProduct


@pytest.mark.parametrize("case, log10_first", [
    ("normal", 0.0),  # factors near 1: every partial product is a normal float
    ("overflow", 48.0),  # the first partial product is ~1e48, inf in fp32
    ("underflow", -56.0),  # ~1e-56 is 0
    # ~6e-45 is finite but keeps only a few bits, so its log is off by up to ~0.3
    ("subnormal", -44.2),
])
@pytest.mark.parametrize("d", [24, 6])  # partial products of 8 factors, of 2
@pytest.mark.parametrize("kernels", ["eager", "c"])
def test_grouped_log_product_matches_per_factor_log(case, log10_first, d, kernels):
    """SplineProduct's forward multiplies groups of gcd(d, 8) factors and takes one log per group.
    In float32 it equals the per-factor product computed in float64, also when a partial product
    leaves fp32's normal range (it then takes one log per factor). S is constant along the knots and
    t keeps away from the ends of [0, 1] (where the basis reaches the zero padding knots), so that
    phi equals S up to rounding: the weights sum to 1. The first group's factors multiply to
    ~10^log10_first, the other groups' to its inverse, so that M stays near 1."""
    h, n_knots, r, U = 2, 4, 3, 5
    group = math.gcd(d, 8)
    g = torch.Generator().manual_seed(0)
    magnitude = torch.empty(h, d, r, dtype=torch.float64).uniform_(1 / 1.1, 1.1, generator=g)
    magnitude[:, :group] *= 10 ** (log10_first / group)
    magnitude[:, group:] *= 10 ** (-log10_first / (d - group))
    signs = torch.randint(0, 2, magnitude.shape, generator=g) * 2 - 1
    factors = (magnitude * signs).float()  # (h, d, r)
    S = factors.unsqueeze(2).expand(h, d, n_knots, r).contiguous()
    t = 0.2 + 0.6 * torch.rand(U, h, d, generator=g)  # knots j-1, j, j+1 all within the 4
    if kernels == "c":
        skip_without_c_kernels()
    M = SplineProduct.apply(t, S, pad_knots(S), 2, kernels, False)  # (U, h, r)
    want_sign, want_log = signed_log_product(factors.double(), dim=1)  # (h, r)
    torch.testing.assert_close(M.double(), (want_sign * want_log.exp()).expand(U, h, r),
                               rtol=1e-4, atol=0)
    first_partial = factors[:, :group].prod(1)  # what one log per group would have seen, in fp32
    if case == "normal":
        assert first_partial.abs().min() >= torch.finfo(torch.float32).tiny
    else:  # the input really needs the per-factor fallback
        assert not (torch.isfinite(first_partial.abs().log()).all()
                    and first_partial.abs().min() >= torch.finfo(torch.float32).tiny)


def dense_basis_derivative(t, n_knots, normalize):
    """d bspline_basis / dt, (N, n_knots), by autograd: each weight depends on t elementwise."""
    t = t.detach().requires_grad_()
    w = bspline_basis(t, n_knots, normalize)
    return torch.stack([torch.autograd.grad(w[:, k].sum(), t, retain_graph=True)[0]
                        for k in range(n_knots)], -1)


@pytest.mark.parametrize("normalize", [True, False])
# with 17 knots the half-knot points t = (j + 0.5) / 16 are exact
@pytest.mark.parametrize("n_knots", [3, 16, 17])
def test_bspline_weights3_equal_the_dense_basis(n_knots, normalize):
    g = n_knots - 1
    t = torch.cat([torch.tensor([0.0, 1.0, 0.2 / g, 1 - 0.3 / g]), torch.arange(g + 1) / g,
                   (torch.arange(g) + 0.5) / g,
                   torch.rand(200, generator=torch.Generator().manual_seed(0))]).double()
    j, w3, dw3 = bspline_weights3(t, n_knots, normalize)
    w, dw = bspline_basis(t, n_knots, normalize), dense_basis_derivative(t, n_knots, normalize)
    assert j.dtype == torch.long and w3.shape == dw3.shape == (len(t), 3)
    at = j.unsqueeze(-1) + torch.arange(3)  # knots j-1, j, j+1 of the basis padded at both ends

    def dense(x):  # scatter the 3 entries into the padded basis, then drop the two padding knots
        return torch.zeros(len(t), n_knots + 2, dtype=x.dtype).scatter(1, at, x)[:, 1:-1]

    torch.testing.assert_close(dense(w3), w, rtol=0, atol=1e-14)
    torch.testing.assert_close(dense(dw3), dw, rtol=0, atol=1e-10)
    # with the padding knots, a partition of unity
    torch.testing.assert_close(w3.sum(-1), torch.ones_like(t))
    # a 4th knot may get ~1e-30 from rounding
    assert (w >= 0).all() and ((w > 1e-12).sum(-1) <= 3).all()


def test_spline_3knots_indexing_equals_embedding_bag():
    """Both ways spline_3knots gathers the 3 knots (indexing: compiled or on other devices;
    embedding_bag: eager on CPU and CUDA) compute the same phi, here both eagerly."""
    g = torch.Generator().manual_seed(0)
    hd, n_knots, r, u = 6, 5, 4, 7
    S = torch.randn(hd, n_knots, r, dtype=torch.float64, generator=g)
    S_padded = F.pad(S, (0, 0, 1, 1))
    j, w, _ = bspline_weights3(torch.rand(hd, u, dtype=torch.float64, generator=g), n_knots, True)
    by_embedding_bag = spline_3knots(S_padded, j, w)
    by_indexing = spline_3knots_indexing(S_padded, j, w)
    want = torch.stack([torch.stack([sum(w[i, k, m] * S_padded[i, j[i, k] + m] for m in range(3))
                                     for k in range(u)]) for i in range(hd)])
    assert by_embedding_bag.shape == by_indexing.shape == (hd, u, r)
    torch.testing.assert_close(by_embedding_bag, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(by_indexing, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernels", ["eager", "c"])
@pytest.mark.parametrize("normalize", [True, False])
def test_spline_product_gradcheck(normalize, kernels):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(5, 2, 4, dtype=torch.float64, generator=g)  # (U, h, d)
    t[0, 0, :2] = torch.tensor([0.01, 0.995])  # at the ends, where normalising matters
    t.requires_grad_()
    S = (1 + 0.3 * torch.randn(2, 4, 6, 3, dtype=torch.float64, generator=g)).requires_grad_()
    if kernels == "c":
        skip_without_c_kernels()
    def product(t, S):
        return SplineProduct.apply(t, S, pad_knots(S), 2, kernels, normalize)

    assert torch.autograd.gradcheck(product, (t, S))


# --------------------------------------------------------------------------------------------------
# The C kernels: their build, their numbers, their operands


def test_c_kernels_are_built_once_per_source_into_the_cache(tmp_path, monkeypatch):
    """lev_kernels.c is compiled into LEVIATHAN_CACHE on first use, reused while the source is
    unchanged, and rebuilt under another name when it changes (the name hashes the source)."""
    skip_without_c_kernels()
    monkeypatch.setenv("LEVIATHAN_CACHE", str(tmp_path / "cache"))
    first = c_kernels.build_c_library()
    assert first.parent == tmp_path / "cache" and first.exists()
    mtime = first.stat().st_mtime_ns
    # not rebuilt
    assert c_kernels.build_c_library() == first and first.stat().st_mtime_ns == mtime
    changed = tmp_path / "lev_kernels.c"
    changed.write_text(c_kernels.C_SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(c_kernels, "C_SOURCE", changed)
    second = c_kernels.build_c_library()
    assert second != first and second.exists()
    # and no temporary folder left behind
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert built == sorted([first.name, second.name])


@pytest.mark.parametrize("factor, want",
                         [(2.0, float("inf")), (0.5, 2.0 ** -130), (-2.0, float("inf"))])
def test_c_kernels_modes_beyond_float32s_range_are_what_float32_makes_of_them(factor, want):
    """130 factors of 2 (or 1/2): every partial product is normal, the mode 2^130 (2^-130) is not:
    inf (a subnormal), as exp(log|M|) gives in the torch kernels. An even number of negative
    factors: positive."""
    skip_without_c_kernels()
    h, d, n_knots, r = 1, 130, 4, 3
    S = torch.full((h, d, n_knots, r), factor)
    # knots 1, 2, 3 of 0..3 all exist: the weights sum to 1, so phi = factor
    t = torch.full((2, h, d), 0.5)
    M = SplineProduct.apply(t, S, pad_knots(S), 2, "c", True)
    torch.testing.assert_close(M, torch.full_like(M, want), rtol=1e-6, atol=0)
    eager = SplineProduct.apply(t, S, pad_knots(S), 2, "eager", True)
    torch.testing.assert_close(M, eager, rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_kernels_give_the_same_numbers_on_any_number_of_threads(dtype):
    """The C kernels split ids (forward) or blocks of one head's seed dimensions (backward) among
    threads; each output is computed by one thread in one order, so 1 and 3 threads give the same
    bits (the kernels alone: torch's own matmuls around them may sum in another order on another
    number of threads)."""
    skip_without_c_kernels()
    g = torch.Generator().manual_seed(0)
    U, h, d, n_knots, r = 37, 3, 80, 6, 5  # 3 heads x 80 dimensions: blocks of 64 and 16 per head
    t = torch.rand(U, h, d, generator=g).to(dtype)
    S_padded = F.pad(1 + 0.3 * torch.randn(h * d, n_knots, r, generator=g), (0, 0, 1, 1)).to(dtype)
    G = torch.randn(U, h, r, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append([c_kernels.c_spline_product(t, S_padded, True),
                            *c_kernels.c_spline_product_backward(t, S_padded, G, True)])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(*results, strict=True):
        assert torch.equal(one, three)


def test_c_kernels_refuse_operands_they_would_misread():
    """The C kernels read raw memory: mixed dtypes or wrong shapes raise a ValueError instead; and
    LEV's fast path does not pick them when its spline is in another dtype than the coordinates."""
    t = torch.rand(3, 2, 4)
    S_padded = torch.rand(8, 6, 5)
    with pytest.raises(ValueError, match="LEV's C kernels"):
        c_kernels.c_spline_product(t, S_padded.double(), True)
    with pytest.raises(ValueError, match="LEV's C kernels"):
        c_kernels.c_spline_product(t, torch.rand(7, 6, 5), True)  # h*d = 8 rows expected
    with pytest.raises(ValueError, match="LEV's C kernels"):  # G: (U, h, r) = (3, 2, 5)
        c_kernels.c_spline_product_backward(t, S_padded, torch.rand(3, 2, 4), True)
    lev = tiny_lev(dtype=torch.float32, kernels="c")
    assert lev.fast_embed.kernels(torch.rand(1, 2, 16), lev.spline) == "c"
    assert lev.fast_embed.kernels(torch.rand(1, 2, 16, dtype=torch.float64), lev.spline) != "c"


# missing, failing (exit status 1), or a cache folder that cannot be made (under a file)
@pytest.mark.parametrize("compiler", ["no-such-compiler", "false", "cache-under-a-file"])
def test_lev_without_a_c_compiler_says_so_once_and_runs_torchs_kernels(tmp_path, monkeypatch,
                                                                        capsys, compiler):
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command to stand in for a failing compiler")
    cc = {"no-such-compiler": str(tmp_path / compiler), "false": shutil.which("false")}
    if compiler in cc:
        monkeypatch.setenv("CC", cc[compiler])
    (tmp_path / "a_file").write_text("")
    cache = tmp_path / ("a_file" if compiler == "cache-under-a-file" else "") / "cache"
    monkeypatch.setenv("LEVIATHAN_CACHE", str(cache))
    monkeypatch.setattr(c_kernels, "_c_state", {})  # the module's memory of an earlier build: none
    lev = tiny_lev(kernels="torch")
    lev.fast_embed.c_kernels = True
    idx = random_ids(2, 9, seed=1)
    E = lev(idx)
    lev(idx)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("LEV: could not build its C kernels"), err
    reason = {"no-such-compiler": "no C compiler", "false": "the C compiler failed (it exited",
              "cache-under-a-file": "set LEVIATHAN_CACHE to a folder you can write to"}[compiler]
    assert reason in err and err.rstrip().endswith("--lev_c_kernels=False to skip the attempt")
    kernels = lev.fast_embed.kernels(torch.rand(1, 2, 16, dtype=torch.float64), lev.spline)
    assert kernels in ("compiled", "eager")
    torch.testing.assert_close(E, lev.reference(idx), rtol=1e-10, atol=1e-12)
