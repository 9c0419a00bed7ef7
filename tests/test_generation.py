"""Generation: GPT.stream with and without the KV cache, with and without LEV's fast path (as
sample.py installs it), against the model's own plain code (leviathan.py with no fast path): the
same logits (float64) and the same tokens, greedy and sampled, far past block_size.

Everything is hermetic and runs on CPU: tiny models (V=61, block_size=16, n_embd=32).
Run:  python -m pytest -q tests/test_generation.py
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plain `pytest` finds leviathan.py
from conftest import BLOCK, V, random_ids, tiny_model  # noqa: E402

from kernels.fast_lev import FastEmbedder  # noqa: E402
from kernels.fast_paths import install_fast_paths  # noqa: E402
from leviathan import EMBEDDINGS, GPT, Config  # noqa: E402

arms = pytest.mark.parametrize("arm", EMBEDDINGS)
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0),
             dict(temperature=0.8, top_k=10, top_p=0.9)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def plain_and_fast(arm, **overrides):
    """Two copies of one tiny model in eval mode: as leviathan.py runs it, and with sample.py's
    fast path (LEV's, kernels eager)."""
    plain = tiny_model(arm, **overrides).eval()
    fast = install_fast_paths(tiny_model(arm, **overrides).eval(),
                              lev=FastEmbedder(compile_kernels=False))
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
# Generation: with LEV's fast path against the plain model's, with and without the KV cache


@arms
@pytest.mark.parametrize("prompt_len", [5, BLOCK + 4])
@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_generation_with_cache_equals_without(arm, prompt_len, sampling):
    """Same tokens with and without the KV cache, with the fast path and in the plain model,
    also far past block_size (several window jumps)."""
    plain, fast = plain_and_fast(arm)
    prompt = random_ids(2, prompt_len, seed=1)
    tokens = generations(plain, fast, prompt, 40, **sampling)
    cached = tokens["fast", True]
    assert cached.shape == (2, prompt_len + 40)
    assert torch.equal(cached[:, :prompt_len], prompt)
    assert_all_equal(tokens)


def record_logits(model, record):
    """Make each generation step of model append its logits (GPT.next_logits) to record."""
    next_logits = model.next_logits

    def recorded(idx, *args, **kwargs):
        logits = next_logits(idx, *args, **kwargs)
        record.append(logits.clone())
        return logits

    model.next_logits = recorded


@arms
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("sampling", [SAMPLINGS[0], SAMPLINGS[2]])
def test_fast_generation_gives_the_plain_generations_logits_in_float64(arm, use_cache, sampling):
    """In float64, each step of a generation with the fast path computes the logits of the plain
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
        assert got.dtype == want.dtype == torch.float64 and got.shape == want.shape == (2, V)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, s=step: f"step {s}: {m}")


@arms
def test_generation_on_several_threads_equals_without_cache(arm):
    """With 3 threads, with and without the KV cache: the same tokens as the plain model's on one,
    greedy and sampled, past block_size."""
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
    token through the backbone."""
    plain, fast = plain_and_fast(arm)
    for model in (plain, fast):
        fed = []
        count_fed_tokens(model, fed, monkeypatch)
        model.generate(random_ids(1, 5, seed=1), 20, temperature=0.0)
        # 5 prompt tokens, 11 single tokens up to 16, a jump to the last 8 tokens, then single
        # tokens again
        assert fed == [5] + [1] * 11 + [8] + [1] * 7


@arms
def test_generation_with_block_size_one(arm):
    plain, fast = plain_and_fast(arm, block_size=1)
    prompt = torch.zeros(1, 1, dtype=torch.long)
    tokens = generations(plain, fast, prompt, 3, temperature=0.0)
    assert tokens["fast", True].shape == (1, 4)
    assert_all_equal(tokens)


def test_a_logits_hook_rewrites_every_next_tokens_logits():
    """GPT.stream's logits_hook gets each step's (B, V) float32 logits and all the tokens so far,
    and sampling uses what it returns: banned tokens never come, with and without the cache."""
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=40, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    idx, calls = torch.randint(40, (2, 3)), []

    def ban_below_20(logits, so_far):
        calls.append((logits.dtype, tuple(logits.shape), so_far.shape[1]))
        return torch.cat([torch.full_like(logits[:, :20], -float("inf")), logits[:, 20:]], 1)

    assert (model.generate(idx, 12, temperature=1.0)[:, 3:] < 20).any()  # without: some come
    for use_cache in (True, False):
        calls.clear()
        out = model.generate(idx, 12, temperature=1.0, use_cache=use_cache,
                             logits_hook=ban_below_20)
        assert (out[:, 3:] >= 20).all()
        assert calls == [(torch.float32, (2, 40), n) for n in range(3, 15)]
