"""Tests of eval.py on tiny synthetic data dirs, tiny untrained checkpoints, hand-written logs."""

import importlib.util
import json
import math
import os
import random
import string
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

from kernels.fast_lev import FastEmbedder
from lab import eval as ev
from lab import evaluation
from lab.checkpoints import CHECKPOINT_VERSION
from lab.dataset import CharTokenizer, TiktokenTokenizer
from leviathan import GPT, Config
from train import eval_windows

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
WORDS = ("the king shall speak to my lord and you are not here good night come away love what is "
         "this").split()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def synthetic_play(seed, n_paragraphs):
    """Speeches between blank lines, each ending in a word and punctuation (Tiny Shakespeare)."""
    rng = random.Random(seed)
    speeches = []
    for _ in range(n_paragraphs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        speaker = rng.choice(["ROMEO", "JULIET", "NURSE"])
        speeches.append(f"{speaker}:\n{' '.join(words).capitalize()}{rng.choice('.!?')}\n")
    return "\n".join(speeches)


# every character synthetic_play writes: datasets of other texts with the same char tokenizer
ALPHABET = "".join(sorted(set(string.ascii_letters + " .!?:\n,")))


def make_data(path, dataset="tiny", seed=0, chars=None):
    """A char-level data dir; 'Q' occurs only in val, so the 'unseen' bucket is not empty. chars:
    the vocabulary (default: the text's characters)."""
    train = synthetic_play(seed, 80)
    val = synthetic_play(seed + 1, 12) + "\nNURSE:\nQuiet now, my lord.\n"
    chars = chars or "".join(sorted(set(train + val)))
    tok = CharTokenizer(chars)
    os.makedirs(path, exist_ok=True)
    np.array(tok.encode(train), dtype=np.uint16).tofile(os.path.join(path, "train.bin"))
    np.array(tok.encode(val), dtype=np.uint16).tofile(os.path.join(path, "val.bin"))
    meta = {"dataset": dataset, "tokenizer": "char", "vocab_size": len(chars), "dtype": "uint16",
            "train_tokens": len(train), "val_tokens": len(val), "chars": chars,
            "source": "synthetic"}
    Path(path, "meta.json").write_text(json.dumps(meta))
    return meta


def make_run(path, meta, embedding, seed=0, log=None, origin=None):
    """A tiny untrained checkpoint in the train.py format, and optionally a log.jsonl of log, a list
    of (tokens, val_loss) at steps 0, 1, ..., the checkpoint at the last; origin: the run it was
    fine-tuned from, as train.py records it."""
    torch.manual_seed(seed)
    config = Config(vocab_size=meta["vocab_size"], block_size=BLOCK, n_layer=1, n_head=2, n_embd=32,
                    embedding=embedding, lev_seed_dim=16, lev_heads=2, lev_rank=8)
    model = GPT(config)
    os.makedirs(path, exist_ok=True)
    ckpt = {"version": CHECKPOINT_VERSION, "model": model.state_dict(),
            "model_config": asdict(config), "train_config": {"batch_size": 4, "seed": seed},
            "meta": meta, "step": len(log) - 1 if log else 10,
            "tokens_seen": int(log[-1][0]) if log else 640, "best_val_loss": 4.0, "optimizer": {},
            "rng": {}}
    torch.save({**ckpt, "origin": origin} if origin else ckpt, os.path.join(path, "ckpt.pt"))
    if log is not None:
        with open(os.path.join(path, "log.jsonl"), "w") as f:
            for step, (tokens, val_loss) in enumerate(log):
                f.write(json.dumps({"step": step, "tokens": tokens, "train_loss": val_loss,
                                    "val_loss": val_loss, "lr": 1e-3, "elapsed_s": step,
                                    "embedding": embedding}) + "\n")
    return model.eval()


def val_tokens(data_dir):
    return np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)


def counts_of(data_dir, vocab_size):
    train = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16)
    return np.bincount(train, minlength=vocab_size)


