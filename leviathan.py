"""
Leviathan: a language model whose input embedding is a small continuous function of the token index.

Batley & Saha, "Leviathan: Decoupling Input and Output Representations in Language Models",
arXiv 2601.22040. A standard model uses one V x n_embd table twice, as the input embedding and (tied) as the
output head. Leviathan keeps a full, untied V x n_embd head and replaces the input table with LEV (learned
embedding vectorization), whose size barely depends on V.

The file is one story, top to bottom; a reader who stops after section 3 has read the whole model:
  1. LEV, the input embedding: its recipe step by step, and `LEV.reference`, the plain recipe that is the
     executable specification;
  2. the backbone: a decoder-only LLaMA-style Transformer (RMSNorm, rotary positions, SwiGLU, no biases);
  3. GPT, the model: one backbone, three input/output arms chosen by Config.embedding:
       "lev"    LEV input + untied V x n_embd head   (Leviathan)
       "tied"   one table, shared by input and head  (the usual baseline)
       "untied" a table and a separate head          (separates the effect of untying from that of LEV)
  4. LEV's fast path: the machinery that makes training fast (kernels, a custom autograd Function, their
     torch.compile wrapper) and the per-call embedding cache of generation;
  5. the memory-lean head: the loss without ever holding all the logits;
  6. decoding: the head laid out for one token at a time, and the one-token steps in fewer operations.
Each piece of 4 to 6 is tested equal, in float64 values and gradients, to the plain path it speeds up; which
of them a run uses are settings of the run (set_runtime), not of the model.
"""

import ctypes
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

EMBEDDINGS = ("lev", "tied", "untied")


