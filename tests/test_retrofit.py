"""Retrofitting LEV onto a tied or untied run (train.py --init_from=RUN --embedding=lev,
machinery/retrofit.py): the fit, the swap, the fine-tuning run after it, and the refusals (all
hermetic, CPU, tiny models on the char_data fixture)."""

import os

import pytest
import test_train
import torch
from conftest import random_ids, tiny_lev, tiny_model
from test_train import read_log

import leviathan
import sample
import train
from lab import eval as ev
from machinery import checkpoints, dataset, retrofit

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# test_train.py's tiny runs, with fewer progress lines and LEV's kernels eager
RUN = ["--log_interval=5", "--lev_compile=False"]
FIT = ["--embedding=lev", "--fit_steps=20", "--fit_batch=64", "--fit_lr=3e-3"]


def run_train(capsys, data, out, *args):
    return test_train.run_train(capsys, data, out, *RUN, *args)


def load(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)


@pytest.fixture
def source(tmp_path, char_data, capsys, request):
    """A trained source run of the arm request.param (tied by default): its directory."""
    arm = getattr(request, "param", "tied")
    out = tmp_path / f"src-{arm}"
    code, _, err = run_train(capsys, char_data, out, "--max_iters=4", "--eval_interval=4",
                             f"--embedding={arm}")
    assert code == 0, err
    return out


# --------------------------------------------------------------------------------------------------
# The fit, on LEV alone


@pytest.mark.parametrize("loss", train.CHOICES["fit_loss"])
@pytest.mark.parametrize("kind", train.CHOICES["fit_weights"])
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


def test_a_frozen_lev_is_fitted_and_stays_frozen():
    lev = tiny_lev(kernels="torch")
    lev.requires_grad_(False)
    start = {k: v.clone() for k, v in lev.state_dict().items()}
    table = torch.randn(lev.vocab_size, lev.n_embd, dtype=torch.float64) * 0.02
    weights = retrofit.id_weights("uniform", torch.ones(lev.vocab_size))
    retrofit.fit(lev, table, weights, steps=3, lr=1e-2, batch=16, log=lambda line: None)
    assert any(not torch.equal(start[k], v) for k, v in lev.state_dict().items())
    assert not any(p.requires_grad for p in lev.parameters())


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
# train.py --init_from=RUN --embedding=lev


@pytest.mark.parametrize("source", ["tied", "untied"], indirect=True)
def test_the_swap_keeps_the_source_and_puts_lev_table_at_the_input(tmp_path, char_data, capsys,
                                                                   source):
    code, out, err = run_train(capsys, char_data, tmp_path / "rf", f"--init_from={source}", *FIT,
                               "--max_iters=0")
    assert code == 0, err
    assert "retrofit: fitting LEV to the source's input table" in out
    assert "fit step 5/20 | loss" in out and "fit step 20/20 | loss" in out
    assert "over ids: rel error, cosine" in out and "  unseen " in out
    src, rf = load(source), load(tmp_path / "rf")
    assert rf["model_config"]["embedding"] == "lev" and rf["model_config"]["n_embd"] == 32
    # the backbone and the head are the source's, exactly
    head_key = "tok_emb.weight" if src["model_config"]["embedding"] == "tied" else "lm_head.weight"
    assert torch.equal(rf["model"]["lm_head.weight"], src["model"][head_key])
    backbone = [k for k in src["model"] if not k.startswith(("tok_emb.", "lm_head."))]
    assert backbone and all(torch.equal(rf["model"][k], src["model"][k]) for k in backbone)
    # the forward: the source's, with LEV.table() in place of its input table (float64)
    lev_model, _ = checkpoints.load_checkpoint(tmp_path / "rf", leviathan.GPT, leviathan.Config)
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
    # the origin and the fit's figures: in ckpt.pt and in the step-0 record
    fitted = rf["origin"]["retrofit"]
    assert rf["origin"]["embedding"] == src["model_config"]["embedding"]
    assert {"fit_steps": 20, "fit_batch": 64, "fit_lr": 3e-3, "fit_loss": "cosine_norm",
            "fit_weights": "counts"}.items() <= fitted.items()
    assert 0 < fitted["loss"] and -1 <= fitted["cosine"] <= 1 and len(fitted["buckets"]) == 6
    (record,) = read_log(tmp_path / "rf")
    assert record["step"] == 0 and record["retrofit"] == fitted
    assert ev.read_curve(str(tmp_path / "rf"), 0) == ([(0.0, record["val_loss"])], True)


