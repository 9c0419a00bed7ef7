"""The GPU path: what only a CUDA device exercises (Triton kernels from torch.compile, fused AdamW,
bf16 autocast, pinned-memory batches), checked against the eager / plain paths the CPU suite already
trusts.

  - LEV's compiled kernels equal the eager ones and LEV.reference (fp32), also at the paper's LEV
    sizes; under bf16 autocast LEV's output stays fp32 and equals the fp32 one;
  - one training step per arm as train.py runs it on a GPU (torch.compile, bf16 autocast, fused
    AdamW, the lean head): finite losses that fall over 20 steps on a fixed batch;
  - the lean head equals full cross-entropy (GPT.forward with lean_head on and off, fp32, loss and
    gradients);
  - generation: the KV cache gives the tokens of full forward passes (greedy), and a generation
    after a fused AdamW step sees the new weights;
  - train.py end to end, in-process: --device=cuda --dtype=bfloat16 --compile.

Every test skips without a GPU (this file was written on a machine without one). Compiling runs with
the default stance here (conftest.py sets "force_eager" for the suite), so the first tests take a
minute of Triton compiling.
Run:  python -m pytest -q tests/test_cuda.py
      (tests/gpu_check.sh runs it with the other GPU checks)
"""

import json
import warnings

import pytest
import torch
from conftest import adamw
from torch._dynamo.utils import counters

import leviathan
import train
from kernels import fast_lev, lean_head
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import GPT, LEV, Config

DEVICE = "cuda"
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("one_thread", "exact_fp32")]
ARMS = pytest.mark.parametrize("arm", leviathan.EMBEDDINGS)


def lev_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("LEV:")]


def close_by_norm(got, want, tol):
    """Tensor by tensor, relative to each tensor's norm: fp32 sums in another order (compiled
    kernels, GPU reductions) lose digits in single elements that are sums of cancelling terms, not
    in the whole."""
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.isfinite(g).all()
        assert (g - w).norm() <= tol * w.norm(), (
            f"relative error {((g - w).norm() / w.norm()).item():.2e}")


# --------------------------------------------------------------------------------------------------
# LEV's kernels on the GPU


def make_lev(size, compile=True, chunk=16):
    torch.manual_seed(0)
    if size == "small":
        # as tests/test_compile.py: d_seed=24 (groups of 8 factors), small everything
        config = Config(vocab_size=300, n_embd=12, n_head=1, lev_seed_dim=24, lev_heads=2,
                        lev_knots=8, lev_rank=4)
    else:
        # the paper's LEV (d_seed=128, h=8, kappa=16, r=64) at the GPU configs' width and GPT-2's V
        config = Config(vocab_size=50257, n_embd=384, n_head=6)
    lev = LEV(config)
    # C: CPU only
    lev.fast_embed = FastEmbedder(chunk=chunk, c_kernels=False, compile_kernels=compile)
    with torch.no_grad():
        # away from the init, so that every knot matters
        lev.spline.add_(0.3 * torch.randn_like(lev.spline))
        lev.ln_weight.mul_(4.0)  # many coordinates near the ends of [0, 1]
    return lev.to(DEVICE)


def values_and_grads(lev, embed, idx, autocast=False):
    """embed(idx) and the gradients of every LEV parameter; with autocast, the forward under bf16
    autocast and the backward after it, as in training."""
    lev.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        E = embed(idx)
    weight = torch.randn(E.shape, generator=torch.Generator().manual_seed(1)).to(E)
    (E * weight).sum().backward()
    return [E.detach()] + [p.grad.clone() for p in lev.parameters()]


# (size, ids, chunk): 37-ish distinct ids in chunks of 16 (full chunks and a remainder: two compiled
# shapes); and at the paper's sizes 1,000 distinct ids in chunks of 256, the reference needing
# ~1.5 GB for them
SMALL_IDS = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(2))
PAPER_IDS = torch.randperm(50257, generator=torch.Generator().manual_seed(2))[:1000].view(4, 250)
CASES = [("small", SMALL_IDS, 16),
         ("paper", PAPER_IDS, 256)]


