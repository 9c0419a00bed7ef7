"""The fast paths a script installs on a model, each checked against the model's own code as it
stands: what you edit is what runs.

leviathan.py runs as written, and leaves two hooks at None for the two narrow functions that plain
torch runs far slower: LEV.fast_embed, LEV's spline product (fast_lev.py), and GPT.fast_loss, the
loss of the V-wide head without all the logits at once (lean_head.py). They are settings of a run,
not of the architecture: kept out of Config and checkpoints.

A reader who edits leviathan.py (another spline, norm or loss term) changes the plain code, which
the fast paths re-implement. So install_fast_paths checks each one it installs: it computes a small
probe with the hook on and with it off (the model's own code), on the model's device and in its
parameters' dtype:

  LEV       a few ids, both ends of the vocabulary among them, once with the model's weights and
            once with its LayerNorm gains widened and one spline negated (coordinates at both ends
            of [0, 1], modes of either sign); in training mode the gradients too;
  the loss  one short batch (an ignored target among them), reduction "none" without and with a
            z-loss, and "mean", once more with scaled_weights, where attention and logits act as in
            a trained model; in training mode every parameter's gradient of the mean too.

Where the largest relative difference passes TOLERANCE (float noise is far below it, see
docs/model.md), that fast path is removed and one line says which, by how much, and that the model
runs as written. A probe that fails itself removes its fast path the same way. The probes change
nothing: no weight, no .grad, no random state (forked), no setting (restored).

The check runs with autocast and TF32 off, in plain float32 (or float64): it asks whether two
pieces of code compute the same function, and bf16 rounding (8 bits) would hide edits as small as
a z-loss. The fast paths' own accuracy under autocast is what tests/test_cuda.py checks.
"""

import contextlib
import copy
import math
import sys

import torch

from kernels.lean_head import lean_loss

# largest relative difference (max |fast - plain| / max |plain|, per tensor) that counts as float
# noise, by the probe's dtype; docs/model.md has the measured noise (fp32: ~1e-6) and edits' sizes
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
LEV_PROBE_IDS = 9  # evenly spaced over [0, V): the first and the last id among them
LOSS_PROBE = (2, 32)  # batch and (at most) sequence length of the loss's probe
TRAINED_LOGITS = 32  # about the largest logit of a trained model; see weight_factors
Z_LOSS_PROBE = 0.01  # the loss probe's z-loss weight: large enough that an edit of it shows

PARTS = {  # hook -> (the fast path, the model's own code it replaces, what then runs as written)
    "lev": ("LEV's fast path (machinery/fast_lev.py)", "leviathan.py's LEV", "LEV"),
    "loss": ("the lean head (machinery/lean_head.py)", "leviathan.py's loss (GPT.forward)",
             "the loss"),
}


def say_on_stderr(line):
    print(line, file=sys.stderr, flush=True)


def install_fast_paths(model, lev=None, lean_head=False, check=True, say=say_on_stderr):
    """Set the model's fast paths (each call sets both): lev, a FastEmbedder (fast_lev.py) or None
    for LEV's recipe as written (lev arm only); lean_head, the loss from lean_head.py.
    check: check each against the model's own code (check_fast_paths), on the model's device:
    install on the model where it will run, after its weights are loaded."""
    if model.config.embedding == "lev":
        model.tok_emb.fast_embed = lev
    model.fast_loss = lean_loss if lean_head else None
    if check:
        check_fast_paths(model, say)
    return model


def check_fast_paths(model, say=say_on_stderr):
    """Check every fast path installed on model against the model's own code; remove those that
    differ, with one line each through say. Returns {part: relative difference, or the error}."""
    found = {}
    if getattr(model.tok_emb, "fast_embed", None) is not None:
        found["lev"] = check_lev(model.tok_emb, say)
    if model.fast_loss is not None:
        found["loss"] = check(model, "fast_loss", "loss", lambda: loss_outputs(model), say)
    return found


def check_lev(lev, say=say_on_stderr):
    """check_fast_paths for a LEV module alone (its fast_embed)."""
    return check(lev, "fast_embed", "lev", lambda: lev_outputs(lev), say)


