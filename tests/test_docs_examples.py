"""Every worked diff and recipe of docs/training.md, applied to a copy of the project and run (a few
steps of a tiny model), its effect asserted: a change of train.py that breaks one turns CI red.
A diff that no longer applies is made again as a reader would: its change written into a fresh
train.py, then `git diff` pasted into the page.
Run: python -m pytest -q tests/test_docs_examples.py"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, copy_project, prepare_text
from test_train import TINY

PAGE = Path(ROOT) / "docs" / "training.md"
PROJECT = ["leviathan.py", "train.py", "sample.py", "prepare_data.py", "lab", "kernels",
           "config"]
# the example each diff is, found by a line only it adds
DIFFS = {"schedule": '+    "schedule": (', "weight_norm": "+def weight_norm(model):",
         "sgd": '+    "optimizer": (', "extra_eval": '+    "extra_dataset": (',
         "grad_norms": "+def grad_parts(model):", "loss_term": "+                log_z = ",
         "val_metric": '+                "accuracy": '}


def examples(kind):
    """docs/training.md's ```kind blocks, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def the_diff(name):
    [diff] = [d for d in examples("diff") if DIFFS[name] in d]
    return diff


def copy_of_project(folder, diff=None):
    """The project's scripts in folder, with diff applied as a reader would (git apply)."""
    copy_project(folder, PROJECT)
    if diff is not None:
        done = subprocess.run(["git", "apply", "-"], input=diff, cwd=folder, text=True,
                              capture_output=True)
        assert done.returncode == 0, f"the diff no longer applies: {done.stderr}"
    return folder


