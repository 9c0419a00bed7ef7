"""
Leviathan: a language model whose input embedding is a small continuous function of the token index.

Batley & Saha, "Leviathan: Decoupling Input and Output Representations in Language Models",
arXiv 2601.22040. A standard model uses one V x n_embd table twice, as the input embedding and (tied) as the
output head. Leviathan keeps a full, untied V x n_embd head and replaces the input table with LEV (learned
embedding vectorization), whose size barely depends on V.

The file reads top to bottom:
  1. LEV, the input embedding (with its plain reference recipe and the fast path that training uses);
  2. the backbone: a decoder-only LLaMA-style Transformer (RMSNorm, rotary positions, SwiGLU, no biases);
  3. GPT, the model: one backbone, three input/output arms chosen by Config.embedding:
       "lev"    LEV input + untied V x n_embd head   (Leviathan)
       "tied"   one table, shared by input and head  (the usual baseline)
       "untied" a table and a separate head          (separates the effect of untying from that of LEV)
"""

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

EMBEDDINGS = ("lev", "tied", "untied")


@dataclass
class Config:
    vocab_size: int = 50257  # V: GPT-2 BPE
    block_size: int = 256  # longest context the model sees
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    embedding: str = "lev"  # one of EMBEDDINGS
    # LEV (defaults are the paper's)
    n_digits: int = 3  # k: a token id becomes k digits in base b = ceil(V ** (1/k))
    d_seed: int = 128  # width of the seed vector z and of each head's spline coordinates
    n_lev_heads: int = 8  # h: independent separable modes, summed
    n_knots: int = 16  # kappa: evenly spaced knots of the quadratic B-spline on [0, 1]
    lev_rank: int = 64  # r: outputs of each per-dimension spline, i.e. length of a mode vector
    lev_chunk: int = 64  # ids LEV's fast path computes together (memory and speed, not results); tuned on CPU
    lev_compile: bool = True  # in training, torch.compile LEV's two kernels (eager where that fails; same result)

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"Config: {msg}")

        need(self.embedding in EMBEDDINGS, f"embedding={self.embedding!r}; choose one of {', '.join(EMBEDDINGS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_digits", "d_seed",
                     "n_lev_heads", "n_knots", "lev_rank", "lev_chunk"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"{name}={getattr(self, name)!r} must be a positive integer")
        need(isinstance(self.lev_compile, bool), f"lev_compile={self.lev_compile!r} must be True or False")
        need(self.vocab_size >= 2, f"vocab_size={self.vocab_size} must be at least 2")
        need(self.n_knots >= 3, f"n_knots={self.n_knots} must be at least 3 (a quadratic spline spans 3 knots)")
        need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        need((self.n_embd // self.n_head) % 2 == 0,
             f"head size n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        need(0.0 <= self.dropout < 1.0, f"dropout={self.dropout} must be in [0, 1)")


# ----------------------------------------------------------------------------------------------------------
# 1. LEV: token index -> embedding, as a compact continuous function


def check_ids(lo, hi, vocab_size):
    """Raise a ValueError naming the first id outside [0, V), given the smallest and largest ids of a batch."""
    for i in (int(lo), int(hi)):
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size}); "
                             f"was the data tokenized with another tokenizer than this model's?")


def digit_base(vocab_size, n_digits):
    """The smallest integer b with b ** n_digits >= vocab_size, i.e. ceil(V ** (1/k)), in exact integers
    (float pow can land on the wrong side, e.g. 125 ** (1/3) = 4.999...)."""
    b = max(2, round(vocab_size ** (1.0 / n_digits)))
    while b ** n_digits < vocab_size:
        b += 1
    while b > 2 and (b - 1) ** n_digits >= vocab_size:
        b -= 1
    return b


