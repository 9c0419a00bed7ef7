"""train.py: end to end, exact resume, the same batches for every arm, DDP, and clear errors (all
hermetic, CPU).

Most runs call train.main in-process (importing torch once per process is the slow part here); the
command line itself runs as a subprocess once, and DDP under torch.distributed.run once."""

import errno
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, fast_path_check_running, prepare_text, spoil_training_loss

import leviathan
import train
from lab import checkpoints, dataset
from lab import eval as ev

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--lev_seed_dim=16",
        "--lev_heads=2", "--lev_rank=8", "--lev_knots=6", "--batch_size=4", "--eval_iters=2",
        "--log_interval=1", "--warmup_iters=2", "--device=cpu"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def run_train(capsys, data, out, *args, dataset="tiny_char"):
    """train.main in-process -> (exit code, stdout, stderr)."""
    code = train.main([f"--data_dir={data}", f"--dataset={dataset}", f"--out_dir={out}", *TINY,
                       *args])
    out_text, err_text = capsys.readouterr()
    return code, out_text, err_text


def read_log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out):
    return [(r["step"], r["tokens"], r["train_loss"], r["val_loss"], r["lr"])
            for r in read_log(out)]


def weights(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["model"]


def test_end_to_end_on_the_command_line(tmp_path, bpe_data):
    """A few steps of Leviathan on a BPE dataset, as a user runs it (data/ and out-*/ relative to
    the cwd)."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--dataset=tiny_bpe",
                             *TINY, "--max_iters=4", "--eval_interval=2",
                             "--lev_compile=False"],  # eager, as in-process
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stdout.splitlines() if "ms/step" in line]
    assert len(progress) == 4
    assert all(key in line for line in progress
               for key in ("| loss ", "| lr ", "| grad norm ", "| clipped ", "tok/s", "| ETA "))
    out = tmp_path / "out-tiny_bpe-lev"  # the default out_dir names the dataset and the arm
    records = read_log(out)
    assert [r["step"] for r in records] == [0, 2, 4]
    # the keys eval.py and the docs rely on (a value added to the record is no test edit)
    assert set(records[0]) >= {"step", "tokens", "train_loss", "val_loss", "lr", "grad_norm",
                               "clip_fraction", "elapsed_s", "embedding"}
    assert [r["tokens"] for r in records] == [0, 2 * 4 * 16, 4 * 4 * 16]
    assert records[0]["lr"] > 0 and records[0]["embedding"] == "lev"
    assert records[-1]["val_loss"] < records[0]["val_loss"]

    model, ckpt = checkpoints.load_checkpoint(str(out))  # loads with weights_only=True
    assert ckpt["step"] == 4 and ckpt["tokens_seen"] == 4 * 4 * 16
    assert ckpt["meta"]["tokenizer"] == "tiny" and ckpt["model_config"]["vocab_size"] == 256
    assert ckpt["best_val_loss"] == min(r["val_loss"] for r in records)
    assert ckpt["train_config"]["max_iters"] == 4 and ckpt["train_config"]["lev_heads"] == 2
    assert set(ckpt["rng"]) == {"data", "torch"} and ckpt["optimizer"]["state"]
    logits, _ = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 256)


def test_resume_continues_the_same_run_exactly(tmp_path, char_data, capsys, monkeypatch):
    """20 steps == 10 + resume 10 == interrupted by Ctrl-C at step 3 + resume: same losses, same
    weights (dropout on, so the torch RNG state must be restored too, not only the data order)."""
    run = ["--dropout=0.1", "--eval_interval=4", "--lr_decay_iters=8", "--max_iters=8"]
    assert run_train(capsys, char_data, tmp_path / "straight", *run)[0] == 0

    assert run_train(capsys, char_data, tmp_path / "split", *run[:-1], "--max_iters=4")[0] == 0
    code, out, _ = run_train(capsys, char_data, tmp_path / "split", "--init_from=resume",
                             "--max_iters=8")
    assert code == 0 and "resuming at step 4" in out

    forward = leviathan.GPT.forward
    training_calls, checking = [], fast_path_check_running(monkeypatch)

    def interrupt_during_the_third_step(self, *args, **kwargs):
        if self.training and not checking:
            training_calls.append(1)
            if len(training_calls) == 3:
                # as Ctrl-C: the step finishes, then the run saves and stops
                os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(leviathan.GPT, "forward", interrupt_during_the_third_step)
    code, out, _ = run_train(capsys, char_data, tmp_path / "ctrl_c", *run)
    assert code == 130 and "stopped at step 3" in out
    assert torch.load(tmp_path / "ctrl_c" / "ckpt.pt", weights_only=True)["step"] == 3
    monkeypatch.setattr(leviathan.GPT, "forward", forward)
    assert run_train(capsys, char_data, tmp_path / "ctrl_c", "--init_from=resume")[0] == 0

    expected = losses(tmp_path / "straight")
    assert [r[0] for r in expected] == [0, 4, 8]
    assert losses(tmp_path / "split") == expected
    # the record of the step resumed from is the first run's, kept (with its gradient diagnostics),
    # not evaluated again; then those of the same steps
    straight, split = read_log(tmp_path / "straight"), read_log(tmp_path / "split")
    assert straight[1]["grad_norm"] is not None
    for i in (1, 2):
        assert [split[i][k] for k in GRAD_KEYS] == [straight[i][k] for k in GRAD_KEYS]
    assert losses(tmp_path / "ctrl_c") == expected
    final = weights(tmp_path / "straight")
    for other in ("split", "ctrl_c"):
        resumed = weights(tmp_path / other)
        assert all(torch.equal(final[k], resumed[k]) for k in final), other


@pytest.mark.parametrize("arm", ["lev", "tied"])
def test_resume_is_exact_on_two_threads(tmp_path, char_data, capsys, arm):
    """LEV's gathers (codebook rows, each id's embedding) have a deterministic backward, so that
    8 steps equal 4 + 4 bit for bit on several threads too, not only on one."""
    torch.set_num_threads(2)  # the one_thread fixture puts 1 back afterwards
    run = [f"--embedding={arm}", "--eval_interval=4", "--lr_decay_iters=8"]
    assert run_train(capsys, char_data, tmp_path / "straight", *run, "--max_iters=8")[0] == 0
    assert run_train(capsys, char_data, tmp_path / "split", *run, "--max_iters=4")[0] == 0
    assert run_train(capsys, char_data, tmp_path / "split", "--init_from=resume",
                     "--max_iters=8")[0] == 0
    final, resumed = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


@pytest.mark.parametrize("arm", ["digits", "factorized"])
def test_compact_arms_train_resume_fine_tune_and_evaluate(tmp_path, char_data, capsys, arm):
    """The compact arms through every path a run takes: 4 steps equal 2 + resumed 2, a fine-tune
    starts from the run, and eval.py scores it beside a tied run."""
    run = [f"--embedding={arm}", "--eval_interval=2", "--lr_decay_iters=4"]
    assert run_train(capsys, char_data, tmp_path / "straight", *run, "--max_iters=4")[0] == 0
    assert run_train(capsys, char_data, tmp_path / "split", *run, "--max_iters=2")[0] == 0
    code, out, _ = run_train(capsys, char_data, tmp_path / "split", "--init_from=resume",
                             "--max_iters=4")
    assert code == 0 and "resuming at step 2" in out
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    final, resumed = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    code, out, err = run_train(capsys, char_data, tmp_path / "ft", "--max_iters=2",
                               f"--init_from={tmp_path / 'straight'}")
    assert code == 0 and "fine-tuning" in out, err
    assert run_train(capsys, char_data, tmp_path / "tied", "--embedding=tied", "--max_iters=4",
                     "--eval_interval=2")[0] == 0
    code = ev.main([str(tmp_path / "tied"), str(tmp_path / "straight"),
                    f"--data_dir={char_data}", "--lambada_max=0", "--device=cpu"])
    out = capsys.readouterr().out
    assert code is None and f"| {arm} | 4 | " in out and "## Token efficiency" in out


def test_resuming_a_finished_run_keeps_every_record(tmp_path, char_data, capsys):
    """A finished run resumed with a larger max_iters (and another eval_interval): log.jsonl keeps
    every record it had, the last one (the checkpoint's step) as it was, and goes on."""
    out = tmp_path / "run"
    assert run_train(capsys, char_data, out, "--max_iters=4", "--eval_interval=2")[0] == 0
    before = read_log(out)
    code, _, err = run_train(capsys, char_data, out, "--init_from=resume", "--max_iters=7",
                             "--eval_interval=3")
    assert code == 0, err
    after = read_log(out)
    assert [r["step"] for r in after] == [0, 2, 4, 6, 7]
    assert after[:3] == before


GRAD_KEYS = ("grad_norm", "clip_fraction")


def test_gradient_diagnostics_in_the_log(tmp_path, char_data, capsys):
    """Each record after step 0 gives the mean gradient norm before clipping and the fraction of
    steps clipped since the previous record (the per-part norms: docs/training.md's worked diff,
    tests/test_docs_examples.py)."""
    code, out, err = run_train(capsys, char_data, tmp_path / "lev", "--max_iters=2",
                               "--eval_interval=1")
    assert code == 0, err
    records = read_log(tmp_path / "lev")
    assert [records[0][k] for k in GRAD_KEYS] == [None, None]  # no step yet
    norms = [float(x) for x in re.findall(r"\| grad norm ([0-9.]+) \|", out)]
    for r, norm in zip(records[1:], norms, strict=True):  # one step per record: its own norm
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] == pytest.approx(norm, abs=1e-3)
        assert r["clip_fraction"] == (1.0 if r["grad_norm"] > 1.0 else 0.0)
    assert "| clipped " in out
    # eval.py reads it
    curve = [(r["tokens"], r["val_loss"]) for r in records]
    assert ev.read_curve(tmp_path / "lev", records[-1]["step"]) == (curve, True)

    code, out, err = run_train(capsys, char_data, tmp_path / "tied", "--max_iters=3",
                               "--eval_interval=3", "--embedding=tied", "--grad_clip=1e-9")
    assert code == 0, err
    last = read_log(tmp_path / "tied")[-1]
    assert last["clip_fraction"] == 1.0 and last["grad_norm"] > 1e-9 and "| clipped 100% |" in out

    code, out, err = run_train(capsys, char_data, tmp_path / "untied", "--max_iters=3",
                               "--eval_interval=3", "--embedding=untied", "--grad_clip=0")
    assert code == 0, err
    last = read_log(tmp_path / "untied")[-1]
    assert last["clip_fraction"] is None and 0 < last["grad_norm"] < math.inf
    assert "clipped" not in out


