"""Retrofitting LEV onto a tied or untied run (lab/retrofit.py): the fit, the swap, the checkpoint
it writes and train.py's fine-tuning of it, the refusals, and docs/retrofit.md's recipe (all
hermetic, CPU, tiny models on the char_data fixture)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import test_train
import torch
from conftest import ROOT, copy_project, prepare_text, random_ids, tiny_lev, tiny_model
from test_train import read_log

import leviathan
import sample
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from lab import checkpoints, dataset, retrofit
from lab import eval as ev

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# LEV as test_train.py's tiny runs have it (so that train.py fine-tunes the checkpoint with its
# TINY flags), and a short fit
LEV = ["--lev_seed_dim=16", "--lev_heads=2", "--lev_rank=8", "--lev_knots=6"]
FIT = ["--fit_steps=20", "--fit_batch=64", "--fit_lr=3e-3", "--log_interval=5"]


def run_train(capsys, data, out, *args):
    """train.py's tiny run (test_train.py's), with LEV's kernels eager."""
    return test_train.run_train(capsys, data, out, "--log_interval=5", "--lev_compile=False",
                                *args)


def run_retrofit(run_cli, data, source, out, *args):
    """lab/retrofit.py's main in-process -> (exit code, stdout, stderr)."""
    return run_cli(retrofit.main, [source, f"--out={out}", f"--data_dir={data}", "--device=cpu",
                                   *LEV, *FIT, *args])


def load(path):
    return torch.load(path, weights_only=True)


@pytest.fixture
def source(tmp_path, char_data, capsys, request):
    """A trained source run of the arm request.param (tied by default): its directory."""
    arm = getattr(request, "param", "tied")
    out = tmp_path / f"src-{arm}"
    code, _, err = run_train(capsys, char_data, out, "--max_iters=4", "--eval_interval=4",
                             f"--embedding={arm}")
    assert code == 0, err
    return out


@pytest.fixture
def fitted(tmp_path, char_data, source, run_cli):
    """The source retrofitted by lab/retrofit.py with LEV and FIT: the checkpoint's path."""
    out = tmp_path / "retrofit.pt"
    code, _, err = run_retrofit(run_cli, char_data, source, out)
    assert code == 0, err
    return out


# --------------------------------------------------------------------------------------------------
# The fit, on LEV alone


@pytest.mark.parametrize("loss", retrofit.FIT_LOSSES)
@pytest.mark.parametrize("kind", retrofit.FIT_WEIGHTS)
def test_the_fit_lowers_its_own_loss(loss, kind):
    lev = tiny_lev(kernels="torch")
    table = tiny_lev(seed=5, kernels=None).table() * 10  # a table that a LEV can represent
    counts = torch.arange(lev.vocab_size) % 7  # some unseen ids, others seen up to 6 times
    weights = retrofit.id_weights(kind, counts)
    before, _ = retrofit.report(lev, table, weights, counts.numpy(), loss)
    retrofit.fit(lev, table, weights, loss, steps=40, lr=3e-3, batch=32, log=lambda line: None)
    after, buckets = retrofit.report(lev, table, weights, counts.numpy(), loss)
    assert after["loss"] < 0.5 * before["loss"], (before, after)
    assert [b["bucket"] for b in buckets] == list(dataset.BUCKETS)
    assert buckets[0]["ids"] == int((counts == 0).sum()) and buckets[0]["tokens"] == 0
    assert buckets[0]["rel_error_tokens"] is None and buckets[0]["rel_error"] is not None
    assert sum(b["ids"] for b in buckets) == lev.vocab_size


