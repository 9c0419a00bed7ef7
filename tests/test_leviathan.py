"""Tests of leviathan.py: the three model arms, LEV's fast path against its plain reference, generation with and
without the KV cache, sampling, parameter counts, optimizer groups and checkpoints.

Everything is hermetic and runs on CPU in about 10 CPU-seconds: tiny models (V=61, block_size=16, n_embd=32) and,
where exactness matters, float64.
Run:  python -m pytest -q tests/test_leviathan.py
"""

import dataclasses
import math
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so that plain `pytest` finds leviathan.py too
from conftest import lev_param_count  # noqa: E402

import leviathan  # noqa: E402
from common import CHECKPOINT_VERSION, load_checkpoint  # noqa: E402
from leviathan import (  # noqa: E402
    EMBEDDINGS,
    GPT,
    LEV,
    Config,
    DecodeCache,
    DecodeHead,
    Decoder,
    EmbeddingCache,
    KVCache,
    SplineProduct,
    bspline_basis,
    bspline_weights3,
    c_library,
    digit_base,
    sample_next,
    signed_log_product,
    spline_3knots,
    spline_3knots_indexing,
)

V = 61  # not a perfect cube: base 4, so digits 4**3 = 64 > 61 ids leave some digit combinations unused
BLOCK = 16
arms = pytest.mark.parametrize("arm", EMBEDDINGS)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_config(arm, **overrides):
    settings = dict(vocab_size=V, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, embedding=arm,
                    lev_seed_dim=16, lev_heads=2, lev_rank=8)
    return Config(**{**settings, **overrides})


def tiny_model(arm, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(arm, **overrides))


def lev_config(vocab_size=V, n_embd=12, **lev):
    """A Config for LEV alone (the backbone settings do not matter to it)."""
    return Config(vocab_size=vocab_size, n_embd=n_embd, n_head=1, **lev)


def tiny_lev(seed=0, dtype=torch.float64, d_seed=16, chunk=5, vocab_size=V, normalize=True, kernels="c", rank=4):
    """A small LEV in float64 (so fast path and reference agree to ~1e-15). kernels: "c" (lev_kernels.c; the
    test is skipped without a C compiler) or "torch" (torch's kernels, with a chunk smaller than most batches so
    that chunking is exercised by default)."""
    torch.manual_seed(seed)
    lev = LEV(lev_config(vocab_size, lev_digits=3, lev_seed_dim=d_seed, lev_heads=2, lev_knots=8, lev_rank=rank,
                         lev_normalize_basis=normalize))
    lev.chunk = chunk
    use_kernels(lev, kernels)
    return lev.to(dtype)


KERNELS = pytest.mark.parametrize("kernels", ["c", "torch"])


def skip_without_c_kernels():
    if c_library() is None:
        pytest.skip("no C compiler for lev_kernels.c")


def use_kernels(lev, kernels):
    """Make LEV run its C kernels (skip the test where they cannot be built) or torch's."""
    if kernels == "c":
        skip_without_c_kernels()
    lev.c_kernels = kernels == "c"


def random_ids(*shape, seed=0, high=V):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def values_and_grads(lev, embed, idx, weight):
    """E = embed(idx) and the gradient of every LEV parameter of the non-trivial loss (E * weight).sum()."""
    lev.zero_grad(set_to_none=True)
    E = embed(idx)
    (E * weight).sum().backward()
    return E.detach().clone(), {name: p.grad.clone() for name, p in lev.named_parameters()}


def assert_same_values_and_grads(got, want, **tol):
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **tol, msg=lambda m, n=name: f"grad of {n}: {m}")


# ----------------------------------------------------------------------------------------------------------
# The model: shapes, loss at init, causality, gradients, overfitting, tying


@arms
def test_forward_shapes(arm):
    model = tiny_model(arm)
    idx, targets = random_ids(3, 10, seed=1), random_ids(3, 10, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, V) and loss.shape == () and loss.dtype == torch.float32
    logits, loss = model(idx)
    assert logits.shape == (3, 1, V) and loss is None
    # the last-position logits of the two calls agree
    torch.testing.assert_close(logits[:, 0], model(idx, targets)[0][:, -1])


@arms
def test_loss_at_init_is_near_log_vocab(arm):
    model = tiny_model(arm, vocab_size=500)
    _, loss = model(random_ids(8, BLOCK, seed=1, high=500), random_ids(8, BLOCK, seed=2, high=500))
    assert abs(loss.item() - math.log(500)) < 0.1, f"loss {loss.item():.3f} vs ln(V) = {math.log(500):.3f}"


@arms
def test_targets_minus_one_are_ignored(arm):
    model = tiny_model(arm)
    idx, targets = random_ids(2, 12, seed=1), random_ids(2, 12, seed=2)
    masked = targets.clone()
    masked[:, :5] = -1
    logits, loss = model(idx, masked)
    expected = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, V), targets[:, 5:].reshape(-1))
    torch.testing.assert_close(loss, expected)


@arms
def test_causal(arm):
    """Changing token t changes no logit before t (and does change the logits at t)."""
    model = tiny_model(arm).double()
    idx = random_ids(2, BLOCK, seed=1)

    def all_logits(x):
        return model(x, targets=x)[0]  # targets only to get the logits of every position

    before = all_logits(idx)
    for t in (0, 5, BLOCK - 1):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1 + torch.arange(2)) % V
        after = all_logits(changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-12)
        assert (after[:, t] - before[:, t]).abs().max() > 1e-6


@arms
def test_gradients_are_finite_and_reach_every_parameter(arm):
    model = tiny_model(arm)
    _, loss = model(random_ids(4, BLOCK, seed=1), random_ids(4, BLOCK, seed=2))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


@arms
def test_overfits_one_batch(arm):
    model = tiny_model(arm, n_layer=1)
    optimizer = model.configure_optimizers(weight_decay=0.0, learning_rate=1e-2)
    idx, targets = random_ids(4, BLOCK, seed=1), random_ids(4, BLOCK, seed=2)
    losses = []
    for _ in range(60):
        _, loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], f"loss went from {losses[0]:.3f} to {losses[-1]:.3f} only"


