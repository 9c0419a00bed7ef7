"""Bad input and failures, across the scripts, as a hostile user would try them: every case is one
actionable line on stderr and exit code 2 (never a traceback, never a silent success), and no
failure ever loses the last good checkpoint. prepare_data.py's cases live in
tests/test_prepare_data.py."""

import errno
import importlib.util
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import spoil_training_loss

import sample
import train
from lab import bench, cli, evaluation
from lab import eval as ev

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--lev_seed_dim=16",
        "--lev_heads=2", "--lev_rank=8", "--lev_knots=6", "--batch_size=4", "--eval_iters=2",
        "--log_interval=1", "--warmup_iters=2", "--device=cpu"]


def train_cli(run_cli, data, out, *args, dataset="tiny_char"):
    return run_cli(train.main, [f"--data_dir={data}", f"--dataset={dataset}", f"--out_dir={out}",
                                *TINY, *args])


def assert_one_line(code, err, message, prog):
    assert code == 2, (code, err)
    assert (err.startswith(f"{prog}: error: ") and err.count("\n") == 1
            and "Traceback" not in err), err
    assert message in err, err


def all_finite(path):
    return all(t.isfinite().all() for t in torch.load(path, weights_only=True)["model"].values()
               if t.is_floating_point())


@pytest.fixture
def trained(tmp_path, char_data, run_cli):
    """A finished 2-step lev run in tmp_path/run (checkpoint at step 2)."""
    code, _, err = train_cli(run_cli, char_data, tmp_path / "run", "--max_iters=2",
                             "--eval_interval=2")
    assert code == 0, err
    return tmp_path / "run"


def edited_checkpoint(src, dst, edit):
    """A copy of src's ckpt.pt in folder dst, changed by edit(ckpt) (as a hand-edit would)."""
    ckpt = torch.load(src / "ckpt.pt", weights_only=True)
    edit(ckpt)
    dst.mkdir()
    torch.save(ckpt, dst / "ckpt.pt")
    return dst


# --------------------------------------------------------------------------------------------------
# train.py


def test_train_settings_are_checked_before_any_work(tmp_path, char_data, run_cli):
    (tmp_path / "latin1.py").write_bytes("# caf\xe9\nn_layer = 2\n".encode("latin-1"))
    (tmp_path / "a_file").write_text("")
    cases = [
        (["--block_size=0"], "block_size=0 must be a positive integer"),
        (["--n_embd=0"], "n_embd=0 must be a positive integer"),
        (["--learning_rate=nan"], "learning_rate=nan must be a finite number"),
        (["--learning_rate=1e999"], "learning_rate=inf must be a finite number"),
        (["--min_lr=0.01", "--learning_rate=0.001"],
         "min_lr=0.01 must not exceed learning_rate=0.001"),
        (["--dropout=1.5"], "dropout=1.5 must be in [0, 1)"),
        (["--seed=-1"], "seed=-1 must be in [0, 2^63"),
        (["--lev_chunk=0"], "lev_chunk=0 must be at least 1"),
        (["--lev_out_init_std=nan"], "lev_out_init_std=nan must be a finite number"),
        (["--lev_out_init_std=0"], "lev_out_init_std=0.0 must be a finite number > 0"),
        (["--lev_out_init_std=-1"], "lev_out_init_std=-1.0 must be a finite number > 0"),
        (["--lev_out_init_std=1e999"], "lev_out_init_std=inf must be a finite number"),
        (["--out_dir="], "out_dir is empty"),
        ([f"--out_dir={tmp_path / 'a_file'}"], "is a file, not a folder"),
        ([f"--out_dir={tmp_path / 'a_file' / 'below'}"], "cannot write in"),
        (["--init_from="], "init_from is empty"),
        ([str(tmp_path / "latin1.py")],
         "latin1.py: 'utf-8' codec can't decode byte 0xe9 in position 5"),
        (["--max_iters=1e3"], "max_iters=1000.0 must be an integer"),
        (["--learning_rate=inf"], "learning_rate=inf must be a finite number"),
        (["--z_loss=nan"], "z_loss=nan must be a finite number"),
        (["--z_loss=1e6"], "z_loss=1000000.0 must be in [0, 1)"),
        (["--nosuchflag"], "--nosuchflag: unknown setting 'nosuchflag'; see python train.py"),
        (["--complie"], "--complie: unknown setting 'complie'; did you mean compile?"),
        (["--init_from=Resume"], "init_from='Resume' is not a checkpoint (did you mean "
                                 "--init_from=resume?)"),
        (["--init_from=gpt2"], "init_from='gpt2' is not a checkpoint (no pretrained weights are "
                               "loaded by name)"),
        ([f"--out_dir={tmp_path / 'a_file'}", "--init_from=resume"],
         f"out_dir={tmp_path / 'a_file'} is a file, not a folder; give another path"),
    ]
    for args, message in cases:
        out = args[0].split("=", 1)[1] if args[0].startswith("--out_dir") else tmp_path / "out"
        code, _, err = run_cli(train.main, [f"--data_dir={char_data}", "--dataset=tiny_char",
                                            f"--out_dir={out}", *TINY, *args])
        assert_one_line(code, err, message, "train.py")
    assert not (tmp_path / "out").exists()  # nothing was written for a bad setting