def test_a_step_the_float16_grad_scaler_skips_is_not_counted(tmp_path, char_data, capsys,
                                                              monkeypatch):
    """float16 with a GradScaler: a step of inf gradients is skipped by the scaler (no
    divergence), shown in its progress line, and left out of the record's grad_norm and
    clip_fraction."""
    def infinite_gradient(loss):
        loss = loss * 1.0
        loss.register_hook(lambda grad: grad * float("inf"))
        return loss

    spoil_training_loss(monkeypatch, infinite_gradient, at_call=2)
    code, out, err = run_train(capsys, char_data, tmp_path / "out", "--dtype=float16",
                               "--embedding=untied", "--max_iters=3", "--eval_interval=3")
    assert code == 0, err
    norms = [float(x) for x in re.findall(r"\| grad norm ([0-9.a-z]+) \|", out)]
    assert len(norms) == 3 and not math.isfinite(norms[1]) and "dtype float16" in out
    last = read_log(tmp_path / "out")[-1]
    assert last["grad_norm"] == pytest.approx((norms[0] + norms[2]) / 2, abs=1e-3)
    assert last["clip_fraction"] == sum(n > 1.0 for n in (norms[0], norms[2])) / 2


def test_resume_a_checkpoint_older_than_a_run_setting(tmp_path, char_data, capsys):
    """A checkpoint written before a run setting existed (here lev_chunk and lev_fast) resumes with
    that setting's default."""
    run = ["--eval_interval=2", "--lev_chunk=8", "--lev_fast=False"]
    assert run_train(capsys, char_data, tmp_path / "old", *run, "--max_iters=2")[0] == 0
    path = tmp_path / "old" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["train_config"]["lev_chunk"], ckpt["train_config"]["lev_fast"]) == (8, False)
    del ckpt["train_config"]["lev_chunk"], ckpt["train_config"]["lev_fast"]
    torch.save(ckpt, path)
    code, out, err = run_train(capsys, char_data, tmp_path / "old", "--init_from=resume",
                               "--max_iters=4")
    assert code == 0 and "resuming at step 2" in out, err
    resumed = torch.load(path, weights_only=True)["train_config"]
    assert (resumed["lev_chunk"], resumed["lev_fast"]) == (64, True)


