"""The memory-lean head (GPT.fast_logits): logits made only when they are used, and whose
cross-entropy is computed a chunk of tokens at a time, never holding all the logits; tested equal
to the plain head (F.cross_entropy of F.linear), values and gradients in float64
(tests/test_lean_head.py). For N tokens and a V-word vocabulary the plain head makes N x V logits,
and autograd keeps them, their log-softmax and their gradient alive; linear_cross_entropy holds
chunk x V logits at a time, with the same loss and gradients. The idea of Cut Cross-Entropy and of
Liger's fused linear cross-entropy.
"""

import inspect

import torch
import torch.nn.functional as F

CHUNK_MIB = 256  # default size of one chunk's fp32 logits; see default_chunk_size


def default_chunk_size(vocab_size):
    """Tokens per chunk such that a chunk's fp32 logits take about CHUNK_MIB MiB (at least 16
    tokens): the head's scratch memory stays fixed whatever V is (1,335 tokens at V = 50,257, 334 at
    V = 200,376). Thinner chunks make thinner matmuls, which run slower (docs/LOG.md,
    2026-11-30)."""
    return max(16, CHUNK_MIB * 2**20 // (4 * vocab_size))


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
        self.w = weight.to(dtype)  # (V, D) the head in the matmul's dtype (no copy when it is)
        self.z = weight.new_empty(chunk, V, dtype=acc_dtype)  # (C, V) logits, softmax, dL/dlogits
        self.low = weight.new_empty(chunk, V, dtype=dtype) if dtype != acc_dtype else None  # bf16
        self.low_w = None  # (V, D) backward's bf16 product, made on first use

    def logits(self, x_c):
        """x_c: (n, D) -> (n, V) logits in acc_dtype: the matmul in the head's dtype (bf16 under
        autocast, rounded as F.linear's output), widened for the exp and the log (as `.float()`)."""
        n = len(x_c)
        if self.low is None:
            return torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.z[:n])
        torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.low[:n])
        return self.z[:n].copy_(self.low[:n])

    def accumulate(self, grad_w, g, x_c):
        """grad_w += g^T x_c in place, in fp32 even for bf16 g and x_c: a fresh (V, D) product per
        chunk would cost page faults each time, and summing chunks in bf16 would lose bits."""
        if grad_w.dtype == g.dtype:
            grad_w.addmm_(g.t(), x_c)
            return
        if self.low_w is None:
            self.low_w = torch.empty_like(self.w)  # (V, D) in the matmul's dtype
        grad_w += torch.mm(g.t(), x_c, out=self.low_w)

    def low_precision(self, z):
        """(n, V) acc_dtype -> the same values in the matmul's dtype, for the backward matmuls."""
        return z if self.low is None else self.low[:len(z)].copy_(z)


def chunk_forward(buf, x_c, safe_c, valid_c):
    """One chunk's forward: x_c (n, D) -> lse (n,), loss (n,) (0 where not valid_c), and the softmax
    denominator (n, 1), leaving exp(z - max) in buf.z[:n]."""
    z = buf.logits(x_c)  # (n, V)
    target_logit = z.gather(1, safe_c[:, None]).squeeze(1)  # (n,)
    m = z.amax(dim=1, keepdim=True)  # (n, 1) subtracted before exp, so that exp cannot overflow
    denominator = z.sub_(m).exp_().sum(dim=1, keepdim=True)  # (n, 1)
    lse = (m + denominator.log()).squeeze(1)  # (n,)
    return lse, torch.where(valid_c, lse - target_logit, 0.0), denominator


