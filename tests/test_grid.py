"""lab/grid.py at toy sizes: the whole grid from one command, a second call that trains nothing, a
killed run resumed, the table written, bad flags refused in one line."""

import json
import os
import subprocess
import time

import pytest
from conftest import ROOT

from lab import grid

TOY = ["--widths=16,32", "--head_size=8", "--seeds=1", "--rare_seeds=1", "--max_iters=40",
       "--long_iters=60", "--eval_points=2", "--jobs=2",
       "--train_flags=--n_layer=1 --block_size=16 --batch_size=4 --lev_seed_dim=16 --lev_heads=2 "
       "--lev_rank=8 --lev_knots=6 --eval_iters=2 --warmup_iters=2 --log_interval=1 "
       "--device=cpu --lev_compile=False"]


def run_grid(run_cli, out, data, *flags):
    return run_cli(grid.main, [f"--out={out}", f"--data_dir={data}", "--dataset=tiny_char", *TOY,
                               *flags])


def test_the_grid_trains_resumes_and_writes_its_table(tmp_path, char_data, run_cli):
    out = tmp_path / "grid"
    args = grid.parse_args([f"--out={out}", f"--data_dir={char_data}", "--dataset=tiny_char",
                            *TOY])
    # a run killed after its first save (step 20), before the grid starts: the grid resumes it
    width, arm, seed, name = grid.grid_runs(args)[2]
    folder = out / name
    folder.mkdir(parents=True)
    command = grid.train_command(args, width, arm, seed, str(folder), 40)
    with open(folder / "train.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log)
        while not (folder / "ckpt.pt").exists() and process.poll() is None:
            time.sleep(0.05)
        process.kill()
        process.wait(timeout=120)
    killed_at = grid.last_step(str(folder))
    assert killed_at == 20

    code, stdout, err = run_grid(run_cli, out, char_data)
    assert code == 0, err
    runs = grid.grid_runs(args)
    assert len(runs) == 10  # 2 widths x (tied, untied, lev, digits, factorized) x 1 seed
    for _, _, _, name in runs:
        assert grid.last_step(str(out / name)) == 40
    assert f"resuming at step {killed_at}" in (folder / "train.log").read_text()
    table = (out / "grid.md").read_text()
    for width in (16, 32):
        for arm in ("tied", "untied", "lev", "digits", "factorized"):
            assert f"| {width} | {arm} |" in table
    # the long runs: tied and lev, 2 seeds, at the width where LEV's gap to tied is largest
    long_width = int(table.split(" long | lev |")[0].rsplit("| ", 1)[-1])
    for name in ("tied-long-s0", "lev-long-s1"):
        assert grid.last_step(str(out / f"w{long_width}-{name}")) == 60
    scores = json.loads((out / "scores" / "w16-s0.json").read_text())
    assert [a["embedding"] for a in scores["arms"]][0] == "tied"

    # a second call trains nothing and scores nothing again
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")}
    scored = {p: p.stat().st_mtime_ns for p in (out / "scores").iterdir()}
    code, stdout, err = run_grid(run_cli, out, char_data)
    assert code == 0, err
    assert "10 of 10 runs done; training 0" in stdout and "4 of 4 runs done; training 0" in stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")} == mtimes
    assert {p: p.stat().st_mtime_ns for p in (out / "scores").iterdir()} == scored


@pytest.mark.parametrize("flag, message", [
    ("--widths=a,b", "--widths=a,b: give integers, comma-separated"),
    ("--widths=20", "--widths: 20 is not a positive multiple of --head_size=8"),
    ("--jobs=0", "--jobs=0 must be at least 1"),
    ("--dataset=nowhere", "no prepared dataset nowhere in"),
])
def test_bad_flags_are_one_line(tmp_path, char_data, run_cli, flag, message):
    code, _, err = run_grid(run_cli, tmp_path / "grid", char_data, flag)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not os.path.exists(tmp_path / "grid" / "grid.md")


def test_last_evaluation_reads_the_gap_and_minutes_of_the_last_evaluated_step(tmp_path):
    records = [{"step": 0, "train_loss": 9.0, "val_loss": 9.1, "elapsed_s": 3.0},
               {"step": 5, "train_loss": 4.0, "val_loss": 4.5, "elapsed_s": 90.0},
               {"step": 6, "train_loss": 3.9, "val_loss": None, "elapsed_s": 99.0}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    gap, minutes = grid.last_evaluation(str(tmp_path))
    assert gap == pytest.approx(0.5) and minutes == pytest.approx(1.5)


def test_ctrl_c_waits_for_the_runs_then_is_one_line(tmp_path, char_data, run_cli, monkeypatch):
    """Ctrl-C reaches the runs too (one process group): the grid waits while they save, then says
    so in one line, exit code 130."""
    waited = []

    class Stopping:
        def poll(self):
            raise KeyboardInterrupt

        def wait(self):
            waited.append(True)

    def popen(*args, **kwargs):
        return Stopping()

    monkeypatch.setattr(grid.subprocess, "Popen", popen)
    code, _, err = run_grid(run_cli, tmp_path / "grid", char_data, "--jobs=1")
    assert code == 130 and waited == [True]
    assert err == (f"grid.py: stopped (Ctrl-C); the runs in {tmp_path / 'grid'} saved their last "
                   f"step, and the same command resumes\n")