def test_bucket_report_averages_over_ids_and_over_tokens():
    # buckets: unseen, unseen, 1-10, 1-10, 11-100, 1k-10k (and none in 101-1k or >10k)
    counts = torch.tensor([0, 0, 3, 5, 20, 2000]).numpy()
    rel_error = torch.tensor([0.9, 0.7, 0.2, 0.6, 0.3, 0.1]).numpy()
    cosine = torch.tensor([0.1, 0.3, 0.9, 0.5, 0.8, 1.0]).numpy()
    row_norm = torch.tensor([1.0, 3.0, 2.0, 4.0, 0.5, 6.0]).numpy()
    rows = {r["bucket"]: r for r in retrofit.bucket_report(rel_error, cosine, row_norm, counts)}
    assert rows["unseen"]["ids"] == 2 and rows["unseen"]["tokens"] == 0
    assert rows["unseen"]["rel_error"] == pytest.approx(0.8)
    assert rows["unseen"]["row_norm"] == pytest.approx(2.0)
    assert rows["unseen"]["rel_error_tokens"] is None and rows["unseen"]["cosine_tokens"] is None
    seldom = rows["1-10"]
    assert (seldom["ids"], seldom["tokens"], seldom["row_norm"]) == (2, 8, pytest.approx(3.0))
    assert seldom["rel_error"] == pytest.approx(0.4) and seldom["cosine"] == pytest.approx(0.7)
    assert seldom["rel_error_tokens"] == pytest.approx((3 * 0.2 + 5 * 0.6) / 8)
    assert seldom["cosine_tokens"] == pytest.approx((3 * 0.9 + 5 * 0.5) / 8)
    assert rows["1k-10k"]["tokens"] == 2000 and rows["1k-10k"]["cosine_tokens"] == pytest.approx(1)
    empty = rows["101-1k"]
    assert empty["ids"] == 0 and empty["row_norm"] is None and empty["rel_error"] is None
    lines = retrofit.format_buckets(list(rows.values()))
    assert len(lines) == 1 + len(dataset.BUCKETS) and "row norm" in lines[0]


def test_a_tied_table_becomes_a_head_of_its_own():
    tied, lev_model = tiny_model("tied", seed=0), tiny_model("lev", seed=1)
    table = retrofit.transplant(lev_model, tied.state_dict())
    assert torch.equal(lev_model.lm_head.weight, tied.tok_emb.weight) and table is not None
    assert lev_model.lm_head.weight.data_ptr() != tied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        tied.tok_emb.weight.add_(1.0)  # the source's table changes: the new head does not
    assert not torch.equal(lev_model.lm_head.weight, tied.tok_emb.weight)
    untied = tiny_model("untied", seed=2)
    with pytest.raises(ValueError, match="do not fit a lev model"):
        retrofit.transplant(lev_model, {**untied.state_dict(), "extra.weight": torch.zeros(1)})


# --------------------------------------------------------------------------------------------------
# python lab/retrofit.py RUN --out=PATH