def chunk_backward(buf, probs, x_c, safe_c, scale_c, grad_x_c, grad_w):
    """One chunk's gradients from its softmax probs (n, V), overwritten:
    g = scale_c * (probs - onehot(target)), grad_x_c[:] = g W and grad_w += g^T x_c, each unless it
    is None. scale_c: (n, 1), 0 at ignored tokens."""
    probs.scatter_add_(1, safe_c[:, None], -torch.ones_like(scale_c))  # - onehot(target)
    g = buf.low_precision(probs.mul_(scale_c))  # (n, V) dL/dlogits, in the matmul's dtype
    if grad_x_c is not None:
        grad_x_c[:] = g @ buf.w  # (n, D)
    if grad_w is not None:
        buf.accumulate(grad_w, g, x_c)  # (V, D)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of the logits x @ W^T, token i with target t_i (0 where t_i ==
    ignore_index):

        z_i    = W x_i                          (V,)  logits, never all N rows at once
        lse_i  = log sum_v exp(z_iv)            the log-sum-exp, the only (N,) thing kept
        loss_i = lse_i - z_{i,t_i}
        dloss_i/dz_i = softmax(z_i) - onehot(t_i),  softmax(z_i) = exp(z_i - lse_i)

    so with g_i = grad_i * dloss_i/dz_i (grad_i: the incoming gradient of loss_i): dL/dx_i = g_i W
    and dL/dW = sum_i g_i^T x_i. The exp, the log and g are in fp32 (fp64 for fp64 inputs) even
    when the matmuls run in bf16 under autocast. Two ways to the gradients:
      mean=False: forward returns the per-token losses and saves x, W, the targets and lse;
                  backward recomputes z chunk by chunk (one more matmul);
      mean=True:  forward returns the mean over the counted tokens and computes the gradients as it
                  goes, from the softmax it has just made (grad_i = 1 / count: the loss is a
                  scalar, so the incoming gradient only scales them): the usual head's three
                  matmuls, one exp; backward scales the saved dL/dx (N, D) and dL/dW (V, D).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, dtype, mean):
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)  # (N,) any real id where ignored: gather needs one
        acc_dtype = torch.promote_types(dtype, torch.float32)
        lse, loss = (x.new_empty(len(x), dtype=acc_dtype) for _ in range(2))  # (N,), (N,)
        count = valid.sum()  # a tensor, not a Python int: no device sync
        # (N, 1) 1 / count, 0 at ignored tokens: gradients 0, not NaN, when every target is ignored
        scale = valid.to(acc_dtype)[:, None] / count.clamp(min=1)
        # dL/dx (N, D) filled chunk by chunk, dL/dW (V, D) summed over the chunks (in fp32 even for
        # a bf16 weight); None for an input that needs none, and for mean=False
        grad_x = torch.empty_like(x) if mean and ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, acc_dtype))
                  if mean and ctx.needs_input_grad[1] else None)
        with torch.autocast(x.device.type, enabled=False):  # dtypes handled in Buffers.logits
            buf = Buffers(min(chunk, len(x)), weight, dtype, acc_dtype)
            for c in range(0, len(x), chunk):
                at = slice(c, c + chunk)
                x_c = x[at].to(dtype)  # (n, D)
                lse[at], loss[at], denominator = chunk_forward(buf, x_c, safe[at], valid[at])
                if mean:
                    probs = buf.z[:len(x_c)].div_(denominator)  # (n, V) softmax, from exp(z - max)
                    chunk_backward(buf, probs, x_c, safe[at], scale[at],
                                   None if grad_x is None else grad_x[at], grad_w)
        ctx.chunk, ctx.dtype, ctx.mean, ctx.scaled_by = chunk, dtype, mean, None
        if mean:
            ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
            return loss.sum() / count  # 0 / 0 = NaN when every target is ignored
        ctx.save_for_backward(x, weight, safe, valid, lse)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not itself differentiable
    def backward(ctx, grad_loss):
        if ctx.mean:
            saved = ctx.saved_tensors
            if ctx.scaled_by is None:  # the first backward scales them in place: no second (V, D)
                ctx.scaled_by = grad_loss  # tensor. Through .data, which the saved tensors'
                for g in saved:            # version check does not see: a later backward
                    if g is not None:      # (retain_graph) knows the factor and scales anew
                        g.data.mul_(grad_loss)
                return (*saved, None, None, None, None, None)
            if (ctx.scaled_by == 0).item():  # (a second backward only: a sync then is no cost)
                raise RuntimeError("the lean loss's first backward had a zero gradient, which "
                                   "left nothing to scale for a second; train with "
                                   "--lean_head=False to backward through it twice")
            factor = grad_loss / ctx.scaled_by
            return (*(None if g is None else g * factor for g in saved), None, None, None, None,
                    None)
        x, weight, safe, valid, lse = ctx.saved_tensors
        # (N,) 0 at ignored tokens, even where grad_loss is inf or NaN
        scale = torch.where(valid, grad_loss, 0.0).to(lse.dtype)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, lse.dtype))
                  if ctx.needs_input_grad[1] else None)
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(ctx.chunk, len(x)), weight, ctx.dtype, lse.dtype)
            for c in range(0, len(x), ctx.chunk):
                at = slice(c, c + ctx.chunk)
                x_c = x[at].to(ctx.dtype)  # (n, D)
                probs = buf.logits(x_c).sub_(lse[at, None]).exp_()  # (n, V) recomputed softmax
                chunk_backward(buf, probs, x_c, safe[at], scale[at, None],
                               None if grad_x is None else grad_x[at], grad_w)
        return (grad_x, None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None, None, None)