# --------------------------------------------------------------------------------------------------
# frequency buckets


def test_bucket_stats_hand_made():
    # id:          0  1   2   3    4    5     6     7      8      9   10
    counts = np.array([0, 1, 10, 11, 100, 101, 1000, 1001, 10000, 10001, 5])
    targets = np.array([0, 1, 2, 10, 3, 4, 5, 6, 7, 8, 9, 9])
    losses = np.array([5.0, 1.0, 2.0, 3.0, 0.5, 1.5, 0.2, 0.4, 0.1, 0.3, 0.05, 0.15])
    stats = ev.bucket_stats(losses, targets, counts)
    assert [s["bucket"] for s in stats] == list(ev.BUCKETS)
    assert [s["tokens"] for s in stats] == [1, 3, 2, 2, 2, 2]
    for s, want in zip(stats, [5.0, 2.0, 1.0, 0.3, 0.2, 0.1], strict=True):
        assert s["loss"] == pytest.approx(want)
        assert s["ppl"] == pytest.approx(math.exp(want))
        assert s["share"] == pytest.approx(s["tokens"] / len(targets))
    # buckets without targets have no loss rather than a made-up one
    stats = ev.bucket_stats(np.array([1.0, 3.0]), np.array([3, 4]), counts)
    assert [s["tokens"] for s in stats] == [0, 0, 2, 0, 0, 0]
    assert stats[2]["loss"] == pytest.approx(2.0)
    assert stats[0]["loss"] is None and stats[0]["ppl"] is None


def test_train_counts_chunked():
    tokens = np.array([3, 1, 3, 0, 3, 1, 4], dtype=np.uint16)
    assert ev.train_counts(tokens, 6, chunk=2).tolist() == [1, 2, 0, 3, 1, 0]


def test_whole_split_losses_and_stratification(tmp_path):
    meta = make_data(tmp_path / "data")
    model = make_run(tmp_path / "run", meta, "lev")
    val = val_tokens(tmp_path / "data")
    losses, targets = ev.evaluate_tokens(model, val, batch_size=7, device="cpu")
    n_windows = (len(val) - 1) // BLOCK
    assert len(losses) == len(targets) == n_windows * BLOCK
    assert np.array_equal(targets, val[1:n_windows * BLOCK + 1])
    # the same mean loss as the model's own forward pass over the same windows, and independent of
    # batching
    with torch.no_grad():
        window_losses = []
        for s in eval_windows(len(val), BLOCK):
            w = torch.from_numpy(val[s:s + BLOCK + 1].astype(np.int64))
            window_losses.append(model(w[None, :-1], w[None, 1:])[1].item())
    assert losses.mean() == pytest.approx(np.mean(window_losses), abs=1e-5)
    unbatched, _ = ev.evaluate_tokens(model, val, batch_size=1, device="cpu")
    assert np.allclose(losses, unbatched, atol=1e-5)
    # every scored target falls in exactly one bucket; the bucket losses recombine into the overall
    # loss
    counts = counts_of(tmp_path / "data", meta["vocab_size"])
    stats = ev.bucket_stats(losses, targets, counts)
    assert sum(s["tokens"] for s in stats) == len(targets)
    assert sum(s["share"] for s in stats) == pytest.approx(1.0)
    by_hand = [0] * 6
    for t in targets:
        c = counts[t]
        bucket = (0 if c == 0 else 1 if c <= 10 else 2 if c <= 100 else 3 if c <= 1000
                  else 4 if c <= 10000 else 5)
        by_hand[bucket] += 1
    assert [s["tokens"] for s in stats] == by_hand
    assert counts[meta["chars"].index("Q")] == 0 and stats[0]["tokens"] > 0  # 'Q': only in val
    recombined = sum(s["tokens"] * s["loss"] for s in stats if s["tokens"]) / len(targets)
    assert recombined == pytest.approx(losses.mean())


# --------------------------------------------------------------------------------------------------
# token efficiency


