"""sample.py: determinism, greedy = argmax, streaming = decoded text (also for BPE split inside
UTF-8 characters), caches that do not change the output, and clear errors for bad input. Each test
writes its own tiny random checkpoint, so no training run, data or network is needed."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fast_path_check_running

import leviathan
import sample
from lab import dataset

ROOT = Path(__file__).resolve().parents[1]
CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
CHAR_META = {"dataset": "tiny", "tokenizer": "char", "vocab_size": len(CHARS), "dtype": "uint16",
             "train_tokens": 100, "val_tokens": 10, "chars": CHARS, "source": "synthetic"}
BPE_META = {"dataset": "tiny", "tokenizer": "tiny", "vocab_size": 256, "dtype": "uint16",
            "train_tokens": 100, "val_tokens": 10, "source": "synthetic"}
BLOCK = 24


def make_checkpoint(out_dir, meta=CHAR_META, embedding="lev", version=2):
    """Write out_dir/ckpt.pt for a tiny random model, as train.py would; return the model."""
    torch.manual_seed(0)
    config = leviathan.Config(vocab_size=meta["vocab_size"], block_size=BLOCK, n_layer=2, n_head=2,
                              n_embd=32, embedding=embedding, lev_seed_dim=16, lev_heads=2,
                              lev_rank=8)
    model = leviathan.GPT(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"version": version, "model": model.state_dict(),
                "model_config": dataclasses.asdict(config), "train_config": {}, "meta": meta,
                "step": 0, "tokens_seen": 0, "best_val_loss": float("inf"), "optimizer": {},
                "rng": {}}, out_dir / "ckpt.pt")
    return model


def run(out_dir, *flags):
    return sample.main([f"--out_dir={out_dir}", "--device=cpu", *flags])


@pytest.fixture
def char_ckpt(tmp_path):
    make_checkpoint(tmp_path / "out")
    return tmp_path / "out"


def test_same_seed_same_output_different_seed_different_output(char_ckpt, capsys):
    flags = ["--start=ROMEO:", "--num_samples=2", "--max_new_tokens=15", "--temperature=1.0"]
    first, again = run(char_ckpt, *flags, "--seed=1"), run(char_ckpt, *flags, "--seed=1")
    other = run(char_ckpt, *flags, "--seed=2")
    assert first == again
    assert first != other
    assert first[0] != first[1]  # samples within one run differ too
    assert all(t.startswith("ROMEO:") and len(t) == len("ROMEO:") + 15 for t in first + other)


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_greedy_equals_argmax_of_full_forward_passes_with_and_without_caches(tmp_path, embedding,
                                                                             capsys):
    model = make_checkpoint(tmp_path / "out", embedding=embedding)
    prompt, n_new = "To be", BLOCK - 5  # stays within one block: no window jumps
    idx = torch.tensor([[CHARS.index(c) for c in prompt]])
    with torch.no_grad():
        # a full forward pass over the whole sequence at every step, then argmax
        for _ in range(n_new):
            logits, _ = model(idx)
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = prompt + "".join(CHARS[i] for i in idx[0, len(prompt):].tolist())
    flags = [f"--start={prompt}", "--num_samples=1", f"--max_new_tokens={n_new}", "--temperature=0"]
    assert run(tmp_path / "out", *flags) == [expected]
    assert run(tmp_path / "out", *flags, "--no_kv_cache") == [expected]
    assert run(tmp_path / "out", *flags, "--no_kv_cache", "--plain") == [expected]
    # past the block size the model's window jumps; the KV cache must follow it exactly
    long_flags = [f"--start={prompt}", "--num_samples=1", f"--max_new_tokens={3 * BLOCK}",
                  "--temperature=0"]
    assert run(tmp_path / "out", *long_flags) == run(tmp_path / "out", *long_flags, "--no_kv_cache")


def test_no_kv_cache_feeds_the_whole_context_at_every_step(char_ckpt, capsys, monkeypatch):
    fed, checking = [], fast_path_check_running(monkeypatch)
    backbone = leviathan.GPT.backbone

    def note(call):
        if not checking:
            fed.append(call)

    monkeypatch.setattr(leviathan.GPT, "backbone", lambda self, x, kv_cache=None: note(
        (x.shape[1], kv_cache is not None)) or backbone(self, x, kv_cache))
    flags = ["--start=ab", "--num_samples=1", "--max_new_tokens=5"]
    run(char_ckpt, *flags)
    assert fed == [(2, True)] + [(1, True)] * 4  # the prompt, then only the newest token
    fed.clear()
    run(char_ckpt, *flags, "--no_kv_cache")
    assert fed == [(n, False) for n in range(2, 7)]  # everything, every time
    assert "kv_cache=off" in capsys.readouterr().err


class FlushRecorder:
    """A stdout that keeps what each flush showed (flushed) and what is not flushed yet (buffer)."""

    def __init__(self):
        self.buffer, self.flushed = "", []

    def write(self, s):
        self.buffer += s

    def flush(self):
        self.flushed.append(self.buffer)
        self.buffer = ""


def test_streamed_stdout_equals_returned_texts_token_by_token(char_ckpt, capsys, monkeypatch):
    out = FlushRecorder()
    monkeypatch.setattr(sys, "stdout", out)
    texts = run(char_ckpt, "--start=Hi", "--num_samples=3", "--max_new_tokens=12")
    assert "".join(out.flushed) + out.buffer == "".join(f"{t}\n{sample.SEPARATOR}\n" for t in texts)
    assert len(out.flushed) >= 3 * 12  # every token is printed as soon as it is sampled
    err = capsys.readouterr().err
    assert ("36 tokens in" in err and "tokens/s after the first sample" in err
            and "kv_cache=on, device=cpu" in err)


def test_stream_text_holds_back_incomplete_utf8_characters(tiny_encoding):
    """lab/dataset.py's stream_text (lab/harness_model.py streams with it; sample.py decodes
    with an incremental UTF-8 decoder, tested below)."""
    # byte-level: multi-byte characters span several ids
    tok = dataset.TiktokenTokenizer(tiny_encoding)
    ids = tok.encode("hé😀") + [0xFF, 0xC3]  # ... then an invalid byte and a cut-off character
    pieces = list(dataset.stream_text(tok, iter(ids)))
    assert pieces == ["h", "é", "😀", "\ufffd\ufffd"]
    assert "".join(pieces) == tok.decode(ids)
    assert list(dataset.stream_text(tok, iter([]))) == []


def test_a_character_cut_between_tokens_is_printed_once_whole(tmp_path, monkeypatch,
                                                               tiny_encoding):
    """Byte-level tokens that split characters: each character is printed once its last byte
    arrives, an invalid byte at once as U+FFFD, bytes never completed at the end as U+FFFD; the
    printed text is the decoding of all the ids."""
    make_checkpoint(tmp_path / "out", BPE_META)
    monkeypatch.setattr(sample.tiktoken, "get_encoding", lambda name: tiny_encoding)
    new_ids = tiny_encoding.encode_ordinary("hé😀") + [0xFF, 0xC3]
    monkeypatch.setattr(leviathan.GPT, "stream", lambda self, x, n, *args, **kwargs: (
        torch.tensor([[i]]) for i in new_ids))

    out = FlushRecorder()
    monkeypatch.setattr(sys, "stdout", out)
    [text] = run(tmp_path / "out", "--start=a", "--num_samples=1", "--max_new_tokens=9")
    assert text == "a" + tiny_encoding.decode(new_ids) == "ahé😀\ufffd\ufffd"
    assert out.flushed == ["ah", "", "é", "", "", "", "😀", "\ufffd", ""]  # one flush per token
    assert out.buffer == f"\ufffd\n{sample.SEPARATOR}\n"


def test_bpe_checkpoint_streams_exactly_the_decoded_text(tmp_path, capsys, monkeypatch,
                                                         tiny_encoding):
    """A byte-level model splits multi-byte characters across tokens at random; the printed text
    must still be exactly the decoding of all sampled ids."""
    model = make_checkpoint(tmp_path / "out", BPE_META)
    # a name-only meta cannot reach an unregistered encoding: inject it
    monkeypatch.setattr(sample.tiktoken, "get_encoding", lambda name: tiny_encoding)
    prompt = "naïve café 😀"
    texts = run(tmp_path / "out", f"--start={prompt}", "--num_samples=2", "--max_new_tokens=30",
                "--seed=7", "--temperature=1.0")
    assert capsys.readouterr().out == "".join(f"{t}\n{sample.SEPARATOR}\n" for t in texts)
    torch.manual_seed(7)
    x = torch.tensor([tiny_encoding.encode_ordinary(prompt)])
    for text in texts:
        new_ids = model.generate(x, 30, temperature=1.0, top_k=200)[0, x.shape[1]:].tolist()
        assert text == prompt + tiny_encoding.decode(new_ids)
    assert any("\ufffd" in t[len(prompt):] for t in texts)  # the sampled bytes did cut characters


def test_long_prompt_is_cropped_to_the_block_with_a_note(char_ckpt, capsys):
    prompt = "Now is the winter of our discontent made glorious summer"
    assert len(prompt) > BLOCK
    flags = ["--num_samples=1", "--max_new_tokens=8", "--temperature=0"]
    long = run(char_ckpt, f"--start={prompt}", *flags)
    note = f"the prompt is {len(prompt)} tokens, longer than block_size={BLOCK}"
    assert note in capsys.readouterr().err
    cropped = run(char_ckpt, f"--start={prompt[-BLOCK:]}", *flags)
    assert long[0] == prompt + cropped[0][BLOCK:]


def test_prompt_from_file(char_ckpt, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_text("JULIET:\n", encoding="utf-8")
    flags = ["--num_samples=1", "--max_new_tokens=5", "--temperature=0"]
    from_file = run(char_ckpt, f"--start=FILE:{tmp_path / 'prompt.txt'}", *flags)
    assert from_file == run(char_ckpt, "--start=JULIET:\n", *flags)


@pytest.mark.parametrize("flags, says", [
    # the sampling settings: GPT.stream's own checks, as one line
    (["--temperature=-0.5"], "temperature=-0.5 must be a finite number >= 0"),
    (["--top_k=0"], "top_k=0 must be >= 1"),
    (["--top_p=0"], "top_p=0.0 must be in (0, 1]"),
    (["--top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
    (["--max_new_tokens=-1"], "max_new_tokens=-1 must be >= 0"),
    (["--start="], "the prompt is empty"),
    # sample.py's own
    (["--num_samples=0"], "--num_samples=0 must be >= 1"),
    (["--repetition_penalty=0"], "--repetition_penalty=0.0 must be a finite number > 0"),
    (["--repetition_penalty=nan"], "--repetition_penalty=nan must be a finite number > 0"),
    (["--max_new_tokens=ten"], "invalid int value: 'ten'"),
    (["--start=FILE:/nonexistent/prompt.txt"], "cannot read the prompt file"),
    (["--start=Hello, World 42!"], "'24' not in the checkpoint's vocabulary"),  # say which
    (["--start=é"], "'é'"),
    pytest.param(["--device=cuda"], "no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(),
                                          reason="this machine has a GPU")),
])
def test_bad_input_is_one_line_and_exit_code_2(char_ckpt, capsys, flags, says):
    with pytest.raises(SystemExit) as exit_info:
        run(char_ckpt, *flags)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (captured.err.count("\n") == 1 and "error" in captured.err
            and says in captured.err), captured.err


class Evil:
    def __reduce__(self):
        return print, ("this ran",)


@pytest.mark.filterwarnings("error::UserWarning")  # one line: no warning printed before it
def test_bad_checkpoints_are_one_line_and_exit_code_2(tmp_path, capsys):
    make_checkpoint(tmp_path / "old", version=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "ckpt.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "evil").mkdir()
    torch.save({"version": 2, "model": Evil()}, tmp_path / "evil" / "ckpt.pt")
    make_checkpoint(tmp_path / "bad_vocab", meta={**CHAR_META, "chars": CHARS[:-1]})
    (tmp_path / "tensor").mkdir()
    torch.save(torch.zeros(3), tmp_path / "tensor" / "ckpt.pt")  # a torch.save file, not a dict

    def edited(name, edit):
        make_checkpoint(tmp_path / name)
        ckpt = torch.load(tmp_path / name / "ckpt.pt", weights_only=True)
        edit(ckpt)
        torch.save(ckpt, tmp_path / name / "ckpt.pt")

    edited("mismatch", lambda c: c["model_config"].update(n_layer=3))  # weights do not fit
    edited("unknown", lambda c: c["model_config"].update(n_experts=4))
    edited("no_meta", lambda c: c.pop("meta"))
    edited("nan", lambda c: c["model"]["norm.weight"].fill_(float("nan")))
    cases = [(tmp_path / "missing", "(no such file or directory); train a model first"),
             (tmp_path / "empty", "(no such file or directory); train a model first"),
             (tmp_path / "old", "format version 0; this sample.py reads version 2"),
             (tmp_path / "garbage", "cannot read a checkpoint at"),
             (tmp_path / "evil", "could run code: refused"),
             (tmp_path / "tensor", "is not a checkpoint this sample.py reads"),
             (tmp_path / "bad_vocab", "tokenizer has 60 tokens, its model 61"),
             (tmp_path / "mismatch", "Missing key(s) in state_dict"),
             (tmp_path / "unknown", "n_experts"),
             (tmp_path / "no_meta", "(it has no 'meta'); use one written by train.py"),
             (tmp_path / "nan", "holds NaN or inf (in norm.weight)")]
    for out_dir, says in cases:
        with pytest.raises(SystemExit) as exit_info:
            run(out_dir)
        captured = capsys.readouterr()
        assert exit_info.value.code == 2 and captured.err.count("\n") == 1, captured.err
        assert says in captured.err and captured.out == "", captured.err
        assert "Error:" not in captured.err, captured.err  # no exception class names


def test_cli_streams_samples_and_reports_speed_then_fails_cleanly(char_ckpt):
    cmd = [sys.executable, str(ROOT / "sample.py"), f"--out_dir={char_ckpt}", "--start=ROMEO:",
           "--num_samples=2", "--max_new_tokens=20", "--no_kv_cache"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ROMEO:") == 2 and done.stdout.count(f"\n{sample.SEPARATOR}\n") == 2
    summary = done.stderr.strip().splitlines()[-1]
    assert ("40 tokens in" in summary and "tokens/s" in summary
            and "kv_cache=off, device=cpu" in summary)
    bad = subprocess.run([*cmd, "--top_p=2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_plain_runs_the_model_as_written_and_samples_the_same(tmp_path, embedding, capsys,
                                                              monkeypatch):
    """--plain: no fast path (a model whose code was edited samples what its code says), and the
    same greedy text as with them."""
    make_checkpoint(tmp_path / "out", embedding=embedding)
    flags = ["--start=To be", "--num_samples=1", f"--max_new_tokens={2 * BLOCK}", "--temperature=0"]
    fast = run(tmp_path / "out", *flags)
    with_fast_paths = "on" if embedding == "lev" else f"none ({embedding} arm)"
    assert f"fast_paths={with_fast_paths}" in capsys.readouterr().err
    calls = []
    if embedding == "lev":  # LEV's fast path is not called
        recipe = leviathan.LEV.recipe
        monkeypatch.setattr(leviathan.LEV, "recipe",
                            lambda self, ids: calls.append(1) or recipe(self, ids))
    assert run(tmp_path / "out", *flags, "--plain") == fast
    assert bool(calls) == (embedding == "lev")  # the recipe as written computed LEV
    err = capsys.readouterr().err
    assert f"fast_paths={'off' if embedding == 'lev' else with_fast_paths}" in err


def test_plain_and_compile_compile_the_model_as_written(char_ckpt, capsys):
    flags = ["--start=ab", "--num_samples=1", "--max_new_tokens=6", "--temperature=0"]
    assert run(char_ckpt, *flags, "--plain", "--compile") == run(char_ckpt, *flags)
    assert "compile=on, fast_paths=off" in capsys.readouterr().err


def test_sampling_loads_neither_the_lean_head_nor_the_lab(char_ckpt):
    """sample.py's path: leviathan.py and LEV's fast path; not the training-only lean head, nor
    lab/."""
    code = (f"import sys, sample; sample.main(['--out_dir={char_ckpt}', '--num_samples=1', "
            f"'--max_new_tokens=2']); print(sorted(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(eval(done.stdout.strip().splitlines()[-1]))
    assert {"leviathan", "kernels.fast_lev", "kernels.fast_paths"} <= loaded
    assert "fast_paths=on" in done.stderr  # LEV's fast path was installed, and checked
    assert not {m for m in loaded if m == "kernels.lean_head" or m.split(".")[0] in
                {"lab"}}


def test_bfloat16_samples_under_autocast_and_says_so(char_ckpt, capsys):
    """--dtype=bfloat16 on CPU: the matmuls in bf16 (greedy tokens may differ from fp32's, so only
    that it runs and reports its dtype is checked); --chat without a chat format is refused."""
    texts = run(char_ckpt, "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=8",
                "--temperature=0", "--dtype=bfloat16")
    assert len(texts[0]) == len("ROMEO:") + 8 and "dtype=bfloat16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(char_ckpt, "--chat", "--start=Hi", "--max_new_tokens=2")
    assert "has no chat format; drop --chat" in capsys.readouterr().err


def test_greedy_draws_one_sample_unless_asked(char_ckpt, capsys):
    assert len(run(char_ckpt, "--temperature=0", "--max_new_tokens=3")) == 1
    assert len(run(char_ckpt, "--temperature=0", "--max_new_tokens=3", "--num_samples=2")) == 2
    assert len(run(char_ckpt, "--max_new_tokens=3")) == 10


def test_repetition_penalty_is_a_logits_hook_as_written(char_ckpt, capsys):
    """--repetition_penalty's hook: each seen id's logit divided (positive) or multiplied
    (negative), the others untouched; greedy with it = argmax of the rewritten logits at each
    step, from full forward passes."""
    hook = sample.repetition_penalty(2.0)
    logits, idx = torch.tensor([[4.0, -1.0, 3.0, 0.5]]), torch.tensor([[0, 1, 1]])
    assert hook(logits, idx).tolist() == [[2.0, -2.0, 3.0, 0.5]]
    [text] = run(char_ckpt, "--start=ab", "--temperature=0", "--max_new_tokens=12",
                 "--repetition_penalty=1.8")
    model = make_checkpoint(char_ckpt.parent / "same")  # the same weights (same seed)
    ids = torch.tensor([[CHARS.index(c) for c in "ab"]])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, hook_argmax(model, ids, sample.repetition_penalty(1.8))], 1)
    assert text == "".join(CHARS[i] for i in ids[0].tolist())
    [plain] = run(char_ckpt, "--start=ab", "--temperature=0", "--max_new_tokens=12")
    assert plain != text  # the penalty changed something, or the test shows nothing


def hook_argmax(model, ids, hook):
    logits, _ = model(ids)
    return hook(logits[:, -1].float(), ids).argmax(-1, keepdim=True)
