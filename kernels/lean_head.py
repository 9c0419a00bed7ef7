"""The memory-lean head: GPT.forward's loss a chunk of tokens at a time, without ever holding all
logits.

Tested equal to the plain head (F.cross_entropy of F.linear), values and gradients in float64
(tests/test_lean_head.py). For N tokens and a V-word vocabulary the plain head materialises N x V
logits, and autograd keeps them (and the log-softmax, and their gradient) alive: N x V x 4 bytes
each in fp32. linear_cross_entropy holds only chunk x V logits at once, with the same loss and
gradients. The idea of Cut Cross-Entropy and of Liger's fused linear cross-entropy. fast_paths.py
installs it as the model's GPT.fast_loss.
"""

import torch

CHUNK_MIB = 256  # default size of one chunk's fp32 logits; see default_chunk_size


def default_chunk_size(vocab_size, mib=CHUNK_MIB):
    """Tokens per chunk such that a chunk's fp32 logits take about `mib` MiB (at least 16 tokens):
    the head's scratch memory stays fixed whatever V is (256 MiB: 1,335 tokens at V = 50,257, 334 at
    V = 200,376). Chunks too thin make thin matmuls and run slower; docs/speed.md has the
    measurements."""
    return max(16, mib * 2**20 // (4 * vocab_size))


def autocast_dtype(x, weight):
    """The dtype the head's matmul runs in: autocast's (e.g. bf16) when it is on for this device, as
    F.linear would under autocast (float64 stays float64, as autocast leaves it), else the inputs'
    own dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (x.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but weight is {weight.dtype}; F.linear needs them equal "
                        f"(or autocast)")
    return x.dtype


class Buffers:
    """One chunk's scratch tensors, allocated once per pass and reused by every chunk: fresh
    chunk x V tensors for each chunk would each cost page faults (large allocations are mmap'ed
    afresh) and slow the loop down."""

    def __init__(self, chunk, weight, dtype, acc_dtype):
        V = weight.shape[0]
        # (V, D) the head in the matmul's dtype (no copy when it already is)
        self.w = weight.to(dtype)
        # (C, V) logits, then softmax, then dL/dlogits
        self.z = weight.new_empty(chunk, V, dtype=acc_dtype)
        # (C, V) bf16 copy
        self.low = weight.new_empty(chunk, V, dtype=dtype) if dtype != acc_dtype else None
        self.low_w = None  # (V, D) backward's bf16 product, made on first use

    def logits(self, x_c):
        """x_c: (n, D) -> (n, V) logits in acc_dtype: the matmul in the head's dtype (bf16 under
        autocast, rounded to bf16 like F.linear's output), widened to fp32 for the exp and the log
        (like `.float()`)."""
        n = len(x_c)
        if self.low is None:
            return torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.z[:n])
        torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.low[:n])
        return self.z[:n].copy_(self.low[:n])

    def accumulate(self, grad_w, g, x_c):
        """grad_w += g^T x_c in place, in fp32 even when g and x_c are bf16: a fresh (V, D) product
        per chunk would cost an allocation and its page faults each time, and summing chunks in bf16
        would lose bits."""
        if grad_w.dtype == g.dtype:
            grad_w.addmm_(g.t(), x_c)
            return
        if self.low_w is None:
            self.low_w = torch.empty_like(self.w)  # (V, D) in the matmul's dtype
        grad_w += torch.mm(g.t(), x_c, out=self.low_w)

    def low_precision(self, z):
        """(n, V) acc_dtype -> the same values in the matmul's dtype, for the two backward
        matmuls."""
        return z if self.low is None else self.low[:len(z)].copy_(z)


def chunk_forward(buf, x_c, safe_c, valid_c, z_loss):
    """One chunk's forward: x_c (n, D) -> lse (n,), loss (n,) (0 where not valid_c), and the softmax
    denominator (n, 1), leaving exp(z - max) in buf.z[:n]."""
    z = buf.logits(x_c)  # (n, V)
    target_logit = z.gather(1, safe_c[:, None]).squeeze(1)  # (n,)
    m = z.amax(dim=1, keepdim=True)  # (n, 1) subtracted before exp, so that exp cannot overflow
    denominator = z.sub_(m).exp_().sum(dim=1, keepdim=True)  # (n, 1)
    lse = (m + denominator.log()).squeeze(1)  # (n,)
    loss = lse - target_logit if z_loss == 0 else lse - target_logit + z_loss * lse.square()
    return lse, torch.where(valid_c, loss, 0.0), denominator


def chunk_backward(buf, probs, x_c, safe_c, scale_c, grad_x_c, grad_w, lse_c, z_loss):
    """One chunk's gradients from its softmax probs (n, V), overwritten:
    g = scale_c * ((1 + 2 z_loss lse_c) probs - onehot(target)), grad_x_c[:] = g W and
    grad_w += g^T x_c, each unless it is None. scale_c: (n, 1), 0 at ignored tokens."""
    if z_loss == 0:
        probs.scatter_add_(1, safe_c[:, None], -torch.ones_like(scale_c))  # - onehot(target)
    else:  # d(z_loss lse^2)/dz = 2 z_loss lse probs: g = scale_c f (probs - onehot / f), one pass
        f = 1 + 2 * z_loss * lse_c[:, None]  # (n, 1)
        probs.scatter_add_(1, safe_c[:, None], -1 / f)
        scale_c = scale_c * f
    g = buf.low_precision(probs.mul_(scale_c))  # (n, V) dL/dlogits, in the matmul's dtype
    if grad_x_c is not None:
        grad_x_c[:] = g @ buf.w  # (n, D)
    if grad_w is not None:
        buf.accumulate(grad_w, g, x_c)  # (V, D)


def new_grads(ctx, x, weight, acc_dtype):
    """dL/dx (N, D), filled chunk by chunk, and a zeroed dL/dW (V, D) that sums over the chunks (so
    in fp32 even for a bf16 weight); None for an input that needs no gradient."""
    grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
    need_w = ctx.needs_input_grad[1]
    grad_w = (torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, acc_dtype))
              if need_w else None)
    return grad_x, grad_w


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of the logits x @ W^T, token i with target t_i (0 where t_i ==
    ignore_index):

        z_i    = W x_i                          (V,)  logits, never all N rows at once
        lse_i  = log sum_v exp(z_iv)            the log-sum-exp, the only (N,) thing forward keeps
        loss_i = lse_i - z_{i,t_i} + c lse_i^2      (c: the z-loss's weight, 0 by default)
        dloss_i/dz_i = (1 + 2 c lse_i) softmax(z_i) - onehot(t_i),  softmax(z_i) = exp(z_i - lse_i)

    so with g_i = grad_i * dloss_i/dz_i (grad_i: the incoming gradient of
    loss_i): dL/dx_i = g_i W and dL/dW = sum_i g_i^T x_i. Forward saves x, W (both alive anyway),
    the targets and lse; backward recomputes z chunk by chunk. The exp, the log and g are in fp32
    (fp64 for fp64 inputs) even when the matmuls run in bf16 under autocast.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, dtype, z_loss):
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)  # (N,) any real id where ignored: gather needs one
        acc_dtype = torch.promote_types(dtype, torch.float32)
        lse, loss = (x.new_empty(len(x), dtype=acc_dtype) for _ in range(2))  # (N,), (N,)
        # dtypes handled explicitly in Buffers.logits
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(chunk, len(x)), weight, dtype, acc_dtype)
            for c in range(0, len(x), chunk):
                at = slice(c, c + chunk)
                lse[at], loss[at], _ = chunk_forward(buf, x[at], safe[at], valid[at], z_loss)
        ctx.save_for_backward(x, weight, safe, valid, lse)
        ctx.chunk, ctx.dtype, ctx.z_loss = chunk, dtype, z_loss
        return loss

    @staticmethod
    # backward is not itself differentiable: no double backward
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        x, weight, safe, valid, lse = ctx.saved_tensors
        # (N,) 0 at ignored tokens, even where grad_loss is inf or NaN (a "mean" over no token
        # divides by 0)
        scale = torch.where(valid, grad_loss, 0.0).to(lse.dtype)
        grad_x, grad_w = new_grads(ctx, x, weight, lse.dtype)  # (N, D), (V, D)
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(ctx.chunk, len(x)), weight, ctx.dtype, lse.dtype)
            for c in range(0, len(x), ctx.chunk):
                at = slice(c, c + ctx.chunk)
                x_c = x[at].to(ctx.dtype)  # (n, D)
                probs = buf.logits(x_c).sub_(lse[at, None]).exp_()  # (n, V) recomputed softmax
                chunk_backward(buf, probs, x_c, safe[at], scale[at, None],
                               None if grad_x is None else grad_x[at], grad_w, lse[at], ctx.z_loss)
        return (grad_x, None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None, None, None)


class LinearCrossEntropyEager(torch.autograd.Function):
    """The mean cross-entropy of x @ W^T with its gradients computed during forward,
    chunk by chunk, from the softmax forward has just made: no recomputation, so the head costs the
    same three matmuls as the usual one (logits, dL/dx, dL/dW), and the exp runs once instead of
    twice. Possible because the loss is a scalar: its incoming gradient only scales the saved dL/dx
    (N, D) and dL/dW (V, D). Formulas: as LinearCrossEntropy, with grad_i = 1 / (number of counted
    tokens).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, dtype, z_loss):
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)  # (N,)
        acc_dtype = torch.promote_types(dtype, torch.float32)
        count = valid.sum()  # a tensor, not a Python int: no device sync
        # (N, 1) 1 / count, or 0 at ignored tokens: gradients 0, not NaN, when every target is
        # ignored (as F.cross_entropy)
        scale = valid.to(acc_dtype)[:, None] / count.clamp(min=1)
        loss = x.new_empty(len(x), dtype=acc_dtype)  # (N,)
        grad_x, grad_w = new_grads(ctx, x, weight, acc_dtype)  # (N, D), (V, D)
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(chunk, len(x)), weight, dtype, acc_dtype)
            for c in range(0, len(x), chunk):
                at = slice(c, c + chunk)
                x_c = x[at].to(dtype)  # (n, D)
                lse, loss[at], denominator = chunk_forward(buf, x_c, safe[at], valid[at], z_loss)
                probs = buf.z[:len(x_c)].div_(denominator)  # (n, V) softmax, from exp(z - max)
                chunk_backward(buf, probs, x_c, safe[at], scale[at],
                               None if grad_x is None else grad_x[at], grad_w, lse, z_loss)
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        # 0 / 0 = NaN when every target is ignored
        return loss.sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        # in place: the saved gradients are used once (a second backward through this graph raises,
        # as usual)
        return (None if grad_x is None else grad_x.mul_(grad_loss),
                None if grad_w is None else grad_w.mul_(grad_loss),
                None, None, None, None, None)


