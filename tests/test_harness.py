"""Tests of harness.py and lab/harness_model.py: lm-evaluation-harness's scores of a Leviathan run
equal eval.py --task's (lab/tasks.py), example by example.

Local files in five published formats are written here and read through tasks/'s own configs (their
data_files pointed at these files): the prompts, log-likelihoods, acc, acc_norm and perplexity that
the harness computes through the adapter (lm_eval.simple_evaluate) are lab.tasks' on the same
files; loglikelihood_rolling is eval.py's whole-text loss; generate_until gives sample.py's tokens.
Skipped without lm_eval (an optional dependency); hermetic: tiny random models, tokenizers built
in-process, the Hugging Face libraries offline."""

import glob
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

import sample
from kernels.fast_lev import FastEmbedder
from kernels.fast_paths import install_fast_paths
from lab import eval as ev
from lab import tasks
from lab.checkpoints import CHECKPOINT_VERSION, load_checkpoint
from lab.dataset import CharTokenizer, TiktokenTokenizer
from leviathan import GPT, Config

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 24  # shorter than most contexts here: they are cut from the left

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def lm_eval():
    # nothing here needs the Hugging Face Hub; read when the datasets library is first imported
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("lm_eval")


def write_jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# --------------------------------------------------------------------------------------------------
# the task files, in the published formats, and tasks/'s configs pointed at them

FILES = {
    "hellaswag": [
        {"activity_label": "Making tea", "ctx_a": "A man fills a kettle and sets it on the stove.",
         "ctx_b": "he", "label": 0, "endings": ["waits for it.", "eats [title] the stove.",
                                                "sings to it.", "runs away."]},
        {"activity_label": "Home and Garden", "label": "1", "ctx_b": "",
         "ctx_a": "[header] How to water a plant [title] Check the soil.",
         "endings": ["[step] Bury it.", "[step] Pour  water.", "Freeze it."]},
        {"activity_label": "Cycling", "ctx_a": "A girl climbs onto her bicycle.", "ctx_b": "then",
         "label": 2, "endings": ["she naps.", "it sings.", "she pedals off."]}],
    "arc": [
        {"id": "a", "question": {"stem": "Which of these does a plant need to make food?",
                                 "choices": [{"text": "sunlight", "label": "A"},
                                             {"text": "sand", "label": "B"},
                                             {"text": "smoke", "label": "C"}]},
         "answerKey": "A"},
        {"id": "b", "question": {"stem": "What gives the Moon its light?",
                                 "choices": [{"text": "its own fire", "label": "1"},
                                             {"text": "the Sun", "label": "2"}]},
         "answerKey": "2"}],
    "winogrande": [
        {"sentence": "The trophy does not fit into the brown suitcase because the _ is too large.",
         "option1": "trophy", "option2": "suitcase", "answer": "1"},
        {"sentence": "Sarah lent Maria her umbrella because _ was going out in the rain.",
         "option1": "Sarah", "option2": "Maria", "answer": "2"}],
    "piqa": [
        {"goal": "To keep bread fresh for longer,", "sol1": "seal it in a bag.",
         "sol2": "leave it open.", "label": 0},
        {"goal": "How do you light a candle?", "sol1": "Pour water on it.",
         "sol2": "Use a match.", "label": 1}],
    "lambada": [
        {"text": "She took the key from her pocket, put it in the lock and turned it. The old "
                 "door creaked open and behind the door"},
        {"text": "The king called for his horse, and the servants ran to fetch the horse"}],
}


def plain_text(n_tokens, seed):
    """A text of exactly n_tokens tokens of the test encoding (characters that no merge joins)."""
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("bcdfgkmopqrsuvwxyz.,;\n"), n_tokens))


# loglikelihood_rolling: whole windows, a text shorter than a window, and windows plus a remainder
TEXT_TOKENS = (2 * BLOCK, BLOCK - 5, 2 * BLOCK + 7)
TEXTS = [{"text": plain_text(n, seed)} for seed, n in enumerate(TEXT_TOKENS)]


def task_dir(root, files):
    """tasks/'s configs and preprocess.py, copied into root with each data_files line pointed at
    files[format] and the datasets cache in root -> root."""
    root.mkdir()
    (root / "preprocess.py").write_text((ROOT / "tasks" / "preprocess.py").read_text())
    for config in sorted((ROOT / "tasks").glob("local_*.yaml")):
        name = config.stem.removeprefix("local_")
        text = config.read_text()
        text, found = re.subn(r"(\n    test: ).*\n", rf"\g<1>{files[name]}\n"
                                                     rf"  cache_dir: {root / 'cache'}\n", text)
        assert found == 1, config
        (root / config.name).write_text(text)
    return root


