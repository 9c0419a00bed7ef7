"""
LEV against its baselines across model widths: one command trains the grid, resumes where it
stopped, scores every run with lab/eval.py and writes a table and a figure.

    python lab/grid.py                                  # the grid of docs/results.md, 2 at a time
    python lab/grid.py --jobs=1 --widths=64,128         # fewer widths, one run at a time
    python lab/grid.py --report                         # score what has finished, write the table
    python lab/grid.py --widths=32,64 --seeds=1 --rare_seeds=1 --max_iters=10 --long_iters=0 \
        --eval_points=2 --out=grid-toy                  # a toy grid: 10 short runs

The default grid is 42 runs of 250 steps, then 4 long runs of 500: about 5.5 hours on 2 CPU cores.
Ctrl-C stops it: the runs it was training save their last step, and the same command resumes.

The grid: n_embd in --widths, config/shakespeare_cpu.py's 4 layers and heads of --head_size at
every width; arms tied, untied and lev, and digits and factorized at the two smallest widths;
--seeds seeds per (width, arm), --rare_seeds at n_embd=128. Every run trains --max_iters steps
of the config's 16 x 128 tokens (the same tokens, batches and dropout for every arm and width),
evaluating at step 0 and --eval_points times after on a few val windows for its curve. Then the
long runs: tied and lev, 2 seeds, --long_iters steps, at the width where LEV's gap to tied is
least in its favour (or --long_width).

A run is a folder under --out (w128-lev-s0, w384-lev-long-s0): one whose ckpt.pt is at its last
step is not trained again, a killed one resumes from its last ckpt.pt (train.py --init_from=resume),
one stopped before its first save starts again; train.py's output goes to its train.log. Each
(width, seed) is scored with lab/eval.py on the whole val split (scores/w128-s0.json, made again
when a run of it is newer); grid.md holds the table, grid.png the figure (with matplotlib).
"""

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from lab import cli  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPACT = ("digits", "factorized")  # at the two smallest widths only
RARE = ("unseen", "1-10", "11-100")  # lab/eval.py's buckets of targets seen <= 100 times


def parse_args(argv):
    p = cli.ArgumentParser(prog="grid.py", description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--out", default="grid", help="folder of the runs, scores, grid.md, grid.png")
    p.add_argument("--data_dir", default="data", help="folder of the prepared datasets")
    p.add_argument("--dataset", default="shakespeare", help="the dataset every run trains on")
    p.add_argument("--config", default="config/shakespeare_cpu.py", help="train.py's config")
    p.add_argument("--widths", default="64,128,256,384", help="n_embd values, comma-separated")
    p.add_argument("--head_size", type=int, default=32, help="n_head = n_embd / head_size")
    p.add_argument("--seeds", type=int, default=2, help="seeds per width and arm")
    p.add_argument("--rare_seeds", type=int, default=4, help="seeds at n_embd=128")
    p.add_argument("--max_iters", type=int, default=250, help="training steps of every run")
    p.add_argument("--long_iters", type=int, default=500, help="steps of the long runs; 0: none")
    p.add_argument("--long_width", type=int, default=0, help="their width; 0: LEV's worst")
    p.add_argument("--eval_points", type=int, default=5,
                   help="evaluations per run after step 0's (its curve)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once")
    p.add_argument("--report", action="store_true", help="train nothing: score and write")
    p.add_argument("--train_flags", default="", help="more train.py flags, space-separated")
    args = p.parse_args(argv)
    try:
        args.widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths={args.widths}: give integers, comma-separated")
    if args.head_size < 2 or args.head_size % 2:
        p.error(f"--head_size={args.head_size} must be even (rotary positions rotate pairs)")
    bad = [w for w in args.widths if w < 1 or w % args.head_size]
    if bad:
        p.error(f"--widths: {bad[0]} is not a positive multiple of --head_size={args.head_size}")
    for flag in ("seeds", "rare_seeds", "max_iters", "eval_points", "jobs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}={getattr(args, flag)} must be at least 1")
    if args.long_iters < 0 or args.long_width < 0:
        p.error("--long_iters and --long_width must be >= 0")
    if not os.path.isfile(os.path.join(args.data_dir, args.dataset, "meta.json")):
        p.error(f"no prepared dataset {args.dataset} in {args.data_dir}; prepare it: python "
                f"prepare_data.py {args.dataset}")
    return args


# --------------------------------------------------------------------------------------------------
# The runs


def grid_runs(args):
    """The main grid: (width, arm, seed, folder name) for every run."""
    small = sorted(args.widths)[:2]
    runs = []
    for w in args.widths:
        arms = ["tied", "untied", "lev"] + (list(COMPACT) if w in small else [])
        for seed in range(args.rare_seeds if w == 128 else args.seeds):
            runs += [(w, arm, seed, f"w{w}-{arm}-s{seed}") for arm in arms]
    return runs


def long_runs(args, width):
    return [(width, arm, seed, f"w{width}-{arm}-long-s{seed}") for seed in range(2)
            for arm in ("tied", "lev")]


def last_step(folder, iters=None):
    """The step of a run's checkpoint, None where it has none. iters: the run's length, which a
    checkpoint of another length refuses (a grid of other --max_iters in the same --out)."""
    path = os.path.join(folder, "ckpt.pt")
    if not os.path.isfile(path):
        return None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    trained_for = ckpt["train_config"]["max_iters"]
    if iters is not None and trained_for != iters:
        raise ValueError(f"{folder} is a run of {trained_for} steps, not {iters}; give another "
                         f"--out or the same steps")
    return ckpt["step"]


def train_command(args, width, arm, seed, folder, iters):
    resume = ["--init_from=resume"] if last_step(folder) is not None else []
    return [sys.executable, "train.py", args.config, f"--data_dir={args.data_dir}",
            f"--dataset={args.dataset}", f"--out_dir={folder}", f"--embedding={arm}",
            f"--n_embd={width}", f"--n_head={width // args.head_size}", f"--seed={seed}",
            f"--max_iters={iters}", f"--lr_decay_iters={iters}",
            f"--eval_interval={max(1, iters // args.eval_points)}", "--eval_iters=4",
            *args.train_flags.split(), *resume]


def train_all(args, runs, iters):
    """Train every run not yet finished, args.jobs at a time -> the names of those that failed."""
    todo = [r for r in runs if last_step(os.path.join(args.out, r[3]), iters) != iters]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs done; training {len(todo)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.jobs))}
    running, failed = {}, []
    try:
        return run_all(args, todo, iters, env, running, failed)
    except KeyboardInterrupt:  # the runs got Ctrl-C too: they finish their step and save
        for process, log, _ in running.values():
            with contextlib.suppress(KeyboardInterrupt):
                process.wait()
            log.close()
        raise