# under a model-wide torch.compile it runs as it is (a graph break), like LEV: its chunk loop and
# reused buffers are the point, and they are not what inductor would make of it
@torch.compiler.disable
def linear_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1, reduction="mean",
                         z_loss=0.0):
    """Cross-entropy of the head's logits x @ weight^T against targets, without ever holding all the
    logits.

    x: (..., D) final hidden states, weight: (V, D) the head (tied to an embedding or not: gradients
    reach the Parameter through autograd as usual), targets: (...) ids, ignore_index where a token
    does not count. chunk_size: tokens per chunk (default: default_chunk_size(V), ~256 MiB of fp32
    logits). reduction: "mean" over counted tokens (NaN when none counts, as F.cross_entropy), or
    "none": per-token losses shaped like targets, 0 at ignored tokens. z_loss: the weight c of
    PaLM's z-loss, c * lse^2 added to each counted token's loss (lse: its logits' log-sum-exp, which
    the chunks compute anyway, so the term costs nothing more). The loss is fp32 (fp64 for
    fp64 inputs). Training's mean, with gradients wanted, computes them during forward as it goes
    (LinearCrossEntropyEager): three matmuls as the usual head, and forward keeps dL/dW (V x D).
    Otherwise forward keeps only the per-token log-sum-exp, and a backward recomputes the logits
    (LinearCrossEntropy): one more matmul.

    Same value and gradients as GPT.forward's plain head (F.cross_entropy(F.linear(x,
    weight).float(), targets, ignore_index=ignore_index, reduction=reduction) with z_loss 0),
    autocast included, with memory O(chunk_size x V) instead of O(N x V).
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction={reduction!r}: choose mean or none")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    x2, t1 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (N, D), (N,)
    dtype = autocast_dtype(x, weight)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction == "mean" and wants_grad:
        return LinearCrossEntropyEager.apply(x2, weight, t1, chunk, ignore_index, dtype, z_loss)
    per_token = LinearCrossEntropy.apply(x2, weight, t1, chunk, ignore_index, dtype, z_loss)
    if reduction == "none":
        return per_token.view(targets.shape)
    # 0 / 0 = NaN when every target is ignored
    return per_token.sum() / (targets != ignore_index).sum()


def refuse(*args, **kwargs):
    raise ValueError(MESSAGE)


class NoLogits:
    """What GPT.forward gives in place of the logits under the lean head, which never builds them
    all: any use raises one line that says what to do (a bare None would raise a traceback about
    NoneType, far from the cause). A method, an index, an operator, or a torch function
    (torch.softmax(logits, -1), F.cross_entropy(logits, y): __torch_function__ is torch's hook)."""

    __torch_function__ = classmethod(refuse)
    __getitem__ = __iter__ = __len__ = __bool__ = __float__ = __int__ = __array__ = refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = refuse
    __truediv__ = __rtruediv__ = __pow__ = __neg__ = __lt__ = __le__ = __gt__ = __ge__ = refuse

    def __getattr__(self, name):
        if name.startswith("_"):  # Python's and torch's own lookups
            raise AttributeError(name)
        raise ValueError(MESSAGE)

    def __repr__(self):
        return "NoLogits()"


MESSAGE = ("the lean head computes the loss without building the logits (training's default); for "
           "a z-loss pass z_loss= to the model (train.py's --z_loss), or train with "
           "--lean_head=False to get them (slower, more memory)")
NO_LOGITS = NoLogits()


def lean_loss(x, weight, targets, reduction="mean", z_loss=0.0):
    """GPT.fast_loss: (NO_LOGITS, linear_cross_entropy's loss)."""
    return NO_LOGITS, linear_cross_entropy(x, weight, targets, reduction=reduction, z_loss=z_loss)