@pytest.mark.parametrize("source", ["tied", "untied"], indirect=True)
def test_the_swap_keeps_the_source_and_puts_lev_table_at_the_input(tmp_path, char_data, capsys,
                                                                   source, run_cli):
    code, out, err = run_retrofit(run_cli, char_data, source, tmp_path / "rf.pt")
    assert code == 0, err
    assert "retrofit: fitting LEV to the source's input table" in out
    assert "fit step 5/20 | loss" in out and "fit step 20/20 | loss" in out
    assert "over ids: rel error, cosine" in out and "  unseen " in out
    assert f"--init_from={tmp_path / 'rf.pt'}" in out
    src, rf = load(source / "ckpt.pt"), load(tmp_path / "rf.pt")
    assert rf["version"] == checkpoints.CHECKPOINT_VERSION and rf["meta"] == src["meta"]
    assert rf["model_config"]["embedding"] == "lev" and rf["model_config"]["n_embd"] == 32
    assert rf["model_config"]["lev_seed_dim"] == 16 and rf["step"] == src["step"] == 4
    # the backbone and the head are the source's, exactly
    head_key = "tok_emb.weight" if src["model_config"]["embedding"] == "tied" else "lm_head.weight"
    assert torch.equal(rf["model"]["lm_head.weight"], src["model"][head_key])
    backbone = [k for k in src["model"] if not k.startswith(("tok_emb.", "lm_head."))]
    assert backbone and all(torch.equal(rf["model"][k], src["model"][k]) for k in backbone)
    # the forward: the source's, with LEV.table() in place of its input table (float64)
    lev_model, _ = checkpoints.load_checkpoint(tmp_path / "rf.pt")
    table_config = {**src["model_config"], "embedding": "untied"}
    table_model = leviathan.GPT(leviathan.Config(**table_config)).eval()
    table_model.load_state_dict({**src["model"], "lm_head.weight": src["model"][head_key]})
    lev_model.double()
    table_model.double()
    with torch.no_grad():
        table_model.tok_emb.weight.copy_(lev_model.tok_emb.table())
    x = random_ids(3, 16, high=src["model_config"]["vocab_size"])
    expected, _ = table_model(x, torch.zeros_like(x))
    logits, _ = lev_model(x, torch.zeros_like(x))
    torch.testing.assert_close(logits, expected, rtol=1e-12, atol=1e-12)
    # the fit's figures: printed, and in the checkpoint with its settings and source
    figures = rf["retrofit"]
    assert figures["source"] == str(source / "ckpt.pt")
    assert figures["source_embedding"] == src["model_config"]["embedding"]
    assert {"fit_steps": 20, "fit_batch": 64, "fit_lr": 3e-3, "fit_loss": "cosine_norm",
            "fit_weights": "counts"}.items() <= figures.items()
    assert 0 < figures["loss"] and -1 <= figures["cosine"] <= 1 and len(figures["buckets"]) == 6
    assert (f"loss {figures['loss']:.4f}, rel error {figures['rel_error']:.4f}, cosine "
            f"{figures['cosine']:.4f}") in out
    # train.py evaluates it as any checkpoint it fine-tunes: the model right after the swap
    code, _, err = run_train(capsys, char_data, tmp_path / "swap", f"--init_from={tmp_path}/rf.pt",
                             "--max_iters=0")
    assert code == 0, err
    (record,) = read_log(tmp_path / "swap")
    assert record["step"] == 0 and record["init_from"] == str(tmp_path / "rf.pt")
    assert ev.read_curve(str(tmp_path / "swap"), 0) == ([(0.0, record["val_loss"])], True)


def test_the_fit_is_the_recipe_and_follows_the_seed(tmp_path, char_data, source, fitted, run_cli):
    """The script's model is this recipe's, tensor for tensor (the recipe train.py's retrofit
    followed at f34d3d0): the seed, then a new lev model of RUN's architecture, RUN's backbone and
    head, then the fit with a generator of its own on the training counts, through the fast path."""
    src = load(source / "ckpt.pt")
    config = {**src["model_config"], "embedding": "lev", "lev_seed_dim": 16, "lev_heads": 2,
              "lev_rank": 8, "lev_knots": 6}
    torch.manual_seed(1337)
    model = leviathan.GPT(leviathan.Config(**config))
    table = retrofit.transplant(model, src["model"])
    install_fast_paths(model, lev=FastEmbedder())
    train_tokens = dataset.load_split(char_data / "tiny_char", "train")
    weights = retrofit.id_weights("counts", dataset.train_counts(train_tokens, len(table)))
    retrofit.fit(model.tok_emb, table, weights, "cosine_norm", steps=20, lr=3e-3, batch=64,
                 log=lambda line: None, seed=1337)
    script = load(fitted)["model"]
    assert script.keys() == model.state_dict().keys()
    assert all(torch.equal(script[k], v) for k, v in model.state_dict().items())
    code, _, err = run_retrofit(run_cli, char_data, source, tmp_path / "seed2.pt", "--seed=2")
    assert code == 0, err
    other = load(tmp_path / "seed2.pt")["model"]
    assert not torch.equal(other["tok_emb.codebooks"], script["tok_emb.codebooks"])
    assert torch.equal(other["lm_head.weight"], script["lm_head.weight"])