@arms
def test_tied_arm_shares_storage(arm):
    model = tiny_model(arm)
    embedding_storage = {p.data_ptr() for p in model.tok_emb.parameters()}
    assert (model.lm_head.weight.data_ptr() in embedding_storage) == (arm == "tied")
    assert (model.lm_head.weight is getattr(model.tok_emb, "weight", None)) == (arm == "tied")
    report = model.param_report()
    assert report["total"] == sum(p.numel() for p in model.parameters())
    assert report["input_embedding"] + report["backbone"] + report["head"] == report["total"]
    assert report["head"] == (0 if arm == "tied" else V * 32)


@arms
def test_sequence_longer_than_block_size_raises(arm):
    model = tiny_model(arm)
    with pytest.raises(ValueError, match=f"longer than block_size={BLOCK}"):
        model(random_ids(1, BLOCK + 1))


@arms
@pytest.mark.parametrize("bad", [-1, V])
def test_out_of_range_ids_raise_value_error(arm, bad):
    model = tiny_model(arm)
    idx = torch.tensor([[0, 5, bad, 3]])
    pattern = f"token id {bad} .*" + re.escape(f"[0, {V})")
    with pytest.raises(ValueError, match=pattern):
        model(idx)
    with pytest.raises(ValueError, match=pattern), torch.no_grad():
        model(idx)
    if arm == "lev":
        with pytest.raises(ValueError, match=pattern):
            model.tok_emb(idx)
        with pytest.raises(ValueError, match=pattern):
            model.tok_emb.reference(idx)


