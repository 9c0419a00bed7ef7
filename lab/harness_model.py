"""The lm-evaluation-harness adapter: a Leviathan model as lm_eval's LM, scored as eval.py --task.

harness.py registers a subclass of it as the model "leviathan" (one that loads run=DIR) and hands
its flags to lm_eval's own command line (run_cli). Each kind of request, and the plain path it is
tested equal to (tests/test_harness.py; docs/harness.md):

  - loglikelihood(context, continuation): lab/tasks.py's encode_pair (the harness's token
    boundary) and loglikelihoods (the last block_size + 1 tokens, the context cut from the left,
    rows of similar length batched): eval.py --task's figures;
  - loglikelihood_rolling(text): the harness's rolling windows (lm_eval.utils), the first token
    predicted from the end-of-text token, scored by the same loglikelihoods: on a text of whole
    windows, the summed loss of eval.py's evaluate_tokens;
  - generate_until(context, gen_kwargs): GPT.stream with sample.py's settings,
    the prompt cut to its last block_size tokens, greedy or sampled, cut at the first stop string:
    sample.py's tokens.

lm_eval is optional: without it, importing this module raises ModuleNotFoundError (harness.py says
how to install it). This package never imports leviathan.py: a model comes built (model=), or
harness.py's subclass builds a run's.
"""

import glob
import json
import logging
import math
import os
import sys

import torch
import yaml
from lm_eval.api.model import LM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kernels.compiled_lev import CompiledRecipe
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from lab import cli, dataset, devices, tasks

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_BATCH_SIZE = 16  # --batch_size auto: eval.py's default (no search for the largest that fits)
GROUP_BATCHES = 32  # batches scored between two steps of the progress bar
MAX_GEN_TOKS = 256  # the harness's default when a task sets no max_gen_toks
GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}
SUBCOMMANDS = ("run", "ls", "validate")


class AdapterError(ValueError):
    """A run, setting or request the adapter cannot use; the message is one line."""


def pick_device(name):
    """The harness's --device (its default: cuda:0) -> a torch device name. Without CUDA a cuda
    device falls back to auto, as the harness's own hf model does."""
    name = str(name or "auto")
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        log.warning("torch sees no CUDA GPU for --device=%s (the harness's default when none is "
                    "given): the device is chosen as auto", name)
        name = kind = "auto"
    try:
        resolved = devices.resolve_device(kind)
    except ValueError as e:
        raise AdapterError(str(e)) from None
    return name if resolved == kind else resolved  # keeps an index: cuda:1


def pick_dtype(name, device):
    """dtype=auto: float32 off CUDA, bfloat16 autocast on CUDA (float16 where bf16 is unsupported,
    as train.py); float32: eval.py's figures on any device."""
    if name not in DTYPES:
        raise AdapterError(f"dtype={name}; choose {', '.join(DTYPES)}")
    return devices.resolve_dtype(name, torch.device(device).type)


def batch_size_of(value):
    """--batch_size: an integer >= 1, or auto (auto:N): AUTO_BATCH_SIZE."""
    if str(value).startswith("auto"):
        return AUTO_BATCH_SIZE
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise AdapterError(f"--batch_size={value} must be an integer >= 1 or auto")
    return size