def encoding():
    """A byte-level encoding with a few merges and an end-of-text token, built in-process."""
    ranks = {bytes([i]): i for i in range(256)}
    merges = [b" t", b"he", b" the", b"in", b" a", b"ing"]
    ranks.update({m: 256 + i for i, m in enumerate(merges)})
    return tiktoken.Encoding(name="test", pat_str=r"""'s|'t| ?\w+| ?[^\s\w]+|\s+""",
                             mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 256 + len(merges)})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The task files in the five formats and a text file, tasks/'s configs for them, a tiny
    random lev model and its BPE tokenizer -> (folder, files, configs, model, tokenizer)."""
    root = tmp_path_factory.mktemp("harness")
    files = {name: write_jsonl(root / f"{name}.jsonl", rows) for name, rows in FILES.items()}
    files["text"] = write_jsonl(root / "text.jsonl", TEXTS)
    tokenizer = TiktokenTokenizer(encoding())
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, n_head=2,
                       n_embd=32, embedding="lev", lev_seed_dim=16, lev_heads=2, lev_rank=8))
    return root, files, task_dir(root / "tasks", files), model.eval(), tokenizer


def manager(configs):
    """The harness's tasks: those of the folder configs only (not its own thousands)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(configs), include_defaults=False)


def evaluate(lm_eval, lm, configs, names):
    """simple_evaluate on the tasks names of the folder configs, samples logged."""
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager(configs),
                                   log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def harness_results(lm_eval, world):
    """The adapter on every task of the world, through the harness -> (results, the adapter)."""
    from lab.harness_model import LeviathanLM

    _, files, configs, model, tokenizer = world
    lm = LeviathanLM(model=model, tokenizer=tokenizer, batch_size=4, device="cpu")
    names = [f"local_{name}" for name in files]
    return evaluate(lm_eval, lm, configs, names), lm


# --------------------------------------------------------------------------------------------------
# the harness's figures, example by example, are eval.py --task's


@pytest.mark.parametrize("name", list(FILES))
def test_every_example_scores_as_eval_py_task(harness_results, world, name):
    results, _ = harness_results
    _, files, _, model, tokenizer = world
    # eval.py's run settings and its scoring (load_runs, load_text_tasks, evaluate_run)
    install_fast_paths(model, lev=FastEmbedder())
    [task] = tasks.load_tasks([(name, files[name])], tokenizer, 0, BLOCK)
    examples = list(tasks.LOADERS[name](files[name]))
    assert task["skipped"] == 0 and len(task["examples"]) == len(examples) == len(FILES[name])
    rows = [row for rows, _, _ in task["examples"] for row in rows]
    assert any(len(c) + len(w) > BLOCK + 1 for c, w in rows)  # some contexts are cut
    ll, greedy = tasks.loglikelihoods(model, rows, 4, "cpu")
    samples = sorted(results["samples"][f"local_{name}"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(examples)))
    start = 0
    for logged, example, (ex_rows, label, lengths) in zip(samples, examples, task["examples"],
                                                          strict=True):
        # the same (context, continuation) strings, hence the same tokens
        assert [tuple(a) for a in logged["arguments"]] == example.pairs
        scored = slice(start, start + len(ex_rows))
        start += len(ex_rows)
        assert [r[0] for r in logged["filtered_resps"]] == pytest.approx(ll[scored], abs=1e-5)
        assert [bool(r[1]) for r in logged["filtered_resps"]] == list(greedy[scored])
        if name == "lambada":
            assert logged["acc"] == int(greedy[scored][0])
            continue
        assert logged["acc"] == float(np.argmax(ll[scored]) == label)
        if lengths is not None:
            assert logged["acc_norm"] == float(np.argmax(ll[scored] / np.array(lengths)) == label)
    # and the task's figures, as eval.py's table reports them
    scores = tasks.score_task(model, task, 4, "cpu")
    figures = results["results"][f"local_{name}"]
    assert figures["acc,none"] == pytest.approx(scores["acc"], abs=1e-12)
    if scores["acc_norm"] is not None:
        assert figures["acc_norm,none"] == pytest.approx(scores["acc_norm"], abs=1e-12)
    else:
        assert "acc_norm,none" not in figures
    if scores["ppl"] is not None:
        assert figures["perplexity,none"] == pytest.approx(scores["ppl"], rel=1e-5)