def setting(default, help):
    """A Config field with its help text (train.py shows it in --help and builds its flags from the fields)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """The architecture: everything a checkpoint needs to rebuild the model. Settings that change speed but not
    results (LEV's chunk size, compiling) belong to a run, not here."""

    vocab_size: int = setting(50257, "V, the tokenizer's vocabulary (train.py takes it from the data)")
    block_size: int = setting(256, "longest context the model sees, in tokens")
    n_layer: int = setting(6, "Transformer blocks")
    n_head: int = setting(6, "attention heads per block")
    n_embd: int = setting(384, "model width")
    dropout: float = setting(0.0, "dropout probability")
    embedding: str = setting("lev", "lev (Leviathan: LEV input + untied head), tied or untied (baselines)")
    # LEV; the defaults are the paper's
    lev_digits: int = setting(3, "LEV: k, digits of a token id, in base b = ceil(V^(1/k))")
    lev_seed_dim: int = setting(128, "LEV: d_seed, width of the seed vector z and of each head's coordinates")
    lev_heads: int = setting(8, "LEV: h, independent separable modes, summed")
    lev_knots: int = setting(16, "LEV: kappa, evenly spaced knots of each quadratic B-spline on [0, 1]")
    lev_rank: int = setting(64, "LEV: r, outputs of each spline, i.e. length of a mode")
    lev_normalize_basis: bool = setting(True, "LEV: divide the spline basis by its sum over knots (a partition "
                                              "of unity also at the two ends of [0, 1])")
    # LEV's initialisation, which the paper leaves open: ours. 0.002 starts LEV's embeddings at the norm of a
    # 0.02-std table's rows (~0.27 against 0.23 at n_embd = 128; 0.02 gave 2.7); README, "Why LEV lost on the
    # most frequent tokens", has the ablation that made it the default
    lev_out_init_std: float = setting(0.002, "LEV (ours; the paper leaves LEV's initialisation open): W_out starts "
                                             "as N(0, std^2 / h)")

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"Config: {msg}")

        need(self.embedding in EMBEDDINGS, f"embedding={self.embedding!r}; choose one of {', '.join(EMBEDDINGS)}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "lev_digits", "lev_seed_dim",
                     "lev_heads", "lev_knots", "lev_rank"):
            value = getattr(self, name)
            need(type(value) is int and value >= 1, f"{name}={value!r} must be a positive integer")
        need(type(self.lev_normalize_basis) is bool, f"lev_normalize_basis={self.lev_normalize_basis!r} must be "
                                                     f"True or False")
        need(self.vocab_size >= 2, f"vocab_size={self.vocab_size} must be at least 2")
        need(self.lev_knots >= 3, f"lev_knots={self.lev_knots} must be at least 3 (a quadratic spline spans 3)")
        need(self.n_embd % self.n_head == 0, f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        need((self.n_embd // self.n_head) % 2 == 0,
             f"head size n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")
        need(isinstance(self.dropout, float | int) and 0.0 <= self.dropout < 1.0,
             f"dropout={self.dropout} must be in [0, 1)")
        std = self.lev_out_init_std
        need(isinstance(std, float | int) and not isinstance(std, bool) and math.isfinite(std) and std > 0,
             f"lev_out_init_std={std!r} must be a finite number > 0")


# ----------------------------------------------------------------------------------------------------------
# 1. LEV: token index -> embedding, as a compact continuous function


def digit_base(vocab_size, n_digits):
    """The smallest integer b with b ** n_digits >= vocab_size, i.e. ceil(V ** (1/k)), in exact integers
    (float pow can land on the wrong side, e.g. 125 ** (1/3) = 4.999...)."""
    b = max(2, round(vocab_size ** (1.0 / n_digits)))
    while b ** n_digits < vocab_size:
        b += 1
    while b > 2 and (b - 1) ** n_digits >= vocab_size:
        b -= 1
    return b


def bspline_basis(t, n_knots, normalize=True):
    """Quadratic B-spline basis on n_knots evenly spaced knots g_j = j / (n_knots - 1) of [0, 1].

    t: (...,) in [0, 1] -> w: (..., n_knots), with delta = |t - g_j| * (n_knots - 1):
        w = 0.75 - delta^2          for delta < 0.5
        w = 0.5 * (1.5 - delta)^2   for 0.5 <= delta < 1.5
        w = 0                       otherwise   (so at most 3 knots are non-zero)
    Inside [g_1/2, 1 - g_1/2] the 3 weights sum to 1. Closer to 0 or 1, one of the 3 would sit on a knot
    outside [0, 1], which does not exist, and the sum falls to 0.875 at t = 0 and t = 1 (g_1/2 = 1/30 for
    16 knots). normalize=True divides by the sum, so that the basis is a partition of unity on all of [0, 1],
    as the public reference implementation of the paper does; False keeps the plain basis.
    """
    knots = torch.linspace(0, 1, n_knots, device=t.device, dtype=t.dtype)
    delta = (t.unsqueeze(-1) - knots).abs() * (n_knots - 1)  # (..., n_knots)
    w = torch.where(delta < 0.5, 0.75 - delta ** 2, torch.where(delta < 1.5, 0.5 * (1.5 - delta) ** 2, 0.0))
    return w / w.sum(-1, keepdim=True) if normalize else w


def signed_log_product(phi, dim):
    """prod(phi, dim) as (sign, log|prod|): a product of 128 factors near 1 over- or underflows in plain
    floating point, its log does not. The sign is the parity of the negative factors."""
    log_abs = phi.abs().log().sum(dim)
    sign = 1.0 - 2.0 * ((phi < 0).sum(dim) % 2).to(phi.dtype)
    return sign, log_abs


class LEV(nn.Module):
    """Learned embedding vectorization: token id -> n_embd vector, with O(V^(1/k)) parameters.

        digits:  id = sum_i digit_i * b^(k-1-i),  b = ceil(V^(1/k)), most significant digit first
        seed:    z = sum_i C[i, digit_i]                                    C: (k, b, d_seed)
        per head (h heads, each with its own parameters):
          x = W_seed z;  t = sigmoid(LayerNorm(x) / 2)  in [0, 1]^d_seed    W_seed: (d_seed, d_seed)
          phi[d, :] = sum_j w_j(t[d]) S[d, j, :]  (quadratic B-spline)     S: (d_seed, kappa, r)
          M = prod_d phi[d, :]        (a rank-1 separable mode, length r)
        E = sum_heads M @ W_out                                             W_out: (r, n_embd)

    Parameters: k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*n_embd); 2,252,928 for V = 200,376
    and n_embd = 2048 with the paper's k=3, d_seed=128, h=8, kappa=16, r=64.

    reference() is the recipe with every intermediate materialised: the specification. forward() computes the
    same function on the fast path (section 4): each distinct id of the batch once, the spline product in chunks
    from the 3 non-zero knots of each basis, recomputed in backward. `c_kernels`, `chunk` and `compile_kernels`
    are settings of a run (speed and memory, not results); train.py, sample.py and bench.py set them.
    """

    def __init__(self, config):
        super().__init__()
        c = config
        self.vocab_size, self.n_embd, self.n_knots = c.vocab_size, c.n_embd, c.lev_knots
        self.normalize_basis = c.lev_normalize_basis
        self.base = digit_base(c.vocab_size, c.lev_digits)
        self.register_buffer("place", self.base ** torch.arange(c.lev_digits - 1, -1, -1), persistent=False)
        h, d, r = c.lev_heads, c.lev_seed_dim, c.lev_rank
        self.codebooks = nn.Parameter(torch.randn(c.lev_digits, self.base, d) * 0.02)  # C
        # x = W_seed z: std 1/sqrt(d) keeps x at z's scale, well above LayerNorm's eps
        self.seed_proj = nn.Parameter(torch.randn(h, d, d) / math.sqrt(d))  # W_seed, per head
        self.ln_weight = nn.Parameter(torch.ones(h, d))
        self.ln_bias = nn.Parameter(torch.zeros(h, d))
        # near 1, so that the 128-factor product starts near 1 rather than at 0 or infinity
        self.spline = nn.Parameter(1.0 + 0.1 * torch.randn(h, d, c.lev_knots, r))  # S
        # 1/sqrt(h): the h heads' outputs are summed
        self.out_proj = nn.Parameter(torch.randn(h, r, c.n_embd) * c.lev_out_init_std / math.sqrt(h))  # W_out
        # run settings of the fast path (section 4): on CPU, whether the spline product runs in lev_kernels.c
        # (~3x faster than torch.compile's kernels); else ids per chunk (64 suits a CPU's caches) and whether
        # training runs torch's two kernels through torch.compile (~2.3x faster than eager). All the same sums.
        self.c_kernels = True
        self.chunk = 64
        self.compile_kernels = True

    # -- the recipe, step by step (both paths use these) --

    def digits(self, idx):
        return torch.div(idx.unsqueeze(-1), self.place, rounding_mode="floor") % self.base  # (..., k)

    def seed(self, idx):
        digits = self.digits(idx)  # (..., k)
        return sum(self.codebooks[i][digits[..., i]] for i in range(digits.shape[-1]))  # (..., d_seed)

    def unit_coords(self, z):
        """z: (N, d_seed) -> t: (N, h, d_seed) = sigmoid(LayerNorm(W_seed z) / 2), per head."""
        x = torch.einsum("hij,nj->nhi", self.seed_proj, z)  # (N, h, d_seed)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-5) * self.ln_weight + self.ln_bias
        return torch.sigmoid(x / 2)

    def mix_heads(self, M):
        """M: (N, h, r) -> E: (N, n_embd) = sum_h M[:, h] @ W_out[h], as one matmul."""
        N, h, r = M.shape
        return M.reshape(N, h * r) @ self.out_proj.reshape(h * r, self.n_embd)

    def reference(self, idx):
        """The plain recipe, with every intermediate materialised: idx (...) -> (..., n_embd)."""
        check_ids(*torch.aminmax(idx), self.vocab_size)
        flat = idx.reshape(-1)
        t = self.unit_coords(self.seed(flat))  # (N, h, d_seed)
        w = bspline_basis(t, self.n_knots, self.normalize_basis)  # (N, h, d_seed, kappa)
        phi = torch.einsum("nhdj,hdjr->nhdr", w, self.spline)  # (N, h, d_seed, r)
        sign, log_abs = signed_log_product(phi, dim=2)  # (N, h, r)
        E = self.mix_heads(sign * log_abs.exp())
        return E.view(*idx.shape, self.n_embd)

    # Kept out of a model-wide torch.compile: the number of distinct ids changes from batch to batch, and each new
    # count would recompile the graph. The heavy part is compiled on its own, a chunk of ids at a time (section 4).
    @torch.compiler.disable
    def forward(self, idx, cache=None):
        """idx (...) -> (..., n_embd), the same function as reference() (section 4 has the machinery).
        cache: an EmbeddingCache owned by the caller's generation or evaluation, for gradient-free use."""
        if idx.numel() == 0:
            return self.out_proj.new_zeros(*idx.shape, self.n_embd)
        ids, inverse = torch.unique(idx.reshape(-1), return_inverse=True)  # ~800 distinct of 2,048 ids
        check_ids(ids[0], ids[-1], self.vocab_size)  # sorted: the extremes are enough
        if cache is None:
            emb = self.embed_distinct(ids)
        elif torch.is_grad_enabled():
            raise RuntimeError("an EmbeddingCache is for gradient-free use: the weights change in training")
        else:
            emb = cache.lookup(ids)
        return emb[inverse].view(*idx.shape, self.n_embd)

    def embed_distinct(self, ids):
        """ids: (U,) distinct -> (U, n_embd). The product and its exp stay in fp32 even under autocast:
        log|M| reaches ~9 in training and fp16 overflows at exp(11.1)."""
        with torch.autocast(ids.device.type, enabled=False):
            t = self.unit_coords(self.seed(ids))  # (U, h, d_seed)
            M = SplineProduct.apply(t, self.spline, self.chunk, self.kernels(t), self.normalize_basis)  # (U, h, r)
            return self.mix_heads(M)

    def kernels(self, t):
        """Which kernels SplineProduct runs for coordinates t (section 4): "c" (lev_kernels.c: CPU, fp32 or fp64,
        where a C compiler built it), else torch's, "compiled" in training (which runs them every step) and
        "eager" otherwise (inference meets each id once)."""
        if (self.c_kernels and t.device.type == "cpu" and t.dtype in C_TYPES and self.spline.dtype == t.dtype
                and c_library() is not None):
            return "c"
        return "compiled" if self.compile_kernels and torch.is_grad_enabled() else "eager"

    @torch.no_grad()
    def table(self):
        """Materialise the whole V x n_embd input table (e.g. to export LEV as an ordinary embedding)."""
        ids = torch.arange(self.vocab_size, device=self.codebooks.device)
        return torch.cat([self.embed_distinct(c) for c in ids.split(max(self.chunk, 4096))])


def check_ids(lo, hi, vocab_size):
    """Raise a ValueError naming the first id outside [0, V), given the smallest and largest ids of a batch."""
    for i in (int(lo), int(hi)):
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size}); "
                             f"was the data tokenized with another tokenizer than this model's?")


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
    """cos and sin of the rotation angles pos * theta^(-2i/head_size), each (length, 1, 1, head_size/2): shaped
    to broadcast over the (B, T, 2, nh, hs/2) halves of the queries and keys that Attention rotates together."""
    inv_freq = theta ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq).view(length, 1, 1, -1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate pairs (x[..., :hs/2], x[..., hs/2:]) of x: (B, T, 2, nh, hs) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding. Each layer's buffers are
    allocated once, for block_size positions, and filled in place: no copy of the past per new token."""

    def __init__(self, n_layer, block_size):
        self.k, self.v = [None] * n_layer, [None] * n_layer
        self.block_size = block_size
        self.pos = 0  # tokens already in the cache; the position of the next token

    def update(self, layer, k, v):
        """Store k, v: (B, nh, T, hs) at positions pos..pos+T-1 -> all keys and values so far, (B, nh, pos+T, hs)."""
        if self.k[layer] is None:
            shape = (*k.shape[:2], self.block_size, k.shape[3])
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.n_head, self.layer, self.dropout = config.n_head, layer, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, kv_cache=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head)
        # queries and keys rotated together: one pass over both (decoding runs ~100 small ops per token, and
        # each op costs microseconds of overhead whatever its size)
        q, k = apply_rotary(qkv[:, :, :2], cos, sin).permute(2, 0, 3, 1, 4)  # 2 x (B, nh, T, hs)
        v = qkv[:, :, 2].transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer, k, v)  # (B, nh, T_past + T, hs)
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

    def forward(self, x, cos, sin, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------------------------------------
# 3. The model: identical backbone, three embedding arms


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = c = config
        self.tok_emb = LEV(c) if c.embedding == "lev" else nn.Embedding(c.vocab_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList([Block(c, layer) for layer in range(c.n_layer)])
        self.norm = RMSNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)  # the output head: hidden state -> logits
        self.lean_head = False  # a run setting (set_runtime): the loss from linear_cross_entropy (section 5)
        self.decode_step = None  # a run setting (set_runtime): hidden() compiled for one-token decoding steps
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
            self.lm_head.weight = self.tok_emb.weight  # one V x n_embd matrix, read at input and at output

    def param_report(self):
        """Parameter counts split into input embedding / backbone / head (the tied table counts as input)."""
        emb = sum(p.numel() for p in self.tok_emb.parameters())
        head = 0 if self.config.embedding == "tied" else self.lm_head.weight.numel()
        total = sum(p.numel() for p in self.parameters())  # shared parameters are counted once
        return {"input_embedding": emb, "backbone": total - emb - head, "head": head, "total": total}

    def forward(self, idx, targets=None, reduction="mean", cache=None):
        """idx: (B, T) token ids -> (logits, loss).

        With targets (B, T): logits of every position (B, T, V) and the cross-entropy (targets == -1 ignored):
        its mean over the scored targets, or with reduction="none" the loss of each position, (B, T), 0 where
        ignored. With lean_head on (a run setting, section 5) the same loss comes without the logits (None),
        which never exist all at once. Without targets: the logits of the last position only, (B, 1, V), and
        loss None.
        cache: a DecodeCache of one generation call (KV cache, LEV's embedding cache, the head's layout)."""
        B, T = idx.shape
        x = self.hidden(idx, cache)  # (B, T, n_embd)
        if targets is None:
            return self.last_logits(x, cache), None
        if reduction not in ("mean", "none"):
            raise ValueError(f"reduction={reduction!r}; choose mean or none")
        if self.lean_head:
            return None, linear_cross_entropy(x, self.lm_head.weight, targets, reduction=reduction)
        logits = self.lm_head(x)
        wide = logits.view(-1, logits.size(-1)).to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32
        loss = F.cross_entropy(wide, targets.reshape(-1), ignore_index=-1, reduction=reduction)
        return logits, loss.view(B, T) if reduction == "none" else loss

    def hidden(self, idx, cache=None):
        """idx: (B, T) -> the last hidden states (B, T, n_embd), normalised, which the head turns into logits."""
        T = idx.shape[1]
        kv_cache = cache.kv if cache is not None else None
        pos = kv_cache.pos if kv_cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens is longer than block_size={self.config.block_size}")
        if pos > 0 and T > 1:
            raise NotImplementedError("feeding several tokens after a non-empty KV cache is not supported")
        x = self.drop(self.embed(idx, cache))  # (B, T, n_embd)
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        for block in self.blocks:
            x = block(x, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        return self.norm(x)

    def last_logits(self, x, cache=None):
        """Hidden states x: (B, T, n_embd) -> the logits of the last position, (B, 1, V), through the generation
        call's DecodeHead where the cache has one."""
        if cache is not None and cache.head is not None:
            return cache.head(x[:, -1]).unsqueeze(1)
        return self.lm_head(x[:, [-1], :])

    def embed(self, idx, cache=None):
        """idx: (B, T) token ids, checked -> input embeddings (B, T, n_embd); cache: a DecodeCache, whose
        EmbeddingCache (lev arm) serves the ids it has met."""
        if self.config.embedding == "lev":
            return self.tok_emb(idx, cache.embeddings if cache is not None else None)  # LEV checks its ids itself
        if not torch.compiler.is_compiling():
            check_ids(*torch.aminmax(idx), self.config.vocab_size)
        return self.tok_emb(idx)

    def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), device_type="cpu",
                             lev_lr_scale=1.0, lev_wd_scale=1.0):
        """AdamW. Decay matrices and tables (dim >= 2), not norms' gains and biases (LEV's per-head LayerNorm
        ones are 2-D), and not LEV's spline coefficients S: decay pulls each factor towards 0, and so a
        128-factor product much faster still.

        lev_lr_scale, lev_wd_scale: LEV's learning rate and weight decay as multiples of the others' (lev arm only).
        Each group's "lr_scale" is the factor a schedule multiplies its lr by. With both at 1 there are two groups,
        decay and no_decay, as before these settings existed, so that older optimizer states still load; otherwise
        LEV's parameters get groups of their own after those two (one per kind that has parameters)."""
        not_decayed = ("tok_emb.spline", "tok_emb.ln_weight", "tok_emb.ln_bias")
        own_lev_groups = self.config.embedding == "lev" and (lev_lr_scale != 1 or lev_wd_scale != 1)
        groups = {"decay": {"params": [], "weight_decay": weight_decay, "lr_scale": 1.0},
                  "no_decay": {"params": [], "weight_decay": 0.0, "lr_scale": 1.0},
                  "lev.decay": {"params": [], "weight_decay": weight_decay * lev_wd_scale, "lr_scale": lev_lr_scale},
                  "lev.no_decay": {"params": [], "weight_decay": 0.0, "lr_scale": lev_lr_scale}}
        for name, p in self.named_parameters():
            if p.requires_grad:
                kind = "decay" if p.dim() >= 2 and name not in not_decayed else "no_decay"
                groups[f"lev.{kind}" if own_lev_groups and name.startswith("tok_emb.") else kind]["params"].append(p)
        used = [group for key, group in groups.items() if group["params"] or not key.startswith("lev.")]
        return torch.optim.AdamW(used, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    # -- generation --

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
               lev_cache=True):
        """Yield the next token, (B, 1), max_new_tokens times, continuing idx: (B, T).

        temperature=0 is greedy. The model sees at most block_size tokens: when the context is full, the
        window jumps forward by half a block (it keeps the last block_size/2 tokens), so a KV cache stays valid
        between jumps and is rebuilt at each jump. use_cache=False runs full forward passes over exactly the same
        windows, so both give identical tokens; it is the plain path the cache is tested against. lev_cache: the
        lev arm computes each id's embedding once per call (an EmbeddingCache that lives as long as the call).
        Arguments are checked here, at the call, not at the first token.
        """
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0 means greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1]")
        return self._stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, lev_cache)

    # inference_mode, not just no_grad: tensors made here skip autograd's version counting, ~10% less overhead on
    # each of the ~100 small operations per token
    @torch.inference_mode()
    def _stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache, lev_cache):
        block = self.config.block_size
        start = max(0, idx.shape[1] - block)  # the window is idx[:, start:]
        embeddings = EmbeddingCache(self.tok_emb) if lev_cache and self.config.embedding == "lev" else None
        # built once per call, the weights cannot change during it: the head laid out for one token at a time,
        # and the one-token steps' fast path (section 6; it has no dropout: not in training mode with dropout)
        head = DecodeHead(self.lm_head.weight)
        decoder = (Decoder(self, head) if use_cache and self.decode_step is None
                   and not (self.training and self.config.dropout > 0) else None)
        cache, fed = None, 0  # with the KV cache: how many tokens of the window it holds
        for _ in range(max_new_tokens):
            if idx.shape[1] - start > block:
                start = idx.shape[1] - max(1, block // 2)
                cache = None
            if not use_cache:
                logits, _ = self(idx[:, start:], cache=DecodeCache(None, embeddings, head))
            else:
                if cache is None:
                    cache, fed = DecodeCache(KVCache(self.config.n_layer, block), embeddings, head), start
                new = idx[:, fed:]  # the window's first tokens after a jump, then one token per step
                if new.shape[1] == 1 and self.decode_step is not None:  # compiled; the head outside the graph
                    logits = self.last_logits(self.decode_step(new, cache=cache), cache)
                elif new.shape[1] == 1 and decoder is not None:
                    logits = decoder.step(new, cache)
                else:
                    logits, _ = self(new, cache=cache)
                fed = idx.shape[1]
            next_id = sample_next(logits[:, -1, :].float(), temperature, top_k, top_p)
            idx = torch.cat([idx, next_id], dim=1)
            yield next_id

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
                 lev_cache=True):
        """idx: (B, T) -> (B, T + max_new_tokens): the prompt followed by the sampled tokens (see stream)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache, lev_cache))
        return torch.cat([idx, *new], dim=1)


class DecodeCache:
    """What one generation call keeps between tokens: the KV cache of the current window (None: no KV cache),
    for the lev arm its EmbeddingCache (None: recompute embeddings), and the head laid out for one token at a
    time (a DecodeHead; None: the model's own lm_head)."""

    def __init__(self, kv, embeddings, head=None):
        self.kv, self.embeddings, self.head = kv, embeddings, head


def sample_next(logits, temperature=1.0, top_k=None, top_p=None):
    """logits: (B, V) -> next ids (B, 1). temperature 0 = argmax; top_k keeps the k likeliest ids; top_p keeps
    the smallest set of likeliest ids whose probability reaches p (nucleus sampling)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # shift first: the best logit becomes 0, so that a tiny temperature gives -inf for the rest, never inf - inf
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the likelier ids before this one already reach p
        drop[:, 0] = False  # the likeliest id always stays (a top_p below fp32's smallest number is 0 there)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -float("inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


# ----------------------------------------------------------------------------------------------------------
# 4. LEV's fast path: the same function as LEV.reference, fast enough to train
#
# For each distinct id LEV needs h * d_seed * r = 8 x 128 x 64 spline values (256 KiB in fp32) and their product.
# Autograd through the plain recipe keeps several such tensors per id (~12 GB for 8,192 ids). The fast path
# instead: walks the ids in chunks; reads only the 3 non-zero knots of each basis; multiplies 8 factors before
# each log; recomputes everything in backward (SplineProduct, a custom autograd Function); and in training runs
# its two kernels through torch.compile, which fuses gather, spline, product and logs so that the spline values
# never reach memory.


def bspline_weights3(t, n_knots, normalize):
    """bspline_basis, keeping only its (at most) 3 non-zero knots: t (...) -> (j, w, dw), where knots j-1, j,
    j+1 (j = the nearest knot) carry weights w (..., 3) and derivatives dw/dt (..., 3). With s = t (n_knots - 1)
    and f = s - j in [-0.5, 0.5]:  w = (0.5 (0.5 - f)^2, 0.75 - f^2, 0.5 (0.5 + f)^2). A knot -1 or n_knots
    gets weight 0 when normalize (it does not exist) and its w otherwise (S's zero padding cancels it); normalize
    then divides by W = sum(w), so dw becomes (dw - w dW / W) / W."""
    s = t * (n_knots - 1)
    j = s.round()  # t must be finite (SplineProduct checks): a NaN would become a knot index far out of range
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
    """phi[i, u, :] = sum_m w[i, u, m] * S_padded[i, j[i, u] + m, :]: the spline of each of the h*d seed
    dimensions i at each of u points, from only the 3 non-zero knots of its basis (bspline_weights3).

    S_padded: (h*d, kappa + 2, r), S with a zero knot at each end; j: (h*d, u); w: (h*d, u, 3) -> (h*d, u, r).
    Under torch.compile the gather is written as indexing, which inductor fuses into whatever consumes phi, so
    phi never reaches memory. Eagerly on CPU and CUDA, F.embedding_bag gathers and sums the 3 rows in one pass
    (instead of 3 gathers, 3 multiplies and 2 adds, each a pass over phi); other devices (e.g. MPS, which gained
    embedding_bag only in recent PyTorch) take the indexing too.
    """
    if torch.compiler.is_compiling() or S_padded.device.type not in ("cpu", "cuda"):
        return spline_3knots_indexing(S_padded, j, w)
    hd, n_padded, r = S_padded.shape
    first_row = torch.arange(hd, device=j.device).unsqueeze(1) * n_padded  # of each i, in S_padded.view(-1, r)
    rows = (first_row + j).unsqueeze(-1) + torch.arange(3, device=j.device)  # (h*d, u, 3)
    phi = F.embedding_bag(rows.reshape(-1, 3), S_padded.view(-1, r), mode="sum",
                          per_sample_weights=w.reshape(-1, 3))
    return phi.view(hd, -1, r)


def spline_3knots_indexing(S_padded, j, w):
    """spline_3knots as plain indexing (what inductor fuses)."""
    i = torch.arange(S_padded.shape[0], device=j.device).unsqueeze(1)
    return sum(w[..., m, None] * S_padded[i, j + m] for m in range(3))


def log_mode_chunk(t, S_padded, group, normalize):
    """Forward of SplineProduct for a chunk of u ids: t (u, h, d) -> sign, log|M| (u, h, r), and whether every
    partial product stayed in the normal range of t's dtype (if not, the caller redoes the chunk with group=1).

    The product over d multiplies groups of `group` factors directly and takes logs of those partial products,
    8x fewer logs than one per factor for group=8; fp32 holds any product of 8 factors each in [1.9e-5, 6.5e4]."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, _ = bspline_weights3(t.reshape(u, h * d).T, n_padded - 2, normalize)  # (h*d, u), (h*d, u, 3)
    phi = spline_3knots(S_padded, j, w).view(h, d // group, group, u, r)
    partial = phi.prod(2)  # (h, d / group, u, r)
    sign, log_abs = signed_log_product(partial, dim=1)  # (h, u, r)
    normal = log_abs.isfinite().all() & (partial.abs().amin() >= torch.finfo(t.dtype).tiny)
    return sign.transpose(0, 1), log_abs.transpose(0, 1), normal


def log_mode_chunk_backward(t, S_padded, G, normalize):
    """Backward of SplineProduct for a chunk of u ids, phi recomputed: t (u, h, d), G = dL/dM * M (u, h, r)
    -> dL/dt (u, h, d), dL/dS_padded (h*d, kappa + 2, r). With M = prod_d phi:
        dL/dphi[h, d, u, :] = G[u, h, :] / phi[h, d, u, :]
        dL/dt               = sum_r dL/dphi * dphi/dt,   dphi/dt = the spline with the basis' derivatives
        dL/dS[h, d, k, :]   = sum_u w_k(t[u, h, d]) dL/dphi[h, d, u, :]
    A factor phi exactly 0 gives 0/0 = NaN here, as it does in autograd through the plain recipe."""
    u, h, d = t.shape
    n_padded, r = S_padded.shape[1:]
    j, w, dw = bspline_weights3(t.reshape(u, h * d).T, n_padded - 2, normalize)  # (h*d, u), (h*d, u, 3) x2
    phi = spline_3knots(S_padded, j, w).view(h, d, u, r)
    grad_phi = (G.transpose(0, 1).unsqueeze(1) / phi).view(h * d, u, r)
    grad_t = (grad_phi * spline_3knots(S_padded, j, dw)).sum(-1)  # (h*d, u)
    # dL/dS as one batched matmul, over a dense basis (h*d, kappa + 2, u) holding the 3 weights of each t
    knots = j.unsqueeze(1) + torch.arange(3, device=t.device).view(3, 1)  # (h*d, 3, u)
    basis = torch.zeros(h * d, n_padded, u, dtype=t.dtype, device=t.device).scatter_(1, knots, w.transpose(1, 2))
    return grad_t.T.reshape(u, h, d), torch.bmm(basis, grad_phi)


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
        detail = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"LEV: torch.compile of its kernels failed on {device} ({type(error).__name__}: {detail}); "
                      f"they run eagerly from now on, ~2.3x slower. --lev_compile=False skips the attempt.",
                      stacklevel=1)  # raised from inside autograd: no caller frame of the user's to point at
        return result


# The C kernels (lev_kernels.c): the same two functions in loops ordered for a CPU, ~3x faster than the compiled
# torch kernels in training (README, "Speed"). Built once per machine with the system's C compiler into a cache
# directory and loaded with ctypes. Built with OpenMP, the library uses the OpenMP runtime torch has loaded, so
# torch's threads, as many as torch.get_num_threads(); without it (a compiler without OpenMP), one thread.

C_SOURCE = Path(__file__).with_name("lev_kernels.c")
C_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC")
C_TYPES = {torch.float32: "f32", torch.float64: "f64"}
_c_state = {}  # "library": the loaded library, or None where it could not be built (warned once)


def c_library():
    """lev_kernels.c as a ctypes library, built on first use (CC or cc; LEVIATHAN_CACHE or ~/.cache/leviathan
    holds it, named by a hash of the source, the flags and the machine). None, with one warning, where it cannot
    be built: LEV then runs torch's kernels."""
    if "library" not in _c_state:
        try:
            _c_state["library"] = load_c_library(build_c_library())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:  # RuntimeError: no home directory
            _c_state["library"] = None
            detail = ((getattr(error, "stderr", None) or str(error)).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"LEV: could not build its C kernels ({type(error).__name__}: {detail}); torch's kernels "
                          f"run instead, ~3x slower on CPU. Install a C compiler (or set CC), or turn the C "
                          f"kernels off (train.py --lev_c_kernels=False) to skip the attempt.", stacklevel=2)
    return _c_state["library"]


def build_c_library():
    """Compile C_SOURCE, with OpenMP if the compiler has it, unless this machine's build is cached -> the path of
    the shared library."""
    compiler = shlex.split(os.environ.get("CC") or shutil.which("cc") or "gcc")  # CC may be "ccache gcc"
    source = C_SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(C_FLAGS).encode(), " ".join(compiler).encode(),
                                     platform.node().encode(), platform.machine().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("LEVIATHAN_CACHE") or Path.home() / ".cache" / "leviathan")
    library = cache / f"lev_kernels-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: never half a file
            built = Path(tmp) / library.name
            for openmp in (["-fopenmp"], []):
                command = [*compiler, *C_FLAGS, *openmp, str(C_SOURCE), "-o", str(built), "-lm"]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if result.returncode == 0:
                    break
            if result.returncode != 0:
                raise subprocess.CalledProcessError(result.returncode, command, result.stdout, result.stderr)
            os.replace(built, library)
    return library


def load_c_library(path):
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in C_TYPES.values():
        getattr(library, f"lev_forward_{name}").argtypes = [ptr] * 3 + [i64] * 5 + [ctypes.c_int] * 2
        getattr(library, f"lev_backward_{name}").argtypes = [ptr] * 5 + [i64] * 5 + [ctypes.c_int] * 2
    return library


def c_spline_product(t, S_padded, normalize):
    """SplineProduct's forward in C: t (U, h, d), S_padded (h*d, kappa + 2, r) -> M (U, h, r)."""
    (U, h, d), (n_padded, r) = t.shape, S_padded.shape[1:]
    check_c_operands(t, S_padded)
    t, S_padded = t.contiguous(), S_padded.contiguous()
    M = t.new_empty(U, h, r)
    forward = getattr(c_library(), f"lev_forward_{C_TYPES[t.dtype]}")
    forward(t.data_ptr(), S_padded.data_ptr(), M.data_ptr(), U, h, d, n_padded - 2, r, normalize,
            torch.get_num_threads())
    return M


def c_spline_product_backward(t, S_padded, G, normalize):
    """SplineProduct's backward in C, from G = dL/dM * M (U, h, r) -> dL/dt (U, h, d), dL/dS_padded."""
    (U, h, d), (n_padded, r) = t.shape, S_padded.shape[1:]
    check_c_operands(t, S_padded, G)
    t, S_padded, G = t.contiguous(), S_padded.contiguous(), G.contiguous()
    grad_t, grad_S = torch.empty_like(t), torch.zeros_like(S_padded)
    backward = getattr(c_library(), f"lev_backward_{C_TYPES[t.dtype]}")
    backward(t.data_ptr(), S_padded.data_ptr(), G.data_ptr(), grad_t.data_ptr(), grad_S.data_ptr(), U, h, d,
             n_padded - 2, r, normalize, torch.get_num_threads())
    return grad_t, grad_S


def check_c_operands(t, S_padded, *others):
    """The C kernels read raw memory: every operand on the CPU, in t's dtype (fp32 or fp64), in the shapes of
    section 4. (A t outside [0, 1], NaN included, reads nothing outside S: the kernels clamp its knot index;
    SplineProduct gives non-finite t NaN modes before calling them.)"""
    h, d = t.shape[1:]
    ok = (t.dtype in C_TYPES and all(x.device.type == "cpu" and x.dtype == t.dtype for x in (t, S_padded, *others))
          and S_padded.dim() == 3 and S_padded.shape[0] == h * d and S_padded.shape[1] >= 3
          and all(x.shape == (len(t), h, S_padded.shape[2]) for x in others))
    if not ok:
        raise ValueError(f"LEV's C kernels: operands of shapes {[tuple(x.shape) for x in (t, S_padded, *others)]}, "
                         f"dtypes {[x.dtype for x in (t, S_padded, *others)]}; expected (U, h, d), (h*d, kappa+2, "
                         f"r) and (U, h, r), all fp32 or all fp64 on the CPU")


def torch_spline_product(t, S_padded, chunk, compile, normalize):
    """SplineProduct's forward through torch's kernels, `chunk` ids at a time: t (U, h, d) -> M (U, h, r)."""
    M = t.new_empty(*t.shape[:2], S_padded.shape[2])
    for c in range(0, len(t), chunk):
        t_chunk = t[c:c + chunk]
        sign, log_abs, normal = run_kernel(log_mode_chunk, t_chunk, S_padded, math.gcd(t.shape[2], 8), normalize,
                                           compile=compile)
        if not normal:  # rare: one log per factor instead
            sign, log_abs, _ = log_mode_chunk(t_chunk, S_padded, 1, normalize)
        M[c:c + chunk] = sign * log_abs.exp()
    return M


def torch_spline_product_backward(t, S_padded, G, chunk, compile, normalize):
    """SplineProduct's backward through torch's kernels, from G = dL/dM * M -> dL/dt, dL/dS_padded."""
    grad_t, grad_S = torch.empty_like(t), torch.zeros_like(S_padded)
    for c in range(0, len(t), chunk):
        at = slice(c, c + chunk)
        grad_t[at], grad_S_chunk = run_kernel(log_mode_chunk_backward, t[at], S_padded, G[at], normalize,
                                              compile=compile)
        grad_S += grad_S_chunk
    return grad_t, grad_S


class SplineProduct(torch.autograd.Function):
    """The heavy core of LEV: unit coordinates t -> rank-1 separable modes M, recomputed in backward.

        phi[u, h, d, :] = sum_k w_k(t[u, h, d]) S[h, d, k, :]     (per-dimension spline, r outputs)
        M[u, h, :]      = prod_d phi[u, h, d, :]                   (sign and log|M| kept apart)

    Forward keeps only t, S (padded) and M; backward recomputes phi. kernels: "c" runs both passes in
    lev_kernels.c, which never holds phi; "compiled" and "eager" run torch's kernels (log_mode_chunk and
    log_mode_chunk_backward, through torch.compile or not) on `chunk` ids at a time, so that phi stays small.
    Only 3 knots of each basis are non-zero, and S is padded with a zero knot at each end so that knots j-1 and
    j+1 always exist. Inside the torch kernels the h*d seed dimensions come first, (h*d, u, r): each has its own
    S, so they are the batch axis of the gather and of the matmul for dL/dS.
    """

    @staticmethod
    def forward(ctx, t, S, chunk, kernels, normalize):
        U, h, d = t.shape
        n_knots, r = S.shape[2:]
        S_padded = F.pad(S, (0, 0, 1, 1)).view(h * d, n_knots + 2, r)
        # Weights that diverged give non-finite coordinates. The modes are then NaN (so is the loss, and train.py
        # stops cleanly) instead of a NaN becoming a knot index far out of range. Checked here, once, not inside
        # the kernels: a guard there costs ~50% of their time under torch.compile.
        ctx.finite = bool(torch.isfinite(t).all())
        ctx.chunk, ctx.kernels, ctx.normalize = chunk, kernels, normalize
        if not ctx.finite:
            M = t.new_full((U, h, r), float("nan"))
        elif kernels == "c":
            M = c_spline_product(t, S_padded, normalize)
        else:
            M = torch_spline_product(t, S_padded, chunk, kernels == "compiled", normalize)
        ctx.save_for_backward(t, S_padded, M)
        return M

    @staticmethod
    @once_differentiable  # the kernels are not themselves differentiated: no double backward
    def backward(ctx, grad_M):
        t, S_padded, M = ctx.saved_tensors
        h, d = t.shape[1:]
        n_padded, r = S_padded.shape[1:]
        if not ctx.finite:
            return torch.full_like(t, float("nan")), S_padded.new_full((h, d, n_padded - 2, r), float("nan")), \
                None, None, None
        with torch.autocast(t.device.type, enabled=False):  # fp32 like the forward, even if called under autocast
            G = grad_M * M  # dL/dM * M, shared by the d factors of a mode
            if ctx.kernels == "c":
                grad_t, grad_S = c_spline_product_backward(t, S_padded, G, ctx.normalize)
            else:
                grad_t, grad_S = torch_spline_product_backward(t, S_padded, G, ctx.chunk, ctx.kernels == "compiled",
                                                               ctx.normalize)
        return grad_t, grad_S.view(h, d, n_padded, r)[:, :, 1:-1], None, None, None


class EmbeddingCache:
    """LEV's embeddings of the ids one generation (or evaluation) call has met: each computed on first use, then
    looked up. It belongs to that call (GPT.stream makes one per call), so the weights cannot change while it
    lives, and nothing has to detect that they did: a new call starts empty."""

    def __init__(self, lev):
        self.lev = lev
        self.slot = None  # (V,) row of each id in rows, -1 when not computed yet
        self.rows = None  # (n_cached, n_embd)

    def lookup(self, ids):
        """ids: (U,) distinct -> (U, n_embd)."""
        if self.slot is None:
            self.slot = torch.full((self.lev.vocab_size,), -1, dtype=torch.long, device=ids.device)
            self.rows = self.lev.out_proj.new_empty(0, self.lev.n_embd)
        new = ids[self.slot[ids] < 0]
        if len(new):
            self.slot[new] = torch.arange(len(new), device=ids.device) + len(self.rows)
            self.rows = torch.cat([self.rows, self.lev.embed_distinct(new)])
        return self.rows[self.slot[ids]]


# ----------------------------------------------------------------------------------------------------------
# 5. The memory-lean head: logits and cross-entropy a chunk of tokens at a time, never all at once
#
# For N tokens and a V-word vocabulary the plain head (GPT.forward with lean_head off) materialises N x V logits,
# and autograd keeps them (and the log-softmax, and their gradient) alive: 1.6 GB each for 2,048 tokens at
# V = 200,376 in fp32. linear_cross_entropy holds only chunk x V logits at once, with the same loss and gradients
# (tests/test_lean_head.py, float64). The idea of Cut Cross-Entropy and of Liger's fused linear cross-entropy.

CHUNK_MIB = 256  # default size of one chunk's fp32 logits; see default_chunk_size


def default_chunk_size(vocab_size, mib=CHUNK_MIB):
    """Tokens per chunk such that a chunk's fp32 logits take about `mib` MiB (at least 16 tokens): the head's
    scratch memory stays fixed whatever V is. 256 MiB: 1,335 tokens at V = 50,257, 334 at V = 200,376. Measured
    with bench_head.py on 2 CPU cores (D = 128, 2,048 tokens): chunks of 512 tokens or more run the head at full
    speed, smaller ones slower (the matmuls get thin: 128 tokens took 1.15x the time of 512 at V = 200,376, 1.7x at
    50,257), while each 128 tokens cost V / 2,048 MiB more (fp32; 1.5x that under bf16 autocast)."""
    return max(16, mib * 2**20 // (4 * vocab_size))


def autocast_dtype(x, weight):
    """The dtype the head's matmul runs in: autocast's (e.g. bf16) when it is on for this device, as F.linear
    would under autocast (float64 stays float64, as autocast leaves it), else the inputs' own dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (x.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but weight is {weight.dtype}; F.linear needs them equal (or autocast)")
    return x.dtype


class Buffers:
    """One chunk's scratch tensors, allocated once per pass and reused by every chunk: fresh chunk x V tensors for
    each chunk would each cost page faults (large allocations are mmap'ed afresh) and slow the loop down."""

    def __init__(self, chunk, weight, dtype, acc_dtype):
        V = weight.shape[0]
        self.w = weight.to(dtype)  # (V, D) the head in the matmul's dtype (no copy when it already is)
        self.z = weight.new_empty(chunk, V, dtype=acc_dtype)  # (C, V) logits, then softmax, then dL/dlogits
        self.low = weight.new_empty(chunk, V, dtype=dtype) if dtype != acc_dtype else None  # (C, V) bf16 copy
        self.low_w = None  # (V, D) backward's bf16 product, made on first use

    def logits(self, x_c):
        """x_c: (n, D) -> (n, V) logits in acc_dtype: the matmul in the head's dtype (bf16 under autocast,
        rounded to bf16 like F.linear's output), widened to fp32 for the exp and the log (like `.float()`)."""
        n = len(x_c)
        if self.low is None:
            return torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.z[:n])
        torch.mm(x_c.to(self.w.dtype), self.w.t(), out=self.low[:n])
        return self.z[:n].copy_(self.low[:n])

    def accumulate(self, grad_w, g, x_c):
        """grad_w += g^T x_c in place, in fp32 even when g and x_c are bf16: a fresh (V, D) product per chunk
        would cost an allocation and its page faults each time, and summing chunks in bf16 would lose bits."""
        if grad_w.dtype == g.dtype:
            grad_w.addmm_(g.t(), x_c)
            return
        if self.low_w is None:
            self.low_w = torch.empty_like(self.w)  # (V, D) in the matmul's dtype
        grad_w += torch.mm(g.t(), x_c, out=self.low_w)

    def low_precision(self, z):
        """(n, V) acc_dtype -> the same values in the matmul's dtype, for the two backward matmuls."""
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
    """One chunk's gradients from its softmax probs (n, V), overwritten: g = scale_c * (probs - onehot(target)),
    grad_x_c[:] = g W and grad_w += g^T x_c, each unless it is None. scale_c: (n, 1), 0 at ignored tokens."""
    probs.scatter_add_(1, safe_c[:, None], -torch.ones_like(scale_c))  # - onehot(target)
    g = buf.low_precision(probs.mul_(scale_c))  # (n, V) dL/dlogits, in the matmul's dtype
    if grad_x_c is not None:
        grad_x_c[:] = g @ buf.w  # (n, D)
    if grad_w is not None:
        buf.accumulate(grad_w, g, x_c)  # (V, D)


def new_grads(ctx, x, weight, acc_dtype):
    """dL/dx (N, D), filled chunk by chunk, and a zeroed dL/dW (V, D) that sums over the chunks (so in fp32 even
    for a bf16 weight); None for an input that needs no gradient."""
    grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
    need_w = ctx.needs_input_grad[1]
    return grad_x, torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, acc_dtype)) if need_w else None


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of the logits x @ W^T, token i with target t_i (0 where t_i == ignore_index):

        z_i    = W x_i                          (V,)  logits, never all N rows at once
        lse_i  = log sum_v exp(z_iv)            the log-sum-exp, the only (N,) thing forward keeps
        loss_i = lse_i - z_{i,t_i}
        dloss_i/dz_i = softmax(z_i) - onehot(t_i) = exp(z_i - lse_i) - onehot(t_i)

    so with g_i = grad_i * (exp(z_i - lse_i) - onehot(t_i)) (grad_i: the incoming gradient of loss_i):
    dL/dx_i = g_i W and dL/dW = sum_i g_i^T x_i. Forward saves x, W (both alive anyway), the targets and lse;
    backward recomputes z chunk by chunk. The exp, the log and g are in fp32 (fp64 for fp64 inputs) even when
    the matmuls run in bf16 under autocast.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, dtype):
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)  # (N,) any real id where ignored: gather needs one
        acc_dtype = torch.promote_types(dtype, torch.float32)
        lse, loss = (x.new_empty(len(x), dtype=acc_dtype) for _ in range(2))  # (N,), (N,)
        with torch.autocast(x.device.type, enabled=False):  # dtypes handled explicitly in Buffers.logits
            buf = Buffers(min(chunk, len(x)), weight, dtype, acc_dtype)
            for c in range(0, len(x), chunk):
                at = slice(c, c + chunk)
                lse[at], loss[at], _ = chunk_forward(buf, x[at], safe[at], valid[at])
        ctx.save_for_backward(x, weight, safe, valid, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # backward is not itself differentiable: no double backward
    def backward(ctx, grad_loss):
        x, weight, safe, valid, lse = ctx.saved_tensors
        # (N,) 0 at ignored tokens, even where grad_loss is inf or NaN (a "mean" over no token divides by 0)
        scale = torch.where(valid, grad_loss, 0.0).to(lse.dtype)
        grad_x, grad_w = new_grads(ctx, x, weight, lse.dtype)  # (N, D), (V, D)
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(ctx.chunk, len(x)), weight, ctx.dtype, lse.dtype)
            for c in range(0, len(x), ctx.chunk):
                at = slice(c, c + ctx.chunk)
                x_c = x[at].to(ctx.dtype)  # (n, D)
                probs = buf.logits(x_c).sub_(lse[at, None]).exp_()  # (n, V) recomputed softmax
                chunk_backward(buf, probs, x_c, safe[at], scale[at, None], None if grad_x is None else grad_x[at],
                               grad_w)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


