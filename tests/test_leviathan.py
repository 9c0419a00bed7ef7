"""Tests of leviathan.py, the model as it is written (no fast path installed unless a test says so):
the three arms, the KV cache, generation's window and sampling, LEV's basis, parameter counts,
digits, optimizer groups and checkpoints. LEV's fast path is tested in test_fast_lev.py,
generation's in test_generation.py.

Everything is hermetic and runs on CPU: tiny models (V=61, block_size=16, n_embd=32) and, where
exactness matters, float64.
Run:  python -m pytest -q tests/test_leviathan.py
"""

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plain `pytest` finds leviathan.py
from conftest import (  # noqa: E402
    BLOCK,
    V,
    adamw,
    lev_config,
    lev_param_count,
    random_ids,
    tiny_config,
    tiny_lev,
    tiny_model,
)

from kernels.fast_lev import FastEmbedder  # noqa: E402
from kernels.fast_paths import install_fast_paths  # noqa: E402
from lab.checkpoints import CHECKPOINT_VERSION, load_checkpoint  # noqa: E402
from leviathan import (  # noqa: E402
    EMBEDDINGS,
    GPT,
    LEV,
    Config,
    KVCache,
    bspline_basis,
    digit_base,
    sample_next,
)

arms = pytest.mark.parametrize("arm", EMBEDDINGS)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# --------------------------------------------------------------------------------------------------
# The model: shapes, loss at init, causality, gradients, overfitting, tying


@arms
def test_forward_shapes(arm):
    model = tiny_model(arm)
    idx, targets = random_ids(3, 10, seed=1), random_ids(3, 10, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, V) and loss.shape == () and loss.dtype == torch.float32
    logits, loss = model(idx)
    assert logits.shape == (3, 10, V) and loss is None
    # the two calls' logits agree, and generation's next_logits are the last position's
    torch.testing.assert_close(logits, model(idx, targets)[0])
    torch.testing.assert_close(model.next_logits(idx), logits[:, -1])


@arms
def test_loss_at_init_is_near_log_vocab(arm):
    model = tiny_model(arm, vocab_size=500)
    _, loss = model(random_ids(8, BLOCK, seed=1, high=500), random_ids(8, BLOCK, seed=2, high=500))
    assert abs(loss.item() - math.log(500)) < 0.1, \
        f"loss {loss.item():.3f} vs ln(V) = {math.log(500):.3f}"


@arms
def test_targets_minus_one_are_ignored(arm):
    model = tiny_model(arm)
    idx, targets = random_ids(2, 12, seed=1), random_ids(2, 12, seed=2)
    masked = targets.clone()
    masked[:, :5] = -1
    logits, loss = model(idx, masked)
    expected = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, V),
                                                 targets[:, 5:].reshape(-1))
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
@pytest.mark.parametrize("fast", [False, True])  # the plain code, or with the fast paths
def test_gradients_are_finite_and_reach_every_parameter(arm, fast):
    model = tiny_model(arm)
    if fast:
        install_fast_paths(model, lev=FastEmbedder(), lean_head=True)
    _, loss = model(random_ids(4, BLOCK, seed=1), random_ids(4, BLOCK, seed=2))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} gets no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


@arms
def test_overfits_one_batch(arm):
    model = tiny_model(arm, n_layer=1)
    optimizer = adamw(model, learning_rate=1e-2, weight_decay=0.0)
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


def test_a_fresh_model_runs_the_plain_code():
    """leviathan.py's hooks are None until install_fast_paths sets them."""
    model = tiny_model("lev")
    assert model.tok_emb.fast_embed is None and model.fast_logits is None
    install_fast_paths(model, lev=FastEmbedder(), lean_head=True)
    assert model.tok_emb.fast_embed is not None and model.fast_logits is not None
    install_fast_paths(model)
    assert model.tok_emb.fast_embed is None and model.fast_logits is None


