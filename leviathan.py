"""
Leviathan: a language model whose input embedding is a small continuous function of the token index.

Batley & Saha, "Leviathan: Decoupling Input and Output Representations in Language Models", arXiv
2601.22040. A standard model uses one V x n_embd table twice, as the input embedding and (tied) as
the output head. Leviathan keeps a full, untied V x n_embd head and replaces the input table with
LEV (learned embedding vectorization), whose size barely depends on V.

The file is the whole model, top to bottom:
  1. LEV, the input embedding: its recipe step by step (LEV.recipe is the executable spec), then
     the compact embeddings it competes with;
  2. the backbone: a decoder-only LLaMA-style Transformer (RMSNorm, rotary positions, SwiGLU);
  3. GPT, the model: one backbone, five input/output arms chosen by Config.embedding:
       "lev"        LEV input + untied V x n_embd head   (Leviathan)
       "tied"       one table, shared by input and head  (the usual baseline)
       "untied"     a table and a separate head          (the effect of untying apart from LEV's)
       "digits"     LEV's digits and codebooks, then one linear map, + untied head (LEV's first
                    stage alone: what the spline stage adds)
       "factorized" a V x E table, then E -> n_embd, + untied head, E matching LEV's size (ALBERT)
     and generation with a KV cache.

It runs as written. The scripts run two parts faster (kernels/): LEV (its recipe compiled, or
hand-written kernels) and the V-wide head's loss, each checked against the code here when installed;
LEV.fast_embed and GPT.fast_logits, both None here, are the hooks they use.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

EMBEDDINGS = ("lev", "tied", "untied", "digits", "factorized")


def setting(default, help):
    """A Config field with its help text (train.py builds its flags and their --help from it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """The architecture: everything a checkpoint needs to rebuild the model. Settings that change
    speed but not results (the fast paths) belong to a run, not here."""

    vocab_size: int = setting(50257, "V, the tokenizer's vocabulary (train.py takes it from the "
                                     "data)")
    block_size: int = setting(256, "longest context the model sees, in tokens")
    n_layer: int = setting(6, "Transformer blocks")
    n_head: int = setting(6, "attention heads per block")
    n_embd: int = setting(384, "model width")
    # what a pretrained LLaMA-style model sets otherwise (lab/from_gguf.py); the defaults are ours
    n_kv_head: int = setting(0, "key/value heads per block, each shared by n_head / n_kv_head "
                                "query heads (grouped-query attention); 0: n_head")
    rope_theta: float = setting(10000.0, "rotary positions' base: pair i of a head turns by "
                                         "pos * theta^(-2i/head_size)")
    mlp_hidden: int = setting(0, "SwiGLU's hidden width; 0: 8/3 n_embd rounded up to 64 "
                                 "(LLaMA's)")
    dropout: float = setting(0.0, "dropout probability")
    embedding: str = setting("lev", "lev (Leviathan: LEV input + untied head), tied or untied "
                                    "(baselines), digits or factorized (compact inputs + "
                                    "untied head)")
    # LEV; the defaults are the paper's
    lev_digits: int = setting(3, "LEV: k, digits of a token id, in base b = ceil(V^(1/k))")
    lev_seed_dim: int = setting(128, "LEV: d_seed, width of the seed vector z and of each head's "
                                     "coordinates")
    lev_heads: int = setting(8, "LEV: h, independent separable modes, summed")
    lev_knots: int = setting(16, "LEV: kappa, knots of each spline on [0, 1] (its basis: "
                                 "bspline_basis)")
    lev_rank: int = setting(64, "LEV: r, outputs of each spline, i.e. length of a mode")
    lev_normalize_basis: bool = setting(True, "LEV: divide the spline basis by its sum over knots "
                                              "(bspline_basis's normalize)")
    # LEV's initialisation, which the paper leaves open: ours. 0.002 starts LEV's embeddings at the
    # norm of a 0.02-std table's rows (~0.27 against 0.23 at n_embd = 128; 0.02 gave 2.7);
    # docs/results.md has the ablation that made it the default
    lev_out_init_std: float = setting(0.002, "LEV (ours; the paper leaves LEV's initialisation "
                                             "open): W_out starts as N(0, std^2 / h)")
    factorized_dim: int = setting(0, "factorized: E, the width of its V x E table; 0: LEV's size "
                                     "at this V and n_embd")

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"Config: {msg}")

        need(self.embedding in EMBEDDINGS,
             f"embedding={self.embedding!r}; choose one of {', '.join(EMBEDDINGS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "lev_digits",
                     "lev_seed_dim", "lev_heads", "lev_knots", "lev_rank"):
            value = getattr(self, name)
            need(type(value) is int and value >= 1, f"{name}={value!r} must be a positive integer")
        for name in ("n_kv_head", "mlp_hidden"):
            value = getattr(self, name)
            need(type(value) is int and value >= 0, f"{name}={value!r} must be an integer >= 0 "
                 f"(0: the default)")
        need(self.n_head % (self.n_kv_head or self.n_head) == 0,
             f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        theta = self.rope_theta
        need(isinstance(theta, float | int) and not isinstance(theta, bool) and math.isfinite(theta)
             and theta > 1, f"rope_theta={theta!r} must be a finite number > 1")
        need(type(self.factorized_dim) is int and self.factorized_dim >= 0,
             f"factorized_dim={self.factorized_dim!r} must be an integer >= 0 (0: LEV's size)")
        need(type(self.lev_normalize_basis) is bool,
             f"lev_normalize_basis={self.lev_normalize_basis!r} must be True or False")
        need(self.vocab_size >= 2, f"vocab_size={self.vocab_size} must be at least 2")
        need(self.lev_knots >= BASIS_MIN_KNOTS, f"lev_knots={self.lev_knots} must be at least "
             f"{BASIS_MIN_KNOTS} ({BASIS_MIN_KNOTS_WHY})")
        need(self.n_embd % self.n_head == 0,
             f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        need((self.n_embd // self.n_head) % 2 == 0, f"head size n_embd/n_head="
             f"{self.n_embd // self.n_head} must be even for rotary embeddings")
        need(isinstance(self.dropout, float | int) and 0.0 <= self.dropout < 1.0,
             f"dropout={self.dropout} must be in [0, 1)")
        std = self.lev_out_init_std
        number = isinstance(std, float | int) and not isinstance(std, bool)
        need(number and math.isfinite(std) and std > 0,
             f"lev_out_init_std={std!r} must be a finite number > 0")


# --------------------------------------------------------------------------------------------------
# 1. LEV: token index -> embedding, as a compact continuous function


def digit_base(vocab_size, n_digits):
    """The smallest integer b with b ** n_digits >= vocab_size, i.e. ceil(V ** (1/k)), in exact
    integers (float pow can land on the wrong side, e.g. 125 ** (1/3) = 4.999...)."""
    b = max(2, round(vocab_size ** (1.0 / n_digits)))
    while b ** n_digits < vocab_size:
        b += 1
    while b > 2 and (b - 1) ** n_digits >= vocab_size:
        b -= 1
    return b


# the basis's own settings, beside it: an edit of the basis edits them here (lev_knots' lower bound;
# lev_normalize_basis is its normalize)
BASIS_MIN_KNOTS, BASIS_MIN_KNOTS_WHY = 3, "a quadratic B-spline spans 3 knots"


def bspline_basis(t, n_knots, normalize=True):
    """Quadratic B-spline basis on n_knots evenly spaced knots g_j = j / (n_knots - 1) of [0, 1].

    t: (...,) in [0, 1] -> w: (..., n_knots), with delta = |t - g_j| * (n_knots - 1):
        w = 0.75 - delta^2          for delta < 0.5
        w = 0.5 * (1.5 - delta)^2   for 0.5 <= delta < 1.5
        w = 0                       otherwise: only the 3 knots nearest t, computed elementwise
    Inside [g_1/2, 1 - g_1/2] their weights sum to 1. Closer to 0 or 1, one of the 3 would sit on a
    knot outside [0, 1], which does not exist, and the sum falls to 0.875 at t = 0 and t = 1 (g_1/2
    = 1/30 for 16 knots). normalize=True divides by the sum, so that the basis is a partition of
    unity on all of [0, 1], as the public reference implementation of the paper does; False not.
    """
    s = t * (n_knots - 1)  # t in units of the knot spacing
    nearest = s.round().unsqueeze(-1) + torch.arange(-1, 2, device=t.device, dtype=t.dtype)
    delta = (s.unsqueeze(-1) - nearest).abs()  # (..., 3), each in [0, 1.5]
    w = torch.where(delta < 0.5, 0.75 - delta ** 2,
                    torch.where(delta < 1.5, 0.5 * (1.5 - delta) ** 2, 0.0))
    w = torch.where((nearest >= 0) & (nearest < n_knots), w, 0.0)  # knots -1 and n_knots
    w = w / w.sum(-1, keepdim=True) if normalize else w
    knot = nearest.clamp(0, n_knots - 1).long()  # added, not written: a missing knot adds 0
    return torch.zeros(*t.shape, n_knots, dtype=t.dtype, device=t.device).scatter_add(-1, knot, w)


def signed_log_product(phi, dim):
    """prod(phi, dim) as (sign, log|prod|): a product of 128 factors near 1 over- or underflows in
    plain floating point, its log does not. The sign is the parity of the negative factors."""
    log_abs = phi.abs().log().sum(dim)
    sign = 1.0 - 2.0 * ((phi < 0).sum(dim) % 2).to(phi.dtype)
    return sign, log_abs


def check_ids(lo, hi, vocab_size):
    """Raise a ValueError naming the first id outside [0, V), given the smallest and largest ids."""
    for i in (int(lo), int(hi)):
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size}); "
                             f"was the data tokenized with another tokenizer than this model's?")