def lev_param_count(vocab_size, n_embd, n_digits=3, d_seed=128, n_lev_heads=8, n_knots=16, lev_rank=64):
    """k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*n_knots*rank + rank*n_embd): codebooks, then per head the
    seed map, its LayerNorm, the spline coefficients and the output map. 2,252,928 for V=200,376, n_embd=2048."""
    b = digit_base(vocab_size, n_digits)
    per_head = d_seed * d_seed + 2 * d_seed + d_seed * n_knots * lev_rank + lev_rank * n_embd
    return n_digits * b * d_seed + n_lev_heads * per_head


def bspline_basis(t, n_knots, derivative=False):
    """Quadratic B-spline basis on n_knots evenly spaced knots g_j = j / (n_knots - 1) of [0, 1].

    t: (...,) in [0, 1] -> w: (..., n_knots), with delta = |t - g_j| * (n_knots - 1):
        w = 0.75 - delta^2          for delta < 0.5
        w = 0.5 * (1.5 - delta)^2   for 0.5 <= delta < 1.5
        w = 0                       otherwise   (so at most 3 knots are non-zero)
    With derivative=True also returns dw/dt, same shape.
    """
    knots = torch.linspace(0, 1, n_knots, device=t.device, dtype=t.dtype)
    signed = (t.unsqueeze(-1) - knots) * (n_knots - 1)  # (..., n_knots)
    delta = signed.abs()
    inner, outer = delta < 0.5, (delta >= 0.5) & (delta < 1.5)
    w = torch.where(inner, 0.75 - delta ** 2, torch.where(outer, 0.5 * (1.5 - delta) ** 2, 0.0))
    if not derivative:
        return w
    # d delta / dt = sign(signed) * (n_knots - 1)
    dw = torch.where(inner, -2.0 * signed, torch.where(outer, -(1.5 - delta) * signed.sign(), 0.0))
    return w, dw * (n_knots - 1)


def signed_log_product(phi, dim):
    """prod(phi, dim) as (sign, log|prod|): a product of 128 factors near 1 over- or underflows in plain
    floating point, its log does not. The sign is the parity of the negative factors."""
    log_abs = phi.abs().log().sum(dim)
    sign = 1.0 - 2.0 * ((phi < 0).sum(dim) % 2).to(phi.dtype)
    return sign, log_abs


def bspline_basis3(t, n_knots):
    """The same basis, keeping only its (at most) 3 non-zero knots: t (...) -> (j, w, dw), where knots
    j-1, j, j+1 (j = the nearest knot) carry weights w (..., 3) and derivatives dw/dt (..., 3). With
    s = t * (n_knots - 1) and f = s - j in [-0.5, 0.5]:  w = (0.5 (0.5 - f)^2, 0.75 - f^2, 0.5 (0.5 + f)^2)."""
    s = t * (n_knots - 1)
    j = s.round()
    f = s - j
    w = torch.stack([0.5 * (0.5 - f) ** 2, 0.75 - f * f, 0.5 * (0.5 + f) ** 2], dim=-1)
    dw = torch.stack([f - 0.5, -2.0 * f, 0.5 + f], dim=-1) * (n_knots - 1)
    return j.long(), w, dw


def spline_3knots(S_padded, j, w):
    """phi[i, u, :] = sum_m w[i, u, m] * S_padded[i, j[i, u] + m, :]: the spline of each of the h*d seed
    dimensions i at each of u points, from only the 3 non-zero knots of its basis (bspline_basis3).

    S_padded: (h*d, n_knots + 2, r), S with a zero knot at each end; j: (h*d, u); w: (h*d, u, 3) -> (h*d, u, r).
    Under torch.compile the gather is written as indexing, which inductor fuses into whatever consumes phi, so
    phi never reaches memory. Eagerly on CPU and CUDA, F.embedding_bag gathers and sums the 3 rows in one pass
    (instead of 3 gathers, 3 multiplies and 2 adds, each a pass over phi); other devices (e.g. MPS, which gained
    embedding_bag only in recent PyTorch) take the indexing too.
    """
    hd, n_padded, r = S_padded.shape
    if torch.compiler.is_compiling() or S_padded.device.type not in ("cpu", "cuda"):
        i = torch.arange(hd, device=j.device).unsqueeze(1)
        return sum(w[..., m, None] * S_padded[i, j + m] for m in range(3))
    first_row = torch.arange(hd, device=j.device).unsqueeze(1) * n_padded  # of each i, in S_padded.view(-1, r)
    rows = (first_row + j).unsqueeze(-1) + torch.arange(3, device=j.device)  # (h*d, u, 3)
    phi = F.embedding_bag(rows.reshape(-1, 3), S_padded.view(-1, r), mode="sum",
                          per_sample_weights=w.reshape(-1, 3))
    return phi.view(hd, -1, r)


