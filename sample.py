"""Sample from a trained model: a checkpoint in, text streamed to the terminal as it is generated.

    python sample.py --out_dir=out-shakespeare-cpu-lev --start="ROMEO:" --num_samples=3
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0  # greedy
    python sample.py --out_dir=out --plain  # leviathan.py exactly as written, no fast path
    python sample.py --out_dir=out-smollm2 --chat --start="Who wrote Hamlet?"  # lab/from_gguf.py

The tokenizer is the checkpoint's (characters, a tiktoken encoding, or a converted model's own
BPE). Defaults are nanoGPT's.
"""

import argparse
import base64
import codecs
import signal
import sys
import textwrap
import time
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C (torch's import included), or `python sample.py | head`: quiet
    for stop_quietly in {signal.SIGINT, getattr(signal, "SIGPIPE", signal.SIGINT)}:  # (Windows)
        signal.signal(stop_quietly, signal.SIG_DFL)

import tiktoken
import torch

from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import GPT, Config

SEPARATOR = "---------------"


def fail(message):  # bad input: one line on stderr, what was wrong and what to do; exit code 2
    print(f"sample.py: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    """sample.py with these flags (sys.argv[1:] when None) -> the samples, prompts included."""
    p = argparse.ArgumentParser("sample.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = lambda message: fail(f"{message} (see --help)")  # one line, not the usage block
    add = p.add_argument
    add("--out_dir", default="out", help="the run's folder, where train.py wrote ckpt.pt")
    add("--start", default="\n", help="the prompt, or FILE:path to read it from a UTF-8 file")
    add("--num_samples", type=int, help="samples drawn, one after another (default: 10; 1 when "
        "greedy, whose samples are all the same)")
    add("--max_new_tokens", type=int, default=500, help="tokens generated per sample")
    add("--temperature", type=float, default=0.8, help="1: the model's distribution, 0: greedy")
    add("--top_k", type=int, default=200, help="sample among the k likeliest tokens only")
    add("--top_p", type=float, help="nucleus: among the likeliest tokens whose probability is p")
    add("--repetition_penalty", type=float, default=1.0, help="CTRL's: a token already in the "
        "text has its logit divided by this where positive, multiplied where negative (1: off)")
    add("--chat", action="store_true", help="the prompt is a user's turn in the model's chat "
        "format (a converted Instruct model), the reply ends with the turn")
    add("--seed", type=int, default=1337, help="random seed: the same seed, the same samples")
    add("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="the matmuls' type (autocast); auto: bfloat16 on CUDA, float32 elsewhere")
    add("--compile", action="store_true", help="torch.compile the model (slow to start)")
    add("--no_kv_cache", action="store_true", help="recompute the whole context for every token")
    add("--plain", action="store_true", help="no fast path: leviathan.py as written, slower")
    add("--threads", type=int, default=0, help="CPU threads; 0: one under 50M parameters")
    args = p.parse_args(argv)  # the sampling settings are GPT.stream's to check
    if args.num_samples is None:
        args.num_samples = 1 if args.temperature == 0 else 10
    for bad, message in [(not 0 < args.repetition_penalty < float("inf"),  # (NaN too)
                          f"--repetition_penalty={args.repetition_penalty} must be a finite "
                          f"number > 0"),
                         (args.num_samples < 1, f"--num_samples={args.num_samples} must be >= 1"),
                         (args.threads < 0, f"--threads={args.threads} must be >= 0"),
                         (not 0 <= args.seed < 2**63, f"--seed={args.seed} must be in [0, 2^63)")]:
        if bad:
            p.error(message)
    if (prompt := args.start).startswith("FILE:"):  # as in nanoGPT
        try:
            prompt = Path(prompt[5:]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read the prompt file --start={prompt} ({e}); give a UTF-8 text file")
    have = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    device = next((d for d in have if have[d]), "cpu") if args.device == "auto" else args.device
    if not have.get(device, True):
        fail(f"--device={device}, but torch sees no {'CUDA GPU' if device == 'cuda' else 'MPS'}")

    # -- the model: train.py's checkpoint, checked; weights_only loads tensors, never code --
    path = Path(args.out_dir) / "ckpt.pt"
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # no such file, not a zip archive, truncated, pickled objects ...
        if "GLOBAL" in str(e):  # torch's message would advise loading it unsafely: not passed on
            fail(f"{path} holds Python objects other than tensors, which could run code: refused")
        missing = isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError))
        why = e.strerror.lower() if missing else "not a torch.save file, or a damaged one"
        fail(f"cannot read a checkpoint at {path} ({why}); train a model first (python train.py) "
             f"or fix --out_dir")
    try:  # another format, settings this leviathan.py does not know, weights that do not fit
        version = ckpt.get("version") if isinstance(ckpt, dict) else None  # a bare tensor warns
        if version != 2:
            raise ValueError(f"format version {version!r}; this sample.py reads version 2: "
                             f"train again, or sample with the leviathan version that wrote it")
        model = GPT(Config(**ckpt["model_config"])).to(device).eval()
        model.load_state_dict(ckpt.pop("model"))  # popped: no second copy of the weights kept
        meta, V, block_size = dict(ckpt["meta"]), model.config.vocab_size, model.config.block_size
    except (LookupError, TypeError, ValueError, RuntimeError) as e:
        why = f"it has no {e}" if isinstance(e, LookupError) else " ".join(str(e).split())[:300]
        fail(f"{path} is not a checkpoint this sample.py reads ({why}); use one written by "
             f"train.py")
    if bad := [name for name, t in model.state_dict().items() if not t.isfinite().all()]:
        fail(f"{path} holds NaN or inf (in {bad[0]}): its run diverged; use an earlier checkpoint")

    # -- the tokenizer; utf8(id) is a token's UTF-8 bytes, in BPE maybe part of a character --
    if meta.get("tokenizer") == "char":  # one token per character of the dataset's vocabulary
        chars = meta.get("chars", "")
        if missing := "".join(sorted(set(prompt) - set(chars))):
            fail(f"cannot encode the prompt: {missing!r} not in the checkpoint's vocabulary")
        ids, utf8, n_vocab = [*map(chars.index, prompt)], lambda i: chars[i].encode(), len(chars)
    else:
        if bpe := meta.get("bpe"):  # a converted model's own BPE (lab/from_gguf.py), ranked by id
            ranks = {base64.b64decode(t): i for i, t in enumerate(bpe["tokens"]) if t is not None}
            enc = tiktoken.Encoding(meta["tokenizer"], pat_str=bpe["pattern"],
                                    mergeable_ranks=ranks, special_tokens=bpe["special_tokens"])
        else:
            try:  # tiktoken downloads an encoding once, into TIKTOKEN_CACHE_DIR where it is set
                enc = tiktoken.get_encoding(meta.get("tokenizer"))
            except Exception as e:  # an unknown name; offline, an encoding never downloaded
                why = textwrap.shorten(str(e), 150, placeholder=" ...")  # whole words
                fail(f"cannot load {path}'s tokenizer {meta.get('tokenizer')!r} ({why}); "
                     f"connect once, or set TIKTOKEN_CACHE_DIR to a folder that holds it")
        ids, utf8, n_vocab = enc.encode_ordinary(prompt), enc.decode_single_token_bytes, enc.n_vocab
    stop = None  # --chat: the token that ends the model's turn
    if args.chat:  # the turn's markers are special tokens, the message is text
        if not meta.get("chat"):
            fail(f"{path}'s model has no chat format; drop --chat (a model converted from an "
                 f"Instruct GGUF file has one)")
        head, tail = meta["chat"]["prompt"].split("{message}")
        ids = [*enc.encode(head, allowed_special="all"), *ids,
               *enc.encode(tail, allowed_special="all")]
        stop, prompt = enc.encode_single_token(meta["chat"]["stop"]), ""  # the reply is printed
    if n_vocab != V:
        fail(f"{path} is inconsistent: its tokenizer has {n_vocab} tokens, its model {V}; use an "
             f"untouched checkpoint written by train.py")
    if len(ids) > block_size:
        print(f"sample.py: note: the prompt is {len(ids)} tokens, longer than block_size="
              f"{block_size}; the model sees only its last {block_size}", file=sys.stderr)
    x = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)

    # -- run settings: threads, LEV's fast path (kernels eager: generation meets each id once) --
    if device == "cpu":  # one thread for a small model: on a busy machine, waiting threads stall
        small = sum(p.numel() for p in model.parameters()) < 50_000_000
        torch.set_num_threads(args.threads or (1 if small else torch.get_num_threads()))
    install_fast_paths(model, lev=None if args.plain else FastEmbedder(compile_kernels=False))
    if args.compile:
        model.next_logits = torch.compile(model.next_logits)  # what generation runs

    # -- sample, each token printed as it comes; a sampling rule is a logits hook --
    hook = None if args.repetition_penalty == 1 else repetition_penalty(args.repetition_penalty)
    torch.manual_seed(args.seed)  # every device's generator
    texts, started, counts = [], [], []  # counts: tokens generated per sample
    bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device == "cuda")  # as nanoGPT
    with torch.autocast(device, torch.bfloat16, enabled=bf16):
        for _ in range(args.num_samples):
            started.append(time.perf_counter())
            try:  # GPT.stream checks its settings at the call: before anything is printed
                tokens = model.stream(x, args.max_new_tokens, args.temperature, args.top_k,
                                      args.top_p, not args.no_kv_cache, hook)
            except ValueError as e:
                fail(e)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # cut characters
            text = prompt
            print(prompt, end="")
            counts.append(0)
            for t in tokens:
                counts[-1] += 1
                if int(t) == stop:
                    break
                piece = decoder.decode(utf8(int(t)))
                print(piece, end="", flush=True)  # a person watches the text appear
                text += piece
            rest = decoder.decode(b"", final=True)  # the bytes of a character never completed
            print(f"{rest}\n{SEPARATOR}")
            texts.append(text + rest)
    done, n = time.perf_counter(), sum(counts)
    rate = f"{n} tokens in {done - started[0]:.2f} s = {n / (done - started[0]):.1f} tokens/s"
    if len(started) > 1:  # without the first sample, which also warms up (and compiles)
        rate += f" ({(n - counts[0]) / (done - started[1]):.1f} tokens/s after the first sample)"
    arm = model.config.embedding
    fast = f"none ({arm} arm)" if arm != "lev" else "on" if model.tok_emb.fast_embed else "off"
    print(f"sample.py: {rate}; kv_cache={'off' if args.no_kv_cache else 'on'}, device={device}, "
          f"threads={torch.get_num_threads()}, dtype={'bfloat16' if bf16 else 'float32'}, "
          f"compile={'on' if args.compile else 'off'}, "
          f"fast_paths={fast}", file=sys.stderr)
    return texts


def repetition_penalty(penalty):
    """GPT.stream's logits hook for CTRL's repetition penalty (Keskar et al., 2019): the logit of
    each id already in idx divided by penalty where positive, multiplied where negative."""
    def hook(logits, idx):  # (B, V), (B, T)
        seen = logits.gather(1, idx)
        return logits.scatter(1, idx, torch.where(seen > 0, seen / penalty, seen * penalty))
    return hook


if __name__ == "__main__":
    main()