def run_all(args, todo, iters, env, running, failed):
    """train_all's loop: start runs as slots free up, collect them as they end."""
    while todo or running:
        while todo and len(running) < args.jobs:
            width, arm, seed, name = todo.pop(0)
            folder = os.path.abspath(os.path.join(args.out, name))
            os.makedirs(folder, exist_ok=True)
            log = open(os.path.join(folder, "train.log"), "a", encoding="utf-8")
            command = train_command(args, width, arm, seed, folder, iters)
            running[name] = (subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env=env),
                             log, time.time())
        time.sleep(0.5)
        for name, (process, log, started) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            del running[name]
            minutes = (time.time() - started) / 60
            if process.returncode:
                failed.append(name)
                print(f"{name}: failed (exit {process.returncode}); see its train.log", flush=True)
            else:
                print(f"{name}: done in {minutes:.1f} min", flush=True)
    return failed


# --------------------------------------------------------------------------------------------------
# Scores: lab/eval.py per (width, seed), then the table and the figure


def score(args, runs):
    """lab/eval.py on each (width, seed) group whose runs all finished, tied first -> {(width,
    seed, long): its JSON}."""
    groups = {}
    for width, _, seed, name in runs:
        groups.setdefault((width, seed, "long" in name), []).append(os.path.join(args.out, name))
    scores = {}
    for (width, seed, long), dirs in groups.items():
        iters = args.long_iters if long else args.max_iters
        if any(last_step(d, iters) != iters for d in dirs):
            continue  # not trained to the end (yet, or it failed)
        path = os.path.join(args.out, "scores", f"w{width}{'-long' * long}-s{seed}.json")
        newest = max(os.path.getmtime(os.path.join(d, "ckpt.pt")) for d in dirs)
        if not os.path.isfile(path) or os.path.getmtime(path) < newest:
            command = [sys.executable, "lab/eval.py", *map(os.path.abspath, dirs),
                       f"--data_dir={os.path.abspath(args.data_dir)}", f"--dataset={args.dataset}",
                       "--lambada_max=0", f"--json={os.path.abspath(path)}"]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                raise ValueError(f"lab/eval.py failed on {dirs[0]} ...: "
                                 f"{(done.stderr.strip().splitlines() or [''])[-1]}")
        with open(path, encoding="utf-8") as f:
            scores[width, seed, long] = json.load(f)
    return scores


def figures(scores):
    """{(width, arm, long): {"loss": [...], "gap": [...], "rare_gap": [...], "fewer": [...],
    "params": n}} over the seeds: gap = the perplexity against tied's of the same seed, in %."""
    cells = {}
    for (width, _, long), s in sorted(scores.items()):
        tied = s["arms"][0]
        for arm in s["arms"]:
            cell = cells.setdefault((width, arm["embedding"], long), {
                "loss": [], "gap": [], "rare_gap": [], "fewer": [], "overfit": [], "minutes": [],
                "params": arm["params"]["total"], "tokens": arm["tokens_seen"]})
            cell["loss"].append(arm["val_loss"])
            overfit, minutes = last_evaluation(arm["dir"])
            cell["overfit"].append(overfit)
            cell["minutes"].append(minutes)
            cell["gap"].append(100 * math.expm1(arm["val_loss"] - tied["val_loss"]))
            cell["rare_gap"].append(100 * math.expm1(rare_loss(arm) - rare_loss(tied)))
            cell["fewer"].append(arm["token_efficiency"]["fewer_tokens"])
    return cells