def log_mode_chunk(t, S_padded, group):
    """Forward of SplineProduct for a chunk of u ids: t (u, h, d) -> sign, log|M| (u, h, r), and whether every
    partial product stayed in the normal range of t's dtype (if not, the caller redoes the chunk with group=1).

    The product over d multiplies groups of `group` factors directly and takes logs of those partial products,
    8x fewer logs than one per factor for group=8; fp32 holds any product of 8 factors each in [1.9e-5, 6.5e4]."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, _ = bspline_basis3(t.reshape(u, h * d).T, n_padded - 2)  # (h*d, u), (h*d, u, 3)
    phi = spline_3knots(S_padded, j, w).view(h, d // group, group, u, r)
    partial = phi.prod(2)  # (h, d / group, u, r)
    sign, log_abs = signed_log_product(partial, dim=1)  # (h, u, r)
    normal = log_abs.isfinite().all() & (partial.abs().amin() >= torch.finfo(t.dtype).tiny)
    return sign.transpose(0, 1), log_abs.transpose(0, 1), normal


def log_mode_chunk_backward(t, S_padded, G):
    """Backward of SplineProduct for a chunk of u ids, phi recomputed: t (u, h, d), G = dL/dM * M (u, h, r)
    -> dL/dt (u, h, d), dL/dS_padded (h*d, n_knots + 2, r). With M = prod_d phi:
        dL/dphi[h, d, u, :] = G[u, h, :] / phi[h, d, u, :]
        dL/dt               = sum_r dL/dphi * dphi/dt,   dphi/dt = the spline with the basis' derivatives
        dL/dS[h, d, k, :]   = sum_u w_k(t[u, h, d]) dL/dphi[h, d, u, :]
    A factor phi exactly 0 gives 0/0 = NaN here, as it does in autograd through the plain recipe."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, dw = bspline_basis3(t.reshape(u, h * d).T, n_padded - 2)  # (h*d, u), (h*d, u, 3) x2
    phi = spline_3knots(S_padded, j, w).view(h, d, u, r)
    grad_phi = (G.transpose(0, 1).unsqueeze(1) / phi).view(h * d, u, r)
    grad_t = (grad_phi * spline_3knots(S_padded, j, dw)).sum(-1)  # (h*d, u)
    # dL/dS as one batched matmul, over a dense basis (h*d, n_knots + 2, u) holding the 3 weights of each t
    knots = j.unsqueeze(1) + torch.arange(3, device=t.device).view(3, 1)  # (h*d, 3, u)
    basis = torch.zeros(h * d, n_padded, u, dtype=t.dtype, device=t.device).scatter_(1, knots, w.transpose(1, 2))
    return grad_t.T.reshape(u, h, d), torch.bmm(basis, grad_phi)


