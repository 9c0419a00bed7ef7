"""LEV's fast path (LEV.fast_embed): the function of LEV's recipe in leviathan.py, fast enough to
train; tested equal to LEV.reference, values and gradients in float64 (tests/test_fast_lev.py).

For each distinct id LEV needs h * d_seed * r spline values (8 x 128 x 64 at the paper's sizes) and
their product, and autograd through the recipe keeps several such tensors per id. The fast path
reads only the 3 non-zero knots of each basis, multiplies 8 factors before each log, recomputes
everything in backward (SplineProduct), and runs its two kernels in C on CPUs (c_kernels.py), else
in chunks of ids through torch.compile in training, which fuses gather, spline, product and logs so
that the spline values never reach memory.
"""

import math
import warnings

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from kernels.c_kernels import C_TYPES, c_library, c_spline_product, c_spline_product_backward


class FastEmbedder:
    """LEV.fast_embed: (lev, ids (U,) distinct) -> (U, n_embd), LEV.embed_distinct's function with
    the spline product in SplineProduct. Its settings are a run's (speed and memory, not results):
    c_kernels (on CPU, lev_kernels.c where a C compiler built it), else torch's kernels, `chunk` ids
    at a time (64 suits a CPU's caches), in training through torch.compile if compile_kernels."""

    name = "LEV's fast path (kernels/fast_lev.py)"

    def __init__(self, chunk=64, c_kernels=True, compile_kernels=True):
        self.chunk, self.c_kernels, self.compile_kernels = chunk, c_kernels, compile_kernels
        self.padded_key, self.padded_of, self.S_padded = None, None, None

    def __call__(self, lev, ids):
        t = lev.unit_coords(lev.seed(ids))  # (U, h, d_seed)
        kernels = self.kernels(t, lev.spline)
        M = SplineProduct.apply(t, lev.spline, self.padded(lev.spline), self.chunk, kernels,
                                lev.normalize_basis)  # (U, h, r)
        return lev.mix_heads(M)

    def padded(self, S):
        """pad_knots(S), kept while S is unchanged: decoding embeds one id per call, and a fresh
        copy of S (4.7 MB at the paper's sizes) costs more than embedding that id."""
        if S.is_inference():  # made under torch.inference_mode: no version counter to follow
            return pad_knots(S)
        key = (S.data_ptr(), S._version, S.dtype)  # an in-place change of S bumps its _version
        if key != self.padded_key:
            with torch.no_grad():
                self.S_padded = pad_knots(S)
            # holding S's memory keeps any other tensor from taking its address (and the key)
            self.padded_key, self.padded_of = key, S.detach()
        return self.S_padded

    def kernels(self, t, spline):
        """Which kernels SplineProduct runs for coordinates t: "c" (lev_kernels.c: CPU, fp32 or
        fp64, where a C compiler built it), else torch's, "compiled" in training (which runs them
        every step) and "eager" otherwise (inference meets each id once)."""
        if (self.c_kernels and t.device.type == "cpu" and t.dtype in C_TYPES
                and spline.dtype == t.dtype and c_library() is not None):
            return "c"
        return "compiled" if self.compile_kernels and torch.is_grad_enabled() else "eager"


def pad_knots(S):
    """S (h, d, kappa, r) -> (h*d, kappa + 2, r), with a zero knot at each end: the layout that
    SplineProduct's kernels read, where knots j-1 and j+1 of any knot j exist."""
    h, d, n_knots, r = S.shape
    return F.pad(S, (0, 0, 1, 1)).view(h * d, n_knots + 2, r)


def bspline_weights3(t, n_knots, normalize):
    """leviathan.bspline_basis, keeping only its (at most) 3 non-zero knots: t (...) -> (j, w, dw),
    where knots j-1, j, j+1 (j = the nearest knot) carry weights w (..., 3) and derivatives dw/dt
    (..., 3). With s = t (n_knots - 1) and f = s - j in [-0.5, 0.5]:
        w = (0.5 (0.5 - f)^2, 0.75 - f^2, 0.5 (0.5 + f)^2).
    A knot -1 or n_knots gets weight 0 when normalize (it does not exist; else S's zero padding
    cancels it); normalize then divides by W = sum(w), so dw becomes (dw - w dW / W) / W."""
    s = t * (n_knots - 1)
    j = s.round()  # t must be finite (SplineProduct checks): a NaN would become a wild knot index
    f = s - j
    w = torch.stack([0.5 * (0.5 - f) ** 2, 0.75 - f * f, 0.5 * (0.5 + f) ** 2], dim=-1)
    dw = torch.stack([f - 0.5, -2.0 * f, 0.5 + f], dim=-1) * (n_knots - 1)
    if normalize:
        knot = j.unsqueeze(-1) + torch.arange(-1, 2, device=t.device)
        exists = (knot >= 0) & (knot <= n_knots - 1)
        w, dw = w * exists, dw * exists
        W, dW = w.sum(-1, keepdim=True), dw.sum(-1, keepdim=True)
        w = w / W
        dw = (dw - w * dW) / W
    return j.long(), w, dw