def test_lev_fast_off_trains_the_same_function(tmp_path, char_data, capsys):
    """--lev_fast=False runs LEV's recipe as leviathan.py writes it: the same losses as the fast
    path (in float32, up to rounding), and a run setting that a resume keeps."""
    run = ["--max_iters=2", "--eval_interval=1"]
    assert run_train(capsys, char_data, tmp_path / "fast", *run, "--lev_compile=False")[0] == 0
    code, _, err = run_train(capsys, char_data, tmp_path / "plain", *run, "--lev_fast=False")
    assert code == 0, err
    for plain, fast in zip(losses(tmp_path / "plain"), losses(tmp_path / "fast"), strict=True):
        assert plain == pytest.approx(fast, rel=1e-4)
    code, _, err = run_train(capsys, char_data, tmp_path / "plain", "--init_from=resume",
                             "--max_iters=3")
    assert code == 0, err
    ckpt = torch.load(tmp_path / "plain" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 3 and ckpt["train_config"]["lev_fast"] is False


def test_a_checkpoint_older_than_a_model_setting_loads_and_resumes(tmp_path, char_data, capsys):
    """A checkpoint written before a Config field existed (here lev_out_init_std) gets its default:
    it loads, resumes, and a flag that asks for another value is refused as for any model
    setting."""
    assert run_train(capsys, char_data, tmp_path / "old", "--max_iters=2",
                     "--eval_interval=2")[0] == 0
    path = tmp_path / "old" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    del ckpt["model_config"]["lev_out_init_std"]
    torch.save(ckpt, path)
    model, _ = checkpoints.load_checkpoint(path)
    assert model.config.lev_out_init_std == 0.002
    code, _, err = run_train(capsys, char_data, tmp_path / "old", "--init_from=resume",
                             "--lev_out_init_std=0.1")
    assert code == 2 and "has lev_out_init_std=0.002, this run asks for 0.1" in err
    code, out, err = run_train(capsys, char_data, tmp_path / "old", "--init_from=resume",
                               "--max_iters=4")
    assert code == 0 and "resuming at step 2" in out, err
    assert torch.load(path, weights_only=True)["model_config"]["lev_out_init_std"] == 0.002


def test_a_version_1_checkpoint_is_refused_in_one_line_saying_what_to_do(
        tmp_path, char_data, capsys):
    assert run_train(capsys, char_data, tmp_path / "old", "--max_iters=2",
                     "--eval_interval=2")[0] == 0
    path = tmp_path / "old" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["version"] = 1
    torch.save(ckpt, path)
    code, _, err = run_train(capsys, char_data, tmp_path / "old", "--init_from=resume")
    assert code == 2 and err.count("\n") == 1 and "format 1, and this leviathan reads format 2: " \
        "train the run again, or use the leviathan version that wrote it" in err, err
    assert not re.search(r"\b[0-9a-f]{7}\b", err), err  # no commit hash


def test_every_arm_draws_the_same_batches(tmp_path, char_data, capsys, monkeypatch):
    """The data order depends on the seed only, not on the model (whose init consumes different
    randomness)."""
    get_batch = train.get_batch
    seen = []

    def recording_get_batch(data, starts, *args):
        seen.append(starts.tolist())
        return get_batch(data, starts, *args)

    monkeypatch.setattr(train, "get_batch", recording_get_batch)
    batches = {}
    for arm, seed in (("lev", 1), ("tied", 1), ("untied", 1), ("lev", 2)):
        seen.clear()
        code, *_ = run_train(capsys, char_data, tmp_path / f"{arm}{seed}", f"--embedding={arm}",
                             f"--seed={seed}", "--max_iters=3", "--eval_interval=3")
        assert code == 0
        batches[arm, seed] = list(seen)
    assert batches["lev", 1] == batches["tied", 1] == batches["untied", 1]
    assert batches["lev", 2] != batches["lev", 1]
    # different models all the same
    assert losses(tmp_path / "lev1")[0] != losses(tmp_path / "tied1")[0]


def test_two_ddp_processes_match_one_process(tmp_path, char_data, capsys):
    """torch.distributed.run with 2 CPU processes (gloo), each doing one of 2 micro-steps, trains
    like one process doing both: the same global batches, the same averaged gradients."""
    run = ["--max_iters=3", "--eval_interval=3", "--gradient_accumulation_steps=2"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", os.path.join(ROOT, "train.py"),
                             f"--data_dir={char_data}", "--dataset=tiny_char",
                             f"--out_dir={tmp_path / 'ddp'}", *TINY, *run, "--lev_compile=False"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    # rank 0 prints
    assert "2 process(es)" in result.stdout and result.stdout.count("step 3: train loss") == 1
    assert run_train(capsys, char_data, tmp_path / "one", *run)[0] == 0
    for ddp, one in zip(losses(tmp_path / "ddp"), losses(tmp_path / "one"), strict=True):
        assert ddp == pytest.approx(one, rel=1e-5)
    ddp_weights, one_weights = weights(tmp_path / "ddp"), weights(tmp_path / "one")
    assert all(torch.allclose(ddp_weights[k], one_weights[k], atol=1e-5) for k in one_weights)


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, char_data, capsys,
                                                                     monkeypatch):
    spoil_training_loss(monkeypatch, lambda loss: loss * float("nan"))
    code, _, err = run_train(capsys, char_data, tmp_path / "out", "--max_iters=8",
                             "--eval_interval=2")
    assert code == 1 and "the loss is nan at step 3" in err
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["step"] == 2
    assert [r["step"] for r in read_log(tmp_path / "out")] == [0, 2]


def test_bad_input_is_one_line_with_exit_code_2(tmp_path, char_data, bpe_data, capsys):
    out = tmp_path / "out"
    # a checkpoint of the char vocabulary
    assert run_train(capsys, char_data, out, "--max_iters=0")[0] == 0
    # where a scratch run finds no run to refuse to replace
    fresh = f"--out_dir={tmp_path / 'fresh'}"
    (tmp_path / "exec.py").write_text("import os\n")
    (tmp_path / "typo.py").write_text("# a comment\nn_layer = 2\nlearnig_rate = 1e-3\n")
    (tmp_path / "twice.py").write_text("n_layer = 1\nn_layer = 2\n")
    cases = [
        # which command prepares it
        (["--dataset=nope", fresh], "python prepare_data.py nope --input="),
        (["--n_layers=2"], "did you mean n_layer?"),
        (["--n_layer=two"], "n_layer='two' must be an integer"),
        (["--learning_rate=True"], "must be a number"),
        (["--embedding=bag"], "choose one of lev, tied, untied"),
        (["--n_head=3"], "divisible by n_head=3"),  # leviathan.Config's own check
        (["--batch_size=0"], "batch_size=0 must be at least 1"),
        (["--out_dir=out-{arm}"], "must name a setting"),
        ([str(tmp_path / "exec.py")], "line 1: only `key = value` lines"),
        ([str(tmp_path / "typo.py")],
         "typo.py line 3: unknown setting 'learnig_rate'; did you mean learning_rate?"),
        ([str(tmp_path / "missing.py")], "No such file"),
        (["--init_from=resume", "--dataset=tiny_bpe"], "trained on char tokens (vocab_size 36)"),
        (["--init_from=resume", "--n_embd=64"], "has n_embd=32, this run asks for 64"),
        (["--init_from=resume", f"--out_dir={tmp_path / 'none'}"], "holds no run to resume"),
        # a setting that does not apply is refused, not ignored
        (["--lev_fast=False", "--lev_c_kernels=False"], "lev_c_kernels=False is a setting of "
                                                        "LEV's fast path, and lev_fast=False"),
        # settings that are gone: unknown
        (["--lev_lr_scale=2.0"], "unknown setting 'lev_lr_scale'; see python train.py --help"),
        # a setting given twice (a later file or flag overriding a file is no mistake)
        ([str(tmp_path / "twice.py")], "twice.py line 2: n_layer is given twice in"),
    ]
    for args, message in cases:
        code, _, err = run_train(capsys, char_data, out, *args)
        assert code == 2, args
        assert (err.startswith("train.py: error: ") and err.count("\n") == 1
                and message in err), (args, err)
    assert not (tmp_path / "fresh").exists()  # a refused command leaves no empty out_dir


# --------------------------------------------------------------------------------------------------
# Resolving a run: every combination of a checkpoint, files and flags


def test_a_flag_repeating_the_checkpoint_is_accepted(tmp_path, char_data, bpe_data, capsys):
    """Resuming or fine-tuning with a flag that repeats the checkpoint's own value: accepted,
    checked against the checkpoint's model, not against the defaults (n_embd=32 with the default
    n_head would not divide)."""
    assert run_train(capsys, char_data, tmp_path / "run", "--max_iters=2")[0] == 0
    few = [f"--data_dir={char_data}", "--dataset=tiny_char", "--device=cpu", "--batch_size=4",
           "--eval_iters=1", "--lev_compile=False"]
    assert train.main([*few, f"--out_dir={tmp_path / 'run'}", "--init_from=resume",
                       "--n_embd=32", "--max_iters=3"]) == 0, capsys.readouterr().err
    assert train.main([*few, f"--out_dir={tmp_path / 'ft'}", f"--init_from={tmp_path / 'run'}",
                       "--n_embd=32", "--embedding=lev", "--max_iters=1"]) == 0
    assert "fine-tuning" in capsys.readouterr().out
    # a table model with --embedding=lev: no retrofit here, and said where it is
    assert run_train(capsys, char_data, tmp_path / "tied", "--max_iters=0",
                     "--embedding=tied")[0] == 0
    code, _, err = run_train(capsys, char_data, tmp_path / "ft2", "--embedding=lev",
                             f"--init_from={tmp_path / 'tied'}")
    assert code == 2 and err.count("\n") == 1 and "python lab/retrofit.py" in err, err
    assert not (tmp_path / "ft2").exists()


def test_a_setting_given_twice_in_the_flags_is_said(tmp_path, char_data, capsys):
    code, out, _ = run_train(capsys, char_data, tmp_path / "out", "--max_iters=0",
                             "--n_layer=1", "--n_layer=2")
    assert code == 0 and "note: n_layer is given twice (--n_layer=1, then --n_layer=2)" in out
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)["model_config"][
        "n_layer"] == 2