def test_train_refuses_damaged_data(tmp_path, char_data, run_cli):
    meta_path = char_data / "tiny_char" / "meta.json"
    meta = meta_path.read_text()
    for bad, message in [(meta.replace('"uint16"', '"float64"'),
                          "dtype uint16 or uint32"),
                         (meta.replace('"train_tokens": ', '"train_tokens": -'),
                          "train_tokens and val_tokens non-negative integers"),
                         ("[1, 2]", "needs a tokenizer"),
                         ('{"tokenizer": ',
                          "meta.json is not valid JSON, or not UTF-8; prepare it")]:
        meta_path.write_text(bad)
        code, _, err = train_cli(run_cli, char_data, tmp_path / "out", "--max_iters=1")
        assert_one_line(code, err, message, "train.py")
        assert "Error" not in err, err  # no exception class names
    meta_path.write_text(meta)
    with open(char_data / "tiny_char" / "train.bin", "r+b") as f:
        f.truncate(100)
    code, _, err = train_cli(run_cli, char_data, tmp_path / "out", "--max_iters=1")
    assert_one_line(code, err, "train.bin is 100 bytes, meta.json expects", "train.py")


def test_resuming_an_edited_or_foreign_checkpoint_is_refused(tmp_path, char_data, run_cli, trained):
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'PWNED'}",)

    (tmp_path / "evil").mkdir()
    torch.save({"version": 2, "model": Evil()}, tmp_path / "evil" / "ckpt.pt")
    cases = [
        (edited_checkpoint(trained, tmp_path / "no_opt", lambda c: c.pop("optimizer")),
         "optimizer missing or not a dict"),
        (edited_checkpoint(trained, tmp_path / "no_meta", lambda c: c.pop("meta")),
         "meta missing or not a dict"),
        (edited_checkpoint(trained, tmp_path / "no_rng", lambda c: c.pop("rng")),
         "rng missing or not a dict"),
        (edited_checkpoint(trained, tmp_path / "str_step", lambda c: c.update(step="2")),
         "(rng) are unusable ('<' not supported"),
        (edited_checkpoint(trained, tmp_path / "bad_rng", lambda c: c.update(rng={"data": 3})),
         "random states (rng) are unusable"),
        (edited_checkpoint(trained, tmp_path / "bad_opt",
                           lambda c: c["optimizer"].update(param_groups=[])),
         "its optimizer state does not fit this train.py's parameter groups"),
        (edited_checkpoint(trained, tmp_path / "lev_groups", lambda c: c["optimizer"].update(
            param_groups=[dict(g, params=g["params"][i::2]) for g in c["optimizer"]["param_groups"]
                          for i in (0, 1)])),
         "fine-tune from it with a fresh optimizer"),  # LEV's own 2 groups (a retired setting)
        (edited_checkpoint(trained, tmp_path / "bad_weights",
                           lambda c: c["model"].pop("norm.weight")),
         "the weights do not fit its model settings"),
        (tmp_path / "evil", "could run code when loaded; it was refused unread"),
    ]
    for out, message in cases:
        code, _, err = train_cli(run_cli, char_data, out, "--init_from=resume", "--max_iters=4")
        assert_one_line(code, err, message, "train.py")
        assert "weights_only" not in err  # torch's advice to load unsafely is not passed on
    assert not (tmp_path / "PWNED").exists()