def spline_3knots(S_padded, j, w):
    """phi[i, u, :] = sum_m w[i, u, m] * S_padded[i, j[i, u] + m, :]: the spline of each of the h*d
    seed dimensions i at each of u points, from the 3 non-zero knots of its basis: S_padded
    (h*d, kappa + 2, r), j (h*d, u), w (h*d, u, 3) -> (h*d, u, r). Under torch.compile, indexing,
    which inductor fuses into whatever consumes phi (phi never reaches memory). Eagerly on CPU and
    CUDA, F.embedding_bag gathers and sums the 3 rows in one pass, where indexing makes 8 passes
    over phi; other devices (MPS gained embedding_bag only recently) index too."""
    if torch.compiler.is_compiling() or S_padded.device.type not in ("cpu", "cuda"):
        return spline_3knots_indexing(S_padded, j, w)
    hd, n_padded, r = S_padded.shape
    first_row = torch.arange(hd, device=j.device).unsqueeze(1) * n_padded  # of each i's knots
    rows = (first_row + j).unsqueeze(-1) + torch.arange(3, device=j.device)  # (h*d, u, 3)
    phi = F.embedding_bag(rows.reshape(-1, 3), S_padded.view(-1, r), mode="sum",
                          per_sample_weights=w.reshape(-1, 3))
    return phi.view(hd, -1, r)


def spline_3knots_indexing(S_padded, j, w):
    """spline_3knots as plain indexing (what inductor fuses)."""
    i = torch.arange(S_padded.shape[0], device=j.device).unsqueeze(1)
    return sum(w[..., m, None] * S_padded[i, j + m] for m in range(3))


def log_mode_chunk(t, S_padded, group, normalize):
    """Forward of SplineProduct for a chunk of u ids: t (u, h, d) -> sign, log|M| (u, h, r), and
    whether every partial product stayed in the normal range of t's dtype (if not, the caller redoes
    the chunk with group=1). The product over d multiplies groups of `group` factors and takes logs
    of those partial products (fp32 holds any product of 8 factors each in [1.9e-5, 6.5e4]); sign
    and log as leviathan.signed_log_product's, over the partial products."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, _ = bspline_weights3(t.reshape(u, h * d).T, n_padded - 2, normalize)
    phi = spline_3knots(S_padded, j, w).view(h, d // group, group, u, r)
    partial = phi.prod(2)  # (h, d / group, u, r)
    log_abs = partial.abs().log().sum(1)  # (h, u, r)
    sign = 1.0 - 2.0 * ((partial < 0).sum(1) % 2).to(partial.dtype)
    normal = log_abs.isfinite().all() & (partial.abs().amin() >= torch.finfo(t.dtype).tiny)
    return sign.transpose(0, 1), log_abs.transpose(0, 1), normal


def log_mode_chunk_backward(t, S_padded, G, normalize):
    """Backward of SplineProduct for a chunk of u ids, phi recomputed: t (u, h, d), G = dL/dM * M
    (u, h, r) -> dL/dt (u, h, d), dL/dS_padded (h*d, kappa + 2, r). With M = prod_d phi:
        dL/dphi[h, d, u, :] = G[u, h, :] / phi[h, d, u, :]
        dL/dt               = sum_r dL/dphi * dphi/dt,   dphi/dt = spline of the basis' derivatives
        dL/dS[h, d, k, :]   = sum_u w_k(t[u, h, d]) dL/dphi[h, d, u, :]
    A factor phi exactly 0 gives 0/0 = NaN here, as it does in autograd through the plain recipe."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, dw = bspline_weights3(t.reshape(u, h * d).T, n_padded - 2, normalize)  # (h*d, u, 3)
    phi = spline_3knots(S_padded, j, w).view(h, d, u, r)
    grad_phi = (G.transpose(0, 1).unsqueeze(1) / phi).view(h * d, u, r)
    grad_t = (grad_phi * spline_3knots(S_padded, j, dw)).sum(-1)  # (h*d, u)
    # dL/dS as one batched matmul, over a dense basis (h*d, kappa + 2, u) of the 3 weights of each t
    knots = j.unsqueeze(1) + torch.arange(3, device=t.device).view(3, 1)  # (h*d, 3, u)
    basis = torch.zeros(h * d, n_padded, u, dtype=t.dtype, device=t.device)
    basis.scatter_(1, knots, w.transpose(1, 2))
    return grad_t.T.reshape(u, h, d), torch.bmm(basis, grad_phi)


_compiled_kernels = {}  # kernel -> its torch.compile wrapper
_compile_failures = {}  # device type ("cpu", "cuda", ...) -> the error that made compiling fail