@arms
def test_sequence_longer_than_block_size_raises(arm):
    model = tiny_model(arm)
    with pytest.raises(ValueError, match=f"longer than block_size={BLOCK}"):
        model(random_ids(1, BLOCK + 1))


@arms
@pytest.mark.parametrize("bad", [-1, V])
@pytest.mark.parametrize("fast", [False, True])
def test_out_of_range_ids_raise_value_error(arm, bad, fast):
    model = tiny_model(arm)
    if fast:
        install_fast_paths(model, lev=FastEmbedder(), lean_head=True)
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


# --------------------------------------------------------------------------------------------------
# Generation: the KV cache, the window, sampling (more: test_generation.py)


@arms
def test_cached_logits_equal_full_forward(arm):
    """Feeding a prompt and then one token at a time through the KV cache gives the full forward's
    logits."""
    model = tiny_model(arm).eval()
    idx = random_ids(2, BLOCK, seed=1)
    with torch.no_grad():
        full, _ = model(idx, targets=idx)
        kv_cache = KVCache(model.config.n_layer, BLOCK)
        logits = model.next_logits(idx[:, :5], kv_cache)
        torch.testing.assert_close(logits, full[:, 4], rtol=1e-5, atol=1e-5)
        for t in range(5, BLOCK):
            logits = model.next_logits(idx[:, t:t + 1], kv_cache)
            torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)
        assert kv_cache.pos == BLOCK
        with pytest.raises(ValueError, match="longer than block_size"):
            model.next_logits(idx[:, :1], kv_cache)
        kv_cache = KVCache(model.config.n_layer, BLOCK)
        model.next_logits(idx[:, :3], kv_cache)
        with pytest.raises(NotImplementedError):  # several tokens after a non-empty cache
            model.next_logits(idx[:, 3:5], kv_cache)


@arms
@pytest.mark.parametrize("fast", [False, True])  # generation as written, or with sample.py's path
def test_greedy_equals_argmax_loop(arm, fast):
    """While the sequence fits in block_size, greedy generation is argmax over full forward passes
    (of the plain model); past it, the model sees the window of the last block_size // 2 tokens
    after each jump (GPT.stream's policy)."""
    model = tiny_model(arm).eval()
    lev = FastEmbedder(compile_kernels=False)
    generator = install_fast_paths(tiny_model(arm).eval(), lev=lev) if fast else model
    idx = random_ids(2, 4, seed=1)
    generated = generator.generate(idx, 30, temperature=0.0)
    start = 0
    with torch.no_grad():
        for _ in range(30):
            if idx.shape[1] - start > BLOCK:
                start = idx.shape[1] - BLOCK // 2
            logits, _ = model(idx[:, start:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated[:, :BLOCK], idx[:, :BLOCK])  # the plain loop, before any jump
    assert torch.equal(generated, idx)


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-3), "max_new_tokens=-3 must be >= 0"),
    (dict(idx=random_ids(1, 0)), "the prompt is empty"),
])
def test_stream_rejects_bad_sampling_settings_at_the_call(settings, message):
    model = tiny_model("tied").eval()
    settings = {"idx": random_ids(1, 3), "max_new_tokens": 5, **settings}
    with pytest.raises(ValueError, match=message):
        model.stream(**settings)  # not at the first token: stream itself is not a generator
    with pytest.raises(ValueError, match=message):
        model.generate(**settings)


def test_sample_next_top_k_one_is_argmax():
    torch.manual_seed(0)
    for _ in range(5):
        logits = torch.randn(16, 50)
        for temperature in (1.0, 0.5, 2.0):
            assert torch.equal(sample_next(logits, temperature, top_k=1),
                               logits.argmax(-1, keepdim=True))
    assert torch.equal(sample_next(logits, 0.0, top_k=7, top_p=0.5),
                       logits.argmax(-1, keepdim=True))


def test_sample_next_top_k_keeps_the_k_likeliest():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    drawn = sample_next(logits.expand(4000, 50), 1.0, top_k=3)
    assert set(drawn.flatten().tolist()) == set(logits[0].topk(3).indices.tolist())