def check(owner, hook, part, outputs, say):
    """largest_difference(outputs() with owner.<hook>, outputs() without); the hook is removed,
    with a line, unless that is within the tolerance -> the relative difference, or the probe's
    error."""
    try:
        with exact_arithmetic(owner):
            found = largest_difference(*with_and_without(owner, hook, outputs))
    except (torch.OutOfMemoryError, MemoryError):
        raise  # the machine's limit, not the code's: the script says what to do
    except Exception as error:  # a probe that fails: the model as written, never a traceback
        found = error
    tol = tolerance(owner)
    if isinstance(found, Exception) or not found <= tol:
        setattr(owner, hook, None)
        say(step_aside_line(part, found, tol))
    return found


def tolerance(module):
    return TOLERANCE.get(next(module.parameters()).dtype, TOLERANCE[torch.float32])


def step_aside_line(part, found, tol):
    fast, plain, runs = PARTS[part]
    if isinstance(found, Exception):
        detail = (str(found).strip().splitlines() or [""])[0][:150]
        what = f"could not be checked against {plain} ({type(found).__name__}: {detail})"
    else:
        what = f"differs from {plain} by {found:.1e} (relative; float noise stays below {tol:.0e})"
    return (f"note: {fast} {what}; it is off, and {runs} runs as written, slower "
            f"(docs/model.md: Editing the recipe)")


@contextlib.contextmanager
def exact_arithmetic(module):
    """Autocast and TF32 off, and the random state forked: the probes draw dropout masks as the
    model would (the same ones for both sides, seeded alike) and leave the run's streams as they
    were."""
    device = next(module.parameters()).device
    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
    saved = [getattr(backend, name) for backend, name in flags]
    cuda = [device] if device.type == "cuda" else []
    # torch.manual_seed reseeds MPS too, which fork_rng does not put back
    mps = torch.mps.get_rng_state() if device.type == "mps" else None
    try:
        for backend, name in flags:
            setattr(backend, name, False)
        with torch.random.fork_rng(devices=cuda), torch.autocast(device.type, enabled=False):
            yield
    finally:
        for (backend, name), value in zip(flags, saved, strict=True):
            setattr(backend, name, value)
        if mps is not None:
            torch.mps.set_rng_state(mps)


def with_and_without(owner, hook, outputs):
    """outputs() with owner.<hook> as installed, and with it None (the model's own code), each from
    the same random state."""
    fast_hook = getattr(owner, hook)
    torch.manual_seed(0)
    fast = outputs()
    setattr(owner, hook, None)
    try:
        torch.manual_seed(0)
        plain = outputs()
    finally:
        setattr(owner, hook, fast_hook)
    return fast, plain


def largest_difference(fast, plain):
    """The largest relative_difference of two lists of tensors (or of tuples of tensors), side by
    side."""
    if len(fast) != len(plain):
        return float("inf")
    return max((relative_difference(f, p) for f, p in zip(fast, plain, strict=True)), default=0.0)


def relative_difference(fast, plain):
    """max |fast - plain| / max |plain| over a tensor, or over a tuple of tensors taken together
    (the gradients of all parameters, measured against the largest of them, so that the smallest,
    where rounding from the layers above weighs most, raise no false alarm). inf for other shapes,
    or where one side is not finite and the other is."""
    if isinstance(plain, torch.Tensor):
        fast, plain = (fast,), (plain,)
    if len(fast) != len(plain) or any(f.shape != p.shape for f, p in zip(fast, plain, strict=True)):
        return float("inf")
    pairs = [gap_and_scale(f.detach(), p.detach()) for f, p in zip(fast, plain, strict=True)]
    gap, scale = max((g for g, _ in pairs), default=0.0), max((s for _, s in pairs), default=0.0)
    return gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf"))


def gap_and_scale(fast, plain):
    """(max |fast - plain|, max |plain|) over the values finite on both sides; (inf, 0) where one
    side is finite and the other is not."""
    if plain.numel() == 0:
        return 0.0, 0.0
    gap, scale = (fast - plain).abs().max().item(), plain.abs().max().item()
    if math.isfinite(gap) and math.isfinite(scale):
        return gap, scale
    finite = plain.isfinite()  # rare: non-finite values, compared as such
    if not torch.equal(fast.isfinite(), finite):
        return float("inf"), 0.0
    return gap_and_scale(fast[finite], plain[finite]) if finite.any() else (0.0, 0.0)


def probe_generator(seed):
    return torch.Generator().manual_seed(seed)  # on the CPU: the probe's tokens, not the run's


# --------------------------------------------------------------------------------------------------
# the probes: each returns a list of tensors, compared side by side


