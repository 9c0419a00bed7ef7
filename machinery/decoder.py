"""Fast decoding: the head laid out for one token at a time, and the one-token steps in fewer
operations.

Tested equal to the model's plain generation (leviathan.GPT.stream with no fast path installed): the
same tokens, and in float64 the same logits (tests/test_decoder.py). A one-token step of a small
model does little arithmetic in the backbone and reads the whole V x n_embd head: it costs the
head's memory traffic plus a few microseconds of overhead per operation, whatever the operation's
size. DecodeHead lays the head out for MKL's matrix-vector product, one block of columns per thread;
Decoder runs the step in 13 operations per block instead of GPT.forward's ~30, on weights laid out
once per generation call; EmbeddingCache (fast_lev.py) computes each id's LEV embedding once per
call. docs/speed.md has the measurements.

set_runtime (runtime.py) installs a FastDecoding as the model's GPT.fast_decoding; GPT.stream calls
it once per generation call, and the DecodeSession it returns computes the last position's logits.
"""

import torch
import torch.nn.functional as F

from machinery.fast_lev import EmbeddingCache


class FastDecoding:
    """GPT.fast_decoding: model -> a DecodeSession, once per generation call. lev_cache: the lev
    arm's EmbeddingCache; compiled_backbone: GPT.backbone through torch.compile for the one-token
    steps, in place of the Decoder (None: the Decoder)."""

    def __init__(self, lev_cache=True, compiled_backbone=None):
        self.lev_cache, self.compiled_backbone = lev_cache, compiled_backbone

    def __call__(self, model):
        return DecodeSession(model, self.lev_cache, self.compiled_backbone)


class DecodeSession:
    """(tokens (B, T), kv_cache or None) -> the last position's logits (B, 1, V):
    GPT.forward(tokens, kv_cache=kv_cache)'s, for one generation call, whose weights cannot change
    while it lasts.

    One-token steps into a KV cache run through the compiled backbone if there is one (a window's
    first tokens run eagerly, so that the compiled graph meets one shape, T = 1, and the cache's
    position becomes its one dynamic number after the second token: two compilations, not one per
    position), else through the Decoder; no Decoder in training mode with dropout, which it does not
    apply. The head is always the DecodeHead, eager (on CPU, MKL)."""

    def __init__(self, model, lev_cache, compiled_backbone):
        self.model, self.compiled_backbone = model, compiled_backbone
        lev = model.config.embedding == "lev"
        self.embeddings = EmbeddingCache(model.tok_emb) if lev_cache and lev else None
        self.head = DecodeHead(model.lm_head.weight)
        dropping = model.training and model.config.dropout > 0
        use_decoder = compiled_backbone is None and not dropping
        self.decoder = Decoder(model, self.head) if use_decoder else None

    def embed(self, idx):
        if self.embeddings is None:
            return self.model.embed(idx)
        return self.model.tok_emb(idx, self.embeddings.lookup)  # LEV checks its ids itself

    def __call__(self, idx, kv_cache):
        x = self.embed(idx)  # (B, T, n_embd)
        if kv_cache is not None and idx.shape[1] == 1:
            if self.compiled_backbone is not None:
                return self.head(self.compiled_backbone(x, kv_cache)[:, -1]).unsqueeze(1)
            if self.decoder is not None:
                return self.decoder.step(x, kv_cache)
        return self.head(self.model.backbone(x, kv_cache)[:, -1]).unsqueeze(1)