def test_tokens_to_reach():
    curve = [(0, 4.0), (100, 3.0), (200, 2.0), (300, 1.5)]
    assert ev.tokens_to_reach(curve, 2.5) == pytest.approx(150)  # interpolated between 100 and 200
    assert ev.tokens_to_reach(curve, 2.0) == 200  # an evaluation exactly at the target
    assert ev.tokens_to_reach(curve, 4.5) == 0
    assert ev.tokens_to_reach(curve, 1.0) is None  # never reached
    # the first crossing counts, even if the loss rises again afterwards
    rises_again = [(0, 4.0), (100, 2.0), (200, 3.0), (300, 2.2)]
    assert ev.tokens_to_reach(rises_again, 2.2) == pytest.approx(90)


def test_token_efficiency_from_logs(tmp_path):
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": 8, "chars": "abcdefgh"}
    make_run(tmp_path / "base", meta, "tied", log=[(0, 4.0), (1000, 3.0), (2000, 2.5), (4000, 2.0)])
    make_run(tmp_path / "fast", meta, "lev", log=[(0, 4.0), (1000, 3.0), (2000, 1.0)])
    make_run(tmp_path / "slow", meta, "lev", log=[(0, 4.0), (1000, 3.5), (2000, 3.0)])
    make_run(tmp_path / "nolog", meta, "untied")
    curves = [evaluation.read_curve(tmp_path / d)[0] for d in ("base", "fast", "slow", "nolog")]
    assert curves[1] == [(0, 4.0), (1000, 3.0), (2000, 1.0)] and curves[3] is None
    target, rows = ev.token_efficiency(curves, [True] * 4)
    assert target == 2.0
    assert rows[0] == {"final_val_loss": 2.0, "tokens_to_reach": 4000, "fewer_tokens": 1.0}
    assert rows[1]["tokens_to_reach"] == pytest.approx(1500)
    assert rows[1]["fewer_tokens"] == pytest.approx(4000 / 1500)
    assert rows[2] == {"final_val_loss": 3.0, "tokens_to_reach": None, "fewer_tokens": None}
    assert rows[3] == {"final_val_loss": None, "tokens_to_reach": None, "fewer_tokens": None}
    # no baseline log, or a baseline whose checkpoint is not in it: nothing to reach
    assert ev.token_efficiency([None, curves[1]], [False, True]) == (None, None)
    assert ev.token_efficiency(curves[:2], [False, True]) == (None, None)
    # another run whose log ends before its checkpoint: no final loss of its own
    assert ev.token_efficiency(curves[:2], [True, False])[1][1]["final_val_loss"] is None
    with open(tmp_path / "fast" / "log.jsonl", "a") as f:
        f.write('{"step": 3, "tokens": 30\n')
    with pytest.raises(ValueError, match=r"log.jsonl:4 "):
        evaluation.read_curve(tmp_path / "fast")


# --------------------------------------------------------------------------------------------------
# LAMBADA-style last words

TEXT = ("ALICE:\nWe shall go to the market.\n\nBOB:\nThen I'll.\n\n\nCAROL:\nIn 1623.\n\n"
        "DAVE:\nHear me speak!'\n  \n\nEVE:\nA well-known.\n\nSoloword.\n\nFRED:\nGood night")


def test_lambada_passages_char():
    tok = CharTokenizer("".join(sorted(set(TEXT))))
    passages = ev.lambada_passages(TEXT, tok, max_passages=10)
    assert [(tok.decode(c), tok.decode(w), word) for c, w, word in passages] == [
        ("ALICE:\nWe shall go to the ", "market", "market"),
        ("DAVE:\nHear me ", "speak", "speak"),
        ("FRED:\nGood ", "night", "night"),
    ]
    # capped: evenly spaced over the qualifying passages, deterministic
    two = ev.lambada_passages(TEXT, tok, max_passages=2)
    assert [word for _, _, word in two] == ["market", "speak"]
    assert [word for _, _, word in ev.lambada_passages(TEXT, tok, max_passages=1)] == ["market"]