@pytest.mark.usefixtures("compiling")
@pytest.mark.parametrize("size, ids, chunk", CASES, ids=[c[0] for c in CASES])
def test_compiled_kernels_equal_eager_and_reference(size, ids, chunk):
    """fp32 values and the gradient of every parameter: Triton kernels against the eager kernels
    (which the CPU suite checks in float64 against the plain recipe) and against LEV.reference
    itself."""
    ids = ids.to(DEVICE)
    assert ids.unique().numel() % chunk  # a remainder chunk: a second shape
    lev, eager = make_lev(size, chunk=chunk), make_lev(size, compile=False, chunk=chunk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = values_and_grads(lev, lev, ids)
    assert not lev_warnings(caught) and not fast_lev._compile_failures  # no fallback to eager
    assert set(fast_lev._compiled_kernels) == {fast_lev.log_mode_chunk,
                                               fast_lev.log_mode_chunk_backward}
    # each kernel for a full chunk and for the remainder
    assert counters["stats"]["unique_graphs"] >= 4
    close_by_norm(compiled, values_and_grads(eager, eager, ids), 1e-5)
    # the plain recipe takes one log per factor, the fast path one per 8: a little more
    # rounding apart
    close_by_norm(compiled, values_and_grads(eager, eager.reference, ids), 1e-4)


@pytest.mark.usefixtures("compiling")
def test_lev_under_bf16_autocast_stays_fp32():
    """Training runs LEV inside bf16 autocast: its product and exp must stay fp32 (log|M| reaches
    ~9, and low precision there would wreck the embedding). Output and gradients equal those of
    plain fp32 (backward runs after autocast, as in train.py)."""
    ids = CASES[1][1].to(DEVICE)
    lev, plain = make_lev("paper", chunk=256), make_lev("paper", chunk=256)
    under_autocast = values_and_grads(lev, lev, ids, autocast=True)
    assert all(t.dtype == torch.float32 for t in under_autocast)
    close_by_norm(under_autocast, values_and_grads(plain, plain, ids), 1e-5)


# --------------------------------------------------------------------------------------------------
# Training steps, the lean head, generation


def tiny_gpt(arm, vocab_size=512, block_size=32, seed=0):
    torch.manual_seed(seed)
    config = Config(vocab_size=vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=64,
                    embedding=arm, lev_seed_dim=32, lev_heads=2, lev_rank=16, lev_knots=8)
    # LEV's fast path as sample.py installs it
    return install_fast_paths(GPT(config).to(DEVICE), lev=FastEmbedder())


def random_ids(*shape, vocab_size=512, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=generator).to(DEVICE)


@ARMS
@pytest.mark.usefixtures("compiling")
def test_training_steps_as_train_py_runs_them(arm):
    """train.py's GPU settings: the model through torch.compile, bf16 autocast, the lean head, LEV's
    kernels compiled (lev_chunk as in the GPU configs), fused AdamW, gradient clipping. 20 steps on
    one fixed batch: every loss finite, and the model learns the batch."""
    model = tiny_gpt(arm)
    install_fast_paths(model, lev=FastEmbedder(chunk=1024), lean_head=True)
    optimizer = adamw(model, learning_rate=3e-3)
    assert optimizer.defaults["fused"] is True
    fast_model = torch.compile(model)
    x, y = random_ids(8, 32, seed=1), random_ids(8, 32, seed=2)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                logits, loss = fast_model(x, y)
            # the lean head: no logits made, an fp32 loss
            assert logits.made is None and loss.dtype == torch.float32
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    assert not lev_warnings(caught) and not fast_lev._compile_failures
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # ln(512) = 6.2 at the start; random targets can be memorised
    assert losses[-1] < 0.8 * losses[0], losses


@ARMS
def test_lean_head_equals_full_cross_entropy(arm, monkeypatch):
    """GPT.forward's loss with lean_head on equals it with lean_head off, in value and in every
    parameter's gradient (fp32; a few ignored targets; chunks of 37 tokens, so several chunks and a
    short last one)."""
    monkeypatch.setattr(lean_head, "default_chunk_size", lambda vocab_size: 37)
    model = tiny_gpt(arm)
    x, y = random_ids(4, 32, seed=1), random_ids(4, 32, seed=2)
    y[0, :5] = -1

    def loss_and_grads(lean_head):
        install_fast_paths(model, lev=FastEmbedder(), lean_head=lean_head)
        model.zero_grad(set_to_none=True)
        logits, loss = model(x, y)
        assert isinstance(logits, torch.Tensor) != lean_head
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    close_by_norm(loss_and_grads(True), loss_and_grads(False), 1e-5)


@ARMS
@pytest.mark.usefixtures("compiling")
@pytest.mark.parametrize("n_embd", [64, 384])
def test_no_false_alarm_under_bf16_autocast(arm, n_embd):
    """The unedited model keeps every fast path on the GPU, installed as train.py (training mode,
    the lean head, LEV's compiled kernels) and sample.py (eval mode) install them, under bf16
    autocast: the check (kernels/fast_paths.py) finds only float noise."""
    torch.manual_seed(0)
    config = Config(vocab_size=50257, block_size=256, n_layer=2, n_head=n_embd // 64,
                    n_embd=n_embd, embedding=arm)
    model = GPT(config).to(DEVICE)
    lines = []
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        install_fast_paths(model, lev=FastEmbedder(), lean_head=True, say=lines.append)
        install_fast_paths(model.eval(), lev=FastEmbedder(compile_kernels=False),
                           say=lines.append)
    assert lines == []


@ARMS
@pytest.mark.parametrize("prompt_len", [5, 40])
def test_kv_cache_generation_equals_uncached(arm, prompt_len):
    """Greedy tokens with the KV cache (and LEV's fast path) equal those of full forward
    passes over the same windows, also past block_size (window jumps every 16 tokens). fp32."""
    model = tiny_gpt(arm).eval()
    prompt = random_ids(2, prompt_len, seed=3)
    cached = model.generate(prompt, 60, temperature=0.0)
    install_fast_paths(model)  # the model's plain code, full forward passes
    plain = model.generate(prompt, 60, temperature=0.0, use_cache=False)
    assert cached.shape == (2, prompt_len + 60) and cached.device.type == DEVICE
    assert torch.equal(cached, plain)


@ARMS
def test_compiled_decoding_equals_eager(arm):
    """sample.py --compile on the GPU: the model through torch.compile (Triton) gives the eager
    greedy tokens, past block_size too. fp32."""
    model = tiny_gpt(arm).eval()
    prompt = random_ids(2, 5, seed=3)
    eager = model.generate(prompt, 40, temperature=0.0)
    with torch.compiler.set_stance("default"):
        model.next_logits = torch.compile(model.next_logits)  # as sample.py --compile
        compiled = model.generate(prompt, 40, temperature=0.0)
    assert torch.equal(compiled, eager)


@ARMS
def test_generation_after_a_fused_adamw_step_sees_the_new_weights(arm):
    """Fused AdamW updates the weights in place without bumping their version counters: nothing may
    cache what the weights computed, and the call after the step must equal the plain code's."""
    model = tiny_gpt(arm)
    prompt = random_ids(1, 4, seed=1)
    with torch.no_grad():
        logits_before, _ = model(prompt)
    before = model.generate(prompt, 10, temperature=0.0)
    optimizer = adamw(model, learning_rate=0.05, weight_decay=0.0)
    assert optimizer.defaults["fused"] is True
    for _ in range(3):
        _, loss = model(random_ids(2, 16, seed=2), random_ids(2, 16, seed=3))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits_after, _ = model(prompt)
    # the step changed what the model predicts
    assert not torch.allclose(logits_after, logits_before)
    after = model.generate(prompt, 10, temperature=0.0)
    install_fast_paths(model)  # the model's plain code, full forward passes
    plain = model.generate(prompt, 10, temperature=0.0, use_cache=False)
    assert torch.equal(after, plain)
    assert before.shape == after.shape


# --------------------------------------------------------------------------------------------------
# train.py end to end


GPU_TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--lev_seed_dim=16",
            "--lev_heads=2", "--lev_rank=8", "--lev_knots=6", "--batch_size=8", "--eval_iters=2",
            "--log_interval=1", "--warmup_iters=2", "--max_iters=6", "--eval_interval=3",
            "--learning_rate=3e-3", "--device=cuda", "--dtype=bfloat16", "--compile",
            "--lev_chunk=1024"]


@pytest.mark.usefixtures("compiling")
def test_train_py_end_to_end_on_cuda(tmp_path, char_data, capsys):
    """train.main in-process (as tests/test_train.py runs it), with the GPU settings: a few steps,
    evaluations at steps 0, 3 and 6, a checkpoint that loads, and no fallback of LEV's kernels to
    eager. The lev arm only (the most GPU-specific machinery; every arm's compiled step is tested
    above): compiling a model takes ~30 s."""
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = train.main([f"--data_dir={char_data}", "--dataset=tiny_char", f"--out_dir={out}",
                           "--embedding=lev", *GPU_TINY])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert not lev_warnings(caught) and not fast_lev._compile_failures
    assert "device cuda" in stdout and "dtype bfloat16" in stdout
    with open(out / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [0, 3, 6]
    assert all(torch.isfinite(torch.tensor([r["train_loss"], r["val_loss"]])).all()
               for r in records)
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    ckpt = torch.load(out / "ckpt.pt", weights_only=True, map_location="cpu")
    assert ckpt["step"] == 6 and ckpt["train_config"]["compile"] is True
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