def last_evaluation(folder):
    """A run's log at its last evaluation -> (val loss - train loss, on as many windows of each
    split: how far it has begun to fit its training text rather than the language; the minutes
    it trained, its resumes added up)."""
    with open(os.path.join(folder, "log.jsonl"), encoding="utf-8") as f:
        last = [r for r in map(json.loads, f) if r.get("val_loss") is not None][-1]
    return last["val_loss"] - last["train_loss"], last["elapsed_s"] / 60


def rare_loss(arm):
    """The mean loss over the val targets seen at most 100 times in training."""
    parts = [(b["tokens"], b["loss"]) for b in arm["buckets"]
             if b["bucket"] in RARE and b["tokens"]]
    return sum(n * loss for n, loss in parts) / sum(n for n, _ in parts)


def spread(values, spec=".2f"):
    """mean [min, max] of the seeds' values, or - where unknown."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.fmean(values):{spec}} [{min(values):{spec}}, {max(values):{spec}}]"


def table(cells):
    lines = ["| n_embd | arm | params | tokens/param | seeds | val loss | ppl vs tied (%) | "
             "rare-token ppl vs tied (%) | tokens to tied's loss, x fewer | val - train loss | "
             "minutes |",
             "|---:|---|---:|---:|---:|---|---|---|---|---|---|"]
    for (width, arm, long), c in cells.items():
        lines.append(f"| {width}{' long' * long} | {arm} | {c['params']:,} | "
                     f"{c['tokens'] / c['params']:.3f} | {len(c['loss'])} | "
                     f"{spread(c['loss'], '.4f')} | {spread(c['gap'])} | "
                     f"{spread(c['rare_gap'])} | {spread(c['fewer'])} | "
                     f"{spread(c['overfit'], '.3f')} | {spread(c['minutes'], '.1f')} |")
    return "\n".join(lines) + "\n"


def plot(cells, path):
    """The perplexity gap to tied against width, one line per arm (its mean), each seed a point;
    the long runs' seeds as crosses (their gap is to the long tied runs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no figure: pip install matplotlib", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in sorted({a for _, a, _ in cells} - {"tied"}):
        mine = sorted((w, c) for (w, a, long), c in cells.items() if a == arm and not long)
        line = ax.plot([w for w, _ in mine], [statistics.fmean(c["gap"]) for _, c in mine],
                       marker="o", label=arm)[0]
        for w, c in mine:
            ax.scatter([w] * len(c["gap"]), c["gap"], color=line.get_color(), s=12, alpha=0.5)
        for (w, a, long), c in cells.items():
            if a == arm and long:
                ax.scatter([w] * len(c["gap"]), c["gap"], color=line.get_color(), marker="x",
                           label=f"{arm}, long runs (each seed)")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("n_embd")
    ax.set_ylabel("val perplexity against tied (%)")
    ax.set_title("Tiny Shakespeare: the gap to the tied baseline (line: mean; dots: seeds)")
    ax.legend()
    cli.save_figure(fig, path)
    return True


def worst_width(cells):
    """The width where LEV's mean perplexity gap to tied is largest (least in its favour)."""
    return max((statistics.fmean(c["gap"]), w) for (w, arm, long), c in cells.items()
               if arm == "lev" and not long)[1]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cli.check_output_dir(args.out, "--out")
        runs, failed = grid_runs(args), []
        if not args.report:
            failed = train_all(args, runs, args.max_iters)
        cells = figures(score(args, runs))
        width = args.long_width or (worst_width(cells) if cells and not failed else None)
        if args.long_iters and width:
            runs += long_runs(args, width)
            if not args.report:
                failed += train_all(args, long_runs(args, width), args.long_iters)
            cells = figures(score(args, runs))
    except ValueError as e:
        cli.fail("grid.py", str(e))
    except KeyboardInterrupt:
        print(f"grid.py: stopped (Ctrl-C); the runs in {args.out} saved their last step, and the "
              f"same command resumes", file=sys.stderr)
        return 130
    cli.write_atomic(os.path.join(args.out, "grid.md"), table(cells).encode())
    drawn = plot(cells, os.path.join(args.out, "grid.png"))
    print(table(cells) + f"\nwrote {os.path.join(args.out, 'grid.md')}"
          + (f" and {os.path.join(args.out, 'grid.png')}" if drawn else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
