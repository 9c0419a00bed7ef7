"""The fast paths a script installs on a model, each checked against the model's own code as it
stands: what you edit is what runs.

leviathan.py runs as written and leaves two hooks at None: LEV.fast_embed, LEV's spline product
(fast_lev.py) or LEV's recipe compiled (compiled_lev.py), and GPT.fast_logits, the V-wide head's
logits made only when used, their cross-entropy without all of them at once (lean_head.py,
imported only where a script asks for it: sampling never does). They are settings of a run, not
of the architecture.

An edit of leviathan.py changes the plain code, which the fast paths re-implement. So each is
checked when installed: a small probe (lev_outputs, loss_outputs) runs with the hook on and off (the
model's own code), on the model's device, in its parameters' dtype, with autocast and TF32 off
(bf16's 8 bits would hide an edit as small as a z-loss). A fast path whose largest relative
difference passes TOLERANCE (float noise is far below it: docs/model.md), or whose probe fails, is
removed with one line saying why; the model then runs as written, or LEV's next fast path is tried
(install_fast_paths' list: the compiled recipe after the kernels). The probes change nothing: no
weight, .grad, random state (forked) or setting.
"""

import contextlib
import copy
import functools
import sys

import torch
import torch.nn.functional as F

# largest relative difference (max |fast - plain| / max |plain|) that counts as float noise, by the
# probe's dtype; docs/model.md has the measured noise (fp32: at most 8e-6) and edits' sizes
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
LEV_PROBE_IDS = 9  # evenly spaced over [0, V): the first and the last id among them
LOSS_PROBE = (2, 32)  # batch and (at most) sequence length of the loss's probe
TRAINED_LOGITS = 32  # about the largest logit of a trained model; see trained_scale
TERM_PROBE = 0.01  # the weight of the loss probe's term on the logits, as a z-loss's
PARTS = {  # hook -> (the fast path, the model's own code it replaces, what then runs as written)
    "lev": ("LEV's fast path (kernels/fast_lev.py)", "leviathan.py's LEV", "LEV"),
    "loss": ("the lean head (kernels/lean_head.py)", "leviathan.py's head and loss (GPT.forward)",
             "the head"),
}
def say_on_stderr(line):  # sys.stderr as it is when saying (a test may have replaced it)
    print(line, file=sys.stderr, flush=True)


def install_fast_paths(model, lev=None, lean_head=False, check=True, say=say_on_stderr):
    """Set the model's fast paths (each call sets both): lev, LEV's fast path (lev arm only): a
    FastEmbedder (fast_lev.py), a CompiledRecipe (compiled_lev.py), a list of them tried in turn
    (the first that passes its check stays), or None for LEV's recipe as written; lean_head, the
    loss from lean_head.py. check: check each against the model's own code, on its device: install
    where it runs, weights loaded (check=False keeps LEV's first and drops the rest)."""
    candidates = list(lev) if isinstance(lev, (list, tuple)) else [lev] if lev else []
    model.fast_logits = None
    if lean_head:
        from kernels.lean_head import LazyLogits  # here: sampling never imports the lean head

        model.fast_logits = LazyLogits
    if model.config.embedding == "lev":
        model.tok_emb.fast_embed = candidates.pop(0) if candidates else None
    if check:
        check_fast_paths(model, say, then=candidates)
    if model.fast_logits is not None:  # checked: from now on, logits made in training say so once
        model.fast_logits = functools.partial(model.fast_logits, notice=say)
    return model


def check_fast_paths(model, say=say_on_stderr, then=()):
    """Check every fast path installed on model; remove those that differ, with one line each
    (then: LEV's fast paths tried in turn where its own steps aside). -> {part: the relative
    difference, or the probe's error}."""
    found = {}
    if getattr(model.tok_emb, "fast_embed", None) is not None:
        found["lev"] = check_lev(model.tok_emb, say, then)
    if model.fast_logits is not None:
        found["loss"] = check(model, "fast_logits", "loss", loss_outputs, say)
    return found