def lev_outputs(lev):
    """LEV's embeddings of a few ids (and, in training mode, the gradients of its parameters), with
    its own weights and with widened ones."""
    device = next(lev.parameters()).device
    ids = torch.linspace(0, lev.vocab_size - 1, LEV_PROBE_IDS).round().long().unique().to(device)
    outputs = []
    for variant in (lev, widened(lev)):
        if variant is not None:
            outputs += embeddings_and_gradients(variant, ids, lev.training)
    return outputs


def widened(lev):
    """A copy of LEV whose coordinates reach both ends of [0, 1] (LayerNorm gains x 8) and whose
    modes are negative (the first seed dimension's spline negated), or None where LEV has no such
    parameters (an edit renamed them)."""
    if not (isinstance(getattr(lev, "ln_weight", None), torch.Tensor)
            and isinstance(getattr(lev, "spline", None), torch.Tensor)):
        return None
    wide = copy.deepcopy(lev)
    with torch.no_grad():
        wide.ln_weight.mul_(8)
        wide.spline[:, 0].neg_()
    return wide


def embeddings_and_gradients(lev, ids, with_gradients):
    params = [p for p in lev.parameters() if p.requires_grad] if with_gradients else []
    with torch.set_grad_enabled(bool(params)):
        E = lev.embed_distinct(ids)  # (U, n_embd)
        if not params:
            return [E]  # (eval mode: no gradients)
        weight = torch.randn(E.shape, generator=probe_generator(1)).to(E)
        grads = torch.autograd.grad((E * weight).sum(), params, allow_unused=True)
    return [E.detach(), tuple(g for g in grads if g is not None)]


def loss_outputs(model):
    """The loss of one short batch: per token, without and with a z-loss, then the mean (and, in
    training mode, the gradients of every trainable parameter), also with scaled_weights."""
    c = model.config
    device = next(model.parameters()).device
    B, T = LOSS_PROBE[0], min(LOSS_PROBE[1], c.block_size)
    ids = torch.randint(c.vocab_size, (B, T + 1), generator=probe_generator(2))
    ids[0, :2] = torch.tensor([0, c.vocab_size - 1])  # both ends of the vocabulary
    idx, targets = ids[:, :-1].to(device), ids[:, 1:].clone().to(device)
    targets[-1, -1] = -1  # an ignored target
    with torch.no_grad():  # per token, without and with a z-loss
        outputs = [model(idx, targets, reduction="none", z_loss=z)[1] for z in (0.0, Z_LOSS_PROBE)]
    for factor in weight_factors(model, idx):
        with scaled_weights(model, factor):
            outputs += loss_and_gradients(model, idx, targets)
    return outputs


def loss_and_gradients(model, idx, targets):
    params = [p for p in model.parameters() if p.requires_grad] if model.training else []
    with torch.set_grad_enabled(bool(params)):
        loss = model(idx, targets)[1]
        grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
    return [loss.detach(), tuple(g for g in grads if g is not None)]


def weight_factors(model, idx):
    """The weight scales of the loss probe: 1, and a power of two up to 4 where the model's logits
    on idx are small (at initialisation their largest is ~1), so that they reach ~TRAINED_LOGITS, as
    in a trained model, and attention is peaked. There an edit of the attention or of the logits
    shows, where flat attention and small logits hide it. No further: fp32's rounding of logits
    grows with them, and so would the float noise."""
    with torch.no_grad():
        largest = model(idx)[0].abs().max().item()  # the last position's logits
    factor = 1
    while factor < 4 and largest * (2 * factor) ** 2 <= TRAINED_LOGITS:
        factor *= 2
    return (1, factor) if factor > 1 else (1,)


@contextlib.contextmanager
def scaled_weights(model, factor):
    """Within: every parameter but LEV's times factor, a power of two, exact both ways (the logits
    grow by about factor^2: the final norm's gain and the head). LEV's are left alone (its product
    of d_seed factors would overflow); lev_outputs widens LEV its own way."""
    lev = {id(p) for p in model.tok_emb.parameters()} if model.config.embedding == "lev" else set()
    params = [p for p in model.parameters() if id(p) not in lev] if factor != 1 else []
    scaled = []  # undone exactly, even after an interruption halfway
    try:
        with torch.no_grad():
            for p in params:
                p.mul_(factor)
                scaled.append(p)
        yield
    finally:
        with torch.no_grad():
            for p in scaled:
                p.mul_(1 / factor)