def run_kernel(kernel, *args, compile=True):
    """kernel(*args), through torch.compile when `compile` is set (the same sums:
    tests/test_compile.py). Where the compiled call fails but the eager one works (e.g. no C++
    compiler for inductor's CPU backend), warn once and run eagerly on that device type from then
    on. A kernel compiles once for a full chunk, once for any other number of ids (dynamic), and
    per dtype and device; past dynamo's recompile limit (8) it runs eagerly, with a log line."""
    device = args[0].device.type
    if not compile or device in _compile_failures:
        return kernel(*args)
    if kernel not in _compiled_kernels:
        _compiled_kernels[kernel] = torch.compile(kernel)
    try:
        return _compiled_kernels[kernel](*args)
    except torch.OutOfMemoryError:
        raise  # not a compile failure: a smaller lev_chunk or batch is the fix
    except Exception as error:
        result = kernel(*args)  # a genuine error raises again here, from the plain code
        _compile_failures[device] = error
        detail = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"LEV: torch.compile of its kernels failed on {device} "
                      f"({type(error).__name__}: {detail}); they run eagerly from now on, ~2.3x "
                      f"slower. --lev_compile=False skips the attempt.",
                      stacklevel=1)  # raised from inside autograd: no caller frame of the user's
        return result


class SplineProduct(torch.autograd.Function):
    """The heavy core of LEV: unit coordinates t (U, h, d) -> rank-1 separable modes M (U, h, r),

        phi[u, h, d, :] = sum_k w_k(t[u, h, d]) S[h, d, k, :]     (per-dimension spline, r outputs)
        M[u, h, :]      = prod_d phi[u, h, d, :]                   (sign and log|M| kept apart)

    with S_padded = pad_knots(S) given (FastEmbedder keeps it from call to call; the gradient goes
    to S). Forward keeps only t, S_padded and M; backward recomputes phi. kernels: "c" runs both
    passes in lev_kernels.c, which never holds phi; "compiled" and "eager" run log_mode_chunk and
    its backward (through torch.compile or not) on `chunk` ids at a time, so that phi stays small.
    In those the h*d seed dimensions come first, (h*d, u, r): each has its own S, so they are the
    batch axis of the gather and of the matmul for dL/dS.
    """

    @staticmethod
    def forward(ctx, t, S, S_padded, chunk, kernels, normalize):
        # Weights that diverged give non-finite coordinates: the modes are then NaN (so is the
        # loss, and train.py stops cleanly), not a NaN turned into a knot index far out of range.
        # Checked once here: a guard inside the kernels costs much of their time under compile.
        ctx.finite = bool(torch.isfinite(t).all())
        ctx.chunk, ctx.kernels, ctx.normalize = chunk, kernels, normalize
        if not ctx.finite:
            M = t.new_full((*t.shape[:2], S.shape[3]), float("nan"))  # (U, h, r)
        elif kernels == "c":
            M = c_spline_product(t, S_padded, normalize)
        else:
            M = t.new_empty(*t.shape[:2], S.shape[3])
            group = math.gcd(t.shape[2], 8)  # factors multiplied before each log
            for c in range(0, len(t), chunk):
                t_c = t[c:c + chunk]
                sign, log_abs, normal = run_kernel(log_mode_chunk, t_c, S_padded, group,
                                                   normalize, compile=kernels == "compiled")
                if not normal:  # rare: one log per factor instead
                    sign, log_abs, _ = log_mode_chunk(t_c, S_padded, 1, normalize)
                M[c:c + chunk] = sign * log_abs.exp()
        ctx.save_for_backward(t, S_padded, M)
        return M

    @staticmethod
    @once_differentiable  # the kernels are not themselves differentiated: no double backward
    def backward(ctx, grad_M):
        t, S_padded, M = ctx.saved_tensors
        (h, d), (n_padded, r) = t.shape[1:], S_padded.shape[1:]
        if not ctx.finite:
            nan_S = S_padded.new_full((h, d, n_padded - 2, r), float("nan"))
            return torch.full_like(t, float("nan")), nan_S, None, None, None, None
        with torch.autocast(t.device.type, enabled=False):  # fp32 like the forward
            G = grad_M * M  # dL/dM * M, shared by the d factors of a mode
            if ctx.kernels == "c":
                grad_t, grad_S = c_spline_product_backward(t, S_padded, G, ctx.normalize)
            else:
                grad_t, grad_S = torch.empty_like(t), torch.zeros_like(S_padded)
                for c in range(0, len(t), ctx.chunk):
                    at = slice(c, c + ctx.chunk)
                    grad_t[at], grad_S_c = run_kernel(log_mode_chunk_backward, t[at], S_padded,
                                                      G[at], ctx.normalize,
                                                      compile=ctx.kernels == "compiled")
                    grad_S += grad_S_c
        return grad_t, grad_S.view(h, d, n_padded, r)[:, :, 1:-1], None, None, None, None