class DigitCodebooks(nn.Module):
    """LEV's first stage, which the digits arm keeps alone: id -> k digits in base b -> seed z, the
    sum of one codebook row per digit (codebooks C: (k, b, d_seed))."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.vocab_size, self.n_embd = c.vocab_size, c.n_embd
        self.base = digit_base(c.vocab_size, c.lev_digits)
        place = self.base ** torch.arange(c.lev_digits - 1, -1, -1)
        self.register_buffer("place", place, persistent=False)
        self.codebooks = nn.Parameter(torch.randn(c.lev_digits, self.base, c.lev_seed_dim) * 0.02)

    def digits(self, idx):
        digits = torch.div(idx.unsqueeze(-1), self.place, rounding_mode="floor")
        return digits % self.base  # (..., k)

    def seed(self, idx):
        digits = self.digits(idx)  # (..., k)
        # F.embedding, not indexing: its backward sums repeated rows in a fixed order on any number
        # of CPU threads (indexing's does not), so that a resumed run repeats bit for bit
        rows = (F.embedding(digits[..., i], self.codebooks[i]) for i in range(digits.shape[-1]))
        return sum(rows)  # (..., d_seed)


class LEV(DigitCodebooks):
    """Learned embedding vectorization: token id -> n_embd vector, with O(V^(1/k)) parameters.

        digits:  id = sum_i digit_i * b^(k-1-i),  b = ceil(V^(1/k)), most significant digit first
        seed:    z = sum_i C[i, digit_i]                                    C: (k, b, d_seed)
        per head (h heads, each with its own parameters):
          x = W_seed z;  t = sigmoid(LayerNorm(x) / 2)  in [0, 1]^d_seed    W_seed: (d_seed, d_seed)
          phi[d, :] = sum_j w_j(t[d]) S[d, j, :]  (w: bspline_basis)       S: (d_seed, kappa, r)
          M = prod_d phi[d, :]        (a rank-1 separable mode, length r)
        E = sum_heads M @ W_out                                             W_out: (r, n_embd)

    Parameters: k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*n_embd); 2,252,928 for V =
    200,376 and n_embd = 2048 with the paper's k=3, d_seed=128, h=8, kappa=16, r=64.
    """

    # distinct ids embedded together; each chunk is recomputed in backward, so autograd holds one
    # chunk's spline values (65,536 per id at the paper's sizes), not a batch's (CPU config: ~800)
    recipe_chunk = 64
    # matrices left out of weight decay (GPT.param_groups): the per-head LayerNorm's gains
    # and biases, and S, whose decay pulls each of the d_seed factors of the product towards 0
    no_weight_decay = ("ln_weight", "ln_bias", "spline")

    def __init__(self, config):
        super().__init__(config)  # the digits and codebooks C
        c = config
        self.n_knots, self.normalize_basis = c.lev_knots, c.lev_normalize_basis
        h, d, r = c.lev_heads, c.lev_seed_dim, c.lev_rank
        # x = W_seed z: std 1/sqrt(d) keeps x at z's scale, well above LayerNorm's eps
        self.seed_proj = nn.Parameter(torch.randn(h, d, d) / math.sqrt(d))  # W_seed, per head
        self.ln_weight = nn.Parameter(torch.ones(h, d))
        self.ln_bias = nn.Parameter(torch.zeros(h, d))
        # near 1, so that the 128-factor product starts near 1 rather than at 0 or infinity
        self.spline = nn.Parameter(1.0 + 0.1 * torch.randn(h, d, c.lev_knots, r))  # S
        # 1/sqrt(h): the h heads' outputs are summed
        w_out = torch.randn(h, r, c.n_embd) * c.lev_out_init_std / math.sqrt(h)
        self.out_proj = nn.Parameter(w_out)  # W_out
        self.fast_embed = None  # hook: a run's fast path, (lev, ids) -> E (kernels/)

    # -- the recipe, step by step (digits and seed: DigitCodebooks) --

    def unit_coords(self, z):
        """z: (N, d_seed) -> t: (N, h, d_seed) = sigmoid(LayerNorm(W_seed z) / 2), per head."""
        x = torch.einsum("hij,nj->nhi", self.seed_proj, z)  # (N, h, d_seed)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-5) * self.ln_weight + self.ln_bias
        return torch.sigmoid(x / 2)

    def mix_heads(self, M):
        """M: (N, h, r) -> E: (N, n_embd) = sum_h M[:, h] @ W_out[h], as one matmul."""
        N, h, r = M.shape
        return M.reshape(N, h * r) @ self.out_proj.reshape(h * r, self.n_embd)

    def recipe(self, ids):
        """ids (N,) -> E (N, n_embd), step by step as the class docstring writes it, every
        intermediate materialised. No Python decides on values: torch.compile makes one graph of
        it (kernels/compiled_lev.py)."""
        z = self.seed(ids)  # (N, d_seed)
        t = self.unit_coords(z)  # (N, h, d_seed)
        w = bspline_basis(t, self.n_knots, self.normalize_basis)  # (N, h, d_seed, kappa)
        phi = torch.einsum("nhdk,hdkr->nhdr", w, self.spline)  # (N, h, d_seed, r)
        sign, log_abs = signed_log_product(phi, dim=2)  # (N, h, r)
        M = sign * log_abs.exp()  # (N, h, r): each head's mode
        return self.mix_heads(M)  # (N, n_embd)

    def reference(self, idx):
        """The recipe on a whole batch at once: idx (...) -> (..., n_embd)."""
        check_ids(*torch.aminmax(idx), self.vocab_size)
        return self.recipe(idx.reshape(-1)).view(*idx.shape, self.n_embd)

    # Kept out of a model-wide torch.compile: the number of distinct ids changes from batch to
    # batch, and each new count would recompile the graph.
    @torch.compiler.disable
    def forward(self, idx):
        """idx (...) -> (..., n_embd): the same function as reference(), each distinct id of the
        batch computed once."""
        if idx.numel() == 0:
            return self.out_proj.new_zeros(*idx.shape, self.n_embd)
        ids, inverse = torch.unique(idx.reshape(-1), return_inverse=True)
        check_ids(ids[0], ids[-1], self.vocab_size)  # sorted: the extremes are enough
        emb = self.embed_distinct(ids)  # (U, n_embd)
        return F.embedding(inverse, emb).view(*idx.shape, self.n_embd)  # as in seed: deterministic

    def embed_distinct(self, ids):
        """ids: (U,) distinct -> (U, n_embd), by a run's fast path, else by the recipe."""
        # fp32 even under autocast: log|M| grows well past fp16's range of exp (it overflows at
        # exp(11.1))
        with torch.autocast(ids.device.type, enabled=False):
            if self.fast_embed is not None:  # a run's fast path: the same function, faster
                return self.fast_embed(self, ids)
            return self.in_chunks(self.recipe, ids)

    def in_chunks(self, recipe, ids):
        """recipe (self.recipe or it compiled) on ids, a chunk at a time, recomputed in backward."""
        chunks = ids.split(self.recipe_chunk)
        if not torch.is_grad_enabled():  # nothing to recompute
            return torch.cat([recipe(c) for c in chunks])
        return torch.cat([checkpoint(recipe, c, use_reentrant=False) for c in chunks])

    @torch.no_grad()
    def table(self):
        """Materialise the whole V x n_embd input table (e.g. to export LEV as a plain table)."""
        ids = torch.arange(self.vocab_size, device=self.codebooks.device)
        return torch.cat([self.embed_distinct(c) for c in ids.split(4096)])


