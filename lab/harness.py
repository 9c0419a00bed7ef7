r"""
Any lm-evaluation-harness task on a Leviathan run: lm_eval's own command line, with this project's
model registered as "leviathan" (lab/harness_model.py; docs/harness.md).

    python lab/harness.py --model_args run=out-lev --include_path tasks \
        --tasks local_hellaswag,local_arc --batch_size 16 --device cpu
    python lab/harness.py --model_args run=out-lev --tasks hellaswag --num_fewshot 5 \
        --output_path results/   # a task of the harness's own, its data from the Hugging Face Hub

Every flag is lm_eval's (the list follows); --model defaults to leviathan. --model_args: run=DIR
(a run directory holding ckpt.pt, or a checkpoint file), dtype=auto|float32|bfloat16|float16 (auto:
float32 off CUDA, bfloat16 autocast on CUDA as train.py; float32 gives eval.py --task's figures on
any device), plain=true (no fast path, as eval.py --plain). --batch_size: rows per forward pass
(auto: 16, eval.py's default). tasks/ holds task configs that read local files in the published
formats eval.py --task reads, prompted as the harness's own tasks are. Needs lm_eval (tested with
0.4.13, the release harness.py asks for when an import fails).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as lab/x.py

from lab import checkpoints, cli

TESTED = "0.4.13"  # the lm_eval release the adapter is tested with

try:  # lm_eval is optional; imported first, so that without it the error names lm_eval (not
    # PyYAML, one of the adapter's imports that only lm_eval brings)
    import lm_eval  # noqa: F401
    from lm_eval.api.registry import register_model

    from lab import harness_model as harness
    cannot_import = None
except ImportError as e:
    cannot_import = e
else:
    @register_model("leviathan")
    class Leviathan(harness.LeviathanLM):
        """The adapter, registered as lm_eval's model "leviathan": run=DIR is built with
        leviathan.py's classes, as sample.py builds it."""

        def load(self, run, device):
            try:
                return checkpoints.load_model_and_tokenizer(run, device)
            except (OSError, ValueError) as e:
                raise harness.AdapterError(str(e)) from None


def why_not_importable(e):
    """What to do when the adapter cannot be imported, in one line."""
    if isinstance(e, ModuleNotFoundError):
        if e.name and e.name.split(".")[0] == "lm_eval":
            return (f"needs lm-evaluation-harness: pip install lm_eval (tested with lm_eval "
                    f"{TESTED})")
        return f"lm_eval cannot be imported without {e.name!r}; reinstall it: pip install lm_eval"
    # an lm_eval release without a helper the adapter uses
    return (f"this lm_eval lacks what the adapter uses ({cli.one_line(e)}); install the release it "
            f"is tested with: pip install lm_eval=={TESTED}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if cannot_import is not None and argv in ([], ["-h"], ["--help"]):  # the help, then what to do
        print(__doc__.strip() + f"\n\nlm_eval's flags are listed once it can be imported: "
              f"{why_not_importable(cannot_import)}")
        return 0
    if cannot_import is not None:
        cli.fail("harness.py", why_not_importable(cannot_import))
    if not argv or argv in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n")
        argv = ["run", "--help"]
    try:
        harness.run_cli(argv, prog="harness.py")
    except FileNotFoundError as e:  # a task's data file
        cli.fail("harness.py", f"{e}; the data_files of a task config are read from the working "
                               f"directory (tasks/'s: from the repository's root)")
    except ValueError as e:  # the adapter's (AdapterError) and lm_eval's: tasks not found, ...
        cli.fail("harness.py", str(e))
    except Exception as e:  # the datasets library reading a task's data: its error, in one line
        if type(e).__module__.split(".")[0] not in ("datasets", "pyarrow"):
            raise
        cause = e.__cause__ or e
        cli.fail("harness.py", f"a task's data could not be read ({type(cause).__name__}: "
                               f"{cli.one_line(cause)[:200]}); check its data_files")


if __name__ == "__main__":
    main()
