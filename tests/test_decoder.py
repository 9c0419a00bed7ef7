"""Tests of generation's fast path (machinery/decoder.py, and fast_lev.py's EmbeddingCache): the
Decoder's one-token steps, the DecodeHead, a generation call's DecodeSession and caches, each
against the model's own plain code (leviathan.py with no fast path installed): the same logits
(float64, or fp32 to its rounding), and in generation the same tokens, greedy and sampled, with and
without the KV cache, far past block_size.

Everything is hermetic and runs on CPU: tiny models (V=61, block_size=16, n_embd=32).
Run:  python -m pytest -q tests/test_decoder.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plain `pytest` finds leviathan.py
from conftest import BLOCK, V, random_ids, tiny_lev, tiny_model  # noqa: E402

from leviathan import EMBEDDINGS, KVCache  # noqa: E402
from machinery.decoder import DecodeHead, Decoder, DecodeSession  # noqa: E402
from machinery.fast_lev import EmbeddingCache  # noqa: E402
from machinery.runtime import set_runtime  # noqa: E402

arms = pytest.mark.parametrize("arm", EMBEDDINGS)
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0),
             dict(temperature=0.8, top_k=10, top_p=0.9)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def plain_and_fast(arm, **overrides):
    """Two copies of one tiny model in eval mode: as leviathan.py runs it, and with set_runtime's
    fast paths (LEV's fast path, the fast decoding with LEV's embedding cache)."""
    plain = tiny_model(arm, **overrides).eval()
    fast = set_runtime(tiny_model(arm, **overrides).eval())
    assert plain.fast_decoding is None and fast.fast_decoding is not None
    return plain, fast


def generations(plain, fast, prompt, max_new_tokens, **sampling):
    """The tokens of the four ways to generate (plain or fast model, with or without the KV cache),
    from the same seed."""
    out = {}
    for name, model in (("plain", plain), ("fast", fast)):
        for use_cache in (True, False):
            torch.manual_seed(123)
            out[name, use_cache] = model.generate(prompt, max_new_tokens, use_cache=use_cache,
                                                  **sampling)
    return out


def assert_all_equal(tokens):
    want = tokens["plain", False]  # the model's own plain code, full forward passes
    for key, got in tokens.items():
        assert torch.equal(got, want), f"{key} differs from the plain model without the KV cache"


# --------------------------------------------------------------------------------------------------
# The Decoder, the DecodeHead and the DecodeSession against GPT.forward


@arms
def test_decoder_step_equals_forward_with_cache(arm):
    """The Decoder is GPT.forward for one token after a KV cache, in float64: the same logits and
    the same keys and values in the cache, from an empty cache and after a prompt fed by forward, to
    a full block."""
    model = tiny_model(arm).double().eval()
    idx = random_ids(2, BLOCK, seed=4)
    n_layer = model.config.n_layer
    with torch.no_grad():
        decoder = Decoder(model, DecodeHead(model.lm_head.weight))
        for prompt_len in (0, 5):
            plain, fast = KVCache(n_layer, BLOCK), KVCache(n_layer, BLOCK)
            if prompt_len:
                model(idx[:, :prompt_len], kv_cache=plain)
                model(idx[:, :prompt_len], kv_cache=fast)
            for t in range(prompt_len, BLOCK):
                expected, _ = model(idx[:, t:t + 1], kv_cache=plain)
                got = decoder.step(model.embed(idx[:, t:t + 1]), fast)
                torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
            assert fast.pos == plain.pos == BLOCK
            for layer in range(n_layer):
                torch.testing.assert_close(fast.k[layer], plain.k[layer], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(fast.v[layer], plain.v[layer], rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="one token into a cache with room"):
            decoder.step(model.embed(idx[:, :1]), fast)  # the cache is full
        with pytest.raises(ValueError, match="one token into a cache with room"):
            decoder.step(model.embed(idx[:, :2]), KVCache(n_layer, BLOCK))


@arms
def test_decoder_under_autocast_keeps_forwards_fp32_residual_stream(arm):
    """Under bf16 autocast (sample.py on a GPU) the Decoder computes what forward computes there:
    the residual stream stays fp32 (an addmm would return bf16 and drift on the logits)."""
    model = tiny_model(arm).eval()
    idx = random_ids(2, BLOCK, seed=4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = Decoder(model, DecodeHead(model.lm_head.weight))
        plain = KVCache(model.config.n_layer, BLOCK)
        fast = KVCache(model.config.n_layer, BLOCK)
        for t in range(BLOCK):
            expected, _ = model(idx[:, t:t + 1], kv_cache=plain)
            got = decoder.step(model.embed(idx[:, t:t + 1]), fast)
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=1e-6)


@arms
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_head_gives_the_heads_logits(arm, threads):
    """Generation's head (DecodeHead: a (n_embd, V) copy on CPU, in column blocks with several
    threads; V = 61 is not a multiple of 3) gives the logits of the model's own head, and copies
    rather than changes the weight."""
    model = tiny_model(arm).eval()
    weight = model.lm_head.weight
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        head = DecodeHead(weight)
    finally:
        torch.set_num_threads(before)
    copy = head.weight_T if threads == 1 else head.blocks
    C = model.config.n_embd
    assert copy.shape == ((C, V) if threads == 1 else (3, C, 21))
    assert copy.is_contiguous() and copy.data_ptr() != weight.data_ptr()
    x = torch.randn(2, model.config.n_embd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(head(x), x @ weight.T, rtol=1e-5, atol=1e-6)
    idx = random_ids(2, BLOCK, seed=3)
    with torch.no_grad():
        full, _ = model(idx, targets=idx)
        for t in (1, 7, BLOCK):
            logits = head(model.backbone(model.embed(idx[:, :t]))[:, -1])
            torch.testing.assert_close(logits, full[:, t - 1], rtol=1e-5, atol=1e-5)


@arms
@pytest.mark.parametrize("lev_cache", [True, False])
@pytest.mark.parametrize("backbone", ["decoder", "compiled"])  # compiled: eager, the suite's stance
def test_decode_session_equals_forward(arm, lev_cache, backbone):
    """A generation call's DecodeSession gives GPT.forward's last logits, in float64: without a KV
    cache, for a window's first tokens into an empty one, then one token at a time (through the
    Decoder, or through the compiled backbone that compile_decode installs in its place)."""
    model = tiny_model(arm).double().eval()
    idx = random_ids(2, BLOCK, seed=4)
    compiled = torch.compile(model.backbone) if backbone == "compiled" else None
    tol = dict(rtol=1e-12, atol=1e-12)
    with torch.inference_mode():
        session = DecodeSession(model, lev_cache, compiled)
        assert (session.embeddings is not None) == (lev_cache and arm == "lev")
        assert (session.decoder is not None) == (backbone == "decoder")
        for t in (1, 7, BLOCK):
            torch.testing.assert_close(session(idx[:, :t], None), model(idx[:, :t])[0], **tol)
        plain, fast = KVCache(model.config.n_layer, BLOCK), KVCache(model.config.n_layer, BLOCK)
        expected, _ = model(idx[:, :5], kv_cache=plain)
        torch.testing.assert_close(session(idx[:, :5], fast), expected, **tol)
        for t in range(5, BLOCK):
            expected, _ = model(idx[:, t:t + 1], kv_cache=plain)
            torch.testing.assert_close(session(idx[:, t:t + 1], fast), expected, **tol)
        assert fast.pos == plain.pos == BLOCK


# --------------------------------------------------------------------------------------------------
# Generation: the fast decoding against the plain model's, with and without the KV cache


@arms
@pytest.mark.parametrize("prompt_len", [5, BLOCK + 4])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_generation_with_cache_equals_without(arm, prompt_len, sampling):
    """Same tokens with and without the KV cache, with the fast decoding and in the plain model,
    also far past block_size (several window jumps)."""
    plain, fast = plain_and_fast(arm)
    prompt = random_ids(2, prompt_len, seed=1)
    tokens = generations(plain, fast, prompt, 40, **sampling)
    cached = tokens["fast", True]
    assert cached.shape == (2, prompt_len + 40)
    assert torch.equal(cached[:, :prompt_len], prompt)
    assert_all_equal(tokens)


def record_logits(model, record):
    """Make each generation call of model append the last-position logits of every step to record:
    those of the fast decoding's session where it is installed, else those of GPT.forward."""
    if model.fast_decoding is not None:
        fast_decoding = model.fast_decoding

        def start(m):
            session = fast_decoding(m)

            def last_logits(tokens, kv_cache):
                logits = session(tokens, kv_cache)
                record.append(logits.clone())
                return logits

            return last_logits

        model.fast_decoding = start
    else:
        forward = model.forward

        def recorded_forward(idx, *args, **kwargs):
            out = forward(idx, *args, **kwargs)
            record.append(out[0].clone())
            return out

        model.forward = recorded_forward