def first_line(error):
    """The first line of an exception's message ('' if none): enough for a one-line report."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


_compiled_kernels = {}  # kernel -> its torch.compile wrapper
_compile_failures = {}  # device type ("cpu", "cuda", ...) -> the error that made compiling fail there


def run_kernel(kernel, *args, compile=True):
    """kernel(*args), through torch.compile when `compile` is set. Compiling fuses the gather, the spline, the
    product and the logs into a few loops, ~2.3x faster than eager on CPU (README, "Speed"). Where the compiled
    call fails but the eager one works (e.g. no C++ compiler for inductor's CPU backend), warn once and run
    eagerly on that device type from then on. Both compute the same sums (tests/test_compile.py).

    Each kernel compiles once for a full chunk, once more for any other number of ids (dynamic) and again per
    dtype and device; past dynamo's recompile limit (8) it would run eagerly, with a log line, not a warning."""
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
        warnings.warn(f"LEV: torch.compile of its kernels failed on {device} ({type(error).__name__}: "
                      f"{first_line(error)[:200]}); "
                      f"they run eagerly from now on, ~2.3x slower. lev_compile=False skips the attempt.",
                      stacklevel=1)  # raised from inside autograd: no caller frame of the user's to point at
        return result


class SplineProduct(torch.autograd.Function):
    """The heavy core of LEV: unit coordinates t -> rank-1 separable modes M, recomputed in backward.

        phi[u, h, d, :] = sum_k w_k(t[u, h, d]) S[h, d, k, :]     (per-dimension spline, r outputs)
        M[u, h, :]      = prod_d phi[u, h, d, :]                   (sign and log|M| kept apart)

    Autograd would keep several (U, h, d_seed, rank) tensors: 8 x 128 x 64 floats = 256 KiB per id, ~12 GB for
    8,192 ids. Here forward keeps only t, S (padded) and M; both passes walk the ids `chunk` at a time (log_mode_chunk
    and log_mode_chunk_backward), so that phi stays small, and backward recomputes it. Only 3 knots of each
    basis are non-zero, and S is padded with a zero knot at each end so that knots j-1 and j+1 always exist.
    Inside the kernels the h*d seed dimensions come first, (h*d, u, r): each has its own S, so they are the
    batch axis of the gather and of the matmul for dL/dS.
    """

    @staticmethod
    def forward(ctx, t, S, chunk, compile):
        U, h, d = t.shape
        n_knots, r = S.shape[2:]
        S_padded = F.pad(S, (0, 0, 1, 1)).view(h * d, n_knots + 2, r)
        M = t.new_empty(U, h, r)
        for c in range(0, U, chunk):
            t_chunk = t[c:c + chunk]
            sign, log_abs, normal = run_kernel(log_mode_chunk, t_chunk, S_padded, math.gcd(d, 8), compile=compile)
            if not normal:  # rare: one log per factor instead
                sign, log_abs, _ = log_mode_chunk(t_chunk, S_padded, 1)
            M[c:c + chunk] = sign * log_abs.exp()
        ctx.save_for_backward(t, S_padded, M)
        ctx.chunk, ctx.compile = chunk, compile
        return M

    @staticmethod
    @once_differentiable  # the kernels are not themselves differentiated: no double backward
    def backward(ctx, grad_M):
        t, S_padded, M = ctx.saved_tensors
        h, d = t.shape[1:]
        n_padded, r = S_padded.shape[1:]
        with torch.autocast(t.device.type, enabled=False):  # fp32 like the forward, even if called under autocast
            G = grad_M * M  # dL/dM * M, shared by the d factors of a mode
            grad_t, grad_S = torch.empty_like(t), torch.zeros_like(S_padded)
            for c in range(0, len(t), ctx.chunk):
                at = slice(c, c + ctx.chunk)
                grad_t[at], grad_S_chunk = run_kernel(log_mode_chunk_backward, t[at], S_padded, G[at],
                                                      compile=ctx.compile)
                grad_S += grad_S_chunk
        return grad_t, grad_S.view(h, d, n_padded, r)[:, :, 1:-1], None, None


class LEV(nn.Module):
    """Learned embedding vectorization: token id -> n_embd vector, with O(sqrt[k](V)) parameters.

        digits:  id = sum_r digit_r * b^(k-1-r),  b = ceil(V^(1/k)), most significant digit first
        seed:    z = sum_r C[r, digit_r]                                   C: (k, b, d_seed)
        per head (h heads, independent parameters):
          x = W_seed z;  t = sigmoid(LayerNorm(x) / 2)  in [0, 1]^d_seed   W_seed: (d_seed, d_seed)
          phi[d, :] = sum_j w_j(t[d]) S[d, j, :]  (quadratic B-spline)    S: (d_seed, n_knots, rank)
          M = prod_d phi[d, :]        (a rank-1 separable mode, length rank)
        E = sum_heads M @ W_out                                            W_out: (rank, n_embd)

    Parameters: k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*n_knots*rank + rank*n_embd) (lev_param_count).

    forward() is the fast path: each distinct id of the batch is computed once, the spline product runs in
    chunks, from the 3 non-zero knots of each basis, and is recomputed in backward (SplineProduct); in training
    its two kernels run through torch.compile (lev_compile); with gradients off each id's embedding is cached
    on first use. reference() is the plain recipe, kept as the specification the fast path is tested against.
    """

    def __init__(self, vocab_size, n_embd, n_digits=3, d_seed=128, n_lev_heads=8, n_knots=16, lev_rank=64,
                 lev_chunk=64, lev_compile=True):
        super().__init__()
        self.vocab_size, self.n_embd, self.n_knots, self.chunk = vocab_size, n_embd, n_knots, lev_chunk
        self.compile = lev_compile  # with gradients on, run SplineProduct's kernels through torch.compile
        self.base = digit_base(vocab_size, n_digits)
        self.register_buffer("place", self.base ** torch.arange(n_digits - 1, -1, -1), persistent=False)
        h, d = n_lev_heads, d_seed
        self.codebooks = nn.Parameter(torch.randn(n_digits, self.base, d) * 0.02)  # C
        # x = W_seed z: std 1/sqrt(d) keeps x at z's scale, well above LayerNorm's eps
        self.seed_proj = nn.Parameter(torch.randn(h, d, d) / math.sqrt(d))  # W_seed, per head
        self.ln_weight = nn.Parameter(torch.ones(h, d))
        self.ln_bias = nn.Parameter(torch.zeros(h, d))
        # near 1, so that the 128-factor product starts near 1 rather than at 0 or infinity
        self.spline = nn.Parameter(1.0 + 0.1 * torch.randn(h, d, n_knots, lev_rank))  # S
        self.out_proj = nn.Parameter(torch.randn(h, lev_rank, n_embd) * 0.02 / math.sqrt(h))  # W_out
        self.use_cache = True  # with gradients off, remember each id's embedding (False: always recompute)
        self._cache_slot = None  # (V,) row of each id in _cache_rows, -1 when not cached
        self._cache_rows = None  # (n_cached, n_embd)
        self._cache_key = None  # the parameters' identity and versions when the cache was filled

    # -- the recipe, step by step (shared by both paths) --

    def digits(self, idx):
        return torch.div(idx.unsqueeze(-1), self.place, rounding_mode="floor") % self.base  # (..., k)

    def seed(self, idx):
        digits = self.digits(idx)  # (..., k)
        return sum(self.codebooks[r][digits[..., r]] for r in range(digits.shape[-1]))  # (..., d_seed)

    def unit_coords(self, z):
        """z: (N, d_seed) -> t: (N, h, d_seed) = sigmoid(LayerNorm(W_seed z) / 2), per head."""
        x = torch.einsum("hij,nj->nhi", self.seed_proj, z)  # (N, h, d_seed)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-5) * self.ln_weight + self.ln_bias
        return torch.sigmoid(x / 2)

    def mix_heads(self, M):
        """M: (N, h, rank) -> E: (N, n_embd) = sum_h M[:, h] @ W_out[h], as one matmul."""
        N, h, r = M.shape
        return M.reshape(N, h * r) @ self.out_proj.reshape(h * r, self.n_embd)

    def reference(self, idx):
        """The plain recipe, with every intermediate materialised: idx (...) -> (..., n_embd)."""
        check_ids(*torch.aminmax(idx), self.vocab_size)
        flat = idx.reshape(-1)
        t = self.unit_coords(self.seed(flat))  # (N, h, d_seed)
        w = bspline_basis(t, self.n_knots)  # (N, h, d_seed, n_knots)
        phi = torch.einsum("nhdj,hdjr->nhdr", w, self.spline)  # (N, h, d_seed, rank)
        sign, log_abs = signed_log_product(phi, dim=2)  # (N, h, rank)
        E = self.mix_heads(sign * log_abs.exp())
        return E.view(*idx.shape, self.n_embd)

    # -- the fast path --

    def embed_distinct(self, ids):
        """ids: (U,) distinct -> (U, n_embd). The product and its exp stay in fp32 even under autocast:
        log|M| reaches ~9 in training and fp16 overflows at exp(11.1)."""
        device_type = ids.device.type
        with torch.autocast(device_type, enabled=False):
            t = self.unit_coords(self.seed(ids))  # (U, h, d_seed)
            # compiled kernels pay off in training, which runs them every step; inference meets each id once
            compile = self.compile and torch.is_grad_enabled()
            M = SplineProduct.apply(t, self.spline, self.chunk, compile)  # (U, h, rank)
            return self.mix_heads(M)

    # Kept out of a model-wide torch.compile: the number of distinct ids changes from batch to batch, and each new
    # count would recompile the graph. The heavy part is compiled on its own, a chunk of ids at a time (run_kernel).
    @torch.compiler.disable
    def forward(self, idx):
        if idx.numel() == 0:
            return self.out_proj.new_zeros(*idx.shape, self.n_embd)
        ids, inverse = torch.unique(idx.reshape(-1), return_inverse=True)  # ~800 distinct of 2,048 ids
        check_ids(ids[0], ids[-1], self.vocab_size)  # sorted: the extremes are enough
        if torch.is_grad_enabled():
            self._cache_key = None  # training: the weights are about to change, whatever the optimizer
        use_cache = self.use_cache and not torch.is_grad_enabled()
        emb = self.cached(ids) if use_cache else self.embed_distinct(ids)
        return emb[inverse].view(*idx.shape, self.n_embd)

    def cached(self, ids):
        """Embeddings of distinct ids with gradients off: computed on first use, then looked up. The cache is
        emptied by every forward with gradients on (a training step), and keyed on each parameter's storage and
        its `_version`, the counter PyTorch bumps on in-place changes made through the parameter
        (load_state_dict, in-place ops under no_grad, non-fused optimizers). Writes that bypass the counter
        (`p.data`, fused optimizer kernels) after a no-grad forward need use_cache=False or a fresh model."""
        # tensors made under inference_mode cannot be updated outside it (and vice versa): part of the key
        key = (torch.is_inference_mode_enabled(), *((p.data_ptr(), p._version) for p in self.parameters()))
        if key != self._cache_key:
            self._cache_slot = torch.full((self.vocab_size,), -1, dtype=torch.long, device=ids.device)
            self._cache_rows = self.out_proj.new_empty(0, self.n_embd)
            self._cache_key = key
        new = ids[self._cache_slot[ids] < 0]
        if len(new):
            self._cache_slot[new] = torch.arange(len(new), device=ids.device) + len(self._cache_rows)
            self._cache_rows = torch.cat([self._cache_rows, self.embed_distinct(new)])
        return self._cache_rows[self._cache_slot[ids]]

    @torch.no_grad()
    def table(self):
        """Materialise the whole V x n_embd input table (e.g. to export LEV as an ordinary embedding)."""
        ids = torch.arange(self.vocab_size, device=self.codebooks.device)
        return torch.cat([self.embed_distinct(c) for c in ids.split(max(self.chunk, 4096))])


# ----------------------------------------------------------------------------------------------------------
# 2. The backbone: a decoder-only LLaMA-style Transformer


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def rotary_tables(head_size, length, theta=10000.0):
    """cos and sin of the rotation angles pos * theta^(-2i/head_size), each (length, head_size/2)."""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate pairs (x[..., :hs/2], x[..., hs/2:]) of x: (B, nh, T, hs) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding."""

    def __init__(self, n_layer):
        self.kv = [None] * n_layer
        self.pos = 0  # tokens already in the cache; the position of the next token

    def update(self, layer, k, v):
        if self.kv[layer] is not None:
            k = torch.cat([self.kv[layer][0], k], dim=2)
            v = torch.cat([self.kv[layer][1], v], dim=2)
        self.kv[layer] = (k, v)
        return k, v


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.n_head, self.layer, self.dropout = config.n_head, layer, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, cache=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (a.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for a in (q, k, v))  # (B, nh, T, hs)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, nh, T_past + T, hs)
        # T tokens into an empty cache: causal; one token after a past: it attends to all of it (GPT.forward
        # refuses several tokens after a past, which would need an offset mask)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads
        return self.resid_dropout(self.proj(y))


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = 64 * math.ceil(8 * config.n_embd / 3 / 64)  # LLaMA: 2/3 of 4*n_embd, rounded up to 64
        self.gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.up = nn.Linear(config.n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.n_embd)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------------------------------------
# 3. The model: identical backbone, three embedding arms


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        c = config
        if c.embedding == "lev":
            self.tok_emb = LEV(c.vocab_size, c.n_embd, c.n_digits, c.d_seed, c.n_lev_heads, c.n_knots, c.lev_rank,
                               c.lev_chunk, c.lev_compile)
        else:
            self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c, layer) for layer in range(c.n_layer)])
        self.norm = RMSNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        cos, sin = rotary_tables(c.n_embd // c.n_head, c.block_size)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # init as GPT-2/nanoGPT: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.startswith("tok_emb.") and c.embedding == "lev":
                continue  # LEV initialises itself
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        if c.embedding == "tied":
            self.head.weight = self.tok_emb.weight  # one V x n_embd matrix, read at input and at output

    def param_report(self):
        """Parameter counts split into input embedding / backbone / head (the tied table counts as input)."""
        emb = sum(p.numel() for p in self.tok_emb.parameters())
        head = 0 if self.config.embedding == "tied" else self.head.weight.numel()
        total = sum(p.numel() for p in self.parameters())  # shared parameters are counted once
        return {"input_embedding": emb, "backbone": total - emb - head, "head": head, "total": total}

    def forward(self, idx, targets=None, cache=None):
        """idx: (B, T) token ids -> (logits, loss). With targets: logits (B, T, V) and the mean cross-entropy
        (targets == -1 are ignored). Without: logits of the last position only, (B, 1, V), and loss None."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens is longer than block_size={self.config.block_size}")
        if pos > 0 and T > 1:
            raise NotImplementedError("feeding several tokens after a non-empty KV cache is not supported")
        if self.config.embedding != "lev" and not torch.compiler.is_compiling():
            check_ids(*torch.aminmax(idx), self.config.vocab_size)
        x = self.drop(self.tok_emb(idx))  # (B, T, n_embd); LEV checks its ids itself
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        x = self.norm(x)
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), device_type="cpu"):
        """AdamW. Decay matrices and tables (dim >= 2), not norms' gains and biases (LEV's per-head LayerNorm
        ones are 2-D), and not LEV's spline coefficients S: decay pulls each factor towards 0, and so a
        128-factor product much faster still."""
        not_decayed = ("tok_emb.spline", "tok_emb.ln_weight", "tok_emb.ln_bias")
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 and name not in not_decayed else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    # -- generation --

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True):
        """Yield the next token, (B, 1), max_new_tokens times, continuing idx: (B, T).

        temperature=0 is greedy. The model sees at most block_size tokens: when the context is full, the
        window jumps forward by half a block (it keeps the last block_size/2 tokens), so a KV cache stays valid
        between jumps and is rebuilt at each jump. use_cache=False runs full forward passes over exactly the same
        windows, so both give identical tokens; it is the plain path the cache is tested against.
        Arguments are checked here, at the call, not at the first token.
        """
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        return self._stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache)

    @torch.no_grad()
    def _stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache):
        block = self.config.block_size
        start = max(0, idx.shape[1] - block)  # the window is idx[:, start:]
        cache, fed = None, 0  # with a cache: how many tokens of the window it holds
        for _ in range(max_new_tokens):
            if idx.shape[1] - start > block:
                start = idx.shape[1] - max(1, block // 2)
                cache = None
            if not use_cache:
                logits, _ = self(idx[:, start:])
            else:
                if cache is None:
                    cache, fed = KVCache(self.config.n_layer), start
                logits, _ = self(idx[:, fed:], cache=cache)
                fed = idx.shape[1]
            next_id = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p)
            idx = torch.cat([idx, next_id], dim=1)
            yield next_id

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True):
        """idx: (B, T) -> (B, T + max_new_tokens): the prompt followed by the sampled tokens (see stream)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache))
        return torch.cat([idx, *new], dim=1)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """logits: (B, V) -> next ids (B, 1). temperature 0 = argmax; top_k keeps the k likeliest ids; top_p keeps
    the smallest set of likeliest ids whose probability reaches p (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the likelier ids before this one already reach p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints (written by train.py, read by train.py --init_from=resume, sample.py, eval.py) and devices


def resolve_device(name):
    """'auto' -> cuda if available, else mps, else cpu; an explicit device must be available (else ValueError)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but torch sees no CUDA GPU; use --device=cpu or --device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device=mps but this torch has no MPS (Apple GPU) support; use --device=cpu or auto")
    return name


CHECKPOINT_VERSION = 1


def load_checkpoint(path, device="cpu"):
    """Load ckpt.pt (or the ckpt.pt inside a directory) -> (model in eval mode, checkpoint dict).

    A checkpoint is a dict of tensors and plain values only, so it loads with weights_only=True (no arbitrary
    pickles): version, model (state_dict), model_config (Config fields), train_config, meta (the dataset's
    meta.json), step, best_val_loss, tokens_seen, and for resuming: optimizer, rng."""
    import os

    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}; train one first (python train.py ...) or fix --out_dir")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated file, a foreign pickle, ...
        raise ValueError(f"{path} is not a readable leviathan checkpoint "
                         f"({type(e).__name__}: {first_line(e)})") from None
    version = ckpt.get("version") if isinstance(ckpt, dict) else None
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"{path} is a checkpoint of format version {version!r}; this code reads version "
                         f"{CHECKPOINT_VERSION}. Retrain, or use the leviathan version that wrote it.")
    missing = [key for key in ("model", "model_config") if key not in ckpt]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}; it was not written by train.py")
    unknown = set(ckpt["model_config"]) - set(Config.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{path} has model settings this code does not know: {', '.join(sorted(unknown))}")
    model = GPT(Config(**ckpt["model_config"]))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # it lists every tensor that does not fit: one line, the start of the list
        detail = " ".join(str(e).split())[:300]
        raise ValueError(f"{path}: the weights do not fit its model settings ({detail})") from None
    return model.to(device).eval(), ckpt


if __name__ == "__main__":
    # python leviathan.py: the parameter table of the three arms at two sizes (built on the meta device: no memory)
    sizes = {"Tiny Shakespeare CPU config (V=50,257, 4 x 4 x 128)": dict(vocab_size=50257, n_layer=4, n_head=4,
                                                                           n_embd=128, block_size=128),
             "paper's 1.2B-like width (V=200,376, 16 x 16 x 2048)": dict(vocab_size=200376, n_layer=16, n_head=16,
                                                                          n_embd=2048, block_size=2048)}
    for title, size in sizes.items():
        print(f"\n{title}\n\n| arm | input embedding | backbone | head | total |\n|---|---:|---:|---:|---:|")
        for arm in EMBEDDINGS:
            with torch.device("meta"):
                report = GPT(Config(**size, embedding=arm)).param_report()
            print(f"| {arm} | {report['input_embedding']:,} | {report['backbone']:,} | {report['head']:,} | "
                  f"{report['total']:,} |")