def test_train_fine_tunes_resumes_samples_and_evaluates_it(tmp_path, char_data, capsys, source,
                                                           fitted, run_cli):
    whole = ["--eval_interval=2", "--lr_decay_iters=4", f"--init_from={fitted}"]
    assert run_train(capsys, char_data, tmp_path / "whole", *whole, "--max_iters=4")[0] == 0
    assert run_train(capsys, char_data, tmp_path / "split", *whole, "--max_iters=2")[0] == 0
    code, out, err = run_train(capsys, char_data, tmp_path / "split", "--init_from=resume",
                               "--max_iters=4", "--eval_interval=2")
    assert code == 0 and "resuming at step 2" in out and "fit step" not in out, err

    def losses(out):
        return [(r["step"], r["tokens"], r["train_loss"], r["val_loss"], r["lr"])
                for r in read_log(out)]

    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    whole_ckpt, split_ckpt = (load(tmp_path / run / "ckpt.pt") for run in ("whole", "split"))
    assert all(torch.equal(whole_ckpt["model"][k], v) for k, v in split_ckpt["model"].items())
    assert split_ckpt["origin"]["checkpoint"] == str(fitted) and split_ckpt["step"] == 4
    assert split_ckpt["model_config"]["embedding"] == "lev"
    assert split_ckpt["optimizer"]["state"][0]["step"] == 4  # a fresh optimizer at the swap
    samples = sample.main([f"--out_dir={tmp_path / 'split'}", "--device=cpu", "--num_samples=1",
                           "--max_new_tokens=5"])
    assert len(samples) == 1 and len(samples[0]) == 1 + 5  # the prompt "\n", then 5 characters
    capsys.readouterr()
    code, out, err = run_cli(ev.main, [str(source), str(tmp_path / "split"), "--device=cpu",
                                       f"--data_dir={char_data}", "--lambada_max=0"])
    assert code == 0 and "| unseen | " in out, err


def test_freeze_embedding_keeps_the_fitted_lev(tmp_path, char_data, capsys, fitted):
    code, out, err = run_train(capsys, char_data, tmp_path / "ft", f"--init_from={fitted}",
                               "--max_iters=3", "--eval_interval=3", "--freeze=embedding",
                               "--learning_rate=1e-2")
    assert code == 0 and "(frozen: embedding)" in out, err
    lev, tuned = load(fitted)["model"], load(tmp_path / "ft" / "ckpt.pt")["model"]
    lev_keys = [k for k in lev if k.startswith("tok_emb.")]
    assert lev_keys and all(torch.equal(lev[k], tuned[k]) for k in lev_keys)
    assert not torch.equal(lev["lm_head.weight"], tuned["lm_head.weight"])


def test_help_lists_every_flag(run_cli):
    code, out, _ = run_cli(retrofit.main, ["--help"])
    assert code == 0 and "usage: retrofit.py" in out
    flags = ["--out", "--overwrite", "--data_dir", "--dataset", "--device", "--seed",
             "--log_interval", "--fit_steps", "--fit_lr", "--fit_batch", "--fit_loss",
             "--fit_weights"] + [f"--{f.name}" for f in retrofit.LEV_SETTINGS]
    assert "--lev_knots" in flags and not [f for f in flags if not re.search(f"{f}\\b", out)]
    assert "(default: 4096)" in out and "(default: cosine_norm)" in out