@arms
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("sampling", [SAMPLINGS[0], SAMPLINGS[2]])
def test_fast_generation_gives_the_plain_generations_logits_in_float64(arm, use_cache, sampling):
    """In float64, each step of a generation with the fast decoding computes the logits of the plain
    model's generation, window jumps included; so the tokens are the same too."""
    plain, fast = (model.double() for model in plain_and_fast(arm))
    prompt = random_ids(2, BLOCK + 4, seed=1)
    recorded = {"plain": [], "fast": []}
    tokens = {}
    for name, model in (("plain", plain), ("fast", fast)):
        record_logits(model, recorded[name])
        torch.manual_seed(123)
        tokens[name] = model.generate(prompt, 30, use_cache=use_cache, **sampling)
    assert torch.equal(tokens["fast"], tokens["plain"])
    assert len(recorded["fast"]) == len(recorded["plain"]) == 30
    for step, (got, want) in enumerate(zip(recorded["fast"], recorded["plain"], strict=True)):
        assert got.dtype == want.dtype == torch.float64 and got.shape == want.shape == (2, 1, V)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, s=step: f"step {s}: {m}")


@arms
def test_generation_on_several_threads_equals_without_cache(arm):
    """With 3 threads the fast decoding's head is cut into column blocks (DecodeHead), with and
    without the KV cache: the same tokens as the plain model's, greedy and sampled, past
    block_size."""
    plain, fast = plain_and_fast(arm)
    prompt = random_ids(2, 5, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=10)):
            assert_all_equal(generations(plain, fast, prompt, 40, **sampling))
    finally:
        torch.set_num_threads(before)