@pytest.mark.parametrize("overrides, message", [
    (dict(embedding="lookup"), "embedding='lookup'; choose one of lev, tied, untied"),
    (dict(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
    (dict(n_embd=36, n_head=4), "head size .* must be even"),
    (dict(vocab_size=1), "vocab_size=1 must be at least 2"),
    (dict(n_layer=0), "n_layer=0 must be a positive integer"),
    (dict(lev_knots=2), "lev_knots=2 must be at least 3"),
    (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
    (dict(lev_out_init_std=0.0), "lev_out_init_std=0.0 must be a finite number > 0"),
    (dict(lev_out_init_std=-1), "lev_out_init_std=-1 must be a finite number > 0"),
    (dict(lev_out_init_std=float("nan")), "lev_out_init_std=nan must be a finite number > 0"),
    (dict(lev_out_init_std=float("inf")), "lev_out_init_std=inf must be a finite number > 0"),
    (dict(lev_out_init_std="0.02"), "lev_out_init_std='0.02' must be a finite number > 0"),
    (dict(lev_out_init_std=True), "lev_out_init_std=True must be a finite number > 0"),
])
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match="Config: " + message):
        tiny_config("lev", **overrides)


def test_config_rejects_non_integer_lev_knots():
    with pytest.raises(ValueError, match="lev_knots"):
        tiny_config("lev", lev_knots=4.5)


# ----------------------------------------------------------------------------------------------------------
# Generation: KV cache, window jumps, sampling


@arms
def test_cached_logits_equal_full_forward(arm):
    """Feeding a prompt and then one token at a time through the KV cache gives the full forward's logits."""
    model = tiny_model(arm).eval()
    idx = random_ids(2, BLOCK, seed=1)
    with torch.no_grad():
        full, _ = model(idx, targets=idx)
        cache = DecodeCache(KVCache(model.config.n_layer, BLOCK), None)
        logits, _ = model(idx[:, :5], cache=cache)
        torch.testing.assert_close(logits[:, 0], full[:, 4], rtol=1e-5, atol=1e-5)
        for t in range(5, BLOCK):
            logits, _ = model(idx[:, t:t + 1], cache=cache)
            torch.testing.assert_close(logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        assert cache.kv.pos == BLOCK
        with pytest.raises(ValueError, match="longer than block_size"):
            model(idx[:, :1], cache=cache)
        cache = DecodeCache(KVCache(model.config.n_layer, BLOCK), None)
        model(idx[:, :3], cache=cache)
        with pytest.raises(NotImplementedError):  # several tokens after a non-empty cache
            model(idx[:, 3:5], cache=cache)


@arms
def test_decoder_step_equals_forward_with_cache(arm):
    """The Decoder (section 6) is GPT.forward for one token after a KV cache, in float64: the same logits and
    the same keys and values in the cache, from an empty cache and after a prompt fed by forward, to a full block."""
    model = tiny_model(arm).double().eval()
    idx = random_ids(2, BLOCK, seed=4)
    with torch.no_grad():
        decoder = Decoder(model, DecodeHead(model.lm_head.weight))
        for prompt_len in (0, 5):
            plain = DecodeCache(KVCache(model.config.n_layer, BLOCK), None)
            fast = DecodeCache(KVCache(model.config.n_layer, BLOCK), None, decoder.head)
            if prompt_len:
                model(idx[:, :prompt_len], cache=plain)
                model(idx[:, :prompt_len], cache=fast)
            for t in range(prompt_len, BLOCK):
                expected, _ = model(idx[:, t:t + 1], cache=plain)
                torch.testing.assert_close(decoder.step(idx[:, t:t + 1], fast), expected, rtol=1e-12, atol=1e-12)
            assert fast.kv.pos == plain.kv.pos == BLOCK
            for layer in range(model.config.n_layer):
                torch.testing.assert_close(fast.kv.k[layer], plain.kv.k[layer], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(fast.kv.v[layer], plain.kv.v[layer], rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="one token into a cache with room"):
            decoder.step(idx[:, :1], fast)  # the cache is full
        with pytest.raises(ValueError, match="one token into a cache with room"):
            decoder.step(idx[:, :2], DecodeCache(KVCache(model.config.n_layer, BLOCK), None))


@arms
def test_decoder_under_autocast_keeps_forwards_fp32_residual_stream(arm):
    """Under bf16 autocast (sample.py on a GPU) the Decoder computes what forward computes there: the residual
    stream stays fp32 (an addmm would return bf16 and drift, ~2e-3 on logits of ~0.6)."""
    model = tiny_model(arm).eval()
    idx = random_ids(2, BLOCK, seed=4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = Decoder(model, DecodeHead(model.lm_head.weight))
        plain = DecodeCache(KVCache(model.config.n_layer, BLOCK), None)
        fast = DecodeCache(KVCache(model.config.n_layer, BLOCK), None, decoder.head)
        for t in range(BLOCK):
            expected, _ = model(idx[:, t:t + 1], cache=plain)
            got = decoder.step(idx[:, t:t + 1], fast)
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=1e-6)


@arms
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_head_gives_the_heads_logits(arm, threads):
    """Generation's head (DecodeHead: a (n_embd, V) copy on CPU, in column blocks with several threads; V = 61 is
    not a multiple of 3) gives the logits of the model's own head, and copies rather than changes the weight."""
    model = tiny_model(arm).eval()
    weight = model.lm_head.weight
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        head = DecodeHead(weight)
    finally:
        torch.set_num_threads(before)
    copy = head.weight_T if threads == 1 else head.blocks
    assert copy.shape == ((model.config.n_embd, V) if threads == 1 else (3, model.config.n_embd, 21))
    assert copy.is_contiguous() and copy.data_ptr() != weight.data_ptr()
    x = torch.randn(2, model.config.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(head(x), x @ weight.T, rtol=1e-5, atol=1e-6)
    idx = random_ids(2, BLOCK, seed=3)
    with torch.no_grad():
        full, _ = model(idx, targets=idx)
        for t in (1, 7, BLOCK):
            logits, _ = model(idx[:, :t], cache=DecodeCache(None, None, head))
            torch.testing.assert_close(logits[:, 0], full[:, t - 1], rtol=1e-5, atol=1e-5)


@arms
@pytest.mark.parametrize("prompt_len", [5, BLOCK + 4])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=10,
                                                                                         top_p=0.9)])
def test_generation_with_cache_equals_without(arm, prompt_len, sampling):
    """Same tokens with and without the KV cache, also far past block_size (several window jumps)."""
    model = tiny_model(arm).eval()
    prompt = random_ids(2, prompt_len, seed=1)
    torch.manual_seed(123)
    cached = model.generate(prompt, 40, use_cache=True, **sampling)
    torch.manual_seed(123)
    plain = model.generate(prompt, 40, use_cache=False, **sampling)
    assert cached.shape == (2, prompt_len + 40)
    assert torch.equal(cached[:, :prompt_len], prompt)
    assert torch.equal(cached, plain)


@arms
def test_generation_on_several_threads_equals_without_cache(arm):
    """With 3 threads the head is cut into column blocks (DecodeHead) in both paths: same tokens with and without
    the KV cache, greedy and sampled, past block_size."""
    model = tiny_model(arm).eval()
    prompt = random_ids(2, 5, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=10)):
            torch.manual_seed(123)
            cached = model.generate(prompt, 40, **sampling)
            torch.manual_seed(123)
            assert torch.equal(cached, model.generate(prompt, 40, use_cache=False, **sampling))
    finally:
        torch.set_num_threads(before)


@arms
def test_generation_with_cache_feeds_one_token_per_step(arm, monkeypatch):
    """The cached path really uses the cache: between window jumps each step feeds only the newest token."""
    model = tiny_model(arm).eval()
    fed = []
    forward, step = model.forward, Decoder.step
    monkeypatch.setattr(model, "forward", lambda idx, *a, **kw: fed.append(idx.shape[1]) or forward(idx, *a, **kw))
    monkeypatch.setattr(Decoder, "step", lambda self, idx, cache: fed.append(("decoder", idx.shape[1]))
                        or step(self, idx, cache))
    model.generate(random_ids(1, 5, seed=1), 20, temperature=0.0)
    # 5 prompt tokens by forward, 11 single tokens up to 16 by the Decoder, a jump to the last 8 tokens (forward),
    # then single tokens again
    assert fed == [5] + [("decoder", 1)] * 11 + [8] + [("decoder", 1)] * 7
    fed.clear()  # in training mode with dropout on, every token goes through forward (the Decoder has no dropout)
    tiny_model(arm, dropout=0.1).train().generate(random_ids(1, 5, seed=1), 3, temperature=0.0)
    assert fed == []  # that model's forward is not the patched one; the Decoder was not called


@arms
def test_greedy_equals_argmax_loop(arm):
    """While the sequence fits in block_size, greedy generation is argmax over full forward passes; past it,
    the model sees the window of the last block_size // 2 tokens after each jump (GPT.stream's policy)."""
    model = tiny_model(arm).eval()
    idx = random_ids(2, 4, seed=1)
    generated = model.generate(idx, 30, temperature=0.0)
    start = 0
    with torch.no_grad():
        for _ in range(30):
            if idx.shape[1] - start > BLOCK:
                start = idx.shape[1] - BLOCK // 2
            logits, _ = model(idx[:, start:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated[:, :BLOCK], idx[:, :BLOCK])  # the plain loop, before any jump
    assert torch.equal(generated, idx)


@arms
def test_generation_with_block_size_one(arm):
    model = tiny_model(arm, block_size=1).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    cached = model.generate(prompt, 3, temperature=0.0)
    assert cached.shape == (1, 4) and torch.equal(cached, model.generate(prompt, 3, temperature=0.0, use_cache=False))


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_stream_rejects_bad_sampling_settings(settings, message):
    model = tiny_model("tied").eval()
    with pytest.raises(ValueError, match=message):
        next(model.stream(random_ids(1, 3), 5, **settings))
    with pytest.raises(ValueError, match=message):
        model.generate(random_ids(1, 3), 5, **settings)


def test_sample_next_top_k_one_is_argmax():
    torch.manual_seed(0)
    for _ in range(5):
        logits = torch.randn(16, 50)
        for temperature in (1.0, 0.5, 2.0):
            assert torch.equal(sample_next(logits, temperature, top_k=1), logits.argmax(-1, keepdim=True))
    assert torch.equal(sample_next(logits, 0.0, top_k=7, top_p=0.5), logits.argmax(-1, keepdim=True))


def test_sample_next_top_k_keeps_the_k_likeliest():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    drawn = sample_next(logits.expand(4000, 50), 1.0, top_k=3)
    assert set(drawn.flatten().tolist()) == set(logits[0].topk(3).indices.tolist())


@pytest.mark.parametrize("top_p, nucleus", [(0.45, {2}), (0.7, {2, 1}), (0.8, {2, 1, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_sample_next_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    """Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 in shuffled order: the nucleus is the smallest set of
    likeliest ids whose probability reaches top_p."""
    probs = torch.tensor([0.0625, 0.25, 0.5, 0.0625, 0.125])
    torch.manual_seed(0)
    drawn = sample_next(probs.log().expand(4000, 5), 1.0, top_p=top_p)
    assert set(drawn.flatten().tolist()) == nucleus


# ----------------------------------------------------------------------------------------------------------
# LEV: the fast path against the reference, in float64, values and gradients of every parameter


@pytest.mark.parametrize("d_seed", [16, 6, 5])  # partial products of gcd(d_seed, 8) = 8, 2, 1 factors
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
@pytest.mark.parametrize("normalize", [True, False])
@KERNELS
def test_lev_fast_path_equals_reference(d_seed, chunk, normalize, kernels):
    lev = tiny_lev(d_seed=d_seed, chunk=chunk, normalize=normalize, kernels=kernels)
    idx = torch.cat([random_ids(3, 20, seed=1), torch.tensor([[0, V - 1] * 10])])  # many repeated ids
    assert idx.unique().numel() < idx.numel()
    weight = torch.randn(*idx.shape, lev.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fast = values_and_grads(lev, lev, idx, weight)
    reference = values_and_grads(lev, lev.reference, idx, weight)
    assert fast[0].shape == (4, 20, 12)
    assert_same_values_and_grads(fast, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("normalize", [True, False])
def test_lev_c_kernels_at_the_papers_rank_equal_reference(normalize):
    """r = 64, the paper's rank, which the C kernels run as a compile-time constant (other ranks as they come)."""
    lev = tiny_lev(d_seed=16, normalize=normalize, kernels="c", rank=64)
    idx = random_ids(2, 9, seed=1)
    weight = torch.randn(*idx.shape, lev.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert lev.kernels(torch.rand(1, 2, 16, dtype=torch.float64)) == "c"
    assert_same_values_and_grads(values_and_grads(lev, lev, idx, weight),
                                 values_and_grads(lev, lev.reference, idx, weight), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype, big", [(torch.float32, 1e6), (torch.float64, 1e40)])
@KERNELS
def test_lev_with_extreme_spline_scales_equals_reference(dtype, big, kernels):
    """Seed dimensions alternately scaled by big and 1/big: every grouped partial product of 8 factors over- or
    underflows, though the whole product stays near 1, so the fast path must take the per-factor fallback."""
    lev = tiny_lev(dtype=dtype, d_seed=16, kernels=kernels)
    scale = torch.tensor([big, 1 / big] * 8, dtype=torch.float64).view(1, 16, 1, 1)
    with torch.no_grad():
        lev.spline.mul_(scale.to(dtype))
    idx = random_ids(2, 15, seed=1)
    weight = torch.randn(2, 15, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    fast = values_and_grads(lev, lev, idx, weight.to(dtype))
    exact = tiny_lev(dtype=torch.float64, d_seed=16)
    exact.load_state_dict(lev.state_dict())
    reference = values_and_grads(exact, exact.reference, idx, weight)

    def unscaled(result):  # gradients with respect to the spline before scaling, all of order 1
        values, grads = result
        return values.double(), {**{n: g.double() for n, g in grads.items()}, "spline": grads["spline"] * scale}

    tol = dict(rtol=1e-3, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    assert torch.isfinite(reference[0]).all() and reference[0].abs().max() > 1e-3
    assert_same_values_and_grads(unscaled(fast), unscaled(reference), **tol)


@pytest.mark.parametrize("case, log10_first", [
    ("normal", 0.0),  # factors near 1: every partial product is a normal float
    ("overflow", 48.0),  # the first partial product is ~1e48, inf in fp32
    ("underflow", -56.0),  # ~1e-56 is 0
    ("subnormal", -44.2),  # ~6e-45 is finite but keeps only a few bits, so its log is off by up to ~0.3
])
@pytest.mark.parametrize("d", [24, 6])  # partial products of 8 factors, of 2
@pytest.mark.parametrize("kernels", ["eager", "c"])
def test_grouped_log_product_matches_per_factor_log(case, log10_first, d, kernels):
    """SplineProduct's forward multiplies groups of gcd(d, 8) factors and takes one log per group. In float32
    it equals the per-factor product computed in float64, also when a partial product leaves fp32's normal
    range (it then takes one log per factor). S is constant along the knots and t keeps away from the ends of
    [0, 1] (where the basis reaches the zero padding knots), so that phi equals S up to rounding: the weights
    sum to 1. The first group's factors multiply to ~10^log10_first, the other groups' to its inverse, so
    that M stays near 1."""
    h, n_knots, r, U = 2, 4, 3, 5
    group = math.gcd(d, 8)
    g = torch.Generator().manual_seed(0)
    magnitude = torch.empty(h, d, r, dtype=torch.float64).uniform_(1 / 1.1, 1.1, generator=g)
    magnitude[:, :group] *= 10 ** (log10_first / group)
    magnitude[:, group:] *= 10 ** (-log10_first / (d - group))
    factors = (magnitude * (torch.randint(0, 2, magnitude.shape, generator=g) * 2 - 1)).float()  # (h, d, r)
    S = factors.unsqueeze(2).expand(h, d, n_knots, r).contiguous()
    t = 0.2 + 0.6 * torch.rand(U, h, d, generator=g)  # knots j-1, j, j+1 all within the 4
    if kernels == "c":
        skip_without_c_kernels()
    M = SplineProduct.apply(t, S, 2, kernels, False)  # (U, h, r)
    want_sign, want_log = signed_log_product(factors.double(), dim=1)  # (h, r)
    torch.testing.assert_close(M.double(), (want_sign * want_log.exp()).expand(U, h, r), rtol=1e-4, atol=0)
    first_partial = factors[:, :group].prod(1)  # what one log per group would have seen, in fp32
    if case == "normal":
        assert first_partial.abs().min() >= torch.finfo(torch.float32).tiny
    else:  # the input really needs the per-factor fallback
        assert not (torch.isfinite(first_partial.abs().log()).all()
                    and first_partial.abs().min() >= torch.finfo(torch.float32).tiny)


def dense_basis_derivative(t, n_knots, normalize):
    """d bspline_basis / dt, (N, n_knots), by autograd: each weight depends on t elementwise."""
    t = t.detach().requires_grad_()
    w = bspline_basis(t, n_knots, normalize)
    return torch.stack([torch.autograd.grad(w[:, k].sum(), t, retain_graph=True)[0] for k in range(n_knots)], -1)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n_knots", [3, 16, 17])  # with 17 knots the half-knot points t = (j + 0.5) / 16 are exact
def test_bspline_weights3_equal_the_dense_basis(n_knots, normalize):
    g = n_knots - 1
    t = torch.cat([torch.tensor([0.0, 1.0, 0.2 / g, 1 - 0.3 / g]), torch.arange(g + 1) / g, (torch.arange(g) + 0.5) / g,
                   torch.rand(200, generator=torch.Generator().manual_seed(0))]).double()
    j, w3, dw3 = bspline_weights3(t, n_knots, normalize)
    w, dw = bspline_basis(t, n_knots, normalize), dense_basis_derivative(t, n_knots, normalize)
    assert j.dtype == torch.long and w3.shape == dw3.shape == (len(t), 3)
    at = j.unsqueeze(-1) + torch.arange(3)  # knots j-1, j, j+1 in a basis padded by one knot at each end

    def dense(x):  # scatter the 3 entries into the padded basis, then drop the two padding knots
        return torch.zeros(len(t), n_knots + 2, dtype=x.dtype).scatter(1, at, x)[:, 1:-1]

    torch.testing.assert_close(dense(w3), w, rtol=0, atol=1e-14)
    torch.testing.assert_close(dense(dw3), dw, rtol=0, atol=1e-10)
    torch.testing.assert_close(w3.sum(-1), torch.ones_like(t))  # with the padding knots, a partition of unity
    assert (w >= 0).all() and ((w > 1e-12).sum(-1) <= 3).all()  # a 4th knot may get ~1e-30 from rounding


def test_normalised_basis_is_a_partition_of_unity_and_plain_inside():
    """The plain basis sums to 1 only inside [1/30, 29/30] (16 knots): 0.875 at t = 0 and 1. Normalised, it sums
    to 1 everywhere, and equals the plain basis inside."""
    t = torch.linspace(0, 1, 3001, dtype=torch.float64)
    plain, normalised = bspline_basis(t, 16, normalize=False), bspline_basis(t, 16, normalize=True)
    torch.testing.assert_close(normalised.sum(-1), torch.ones_like(t), rtol=0, atol=1e-14)
    torch.testing.assert_close(plain.sum(-1)[[0, -1]], torch.tensor([0.875, 0.875], dtype=torch.float64))
    inside = (t >= 1 / 30) & (t <= 29 / 30)
    torch.testing.assert_close(normalised[inside], plain[inside], rtol=0, atol=1e-14)
    assert not torch.allclose(normalised[~inside], plain[~inside])


@pytest.mark.parametrize("grad", [True, False])
def test_nan_coordinates_give_nan_modes_not_a_wild_knot_index(grad):
    """A diverged model gives NaN coordinates: they must not become a knot index far out of range (a crash in
    the gather, forward or backward), but NaN embeddings and gradients, so that the loss is NaN and train.py
    stops cleanly."""
    lev = tiny_lev()
    with torch.no_grad():
        lev.seed_proj[0, 0, 0] = float("nan")
    with torch.set_grad_enabled(grad):
        E = lev(torch.tensor([1, 2]))
    assert E.isnan().all()
    if grad:
        E.sum().backward()
        assert lev.spline.grad.isnan().all()


def test_spline_3knots_indexing_equals_embedding_bag():
    """Both ways spline_3knots gathers the 3 knots (indexing: compiled or on other devices; embedding_bag: eager
    on CPU and CUDA) compute the same phi, here both eagerly."""
    g = torch.Generator().manual_seed(0)
    hd, n_knots, r, u = 6, 5, 4, 7
    S_padded = torch.nn.functional.pad(torch.randn(hd, n_knots, r, dtype=torch.float64, generator=g), (0, 0, 1, 1))
    j, w, _ = bspline_weights3(torch.rand(hd, u, dtype=torch.float64, generator=g), n_knots, True)
    by_embedding_bag = spline_3knots(S_padded, j, w)
    by_indexing = spline_3knots_indexing(S_padded, j, w)
    want = torch.stack([torch.stack([sum(w[i, k, m] * S_padded[i, j[i, k] + m] for m in range(3))
                                     for k in range(u)]) for i in range(hd)])
    assert by_embedding_bag.shape == by_indexing.shape == (hd, u, r)
    torch.testing.assert_close(by_embedding_bag, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(by_indexing, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernels", ["eager", "c"])
@pytest.mark.parametrize("normalize", [True, False])
def test_spline_product_gradcheck(normalize, kernels):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(5, 2, 4, dtype=torch.float64, generator=g)  # (U, h, d)
    t[0, 0, :2] = torch.tensor([0.01, 0.995])  # at the ends, where normalising matters
    t.requires_grad_()
    S = (1 + 0.3 * torch.randn(2, 4, 6, 3, dtype=torch.float64, generator=g)).requires_grad_()
    if kernels == "c":
        skip_without_c_kernels()
    assert torch.autograd.gradcheck(lambda t, S: SplineProduct.apply(t, S, 2, kernels, normalize), (t, S))


@pytest.mark.parametrize("normalize", [True, False])
@KERNELS
def test_whole_model_with_coordinates_at_the_ends_equals_reference(normalize, kernels):
    """End to end: LayerNorm gains x8 push many coordinates t to the ends of [0, 1], where the two bases differ;
    the model's loss and every gradient with LEV's fast path equal those with LEV.reference (float64)."""
    model = tiny_model("lev", lev_normalize_basis=normalize).double()
    use_kernels(model.tok_emb, kernels)
    with torch.no_grad():
        model.tok_emb.ln_weight.mul_(8.0)
    t = model.tok_emb.unit_coords(model.tok_emb.seed(torch.arange(V)))
    assert ((t < 1 / 30) | (t > 29 / 30)).double().mean() > 0.3  # 43% here
    idx, targets = random_ids(2, BLOCK, seed=1), random_ids(2, BLOCK, seed=2)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    fast = loss_and_grads()
    lev = model.tok_emb
    lev.forward = lambda ids, cache=None: lev.reference(ids)  # this instance only: the plain recipe
    reference = loss_and_grads()
    assert_same_values_and_grads(fast, reference, rtol=1e-9, atol=1e-11)


def test_lev_of_an_empty_batch_is_empty():
    lev = tiny_lev()
    for shape in [(0,), (2, 0)]:
        E = lev(torch.zeros(shape, dtype=torch.long))
        assert E.shape == (*shape, lev.n_embd) and E.dtype == torch.float64


def test_c_kernels_are_built_once_per_source_into_the_cache(tmp_path, monkeypatch):
    """lev_kernels.c is compiled into LEVIATHAN_CACHE on first use, reused while the source is unchanged, and
    rebuilt under another name when it changes (the name hashes the source)."""
    skip_without_c_kernels()
    monkeypatch.setenv("LEVIATHAN_CACHE", str(tmp_path / "cache"))
    first = leviathan.build_c_library()
    assert first.parent == tmp_path / "cache" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert leviathan.build_c_library() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    changed = tmp_path / "lev_kernels.c"
    changed.write_text(leviathan.C_SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(leviathan, "C_SOURCE", changed)
    second = leviathan.build_c_library()
    assert second != first and second.exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, second.name])  # no tmp


@pytest.mark.parametrize("factor, want", [(2.0, float("inf")), (0.5, 2.0 ** -130), (-2.0, float("inf"))])
def test_c_kernels_modes_beyond_float32s_range_are_what_float32_makes_of_them(factor, want):
    """130 factors of 2 (or 1/2): every partial product is normal, the mode 2^130 (2^-130) is not: inf (a
    subnormal), as exp(log|M|) gives in the torch kernels. An even number of negative factors: positive."""
    skip_without_c_kernels()
    h, d, n_knots, r = 1, 130, 4, 3
    S = torch.full((h, d, n_knots, r), factor)
    t = torch.full((2, h, d), 0.5)  # knots 1, 2, 3 of 0..3 all exist: weights sum to 1, so phi = factor
    M = SplineProduct.apply(t, S, 2, "c", True)
    torch.testing.assert_close(M, torch.full_like(M, want), rtol=1e-6, atol=0)
    torch.testing.assert_close(M, SplineProduct.apply(t, S, 2, "eager", True), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_kernels_give_the_same_numbers_on_any_number_of_threads(dtype):
    """The C kernels split ids (forward) or blocks of one head's seed dimensions (backward) among threads; each
    output is computed by one thread in one order, so 1 and 3 threads give the same bits (the kernels alone:
    torch's own matmuls around them may sum in another order on another number of threads)."""
    skip_without_c_kernels()
    g = torch.Generator().manual_seed(0)
    U, h, d, n_knots, r = 37, 3, 80, 6, 5  # 3 heads x 80 dimensions: blocks of 64 and 16 per head
    t = torch.rand(U, h, d, generator=g).to(dtype)
    S_padded = F.pad(1 + 0.3 * torch.randn(h * d, n_knots, r, generator=g), (0, 0, 1, 1)).to(dtype)
    G = torch.randn(U, h, r, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append([leviathan.c_spline_product(t, S_padded, True),
                            *leviathan.c_spline_product_backward(t, S_padded, G, True)])
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(*results, strict=True):
        assert torch.equal(one, three)


def test_c_kernels_refuse_operands_they_would_misread():
    """The C kernels read raw memory: mixed dtypes or wrong shapes raise a ValueError instead; and LEV does not
    pick them when its spline is in another dtype than the coordinates."""
    t = torch.rand(3, 2, 4)
    S_padded = torch.rand(8, 6, 5)
    with pytest.raises(ValueError, match="LEV's C kernels"):
        leviathan.c_spline_product(t, S_padded.double(), True)
    with pytest.raises(ValueError, match="LEV's C kernels"):
        leviathan.c_spline_product(t, torch.rand(7, 6, 5), True)  # h*d = 8 rows expected
    with pytest.raises(ValueError, match="LEV's C kernels"):
        leviathan.c_spline_product_backward(t, S_padded, torch.rand(3, 2, 4), True)  # G: (U, h, r) = (3, 2, 5)
    lev = tiny_lev(dtype=torch.float32, kernels="c")
    assert lev.kernels(torch.rand(1, 2, 16)) == "c"
    assert lev.kernels(torch.rand(1, 2, 16, dtype=torch.float64)) != "c"


@pytest.mark.parametrize("compiler", ["no-such-compiler", "false"])  # missing, or failing (exit status 1)
def test_lev_without_a_c_compiler_warns_once_and_runs_torchs_kernels(tmp_path, monkeypatch, compiler):
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command to stand in for a failing compiler")
    monkeypatch.setenv("CC", str(tmp_path / compiler) if compiler == "no-such-compiler" else shutil.which("false"))
    monkeypatch.setenv("LEVIATHAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(leviathan, "_c_state", {})  # this module's memory of an earlier build: none
    lev = tiny_lev(kernels="torch")
    lev.c_kernels = True
    idx = random_ids(2, 9, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        E = lev(idx)
        lev(idx)
    messages = [str(w.message) for w in caught if str(w.message).startswith("LEV:")]
    assert len(messages) == 1 and "could not build its C kernels" in messages[0] and "--lev_c_kernels" in messages[0]
    assert lev.kernels(torch.rand(1, 2, 16, dtype=torch.float64)) in ("compiled", "eager")
    torch.testing.assert_close(E, lev.reference(idx), rtol=1e-10, atol=1e-12)


def test_lev_table_equals_reference():
    lev = tiny_lev(chunk=7)
    ids = torch.arange(V)
    torch.testing.assert_close(lev.table(), lev.reference(ids).detach(), rtol=1e-10, atol=1e-12)
    assert not lev.table().requires_grad


def test_lev_output_stays_float32_under_autocast():
    lev = tiny_lev(dtype=torch.float32)
    idx = random_ids(2, 9, seed=1)
    expected = lev(idx).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lev(idx)
        with torch.no_grad():
            out_cached = lev(idx, EmbeddingCache(lev))
    assert out.dtype == out_cached.dtype == torch.float32
    torch.testing.assert_close(out.detach(), expected)
    torch.testing.assert_close(out_cached, expected)


# ----------------------------------------------------------------------------------------------------------
# LEV's embedding cache: owned by one generation call


def record_embed_distinct(monkeypatch, lev):
    """Wrap lev.embed_distinct so that each call's ids are recorded."""
    calls, original = [], lev.embed_distinct
    monkeypatch.setattr(lev, "embed_distinct", lambda ids: calls.append(ids.tolist()) or original(ids))
    return calls


def test_embedding_cache_equals_reference_and_computes_each_id_once(monkeypatch):
    lev = tiny_lev()
    calls = record_embed_distinct(monkeypatch, lev)
    cache = EmbeddingCache(lev)
    with torch.no_grad():
        for idx in ([[3, 1, 3, 2]], [[5, 2, 4, 2]], [[1, 5]], [[V - 1, 0, 0]]):
            idx = torch.tensor(idx)
            torch.testing.assert_close(lev(idx, cache), lev.reference(idx), rtol=1e-10, atol=1e-12)
    assert calls == [[1, 2, 3], [4, 5], [0, V - 1]]  # [[1, 5]] was all cached
    with torch.no_grad():
        lev(torch.tensor([1, 2]))  # without a cache: computed again
    assert calls[-1] == [1, 2]
    with pytest.raises(RuntimeError, match="gradient-free"):
        lev(torch.tensor([1, 2]), cache)  # gradients on: the weights are about to change


def test_each_generation_call_has_its_own_cache(monkeypatch):
    """A generation after an optimizer step (fused AdamW included, which bumps no tensor version) or after
    load_state_dict sees the new weights: the cache of the previous call is gone with that call."""
    model = tiny_model("lev")
    prompt = random_ids(1, 4, seed=1)
    before = model.generate(prompt, 6, temperature=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(3):
        _, loss = model(random_ids(2, 8, seed=2), random_ids(2, 8, seed=3))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.generate(prompt, 6, temperature=0)
    plain = model.generate(prompt, 6, temperature=0, use_cache=False, lev_cache=False)
    assert torch.equal(after, plain) and not torch.equal(after, before)
    other = tiny_model("lev", seed=1)
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.generate(prompt, 6, temperature=0), other.generate(prompt, 6, temperature=0))


# ----------------------------------------------------------------------------------------------------------
# Parameter counts, digits


@pytest.mark.parametrize("vocab_size, n_embd, k, d_seed, h, kappa, r", [
    (61, 12, 3, 16, 2, 8, 4),
    (1000, 32, 2, 8, 3, 5, 6),
    (4096, 16, 4, 8, 1, 3, 2),
    (50257, 64, 3, 16, 2, 16, 8),
])
def test_lev_param_count_equals_module(vocab_size, n_embd, k, d_seed, h, kappa, r):
    lev_settings = dict(lev_digits=k, lev_seed_dim=d_seed, lev_heads=h, lev_knots=kappa, lev_rank=r)
    counted = lev_param_count(vocab_size, n_embd, **lev_settings)
    lev = LEV(lev_config(vocab_size, n_embd, **lev_settings))
    assert counted == sum(p.numel() for p in lev.parameters())
    model = GPT(Config(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=n_embd, **lev_settings))
    assert model.param_report()["input_embedding"] == counted


def test_lev_param_count_at_paper_size():
    assert lev_param_count(200376, 2048) == 2_252_928
    with torch.device("meta"):  # shapes only, nothing allocated
        lev = LEV(lev_config(200376, 2048))
    assert sum(p.numel() for p in lev.parameters()) == 2_252_928


def test_digit_base_is_the_smallest_sufficient_base():
    cases = [(v, k) for v in range(2, 1500) for k in (1, 2, 3, 4, 5)]
    cases += [(v, k) for v in (125, 216, 4096, 50257, 65536, 200376, 10**9, 10**9 + 1, 10**18, 10**18 + 1,
                               2**53 + 1, 999_999_999_999, 2**60 - 1) for k in (1, 2, 3, 4, 6, 12)]
    for v, k in cases:
        b = digit_base(v, k)
        assert b >= 2 and b**k >= v, (v, k, b)
        assert b == 2 or (b - 1) ** k < v, (v, k, b)
    known = {(125, 3): 5, (216, 3): 6, (4096, 3): 16, (4096, 2): 64, (4096, 12): 2, (50257, 3): 37,
             (200376, 3): 59, (10**18, 3): 10**6, (10**18 + 1, 3): 10**6 + 1, (2, 3): 2}
    assert {case: digit_base(*case) for case in known} == known


@pytest.mark.parametrize("vocab_size, n_digits", [(V, 3), (1000, 3), (50257, 3), (4096, 2), (7, 1)])
def test_digits_round_trip(vocab_size, n_digits):
    lev = LEV(lev_config(vocab_size, 4, lev_digits=n_digits, lev_seed_dim=2, lev_heads=1, lev_knots=3, lev_rank=1))
    ids = torch.arange(vocab_size)
    digits = lev.digits(ids)
    assert digits.shape == (vocab_size, n_digits)
    assert digits.min() >= 0 and digits.max() < lev.base
    powers = torch.tensor([lev.base ** (n_digits - 1 - r) for r in range(n_digits)])  # most significant first
    assert torch.equal((digits * powers).sum(-1), ids)


def test_lev_out_init_std_scales_w_out_only():
    """W_out ~ N(0, std^2 / h) from the same random draws: 0.02 is the initialisation LEV had before the setting
    existed (the default is 0.002 now), another std scales W_out alone."""
    config = lev_config(lev_heads=2, lev_seed_dim=4, lev_knots=5, lev_rank=3)
    torch.manual_seed(0)
    default = LEV(dataclasses.replace(config, lev_out_init_std=0.02))
    torch.manual_seed(0)  # the draws of LEV.__init__, in its order, with the formula it had before the setting
    draws = [torch.randn(3, default.base, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 5, 3), torch.randn(2, 3, 12)]
    assert torch.equal(default.out_proj, draws[-1] * 0.02 / math.sqrt(2))
    torch.manual_seed(0)
    doubled = LEV(dataclasses.replace(config, lev_out_init_std=0.04))
    assert torch.equal(doubled.out_proj, 2 * default.out_proj)
    assert all(torch.equal(getattr(doubled, name), getattr(default, name))
               for name in ("codebooks", "seed_proj", "ln_weight", "ln_bias", "spline"))


def test_digits_are_most_significant_first():
    lev = LEV(lev_config(1000, 4, lev_digits=3, lev_seed_dim=2, lev_heads=1, lev_knots=3, lev_rank=1))
    assert lev.base == 10
    assert lev.digits(torch.tensor([123, 7, 999])).tolist() == [[1, 2, 3], [0, 0, 7], [9, 9, 9]]


# ----------------------------------------------------------------------------------------------------------
# Optimizer groups


def decay_groups(model, optimizer):
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    plain = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    return names, decayed, plain


@arms
def test_configure_optimizers_decays_matrices_only(arm):
    model = tiny_model(arm)
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=3e-4, betas=(0.9, 0.99))
    names, decayed, plain = decay_groups(model, optimizer)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.99) for g in optimizer.param_groups)
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.1, 0.0}
    for name, p in model.named_parameters():
        if p.dim() == 1 or name == "tok_emb.spline":
            assert name in plain, f"{name} should not be decayed"
    matrices = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.down.weight"]
    matrices += ["tok_emb.codebooks", "tok_emb.seed_proj", "tok_emb.out_proj", "lm_head.weight"] if arm == "lev" else \
        ["tok_emb.weight"] + (["lm_head.weight"] if arm == "untied" else [])
    assert set(matrices) <= decayed


def test_lev_layernorm_gains_and_biases_are_not_decayed():
    model = tiny_model("lev")
    _, _, plain = decay_groups(model, model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3))
    assert {"tok_emb.ln_weight", "tok_emb.ln_bias"} <= plain


@arms
def test_configure_optimizers_default_groups_are_the_two_of_before(arm):
    """lev_lr_scale = lev_wd_scale = 1: decay and no_decay, in this order, as before the settings existed (so that
    the optimizer states of older checkpoints load), whatever the arm."""
    model = tiny_model(arm)
    not_decayed = ("tok_emb.spline", "tok_emb.ln_weight", "tok_emb.ln_bias")
    decay = [name for name, p in model.named_parameters() if p.dim() >= 2 and name not in not_decayed]
    no_decay = [name for name, p in model.named_parameters() if p.dim() < 2 or name in not_decayed]
    names = {id(p): name for name, p in model.named_parameters()}

    def groups(**scales):
        optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, **scales)
        return [([names[id(p)] for p in g["params"]], g["weight_decay"], g["lr_scale"]) for g in optimizer.param_groups]

    expected = [(decay, 0.1, 1.0), (no_decay, 0.0, 1.0)]
    assert groups() == groups(lev_lr_scale=1.0, lev_wd_scale=1.0) == expected
    if arm != "lev":  # no LEV: the scales change nothing
        assert groups(lev_lr_scale=0.5, lev_wd_scale=2.0) == expected


def test_configure_optimizers_gives_lev_groups_of_its_own():
    model = tiny_model("lev")
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, lev_lr_scale=0.5, lev_wd_scale=3.0)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [({names[id(p)] for p in g["params"]}, g["weight_decay"], g["lr_scale"]) for g in optimizer.param_groups]
    assert [(wd, scale) for _, wd, scale in groups] == [(0.1, 1.0), (0.0, 1.0), (pytest.approx(0.3), 0.5), (0.0, 0.5)]
    assert groups[2][0] == {"tok_emb.codebooks", "tok_emb.seed_proj", "tok_emb.out_proj"}
    assert groups[3][0] == {"tok_emb.spline", "tok_emb.ln_weight", "tok_emb.ln_bias"}
    assert not any(name.startswith("tok_emb.") for name in groups[0][0] | groups[1][0])
    assert "lm_head.weight" in groups[0][0] and "norm.weight" in groups[1][0]
    # a frozen LEV: its groups would be empty, and are left out
    model.tok_emb.requires_grad_(False)
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, lev_lr_scale=0.5)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


# ----------------------------------------------------------------------------------------------------------
# Checkpoints


def write_checkpoint(model, path, version=CHECKPOINT_VERSION):
    """A checkpoint as train.py writes it (the dict of the shared interface), after one training step."""
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3)
    _, loss = model(random_ids(2, 8, seed=1), random_ids(2, 8, seed=2))
    loss.backward()
    optimizer.step()
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": V, "dtype": "uint16", "train_tokens": 100,
            "val_tokens": 10, "chars": "".join(chr(65 + i) for i in range(V)), "source": "synthetic"}
    ckpt = {"version": version, "model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
            "train_config": {"batch_size": 2, "learning_rate": 1e-3}, "meta": meta, "step": 1, "tokens_seen": 16,
            "best_val_loss": float("inf"), "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()}}
    torch.save(ckpt, path)


@arms
def test_checkpoint_round_trip_gives_identical_logits(arm, tmp_path):
    model = tiny_model(arm)
    write_checkpoint(model, tmp_path / "ckpt.pt")
    model.eval()
    idx = random_ids(2, BLOCK, seed=3)
    with torch.no_grad():
        expected, _ = model(idx, targets=idx)
    for where in (tmp_path, tmp_path / "ckpt.pt", str(tmp_path)):
        loaded, ckpt = load_checkpoint(where)
        assert not loaded.training and ckpt["step"] == 1 and ckpt["meta"]["vocab_size"] == V
        assert loaded.config == model.config
        with torch.no_grad():
            assert torch.equal(loaded(idx, targets=idx)[0], expected)
        if arm == "tied":
            assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_checkpoint_older_than_a_config_field_loads_with_the_value_it_was_made_with(tmp_path):
    """A checkpoint written before lev_out_init_std existed: its models were initialised with 0.02 (common.py's
    FIELDS_ADDED), which is not today's default, and that is what its config says once loaded."""
    model = tiny_model("lev")
    assert model.config.lev_out_init_std == 0.002  # today's default
    write_checkpoint(model, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    del ckpt["model_config"]["lev_out_init_std"]
    torch.save(ckpt, tmp_path / "ckpt.pt")
    loaded, _ = load_checkpoint(tmp_path)
    assert loaded.config == dataclasses.replace(model.config, lev_out_init_std=0.02)
    assert all(torch.equal(loaded.state_dict()[k], t) for k, t in model.state_dict().items())


def test_checkpoint_of_another_version_is_refused(tmp_path):
    write_checkpoint(tiny_model("lev"), tmp_path / "ckpt.pt", version=CHECKPOINT_VERSION + 1)
    with pytest.raises(ValueError, match=f"format version {CHECKPOINT_VERSION + 1}.*reads versions"):
        load_checkpoint(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {re.escape(str(tmp_path / 'ckpt.pt'))}"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere" / "ckpt.pt")


def test_unreadable_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable leviathan checkpoint"):
        load_checkpoint(tmp_path)


def test_checkpoint_with_unknown_settings_is_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    write_checkpoint(tiny_model("tied"), path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_config"]["n_experts"] = 4
    torch.save(ckpt, path)
    with pytest.raises(ValueError, match="n_experts"):
        load_checkpoint(path)


def test_sample_next_a_top_p_below_float32_keeps_the_likeliest():
    """top_p=1e-300 is 0 in fp32: every id would be dropped and sampling would fail on NaN probabilities."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, 0.8, 200, 1e-300), logits.argmax(-1, keepdim=True))