@pytest.mark.parametrize("source", ["lev"], indirect=True)
def test_refusals_are_one_line(tmp_path, char_data, bpe_data, capsys, source, run_cli):
    lev_source = source
    tied = tmp_path / "src-tied"
    assert run_train(capsys, char_data, tied, "--embedding=tied", "--max_iters=1")[0] == 0
    (tmp_path / "exists.pt").write_bytes(b"")
    cases = [
        (lev_source, [], "is a lev model already: nothing to retrofit"),
        (tmp_path / "none", [], "no checkpoint at"),
        (tied, [f"--data_dir={bpe_data}", "--dataset=tiny_bpe"],
         "was trained on char tokens (vocab_size 36), characters"),
        (tied, ["--dataset=missing"], "no prepared dataset in"),
        (tied, ["--fit_lr=0"], "--fit_lr=0.0 must be a finite number > 0"),
        (tied, ["--fit_lr=nan"], "--fit_lr=nan must be a finite number > 0"),
        (tied, ["--fit_steps=-1"], "--fit_steps=-1 must be >= 0"),
        (tied, ["--fit_batch=0"], "--fit_batch=0 must be in [1, 2^31)"),
        (tied, ["--fit_batch=2147483648"], "--fit_batch=2147483648 must be in [1, 2^31)"),
        (tied, ["--fit_weights=often"], "fit_weights"),
        (tied, ["--fit_loss=l1"], "fit_loss"),
        (tied, ["--seed=-1"], "--seed=-1 must be in [0, 2^63)"),
        (tied, ["--log_interval=0"], "--log_interval=0 must be at least 1"),
        (tied, ["--tune_steps=-1"], "--tune_steps=-1 must be >= 0"),
        (tied, ["--tune_lr=inf"], "--tune_lr=inf must be a finite number > 0"),
        (tied, ["--tune_anchor=-1"], "--tune_anchor=-1.0 must be a finite number >= 0"),
        (tied, ["--tune_block=0"], "--tune_block=0 must be at least 1"),
        (tied, ["--tune_target=both"], "tune_target"),
        (tied, ["--lev_knots=2"], "lev_knots=2 must be at least 3"),
        (tied, ["--lev_normalize_basis=yes"], "'yes' is not True or False"),
        (tied, ["--fit_step=5"], "unrecognized arguments: --fit_step=5"),
        (tied, [f"--out={tmp_path / 'exists.pt'}"], "already exists; give another path, or pass "
         "--overwrite"),
        (tied, [f"--out={tied / 'ckpt.pt'}", "--overwrite"], "is RUN's own checkpoint"),
        (tied, [f"--out={tmp_path}"], "is a directory; give a file name"),
    ]
    for run, args, message in cases:
        code, _, err = run_retrofit(run_cli, char_data, run, tmp_path / "rf.pt", *args)
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)
        assert "Traceback" not in err and not (tmp_path / "rf.pt").exists(), args
    code, _, err = run_cli(retrofit.main, [tied, f"--data_dir={char_data}"])
    assert code == 2 and "--out" in err and err.count("\n") == 1