class LinearCrossEntropyEager(torch.autograd.Function):
    """The summed (or averaged) cross-entropy of x @ W^T with its gradients computed during forward, chunk by
    chunk, from the softmax forward has just made: no recomputation, so the head costs the same three matmuls
    as the usual one (logits, dL/dx, dL/dW), and the exp runs once instead of twice. Possible because the loss is
    a scalar: its incoming gradient only scales the saved dL/dx (N, D) and dL/dW (V, D). Formulas: as
    LinearCrossEntropy, with grad_i = 1 (sum) or 1 / (number of counted tokens) (mean).
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, dtype, mean):
        valid = targets != ignore_index  # (N,)
        safe = torch.where(valid, targets, 0)  # (N,)
        acc_dtype = torch.promote_types(dtype, torch.float32)
        count = valid.sum()  # a tensor, not a Python int: no device sync
        scale = valid.to(acc_dtype)[:, None]  # (N, 1) 1, or 0 at ignored tokens
        if mean:
            scale /= count.clamp(min=1)  # gradients 0, not NaN, when every target is ignored (as F.cross_entropy)
        loss = x.new_empty(len(x), dtype=acc_dtype)  # (N,)
        grad_x, grad_w = new_grads(ctx, x, weight, acc_dtype)  # (N, D), (V, D)
        with torch.autocast(x.device.type, enabled=False):
            buf = Buffers(min(chunk, len(x)), weight, dtype, acc_dtype)
            for c in range(0, len(x), chunk):
                at = slice(c, c + chunk)
                x_c = x[at].to(dtype)  # (n, D)
                _, loss[at], denominator = chunk_forward(buf, x_c, safe[at], valid[at])
                probs = buf.z[:len(x_c)].div_(denominator)  # (n, V) softmax, from exp(z - max)
                chunk_backward(buf, probs, x_c, safe[at], scale[at], None if grad_x is None else grad_x[at], grad_w)
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        return loss.sum() / count if mean else loss.sum()  # 0 / 0 = NaN when every target is ignored

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        # in place: the saved gradients are used once (a second backward through this graph raises, as usual)
        return (None if grad_x is None else grad_x.mul_(grad_loss), None if grad_w is None else grad_w.mul_(grad_loss),
                None, None, None, None, None)


# under a model-wide torch.compile it runs as it is (a graph break), like LEV: its chunk loop and reused buffers are
# the point, and they are not what inductor would make of it
@torch.compiler.disable
def linear_cross_entropy(x, weight, targets, chunk_size=None, ignore_index=-1, reduction="mean", recompute=False):
    """Cross-entropy of the head's logits x @ weight^T against targets, without ever holding all the logits.

    x: (..., D) final hidden states, weight: (V, D) the head (tied to an embedding or not: gradients reach the
    Parameter through autograd as usual), targets: (...) ids, ignore_index where a token does not count.
    chunk_size: tokens per chunk (default: default_chunk_size(V), ~256 MiB of fp32 logits).
    reduction: "mean" over counted tokens (NaN when none counts, as F.cross_entropy), "sum", or "none": per-token
    losses shaped like targets, 0 at ignored tokens. The loss is fp32 (fp64 for fp64 inputs).
    recompute: how backward gets its gradients. False (and reduction "mean" or "sum", gradients wanted):
    forward computes them as it goes (LinearCrossEntropyEager), three matmuls as the usual head, but forward
    keeps dL/dW (V x D), and does that work even if backward never runs. True (and always for "none", or without
    gradients): forward keeps only the per-token log-sum-exp and backward recomputes the logits
    (LinearCrossEntropy): one more matmul.

    Same value and gradients as F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=ignore_index,
    reduction=reduction), autocast included, with memory O(chunk_size x V) instead of O(N x V).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: choose mean, sum or none")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    x2, t1, dtype = x.reshape(-1, x.shape[-1]), targets.reshape(-1), autocast_dtype(x, weight)  # (N, D), (N,)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if reduction != "none" and wants_grad and not recompute:
        return LinearCrossEntropyEager.apply(x2, weight, t1, chunk, ignore_index, dtype, reduction == "mean")
    per_token = LinearCrossEntropy.apply(x2, weight, t1, chunk, ignore_index, dtype)  # (N,)
    if reduction == "none":
        return per_token.view(targets.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (targets != ignore_index).sum()  # 0 / 0 = NaN when every target is ignored


# ----------------------------------------------------------------------------------------------------------
# 6. Decoding one token at a time: the head laid out for it, and GPT.forward's arithmetic in fewer operations
#
# A one-token step of the CPU config (4 x 4 x 128, V = 50,257) does ~1.6 MFLOP in the backbone and reads the
# 25 MB head: it costs the head's memory traffic plus a few microseconds of overhead per operation, whatever the
# operation's size. DecodeHead lays the head out for MKL's matrix-vector product, one block of columns per
# thread; Decoder runs the step in 13 operations per block instead of GPT.forward's ~30, on weights laid out
# once per generation call. Measured on this project's CPU, 1 thread, greedy steps of a tied model (scratch
# timing): forward 0.89 -> Decoder 0.56 ms per token at V = 1,024, where the head costs little; 2.56 -> 2.19 ms
# at V = 50,257, where its 25 MB, read from memory every token, also push the backbone's weights out of cache.


class DecodeHead:
    """The head of one generation call, laid out for one token at a time: head(x (B, n_embd)) -> logits (B, V).

    Decoding multiplies one hidden state by the head per token: a matrix-vector product that reads all V x n_embd
    weights to do 2 FLOPs with each. On CPU, MKL runs x @ W.T with W row-major ~4x slower than x @ W_T with a
    contiguous W_T (3.6 vs 0.9 ms at V = 50,257, n_embd = 128, 1 or 2 threads: the head was 80% of the time
    per token), so one generation call pays one transposed copy (25 MB there; 1.6 GB at the paper's V = 200,376
    and n_embd = 2,048) and reuses it for every token. With several threads the copy is cut into one block of
    columns per thread, (threads, n_embd, V / threads), multiplied as one batched matmul: each thread streams its
    own block, and the head, bound by memory traffic, takes 0.44-0.59 instead of 0.92-0.94 ms at 2 threads (one
    matmul of a single row runs on one thread). The logits are the same sums in another order (tests/test_leviathan.py).
    GPUs run both layouts alike, and a copy of a large head would cost GPU memory: there the weight is used as
    it is."""

    def __init__(self, weight):
        weight = weight.detach()
        self.vocab_size, n_embd = weight.shape
        threads = torch.get_num_threads() if weight.device.type == "cpu" else 1
        if threads == 1:
            self.weight_T, self.blocks = right_operand(weight), None
        else:
            width = -(-self.vocab_size // threads)  # columns per block; the last one padded with zeros
            padded = F.pad(weight, (0, 0, 0, threads * width - self.vocab_size))  # (threads * width, n_embd)
            self.weight_T, self.blocks = None, padded.view(threads, width, n_embd).transpose(1, 2).contiguous()

    def __call__(self, x):
        if self.blocks is None:
            return x @ self.weight_T
        threads, _, width = self.blocks.shape
        logits = torch.bmm(x.expand(threads, *x.shape), self.blocks)  # (threads, B, width)
        return logits.transpose(0, 1).reshape(len(x), threads * width)[:, :self.vocab_size]


class Decoder:
    """GPT.forward(idx, cache=cache) for one new token per sequence, idx: (B, 1), after what the cache holds: the
    same function (tests/test_leviathan.py, float64), built per generation call from the model's weights.

    Per block: rms_norm; qkv matmul; rotation of queries and keys (apply_rotary's products and sums, with tables
    the width of a head); the new key and value into the cache; attention; output projection and residual as one
    addmm (add_matmul); rms_norm; gate and up matmuls; silu; product; down projection and residual as one addmm.
    No dropout: GPT.stream uses it only where dropout is off."""

    def __init__(self, model, head=None):
        c = model.config
        self.model, self.n_head, self.head_size = model, c.n_head, c.n_embd // c.n_head
        # the norms' forward, called without the module call's overhead (~1 us, 9 times per token)
        self.blocks = [dict(attn_norm=b.attn_norm.forward, qkv=right_operand(b.attn.qkv.weight),
                            proj=right_operand(b.attn.proj.weight), mlp_norm=b.mlp_norm.forward,
                            gate=right_operand(b.mlp.gate.weight), up=right_operand(b.mlp.up.weight),
                            down=right_operand(b.mlp.down.weight)) for b in model.blocks]
        self.head = head if head is not None else DecodeHead(model.lm_head.weight)
        # rotary tables the width of a head: x * [cos, cos] + roll(x, hs/2) * [-sin, sin] rotates as apply_rotary
        cos, sin = model.rope_cos.flatten(1), model.rope_sin.flatten(1)  # (block_size, hs/2)
        self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # (block_size, hs)

    def step(self, idx, cache):
        """idx: (B, 1) -> logits (B, 1, V); the token's keys and values join cache.kv."""
        kv, model = cache.kv, self.model
        B, pos = idx.shape[0], kv.pos
        if idx.shape[1] != 1 or pos >= model.config.block_size:
            raise ValueError(f"Decoder.step takes one token into a cache with room: got {idx.shape[1]} at {pos}")
        x = model.embed(idx, cache).view(B, -1)  # (B, C)
        cos, sin = self.cos[pos], self.sin[pos]  # (hs,)
        for layer, w in enumerate(self.blocks):
            qkv = (w["attn_norm"](x) @ w["qkv"]).view(B, 3, self.n_head, self.head_size)
            qk = qkv[:, :2]  # queries and keys, rotated as in apply_rotary: x1 cos - x2 sin | x2 cos + x1 sin
            qk = qk * cos + qk.roll(self.head_size // 2, dims=-1) * sin  # (B, 2, nh, hs)
            k, v = kv.update(layer, qk[:, 1].unsqueeze(2), qkv[:, 2].unsqueeze(2))  # (B, nh, pos + 1, hs)
            y = F.scaled_dot_product_attention(qk[:, 0].unsqueeze(2), k, v)  # (B, nh, 1, hs)
            x = add_matmul(x, y.view(B, -1), w["proj"])  # x + proj(y)
            h = w["mlp_norm"](x)
            x = add_matmul(x, F.silu(h @ w["gate"]) * (h @ w["up"]), w["down"])  # x + down(silu(gate) * up)
        kv.pos += 1
        return self.head(model.norm.forward(x)).view(B, 1, -1)


def add_matmul(x, y, w):
    """x + y @ w, the residual stream plus a projection, as one addmm where that is the same arithmetic. Under
    autocast addmm would return bf16/fp16 and the residual stream would lose forward's fp32 (where
    x + proj(y) promotes back), so there it is a matmul and an add, as in forward."""
    if torch.is_autocast_enabled(x.device.type):
        return x + y @ w
    return torch.addmm(x, y, w)


def right_operand(weight):
    """A (out, in) weight -> (in, out), for x @ W_T: a contiguous copy on CPU (DecodeHead says why), the transposed
    view elsewhere."""
    weight = weight.detach().T
    return weight.contiguous() if weight.device.type == "cpu" else weight


def set_runtime(model, lev_chunk=None, lev_compile=None, lean_head=None, compile_decode=None, lev_c_kernels=None):
    """Set a model's run settings, the ones that change speed and memory but not results, kept out of Config and
    checkpoints: whether LEV runs its C kernels on CPU, its torch kernels' ids per chunk and whether training
    compiles those (no-ops for the table arms), whether forward computes the loss with the memory-lean head, and
    whether generation runs its one-token steps through torch.compile (compile_decode).

    compile_decode compiles GPT.hidden (all but the head) for single tokens only, in place of the Decoder: a
    window's first tokens (the prompt, or the half block after a jump) run eagerly, so the compiled graph meets one
    shape, T = 1, and the KV cache's position becomes its one dynamic number after the second token (two
    compilations, not one per position). The head (DecodeHead) runs eagerly on MKL."""
    if compile_decode is not None:
        model.decode_step = torch.compile(model.hidden) if compile_decode else None
    if isinstance(model.tok_emb, LEV):
        if lev_chunk is not None:
            model.tok_emb.chunk = lev_chunk
        if lev_compile is not None:
            model.tok_emb.compile_kernels = lev_compile
        if lev_c_kernels is not None:
            model.tok_emb.c_kernels = lev_c_kernels
    if lean_head is not None:
        model.lean_head = lean_head


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