# The compact input embeddings LEV competes with, at its size or below, each with an untied head.
# Each starts its embeddings at a 0.02-std table's scale, as LEV does (lev_out_init_std).


class Digits(DigitCodebooks):
    """The digits arm: LEV's first stage alone, the seed z mapped to n_embd by one linear map where
    LEV has its spline stage (a compositional, quotient-remainder embedding):
        E = z @ W,   W: (d_seed, n_embd)
    Parameters: k*b*d_seed + d_seed*n_embd. It isolates what LEV's spline product adds."""

    def __init__(self, config):
        super().__init__(config)
        k, d = config.lev_digits, config.lev_seed_dim
        self.proj = nn.Parameter(torch.randn(d, config.n_embd) / math.sqrt(k * d))  # W
        # z's entries have std 0.02 sqrt(k), so E's have std 0.02

    def forward(self, idx):
        return self.seed(idx) @ self.proj  # (..., n_embd)


def factorized_dim(config):
    """E for the factorized arm: factorized_dim, or by default the E whose V*E + E*n_embd is nearest
    LEV's parameters at the same V and n_embd (25 at the CPU config, 11 at the paper's width)."""
    if config.factorized_dim:
        return config.factorized_dim
    k, d, h = config.lev_digits, config.lev_seed_dim, config.lev_heads
    lev = k * digit_base(config.vocab_size, k) * d + h * (
        d * d + 2 * d + d * config.lev_knots * config.lev_rank + config.lev_rank * config.n_embd)
    return max(1, round(lev / (config.vocab_size + config.n_embd)))


