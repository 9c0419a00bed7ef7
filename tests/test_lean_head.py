"""Tests of the memory-lean head (kernels/lean_head.py): linear_cross_entropy equals
F.cross_entropy on full logits, in value and gradients (float64, both backward modes, every
reduction, ignored targets, a weight tied to an embedding, bf16 autocast, CUDA when there is one),
and GPT.forward with lean_head on equals it with lean_head off.
Run:  python -m pytest -q tests/test_lean_head.py
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import lean_head
from kernels.fast_paths import install_fast_paths
from kernels.lean_head import default_chunk_size, linear_cross_entropy
from leviathan import GPT, Config

pytestmark = pytest.mark.usefixtures("one_thread")

N, D, V = 37, 8, 50  # N not a multiple of the chunk sizes below: the last chunk is short
F64 = dict(rtol=1e-10, atol=1e-12)


def make(dtype=torch.float64, device="cpu", n_ignored=5, seed=0):
    """Hidden states (N, D), head (V, D), targets (N,) with n_ignored of them -1, and an upstream
    gradient (N,)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen, dtype=dtype).to(device).requires_grad_()
    w = torch.randn(V, D, generator=gen, dtype=dtype).to(device).requires_grad_()
    t = torch.randint(V, (N,), generator=gen)
    t[torch.randperm(N, generator=gen)[:n_ignored]] = -1
    return x, w, t.to(device), torch.randn(N, generator=gen, dtype=dtype).to(device)


def loss_and_grads(loss_fn, x, w, t, upstream, reduction="mean"):
    """(loss, dL/dx, dL/dW) with L = sum(loss * upstream) for "none", 1.7 * loss otherwise (not 1: a
    gradient that ignores its incoming scale would pass with 1)."""
    loss = loss_fn(x, w, t, reduction)
    total = (loss * upstream).sum() if reduction == "none" else 1.7 * loss
    return (loss, *torch.autograd.grad(total, (x, w)))


def full(x, w, t, reduction="mean"):
    logits = F.linear(x, w)  # (N, V); .float() as in GPT.forward would turn fp64 into fp32
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), t,
                           ignore_index=-1, reduction=reduction)


def lean(chunk_size):
    return lambda x, w, t, reduction="mean": linear_cross_entropy(
        x, w, t, chunk_size, reduction=reduction)


def assert_all_close(got, want, **tol):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, equal_nan=True, **tol)


def assert_bf16_close(got, want, loss_tol):
    """(loss, dL/dx, dL/dW) under bf16 autocast: all fp32, as the inputs; gradients within bf16's
    precision (dL/dW: ours sums the chunks in fp32, the full path rounds its one product to
    bf16)."""
    assert all(g.dtype == torch.float32 for g in got)
    torch.testing.assert_close(got[0], want[0], rtol=loss_tol, atol=loss_tol)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("chunk_size", [1, 5, N, 1000])
def test_equals_full_cross_entropy_float64(chunk_size, reduction):
    x, w, t, up = make()
    assert_all_close(loss_and_grads(lean(chunk_size), x, w, t, up, reduction),
                     loss_and_grads(full, x, w, t, up, reduction), **F64)


def test_a_wrong_gradient_is_caught(monkeypatch):
    """The comparison above can fail: a softmax off by one part in a million in backward is
    detected."""
    x, w, t, up = make()
    want = loss_and_grads(full, x, w, t, up)
    original = lean_head.chunk_backward

    def slightly_wrong(buf, probs, *rest):
        return original(buf, probs.mul_(1 + 1e-6), *rest)

    monkeypatch.setattr(lean_head, "chunk_backward", slightly_wrong)
    with pytest.raises(AssertionError):
        assert_all_close(loss_and_grads(lean(5), x, w, t, up), want, **F64)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_every_target_ignored(reduction):
    """As F.cross_entropy: NaN for the mean over no token (0 / 0), 0 for sum and none; gradients 0,
    not NaN."""
    x, w, t, up = make(n_ignored=N)
    got = loss_and_grads(lean(5), x, w, t, up, reduction)
    assert_all_close(got, loss_and_grads(full, x, w, t, up, reduction), **F64)
    assert got[0].isnan().all() if reduction == "mean" else (got[0] == 0).all()
    assert (got[1] == 0).all() and (got[2] == 0).all()


