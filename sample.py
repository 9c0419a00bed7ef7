"""
Sample text from a trained leviathan model, streamed to the terminal as it is generated.

    python sample.py --out_dir=out-shakespeare-cpu-lev --start="ROMEO:" --num_samples=3
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0  # greedy
    python sample.py --out_dir=out --num_samples=1 --no_kv_cache            # measure the KV cache
    python sample.py --out_dir=out --plain  # the model exactly as leviathan.py writes it

The tokenizer comes from the checkpoint's dataset metadata (a char vocabulary or a tiktoken encoding
name), so a checkpoint samples correctly without repeating how it was trained. Each sample is
printed (prompt first) as its tokens arrive, samples are separated by a dashed line, and one summary
line on stderr gives tokens/s and what was on. Generation is the model's own forward with a KV
cache (leviathan.GPT.stream); --no_kv_cache switches it off so that its effect on speed can be
measured. Defaults follow nanoGPT's sample.py.
"""

import argparse
import math
import os
import sys
import time

import torch

from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from leviathan import GPT, Config
from machinery import checkpoints, cli, dataset, devices

SEPARATOR = "---------------"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows the module docstring as written (with its examples) and every flag's default."""


def fail(message):
    """Bad input: one actionable line on stderr and exit code 2, never a traceback."""
    cli.fail("sample.py", message)


def parse_args(argv):
    p = cli.ArgumentParser(prog="sample.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out_dir", default="out",
                   help="directory holding ckpt.pt (written by train.py)")
    p.add_argument("--start", default="\n",
                   help="prompt text, or FILE:path to read the prompt from a UTF-8 file "
                        "(default: %(default)r)")
    p.add_argument("--num_samples", type=int, default=10,
                   help="number of samples to draw, one after another")
    p.add_argument("--max_new_tokens", type=int, default=500, help="tokens generated per sample")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="1.0 = the model's distribution, < 1 = more conservative, 0 = greedy "
                        "(argmax)")
    p.add_argument("--top_k", type=int, default=200,
                   help="sample only among the k likeliest tokens")
    p.add_argument("--top_p", type=float, default=None,
                   help="nucleus sampling: only among the likeliest tokens whose probability "
                        "reaches p")
    p.add_argument("--seed", type=int, default=1337, help="random seed: same seed, same samples")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto picks cuda, then mps, then cpu")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (slow to start: the first sample pays ~10-40 s "
                        "of compiling)")
    p.add_argument("--no_kv_cache", action="store_true",
                   help="recompute the whole context for every token (to measure the KV cache's "
                        "speed-up)")
    p.add_argument("--plain", action="store_true",
                   help="run the model exactly as leviathan.py writes it, without LEV's fast path "
                        "(machinery/fast_paths.py): slower, the same tokens")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads; 0: one for models under 50M parameters (threads that wait "
                        "for each other collapse decoding on a busy machine), torch's default "
                        "above")
    args = p.parse_args(argv)
    temperature, top_p = args.temperature, args.top_p
    # the same rules GPT.stream enforces, checked up front so that nothing is loaded for a typo
    for ok, message in [
            (math.isfinite(temperature) and temperature >= 0,
             f"--temperature={temperature} must be a finite number >= 0 (0 means greedy)"),
            (args.top_k >= 1, f"--top_k={args.top_k} must be >= 1"),
            (top_p is None or 0 < top_p <= 1, f"--top_p={top_p} must be in (0, 1]; 1 disables it"),
            (args.num_samples >= 1, f"--num_samples={args.num_samples} must be >= 1"),
            (args.max_new_tokens >= 0, f"--max_new_tokens={args.max_new_tokens} must be >= 0"),
            (0 <= args.seed < 2 ** 63, f"--seed={args.seed} must be in [0, 2^63)"),
            (args.threads >= 0, f"--threads={args.threads} must be >= 0 (0: automatic)"),
            (not (args.plain and args.compile),
             "--compile is a fast path, and --plain runs none: drop one of them")]:
        if not ok:
            p.error(message)
    return args


def read_prompt(start):
    """--start is the prompt itself, or FILE:path names a UTF-8 file holding it (as in nanoGPT)."""
    if start.startswith("FILE:"):
        path = start[len("FILE:"):]
        try:
            with open(path, encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read the prompt file --start=FILE:{path} ({type(e).__name__}: {e}); "
                 f"give a readable UTF-8 text file")
    if not start:
        fail("the prompt is empty; give at least one character with --start=TEXT or "
             "--start=FILE:path")
    return start


def load_model(args):
    """The device, the checkpoint's model and its tokenizer (characters or a tiktoken encoding,
    named in the checkpoint)."""
    try:  # no such device; missing, unreadable, edited, diverged: the message says why
        device = devices.resolve_device(args.device)
        if not os.path.isdir(args.out_dir):
            raise ValueError(f"--out_dir={args.out_dir} does not exist; train a model first "
                             f"(python train.py ...) or fix --out_dir")
        return device, *checkpoints.load_model_and_tokenizer(args.out_dir, GPT, Config, device)
    except (OSError, ValueError) as e:
        fail(str(e))