def train(folder, data, out, *flags, expect=0):
    """train.py of the copy, in its own process -> (stdout, stderr)."""
    done = subprocess.run([sys.executable, "train.py", f"--data_dir={data}", "--dataset=tiny_char",
                           f"--out_dir={out}", *TINY, "--lev_compile=False", *flags], cwd=folder,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == expect, done.stderr[-3000:]
    return done.stdout, done.stderr


def records(out):
    return [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]


def test_every_diff_on_the_page_is_tested():
    diffs = examples("diff")
    assert len(diffs) == len(DIFFS)
    assert all(sum(marker in d for d in diffs) == 1 for marker in DIFFS.values())


def test_the_wsd_schedule(tmp_path, char_data):
    copy = copy_of_project(tmp_path / "copy", the_diff("schedule"))
    out = tmp_path / "out"
    train(copy, char_data, out, "--schedule=wsd", "--max_iters=10", "--eval_interval=5",
          "--warmup_iters=1", "--learning_rate=1e-3", "--min_lr=1e-4")
    lrs = {r["step"]: r["lr"] for r in records(out)}
    assert lrs[5] == 1e-3  # held: decay starts at 80% of lr_decay_iters
    assert lrs[10] == 1e-4
    # a resume keeps the schedule; a bad decay_fraction is one line
    train(copy, char_data, out, "--init_from=resume", "--max_iters=12", "--eval_interval=6")
    assert json.loads((out / "log.jsonl").read_text().splitlines()[-1])["lr"] == 1e-4
    _, err = train(copy, char_data, tmp_path / "bad", "--decay_fraction=1.5", expect=2)
    assert err.count("\n") == 1 and "decay_fraction=1.5 must be in [0, 1)" in err


def test_the_weight_norm_in_the_log(tmp_path, char_data):
    copy = copy_of_project(tmp_path / "copy", the_diff("weight_norm"))
    stdout, _ = train(copy, char_data, tmp_path / "out", "--max_iters=2", "--eval_interval=2")
    norms = [r["weight_norm"] for r in records(tmp_path / "out")]
    assert len(norms) == 2 and all(n > 0 for n in norms) and norms[0] != norms[1]
    assert "| weight norm " in stdout


def test_a_val_metric_is_one_entry(tmp_path, char_data):
    copy = copy_of_project(tmp_path / "copy", the_diff("val_metric"))
    stdout, _ = train(copy, char_data, tmp_path / "out", "--max_iters=2", "--eval_interval=2")
    for r in records(tmp_path / "out"):
        assert 0 <= r["train_accuracy"] <= 1 and 0 <= r["val_accuracy"] <= 1
    assert "val accuracy " in stdout


def test_sgd_and_its_resume(tmp_path, char_data):
    import torch

    copy = copy_of_project(tmp_path / "copy", the_diff("sgd"))
    out = tmp_path / "out"
    train(copy, char_data, out, "--optimizer=sgd", "--max_iters=2", "--eval_interval=2")
    state = torch.load(out / "ckpt.pt", weights_only=True)["optimizer"]
    assert "momentum_buffer" in next(iter(state["state"].values()))
    assert state["param_groups"][0]["nesterov"] is True
    train(copy, char_data, out, "--init_from=resume", "--max_iters=4", "--eval_interval=2")
    assert [r["step"] for r in records(out)] == [0, 2, 4]


def test_the_gradient_norm_of_each_part(tmp_path, char_data):
    """With one step per record, the parts' norms make up the total exactly; LEV's parts make up
    the embedding's; the tied table is one part, embedding+head; frozen parts are left out."""
    import math

    copy = copy_of_project(tmp_path / "copy", the_diff("grad_norms"))
    train(copy, char_data, tmp_path / "lev", "--max_iters=2", "--eval_interval=1")
    first, *others = records(tmp_path / "lev")
    assert first["grad_norms"] is None  # no step yet
    for r in others:
        parts = r["grad_norms"]
        assert list(parts) == ["embedding", "lev.codebooks", "lev.seed_proj", "lev.ln",
                               "lev.spline", "lev.out_proj", "backbone", "head"]
        assert all(math.isfinite(norm) and norm > 0 for norm in parts.values())
        whole = math.hypot(parts["embedding"], parts["backbone"], parts["head"])
        assert whole == pytest.approx(r["grad_norm"], rel=1e-5)
        lev_whole = math.hypot(*(parts[k] for k in parts if k.startswith("lev.")))
        assert lev_whole == pytest.approx(parts["embedding"], rel=1e-5)
    train(copy, char_data, tmp_path / "tied", "--max_iters=1", "--eval_interval=1",
          "--embedding=tied")
    assert list(records(tmp_path / "tied")[-1]["grad_norms"]) == ["embedding+head", "backbone"]
    train(copy, char_data, tmp_path / "ft", f"--init_from={tmp_path / 'lev'}", "--max_iters=1",
          "--eval_interval=1", "--freeze=embedding,backbone")
    assert list(records(tmp_path / "ft")[-1]["grad_norms"]) == ["head"]


def test_the_extra_evaluation(tmp_path, char_data, text):
    prepare_text(text[::-1], "char", str(char_data / "reversed"), "reversed", "synthetic")
    copy = copy_of_project(tmp_path / "copy", the_diff("extra_eval"))
    train(copy, char_data, tmp_path / "out", "--extra_dataset=reversed", "--max_iters=2",
          "--eval_interval=2")
    for r in records(tmp_path / "out"):
        assert r["extra_val_loss"] > 0 and r["extra_val_loss"] != r["val_loss"]


def test_a_loss_term_written_as_in_nanogpt(tmp_path, char_data):
    """The term on the logits, right after the forward, with the default settings (the lean
    head): it trains as with --lean_head=False, its value is in the progress line, and the val loss
    stays the cross-entropy (step 0's equals the unedited run's)."""
    copy = copy_of_project(tmp_path / "copy", the_diff("loss_term"))
    losses = {}
    for lean in (True, False):
        stdout, _ = train(copy, char_data, tmp_path / f"out-{lean}", f"--lean_head={lean}",
                          "--max_iters=3", "--eval_interval=3")
        assert stdout.count("| (log Z)^2 ") == 3
        losses[lean] = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]
    assert losses[True] == pytest.approx(losses[False], abs=2e-4) and len(losses[True]) == 3
    train(ROOT, char_data, tmp_path / "unedited", "--max_iters=3", "--eval_interval=3")
    first = [records(tmp_path / name)[0] for name in ("out-True", "unedited")]
    assert first[0]["val_loss"] == first[1]["val_loss"]
    last = [records(tmp_path / name)[-1] for name in ("out-True", "unedited")]
    assert last[0]["val_loss"] != last[1]["val_loss"]  # the term changed the training