def test_lambada_passages_bpe_moves_the_space_into_the_word():
    # byte-level BPE with one merge, " s": "Hear me " ends in a lone space, "Hear me speak" in
    # " s" + "peak"
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b" s"] = 256
    enc = tiktoken.Encoding(name="tiny", pat_str=r"""'s|'t| ?\w+| ?[^\s\w]+|\s+""",
                            mergeable_ranks=ranks, special_tokens={})
    tok = TiktokenTokenizer(enc)
    [(context, word_ids, word)] = ev.lambada_passages("DAVE:\nHear me speak.<|endoftext|>x", tok, 5)
    decoded = (tok.decode(context), tok.decode(word_ids), word)
    assert decoded == ("DAVE:\nHear me", " speak", "speak")
    assert word_ids[0] == 256 and context + word_ids == tok.encode("DAVE:\nHear me speak")


def test_lambada_eval_matches_unpadded_passages(tmp_path):
    chars = "".join(sorted(set(TEXT + "a long context z")))
    tok = CharTokenizer(chars)
    model = make_run(tmp_path / "run", {"vocab_size": len(chars)}, "untied")
    passages = ev.lambada_passages(TEXT, tok, 10)
    # too long: skipped
    passages.append((tok.encode("a long context " * 3), tok.encode("z" * BLOCK), "z" * BLOCK))
    result = ev.lambada_eval(model, passages, batch_size=2, device="cpu")
    unbatched = ev.lambada_eval(model, passages, batch_size=1, device="cpu")
    assert result == pytest.approx(unbatched, rel=1e-6)  # padding changes nothing but rounding
    # the same figures from each passage alone: no padding, context cut to BLOCK - len(word) tokens
    correct, losses = 0, []
    with torch.no_grad():
        for context, word, _ in passages[:3]:
            context = context[-(BLOCK - len(word)):]
            seq = torch.tensor(context + word)
            logits, _ = model(seq[None, :-1], seq[None, 1:])
            at = torch.arange(len(context) - 1, len(seq) - 1)
            correct += bool((logits[0, at].argmax(-1) == torch.tensor(word)).all())
            word_losses = torch.nn.functional.cross_entropy(logits[0, at], torch.tensor(word),
                                                            reduction="none")
            losses += word_losses.tolist()
    assert result["passages"] == 3
    assert result["accuracy"] == pytest.approx(correct / 3)
    assert result["word_loss"] == pytest.approx(np.mean(losses), abs=1e-5)
    assert result["word_ppl"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-5)


# --------------------------------------------------------------------------------------------------
# the command


def test_runs_of_other_lengths_and_a_stopped_baseline_are_said_so(tmp_path, run_cli, monkeypatch):
    """Runs stopped at different steps: each run's step and tokens in the table, and one line
    above the tables. A baseline stopped between evaluations (Ctrl-C: a checkpoint its log has no
    record of) gives no token-efficiency target: its last record is an earlier model's loss."""
    meta = make_data(tmp_path / "data" / "tiny")
    make_run(tmp_path / "tied", meta, "tied", 0, [(0, 4.0), (1000, 3.0)])
    make_run(tmp_path / "lev", meta, "lev", 1, [(0, 4.0), (1000, 3.0), (2000, 2.0)])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(ev.main, ["tied", "lev", "--device=cpu", "--lambada_max=0"])
    assert code == 0, err
    lines = out.splitlines()
    note = [line for line in lines if line.startswith("Note: the runs trained on different")]
    assert note == ["Note: the runs trained on different numbers of tokens: tied 1,000 (step 1), "
                    "lev 2,000 (step 2); the loss differences below are not the arms' alone."]
    assert lines.index(note[0]) < lines.index(next(x for x in lines if x.startswith("## ")))
    assert "| tied | 1 | 1,000 | " in out and "| lev | 2 | 2,000 | " in out
    assert "val loss at its checkpoint, 3.0000" in out
    ckpt = torch.load(tmp_path / "tied" / "ckpt.pt", weights_only=True)
    torch.save({**ckpt, "step": 7, "tokens_seen": 1700}, tmp_path / "tied" / "ckpt.pt")  # Ctrl-C
    code, out, err = run_cli(ev.main, ["tied", "lev", "--device=cpu", "--lambada_max=0"])
    assert code == 0, err
    assert ("## Token efficiency: skipped, the baseline tied has no log.jsonl record of its "
            "checkpoint (step 7): it stopped between evaluations") in out