def check_lev(lev, say=say_on_stderr, then=()):
    """check_fast_paths for a LEV module alone (its fast_embed, then each of then in turn where it
    steps aside, named in its line) -> the last one's difference."""
    then, lines = list(then), []
    while True:  # each line says what runs in the end: known once the candidates are checked
        name = getattr(lev.fast_embed, "name", PARTS["lev"][0])
        found = check(lev, "fast_embed", "lev", lev_outputs, lines.append, name,
                      "{runs}" if then else None)
        if lev.fast_embed is not None or not then:
            break
        lev.fast_embed = then.pop(0)
    runs = (f"{lev.fast_embed.name} runs in its place, checked equal to it"
            if lev.fast_embed is not None else f"{PARTS['lev'][2]} runs as written, slower")
    for line in lines:
        say(line.replace("{runs}", runs))
    return found


def check(owner, hook, part, outputs, say, fast_name=None, runs=None):
    """outputs(owner) with owner.<hook> and with it None, from the same random state; the hook is
    removed, with a line (fast_name: what it was, runs: what runs instead), unless their largest
    relative difference is within TOLERANCE."""
    fast_hook, results = getattr(owner, hook), []
    try:
        with exact_arithmetic(owner):
            for hook_value in (fast_hook, None):
                setattr(owner, hook, hook_value)
                torch.manual_seed(0)
                results.append(outputs(owner))
        fast, plain = results
        same_length = len(fast) == len(plain)
        found = max(map(relative_difference, fast, plain)) if same_length else float("inf")
    except (torch.OutOfMemoryError, MemoryError):
        raise  # the machine's limit, not the code's: the script says what to do
    except Exception as error:  # a probe that fails: the model as written, never a traceback
        found = error
    finally:
        setattr(owner, hook, fast_hook)
    tol = TOLERANCE.get(next(owner.parameters()).dtype, TOLERANCE[torch.float32])
    if isinstance(found, Exception) or not found <= tol:
        setattr(owner, hook, None)
        default_name, plain_name, as_written = PARTS[part]
        fast_name, runs = fast_name or default_name, runs or f"{as_written} runs as written, slower"
        if isinstance(found, Exception):
            detail = (str(found).strip().splitlines() or [""])[0][:150]
            what = f"could not be checked against {plain_name} ({type(found).__name__}: {detail})"
        else:
            what = f"differs from {plain_name} by {found:.1e} (relative; float noise < {tol:.0e})"
        say(f"note: {fast_name} {what}; it is off, and {runs} (docs/model.md: Editing the recipe)")
    return found


@contextlib.contextmanager
def exact_arithmetic(module):
    """Autocast and TF32 off, and the random state forked: the probes draw dropout masks as the
    model would (the same for both sides) and leave the run's streams as they were."""
    device = next(module.parameters()).device
    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32")]
    saved = [getattr(backend, name) for backend, name in flags]
    # torch.manual_seed reseeds MPS too, which fork_rng does not put back
    mps = torch.mps.get_rng_state() if device.type == "mps" else None
    try:
        for backend, name in flags:
            setattr(backend, name, False)
        with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
              torch.autocast(device.type, enabled=False)):
            yield
    finally:
        for (backend, name), value in zip(flags, saved, strict=True):
            setattr(backend, name, value)
        if mps is not None:
            torch.mps.set_rng_state(mps)


def relative_difference(fast, plain):
    """max |fast - plain| / max |plain| over a tensor, or over a tuple of tensors taken together
    (the gradients of all parameters, against the largest of them, so that the smallest, where
    rounding from the layers above weighs most, raise no false alarm). Non-finite values must match
    and are left out; inf for other shapes, or where one side is finite and the other is not."""
    fast, plain = ((t,) if isinstance(t, torch.Tensor) else t for t in (fast, plain))
    if [f.shape for f in fast] != [p.shape for p in plain]:
        return float("inf")
    gap = scale = 0.0
    for f, p in zip(fast, plain, strict=True):
        f, p = f.detach(), p.detach()
        g, s = ((f - p).abs().max().item(), p.abs().max().item()) if p.numel() else (0.0, 0.0)
        if not g + s < float("inf"):  # rare, and only then masked: non-finite values
            if not torch.equal(f.isfinite(), finite := p.isfinite()):
                return float("inf")
            f, p = f[finite], p[finite]
            g, s = ((f - p).abs().max().item(), p.abs().max().item()) if p.numel() else (0.0, 0.0)
        gap, scale = max(gap, g), max(scale, s)
    return gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf"))