# under a model-wide torch.compile it runs as it is (a graph break), like LEV: its chunk loop and
# reused buffers are the point, and they are not what inductor would make of it
@torch.compiler.disable
def linear_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1, reduction="mean"):
    """Cross-entropy of the head's logits x @ weight^T against targets, never holding all of them.

    x: (..., D) final hidden states, weight: (V, D) the head (tied to an embedding or not: gradients
    reach the Parameter through autograd as usual), targets: (...) ids, ignore_index where a token
    does not count. chunk_size: tokens per chunk (default: default_chunk_size(V)). reduction:
    "mean" over counted tokens (NaN when none counts, as F.cross_entropy), or "none": per-token
    losses shaped like targets, 0 at ignored tokens. The loss is fp32 (fp64 for fp64 inputs): the
    plain head's value and gradients, F.cross_entropy(F.linear(x, weight), targets, ...), autocast
    included, in O(chunk_size x V) memory instead of O(N x V).
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction={reduction!r}: choose mean or none")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    x2, t1 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (N, D), (N,)
    dtype = autocast_dtype(x, weight)
    mean = (reduction == "mean" and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad))
    loss = LinearCrossEntropy.apply(x2, weight, t1, chunk, ignore_index, dtype, mean)
    if mean or reduction == "none":
        return loss if mean else loss.view(targets.shape)
    return loss.sum() / (targets != ignore_index).sum()  # 0 / 0 = NaN when every target is ignored


class LazyLogits:
    """GPT.fast_logits: the logits x @ W^T (..., V), made only when their values are used.

    F.cross_entropy of them, (N, V) against class ids (N,), is linear_cross_entropy: the same loss
    and gradients without ever holding all the logits. What is known without them is answered
    without making them: shape, size(), dtype, device, ndim, dim(), numel(), len(), requires_grad,
    and views that keep the last dimension V (view, reshape, flatten), which stay lazy. Any other
    use (an operator, an index, an item assignment, a method, a torch function, torch.save) makes
    them first, once for all the views of one forward's logits, as the plain head does: F.linear(x,
    W) under the autocast and grad mode of the forward that returned them; the loss then reads
    that tensor, edits included. The first time in a process that training makes them (a loss
    term, an argmax, a print), notice (install_fast_paths' say) gets one line on what it costs.
    Made after the head's weight or the hidden states changed in place (an optimizer.step()), they
    would not be the plain head's: that raises instead. Not a torch.Tensor: isinstance(logits,
    torch.Tensor) is False (docs/model.md says why); logits.tensor() is one."""

    said = False  # the memory notice, once per process

    def __init__(self, x, weight, autocast=None, grad=None, root=None, notice=None):
        self.x, self.weight = x, weight  # (..., D), (V, D)
        self.shape = torch.Size((*x.shape[:-1], weight.shape[0]))
        device = x.device.type
        self.autocast = autocast or (device, torch.get_autocast_dtype(device),
                                     torch.is_autocast_enabled(device))
        self.grad = torch.is_grad_enabled() if grad is None else grad
        self.base = root  # the forward's logits, of which this is a view; None: these are
        self.made_tensor, self.versions, self.notice = None, versions(x, weight), notice

    @property
    def root(self):  # (not stored as self: a reference cycle would keep made logits past the step)
        return self if self.base is None else self.base

    @property
    def made(self):
        """The logits as made (a tensor of the root's shape), or None while they are lazy."""
        return self.root.made_tensor

    def tensor(self):
        """The logits as a tensor, made on first use (in the forward's grad mode)."""
        root = self.root
        if root.made_tensor is None:
            root.check_unchanged()
            with root.forwards_autocast(), torch.set_grad_enabled(root.grad):
                root.made_tensor = F.linear(root.x, root.weight)
            if root.notice and root.made_tensor.requires_grad and not LazyLogits.said:
                LazyLogits.said = True
                mib = root.made_tensor.numel() * root.made_tensor.element_size() / 2**20
                root.notice(f"note: the lean head's logits were made in full ({tuple(root.shape)}, "
                            f"{mib:,.1f} MiB a step, plus autograd's copies); a loss term through "
                            f"F.cross_entropy of them stays lean, or train with --lean_head=False "
                            f"where memory is no issue")
        made = root.made_tensor
        return made if self is root else made.view(self.shape)

    def check_unchanged(self):
        """Lazy logits made from what changed in place since the forward would not be the plain
        head's: raise instead."""
        if versions(self.root.x, self.root.weight) != self.root.versions:
            raise RuntimeError("the lazy logits' head weight or hidden states changed in place "
                               "since the forward (an optimizer.step()?): use the logits before "
                               "it, run the forward again, or train with --lean_head=False")

    def forwards_autocast(self):
        """The autocast of the forward that returned the logits, for the matmul made now."""
        device, dtype, enabled = self.autocast
        return torch.autocast(device, dtype, enabled=enabled)

    # what is known without the logits
    @property
    def dtype(self):
        _, dtype, enabled = self.autocast
        return (dtype if enabled and torch.float64 not in (self.x.dtype, self.weight.dtype)
                else self.x.dtype)

    @property
    def device(self):
        return self.x.device

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def requires_grad(self):
        return self.grad and (self.x.requires_grad or self.weight.requires_grad)

    def dim(self):
        return len(self.shape)

    def numel(self):
        return self.shape.numel()

    def __len__(self):
        return self.shape[0]

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def view(self, *shape, how="view"):
        """Still lazy where the last dimension stays V (e.g. view(-1, V)); else made."""
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if self.made is not None or not shape or shape[-1] != self.shape[-1]:
            return getattr(self.tensor(), how)(*shape)
        x = getattr(self.x, how)(*shape[:-1], self.x.shape[-1])
        return LazyLogits(x, self.weight, self.autocast, self.grad, self.root, self.notice)

    def reshape(self, *shape):
        return self.view(*shape, how="reshape")

    def flatten(self, start_dim=0, end_dim=-1):
        end = end_dim % max(1, self.ndim)
        if self.made is not None or end == self.ndim - 1:
            return self.tensor().flatten(start_dim, end_dim)
        return self.reshape(self.x.flatten(start_dim, end).shape[:-1] + self.shape[-1:])

    def cross_entropy(self, target, ignore_index=-100, reduction="mean"):
        if self.made is not None:  # made: the loss of that tensor, edits included
            return F.cross_entropy(self.tensor(), target, ignore_index=ignore_index,
                                   reduction=reduction)
        self.check_unchanged()
        with self.forwards_autocast():
            return linear_cross_entropy(self.x, self.weight, target, ignore_index=ignore_index,
                                        reduction=reduction)

    def __reduce_ex__(self, protocol):  # torch.save, pickle, copy: the tensor
        return self.tensor().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.cross_entropy:  # (N, V) logits, (N,) class ids, no weight nor smoothing
            call = CROSS_ENTROPY.bind(*args, **(kwargs or {}))
            call.apply_defaults()
            a = call.arguments
            logits, target = a["input"], a["target"]
            if (type(logits) is cls and len(logits.shape) == 2 and isinstance(target, torch.Tensor)
                    and not target.is_floating_point() and target.shape == logits.shape[:1]
                    and a["weight"] is None and a["size_average"] is None and a["reduce"] is None
                    and a["label_smoothing"] == 0 and a["reduction"] in ("mean", "none")):
                return logits.cross_entropy(target, a["ignore_index"], a["reduction"])
        return func(*made(args), **made(kwargs or {}))

    def __getattr__(self, name):  # any other tensor method or attribute: on the logits, made
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tensor(), name)


CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def versions(*tensors):
    """The tensors' version counters (an in-place change bumps one); inference tensors: None."""
    return tuple(None if t.is_inference() else t._version for t in tensors)


def made(value):
    """value with the logits made wherever it holds a LazyLogits (also in a list, tuple or dict)."""
    if type(value) is LazyLogits:
        return value.tensor()
    if isinstance(value, (list, tuple)):
        return type(value)(made(v) for v in value)
    if isinstance(value, dict):
        return {k: made(v) for k, v in value.items()}
    return value


def made_first(name):
    def method(self, *args):
        return getattr(self.tensor(), name)(*args)
    return method


# Python looks operators up on the class, not through __getattr__: each of torch.Tensor's makes
# the logits first (an in-place one, e.g. +=, then changes them, and the name holds the tensor)
_BINARY = ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
           "lshift", "rshift")
for _name in ([f"__{kind}{op}__" for op in _BINARY for kind in ("", "r", "i")]
              + ["__neg__", "__pos__", "__abs__", "__invert__", "__lt__", "__le__", "__gt__",
                 "__ge__", "__eq__", "__ne__", "__getitem__", "__setitem__", "__iter__",
                 "__bool__", "__float__", "__int__", "__index__", "__complex__", "__array__",
                 "__contains__", "__repr__", "__format__"]):
    if hasattr(torch.Tensor, _name):
        setattr(LazyLogits, _name, made_first(_name))