def test_end_to_end(tmp_path, run_cli, monkeypatch):
    meta = make_data(tmp_path / "data" / "tiny")
    models = [
        make_run(tmp_path / "out-tied", meta, "tied", 0,
                 [(0, 4.0), (1000, 3.0), (2000, 2.5), (4000, 2.0)]),
        make_run(tmp_path / "out-lev", meta, "lev", 1, [(0, 4.0), (1000, 3.0), (2000, 1.0)]),
        make_run(tmp_path / "out-lev-s2", meta, "lev", 2, [(0, 4.0), (1000, 3.5), (2000, 3.0)])]
    # the data dir is found as data/<dataset> relative to the working directory
    monkeypatch.chdir(tmp_path)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None  # an optional extra
    plot = ["--plot=res/compare.png"] if has_matplotlib else []
    code, out, err = run_cli(ev.main, ["out-tied", "out-lev", "out-lev-s2", "--device=cpu",
                                       "--batch_size=5", "--lambada_max=8",
                                       "--json=res/compare.json"] + plot)
    assert code == 0, err
    assert "| tied | " in out and "| lev (out-lev) | " in out and "| lev (out-lev-s2) | " in out
    assert "| unseen | " in out and "never reached" in out
    assert "2.67x" in out and "(baseline)" in out
    assert "val loss at its checkpoint, 2.0000" in out

    result = json.loads(Path("res/compare.json").read_text())
    assert [a["label"] for a in result["arms"]] == ["tied", "lev (out-lev)", "lev (out-lev-s2)"]
    val = val_tokens("data/tiny")
    for arm, model in zip(result["arms"], models, strict=True):
        losses, targets = ev.evaluate_tokens(model, val, batch_size=3, device="cpu")
        assert arm["val_loss"] == pytest.approx(float(losses.mean()), abs=1e-5)
        assert arm["val_targets"] == len(targets) == sum(b["tokens"] for b in arm["buckets"])
        assert arm["params"] == model.param_report()
        assert arm["lambada"]["passages"] == 8
        assert f"{arm['val_loss']:.4f}" in out
    assert result["arms"][1]["token_efficiency"]["fewer_tokens"] == pytest.approx(4000 / 1500)
    assert result["baseline_final_val_loss"] == 2.0
    if has_matplotlib:
        assert Path("res/compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no temporary files
    assert sorted(os.listdir("res")) == ["compare.json"] + ["compare.png"] * has_matplotlib
    code, out, err = run_cli(ev.main, ["out-tied", "out-lev", "--lambada_max=0"])
    assert code == 0 and "## Token efficiency" in out and "Last-word" not in out


def test_a_tokenizer_that_cannot_be_built_is_one_line(tmp_path, run_cli, monkeypatch):
    """The last-word task needs the dataset's tokenizer (e.g. GPT-2 BPE files, offline); without it,
    one line."""
    meta = {**make_data(tmp_path / "data" / "tiny"), "tokenizer": "no_such_encoding", "chars": None}
    Path(tmp_path / "data" / "tiny" / "meta.json").write_text(json.dumps(meta))
    make_run(tmp_path / "a", meta, "tied")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(ev.main, ["a"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "cannot build the tokenizer 'no_such_encoding'" in err and "--lambada_max=0" in err
    code, out, err = run_cli(ev.main, ["a", "--lambada_max=0"])
    assert code == 0, err


def test_labels():
    assert evaluation.labels(["out-tied", "out-lev"], ["tied", "lev"]) == ["tied", "lev"]
    assert evaluation.labels(["runs/out-lev", "out-lev-s2/", "out-tied"], ["lev", "lev", "tied"]) \
        == ["lev (out-lev)", "lev (out-lev-s2)", "tied"]
    # the same dir names
    assert evaluation.labels(["a/out", "b/out"], ["lev", "lev"]) == ["lev (a/out)", "lev (b/out)"]


def test_refuses_mismatched_inputs(tmp_path, run_cli, monkeypatch):
    meta = make_data(tmp_path / "data" / "tiny")
    other_meta = make_data(tmp_path / "data" / "other", dataset="other")
    make_data(tmp_path / "wrong" / "tiny", dataset="other")  # a folder tiny holding another dataset
    make_run(tmp_path / "a", meta, "tied")
    make_run(tmp_path / "b", other_meta, "lev")
    make_run(tmp_path / "c", {**meta, "tokenizer": "gpt2", "chars": None}, "lev")
    monkeypatch.chdir(tmp_path)
    cases = [
        # same dataset and vocabulary size, different tokenizer
        (["a", "c"], f"a uses tokenizer char (vocab {meta['vocab_size']}) but c uses tokenizer "
                     f"gpt2 (vocab {meta['vocab_size']}); perplexities per token"),
        (["a", "missing"], "no checkpoint at missing"),
        (["a", "--data_dir=wrong"], "wrong/tiny holds dataset 'other', not 'tiny'"),
        (["a", "--data_dir=nowhere"], "no prepared dataset in nowhere/tiny"),
        (["a", "--batch_size=0"], "--batch_size=0 must be at least 1"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(ev.main, argv)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    code, _, err = run_cli(ev.main, ["a", "--plot=x.png"])
    assert code == 2 and "--plot needs matplotlib" in err
    # another dataset of the same tokenizer: compared (test_runs_of_two_datasets_...)
    code, out, err = run_cli(ev.main, ["a", "b", "--lambada_max=0"])
    assert code == 0 and out.startswith("Scored on dataset 'tiny' (data/tiny: "), err


@pytest.fixture
def two_datasets(tmp_path, monkeypatch):
    """data/src and data/dst: other texts, one char tokenizer; src-tied and src-lev trained on src,
    ft (lev) fine-tuned from src-lev onto dst, each with a log -> {name: model}, in tmp_path."""
    src = make_data(tmp_path / "data" / "src", "src", seed=0, chars=ALPHABET)
    dst = make_data(tmp_path / "data" / "dst", "dst", seed=7, chars=ALPHABET)
    monkeypatch.chdir(tmp_path)
    origin = {"checkpoint": "src-lev/ckpt.pt", "step": 10, "dataset": "src", "embedding": "lev"}
    return {"src-tied": make_run("src-tied", src, "tied", 0, [(0, 4.0), (1000, 3.0), (3000, 2.0)]),
            "src-lev": make_run("src-lev", src, "lev", 1, [(0, 4.0), (1000, 2.5), (2000, 1.5)]),
            "ft": make_run("ft", dst, "lev", 2, [(2000, 3.0), (2500, 1.0)], origin)}


def scored_figures(model, data_dir):
    """model's val loss on data_dir's val split, and its bucket sizes by data_dir's train split."""
    losses, targets = ev.evaluate_tokens(model, val_tokens(data_dir), batch_size=4, device="cpu")
    stats = ev.bucket_stats(losses, targets, counts_of(data_dir, len(ALPHABET)))
    return float(losses.mean()), [b["tokens"] for b in stats]


def test_runs_of_two_datasets_are_scored_on_one(two_datasets, run_cli):
    """A model and its fine-tuned version share a tokenizer: both are scored on one val split (the
    first run's dataset, or --dataset), and token efficiency compares the runs of that dataset only:
    each log.jsonl is of its own run's val split."""
    code, out, err = run_cli(ev.main, ["src-tied", "ft", "src-lev", "--device=cpu",
                                       "--lambada_max=4", "--json=src.json"])
    assert code == 0, err
    assert out.splitlines()[0] == (
        "Scored on dataset 'src' (data/src: its val split, and its train split's counts for the "
        "frequency buckets); runs trained on another dataset (same tokenizer): lev (ft) on 'dst'.")
    assert "| lev (src-lev) | 1.5000 | 1,500 | 2.00x |" in out  # 3000 / 1500 tokens, against tied
    assert "- left out: lev (ft) (on 'dst'): trained on another dataset" in out
    assert "| lev (ft) | 1.0000 |" not in out
    assert "lev (ft) was fine-tuned from src-lev/ckpt.pt (step 10, dataset src)" in out
    result = json.loads(Path("src.json").read_text())
    assert (result["dataset"], result["data_dir"], result["tokenizer"]) == ("src", "data/src",
                                                                            "char")
    assert result["token_efficiency_reference"] == "tied"
    assert [a["dataset"] for a in result["arms"]] == ["src", "dst", "src"]
    assert set(result["arms"][1]["token_efficiency"].values()) == {None}
    for arm, name in zip(result["arms"], ["src-tied", "ft", "src-lev"], strict=True):
        val_loss, sizes = scored_figures(two_datasets[name], "data/src")
        assert arm["val_loss"] == pytest.approx(val_loss, abs=1e-5)
        assert [b["tokens"] for b in arm["buckets"]] == sizes  # src's training counts

    # --dataset=dst: everything on dst; token efficiency among its runs (ft, the reference)
    code, out, err = run_cli(ev.main, ["src-tied", "ft", "src-lev", "--dataset=dst",
                                       "--lambada_max=0", "--json=dst.json"])
    assert code == 0, err
    assert out.startswith("Scored on dataset 'dst' (data/dst: ") and "## Validation loss: " \
        "whole split of data/dst" in out
    assert "training tokens to first reach lev (ft)'s val loss at its checkpoint, 1.0000" in out
    assert "- left out: tied (on 'src'), lev (src-lev) (on 'src'): trained on another" in out
    result = json.loads(Path("dst.json").read_text())
    assert result["dataset"] == "dst" and result["token_efficiency_reference"] == "lev (ft)"
    assert result["arms"][1]["token_efficiency"]["tokens_to_reach"] == 2500
    for arm, name in zip(result["arms"], ["src-tied", "ft", "src-lev"], strict=True):
        val_loss, sizes = scored_figures(two_datasets[name], "data/dst")
        assert arm["val_loss"] == pytest.approx(val_loss, abs=1e-5)
        assert [b["tokens"] for b in arm["buckets"]] == sizes  # dst's training counts
    # runs of one dataset say so; no run of the scored dataset: token efficiency is skipped
    code, out, err = run_cli(ev.main, ["src-tied", "src-lev", "--lambada_max=0"])
    assert code == 0 and out.splitlines()[0].endswith("); every run was trained on it."), err
    code, out, err = run_cli(ev.main, ["src-tied", "--dataset=dst", "--lambada_max=0"])
    assert code == 0 and "## Token efficiency: skipped, no run was trained on 'dst'" in out, err


def test_token_efficiency_among_the_runs_of_the_scored_dataset():
    curves = [[(0, 4.0), (100, 2.0)], [(0, 3.0), (50, 1.0)], [(0, 4.0), (50, 2.0)], None]
    target, rows = ev.token_efficiency_among(curves, [True] * 4, [False, True, True, True])
    assert target == 1.0  # the first run of the scored dataset is the reference
    unknown = {"final_val_loss": None, "tokens_to_reach": None, "fewer_tokens": None}
    assert rows[0] == unknown and rows[3] == unknown  # another dataset; no log
    assert rows[1] == {"final_val_loss": 1.0, "tokens_to_reach": 50, "fewer_tokens": 1.0}
    assert rows[2]["tokens_to_reach"] is None
    assert ev.token_efficiency_among(curves, [True] * 4, [False] * 4) == (None, [unknown] * 4)
    assert (ev.token_efficiency_among([None, curves[0]], [False, True], [True, True])
            == (None, [unknown] * 2))


def test_runs_of_other_tokenizers_are_refused_with_the_rule(two_datasets, run_cli, tmp_path):
    """Perplexity and buckets are per token: comparable under one tokenizer only. The one-line
    error says the rule, and how to compare such runs on tasks."""
    src = json.loads(Path("data/src/meta.json").read_text())
    make_run("bpe", {**src, "tokenizer": "gpt2", "chars": None}, "lev")
    make_run("shuffled", {**src, "chars": ALPHABET[::-1]}, "lev")  # same size, other ids
    make_data(tmp_path / "data" / "other", "other", chars=ALPHABET.replace("Z", "~"))
    v = len(ALPHABET)
    cases = [
        (["src-lev", "bpe"], f"src-lev uses tokenizer char (vocab {v}) but bpe uses tokenizer gpt2 "
         f"(vocab {v}); {evaluation.TOKENIZER_RULE}"),
        (["src-lev", "shuffled"], f"src-lev and shuffled both use tokenizer char (vocab {v}), but "
         f"not the same characters for the same ids; perplexities per token"),
        (["ft", "--dataset=other"], f"data/other holds dataset 'other' of tokenizer char (vocab "
         f"{v}), but other characters than the runs'; score them on a dataset of their tokenizer"),
        (["ft", "--dataset=../src"], "--dataset=../src must be a folder name under --data_dir"),
        (["ft", "--dataset=nowhere"], "no prepared dataset in data/nowhere"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(ev.main, [*argv, "--lambada_max=0"])
        assert code == 2 and err.count("\n") == 1 and not out, (argv, err)
        assert err == f"eval.py: error: {message}\n" or message in err, (argv, err)
    assert "zero-shot task accuracy is, but evaluate each run on its own (python lab/eval.py RUN " \
        "--task=...)" in evaluation.TOKENIZER_RULE


def test_command_line(tmp_path, run_cli):
    """--help documents the last-word rule; the script reports bad input in one line, exit 2."""
    code, out, _ = run_cli(ev.main, ["--help"])
    assert code == 0 and "teacher forcing" in out and "--lambada_max" in out
    assert "DATA_DIR/<dataset" in out
    bad = subprocess.run([sys.executable, str(ROOT / "lab" / "eval.py"), "nowhere"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("eval.py: error: no checkpoint at nowhere")
    assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_plain_gives_the_figures_of_the_fast_path(tmp_path, run_cli, monkeypatch):
    """--plain evaluates the models as leviathan.py writes them (LEV's recipe, no fast path): the
    same figures, to float32 rounding."""
    meta = make_data(tmp_path / "data" / "tiny")
    make_run(tmp_path / "out-tied", meta, "tied", 0)
    make_run(tmp_path / "out-lev", meta, "lev", 1)
    monkeypatch.chdir(tmp_path)
    calls, embed = [], FastEmbedder.__call__
    monkeypatch.setattr(FastEmbedder, "__call__",
                        lambda self, *a: calls.append(1) or embed(self, *a))
    results, fast_calls = [], []
    for extra in ([], ["--plain"]):
        calls.clear()
        code, out, err = run_cli(ev.main, ["out-tied", "out-lev", "--device=cpu", "--lambada_max=8",
                                           f"--json=res{len(extra)}.json", *extra])
        assert code == 0, err
        results.append(json.loads(Path(f"res{len(extra)}.json").read_text()))
        fast_calls.append(len(calls))
    assert fast_calls[0] > 0 and fast_calls[1] == 0  # --plain never ran LEV's fast path
    for fast, plain in zip(results[0]["arms"], results[1]["arms"], strict=True):
        assert plain["val_loss"] == pytest.approx(fast["val_loss"], abs=1e-5)
        assert plain["lambada"] == pytest.approx(fast["lambada"], abs=1e-4)