def test_the_retrofitted_run_fine_tunes_resumes_samples_and_evaluates(tmp_path, char_data, capsys,
                                                                      source, run_cli):
    whole = ["--eval_interval=2", "--lr_decay_iters=4", f"--init_from={source}", *FIT]
    assert run_train(capsys, char_data, tmp_path / "whole", *whole, "--max_iters=4")[0] == 0
    assert run_train(capsys, char_data, tmp_path / "split", *whole, "--max_iters=2")[0] == 0
    code, out, err = run_train(capsys, char_data, tmp_path / "split", "--init_from=resume",
                               "--max_iters=4", "--eval_interval=2")
    assert code == 0 and "resuming at step 2" in out and "fit step" not in out, err
    def losses(out):
        return [(r["step"], r["tokens"], r["train_loss"], r["val_loss"], r["lr"])
                for r in read_log(out)]

    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    assert ["retrofit" in r for r in read_log(tmp_path / "split")] == [True, False, False]
    whole_ckpt, split_ckpt = load(tmp_path / "whole"), load(tmp_path / "split")
    assert all(torch.equal(whole_ckpt["model"][k], v) for k, v in split_ckpt["model"].items())
    assert split_ckpt["origin"]["retrofit"]["fit_steps"] == 20 and split_ckpt["step"] == 4
    assert split_ckpt["optimizer"]["state"][0]["step"] == 4  # a fresh optimizer at the swap
    samples = sample.main([f"--out_dir={tmp_path / 'split'}", "--device=cpu", "--num_samples=1",
                           "--max_new_tokens=5"])
    assert len(samples) == 1 and len(samples[0]) == 1 + 5  # the prompt "\n", then 5 characters
    capsys.readouterr()
    code, out, err = run_cli(ev.main, [str(source), str(tmp_path / "split"), "--device=cpu",
                                       f"--data_dir={char_data}", "--lambada_max=0"])
    assert code == 0 and "| unseen | " in out, err


def test_freeze_embedding_keeps_the_fitted_lev(tmp_path, char_data, capsys, source):
    args = [f"--init_from={source}", *FIT]
    assert run_train(capsys, char_data, tmp_path / "fit", *args, "--max_iters=0")[0] == 0
    code, out, err = run_train(capsys, char_data, tmp_path / "ft", *args, "--max_iters=3",
                               "--eval_interval=3", "--freeze=embedding", "--learning_rate=1e-2")
    assert code == 0 and "(frozen: embedding)" in out, err
    fitted, tuned = load(tmp_path / "fit")["model"], load(tmp_path / "ft")["model"]
    lev_keys = [k for k in fitted if k.startswith("tok_emb.")]
    assert lev_keys and all(torch.equal(fitted[k], tuned[k]) for k in lev_keys)
    assert not torch.equal(fitted["lm_head.weight"], tuned["lm_head.weight"])


@pytest.mark.parametrize("source", ["lev"], indirect=True)
def test_a_lev_source_with_embedding_lev_is_a_plain_fine_tune(tmp_path, char_data, capsys, source):
    code, out, err = run_train(capsys, char_data, tmp_path / "ft", f"--init_from={source}",
                               "--embedding=lev", "--max_iters=1", "--eval_interval=1")
    assert code == 0 and "fit step" not in out, err
    ckpt = load(tmp_path / "ft")
    assert "retrofit" not in ckpt["origin"] and "retrofit" not in read_log(tmp_path / "ft")[0]


def test_refusals_are_one_line(tmp_path, char_data, bpe_data, capsys, source):
    src = f"--init_from={source}"
    cases = [
        ([src, "--embedding=lev", f"--data_dir={bpe_data}", "--dataset=tiny_bpe"],
         "was trained on char tokens (vocab_size 36), but"),
        ([src, "--embedding=lev", "--n_embd=64"],
         "has n_embd=32, this run asks for 64; fine-tuning keeps the source's architecture"),
        ([src, "--embedding=untied"], "has embedding='tied', this run asks for 'untied'"),
        ([src, "--fit_steps=5"], "fit_steps=5 applies to a retrofit"),
        (["--fit_loss=mse"], "fit_loss=mse applies to a retrofit"),
        ([src, "--embedding=lev", "--fit_lr=0"], "fit_lr=0.0 must be > 0"),
        ([src, "--embedding=lev", "--fit_weights=often"], "fit_weights"),
        ([f"--out_dir={source}", "--init_from=resume", "--fit_steps=5"],
         "a resumed run does not fit again"),
    ]
    for args, message in cases:
        code, _, err = run_train(capsys, char_data, tmp_path / "rf", *args)
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)


# --------------------------------------------------------------------------------------------------
# A run that stops before its first save strands nothing


def test_a_fit_stopped_or_failed_before_the_first_save_strands_nothing(tmp_path, char_data, capsys,
                                                                      source, monkeypatch):
    """Ctrl-C during the fit stops in one line; a fit that diverges is refused in one line; after
    either, out_dir holds a log.jsonl but no checkpoint, which is not a run: the same command
    starts again and works, and --init_from=resume says there is nothing to resume."""
    out = tmp_path / "retrofit"
    args = [f"--init_from={source}", *FIT, "--max_iters=2", "--eval_interval=2"]
    fit = retrofit.fit

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(retrofit, "fit", interrupted)
    code, _, err = run_train(capsys, char_data, out, *args)
    assert code == 130 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("train.py: stopped (Ctrl-C); no checkpoint was saved yet: the same "
                          "command starts the run again")
    assert (out / "log.jsonl").exists() and not (out / "ckpt.pt").exists()
    monkeypatch.setattr(retrofit, "fit", fit)
    code, _, err = run_train(capsys, char_data, out, *args, "--fit_lr=1e9")
    assert code == 2 and "lower --fit_lr" in err and err.count("\n") == 1
    code, _, err = run_train(capsys, char_data, out, "--init_from=resume")
    assert code == 2 and "holds no ckpt.pt to resume" in err and err.count("\n") == 1
    code, _, err = run_train(capsys, char_data, out, *args)
    assert code == 0, err
    assert [r["step"] for r in read_log(out)] == [0, 2]