@pytest.mark.parametrize("top_p, nucleus", [(0.45, {2}), (0.7, {2, 1}), (0.8, {2, 1, 4}),
                                            (1.0, {0, 1, 2, 3, 4})])
def test_sample_next_top_p_keeps_the_smallest_nucleus(top_p, nucleus):
    """Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 in shuffled order: the nucleus is the smallest
    set of likeliest ids whose probability reaches top_p."""
    probs = torch.tensor([0.0625, 0.25, 0.5, 0.0625, 0.125])
    torch.manual_seed(0)
    drawn = sample_next(probs.log().expand(4000, 5), 1.0, top_p=top_p)
    assert set(drawn.flatten().tolist()) == nucleus


def test_sample_next_a_top_p_below_float32_keeps_the_likeliest():
    """top_p=1e-300 is 0 in fp32: every id would be dropped and sampling would fail on NaN
    probabilities."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, 0.8, 200, 1e-300), logits.argmax(-1, keepdim=True))


# --------------------------------------------------------------------------------------------------
# LEV as written: its basis, an empty batch


@pytest.mark.parametrize("n_knots", [16, 8, 3, 2])
@pytest.mark.parametrize("normalize", [True, False])
def test_basis_from_its_3_nearest_knots_equals_the_basis_over_every_knot(n_knots, normalize):
    """bspline_basis computes the 3 knots nearest t; its docstring's formula over all n_knots
    knots, written out here, gives the same values and gradients (float64, to 1e-12), at the ends,
    on knots, halfway between them and between."""
    t = torch.cat([torch.tensor([0.0, 1.0]), torch.linspace(0, 1, 2 * n_knots - 1),
                   torch.rand(500, generator=torch.Generator().manual_seed(0))]).double()
    t1, t2 = t.clone().requires_grad_(), t.clone().requires_grad_()
    delta = (t1.unsqueeze(-1) - torch.linspace(0, 1, n_knots, dtype=t.dtype)).abs() * (n_knots - 1)
    every = torch.where(delta < 0.5, 0.75 - delta ** 2,
                        torch.where(delta < 1.5, 0.5 * (1.5 - delta) ** 2, 0.0))
    every = every / every.sum(-1, keepdim=True) if normalize else every
    nearest = bspline_basis(t2, n_knots, normalize)
    torch.testing.assert_close(nearest, every, rtol=0, atol=1e-12)
    weight = torch.randn(every.shape, generator=torch.Generator().manual_seed(1)).double()
    (every * weight).sum().backward()
    (nearest * weight).sum().backward()
    torch.testing.assert_close(t2.grad, t1.grad, rtol=0, atol=1e-12)


def test_normalised_basis_is_a_partition_of_unity_and_plain_inside():
    """The plain basis sums to 1 only inside [1/30, 29/30] (16 knots): 0.875 at t = 0 and 1.
    Normalised, it sums to 1 everywhere, and equals the plain basis inside."""
    t = torch.linspace(0, 1, 3001, dtype=torch.float64)
    plain, normalised = bspline_basis(t, 16, normalize=False), bspline_basis(t, 16, normalize=True)
    torch.testing.assert_close(normalised.sum(-1), torch.ones_like(t), rtol=0, atol=1e-14)
    torch.testing.assert_close(plain.sum(-1)[[0, -1]],
                               torch.tensor([0.875, 0.875], dtype=torch.float64))
    inside = (t >= 1 / 30) & (t <= 29 / 30)
    torch.testing.assert_close(normalised[inside], plain[inside], rtol=0, atol=1e-14)
    assert not torch.allclose(normalised[~inside], plain[~inside])


@pytest.mark.parametrize("kernels", [None, "c"])  # the recipe, or LEV's fast path
def test_lev_of_an_empty_batch_is_empty(kernels):
    lev = tiny_lev(kernels=kernels)
    for shape in [(0,), (2, 0)]:
        E = lev(torch.zeros(shape, dtype=torch.long))
        assert E.shape == (*shape, lev.n_embd) and E.dtype == torch.float64


# --------------------------------------------------------------------------------------------------
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
    model = GPT(Config(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=n_embd,
                       **lev_settings))
    assert model.param_report()["input_embedding"] == counted


def test_lev_param_count_at_paper_size():
    assert lev_param_count(200376, 2048) == 2_252_928
    with torch.device("meta"):  # shapes only, nothing allocated
        lev = LEV(lev_config(200376, 2048))
    assert sum(p.numel() for p in lev.parameters()) == 2_252_928


def test_digit_base_is_the_smallest_sufficient_base():
    cases = [(v, k) for v in range(2, 1500) for k in (1, 2, 3, 4, 5)]
    cases += [(v, k) for v in (125, 216, 4096, 50257, 65536, 200376, 10**9, 10**9 + 1, 10**18,
                               10**18 + 1, 2**53 + 1, 999_999_999_999, 2**60 - 1)
              for k in (1, 2, 3, 4, 6, 12)]
    for v, k in cases:
        b = digit_base(v, k)
        assert b >= 2 and b**k >= v, (v, k, b)
        assert b == 2 or (b - 1) ** k < v, (v, k, b)
    known = {(125, 3): 5, (216, 3): 6, (4096, 3): 16, (4096, 2): 64, (4096, 12): 2, (50257, 3): 37,
             (200376, 3): 59, (10**18, 3): 10**6, (10**18 + 1, 3): 10**6 + 1, (2, 3): 2}
    assert {case: digit_base(*case) for case in known} == known


@pytest.mark.parametrize("vocab_size, n_digits",
                         [(V, 3), (1000, 3), (50257, 3), (4096, 2), (7, 1)])
def test_digits_round_trip(vocab_size, n_digits):
    lev = LEV(lev_config(vocab_size, 4, lev_digits=n_digits, lev_seed_dim=2, lev_heads=1,
                         lev_knots=3, lev_rank=1))
    ids = torch.arange(vocab_size)
    digits = lev.digits(ids)
    assert digits.shape == (vocab_size, n_digits)
    assert digits.min() >= 0 and digits.max() < lev.base
    # most significant first
    powers = torch.tensor([lev.base ** (n_digits - 1 - r) for r in range(n_digits)])
    assert torch.equal((digits * powers).sum(-1), ids)


def test_lev_out_init_std_scales_w_out_only():
    """W_out ~ N(0, std^2 / h) from the same random draws: 0.02 is the initialisation LEV had before
    the setting existed (the default is 0.002 now), another std scales W_out alone."""
    config = lev_config(lev_heads=2, lev_seed_dim=4, lev_knots=5, lev_rank=3)
    torch.manual_seed(0)
    default = LEV(dataclasses.replace(config, lev_out_init_std=0.02))
    # the draws of LEV.__init__, in its order, with the formula it had before the setting
    torch.manual_seed(0)
    draws = [torch.randn(3, default.base, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 5, 3),
             torch.randn(2, 3, 12)]
    assert torch.equal(default.out_proj, draws[-1] * 0.02 / math.sqrt(2))
    torch.manual_seed(0)
    doubled = LEV(dataclasses.replace(config, lev_out_init_std=0.04))
    assert torch.equal(doubled.out_proj, 2 * default.out_proj)
    assert all(torch.equal(getattr(doubled, name), getattr(default, name))
               for name in ("codebooks", "seed_proj", "ln_weight", "ln_bias", "spline"))


def test_digits_are_most_significant_first():
    lev = LEV(lev_config(1000, 4, lev_digits=3, lev_seed_dim=2, lev_heads=1, lev_knots=3,
                         lev_rank=1))
    assert lev.base == 10
    assert lev.digits(torch.tensor([123, 7, 999])).tolist() == [[1, 2, 3], [0, 0, 7], [9, 9, 9]]


# --------------------------------------------------------------------------------------------------
# Optimizer groups


def decay_groups(model, optimizer):
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] > 0
               for p in group["params"]}
    plain = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] == 0
             for p in group["params"]}
    return names, decayed, plain


@arms
def test_param_groups_decay_matrices_only(arm):
    """train.py's optimizer: two groups, decay then no_decay."""
    model = tiny_model(arm)
    optimizer = adamw(model, learning_rate=3e-4)
    names, decayed, plain = decay_groups(model, optimizer)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert all(g["lr"] == 3e-4 and g["betas"] == (0.9, 0.95) for g in optimizer.param_groups)
    for name, p in model.named_parameters():
        if p.dim() == 1 or name == "tok_emb.spline":
            assert name in plain, f"{name} should not be decayed"
    matrices = ["blocks.0.attn.qkv.weight", "blocks.1.mlp.down.weight"]
    own = {"lev": ["codebooks", "seed_proj", "out_proj"], "digits": ["codebooks", "proj"],
           "factorized": ["table", "proj"]}.get(arm, ["weight"])
    matrices += [f"tok_emb.{name}" for name in own] + (["lm_head.weight"] if arm != "tied" else [])
    assert set(matrices) <= decayed