def test_old_or_retired_settings_in_a_checkpoint_do_not_break_a_resume(tmp_path, char_data,
                                                                        capsys):
    assert run_train(capsys, char_data, tmp_path / "run", "--max_iters=2")[0] == 0
    path = tmp_path / "run" / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["train_config"].update(fit_steps=4000, lev_lr_scale=2.0, a_future_setting="x")
    torch.save(ckpt, path)
    code, _, err = run_train(capsys, char_data, tmp_path / "run", "--init_from=resume",
                             "--max_iters=3")
    assert code == 0, err
    assert "fit_steps" not in torch.load(path, weights_only=True)["train_config"]


def test_a_run_failing_before_its_first_step_can_be_run_again(tmp_path, char_data, capsys,
                                                              monkeypatch):
    """The step-0 evaluation does not save (the same command rebuilds that state): a run that
    fails in its first step leaves no ckpt.pt that would make the rerun ask for --overwrite."""
    monkeypatch.setattr(train, "get_lr", lambda step, s: 1 / 0 if step == 0 else 1e-3)
    with pytest.raises(ZeroDivisionError):  # a bug edited into the loop: its traceback
        run_train(capsys, char_data, tmp_path / "out", "--max_iters=2")
    assert not (tmp_path / "out" / "ckpt.pt").exists()
    monkeypatch.undo()
    code, _, err = run_train(capsys, char_data, tmp_path / "out", "--max_iters=2")
    assert code == 0, err