class DecodeHead:
    """The head of one generation call, laid out for one token at a time:
    head(x (B, n_embd)) -> (B, V).

    Decoding multiplies one hidden state by the head per token: a matrix-vector product that reads
    all V x n_embd weights to do 2 FLOPs with each. On CPU, MKL runs x @ W.T with W row-major
    several times slower than x @ W_T with a contiguous W_T (docs/speed.md), so one generation call
    pays one transposed copy (V x n_embd numbers: 1.6 GB at the paper's V = 200,376 and n_embd =
    2,048 in fp32) and reuses it for every token. With several threads the copy is cut into one
    block of columns per thread, (threads, n_embd, V / threads), multiplied as one batched matmul:
    each thread streams its own block (one matmul of a single row runs on one thread). The logits
    are the same sums in another order (tests/test_decoder.py). GPUs run both layouts alike, and a
    copy of a large head would cost GPU memory: there the weight is used as it is."""

    def __init__(self, weight):
        weight = weight.detach()
        self.vocab_size, n_embd = weight.shape
        threads = torch.get_num_threads() if weight.device.type == "cpu" else 1
        if threads == 1:
            self.weight_T, self.blocks = right_operand(weight), None
        else:
            # columns per block; the last one padded with zeros: padded is (threads * width, C)
            width = -(-self.vocab_size // threads)
            padded = F.pad(weight, (0, 0, 0, threads * width - self.vocab_size))
            self.weight_T = None
            self.blocks = padded.view(threads, width, n_embd).transpose(1, 2).contiguous()

    def __call__(self, x):
        if self.blocks is None:
            return x @ self.weight_T
        threads, _, width = self.blocks.shape
        logits = torch.bmm(x.expand(threads, *x.shape), self.blocks)  # (threads, B, width)
        return logits.transpose(0, 1).reshape(len(x), threads * width)[:, :self.vocab_size]


class Decoder:
    """GPT.backbone and the head for one new token per sequence, after what the KV cache holds: the
    same function (tests/test_decoder.py, float64), built per generation call from the model's
    weights.

    Per block: rms_norm; qkv matmul; rotation of queries and keys (apply_rotary's products and sums,
    with tables the width of a head); the new key and value into the cache; attention; output
    projection and residual as one addmm (add_matmul); rms_norm; gate and up matmuls; silu; product;
    down projection and residual as one addmm. No dropout: DecodeSession uses it only where dropout
    is off."""

    def __init__(self, model, head=None):
        c = model.config
        self.model, self.n_head, self.head_size = model, c.n_head, c.n_embd // c.n_head
        # the norms' forward, called without the module call's overhead (~1 us, 9 times per token)
        self.blocks = [dict(attn_norm=b.attn_norm.forward, qkv=right_operand(b.attn.qkv.weight),
                            proj=right_operand(b.attn.proj.weight), mlp_norm=b.mlp_norm.forward,
                            gate=right_operand(b.mlp.gate.weight),
                            up=right_operand(b.mlp.up.weight),
                            down=right_operand(b.mlp.down.weight)) for b in model.blocks]
        self.head = head if head is not None else DecodeHead(model.lm_head.weight)
        # rotary tables the width of a head: x * [cos, cos] + roll(x, hs/2) * [-sin, sin] rotates as
        # apply_rotary does
        cos, sin = model.rope_cos.flatten(1), model.rope_sin.flatten(1)  # (block_size, hs/2)
        # both (block_size, hs)
        self.cos, self.sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)

    def step(self, x, kv):
        """x: (B, 1, n_embd) input embeddings -> logits (B, 1, V); the token's keys and values join
        kv."""
        B, pos = x.shape[0], kv.pos
        if x.shape[1] != 1 or pos >= self.model.config.block_size:
            raise ValueError(f"Decoder.step takes one token into a cache with room: "
                             f"got {x.shape[1]} at {pos}")
        x = x.view(B, -1)  # (B, C)
        cos, sin = self.cos[pos], self.sin[pos]  # (hs,)
        for layer, w in enumerate(self.blocks):
            qkv = (w["attn_norm"](x) @ w["qkv"]).view(B, 3, self.n_head, self.head_size)
            # queries and keys, rotated as apply_rotary: x1 cos - x2 sin | x2 cos + x1 sin
            qk = qkv[:, :2]
            qk = qk * cos + qk.roll(self.head_size // 2, dims=-1) * sin  # (B, 2, nh, hs)
            # k, v: (B, nh, pos + 1, hs)
            k, v = kv.update(layer, qk[:, 1].unsqueeze(2), qkv[:, 2].unsqueeze(2))
            y = F.scaled_dot_product_attention(qk[:, 0].unsqueeze(2), k, v)  # (B, nh, 1, hs)
            x = add_matmul(x, y.view(B, -1), w["proj"])  # x + proj(y)
            h = w["mlp_norm"](x)
            gated = F.silu(h @ w["gate"]) * (h @ w["up"])
            x = add_matmul(x, gated, w["down"])  # x + down(silu * up)
        kv.pos += 1
        return self.head(self.model.norm.forward(x)).view(B, 1, -1)


def add_matmul(x, y, w):
    """x + y @ w, the residual stream plus a projection, as one addmm where that is the same
    arithmetic. Under autocast addmm would return bf16/fp16 and the residual stream would lose
    forward's fp32 (where x + proj(y) promotes back), so there it is a matmul and an add, as in
    forward."""
    if torch.is_autocast_enabled(x.device.type):
        return x + y @ w
    return torch.addmm(x, y, w)


def right_operand(weight):
    """A (out, in) weight -> (in, out), for x @ W_T: a contiguous copy on CPU (DecodeHead says why),
    the transposed view elsewhere."""
    weight = weight.detach().T
    return weight.contiguous() if weight.device.type == "cpu" else weight