def as_bool(value, key):
    """A model_args flag: True/False, or the strings true/false/1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise AdapterError(f"{key}={value} must be true or false")
    return text in ("true", "1")


def cut_at_stops(text, stops):
    """text before the first stop string (the harness's text.split(stop)[0], stop after stop)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


class LeviathanLM(LM):
    """A Leviathan model as an lm_eval LM.

    From the command line: harness.py's subclass, Leviathan(run=DIR, ...), which loads the run's
    checkpoint and tokenizer as sample.py does. From Python:
    LeviathanLM(model=model, tokenizer=tokenizer, ...) with a model already built. model_args:
    run, dtype (DTYPES; pick_dtype), plain (true: no fast path, as eval.py --plain); batch_size and
    device come from the harness's own flags."""

    def __init__(self, run=None, batch_size=1, device=None, dtype="auto", plain=False, model=None,
                 tokenizer=None, max_batch_size=None, **unknown):
        super().__init__()
        if unknown:
            raise AdapterError(f"unknown model_args {', '.join(sorted(unknown))}; the leviathan "
                               f"model takes run, dtype and plain")
        device = pick_device(device)
        self.batch_size = batch_size_of(batch_size)
        self.dtype = pick_dtype(dtype, device)
        self.plain = as_bool(plain, "plain")
        self.run = None if run is None else str(run)
        if model is None:
            if self.run is None:
                raise AdapterError("--model_args needs run=DIR: a run directory holding ckpt.pt "
                                   "(train.py's --out_dir) or a checkpoint file")
            model, tokenizer = self.load(self.run, device)
        self.model = model.to(device).eval()
        if torch.device(device).type == "cpu":  # sample.py's rule: one thread for a small model
            torch.set_num_threads(devices.pick_threads(model.param_report()["total"]))
        self.tokenizer = tokenizer
        self._device = torch.device(device)
        self.block_size = model.config.block_size
        self.eot = tasks.end_of_text(tokenizer)
        self.unencodable = 0  # requests scored -inf: characters a char vocabulary lacks

    def load(self, run, device):
        """The run's model and tokenizer: harness.py's subclass builds them with leviathan.py."""
        raise AdapterError("LeviathanLM(run=...) is harness.py's Leviathan; from Python, pass "
                           "model= and tokenizer=")

    def get_model_info(self):
        """What the harness's results file records about the model."""
        config = self.model.config
        return {"leviathan_run": self.run, "embedding": config.embedding,
                "block_size": config.block_size, "params": self.model.param_report()["total"],
                "dtype": self.dtype, "plain": self.plain}

    def scoring(self):
        """eval.py's run settings (LEV's fast path, or its recipe compiled, unless plain; the plain
        head), under autocast."""
        lev = None if self.plain else [FastEmbedder(), CompiledRecipe()]
        install_fast_paths(self.model, lev=lev)
        return devices.autocast(self._device.type, self.dtype)

    # ----------------------------------------------------------------------------------------------
    # log-likelihoods

    def encode_pair(self, context, continuation):
        """(context ids, continuation ids) as eval.py --task encodes them (tasks.encode_pair); None
        where the tokenizer cannot encode the text (characters a char vocabulary lacks)."""
        if not context.rstrip() and self.eot is None:
            raise AdapterError("a request with an empty context, and this run's tokenizer has no "
                               "end-of-text token to start from (a char-level run); use a BPE run")
        try:
            return tasks.encode_pair(self.tokenizer, context, continuation)
        except tasks.NoContinuationTokens as e:  # refused, as lm_eval's own models refuse it
            raise AdapterError(f"a loglikelihood request: {e}") from None
        except ValueError:
            return None

    def score(self, rows, disable_tqdm=False):
        """rows: (context ids, continuation ids), or None for text that cannot be encoded ->
        [(log-likelihood, is greedy)]: tasks.loglikelihoods' figures, in its batches.

        An empty continuation is certain (0.0, True); text the vocabulary cannot encode is
        impossible (-inf, False): the model never produces a character it lacks. A continuation
        longer than block_size cannot be scored whole, and is refused (eval.py --task skips such
        examples; here every request needs an answer)."""
        T = self.block_size
        out = [(0.0, True) if row is not None else (-math.inf, False) for row in rows]
        todo = [i for i, row in enumerate(rows) if row is not None and row[1]]
        for i in todo:
            if len(rows[i][1]) > T:
                raise AdapterError(f"a continuation of {len(rows[i][1])} tokens does not fit "
                                   f"block_size={T}: it cannot be scored whole")
        # tasks.loglikelihoods orders its rows stably by the length it scores; ordered so first and
        # cut at multiples of batch_size, the groups give the batches of a single call
        todo.sort(key=lambda i: min(len(rows[i][0]) + len(rows[i][1]), T + 1))
        group = self.batch_size * GROUP_BATCHES
        with self.scoring(), tqdm(total=len(todo), desc="Scoring", disable=disable_tqdm) as bar:
            for start in range(0, len(todo), group):
                part = todo[start:start + group]
                ll, greedy = tasks.loglikelihoods(self.model, [rows[i] for i in part],
                                                  self.batch_size, self._device)
                for i, row_ll, row_greedy in zip(part, ll, greedy, strict=True):
                    out[i] = (float(row_ll), bool(row_greedy))
                bar.update(len(part))
        unencodable = rows.count(None)
        if unencodable:
            self.unencodable += unencodable
            log.warning("%d requests hold characters this run's vocabulary lacks: scored -inf "
                        "(eval.py --task skips such examples)", unencodable)
        return out

    def loglikelihood(self, requests, disable_tqdm=False):
        results = self.score([self.encode_pair(*req.args) for req in requests], disable_tqdm)
        for req, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text's log-likelihood, every token predicted once: the harness's rolling windows of
        block_size predictions, the first from the end-of-text token, the last with a full
        context."""
        if self.eot is None:
            raise AdapterError("loglikelihood_rolling (perplexity tasks) predicts a text's first "
                               "token from the end-of-text token, which this run's tokenizer lacks "
                               "(a char-level run); use a BPE run")
        windows, owners = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            try:
                ids = self.tokenizer.encode(text)
            except ValueError:  # characters a char vocabulary lacks
                windows.append(None)
                owners.append(n)
                continue
            for window in get_rolling_token_windows(ids, self.eot, self.block_size, 1):
                windows.append(make_disjoint_window(window))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owners, self.score(windows, disable_tqdm), strict=True):
            totals[n] += ll  # in window order, as the harness sums them
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ----------------------------------------------------------------------------------------------
    # generation

    def generation_settings(self, gen_kwargs):
        """A request's gen_kwargs, normalised as the harness does -> generate's keyword arguments.
        Greedy unless do_sample (temperature 1 unless given); the end-of-text text stops too."""
        kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=MAX_GEN_TOKS)
        until, max_toks = kwargs["until"], kwargs["max_gen_toks"]
        if not (isinstance(until, str)
                or isinstance(until, list | tuple) and all(isinstance(u, str) for u in until)):
            raise AdapterError(f"generation settings: until={until!r} must be a string or a list "
                               f"of strings (the task's generation_kwargs)")
        if isinstance(max_toks, bool) or not isinstance(max_toks, int) or max_toks < 0:
            raise AdapterError(f"generation settings: max_gen_toks={max_toks!r} must be a whole "
                               f"number >= 0 (the task's generation_kwargs)")
        ignored = sorted(set(kwargs) - GEN_KWARGS)
        if ignored:
            log.warning("generation settings the leviathan model ignores: %s", ", ".join(ignored))
        eos = None if self.eot is None else self.tokenizer.decode([self.eot])
        temperature = float(kwargs.get("temperature", 1.0)) if kwargs["do_sample"] else 0.0
        return {"stops": handle_stop_sequences(kwargs["until"], eos),
                "max_new_tokens": kwargs["max_gen_toks"], "temperature": temperature,
                "top_k": kwargs.get("top_k") or None, "top_p": kwargs.get("top_p")}

    def generate(self, context, stops, max_new_tokens, temperature=0.0, top_k=None, top_p=None):
        """One continuation of context: sample.py's tokens (the prompt cut to its last block_size
        tokens, GPT.stream with the KV cache), decoded as they come and cut at the first stop
        string; generation ends as soon as one appears."""
        try:
            ids = self.tokenizer.encode(context)
        except ValueError as e:  # characters a char vocabulary lacks
            raise AdapterError(f"cannot encode a generation prompt: {e}") from None
        if not ids:
            if self.eot is None:
                raise AdapterError("an empty generation prompt, and this run's tokenizer has no "
                                   "end-of-text token to start from (a char-level run)")
            ids = [self.eot]
        x = torch.tensor([ids[-self.block_size:]], dtype=torch.long, device=self._device)
        try:
            new_ids = self.model.stream(x, max_new_tokens, temperature, top_k, top_p)
        except ValueError as e:  # a temperature, top_k or top_p out of range
            raise AdapterError(f"generation settings: {e}") from None
        text = ""
        for piece in dataset.stream_text(self.tokenizer, (int(t) for t in new_ids)):
            text += piece
            if any(stop and stop in text for stop in stops):
                break
        return cut_at_stops(text, stops)

    def generate_until(self, requests, disable_tqdm=False):
        """One request at a time (prompts of different lengths do not share a KV cache)."""
        results = []
        with self.scoring():
            for req in tqdm(requests, desc="Generating", disable=disable_tqdm):
                context, gen_kwargs = req.args
                text = self.generate(context, **self.generation_settings(gen_kwargs))
                self.cache_hook.add_partial("generate_until", req.args, text)
                results.append(text)
        return results


def flag_values(argv, flag):
    """The values given to a flag of the harness's command line (--flag v or --flag=v)."""
    values = []
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