def test_a_run_stopped_before_its_first_save_is_started_again(tmp_path, char_data, run_cli,
                                                              monkeypatch):
    """Ctrl-C while a scratch run loads its data: one line, exit 130, a log.jsonl but no
    checkpoint; that is no run, so the same command starts it again (a fine-tune or a retrofit
    likewise: tests/test_retrofit.py)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 0, "tokens": 0, "val_loss": 9.0}\n')
    data = train.load_data

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "load_data", interrupted)
    code, _, err = train_cli(run_cli, char_data, out, "--max_iters=2")
    assert code == 130 and err.count("\n") == 1 and "no checkpoint was saved yet" in err
    monkeypatch.setattr(train, "load_data", data)
    code, _, err = train_cli(run_cli, char_data, out, "--max_iters=2", "--eval_interval=2")
    assert code == 0, err
    assert (out / "ckpt.pt").exists()
    # stopped while a resume loads its data: the checkpoint is kept, and said
    monkeypatch.setattr(train, "load_data", interrupted)
    code, _, err = train_cli(run_cli, char_data, out, "--init_from=resume", "--max_iters=4")
    assert code == 130 and err.count("\n") == 1
    assert f"{out}/ckpt.pt keeps the last saved state" in err


def test_a_fine_tune_into_its_own_source_folder_is_refused(tmp_path, char_data, run_cli, trained,
                                                           monkeypatch):
    """Whatever --overwrite says, and however the same folder is spelled: the source is read."""
    before = {name: (trained / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")}
    monkeypatch.chdir(tmp_path)
    os.symlink(trained / "ckpt.pt", tmp_path / "file_link")
    os.symlink(trained, tmp_path / "folder_link")
    for source, out in [(trained, trained), (trained / "ckpt.pt", "./run/"), ("run", trained),
                        ("./run/ckpt.pt", "run"), ("file_link", "run"), ("folder_link", "run"),
                        ("run", "folder_link")]:
        for overwrite in ([], ["--overwrite"]):
            code, _, err = train_cli(run_cli, char_data, out, f"--init_from={source}",
                                     "--max_iters=1", *overwrite)
            assert_one_line(code, err, "holds the checkpoint being fine-tuned", "train.py")
            assert "fine-tune into another --out_dir" in err and "pass --overwrite" not in err
    assert {name: (trained / name).read_bytes() for name in before} == before


def test_a_resume_says_what_its_folder_holds(tmp_path, char_data, run_cli):
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "log.jsonl").write_text("")
    code, _, err = train_cli(run_cli, char_data, tmp_path / "stopped", "--init_from=resume")
    assert_one_line(code, err, "holds a log.jsonl but no ckpt.pt: its run stopped before its first "
                               "save", "train.py")
    assert "start it again with the same command without --init_from=resume" in err
    code, _, err = train_cli(run_cli, char_data, tmp_path / "none", "--init_from=resume")
    assert_one_line(code, err, "holds no run to resume (no ckpt.pt); train one first", "train.py")
    (tmp_path / "stopped" / "ckpt.pt").mkdir()  # a folder where the checkpoint should be
    for resume in (["--init_from=resume"], [], ["--overwrite"]):
        code, _, err = train_cli(run_cli, char_data, tmp_path / "stopped", *resume)
        assert_one_line(code, err, "ckpt.pt is not a file (a folder?); move it out of the way",
                        "train.py")


def test_a_resume_with_another_freeze_says_so(char_data, run_cli, trained):
    code, _, err = train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=4",
                             "--freeze=backbone")
    assert_one_line(code, err, "was trained with nothing frozen, this resume asks for "
                               "--freeze=backbone", "train.py")
    assert "another version" not in err


def test_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    """SIGINT as soon as train.py starts (while it imports torch): one line, exit 130."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "train.py"), "--help"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(0.3)  # python is up, torch is loading
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("torch loaded before the signal")
    assert proc.returncode == 130 and err == ("train.py: stopped (Ctrl-C) while starting; nothing "
                                              "was written\n"), err