def count_fed_tokens(model, fed, monkeypatch):
    """Make model's backbone append the number of tokens of each call to fed."""
    backbone = model.backbone
    monkeypatch.setattr(model, "backbone", lambda x, *a, **kw: fed.append(x.shape[1])
                        or backbone(x, *a, **kw))


@arms
def test_generation_with_cache_feeds_one_token_per_step(arm, monkeypatch):
    """The cached path really uses the cache: between window jumps each step feeds only the newest
    token, through the Decoder with the fast decoding, through GPT.forward in the plain model."""
    plain, fast = plain_and_fast(arm)
    fed = []
    step = Decoder.step
    monkeypatch.setattr(Decoder, "step", lambda self, x, kv: fed.append(("decoder", x.shape[1]))
                        or step(self, x, kv))
    count_fed_tokens(plain, fed, monkeypatch)
    count_fed_tokens(fast, fed, monkeypatch)
    fast.generate(random_ids(1, 5, seed=1), 20, temperature=0.0)
    # 5 prompt tokens by the backbone, 11 single tokens up to 16 by the Decoder, a jump to the last
    # 8 tokens (the backbone), then single tokens again
    assert fed == [5] + [("decoder", 1)] * 11 + [8] + [("decoder", 1)] * 7
    fed.clear()
    plain.generate(random_ids(1, 5, seed=1), 20, temperature=0.0)
    assert fed == [5] + [1] * 11 + [8] + [1] * 7
    # in training mode with dropout on, every token goes through the backbone (the Decoder has no
    # dropout)
    fed.clear()
    dropping = set_runtime(tiny_model(arm, dropout=0.1).train())
    count_fed_tokens(dropping, fed, monkeypatch)
    dropping.generate(random_ids(1, 5, seed=1), 3, temperature=0.0)
    assert fed == [5, 1, 1]  # the Decoder was not called