def test_loglikelihood_rolling_is_the_whole_text_loss(harness_results, world):
    """Every token predicted once, the first from end-of-text: on whole windows, eval.py's
    evaluate_tokens over [end-of-text] + the text; a shorter text, one forward pass; a remainder,
    one more window with a full context that scores only its last tokens."""
    results, _ = harness_results
    _, _, _, model, tokenizer = world
    install_fast_paths(model, lev=FastEmbedder())
    eot = tokenizer.encoding.eot_token
    samples = sorted(results["samples"]["local_text"], key=lambda s: s["doc_id"])
    for logged, record, n in zip(samples, TEXTS, TEXT_TOKENS, strict=True):
        ids = tokenizer.encode(record["text"])
        assert len(ids) == n
        whole = n - n % BLOCK
        want = 0.0
        if whole:
            losses, _ = ev.evaluate_tokens(model, np.array([eot] + ids[:whole]), 4, "cpu")
            assert len(losses) == whole
            want -= losses.astype(np.float64).sum()
        if n % BLOCK:
            window = torch.tensor([eot] + ids)[-(BLOCK + 1):]  # [eot] + ids: when it is short
            targets = window[1:].clone()
            targets[:-(n % BLOCK)] = -1  # predicted in the windows before
            with torch.no_grad():
                _, loss = tasks.token_losses(model, window[None, :-1], targets[None])
            want -= loss.double().sum().item()
        assert logged["filtered_resps"][0] == pytest.approx(want, abs=1e-4)
    figures = results["results"]["local_text"]
    total = sum(s["filtered_resps"][0] for s in samples)
    words = sum(len(re.split(r"\s+", t["text"])) for t in TEXTS)
    assert figures["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-9)


# --------------------------------------------------------------------------------------------------
# requests the adapter answers without the model, and the ones it refuses


def test_requests_without_a_model_pass(lm_eval, world):
    from lm_eval.api.instance import Instance

    from lab.harness_model import AdapterError, LeviathanLM, cut_at_stops

    _, _, _, model, tokenizer = world
    chars = CharTokenizer("".join(sorted(set("the cat sat on a mat. "))))
    char_lm = LeviathanLM(model=GPT(Config(vocab_size=chars.vocab_size, block_size=8, n_layer=1,
                                           n_head=2, n_embd=16, embedding="untied")),
                          tokenizer=chars, batch_size="auto", device="cpu")
    assert char_lm.batch_size == 16

    def request(kind, *args):
        return Instance(request_type=kind, doc={}, arguments=args, idx=0)

    # an empty continuation is certain; a character the vocabulary lacks, impossible
    got = char_lm.loglikelihood([request("loglikelihood", "the cat", ""),
                                 request("loglikelihood", "the cat", " sat"),
                                 request("loglikelihood", "the Cat", " sat")])
    assert got[0] == (0.0, True) and got[2] == (-math.inf, False) and got[1][0] < 0
    assert char_lm.unencodable == 1
    with pytest.raises(AdapterError, match="does not fit block_size=8"):
        char_lm.loglikelihood([request("loglikelihood", "a", " cat sat on")])
    with pytest.raises(AdapterError, match="no end-of-text token"):
        char_lm.loglikelihood([request("loglikelihood", "", "the cat")])
    with pytest.raises(AdapterError, match="end-of-text token"):
        char_lm.loglikelihood_rolling([request("loglikelihood_rolling", "the cat")])
    with pytest.raises(AdapterError, match="unknown model_args colour; "):
        LeviathanLM(model=model, tokenizer=tokenizer, colour="red")
    with pytest.raises(AdapterError, match="dtype=float8; choose auto, float32"):
        LeviathanLM(model=model, tokenizer=tokenizer, dtype="float8")
    with pytest.raises(AdapterError, match="--batch_size=0 must be an integer >= 1 or auto"):
        LeviathanLM(model=model, tokenizer=tokenizer, batch_size=0)
    with pytest.raises(AdapterError, match="needs run=DIR"):
        LeviathanLM()
    assert cut_at_stops("one. two\n\nthree", ["\n\n", ".", ""]) == "one"


# --------------------------------------------------------------------------------------------------
# a run on disk: generation as sample.py, the registered model, the command line


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A tiny random lev run with a char vocabulary, saved as train.py saves one -> its folder."""
    root = tmp_path_factory.mktemp("char_run")
    text = json.dumps(FILES) + "Question:\nAnswer:" + "".join(t["text"] for t in TEXTS)
    chars = "".join(sorted(set(text)))
    torch.manual_seed(3)
    model = GPT(Config(vocab_size=len(chars), block_size=32, n_layer=2, n_head=2, n_embd=32,
                       embedding="lev", lev_seed_dim=16, lev_heads=2, lev_rank=8))
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": len(chars), "chars": chars}
    torch.save({"version": CHECKPOINT_VERSION, "model": model.state_dict(),
                "model_config": asdict(model.config), "meta": meta, "step": 0, "tokens_seen": 0},
               root / "ckpt.pt")
    return root


def sampled(run, prompt, capsys, *flags):
    """sample.py's one sample of prompt, without the prompt."""
    [text] = sample.main([f"--out_dir={run}", f"--start={prompt}", "--num_samples=1",
                          "--max_new_tokens=40", "--device=cpu", *flags])
    capsys.readouterr()
    assert text.startswith(prompt)
    return text[len(prompt):]


def test_generate_until_gives_sample_py_tokens(lm_eval, char_run, capsys):
    from lm_eval.api.instance import Instance

    from lab.harness import Leviathan

    lm = Leviathan(run=str(char_run), device="cpu")

    def generate(prompt, **gen_kwargs):
        [text] = lm.generate_until([Instance("generate_until", {}, (prompt, gen_kwargs), 0)])
        return text

    prompt = "Question: How do you light a candle?\nAnswer:"  # longer than the block: cut
    greedy = sampled(char_run, prompt, capsys, "--temperature=0")
    assert len(greedy) == 40 and len(prompt) > 32
    assert generate(prompt, until=[], max_gen_toks=40) == greedy
    assert generate(prompt, until=[], max_gen_toks=40, do_sample=False, temperature=0.7) == greedy
    # a stop string: the text before it
    stop = greedy[5:8]
    assert generate(prompt, until=[stop], max_gen_toks=40) == greedy.split(stop)[0]
    assert generate(prompt, until="\x00", max_gen_toks=7) == greedy[:7]
    # sampled: sample.py's defaults (temperature 0.8, top_k 200, seed 1337)
    drawn = sampled(char_run, prompt, capsys)
    torch.manual_seed(1337)
    assert generate(prompt, until=[], max_gen_toks=40, do_sample=True, temperature=0.8,
                    top_k=200) == drawn
    assert drawn != greedy


def test_an_edited_block_generates_as_written(lm_eval, char_run, capsys, monkeypatch):
    """An edit of the model's MLP (made in-process here; tests/test_edits.py edits a copy of
    leviathan.py): generation is the model's own code, and gives the tokens of plain=true, with
    no note (no fast path re-implements the MLP)."""
    from lm_eval.api.instance import Instance

    import leviathan
    from lab.harness import Leviathan

    def gelu_mlp(self, x):
        F = torch.nn.functional
        return F.dropout(self.down(F.gelu(self.gate(x)) * self.up(x)), self.dropout, self.training)

    monkeypatch.setattr(leviathan.SwiGLU, "forward", gelu_mlp)
    request = Instance("generate_until", {}, ("To be", {"until": [], "max_gen_toks": 20}), 0)
    texts = [Leviathan(run=str(char_run), device="cpu", plain=plain)
             .generate_until([request])[0] for plain in (False, True)]
    assert texts[0] == texts[1] and len(texts[0]) == 20
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == []


def test_the_command_line_scores_as_eval_py_task(lm_eval, world, char_run, tmp_path):
    """python lab/harness.py with the harness's usual flags: its table, its results file, and the
    figures of eval.py --task. (Its start is lm_eval's: an index of the harness's own tasks.)"""
    _, files, configs, _, _ = world
    flags = ["--model_args", f"run={char_run}", "--include_path", str(configs), "--tasks",
             "local_piqa,local_winogrande", "--batch_size", "2", "--device", "cpu",
             "--output_path", "results"]
    done = subprocess.run([sys.executable, str(ROOT / "lab" / "harness.py"), *flags], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "HF_HOME": "hf"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\|local_piqa +\| +1\|none +\| +0\|acc +\|", done.stdout), done.stdout
    [path] = glob.glob(str(tmp_path / "results" / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(path).read_text())
    assert results["config"]["model"] == "leviathan"
    assert results["config"]["leviathan_run"] == str(char_run)
    # the model and run settings of eval.py
    model, ckpt = load_checkpoint(str(char_run), "cpu")
    install_fast_paths(model, lev=FastEmbedder())
    tokenizer = CharTokenizer(ckpt["meta"]["chars"])
    for name in ("piqa", "winogrande"):
        [task] = tasks.load_tasks([(name, files[name])], tokenizer, 0, model.config.block_size)
        scores = tasks.score_task(model, task, 2, "cpu")
        figures = results["results"][f"local_{name}"]
        assert figures["acc,none"] == pytest.approx(scores["acc"], abs=1e-12)
        if scores["acc_norm"] is not None:
            assert figures["acc_norm,none"] == pytest.approx(scores["acc_norm"], abs=1e-12)


def test_a_run_that_cannot_be_loaded_is_one_line(lm_eval, world, tmp_path):
    """The registered model, by name: a missing or bad run is refused in one line, which
    harness.py prints as its error (exit code 2)."""
    from lab import harness  # noqa: F401  (registers the model "leviathan")
    from lab.harness_model import AdapterError
    _, _, configs, _, _ = world
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ckpt.pt").write_text("not a checkpoint")
    for run, message in [(tmp_path / "nowhere", f"no checkpoint at {tmp_path / 'nowhere'}"),
                         (tmp_path / "bad", f"{tmp_path / 'bad' / 'ckpt.pt'} is not a readable")]:
        with pytest.raises(AdapterError) as refused:
            lm_eval.simple_evaluate(model="leviathan", model_args={"run": str(run)},
                                    tasks=["local_piqa"], task_manager=manager(configs))
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_without_lm_eval_one_line_says_how_to_install_it(tmp_path):
    """Runs with or without lm_eval installed: the child process cannot import it."""
    hide = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = ['lab/harness.py', "
            "'--tasks', 'hellaswag']; runpy.run_path('lab/harness.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == ("harness.py: error: needs lm-evaluation-harness: pip install lm_eval "
                             "(tested with lm_eval 0.4.13)\n")
    hide = hide.replace("'--tasks', 'hellaswag'", "'--help'")
    result = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("Any lm-evaluation-harness task on a Leviathan run")
    assert result.stdout.rstrip().endswith("needs lm-evaluation-harness: pip install lm_eval "
                                           "(tested with lm_eval 0.4.13)")


# --------------------------------------------------------------------------------------------------
# the edges: each a one-line refusal, never a traceback


def test_a_continuation_merged_into_its_context_is_refused_the_same_in_both(lm_eval, world,
                                                                            monkeypatch):
    """" t" + "he" is one token, " the": the continuation "he" after "Say t" has no token of its
    own. lm_eval's models refuse such a request; so do the adapter and eval.py --task, in one
    line (eval.py's with the file and line)."""
    from lm_eval.api.instance import Instance

    from lab.harness_model import AdapterError, LeviathanLM

    _, _, _, model, tokenizer = world
    with pytest.raises(tasks.NoContinuationTokens, match="merges into the last token"):
        tasks.encode_pair(tokenizer, "Say t", "he")
    lm = LeviathanLM(model=model, tokenizer=tokenizer, device="cpu")
    with pytest.raises(AdapterError, match="^a loglikelihood request: the continuation 'he'"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("Say t", "he"), 0)])
    merged = tasks.Example([("Say t", "he"), ("Say t", "o")], 0, None, "mine.jsonl:3")
    monkeypatch.setitem(tasks.LOADERS, "piqa", lambda path: [merged])
    with pytest.raises(tasks.TaskError, match=r"^mine\.jsonl:3: the continuation 'he' merges"):
        tasks.load_task("piqa", "mine.jsonl", tokenizer, 0, BLOCK)


def test_bad_generation_settings_are_refused(lm_eval, world):
    from lm_eval.api.instance import Instance

    from lab.harness_model import AdapterError, LeviathanLM

    _, _, _, model, tokenizer = world
    lm = LeviathanLM(model=model, tokenizer=tokenizer, device="cpu")
    for settings, message in [({"until": [123]}, "until=[123] must be a string or a list"),
                              ({"max_gen_toks": -3}, "max_gen_toks=-3 must be a whole number")]:
        request = Instance("generate_until", {}, ("To be", settings), 0)
        with pytest.raises(AdapterError, match=re.escape(message)):
            lm.generate_until([request])


def test_bad_task_configs_and_data_files_are_one_line(lm_eval, tmp_path):
    """Checked before the harness starts: a YAML that does not parse (the harness would say only
    "Tasks not found"), and a data file that is not JSON lines (a traceback from datasets)."""
    from lab.harness_model import AdapterError, check_task_configs

    configs = tmp_path / "tasks"
    configs.mkdir()
    (configs / "ok.yaml").write_text(
        f"task: mine\ndataset_path: json\nprocess_docs: !function preprocess.f\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'data.jsonl'}\n")
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n{"text": broken\n')
    argv = ["--include_path", str(configs), "--tasks", "mine"]
    with pytest.raises(AdapterError, match=r"data\.jsonl:2 \(a data file of .*ok\.yaml\) is not a "
                                           r"JSON object on one line"):
        check_task_configs(argv)
    check_task_configs(["--include_path", str(configs), "--tasks", "other"])  # not asked for
    (configs / "group.yaml").write_text("task: [mine, other]\ntag: [g1, g2]\n")  # lists of names
    with pytest.raises(AdapterError, match=r"data\.jsonl:2"):
        check_task_configs(["--include_path", str(configs), "--tasks", "g1,mine"])
    (configs / "broken.yaml").write_text("task: b\ndataset_path: json\n  bad: [\n")
    with pytest.raises(AdapterError, match=r"broken\.yaml is not a readable task config \(.*line "
                                           r"3.*\); fix it, or move it out of --include_path"):
        check_task_configs(["--include_path", str(configs), "--tasks", "b"])


def test_an_lm_eval_without_a_helper_the_adapter_uses_is_one_line(lm_eval):
    hide = ("import runpy, sys; import lm_eval.models.utils as u; del u.normalize_gen_kwargs; "
            "sys.argv = ['lab/harness.py', '--tasks', 'x']; runpy.run_path('lab/harness.py', "
            "run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith("harness.py: error: this lm_eval lacks what the adapter uses "
                                    "(cannot import name 'normalize_gen_kwargs'")
    assert "pip install lm_eval==0.4.13" in result.stderr


def test_the_adapter_takes_sample_py_threads_on_cpu(lm_eval, world):
    from lab.harness_model import LeviathanLM

    _, _, _, model, tokenizer = world
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LeviathanLM(model=model, tokenizer=tokenizer, device="cpu")
        assert torch.get_num_threads() == 1  # a model under 50M parameters: one thread
    finally:
        torch.set_num_threads(previous)


def test_the_first_recipe_of_harness_md(lm_eval, tmp_path):
    """docs/harness.md's first recipe, as written, on a tiny char run in place of the CPU config's:
    tasks/'s example configs on their example files, from the repository's root."""
    page = (ROOT / "docs" / "harness.md").read_text(encoding="utf-8")
    recipe = re.findall(r"```bash\n(.*?)```", page, re.S)[0]
    first = recipe.split("\n# ")[0]  # its first command (and its comment)
    assert "--include_path tasks" in first and "run=out-shakespeare-cpu-lev" in first
    data = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tasks" / "data").glob("*"))
    chars = "".join(sorted(set(data + "Question: Answer:\n")))
    torch.manual_seed(5)
    model = GPT(Config(vocab_size=len(chars), block_size=512, n_layer=1, n_head=2, n_embd=32,
                       embedding="lev", lev_seed_dim=16, lev_heads=2, lev_rank=8))
    meta = {"dataset": "tiny", "tokenizer": "char", "vocab_size": len(chars), "chars": chars}
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"version": CHECKPOINT_VERSION, "model": model.state_dict(),
                "model_config": asdict(model.config), "meta": meta, "step": 0, "tokens_seen": 0},
               run / "ckpt.pt")
    command = first.replace("run=out-shakespeare-cpu-lev", f"run={run}")
    command = command.replace("python lab/harness.py", f"{sys.executable} lab/harness.py")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "HF_HOME": str(tmp_path / "hf")})
    assert done.returncode == 0, done.stderr[-2000:]
    for task in ("local_hellaswag", "local_arc"):
        assert re.search(rf"\|{task} *\| +1\|", done.stdout), done.stdout
