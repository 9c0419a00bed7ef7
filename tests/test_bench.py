"""bench.py end to end at toy sizes: every table prints, the JSON holds the figures, bad flags fail
cleanly. Speed itself is not asserted here (that is bench.py's job, on a quiet machine), only that
the figures exist and are sane. Run:  python -m pytest -q tests/test_bench.py
"""

import json
import math
import os

import pytest
from conftest import ROOT, lev_param_count

from kernels.c_kernels import c_library
from lab import bench

TOY = ["--dataset=none", "--vocab_size=300", "--n_layer=1", "--n_head=2", "--n_embd=16",
       "--block_size=8", "--batch_size=2", "--steps=2", "--warmup=1", "--lev_ids=40",
       "--lev_embd=8", "--plain_max=10", "--gen_tokens=4", "--lev_chunk=16"]


def test_all_tables_and_json(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/: batches from the Zipf stand-in, said so
    code, out, err = run_cli(bench.main, TOY + ["--json=figures.json"])
    assert code == 0, err
    assert "Zipf(1.1) ids over V=300" in out
    kernels = "C (lev_kernels.c)" if c_library() is not None else "torch, compiled"
    assert f"LEV kernels {kernels}" in out
    for heading in ("## Training step", "## LEV alone", "## Generation"):
        assert heading in out
    figures = json.loads((tmp_path / "figures.json").read_text())
    train = figures["train"]
    assert set(train) == {"tied", "untied", "lev", "lev, recipe compiled",
                          "tied (full head)", "untied (full head)", "lev (full head)"}
    assert train["lev, recipe compiled"]["over_lev"] > 0  # what runs after an edit of LEV
    # each head against its tied
    assert train["tied"]["over_tied"] == train["tied (full head)"]["over_tied"] == 1.0
    assert (figures["lev_over_tied"] == train["lev"]["over_tied"] > 0
            and train["lev"]["head"] == "lean")
    for row in train.values():
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 and row["peak_memory_mib"] > 0
    assert train["lev"]["params"]["input_embedding"] == lev_param_count(300, 16)
    tied_params = train["tied"]["params"]
    assert tied_params["input_embedding"] == 300 * 16 and tied_params["head"] == 0
    lev_rows = figures["lev"]
    assert any(k.startswith("LEV fast path, compiled torch kernels, 40 distinct") for k in lev_rows)
    assert any(k.startswith("LEV fast path, eager torch kernels, 40 distinct") for k in lev_rows)
    has_c_row = any(k.startswith("LEV fast path, C kernels, 40 distinct") for k in lev_rows)
    assert has_c_row == (c_library() is not None)
    assert any(k.startswith("LEV plain recipe (LEV.reference), 10 distinct") for k in lev_rows)
    assert all(v > 0 and math.isfinite(v) for v in lev_rows.values())
    generation = figures["generation"]
    # each arm: KV cache on and off, compiled
    assert [(row["model"], row["kv_cache"], row["steps"]) for row in generation] == [
        (arm, kv, steps) for arm in ("tied", "untied", "lev")
        for kv, steps in ((True, "eager"), (False, "eager"), (True, "compiled"))]
    assert all(row["tokens_per_s"] > 0 for row in generation)
    assert f"lev_over_tied (training step time ratio): {figures['lev_over_tied']:.3f}" in out


def test_one_arm_one_table_without_lev_compile(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = open(os.path.join(ROOT, "leviathan.py"), encoding="utf-8").read()
    (tmp_path / "edited.py").write_text(model.replace("0.75 - delta ** 2", "0.7 - delta ** 2"),
                                        encoding="utf-8")
    code, out, err = run_cli(bench.main, TOY + ["--tables=train", "--embedding=lev",
                                                "--no-lev_c_kernels", "--no-lev_compile",
                                                "--lev_recipe=edited.py"])
    assert code == 0, err
    assert "LEV kernels torch, eager" in out and "| lev |" in out and "| tied |" not in out
    assert "lev_over_tied" not in out and "## LEV alone" not in out
    assert "| lev, recipe as written |" in out and "| lev of edited.py, recipe as written |" in out
    assert "lev of edited.py, recipe as written: " in out and " x lev's step" in out


@pytest.mark.parametrize("flag, message", [
    ("--embedding=lev,big", "unknown arm(s) big"),
    ("--tables=train,speed", "--tables=speed,train: choose among train, lev, gen"),
    ("--device=tpu", "invalid choice"),
    ("--lev_recipe=nowhere/leviathan.py", "--lev_recipe=nowhere/leviathan.py: no such file"),
    ("--lev_recipe=leviathan.py --embedding=tied", "--lev_recipe times a row of table 1's lev"),
])
def test_bad_flags_fail_with_a_message(run_cli, flag, message):
    code, out, err = run_cli(bench.main, flag.split())
    assert code == 2 and message in err and "Traceback" not in err


def test_the_compact_arms_are_timed_and_counted(run_cli, tmp_path, monkeypatch):
    """digits and factorized: step time, and their linear map's FLOPs on top of tied's."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(bench.main, TOY + ["--tables=train", "--heads=lean",
                                                "--embedding=tied,digits,factorized",
                                                "--json=figures.json"])
    assert code == 0, err
    train = json.loads((tmp_path / "figures.json").read_text())["train"]
    assert train["digits"]["ms_per_step"] > 0 and train["factorized"]["over_tied"] > 0
    d_seed = 128  # the default lev_seed_dim
    extra = train["digits"]["model_flops_per_token"] - train["tied"]["model_flops_per_token"]
    assert extra == 6 * d_seed * 16