def test_lev_layernorm_gains_and_biases_are_not_decayed_and_frozen_parts_left_out():
    model = tiny_model("lev")
    _, _, plain = decay_groups(model, adamw(model, learning_rate=1e-3))
    assert {"tok_emb.ln_weight", "tok_emb.ln_bias"} <= plain
    model.tok_emb.requires_grad_(False)
    names, decayed, plain = decay_groups(model, adamw(model, learning_rate=1e-3))
    assert not any(name.startswith("tok_emb.") for name in decayed | plain)


# --------------------------------------------------------------------------------------------------
# Checkpoints


def write_checkpoint(model, path, version=CHECKPOINT_VERSION):
    """A checkpoint as train.py writes it (the dict of the shared interface), after one training
    step."""
    optimizer = adamw(model, learning_rate=1e-3)
    _, loss = model(random_ids(2, 8, seed=1), random_ids(2, 8, seed=2))
    loss.backward()
    optimizer.step()
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": V, "dtype": "uint16",
            "train_tokens": 100, "val_tokens": 10, "chars": "".join(chr(65 + i) for i in range(V)),
            "source": "synthetic"}
    ckpt = {"version": version, "model": model.state_dict(),
            "model_config": dataclasses.asdict(model.config),
            "train_config": {"batch_size": 2, "learning_rate": 1e-3}, "meta": meta, "step": 1,
            "tokens_seen": 16, "best_val_loss": float("inf"), "optimizer": optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()}}
    torch.save(ckpt, path)