def test_the_cpu_config_schedule_follows_max_iters():
    s, _ = train.parse_args([os.path.join(ROOT, "config", "shakespeare_cpu.py"),
                             "--max_iters=100"])
    assert s["lr_decay_iters"] == 0 and train.get_lr(100, s) == s["min_lr"]
    assert train.get_lr(99, s) > s["min_lr"]


def test_eval_windows():
    """Non-overlapping, every target once; a maximum takes an evenly spaced subset."""
    assert train.eval_windows(101, 10).tolist() == list(range(0, 100, 10))
    assert train.eval_windows(100, 10).tolist() == list(range(0, 90, 10))
    assert train.eval_windows(1001, 10, max_windows=4).tolist() == [0, 250, 500, 750]
    with pytest.raises(ValueError, match="too short for one window"):
        train.eval_windows(10, 10)


def test_the_machine_refusing_to_write_gets_advice(tmp_path, char_data, monkeypatch, capsys):
    """A read-only out_dir, no permission, a full disk: the OS's own message, then what to do (a
    full disk in a save: tests/test_bad_input.py)."""
    makedirs = os.makedirs  # (torch's own cache folders are left alone)
    for number in (errno.EROFS, errno.EACCES, errno.ENOSPC):
        def refused(path, *args, number=number, **kwargs):
            if not str(path).startswith(str(tmp_path)):
                return makedirs(path, *args, **kwargs)
            raise OSError(number, os.strerror(number))

        monkeypatch.setattr(train.os, "makedirs", refused)
        code, _, err = run_train(capsys, char_data, tmp_path / "out", "--max_iters=1")
        assert code == 2 and err.count("\n") == 1 and os.strerror(number) in err, err
        assert f"cannot write in {tmp_path / 'out'}" in err and "a folder you can write to" in err