# --------------------------------------------------------------------------------------------------
# the probes: each returns a list of tensors (or tuples of tensors), compared side by side


def lev_outputs(lev):
    """LEV's embeddings of a few ids (and, in training mode, the gradients of its parameters), with
    its own weights and, where it still has them, with its LayerNorm gains x 8 (coordinates at both
    ends of [0, 1]) and the first seed dimension's spline negated (negative modes)."""
    ids = torch.linspace(0, lev.vocab_size - 1, LEV_PROBE_IDS).round().long().unique()
    ids = ids.to(next(lev.parameters()).device)
    variants = [lev]
    if all(isinstance(getattr(lev, name, None), torch.Tensor) for name in ("ln_weight", "spline")):
        variants.append(copy.deepcopy(lev))  # (an edit that renamed them: the first probe only)
        with torch.no_grad():
            variants[1].ln_weight.mul_(8)
            variants[1].spline[:, 0].neg_()
    outputs = []
    for variant in variants:
        params = [p for p in variant.parameters() if p.requires_grad] if lev.training else []
        with torch.set_grad_enabled(bool(params)):
            E = variant.embed_distinct(ids)  # (U, n_embd)
            outputs.append(E.detach())
            if params:
                weight = torch.randn(E.shape, generator=torch.Generator().manual_seed(1)).to(E)
                grads = torch.autograd.grad((E * weight).sum(), params, allow_unused=True)
                outputs.append(tuple(g for g in grads if g is not None))
    return outputs


def loss_outputs(model):
    """One short batch's cross-entropy of the logits per token, then GPT.forward's loss alone and
    with a term on the logits (as train.py's --z_loss), and in training mode the gradients of every
    trainable parameter, also with scale_weights."""
    c = model.config
    B, T = LOSS_PROBE[0], min(LOSS_PROBE[1], c.block_size)
    ids = torch.randint(c.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(2))
    ids[0, :2] = torch.tensor([0, c.vocab_size - 1])  # both ends of the vocabulary
    ids = ids.to(next(model.parameters()).device)
    idx, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[-1, -1] = -1  # an ignored target
    with torch.no_grad():
        logits, _ = model(idx)
        outputs = [F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-1, reduction="none")]
    params = [p for p in model.parameters() if p.requires_grad] if model.training else []
    # the loss alone, then with a term on the logits, at trained-like weights (two sets of
    # gradients a side, each the size of the model: no more at V = 200k)
    for factor, term in ((1, 0.0), (trained_scale(model, idx), TERM_PROBE)):
        with scale_weights(model, factor), torch.set_grad_enabled(bool(params)):
            logits, loss = model(idx, targets)
            if term:  # a loss term on the logits makes them: the plain head's gradients
                loss = loss + term * logits.float().logsumexp(-1).pow(2).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
            outputs += [loss.detach(), tuple(g for g in grads if g is not None)]
    return outputs


def trained_scale(model, idx):
    """The power of two, up to 4, by which scale_weights brings the logits on idx (at
    initialisation ~1 at most; they grow as its square: the final norm's gain and the head) near
    TRAINED_LOGITS, as in a trained model, where attention is peaked: there an edit of the attention
    or of the logits shows, where flat attention and small logits hide it. No further: fp32's
    rounding of the logits grows with them."""
    with torch.no_grad():
        largest = model.next_logits(idx).abs().max().item()  # the last position's
    factor = 1
    while factor < 4 and largest * (2 * factor) ** 2 <= TRAINED_LOGITS:
        factor *= 2
    return factor


@contextlib.contextmanager
def scale_weights(model, factor):
    """Within: every parameter but LEV's times factor, a power of two, exact both ways. LEV's are
    left alone (its product of d_seed factors would overflow): lev_outputs widens LEV its way."""
    lev = set(map(id, model.tok_emb.parameters())) if model.config.embedding == "lev" else set()
    params = [p for p in model.parameters() if id(p) not in lev] if factor != 1 else []
    done = []  # undone exactly, even after an interruption halfway
    try:
        with torch.no_grad():
            for p in params:
                done.append(p.mul_(factor))
        yield
    finally:
        with torch.no_grad():
            for p in done:
                p.mul_(1 / factor)
