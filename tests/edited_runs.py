"""Run train.py, sample.py and eval.py of a copy of the project whose leviathan.py was edited, each
with its defaults and with the plain path, in one process (importing torch is the slow part); print
what they computed as one JSON line. tests/test_edits.py runs it.

    python edited_runs.py DATA_DIR ARM      (in the copy's folder)
"""

import json
import os
import sys

sys.path.insert(0, os.getcwd())  # the copy's leviathan.py, scripts, kernels/ and lab/

import torch  # noqa: E402

import sample  # noqa: E402
import train  # noqa: E402
from lab import eval as evaluate  # noqa: E402

MODEL = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=24", "--lev_seed_dim=16",
         "--lev_heads=2", "--lev_rank=8", "--lev_knots=6"]
RUN = ["--batch_size=4", "--max_iters=4", "--eval_interval=2", "--eval_iters=2", "--log_interval=1",
       "--warmup_iters=1", "--learning_rate=1e-2", "--device=cpu"]
PLAIN = {"train": ["--lev_fast=False", "--lean_head=False"], "sample": ["--plain"],
         "eval": ["--plain"]}
DEFAULT = {"train": ["--lev_compile=False"], "sample": [], "eval": []}  # no compiling in tests


def main(data_dir, arm):
    torch.set_num_threads(1)
    data = [f"--data_dir={data_dir}", "--dataset=tiny_char"]
    results = {}
    for way in ("default", "plain"):
        flags = PLAIN if way == "plain" else DEFAULT
        out = f"out-{way}"
        print(f"== {way}: train.py", file=sys.stderr, flush=True)
        code = train.main([*data, f"--out_dir={out}", f"--embedding={arm}", *MODEL, *RUN,
                           *flags["train"]])
        assert code == 0, f"train.py exited with {code}"
        with open(os.path.join(out, "log.jsonl"), encoding="utf-8") as f:
            log = [json.loads(line) for line in f]
        # sampled and evaluated from one checkpoint, so that only their own paths differ
        print(f"== {way}: sample.py", file=sys.stderr, flush=True)
        texts = sample.main(["--out_dir=out-default", "--start=The ", "--num_samples=1",
                             "--max_new_tokens=30", "--temperature=0", "--device=cpu",
                             *flags["sample"]])
        print(f"== {way}: eval.py", file=sys.stderr, flush=True)
        evaluate.main(["out-default", *data, "--lambada_max=0", "--device=cpu",
                       f"--json={way}.json", *flags["eval"]])
        with open(f"{way}.json", encoding="utf-8") as f:
            figures = json.load(f)
        results[way] = {"val_losses": [r["val_loss"] for r in log], "text": texts[0],
                        "eval_val_loss": figures["arms"][0]["val_loss"]}
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