def test_a_z_loss_as_the_page_says(tmp_path, char_data):
    """--z_loss, a term on the logits in train.py, trains with the default (lean) head as with
    --lean_head=False; the val loss stays the cross-entropy (step 0's is the same with and
    without it)."""
    losses, val = {}, {}
    for lean in (True, False):
        out = tmp_path / f"out-{lean}"
        stdout, _ = train(ROOT, char_data, out, "--z_loss=0.1", f"--lean_head={lean}",
                          "--max_iters=3", "--eval_interval=3", "--embedding=tied")
        losses[lean] = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]
    assert losses[True] == pytest.approx(losses[False], abs=2e-4) and len(losses[True]) == 3
    train(ROOT, char_data, tmp_path / "none", "--max_iters=3", "--eval_interval=3",
          "--embedding=tied")
    val = [records(tmp_path / name)[0]["val_loss"] for name in ("out-True", "none")]
    assert val[0] == val[1]


def run_recipe(recipe, folder, replacements):
    """A bash recipe of the page, with a tiny model and few steps in place of its settings."""
    for old, new in replacements:
        assert old in recipe, old
        recipe = recipe.replace(old, new)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=folder,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def tiny_config(folder):
    """config/shakespeare_cpu.py of the copy, made tiny (the recipes name it)."""
    flags = [f for f in TINY if not f.startswith(("--device", "--log_interval"))]
    lines = [f"{f[2:].split('=')[0]} = {f.split('=')[1]}" for f in flags]
    (folder / "config" / "shakespeare_cpu.py").write_text("\n".join(lines) + "\n")


def test_the_fine_tuning_recipe(tmp_path, text):
    [recipe] = [r for r in examples("bash") if "part_a.txt" in r]
    copy = copy_of_project(tmp_path / "copy")
    tiny_config(copy)
    (copy / "input.txt").write_text(text, encoding="utf-8")
    stdout = run_recipe(recipe, copy, [
        ("TEXT=data/shakespeare/input.txt", "TEXT=input.txt"),
        ("--input=part_a.txt", "--input=part_a.txt --tokenizer=char"),
        ("--input=part_b.txt", "--input=part_b.txt --tokenizer=char"),
        ("--max_iters=150 \\\n      --lr_decay_iters=150", "--max_iters=3 --lr_decay_iters=3"),
        ("--max_iters=100 \\\n      --lr_decay_iters=100", "--max_iters=2 --lr_decay_iters=2"),
        ("--warmup_iters=10", "--warmup_iters=1"), ("--eval_interval=25", "--eval_interval=2"),
        ("--lambada_max=100", "--lambada_max=0")])
    for arm in ("tied", "untied", "lev"):
        [first, *_] = records(copy / f"out-b-{arm}")
        assert first["init_from"].startswith(f"out-a-{arm}")
        assert f"out-b-{arm}" in stdout


def test_the_model_page_parameter_recipe():
    """docs/model.md's one recipe: the parameter report of every arm at the GPU recipe's shape."""
    page = (Path(ROOT) / "docs" / "model.md").read_text(encoding="utf-8")
    [recipe] = re.findall(r"```bash\n(.*?)```", page, re.S)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    arms = [line.split()[0] for line in done.stdout.splitlines()]
    assert arms == ["lev", "tied", "untied", "digits", "factorized"]
    assert all("'total':" in line for line in done.stdout.splitlines())