def encode_prompt(prompt, tokenizer, block_size, device):
    """The prompt as the model will see it: (1, T) ids, cut to the last block_size tokens (with a
    note)."""
    try:
        prompt_ids = tokenizer.encode(prompt)
    except ValueError as e:  # e.g. characters a char-level vocabulary lacks (named in the message)
        fail(f"cannot encode the prompt: {e}")
    if len(prompt_ids) > block_size:
        print(f"sample.py: note: the prompt is {len(prompt_ids)} tokens, longer than "
              f"block_size={block_size}; the model sees only its last {block_size}",
              file=sys.stderr)
        prompt_ids = prompt_ids[-block_size:]
    return torch.tensor([prompt_ids], dtype=torch.long, device=device)


def prepare_model(model, args, device):
    """Run settings for generation: threads, LEV's fast path with its kernels eager (they compile
    for training only; generation meets each id once), and with --compile the model through
    torch.compile (LEV's data-dependent lookup, torch.unique, stays eager behind a graph break)."""
    if device == "cpu":
        torch.set_num_threads(args.threads or devices.pick_threads(model.param_report()["total"]))
    if args.plain:
        return
    install_fast_paths(model, lev=FastEmbedder(compile_kernels=False))
    if args.compile:
        model.compile()


def write_sample(model, tokenizer, prompt, x, args):
    """One sample, written to stdout as its tokens arrive; returns its text (prompt included)."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    new_ids = (int(t) for t in model.stream(x, args.max_new_tokens, args.temperature, args.top_k,
                                            args.top_p, use_cache=not args.no_kv_cache))
    pieces = []
    for piece in dataset.stream_text(tokenizer, new_ids):
        sys.stdout.write(piece)
        sys.stdout.flush()  # a person watches the text appear
        pieces.append(piece)
    sys.stdout.write(f"\n{SEPARATOR}\n")
    sys.stdout.flush()
    return prompt + "".join(pieces)


def report_speed(args, model, device, seconds, seconds_after_first):
    """One line a measurement can be read from: tokens, seconds, tokens/s, and what was on."""
    n_tokens = args.num_samples * args.max_new_tokens
    rate = f"{n_tokens} tokens in {seconds:.2f} s = {n_tokens / max(seconds, 1e-9):.1f} tokens/s"
    if args.num_samples > 1:
        rest = (args.num_samples - 1) * args.max_new_tokens
        rate += f" ({rest / max(seconds_after_first, 1e-9):.1f} tokens/s after the first sample)"
    kv_state = "off" if args.no_kv_cache else "on"
    threads = torch.get_num_threads()
    print(f"sample.py: {rate}; {args.num_samples} x {args.max_new_tokens} new tokens, "
          f"kv_cache={kv_state}, device={device}, threads={threads}, "
          f"compile={'on' if args.compile else 'off'}, fast_paths={fast_paths_state(model, args)}",
          file=sys.stderr)


def fast_paths_state(model, args):
    """on, off (--plain, or stepped aside: its check's note says why), or none for the arms
    without LEV (generation has no fast path of its own)."""
    if model.config.embedding != "lev":
        return f"none ({model.config.embedding} arm)"
    if args.plain:
        return "off"
    return "on" if model.tok_emb.fast_embed is not None else "off (see the note above)"


def main(argv=None):
    """Run sample.py with the arguments (sys.argv[1:] when None); return the samples' texts."""
    args = parse_args(argv)
    prompt = read_prompt(args.start)
    device, model, tokenizer = load_model(args)
    x = encode_prompt(prompt, tokenizer, model.config.block_size, device)
    prepare_model(model, args, device)
    torch.manual_seed(args.seed)  # seeds every device's generator
    # bfloat16 autocast on CUDA, as nanoGPT; elsewhere fp32 (sample_next takes fp32 logits anyway)
    texts, t0 = [], time.perf_counter()
    with devices.autocast(device, "bfloat16" if device == "cuda" else "float32"):
        for i in range(args.num_samples):
            if i == 1:
                t1 = time.perf_counter()  # the first sample also pays for warm-up (and compilation)
            texts.append(write_sample(model, tokenizer, prompt, x, args))
    t2 = time.perf_counter()  # int(t) waits for each token, so no device sync is needed
    report_speed(args, model, device, t2 - t0, t2 - t1 if args.num_samples > 1 else None)
    return texts


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C while watching a sample: stop quietly
        sys.exit(130)
    except BrokenPipeError:  # the reader went away (python sample.py | head): stop quietly
        # so that exit's final flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