def test_a_loss_used_twice_has_the_same_gradients_twice():
    """retain_graph: a second backward, or autograd.grad, gets what the first got (the saved
    gradients are scaled out of place), as with the plain head."""
    for mean_path in (True, False):
        x, w, t, _ = make()
        with torch.set_grad_enabled(True):
            loss = (linear_cross_entropy(x, w, t, 5) if mean_path else
                    linear_cross_entropy(x, w, t, 5, reduction="none").sum())
        first = torch.autograd.grad(1.7 * loss, (x, w), retain_graph=True)
        kept = [g.clone() for g in first]
        second = torch.autograd.grad(0.3 * loss, (x, w), retain_graph=True)
        assert_all_close(first, kept, **F64)  # the first result is not changed by the second
        assert_all_close(second, [g * (0.3 / 1.7) for g in first], **F64)
        loss.backward(retain_graph=True)
        loss.backward()
        assert_all_close((x.grad / 2, w.grad / 2), (first[0] / 1.7, first[1] / 1.7), **F64)


def tiny_gpt(embedding="tied"):
    torch.manual_seed(0)
    return GPT(Config(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=16,
                      embedding=embedding, lev_seed_dim=16, lev_heads=2, lev_rank=8)).double()


def test_the_lean_heads_logits_are_the_plain_heads_when_used():
    """Every use of the logits the lean head returns (a method, an index, a torch function, an
    operator) sees the plain head's logits, made once; F.cross_entropy of (N, V) is the lean loss
    and makes none."""
    model = tiny_gpt()
    idx = torch.randint(61, (2, 16))
    plain, _ = model(idx)
    install_fast_paths(model, lean_head=True)
    uses = [lambda z: z.logsumexp(-1), lambda z: z[:, -1], lambda z: z.float(),
            lambda z: torch.softmax(z, -1), lambda z: F.log_softmax(z, -1),
            lambda z: z + 0, lambda z: 1 - z, lambda z: torch.ones(61).double() * z,
            lambda z: z @ torch.ones(61).double(), lambda z: -z, lambda z: z > 0,
            lambda z: torch.cat([z]), lambda z: z.reshape(2, 16 * 61)[1],
            lambda z: F.cross_entropy(z.transpose(1, 2), idx)]  # (B, V, T): made
    for use in uses:
        logits, _ = model(idx)
        assert logits.made is None and logits.shape == plain.shape
        got = use(logits)
        assert logits.made is not None  # made, once
        torch.testing.assert_close(got, use(plain), **F64)
    logits, _ = model(idx)  # what the lean loss does not compute (label smoothing): made
    flat = logits.view(-1, 61)
    smoothed = F.cross_entropy(flat, idx.view(-1), label_smoothing=0.1)
    assert flat.made is not None
    torch.testing.assert_close(smoothed, F.cross_entropy(plain.view(-1, 61), idx.view(-1),
                                                         label_smoothing=0.1), **F64)
    logits, _ = model(idx)
    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), idx.reshape(-1),
                                reduction="none")
    assert logits.made is None  # the lean loss: no logits made
    torch.testing.assert_close(per_token, F.cross_entropy(plain.view(-1, 61), idx.view(-1),
                                                          reduction="none"), **F64)


@pytest.mark.parametrize("embedding", ["tied", "untied", "lev"])
def test_a_loss_term_on_the_lean_heads_logits_has_the_plain_heads_gradients(embedding):
    """A nanoGPT-style term written after the forward (train.py's --z_loss, or a reader's) trains
    as with --lean_head=False: the loss and every parameter's gradient, float64."""
    model = tiny_gpt(embedding)
    idx, targets = torch.randint(61, (2, 16)), torch.randint(61, (2, 16))
    results = []
    for lean in (False, True):
        install_fast_paths(model, lean_head=lean)
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, targets)
        loss = loss + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)  # .float()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7)


def test_per_token_losses_keep_the_targets_shape():
    x, w, t, _ = make()
    # (B, T, D) input
    per_token = linear_cross_entropy(x.view(1, N, D), w, t.view(1, N), reduction="none")
    assert per_token.shape == (1, N)
    torch.testing.assert_close(per_token.view(N), full(x, w, t, "none"), **F64)
    assert (per_token.view(N)[t == -1] == 0).all() and (per_token.view(N)[t != -1] > 0).all()


def test_weight_tied_to_an_embedding():
    """The head is the embedding table: dL/dW is the sum of both uses, through the one Parameter."""
    x, w, t, _ = make()
    ids = t.clamp(min=0)

    def grad_of_table(head_loss):
        table = torch.nn.Embedding(V, D, dtype=torch.float64)
        table.weight.data.copy_(w.detach())
        h = torch.tanh(table(ids) + x.detach())  # (N, D) the table read at the input ...
        head_loss(h, table.weight, t).backward()  # ... and used as the head
        return table.weight.grad

    torch.testing.assert_close(grad_of_table(lean(5)), grad_of_table(full), **F64)


