"""What you edit is what runs: real edits of leviathan.py, each applied by text to a copy of the
project; then train.py, sample.py and eval.py run with their defaults and with the plain path, and
must agree. Every fast path that an edit leaves behind steps aside with one line; those it reaches
stay on, silently (kernels/fast_paths.py). And the check itself: no false alarm on the
unedited model, nothing it touches changed, a probe that fails falls back in one line.

Run:  python -m pytest -q tests/test_edits.py
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, adamw, copy_project, tiny_model

from kernels import fast_paths
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import check_fast_paths, install_fast_paths

FAST_LEV = FastEmbedder(compile_kernels=False)  # LEV's fast path, its kernels eager

# name -> (the fast paths expected to step aside, the text replaced, its replacement); each text
# stands once in leviathan.py
EDITS = {
    # LEV: the spline basis, its ends only, the product; then one that LEV's fast path follows
    "spline basis": ({"lev"}, "0.75 - delta ** 2", "0.9 - delta ** 2"),
    "basis at the ends": ({"lev"}, "w = w / w.sum(-1, keepdim=True) if normalize else w",
                          "w = w / w.sum(-1, keepdim=True).clamp(min=0.95) if normalize else w"),
    "product": ({"lev"}, "M = sign * log_abs.exp()", "M = sign * (0.5 * log_abs).exp()"),
    "coordinates (followed)": (set(), "return torch.sigmoid(x / 2)", "return torch.sigmoid(x)"),
    # a block: the MLP, the attention, the rotary positions, a norm (no fast path repeats them)
    "MLP activation": (set(), "F.silu(self.gate(x))", "F.gelu(self.gate(x))"),
    "attention sharpened": (set(),
                            "        v = qkv[:, :, nh + nkv:].transpose(1, 2)  # (B, nkv, T, hs)\n",
                            "        v = qkv[:, :, nh + nkv:].transpose(1, 2)  # (B, nkv, T, hs)\n"
                            "        q = 2.0 * q\n"),
    "rotary the other way": (set(), "return (x * cos + x.roll(",
                             "return (x * cos - x.roll("),
    "norm's eps (followed)": (set(), "F.rms_norm(x, x.shape[-1:], self.weight, self.eps)",
                              "F.rms_norm(x, x.shape[-1:], self.weight, 0.1)"),
    # the final norm, the input scale, the head and its loss
    "final norm scaled": (set(), "        return self.norm(x)\n",
                          "        return 1.5 * self.norm(x)\n"),
    "embedding scaled": (set(), "            return self.tok_emb(idx)  # LEV checks",
                         "            return 2.0 * self.tok_emb(idx)  # LEV checks"),
    # the loss: the lean head follows what is written on the logits, and steps aside where the
    # plain head's logits change
    "label smoothing (followed)": (set(), "ignore_index=-1)\n        return logits, loss",
                                   "ignore_index=-1, label_smoothing=0.1)\n"
                                   "        return logits, loss"),
    "z-loss (followed)": (set(), "        return logits, loss\n",
                          "        z = torch.logsumexp(logits, -1).square().mean()\n"
                          "        loss = loss + 1e-4 * z\n"
                          "        return logits, loss\n"),
    "logit soft-cap (followed)": (set(), "        if targets is None:\n",
                                  "        logits = 3 * torch.tanh(logits / 3)\n"
                                  "        if targets is None:\n"),
    "head scaled": ({"loss"}, "logits = self.lm_head(x) if", "logits = 2 * self.lm_head(x) if"),
}
SCRIPTS = ["leviathan.py", "train.py", "sample.py", "prepare_data.py", "lab", "kernels"]


def edited_copy(folder, *edits):
    """The project's scripts, kernels/ and lab/ in folder, with each edit's (old, new) applied to
    its leviathan.py: old replaced by new."""
    copy_project(folder, SCRIPTS)
    model_file = folder / "leviathan.py"
    text = model_file.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, f"an edit's text stands {text.count(old)} times in the file"
        text = text.replace(old, new)
    model_file.write_text(text, encoding="utf-8")
    return folder


def run_edited(folder, data, arm):
    """tests/edited_runs.py in the copy -> (its results, its stderr lines)."""
    env = {**os.environ, "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, str(Path(ROOT) / "tests" / "edited_runs.py"), str(data),
                           arm], cwd=folder, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.splitlines()


def stepped_aside(lines):
    """Which fast paths said they stepped aside."""
    names = {part: fast for part, (fast, _, _) in fast_paths.PARTS.items()}
    return {part for part, fast in names.items()
            for line in lines if line.startswith(f"note: {fast} ")}


def assert_default_equals_plain(results):
    default, plain = results["default"], results["plain"]
    assert default["val_losses"] == pytest.approx(plain["val_losses"], rel=1e-5)
    assert default["eval_val_loss"] == pytest.approx(plain["eval_val_loss"], rel=1e-5)
    assert default["text"] == plain["text"]


@pytest.mark.parametrize("name", EDITS)
def test_an_edited_model_runs_as_written(name, tmp_path, char_data):
    expected, old, new = EDITS[name]
    folder = edited_copy(tmp_path / "copy", (old, new))
    results, lines = run_edited(folder, char_data, "lev")
    assert_default_equals_plain(results)
    assert stepped_aside(lines) == expected, "\n".join(lines)
    notes = [line for line in lines if line.startswith("note: ")]
    # as written, or (eval.py) LEV's recipe compiled in its place, each said in one line; an edit
    # whose loss makes the logits (label smoothing) is told what that costs, once
    assert all(("runs as written" in line or "runs in its place, checked" in line
                or "logits were made in full" in line) and "\n" not in line
               for line in notes), "\n".join(notes)


def test_the_unedited_model_keeps_every_fast_path_and_says_nothing(tmp_path, char_data):
    folder = edited_copy(tmp_path / "copy")
    results, lines = run_edited(folder, char_data, "lev")
    assert_default_equals_plain(results)
    assert not any(line.startswith("note: ") for line in lines), "\n".join(lines)


def test_bench_times_only_the_fast_paths_that_follow_an_edit(tmp_path):
    """bench.py in a copy whose spline and MLP were edited: LEV's table times the plain recipe
    alone, said in one line; the MLP has no fast path to step aside."""
    edits = [EDITS[name][1:] for name in ("spline basis", "MLP activation")]
    folder = edited_copy(tmp_path / "copy", *edits)
    toy = ["--dataset=none", "--vocab_size=300", "--n_layer=1", "--n_head=2", "--n_embd=16",
           "--block_size=8", "--lev_ids=40", "--lev_embd=8", "--plain_max=10", "--gen_tokens=4",
           "--gen_rounds=1", "--tables=lev,gen", "--embedding=lev", "--no-gen_compile"]
    done = subprocess.run([sys.executable, "lab/bench.py", *toy], cwd=folder, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert stepped_aside(lines) == {"lev"}
    assert "| LEV plain recipe (LEV.reference), 10 distinct ids |" in done.stdout
    assert "LEV fast path" not in done.stdout


# --------------------------------------------------------------------------------------------------
# the check itself, in-process


def installed(model):
    return {"lev": getattr(model.tok_emb, "fast_embed", None) is not None,
            "loss": model.fast_logits is not None}


@pytest.mark.parametrize("arm", ["lev", "tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_no_false_alarm_on_the_unedited_model(arm, dtype, training):
    # dropout in training: both sides of a probe draw the same masks
    model = tiny_model(arm, dropout=0.1 if training else 0.0).to(dtype).train(training)
    lines = []
    install_fast_paths(model, lev=FAST_LEV, lean_head=True, say=lines.append)
    assert lines == []
    assert installed(model) == {"lev": arm == "lev", "loss": True}


def test_no_false_alarm_after_training_nor_under_bf16_autocast():
    """Trained weights (larger, less regular than at init), and a run under bf16 autocast: the check
    itself runs in plain float32 either way."""
    model = tiny_model("lev")
    install_fast_paths(model, lev=FAST_LEV, lean_head=True, check=False)
    optimizer = adamw(model, learning_rate=3e-2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (4, 17), generator=generator)
    for _ in range(20):
        model(ids[:, :-1], ids[:, 1:])[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    lines = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = check_fast_paths(model, say=lines.append)
    assert lines == [] and set(found) == {"lev", "loss"}


def test_the_check_changes_nothing():
    """No weight, .grad, random state or TF32 flag changes, and training is bit-identical with the
    check and without it."""
    model = tiny_model("lev", dropout=0.1)
    twin = copy.deepcopy(model)
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    install_fast_paths(model, lev=FAST_LEV, lean_head=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == flags
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    install_fast_paths(twin, lev=FAST_LEV, lean_head=True, check=False)
    for m in (model, twin):
        torch.manual_seed(7)
        m.losses = []
        optimizer = adamw(m, learning_rate=1e-2)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(m.config.vocab_size, (2, 17), generator=generator)
        for _ in range(3):
            loss = m(ids[:, :-1], ids[:, 1:])[1]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            m.losses.append(loss.item())
    assert model.losses == twin.losses


def test_a_probe_that_fails_falls_back_to_the_model_in_one_line():
    model = tiny_model("tied")
    install_fast_paths(model, check=False)
    model.fast_logits = lambda *args, **kwargs: 1 / 0  # a fast path that breaks on this model
    lines = []
    found = check_fast_paths(model, say=lines.append)
    assert isinstance(found["loss"], ZeroDivisionError) and model.fast_logits is None
    assert len(lines) == 1 and "could not be checked" in lines[0]
    assert "ZeroDivisionError" in lines[0]
    assert model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1] > 0


def test_a_difference_is_measured_relative_to_the_plain_values():
    plain = torch.tensor([1.0, -4.0, 2.0])
    assert fast_paths.relative_difference(plain + 0.04, plain) == pytest.approx(0.01)
    assert fast_paths.relative_difference(plain[:2], plain) == float("inf")
    nan = torch.tensor([1.0, float("nan"), 2.0])
    assert fast_paths.relative_difference(plain, nan) == float("inf")
    assert fast_paths.relative_difference(nan, nan) == 0.0