def test_settings_files_then_flags_and_the_shipped_configs():
    parse_args = train.parse_args

    cpu, explicit = parse_args([os.path.join(ROOT, "config", "shakespeare_cpu.py"),
                                "--embedding=tied", "--compile", "--learning_rate=3e-4"])
    assert ((cpu["n_layer"], cpu["n_head"], cpu["n_embd"], cpu["block_size"], cpu["batch_size"])
            == (4, 4, 128, 128, 16))
    assert ((cpu["embedding"], cpu["compile"], cpu["learning_rate"], cpu["eval_iters"])
            == ("tied", True, 3e-4, 0))
    # from Config
    assert cpu["lev_seed_dim"] == leviathan.Config.lev_seed_dim and "lev_seed_dim" not in explicit
    train.check_settings(cpu)
    gpu, _ = parse_args([os.path.join(ROOT, "config", "shakespeare_gpu.py")])
    assert (gpu["n_layer"], gpu["n_head"], gpu["n_embd"], gpu["block_size"]) == (6, 6, 384, 256)
    assert (gpu["dtype"], gpu["compile"], gpu["device"]) == ("bfloat16", True, "cuda")
    train.check_settings(gpu)


def test_learning_rate_schedule():
    s = {"learning_rate": 1e-3, "min_lr": 1e-4, "warmup_iters": 10, "lr_decay_iters": 0,
         "max_iters": 110}
    lrs = [train.get_lr(step, s) for step in range(120)]
    # warmup: lr > 0 from the first step
    assert 0 < lrs[0] < lrs[9] < lrs[10] == pytest.approx(1e-3)
    # then the cosine only decays
    assert all(a >= b for a, b in zip(lrs[10:-1], lrs[11:], strict=True))
    # to min_lr at max_iters
    assert lrs[60] == pytest.approx(5.5e-4) and lrs[110] == lrs[119] == 1e-4