def test_only_what_needs_a_gradient_gets_one():
    x, w, t, _ = make()
    frozen = w.detach()
    got = torch.autograd.grad(linear_cross_entropy(x, frozen, t, 5), x)[0]
    torch.testing.assert_close(got, torch.autograd.grad(full(x, frozen, t), x)[0], **F64)
    frozen_x = x.detach()
    got = torch.autograd.grad(linear_cross_entropy(frozen_x, w, t, 5), w)[0]
    torch.testing.assert_close(got, torch.autograd.grad(full(frozen_x, w, t), w)[0], **F64)
    with torch.no_grad():  # no gradient wanted: the recomputing path, which keeps only N floats
        loss = linear_cross_entropy(x, w, t, 5)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, full(x, w, t), **F64)


def test_bf16_autocast_cpu():
    """Matmuls in bf16 as under F.linear, the log-sum-exp in fp32: near the full path under the same
    autocast, nearer to it than to the fp32 loss; loss and gradients fp32, like the inputs."""
    x, w, t, up = make(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lean(5), x, w, t, up)
        want = loss_and_grads(full, x, w, t, up)
    assert_bf16_close(got, want, loss_tol=1e-5)  # the same bf16 logits, then fp32: the same loss
    fp32_loss = full(x, w, t)
    assert (got[0] - want[0]).abs() < (fp32_loss - want[0]).abs()


def test_default_chunk_size_and_bad_arguments():
    assert default_chunk_size(50257) == 1335 and default_chunk_size(10**9) == 16
    x, w, t, _ = make()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(x, w, t, chunk_size=0)
    with pytest.raises(TypeError, match="float32"):
        linear_cross_entropy(x, w.float(), t)


@pytest.mark.parametrize("embedding", ["tied", "untied", "lev"])
def test_gpt_forward_with_the_lean_head_equals_the_full_head(embedding):
    """The model's loss and every parameter's gradient, lean head on against off (float64); the
    lean head makes no logits."""
    model = tiny_gpt(embedding)
    idx, targets = torch.randint(61, (2, 16)), torch.randint(61, (2, 16))
    targets[0, :3] = -1
    results = []
    for lean in (False, True):
        install_fast_paths(model, lean_head=lean)
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, targets)
        assert isinstance(logits, torch.Tensor) != lean and (not lean or logits.made is None)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], **F64)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, **F64)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.usefixtures("exact_fp32")  # conftest.py: no TF32 on either path
def test_cuda_float32():
    x, w, t, up = make(torch.float32, "cuda")
    assert_all_close(loss_and_grads(lean(5), x, w, t, up),
                     loss_and_grads(full, x, w, t, up), rtol=1e-4, atol=1e-5)