def test_a_read_only_disk_during_a_save_keeps_the_last_checkpoint(char_data, run_cli, trained,
                                                                  monkeypatch):
    before = (trained / "ckpt.pt").read_bytes()
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):
        if str(path).endswith("ckpt.pt.tmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only)
    code, _, err = train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=4")
    assert_one_line(code, err, f"could not write {trained / 'ckpt.pt'} (read-only file system); "
                               f"the previous file, if any, is unchanged; make it writable",
                    "train.py")
    assert (trained / "ckpt.pt").read_bytes() == before


def test_a_scratch_run_never_replaces_a_run_unless_asked(tmp_path, char_data, run_cli, trained):
    before = (trained / "ckpt.pt").read_bytes()
    code, _, err = train_cli(run_cli, char_data, trained, "--max_iters=1")
    assert_one_line(code, err, "already holds a run (ckpt.pt); "
                               "continue it with --init_from=resume", "train.py")
    assert (trained / "ckpt.pt").read_bytes() == before
    code, _, err = train_cli(run_cli, char_data, trained, "--max_iters=1", "--eval_interval=1",
                             "--overwrite")
    assert code == 0, err
    assert torch.load(trained / "ckpt.pt", weights_only=True)["step"] == 1


def test_a_non_finite_gradient_stops_before_any_weight_changes(tmp_path, char_data, run_cli,
                                                               monkeypatch):
    """A finite loss with an infinite gradient (e.g. an overflow in backward) must not reach the
    weights: the run stops, and ckpt.pt keeps the last good state."""
    def infinite_gradient(loss):
        loss = loss * 1.0
        loss.register_hook(lambda grad: grad * float("inf"))
        return loss

    spoil_training_loss(monkeypatch, infinite_gradient)
    code, _, err = train_cli(run_cli, char_data, tmp_path / "out", "--max_iters=8",
                             "--eval_interval=2")
    assert code == 1 and "gradient norm is" in err and "at step 3" in err, err
    assert "ckpt.pt keeps the last good state" in err and "Traceback" not in err
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 2 and all_finite(tmp_path / "out" / "ckpt.pt")


@pytest.mark.parametrize("arm", ["lev", "tied"])
def test_a_diverging_run_stops_cleanly_and_never_saves_nan(tmp_path, char_data, run_cli, arm):
    """learning_rate=1000 blows the weights up within a few steps: in every arm the run stops with
    one line, and ckpt.pt (if any was written) holds finite weights."""
    code, out, err = train_cli(run_cli, char_data, tmp_path / "out", f"--embedding={arm}",
                               "--learning_rate=1000", "--min_lr=0", "--eval_interval=1",
                               "--max_iters=30", "--grad_clip=0")
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert "stopping without saving" in err
    if (tmp_path / "out" / "ckpt.pt").exists():
        assert all_finite(tmp_path / "out" / "ckpt.pt")


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, char_data, run_cli, trained):
    """The temp file the next save writes is pointed at /dev/full (writes fail with ENOSPC, as on a
    full disk): one line naming the path, exit 2, the previous ckpt.pt intact, no temp file left
    behind."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    before = (trained / "ckpt.pt").read_bytes()
    tmp = trained / "ckpt.pt.tmp"
    os.symlink("/dev/full", tmp)
    code, _, err = train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=4")
    assert_one_line(code, err, f"could not write {trained / 'ckpt.pt'} (no space left on device)",
                    "train.py")
    assert "is unchanged" in err and "enforce fail" not in err
    assert (trained / "ckpt.pt").read_bytes() == before and not os.path.lexists(tmp)


def test_a_save_torch_fails_midway_is_one_line_and_not_logged(char_data, run_cli, trained,
                                                              monkeypatch):
    """A full disk met inside torch.save's zip writer is torch's RuntimeError ("[enforce fail at
    inline_container.cc ...]"): one line all the same, and log.jsonl keeps no record of the step
    whose save failed."""
    before = (trained / "ckpt.pt").read_bytes()
    log_before = (trained / "log.jsonl").read_text()

    def full_midway(obj, f):
        f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 2")

    monkeypatch.setattr(train.torch, "save", full_midway)
    monkeypatch.setattr(train.shutil, "disk_usage", lambda path: SimpleNamespace(free=0))
    code, _, err = train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=4",
                             "--eval_interval=2")
    assert_one_line(code, err, f"could not write {trained / 'ckpt.pt'} (no space left on device); "
                               f"the previous file, if any, is unchanged; free disk space",
                    "train.py")
    assert "enforce fail" not in err
    assert (trained / "ckpt.pt").read_bytes() == before
    assert (trained / "log.jsonl").read_text() == log_before  # step 4 was not saved: not logged


def test_a_dead_writers_temp_file_is_replaced(tmp_path, char_data, run_cli, trained):
    dead = trained / "ckpt.pt.tmp"  # what a run killed mid-save leaves behind
    dead.write_bytes(b"x" * 1000)
    assert train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=3")[0] == 0
    assert not dead.exists() and torch.load(trained / "ckpt.pt", weights_only=True)["step"] == 3


def test_resuming_with_more_steps_keeps_the_schedule(tmp_path, char_data, run_cli):
    """lr_decay_iters=0 means max_iters *of the run's start*: resuming with a larger max_iters does
    not reshape the cosine of the steps already taken; past the old end the rate stays at min_lr
    (and the run says so)."""
    code, _, _ = train_cli(run_cli, char_data, tmp_path / "out", "--max_iters=4",
                           "--eval_interval=2", "--warmup_iters=0")
    assert code == 0
    code, out, err = train_cli(run_cli, char_data, tmp_path / "out", "--init_from=resume",
                               "--max_iters=8", "--eval_interval=2")
    assert code == 0 and "the cosine decay ends at step 4" in out, err
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["train_config"]["lr_decay_iters"] == 4
    with open(tmp_path / "out" / "log.jsonl") as f:
        lrs = [float(line.split('"lr": ')[1].split(",")[0]) for line in f]
    assert lrs[2:] == [1e-4, 1e-4, 1e-4]  # steps 4, 6, 8: min_lr


# --------------------------------------------------------------------------------------------------
# sample.py and eval.py


def nan_checkpoint(trained, tmp_path):
    return edited_checkpoint(trained, tmp_path / "nan",
                             lambda c: c["model"]["norm.weight"].fill_(float("nan")))


def run_sample(run_cli, out_dir, *args):
    return run_cli(sample.main, [f"--out_dir={out_dir}", "--num_samples=1", "--max_new_tokens=5",
                                 "--start=ab", "--device=cpu", *args])


def test_sample_rejects_bad_values(tmp_path, run_cli, trained):
    cases = [  # the sampling settings are GPT.stream's checks; the rest sample.py's
        (["--temperature=nan"], "temperature=nan must be a finite number >= 0"),
        (["--temperature=inf"], "temperature=inf must be a finite number >= 0"),
        (["--top_p=nan"], "top_p=nan must be in (0, 1]"),
        (["--seed=99999999999999999999"], "--seed=99999999999999999999 must be in [0, 2^63)"),
        (["--seed=-1"], "--seed=-1 must be in [0, 2^63)"),
        (["--threads=-2"], "--threads=-2 must be >= 0"),
        (["--num_samples=0"], "--num_samples=0 must be >= 1"),
    ]
    for args, message in cases:
        code, _, err = run_sample(run_cli, trained, *args)
        assert_one_line(code, err, message, "sample.py")
        others = {"--seed", "--threads", "--num_samples"} - {args[0].split("=")[0]}
        assert not any(other in err for other in others), err  # only the flag that is wrong
    code, _, err = run_sample(run_cli, nan_checkpoint(trained, tmp_path))
    assert_one_line(code, err, "holds NaN or inf (in norm.weight): its run diverged", "sample.py")


def test_a_tiny_temperature_is_greedy_not_nan(tmp_path, run_cli, trained):
    """logits / 1e-45 overflows to inf - inf = NaN unless the best logit is subtracted first."""
    # sample.main returns the texts
    texts, out, err = run_sample(run_cli, trained, "--temperature=1e-45")
    assert "Traceback" not in err and len(texts) == 1
    assert texts == run_sample(run_cli, trained, "--temperature=0")[0]


def test_eval_checks_outputs_first_and_refuses_nan(tmp_path, char_data, run_cli, trained):
    (tmp_path / "a_file").write_text("")
    # --plot without it is refused first
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    for flag in ("--json", "--plot") if has_matplotlib else ("--json",):
        for path, message in [(tmp_path / "a_file" / "x", "is a file, not a folder"),
                              (tmp_path, "is a directory"),
                              ("", "is empty")]:
            code, _, err = run_cli(ev.main, [str(trained), f"--data_dir={char_data}",
                                             f"{flag}={path}"])
            assert_one_line(code, err, f"{flag}", "eval.py")
            assert message in err and "evaluated" not in err  # refused before any evaluation
    code, _, err = run_cli(ev.main, [str(trained), str(nan_checkpoint(trained, tmp_path)),
                                     f"--data_dir={char_data}"])
    assert_one_line(code, err, "holds non-finite weights", "eval.py")


# --------------------------------------------------------------------------------------------------
# bench.py

TOY = ["--dataset=none", "--vocab_size=300", "--n_layer=1", "--n_head=2", "--n_embd=16",
       "--block_size=8", "--batch_size=2", "--steps=1", "--warmup=0", "--lev_ids=40",
       "--lev_embd=8", "--plain_max=10", "--gen_tokens=4", "--tables=train"]


@pytest.mark.parametrize("flag, message", [
    ("--steps=0", "--steps=0 must be >= 1"),
    ("--warmup=-1", "--warmup=-1 must be >= 0"),
    ("--batch_size=0", "--batch_size=0 must be >= 1"),
    ("--n_head=3", "n_embd=16 must be divisible by n_head=3"),
    ("--block_size=0", "block_size=0 must be a positive integer"),
    ("--n_layer=-1", "n_layer=-1 must be a positive integer"),
    ("--lev_ids=0", "--lev_ids=0 must be >= 1"),
    ("--tables=lev --lev_ids=301", "--lev_ids=301 distinct ids need --vocab_size >= 301"),
    ("--gen_tokens=0", "--gen_tokens=0 must be >= 1"),
    ("--plain_max=0", "--plain_max=0 must be >= 1"),
    ("--vocab_size=1", "vocab_size=1 must be at least 2"),
    ("--lev_chunk=0", "--lev_chunk=0 must be >= 1"),
    ("--lev_embd=0", "n_embd=0 must be a positive integer"),
    ("--seed=-5", "--seed=-5 must be >= 0"),
    ("--embedding=,", "unknown arm(s)"),
    ("--json=", "--json is empty"),
])
def test_bench_flags_are_checked(run_cli, flag, message):
    code, out, err = run_cli(bench.main, [*TOY, *flag.split()])
    assert code == 2 and message in err and "Traceback" not in err and not out, err


def test_common_reports_an_unwritable_folder(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--json=.* is a directory"):
        cli.check_output_file(str(tmp_path), "--json")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        cli.check_output_file(str(tmp_path / "f" / "x.json"), "--json")
    os.chmod(tmp_path / "f", 0o644)
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o555)
        with pytest.raises(ValueError, match="cannot write in"):
            cli.check_output_file(str(tmp_path / "ro" / "x.json"), "--json")


def test_more_damage_found_by_probing(tmp_path, char_data, run_cli, trained):
    """Cases a probe of ~370 hostile inputs turned up: edited settings inside a checkpoint,
    schedules that make no sense, format fields in out_dir, deeply nested config files, bench.py's
    data too short for its block."""
    edited = edited_checkpoint(trained, tmp_path / "edited",
                               lambda c: c["train_config"].update(beta2="x"))
    code, _, err = train_cli(run_cli, char_data, edited, "--init_from=resume", "--max_iters=4")
    assert_one_line(code, err, "(train_config): beta2='x' must be a number", "train.py")
    negative = edited_checkpoint(trained, tmp_path / "negative", lambda c: c.update(step=-3))
    code, _, err = train_cli(run_cli, char_data, negative, "--init_from=resume", "--max_iters=4")
    assert_one_line(code, err, "(rng) are unusable (a counter is negative)", "train.py")
    (tmp_path / "deep.py").write_text("n_layer = " + "-" * 100_000 + "1\n")
    for args, message in [(["--warmup_iters=10", "--lr_decay_iters=2"],
                           "warmup_iters=10 must not exceed"),
                          (["--out_dir=out-{dataset.upper}"], "each {...} must name a setting"),
                          ([str(tmp_path / "deep.py")], "deep.py: nested too deeply to read")]:
        code, _, err = run_cli(train.main, [f"--data_dir={char_data}", "--dataset=tiny_char",
                                            f"--out_dir={tmp_path / 'new'}", *TINY, *args])
        assert_one_line(code, err, message, "train.py")
    # a run whose schedule was fixed at 4 steps, with the default 100 warmup steps, still resumes
    code, _, err = run_cli(train.main, [f"--data_dir={char_data}", "--dataset=tiny_char",
                                        f"--out_dir={trained}",
                                        *[f for f in TINY if "warmup" not in f],
                                        "--init_from=resume", "--max_iters=3"])
    assert code == 0, err
    (trained / "log.jsonl").rename(tmp_path / "log.jsonl")
    (trained / "log.jsonl").mkdir()
    code, _, err = run_cli(ev.main, [str(trained), f"--data_dir={char_data}", "--lambada_max=0"])
    assert_one_line(code, err, "log.jsonl is not a file", "eval.py")
    # lev_ids: the lev table's
    code, _, err = run_cli(bench.main, [*TOY, "--vocab_size=300", "--lev_ids=8192"])
    assert code == 0, err
    code, out, err = run_cli(bench.main, [*TOY, "--block_size=10000000", "--n_embd=16"])
    assert code == 2 and "is longer than the" in err and "Traceback" not in err, err


def test_log_and_config_files_no_parser_reads_are_one_line_with_their_line(tmp_path, char_data,
                                                                          run_cli, trained):
    """Issue 22: a line of 100,000 nested lists in log.jsonl ended a resume in a RecursionError
    traceback, as did eval.py's token efficiency; a config file's value that literal_eval cannot
    build ({[]: 1}) was a TypeError traceback, and some config failures named no line. Each is one
    line naming the file and the line."""
    deep = "[" * 100_000 + "]" * 100_000
    log = trained / "log.jsonl"
    records = log.read_text().splitlines()
    log.write_text("\n".join([records[0], '{"step": 1, "x": ' + deep + "}", *records[1:]]) + "\n")
    code, _, err = train_cli(run_cli, char_data, trained, "--init_from=resume", "--max_iters=3")
    assert_one_line(code, err, "log.jsonl:2 is not a log record; fix or delete that line, then "
                    "resume", "train.py")
    with pytest.raises(ValueError, match=r"log\.jsonl:2 is not a log record with 'tokens' and "
                       r"'val_loss' \(maximum recursion depth exceeded.*\); fix or delete"):
        evaluation.read_curve(str(trained))
    log.write_text('{"tokens": 1' + "0" * 400 + ', "val_loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"log\.jsonl:1 is not a log record .*int too large"):
        evaluation.read_curve(str(trained))
    log.write_bytes(b'{"tokens": 10, "val_loss": 1.5, "note": "caf\xe9"}\n')
    # read as read_log reads it
    assert evaluation.read_curve(str(trained)) == ([(10.0, 1.5)], False)
    configs = {
        "lists.py": (f"n_layer = 2\nn_head = {deep}\n", "lists.py: too many nested parentheses"),
        "minus.py": ("n_layer = 2\nn_head = (\n" + "-" * 100_000 + "1)\n",
                     "minus.py: nested too deeply to read"),
        "unhashable.py": ("n_layer = {[]: 1}\n",
                          "unhashable.py line 1: the value of n_layer must be a literal"),
        "nul.py": ("n_layer = 2\n\0\n", "cannot contain null bytes"),
        "latin1.py": ("n_layer = 2\n# caf\xe9\n",
                      "latin1.py: 'utf-8' codec can't decode byte 0xe9 in position 17"),
    }
    for name, (content, message) in configs.items():
        encoding = "latin-1" if name == "latin1.py" else "utf-8"
        (tmp_path / name).write_text(content, encoding=encoding)
        code, _, err = train_cli(run_cli, char_data, tmp_path / "new", tmp_path / name)
        assert_one_line(code, err, message, "train.py")
    code, _, err = train_cli(run_cli, char_data, tmp_path / "new", "--n_layer={[]: 1}")
    assert_one_line(code, err, "n_layer='{[]: 1}' must be an integer", "train.py")