@pytest.mark.parametrize("target", ["teacher", "text"])
def test_tuning_trains_lev_alone_inside_the_model(tmp_path, char_data, source, fitted, run_cli,
                                                  target):
    """--tune_steps after the fit (the same fit: the same seed): LEV's parameters move, nothing
    else; the tuning's loss falls; the checkpoint records the settings."""
    out = tmp_path / "tuned.pt"
    code, stdout, err = run_retrofit(run_cli, char_data, source, out, "--tune_steps=30",
                                     f"--tune_target={target}", "--tune_lr=3e-3",
                                     "--tune_block=16", "--tune_anchor=0.5")
    assert code == 0, err
    fit, tuned = load(fitted), load(out)
    for name, weight in fit["model"].items():
        moved = not torch.equal(weight, tuned["model"][name])
        assert moved == name.startswith("tok_emb."), name
    losses = [float(x) for x in re.findall(rf"tune step \d+/30 \| {target} loss ([\d.]+)", stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], stdout
    assert (tuned["retrofit"]["tune"]["steps"], tuned["retrofit"]["tune"]["target"]) == (30, target)


def test_lev_from_starts_from_an_earlier_fit(tmp_path, char_data, source, fitted, run_cli):
    out = tmp_path / "again.pt"
    code, _, err = run_retrofit(run_cli, char_data, source, out, "--fit_steps=0",
                                f"--lev_from={fitted}")
    assert code == 0, err
    assert all(torch.equal(v, load(fitted)["model"][k]) for k, v in load(out)["model"].items())
    code, _, err = run_retrofit(run_cli, char_data, source, tmp_path / "bad.pt",
                                f"--lev_from={source}")  # a tied run: no LEV
    assert code == 2 and err.count("\n") == 1 and "holds no LEV of these settings" in err, err


def test_a_fit_stopped_or_failed_writes_nothing(tmp_path, char_data, source, run_cli,
                                                monkeypatch):
    """Ctrl-C during the fit stops in one line; a fit that diverges is refused in one line; after
    either, --out does not exist and the same command works. A second time, --out exists: refused
    unless --overwrite."""
    out, fit = tmp_path / "rf.pt", retrofit.fit

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(retrofit, "fit", interrupted)
    code, _, err = run_retrofit(run_cli, char_data, source, out)
    assert code == 130 and err == "retrofit.py: stopped (Ctrl-C); nothing was written\n"
    monkeypatch.setattr(retrofit, "fit", fit)
    code, _, err = run_retrofit(run_cli, char_data, source, out, "--fit_lr=1e9")
    assert code == 2 and "lower --fit_lr" in err and err.count("\n") == 1
    assert list(tmp_path.glob("rf.pt*")) == []  # not even a temporary file
    assert run_retrofit(run_cli, char_data, source, out)[0] == 0
    first = load(out)["model"]
    code, _, err = run_retrofit(run_cli, char_data, source, out, "--seed=2")
    assert code == 2 and "already exists" in err
    assert run_retrofit(run_cli, char_data, source, out, "--seed=2", "--overwrite")[0] == 0
    assert not torch.equal(load(out)["model"]["tok_emb.codebooks"], first["tok_emb.codebooks"])


# --------------------------------------------------------------------------------------------------
# docs/retrofit.md's recipe, run from a copy of the project's root


def test_the_recipe_of_docs_retrofit(tmp_path, text):
    page = (Path(ROOT) / "docs" / "retrofit.md").read_text(encoding="utf-8")
    [recipe] = [r for r in re.findall(r"```bash\n(.*?)```", page, re.S) if "lab/retrofit.py" in r]
    copy = copy_project(tmp_path / "copy", ["leviathan.py", "train.py", "sample.py",
                                            "prepare_data.py", "lab", "kernels", "config"])
    tiny = [f for f in test_train.TINY if not f.startswith(("--device", "--log_interval"))]
    (copy / "config" / "shakespeare_cpu.py").write_text(
        "".join(f"{f[2:].split('=')[0]} = {f.split('=')[1]}\n" for f in tiny))
    prepare_text(text, "char", str(copy / "data" / "shakespeare"), "shakespeare", "synthetic")
    subprocess.run([sys.executable, "train.py", "config/shakespeare_cpu.py", "--embedding=tied",
                    "--max_iters=2", "--eval_interval=2", "--lev_compile=False",
                    "--out_dir=out-shakespeare-cpu-tied"], cwd=copy,
                   check=True, capture_output=True, timeout=300)
    for old, new in [("--out=retrofit-tied.pt", "--out=retrofit-tied.pt --fit_steps=5 "
                      f"--fit_batch=64 {' '.join(LEV)}"), ("--max_iters=100 --lr_decay_iters=100",
                                                           "--max_iters=2 --lr_decay_iters=2")]:
        assert old in recipe, old
        recipe = recipe.replace(old, new)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=copy,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load(copy / "retrofit-tied.pt")["retrofit"]["fit_steps"] == 5
    assert [r["step"] for r in read_log(copy / "out-retrofit-tied")] == [0]
    assert [r["step"] for r in read_log(copy / "out-retrofit-tied-ft")][-1] == 2
    assert "out-retrofit-tied-ft" in done.stdout