class Factorized(nn.Module):
    """The factorized arm (ALBERT's): a V x E table, then E -> n_embd by one linear map:
        E(i) = T[i] @ W,   T: (V, E), W: (E, n_embd)
    Parameters: V*E + E*n_embd, with E = factorized_dim(config)."""

    def __init__(self, config):
        super().__init__()
        E = factorized_dim(config)
        self.table = nn.Parameter(torch.randn(config.vocab_size, E) * 0.02)  # T
        self.proj = nn.Parameter(torch.randn(E, config.n_embd) / math.sqrt(E))  # W: E's std 0.02

    def forward(self, idx):
        return F.embedding(idx, self.table) @ self.proj  # (..., n_embd)


# --------------------------------------------------------------------------------------------------
# 2. The backbone: a decoder-only LLaMA-style Transformer


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def rotary_tables(head_size, length, theta):
    """The tables of apply_rotary, each (length, 1, head_size): shaped to broadcast over the
    (B, T, nh + nkv, hs) queries and keys that Attention rotates together. With the angles
    a_i = pos * theta^(-2i/head_size), i < head_size/2:
        cos = [cos a, cos a],  sin = [-sin a, sin a]."""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq).view(length, 1, -1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(x, cos, sin):
    """Rotate the pairs (x1, x2) = (x[..., :hs/2], x[..., hs/2:]) of x: (B, T, heads, hs) by their
    positions' angles: (x1 cos a - x2 sin a, x2 cos a + x1 sin a), written as x * cos + the halves
    swapped * sin with rotary_tables' signs (4 operations: decoding pays a few microseconds per
    operation, whatever its size)."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).type_as(x)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding. Each layer's
    buffers are allocated once, for block_size positions, and filled in place: no copy of the past
    per new token."""

    def __init__(self, n_layer, block_size):
        self.k, self.v = [None] * n_layer, [None] * n_layer
        self.block_size = block_size
        self.pos = 0  # tokens already in the cache; the position of the next token

    def update(self, layer, k, v):
        """Store k, v: (B, nkv, T, hs) at positions pos..pos+T-1 -> all keys and values so far,
        (B, nkv, pos+T, hs)."""
        if self.k[layer] is None:
            shape = (*k.shape[:2], self.block_size, k.shape[3])
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    """Causal self-attention with n_head query heads and n_kv_head key/value heads, each key/value
    head shared by n_head / n_kv_head query heads (grouped-query attention; n_kv_head = n_head is
    the usual multi-head attention)."""

    def __init__(self, config, layer):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head or config.n_head
        self.head_size = config.n_embd // config.n_head
        self.layer, self.dropout = layer, config.dropout
        qkv_size = (self.n_head + 2 * self.n_kv_head) * self.head_size  # queries, keys, values
        self.qkv = nn.Linear(config.n_embd, qkv_size, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, kv_cache=None):
        B, T, C = x.shape
        nh, nkv = self.n_head, self.n_kv_head
        qkv = self.qkv(x).view(B, T, nh + 2 * nkv, self.head_size)
        # queries and keys rotated together: one pass over both (decoding runs ~100 small ops per
        # token, and each op costs microseconds of overhead whatever its size)
        qk = apply_rotary(qkv[:, :, :nh + nkv], cos, sin).transpose(1, 2)  # (B, nh + nkv, T, hs)
        q, k = qk[:, :nh], qk[:, nh:]  # (B, nh, T, hs), (B, nkv, T, hs)
        v = qkv[:, :, nh + nkv:].transpose(1, 2)  # (B, nkv, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, nkv, T_past + T, hs)
        # T tokens into an empty cache: causal; one token after a past: it attends to all of it
        # (GPT.backbone refuses several tokens after a past, which would need an offset mask)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=nkv != nh,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads
        return F.dropout(self.proj(y), self.dropout, self.training)


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        # LLaMA's default: 2/3 of 4*n_embd, rounded up to a multiple of 64
        hidden = config.mlp_hidden or 64 * math.ceil(8 * config.n_embd / 3 / 64)
        self.gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.up = nn.Linear(config.n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, config.n_embd, bias=False)
        self.dropout = config.dropout

    def forward(self, x):
        return F.dropout(self.down(F.silu(self.gate(x)) * self.up(x)), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.n_embd)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


# --------------------------------------------------------------------------------------------------
# 3. The model: one backbone, five embedding arms


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = c = config
        compact = {"lev": LEV, "digits": Digits, "factorized": Factorized}.get(c.embedding)
        self.tok_emb = compact(c) if compact else nn.Embedding(c.vocab_size, c.n_embd)
        self.blocks = nn.ModuleList([Block(c, layer) for layer in range(c.n_layer)])
        self.norm = RMSNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)  # hidden state -> logits
        self.fast_logits = None  # hook: a run's memory-lean head (kernels/lean_head.py)
        cos, sin = rotary_tables(c.n_embd // c.n_head, c.block_size, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # init as GPT-2/nanoGPT: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.startswith("tok_emb.") and compact:
                continue  # LEV and the compact arms initialise themselves
            if p.dim() == 2:
                residual = name.endswith(("proj.weight", "down.weight"))
                std = 0.02 / math.sqrt(2 * c.n_layer) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        if c.embedding == "tied":
            self.lm_head.weight = self.tok_emb.weight  # one V x n_embd matrix, at input and output

    def param_groups(self, weight_decay):
        """The optimizer's two groups: weight decay on the matrices and tables (dim >= 2) but those
        a module lists in its no_weight_decay, none on the rest (norms' gains, biases). Frozen
        parameters (requires_grad False) are left out."""
        kept = {id(getattr(m, name)) for m in self.modules()
                for name in getattr(m, "no_weight_decay", ())}
        trained = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in trained if p.dim() >= 2 and id(p) not in kept],
                 "weight_decay": weight_decay},
                {"params": [p for p in trained if p.dim() < 2 or id(p) in kept],
                 "weight_decay": 0.0}]

    def param_report(self):
        """Parameter counts: input embedding / backbone / head (the tied table counts as input)."""
        emb = sum(p.numel() for p in self.tok_emb.parameters())
        head = 0 if self.config.embedding == "tied" else self.lm_head.weight.numel()
        total = sum(p.numel() for p in self.parameters())  # shared parameters are counted once
        backbone = total - emb - head
        return {"input_embedding": emb, "backbone": backbone, "head": head, "total": total}

    def forward(self, idx, targets=None):
        """idx: (B, T) token ids -> (logits (B, T, V), loss): with targets (B, T), the mean
        cross-entropy over the targets that are not -1, else None.

        Under a run's lean head (GPT.fast_logits, kernels/lean_head.py: training's default) the
        logits are a LazyLogits, made only when used: F.cross_entropy of them, as below, runs
        without ever holding them all; any other use (a loss term, a softmax) makes them first,
        with the plain head's values, gradients and memory. It behaves as a tensor but is not one
        (isinstance(logits, torch.Tensor) is False; logits.tensor() is one)."""
        x = self.backbone(self.embed(idx))  # (B, T, n_embd)
        logits = self.lm_head(x) if self.fast_logits is None else self.fast_logits(
            x, self.lm_head.weight)  # (B, T, V)
        if targets is None:
            return logits, None
        # fp32 under autocast (cross_entropy is one of autocast's float32 operations)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1)
        return logits, loss

    def embed(self, idx):
        """idx: (B, T) token ids, checked -> input embeddings (B, T, n_embd)."""
        if self.config.embedding == "lev":
            return self.tok_emb(idx)  # LEV checks its ids itself
        if not torch.compiler.is_compiling():
            check_ids(*torch.aminmax(idx), self.config.vocab_size)
        return self.tok_emb(idx)

    def backbone(self, x, kv_cache=None):
        """Input embeddings x: (B, T, n_embd) -> the last hidden states (B, T, n_embd), normalised,
        which the head turns into logits. With a kv_cache, the T tokens follow the kv_cache.pos
        tokens it holds."""
        T = x.shape[1]
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens is longer than "
                             f"block_size={self.config.block_size}")
        if pos > 0 and T > 1:
            raise NotImplementedError("feeding several tokens after a non-empty KV cache is not "
                                      "supported")
        x = F.dropout(x, self.config.dropout, self.training)
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        for block in self.blocks:
            x = block(x, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.norm(x)

    # -- generation --

    def next_logits(self, idx, kv_cache=None):
        """idx: (B, T) -> the logits of the token after the last, (B, V): the head on the last
        position only. kv_cache: a KVCache that the T tokens join."""
        return self.lm_head(self.backbone(self.embed(idx), kv_cache)[:, -1, :])

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                 use_cache=True, logits_hook=None):
        """idx: (B, T) -> (B, T + max_new_tokens): the prompt, then the sampled tokens (stream)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache,
                               logits_hook))
        return torch.cat([idx, *new], dim=1)

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
               logits_hook=None):
        """Yield the next token, (B, 1), max_new_tokens times, continuing idx: (B, T).

        logits_hook(logits, idx) -> logits, if given, rewrites each next token's logits (B, V),
        float32, before sampling; idx: (B, T') all the tokens so far. A sampling rule is one such
        function: a repetition penalty (sample.py's), banned tokens, a logit bias.
        temperature=0 is greedy. The model sees at most block_size tokens: when the context is full,
        the window jumps forward by half a block (it keeps the last block_size/2 tokens), so a KV
        cache stays valid between jumps and is rebuilt at each jump. use_cache=False runs full
        forward passes over exactly the same windows, so both give identical tokens; it is the plain
        path the cache is tested against. Arguments are checked here, at the call, not at the first
        token.
        """
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 means "
                             f"greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if idx.shape[1] < 1:
            raise ValueError("the prompt is empty: generation needs at least one token to follow")
        return self._stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, logits_hook)

    # inference_mode, not just no_grad: tensors made here skip autograd's version counting, less
    # overhead on each of the ~100 small operations per token
    @torch.inference_mode()
    def _stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache, logits_hook):
        block = self.config.block_size
        start = max(0, idx.shape[1] - block)  # the window is idx[:, start:]
        kv_cache, fed = None, 0  # with the KV cache: how many tokens of the window it holds
        for _ in range(max_new_tokens):
            if idx.shape[1] - start > block:
                start = idx.shape[1] - max(1, block // 2)
                kv_cache = None
            if not use_cache:
                logits = self.next_logits(idx[:, start:])
            else:
                if kv_cache is None:
                    kv_cache, fed = KVCache(self.config.n_layer, block), start
                # the window's first tokens after a jump, then one token per step
                logits = self.next_logits(idx[:, fed:], kv_cache)
                fed = idx.shape[1]
            logits = logits.float() if logits_hook is None else logits_hook(logits.float(), idx)
            next_id = sample_next(logits, temperature, top_k, top_p)
            idx = torch.cat([idx, next_id], dim=1)
            yield next_id


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """logits: (B, V) -> next ids (B, 1). temperature 0 = argmax; top_k keeps the k likeliest ids;
    top_p keeps the smallest set of likeliest ids whose probability reaches p (nucleus sampling)."""
    if temperature == 0:  # max's indices: the first of equal maxima, as argmax, in 40% of its time
        return logits.max(dim=-1, keepdim=True).indices
    # shift first: the best logit becomes 0, so that a tiny temperature gives -inf for the rest,
    # never inf - inf
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the likelier ids before this one already reach p
        drop[:, 0] = False  # the likeliest id stays (a top_p below fp32's smallest number: 0 there)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


if __name__ == "__main__":
    # python leviathan.py: the parameter table of the five arms at two sizes (on the meta device)
    sizes = {"Tiny Shakespeare CPU config (V=50,257, 4 x 4 x 128)":
             dict(vocab_size=50257, n_layer=4, n_head=4, n_embd=128, block_size=128),
             "paper's 1.2B-like width (V=200,376, 16 x 16 x 2048)":
             dict(vocab_size=200376, n_layer=16, n_head=16, n_embd=2048, block_size=2048)}
    for title, size in sizes.items():
        print(f"\n{title}\n\n| arm | input embedding | backbone | head | total |\n"
              f"|---|---:|---:|---:|---:|")
        for arm in EMBEDDINGS:
            with torch.device("meta"):
                report = GPT(Config(**size, embedding=arm)).param_report()
            print(f"| {arm} | {report['input_embedding']:,} | {report['backbone']:,} | "
                  f"{report['head']:,} | {report['total']:,} |")