@arms
def test_generation_with_block_size_one(arm):
    plain, fast = plain_and_fast(arm, block_size=1)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    tokens = generations(plain, fast, prompt, 3, temperature=0.0)
    assert tokens["fast", True].shape == (1, 4)
    assert_all_equal(tokens)


# --------------------------------------------------------------------------------------------------
# LEV's embedding cache: owned by one generation call


def record_embed_distinct(monkeypatch, lev):
    """Wrap lev.embed_distinct so that each call's ids are recorded."""
    calls, original = [], lev.embed_distinct
    monkeypatch.setattr(lev, "embed_distinct",
                        lambda ids: calls.append(ids.tolist()) or original(ids))
    return calls


@pytest.mark.parametrize("kernels", ["c", None])  # LEV's fast path, or its recipe
def test_embedding_cache_equals_reference_and_computes_each_id_once(monkeypatch, kernels):
    lev = tiny_lev(kernels=kernels)
    calls = record_embed_distinct(monkeypatch, lev)
    cache = EmbeddingCache(lev)
    with torch.no_grad():
        for idx in ([[3, 1, 3, 2]], [[5, 2, 4, 2]], [[1, 5]], [[V - 1, 0, 0]]):
            idx = torch.tensor(idx)
            torch.testing.assert_close(lev(idx, cache.lookup), lev.reference(idx),
                                       rtol=1e-10, atol=1e-12)
    assert calls == [[1, 2, 3], [4, 5], [0, V - 1]]  # [[1, 5]] was all cached
    with torch.no_grad():
        lev(torch.tensor([1, 2]))  # without a cache: computed again
    assert calls[-1] == [1, 2]
    with pytest.raises(RuntimeError, match="gradient-free"):
        lev(torch.tensor([1, 2]), cache.lookup)  # gradients on: the weights are about to change
    with pytest.raises(RuntimeError, match="gradient-free"):
        cache.lookup(torch.tensor([1, 2]))


def test_each_generation_call_has_its_own_cache():
    """A generation after an optimizer step (fused AdamW included, which bumps no tensor version) or
    after load_state_dict sees the new weights: the cache of the previous call is gone with that
    call."""
    model = set_runtime(tiny_model("lev"))
    prompt = random_ids(1, 4, seed=1)
    before = model.generate(prompt, 6, temperature=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for _ in range(3):
        _, loss = model(random_ids(2, 8, seed=2), random_ids(2, 8, seed=3))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.generate(prompt, 6, temperature=0)
    set_runtime(model, lev_cache=False)
    uncached = model.generate(prompt, 6, temperature=0, use_cache=False)
    set_runtime(model, lev_fast=False, fast_decoding=False)  # the model's plain code
    plain = model.generate(prompt, 6, temperature=0, use_cache=False)
    assert torch.equal(after, uncached) and torch.equal(after, plain)
    assert not torch.equal(after, before)
    set_runtime(model)
    other = set_runtime(tiny_model("lev", seed=1))
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.generate(prompt, 6, temperature=0),
                       other.generate(prompt, 6, temperature=0))