def test_help_lists_every_setting(capsys):
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"--{key}=" in text for key in train.SETTINGS)
    assert "ckpt.pt" in text and "Ctrl-C" in text


# --------------------------------------------------------------------------------------------------
# Fine-tuning: --init_from=PATH


@pytest.fixture
def two_bpe_datasets(tmp_path, tiny_encoding):
    """Two datasets of different texts, one tokenizer: "a" (the text of conftest) and "b" (another
    text)."""
    from conftest import make_text

    for name, seed in (("a", 0), ("b", 1)):
        prepare_text(make_text(seed=seed), tiny_encoding, str(tmp_path / "data" / name), name,
                       "synthetic")
    return tmp_path / "data"


def test_fine_tuning_starts_from_the_source_weights(tmp_path, two_bpe_datasets, capsys):
    data = two_bpe_datasets
    assert run_train(capsys, data, tmp_path / "src", "--max_iters=6", "--eval_interval=6",
                     dataset="a")[0] == 0
    code, out, err = run_train(capsys, data, tmp_path / "ft", f"--init_from={tmp_path / 'src'}",
                               "--max_iters=4", "--eval_interval=2", "--eval_iters=0",
                               "--n_layer=3", dataset="b")
    # a flag may not change the model
    assert code == 2 and "fine-tuning keeps the source's architecture" in err
    code, out, err = run_train(capsys, data, tmp_path / "ft", f"--init_from={tmp_path / 'src'}",
                               "--max_iters=4", "--eval_interval=2", "--eval_iters=0", dataset="b")
    assert code == 0, err
    assert f"fine-tuning {tmp_path / 'src' / 'ckpt.pt'} (step 6, dataset a)" in out
    # step 0 of the new run scores the source model on the new data: the same number
    # eval.py computes
    source, _ = checkpoints.load_checkpoint(tmp_path / "src")
    val = dataset.load_split(str(data / "b"), "val")
    losses_b, _ = ev.evaluate_tokens(source, val, 4, "cpu")
    first = read_log(tmp_path / "ft")[0]
    assert (first["step"] == 0
            and first["val_loss"] == pytest.approx(float(losses_b.mean()), rel=1e-6))
    assert first["init_from"] == str(tmp_path / "src" / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["origin"]["dataset"] == "a" and ckpt["meta"]["dataset"] == "b"

    assert ckpt["optimizer"]["state"][0]["step"] == 4  # a fresh optimizer: only this run's steps


@pytest.mark.parametrize("arm, frozen, changing", [
    ("lev", "embedding,backbone", {"lm_head.weight"}),
    ("untied", "head", {"tok_emb.weight"}),
    # the tied table is the head too: with the backbone trainable, only it changes
    ("tied", "head", set()),
])
def test_frozen_parts_do_not_change(tmp_path, two_bpe_datasets, capsys, arm, frozen, changing):
    data = two_bpe_datasets
    assert run_train(capsys, data, tmp_path / "src", "--max_iters=2", "--eval_interval=2",
                     f"--embedding={arm}", dataset="a")[0] == 0
    code, out, err = run_train(capsys, data, tmp_path / "ft", f"--init_from={tmp_path / 'src'}",
                               "--max_iters=3", "--eval_interval=3", f"--freeze={frozen}",
                               "--learning_rate=1e-2", dataset="b")
    assert code == 0 and f"(frozen: {frozen})" in out, err
    before, after = weights(tmp_path / "src"), weights(tmp_path / "ft")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if arm == "lev":
        assert changed == changing
    elif arm == "untied":
        assert "tok_emb.weight" in changed and "lm_head.weight" not in changed
    else:
        assert "tok_emb.weight" not in changed and any(k.startswith("blocks.") for k in changed)
    # a resumed fine-tuning run keeps its frozen parts and its origin
    code, out, err = run_train(capsys, data, tmp_path / "ft", "--init_from=resume", "--max_iters=5",
                               dataset="b")
    assert code == 0 and f"(frozen: {frozen})" in out, err
    resumed = weights(tmp_path / "ft")
    if arm == "lev":
        assert all(torch.equal(resumed[k], before[k]) for k in before if k != "lm_head.weight")
    assert torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=True)["origin"]["dataset"] == "a"