class TaskConfigLoader(yaml.SafeLoader):
    """YAML as the harness reads its task configs: its !function tags are names, not loaded."""


TaskConfigLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def check_task_configs(argv):
    """Before the harness starts: every YAML file under --include_path parses (the harness would
    only say "Tasks not found"), and the local JSON data files of the tasks asked for hold one JSON
    object per line (the datasets library would fail with a traceback). AdapterError: the file,
    the line and what is wrong."""
    asked = {name for value in flag_values(argv, "--tasks") for name in value.split(",")}
    for folder in flag_values(argv, "--include_path"):
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.yaml"), recursive=True)):
            try:
                with open(path, encoding="utf-8") as f:
                    config = yaml.load(f, Loader=TaskConfigLoader)
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
                raise AdapterError(f"{path} is not a readable task config "
                                   f"({cli.one_line(e)[:200]}); fix it, or move it out of "
                                   f"--include_path") from None
            if isinstance(config, dict) and asked & config_names(config):
                check_json_data(path, config)


def config_names(config):
    """The names a task config answers to: its task and its tags (a name or a list of names)."""
    names = set()
    for value in (config.get("task"), config.get("tag")):
        values = value if isinstance(value, list) else [value]
        names |= {v for v in values if isinstance(v, str)}
    return names


def check_json_data(config_path, config):
    """The local files of a `dataset_path: json` task: one JSON object per line."""
    if config.get("dataset_path") != "json":
        return
    files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
    for listed in files.values() if isinstance(files, dict) else [files]:
        for path in [listed] if isinstance(listed, str) else listed:
            if not isinstance(path, str) or not os.path.isfile(path):
                continue  # the harness says what is missing
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    try:
                        if line.strip() and not isinstance(json.loads(line), dict):
                            raise ValueError("not a JSON object")
                    except (ValueError, RecursionError) as e:
                        raise AdapterError(f"{path}:{n} (a data file of {config_path}) is not a "
                                           f"JSON object on one line ({cli.one_line(e)[:100]}); "
                                           f"fix that line") from None


def run_cli(argv, prog):
    """lm_eval's own command line (lm-eval run ...) on argv, with --model leviathan unless argv
    names a model: its flags, its tables, its output files."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(argv)
    check_task_configs(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        argv = ["run", *argv]
    if argv[0] == "run" and not {"--model", "-M"} & {a.split("=")[0] for a in argv}:
        argv[1:1] = ["--model", "leviathan"]
    saved = sys.argv
    sys.argv = [prog, *argv]  # the harness's parser reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