@arms
@pytest.mark.parametrize("fast", [False, True])  # both models plain, or both with the fast paths
def test_checkpoint_round_trip_gives_identical_logits(arm, fast, tmp_path):
    model = tiny_model(arm)
    if fast:
        install_fast_paths(model, lev=FastEmbedder())
    write_checkpoint(model, tmp_path / "ckpt.pt")
    model.eval()
    idx = random_ids(2, BLOCK, seed=3)
    with torch.no_grad():
        expected, _ = model(idx, targets=idx)
    for where in (tmp_path, tmp_path / "ckpt.pt", str(tmp_path)):
        loaded, ckpt = load_checkpoint(where)
        if fast:
            install_fast_paths(loaded, lev=FastEmbedder())
        assert not loaded.training and ckpt["step"] == 1 and ckpt["meta"]["vocab_size"] == V
        assert loaded.config == model.config
        with torch.no_grad():
            assert torch.equal(loaded(idx, targets=idx)[0], expected)
        if arm == "tied":
            assert loaded.lm_head.weight is loaded.tok_emb.weight


def test_checkpoint_of_another_version_is_refused(tmp_path):
    write_checkpoint(tiny_model("lev"), tmp_path / "ckpt.pt", version=CHECKPOINT_VERSION + 1)
    with pytest.raises(ValueError,
                       match=f"format {CHECKPOINT_VERSION + 1}, and this leviathan reads "
                             f"format 2: train the run again"):
        load_checkpoint(tmp_path)
    write_checkpoint(tiny_model("lev"), tmp_path / "ckpt.pt", version=1)
    with pytest.raises(ValueError,
                       match="format 1, and this leviathan reads format 2"):
        load_checkpoint(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    where = re.escape(str(tmp_path / "ckpt.pt"))
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {where}"):
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


def test_lev_backward_repeats_bit_for_bit_on_two_threads():
    """Each id's embedding reaches the batch through F.embedding, whose backward sums repeated ids
    in a fixed order on any number of threads (indexing's does not): the same gradients every time,
    so that a resumed run repeats a straight one bit for bit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lev = tiny_model("lev").tok_emb
        ids = random_ids(200_000, seed=3)  # 61 distinct ids, each ~3,000 times
        weight = torch.randn(200_000, lev.n_embd, generator=torch.Generator().manual_seed(1))
        grads = [torch.autograd.grad((lev(ids) * weight).sum(), list(lev.parameters()))
                 for _ in range(3)]
    finally:
        torch.set_num_threads(previous)
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again, strict=True))


# --------------------------------------------------------------------------------------------------
# The compact arms: digits (LEV's first stage alone) and factorized (ALBERT's)


@pytest.mark.parametrize("vocab_size, n_embd, k, d_seed", [(61, 12, 3, 16), (50257, 128, 3, 128),
                                                            (200376, 2048, 3, 128)])
def test_compact_arms_param_formulas(vocab_size, n_embd, k, d_seed):
    """digits: k*b*d_seed + d_seed*n_embd; factorized: V*E + E*n_embd, E nearest LEV's size."""
    size = dict(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=2, n_embd=n_embd,
                lev_digits=k, lev_seed_dim=d_seed)
    with torch.device("meta"):  # shapes only
        digits = GPT(Config(**size, embedding="digits")).param_report()
        factorized = GPT(Config(**size, embedding="factorized"))
    assert digits["input_embedding"] == k * digit_base(vocab_size, k) * d_seed + d_seed * n_embd
    E = factorized.tok_emb.table.shape[1]
    report = factorized.param_report()
    assert report["input_embedding"] == vocab_size * E + E * n_embd
    lev = lev_param_count(vocab_size, n_embd, lev_digits=k, lev_seed_dim=d_seed)
    assert abs(report["input_embedding"] - lev) <= (vocab_size + n_embd) / 2  # the nearest E
    assert digits["head"] == report["head"] == vocab_size * n_embd  # untied heads
    if (vocab_size, n_embd) == (50257, 128):
        assert E == 25


def test_factorized_dim_can_be_set():
    model = tiny_model("factorized", factorized_dim=5)
    assert model.tok_emb.table.shape == (V, 5) and model.tok_emb.proj.shape == (5, 32)
    with pytest.raises(ValueError, match="factorized_dim=-1 must be an integer >= 0"):
        tiny_config("factorized", factorized_dim=-1)


@pytest.mark.parametrize("arm", ["digits", "factorized"])
def test_compact_arms_start_at_a_tables_scale(arm):
    """Their embeddings start with entries of std ~0.02, as a 0.02-std table's (and LEV's)."""
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=5000, block_size=8, n_layer=1, n_head=2, n_embd=128,
                       embedding=arm))
    with torch.no_grad():
        E = model.embed(torch.arange(5000).view(1, -1))
    assert 0.015 < E.std().item() < 0.025
    digits_share = tiny_model("digits").tok_emb.seed(torch.arange(V))
    lev_share = tiny_model("lev").tok_emb.seed(torch.arange(V))
    assert digits_share.shape == lev_share.shape  # the same first stage