@cuda
def test_cuda_bf16_autocast():
    x, w, t, up = make(torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss_and_grads(lean(5), x, w, t, up)
        want = loss_and_grads(full, x, w, t, up)
    assert_bf16_close(got, want, loss_tol=1e-3)


def lean_and_plain(embedding="untied"):
    """A float64 model, a batch, and (lazy logits, plain logits) of one forward each, with the loss
    of each: the lean head's first, then the plain head's."""
    model = tiny_gpt(embedding)
    idx, targets = torch.randint(61, (2, 16)), torch.randint(61, (2, 16))
    out = []
    for lean in (True, False):
        install_fast_paths(model, lean_head=lean)
        out.append(model(idx, targets))
    return model, idx, targets, out


def grads_of(model, loss, **kwargs):
    model.zero_grad(set_to_none=True)
    loss.backward(**kwargs)
    return [p.grad.clone() for p in model.parameters()]


def test_what_is_known_is_answered_without_the_logits():
    _, _, _, [(lazy, _), (plain, _)] = lean_and_plain()
    for ask in (lambda z: z.shape, lambda z: z.size(-1), lambda z: z.dtype, lambda z: z.device,
                lambda z: z.ndim, lambda z: z.dim(), lambda z: z.numel(), lambda z: len(z),
                lambda z: z.requires_grad):
        assert ask(lazy) == ask(plain)
    with torch.autocast("cpu", torch.bfloat16):
        model = tiny_gpt().float()
        install_fast_paths(model, lean_head=True)
        logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.dtype == torch.bfloat16  # as F.linear's under autocast
    with torch.no_grad():
        assert not model(torch.zeros(1, 4, dtype=torch.long))[0].requires_grad
    assert lazy.made is None and logits.made is None


@pytest.mark.parametrize("flat", [lambda z: z.flatten(0, 1), lambda z: z.view(-1, 61),
                                  lambda z: z.reshape(32, 61), lambda z: z.flatten(end_dim=-2)])
def test_views_that_keep_the_vocabulary_stay_lazy(flat):
    model, _, targets, [(lazy, _), (plain, _)] = lean_and_plain()
    loss = F.cross_entropy(flat(lazy), targets.view(-1))
    assert lazy.made is None
    want = F.cross_entropy(flat(plain), targets.view(-1))
    torch.testing.assert_close(loss, want, **F64)
    assert_all_close(grads_of(model, loss), grads_of(model, want), **F64)


@pytest.mark.parametrize("use, differentiable", [
    (lambda z: 2 ** z, True), (lambda z: 1 / z, True), (lambda z: z.__iadd__(1), True),
    (lambda z: z.__imul__(2), True), (lambda z: z.__ipow__(2), True), (lambda z: +z, True),
    (lambda z: z.__isub__(1), True), (lambda z: z.__itruediv__(3), True),
    (lambda z: 3.0 // z, False), (lambda z: 5.0 % z, False), (lambda z: z.__ifloordiv__(2), False)])
def test_reflected_and_in_place_operators(use, differentiable):
    model, _, _, [(lazy, _), (plain, _)] = lean_and_plain()
    got, want = use(lazy).sum(), use(plain).sum()
    torch.testing.assert_close(got, want, **F64)
    if differentiable:  # (floor division and remainder have no gradient in torch)
        assert_all_close(grads_of(model, got), grads_of(model, want), **F64)


def test_edits_are_seen_by_every_view_and_the_loss():
    """An item assignment, directly or through a view of another name, changes what the loss of
    the logits (lazy until then) computes, as it does with the plain head."""
    model, _, targets, pairs = lean_and_plain()
    results = []
    for logits, _ in pairs:
        flat = logits.view(-1, 61)
        flat[:, 3] = -1e4  # through a view
        logits[..., 0] = 7.0  # on the logits
        loss = F.cross_entropy(logits.view(-1, 61), targets.view(-1))
        results.append((loss, flat[:, :4].sum(), grads_of(model, loss)))
    torch.testing.assert_close(results[0][0], results[1][0], **F64)
    torch.testing.assert_close(results[0][1], results[1][1], **F64)
    assert_all_close(results[0][2], results[1][2], **F64)


def test_a_loss_term_used_twice_and_torch_save(tmp_path):
    model, _, _, [(lazy, loss), (plain, plain_loss)] = lean_and_plain()
    got = loss + 0.1 * lazy.logsumexp(-1).pow(2).mean()
    want = plain_loss + 0.1 * plain.logsumexp(-1).pow(2).mean()
    first, again = grads_of(model, got, retain_graph=True), grads_of(model, got)
    assert_all_close(first, grads_of(model, want, retain_graph=True), **F64)
    assert_all_close(again, first, **F64)
    torch.save(lazy, tmp_path / "logits.pt")
    saved = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert type(saved) is torch.Tensor
    torch.testing.assert_close(saved, plain.detach(), **F64)


def test_logits_used_after_the_weights_changed_raise():
    """Made after an optimizer step, lazy logits would be the new weights'; they raise instead.
    Made before it, they are the plain head's, as a tensor is."""
    model, _, targets, [(lazy, _), (plain, _)] = lean_and_plain()
    early, _ = lean_and_plain()[3][0]
    early.tensor()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        lazy.argmax(-1)
    with pytest.raises(RuntimeError, match="changed in place"):
        F.cross_entropy(lazy.view(-1, 61), targets.view(-1))
    assert early.made is not None and early.argmax(-1).shape == (2, 16)


def test_the_logits_made_in_training_say_so_once(capfd, monkeypatch):
    monkeypatch.setattr(lean_head.LazyLogits, "said", False)
    _, _, _, [(lazy, _), _] = lean_and_plain()
    lazy.argmax(-1)
    lean_and_plain()[3][0][0].softmax(-1)
    said = capfd.readouterr().err.splitlines()
    assert len(said) == 1 and "the lean head's logits were made in full ((2, 16, 61)" in said[0]


def test_made_logits_are_freed_with_their_lazy_logits():
    """No reference cycle: made logits go when the step's names go, not at the next collection
    (a step's B x T x V logits kept into the next step would double its peak memory)."""
    import gc
    import weakref

    _, _, _, [(lazy, _), _] = lean_and_plain()
    made = weakref.ref(lazy.tensor())
    gc.disable()
    try:
        del lazy
        assert made() is None
    finally:
        gc.enable()
