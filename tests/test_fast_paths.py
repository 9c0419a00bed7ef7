"""The fast paths change speed, not results: a model trained with them (kernels/fast_paths.py's
install_fast_paths) gives the losses of the same model trained as leviathan.py writes it, step by
step (float64), and generates the same tokens. The model file itself loads nothing of kernels/.

Run:  python -m pytest -q tests/test_fast_paths.py
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, adamw

from kernels.c_kernels import c_library
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import GPT, Config

TINY = dict(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32, lev_seed_dim=16,
            lev_heads=2, lev_rank=8)


def train_losses(model, steps, seed=0):
    """AdamW on two random batches in turn (the same for every model given the seed), so that the
    loss falls -> the loss of each step."""
    optimizer = adamw(model)
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 4, model.config.block_size + 1)
    batches = torch.randint(model.config.vocab_size, shape, generator=generator)
    losses = []
    for step in range(steps):
        x, y = batches[step % 2, :, :-1], batches[step % 2, :, 1:]
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def plain_and_fast(arm, c_kernels=True, lean_head=False):
    torch.manual_seed(0)
    plain = GPT(Config(**TINY, embedding=arm)).double()
    lev = FastEmbedder(c_kernels=c_kernels, compile_kernels=False)
    fast = install_fast_paths(copy.deepcopy(plain), lev=lev, lean_head=lean_head)
    return plain, fast


@pytest.mark.parametrize("arm, kernels", [
    ("lev", "c"),
    ("lev", "torch"),
    ("tied", None),
    ("untied", None),
    ("digits", None),
    ("factorized", None),
])
def test_training_with_fast_paths_gives_the_plain_models_losses(arm, kernels):
    if kernels == "c" and c_library() is None:
        pytest.skip("no C compiler for lev_kernels.c")
    plain, fast = plain_and_fast(arm, c_kernels=kernels == "c", lean_head=True)
    assert plain.tok_emb.fast_embed is None if arm == "lev" else True
    assert plain.fast_logits is None and fast.fast_logits is not None
    plain_losses, fast_logitses = train_losses(plain, 6), train_losses(fast, 6)
    assert plain_losses[-1] < plain_losses[0]  # it trains
    assert fast_logitses == pytest.approx(plain_losses, rel=0, abs=1e-6)
    for (name, p), q in zip(plain.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("arm", ["lev", "tied", "digits", "factorized"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_with_fast_paths_gives_the_plain_models_tokens(arm, temperature):
    plain, fast = plain_and_fast(arm)
    prompt = torch.randint(TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (plain, fast):
        torch.manual_seed(3)  # the same sampling draws
        outputs.append(model.generate(prompt, 3 * TINY["block_size"], temperature=temperature,
                                      top_k=20))
    assert torch.equal(outputs[0], outputs[1])  # past the block size too: the window jumps alike


def test_install_fast_paths_can_turn_every_fast_path_off_again():
    plain, fast = plain_and_fast("lev", lean_head=True)
    install_fast_paths(fast, lev=None, lean_head=False)
    assert fast.tok_emb.fast_embed is None and fast.fast_logits is None
    assert train_losses(fast, 2) == train_losses(plain, 2)  # exactly the same code now


def test_the_model_loads_nothing_of_the_project_and_kernels_only_the_model():
    """The layering: leviathan.py imports nothing of the project; kernels/ imports leviathan.py
    alone (and itself); installing LEV's fast path alone leaves the lean head's module unloaded."""
    code = ("import sys, leviathan; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('kernels', 'lab', 'train', 'sample')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    project = {"leviathan", "train", "sample", "prepare_data", "kernels", "lab"}
    for path in sorted((Path(ROOT) / "kernels").glob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in project - {"leviathan", "kernels"}, line
    code = ("import sys, torch; from kernels.fast_lev import FastEmbedder; "
            "from kernels.fast_paths import install_fast_paths; from leviathan import GPT, Config; "
            "model = GPT(Config(vocab_size=97, block_size=8, n_layer=1, n_head=2, n_embd=16, "
            "lev_seed_dim=8, lev_heads=2, lev_rank=4)); "
            "install_fast_paths(model, lev=FastEmbedder(compile_kernels=False)); "
            "print(model.tok_emb.fast_embed is not None, 'kernels.lean_head' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "False"]


def test_the_scripts_import_nothing_of_the_lab_and_the_top_level_holds_four():
    """The layout: train.py, sample.py and prepare_data.py load nothing of lab/, even
    transitively; the only Python files at the top are the model and those three scripts."""
    code = ("import sys, train, sample, prepare_data; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lab'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
    top = sorted(p.name for p in Path(ROOT).glob("*.py"))
    assert top == ["leviathan.py", "prepare_data.py", "sample.py", "train.py"]
    assert not (Path(ROOT) / "machinery").exists()