def test_fine_tuning_refuses_another_tokenizer_and_bad_freezes(tmp_path, two_bpe_datasets,
                                                                char_data, capsys):
    data = two_bpe_datasets
    assert run_train(capsys, data, tmp_path / "src", "--max_iters=2", "--eval_interval=2",
                     dataset="a")[0] == 0
    src = f"--init_from={tmp_path / 'src'}"
    cases = [
        ([src, f"--data_dir={char_data}", "--dataset=tiny_char"],
         "was trained on tiny tokens (vocab_size 256), but"),
        ([src, "--freeze=everything"],
         "freeze='everything': choose among embedding, backbone, head"),
        ([src, "--freeze=embedding,backbone,head"], "leaves nothing to train"),
        ([f"--init_from={tmp_path / 'nowhere'}"], "no checkpoint at"),
        ([src, f"--out_dir={tmp_path / 'src'}"], "holds the checkpoint being fine-tuned"),
    ]
    for args, message in cases:
        code, _, err = run_train(capsys, data, tmp_path / "ft", *args, dataset="a")
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)


def test_a_fine_tuning_run_is_named_after_the_source_arm(tmp_path, two_bpe_datasets, capsys,
                                                         monkeypatch):
    """out_dir's default, out-{dataset}-{embedding}, names the source's arm: the architecture comes
    first."""
    data = two_bpe_datasets
    assert run_train(capsys, data, tmp_path / "src", "--max_iters=0", "--embedding=tied",
                     dataset="a")[0] == 0
    monkeypatch.chdir(tmp_path)
    code = train.main([f"--data_dir={data}", "--dataset=b", f"--init_from={tmp_path / 'src'}",
                       "--max_iters=0", "--n_layer=1", "--n_head=2", "--n_embd=32",
                       "--block_size=16", "--device=cpu", "--batch_size=4", "--eval_iters=1"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out-b-tied" / "ckpt.pt").exists() and not (tmp_path / "out-b-lev").exists()


def test_fine_tuning_onto_other_characters_of_the_same_count_says_they_differ(tmp_path, char_data,
                                                                              text, capsys):
    """A char-level model's ids mean its own characters: a dataset of as many, but other, characters
    is refused, and the message says what differs (not "char tokens (vocab_size N)" twice)."""
    assert run_train(capsys, char_data, tmp_path / "src", "--max_iters=1")[0] == 0
    unused = next(c for c in "@#%&" if c not in text)
    swapped, dropped = text.replace("a", unused), "a"
    prepare_text(swapped, "char", str(char_data / "other"), "other", "synthetic")
    code, _, err = run_train(capsys, char_data, tmp_path / "ft", f"--init_from={tmp_path / 'src'}",
                             dataset="other")
    assert code == 2 and err.startswith("train.py: error: ") and err.count("\n") == 1, err
    # both vocabularies said, so that the difference shows
    assert f"characters {''.join(sorted(set(text)))!r}, but" in err
    assert f"characters {''.join(sorted(set(swapped)))!r}" in err
    assert dropped in set(text) - set(swapped) and unused in set(swapped) - set(text)


@pytest.mark.parametrize("arm", ["tied", "lev"])
def test_compile_trains_as_eager_with_the_lean_heads_logits(tmp_path, char_data, capsys, arm,
                                                            compiling):
    """--compile: the whole model through torch.compile (really: conftest's compiling), the lean
    head's LazyLogits included, gives the eager run's losses."""
    from torch._dynamo.utils import counters

    losses = {}
    for flag in ("--compile=True", "--compile=False"):
        code, out, err = run_train(capsys, char_data, tmp_path / flag, f"--embedding={arm}",
                                   "--max_iters=3", "--eval_interval=3", flag)
        assert code == 0, err
        ckpt = torch.load(tmp_path / flag / "ckpt.pt", weights_only=True)
        assert ckpt["train_config"]["compile"] == (flag == "--compile=True")
        losses[flag] = [r["val_loss"] for r in read_log(tmp_path / flag)]
        losses[flag] += [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", out)]
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled the model
    assert losses["--compile=True"] == pytest.approx(losses["--compile=False"], abs=1e-4)
