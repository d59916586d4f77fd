"""`python -m maxshard.eval` and `eval_tasks` in training, against lm-eval's own Hugging Face backend.

The Hugging Face fixtures (tests/fixtures/hf) are converted by `maxshard.convert` and scored by the CLI on the example
tasks of configs/eval_tasks (multiple choice, rolling perplexity, greedy and sampled generation); tests/fixtures/eval
holds what lm-eval 0.4.13's Hugging Face backend scored on the same models (tools/make_eval_fixtures.py, float32,
max_length 32 so the longer rolling documents take several windows). The models cover every way a tokenizer treats
BOS: named and never added (llama_gqa), named and added by its template (mixtral), none (qwen3, qwen3_moe), and
none named though the vocabulary holds <s> (qwen3_bos_in_vocab: qwen3's weights, the tokenizer of
tests/fixtures/eval/qwen3_bos_in_vocab). The CLI runs in this process; each model's single-device scores are computed
once and shared by the layout tests and by the one multi-host test, whose two processes run the CLI as subprocesses.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest

pytest.importorskip("lm_eval")

from maxshard import eval as eval_cli  # noqa: E402
from maxshard.convert import __main__ as convert_cli  # noqa: E402
from maxshard.data.tokenizer import load_hf_tokenizer  # noqa: E402
from maxshard.evaluation.harness import MaxshardLM  # noqa: E402
import cli_processes

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
TASKS_DIR = REPO / "configs" / "eval_tasks"
TASKS = ("local_choice", "local_rolling", "local_generate")
TOLERANCE = 1e-4
MODELS = ("llama_gqa", "mixtral", "qwen3", "qwen3_moe", "qwen3_bos_in_vocab")
BOS_IN_VOCAB = ("config.json", "generation_config.json", "model.safetensors")  # from qwen3, beside its own tokenizer


def checkpoint(name: str, scratch: Path) -> Path:
    """The Hugging Face directory of `name`, as tools/make_eval_fixtures.py scored it: qwen3_bos_in_vocab is
    assembled in `scratch` from qwen3's weights and the tokenizer files of tests/fixtures/eval/qwen3_bos_in_vocab."""
    if name != "qwen3_bos_in_vocab":
        return FIXTURES / "hf" / name
    for file in BOS_IN_VOCAB:
        shutil.copyfile(FIXTURES / "hf" / "qwen3" / file, scratch / file)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURES / "eval" / name / file, scratch / file)
    return scratch


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    for name in MODELS:
        source = checkpoint(name, tmp_path_factory.mktemp(f"{name}_hf"))
        assert convert_cli.main(["from_hf", str(source), str(root / name)]) == 0
    return {name: root / name for name in MODELS}


def score(converted: dict[str, Path], out: Path, name: str, *keys: str, devices: Any = None, tasks: tuple = TASKS
          ) -> tuple[dict[str, list], dict, str, dict[str, list]]:
    """Runs the CLI's command (on `devices`, default all 8); returns ({task: every document's resps, in document
    order}, lm-eval's results JSON) as read back from the files `eval_output` wrote, what it printed, and {task:
    every document's sample record}."""
    argv = [str(converted[name] / "config.yml"), f"tasks={','.join(tasks)}", f"eval_tasks_dir={TASKS_DIR}",
            "max_target_length=32", f"eval_output={out}", f"base_output_directory={out}", "eval_batch_size=4", *keys]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert (eval_cli.main(argv) if devices is None else eval_cli.run(argv, devices)) == 0
    resps, results, docs = written(out, tasks)
    return resps, results, printed.getvalue(), docs


def written(out: Path, tasks: tuple) -> tuple[dict[str, list], dict, dict[str, list]]:
    """({task: every document's resps, in document order}, the results JSON, {task: the documents' sample records})
    from the files `eval_output=out` holds: one results file and one samples file per task (a second writer would
    have added its own)."""
    (directory,) = [p for p in out.iterdir() if p.is_dir() and p.name != "default"]
    (results_file,) = directory.glob("results_*.json")
    resps, docs = {}, {}
    for task in tasks:
        (samples_file,) = directory.glob(f"samples_{task}_*.jsonl")
        rows = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda r: r["doc_id"])
        resps[task], docs[task] = [r["resps"] for r in rows], rows
    return resps, json.loads(results_file.read_text()), docs


@pytest.fixture(scope="module")
def one_device(converted, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Each model's scores on one device, computed once."""
    out = {}
    for name in converted:
        tasks = (*TASKS, "local_sample") if name == "qwen3" else TASKS
        out[name] = score(converted, tmp_path_factory.mktemp(name), name, devices=jax.devices()[:1], tasks=tasks)
    return out


def _numbers(resps: list) -> list[float]:
    """The log-likelihoods of the samples file's resps (lm-eval writes them as strings): [[[ll, greedy]], ...]."""
    flat: list[float] = []
    for doc in resps:
        for (answer,) in doc:
            flat.append(float(answer[0] if isinstance(answer, list) else answer))
    return flat


def _greedy(resps: list) -> list[str]:
    return [str(answer[1]) for doc in resps for (answer,) in doc]


@pytest.mark.parametrize("name", MODELS)
def test_scores_equal_lm_evals_hugging_face_backend(one_device, name):
    """Per-request log-likelihoods within 1e-4 of the Hugging Face backend's, the same greedy flags, accuracies and
    rolling perplexities (every rolling document's first window conditioned on the same prefix token), and the same
    greedy generations cut at the same stop sequences."""
    resps, results, *_ = one_device[name]
    want = json.loads((FIXTURES / "eval" / f"{name}.json").read_text())
    for task in ("local_choice", "local_rolling"):
        got, expected = _numbers(resps[task]), _numbers(want[task]["resps"])
        assert got == pytest.approx(expected, abs=TOLERANCE), task
    assert _greedy(resps["local_choice"]) == _greedy(want["local_choice"]["resps"])
    assert [doc[0][0] for doc in resps["local_generate"]] == [doc[0][0] for doc in want["local_generate"]["resps"]]
    for task in TASKS:
        for metric, value in want[task]["metrics"].items():
            if metric in ("acc,none", "acc_norm,none", "exact_match,none"):
                assert results["results"][task][metric] == value, (task, metric)
            elif metric != "name" and metric != "sample_len":
                assert results["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


@pytest.mark.parametrize("name", MODELS)
def test_special_tokens_and_the_prefix_are_transformers_and_lm_evals(tmp_path, name):
    """BOS and EOS as transformers reads them from the tokenizer's config, and the prefix token lm-eval conditions
    an empty context on (BOS, else EOS; <s> in qwen3_bos_in_vocab's vocabulary is no BOS)."""
    tok = load_hf_tokenizer(str(checkpoint(name, tmp_path) / "tokenizer.json"))
    want = json.loads((FIXTURES / "eval" / f"{name}.json").read_text())["tokenizer"]
    assert (tok.bos_id, tok.eos_id) == (want["bos_token_id"], want["eos_token_id"])
    assert MaxshardLM(None, None, tok, 32).prefix_token_id == want["prefix_token_id"]


@pytest.mark.parametrize(("name", "layout"), [
    ("qwen3", ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")),
    ("qwen3_moe", ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")),
])
def test_layouts_give_the_scores_of_one_device(converted, one_device, tmp_path, name, layout):
    """The log-likelihood tasks on 8 devices (the generation engine's layouts are test_generate.py's)."""
    tasks = ("local_choice", "local_rolling")
    resps, results, *_ = score(converted, tmp_path, name, *layout, tasks=tasks)
    single, single_results, *_ = one_device[name]
    for task in tasks:
        assert _numbers(resps[task]) == pytest.approx(_numbers(single[task]), abs=TOLERANCE), task
        assert {k: v for k, v in results["results"][task].items() if "acc" in k} == \
               {k: v for k, v in single_results["results"][task].items() if "acc" in k}
    assert _greedy(resps["local_choice"]) == _greedy(single["local_choice"])


def test_one_console_line_per_task_and_a_bad_task_key_fails_before_loading(converted, one_device, tmp_path, capsys):
    printed = one_device["qwen3"][2].splitlines()
    assert printed[0].startswith("checkpoint: ") and "single device" in printed[0]
    for task in TASKS:
        assert len([line for line in printed if line.startswith(f"{task}: ")]) == 1
    assert any(line.startswith("local_choice: acc ") and line.endswith("(6 documents)") for line in printed)
    config = str(converted["qwen3"] / "config.yml")
    assert eval_cli.main([config, "tasks=local_choice,", f"base_output_directory={tmp_path}"]) == 2
    err = capsys.readouterr()
    assert err.err == ("maxshard: error: tasks expects lm-eval task names separated by commas (e.g. "
                       "tasks=local_choice,local_rolling), got 'local_choice,'\n") and "checkpoint:" not in err.out


def test_a_sampling_task_samples_and_stops_at_its_stop_sequences(one_device):
    """local_sample (local_generate's prompts at temperature 2), scored in the same run as local_generate: its
    completions differ from the greedy ones and never contain a stop sequence."""
    resps = one_device["qwen3"][0]
    sampled, greedy = [doc[0][0] for doc in resps["local_sample"]], [doc[0][0] for doc in resps["local_generate"]]
    assert len(sampled) == 4 and sampled != greedy
    assert not any(stop in text for text in sampled for stop in (" the", " a"))


# ---------------------------------------------------------------------------------------------- multi-host


def two_processes(converted: dict[str, Path], env: dict[str, str], tmp_path: Path, tasks: tuple,
                  limits: tuple[int, int] = (2, 2)) -> list[subprocess.Popen]:
    """The CLI as every host of a cluster runs it: the same command line (but each process's eval_tasks_limit) on
    two processes of 4 CPU devices each, joined on loopback, fsdp over all 8; eval_output under tmp_path/out."""
    from helpers import process_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(converted["qwen3"] / "config.yml"), f"tasks={','.join(tasks)}", f"eval_tasks_dir={TASKS_DIR}",
            "max_target_length=32", f"eval_output={tmp_path / 'out'}", f"base_output_directory={tmp_path}",
            "eval_batch_size=4", "cpu_device_count=4", "ici_fsdp_parallelism=8",
            f"coordinator_address=127.0.0.1:{port}", "process_count=2", "distributed_timeout=60"]
    return [cli_processes.popen([sys.executable, "-m", "maxshard.eval", *argv, f"process_id={i}",
                              f"eval_tasks_limit={limits[i]}"], cwd=REPO, env=process_env(env),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def test_two_processes_score_as_one_and_only_process_0_writes(converted, one_device, env, tmp_path):
    """Each process runs lm-eval on every request and checks the other's requests, log-likelihoods and generated
    texts (greedy and sampled) against its own (a difference would fail it); the scores equal the one-process
    run's, and process 0 alone prints and writes eval_output."""
    from helpers import finished

    tasks, out = ("local_choice", "local_generate", "local_sample"), tmp_path / "out"
    printed = finished(two_processes(converted, env, tmp_path, tasks), timeout=300)
    assert "mesh: fsdp=8" in printed[0] and "local_choice: acc " in printed[0] and "(2 documents)" in printed[0]
    assert not any(line.startswith(("checkpoint:", "local_", "wrote ")) for line in printed[1].splitlines())
    resps, results, docs = written(out, tasks)  # exactly one results file and one samples file per task
    single, _, _, single_docs = one_device["qwen3"]
    assert _numbers(resps["local_choice"]) == pytest.approx(_numbers(single["local_choice"][:2]), abs=TOLERANCE)
    assert _greedy(resps["local_choice"]) == _greedy(single["local_choice"][:2])
    assert [doc[0][0] for doc in resps["local_generate"]] == [doc[0][0] for doc in single["local_generate"][:2]]
    for task, metrics in (("local_choice", ("acc", "acc_norm")), ("local_generate", ("exact_match",))):
        assert [[d[m] for m in metrics] for d in docs[task]] == [[d[m] for m in metrics] for d in single_docs[task][:2]]
    assert all(results["n-samples"][task]["effective"] == 2 for task in tasks)
    assert not any(stop in doc[0][0] for doc in resps["local_sample"] for stop in (" the", " a"))


def test_processes_given_other_requests_stop_in_one_line_before_scoring(converted, env, tmp_path):
    """A host that would score other documents (here: another eval_tasks_limit, as other task files would) is found
    before any request reaches the devices: both processes exit 2 naming it, and nothing is written."""
    procs = two_processes(converted, env, tmp_path, ("local_choice",), limits=(2, 1))
    try:
        printed = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [2, 2], printed
    for out in printed:
        assert "maxshard: error: process 1 of 2 holds other log-likelihood requests than process 0: " in out
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- in training

IN_LOOP = ("eval_tasks=local_choice,local_rolling", f"eval_tasks_dir={TASKS_DIR}", "eval_tasks_period=2",
           "eval_tasks_limit=2", "checkpoint_period=2")


def test_tasks_in_training_appear_at_their_period_and_leave_a_resumed_run_unchanged(env, reference, tmp_path):
    """tests/training_runs.py's run through maxshard.train with eval_tasks every 2 steps, stopped at step 2 and
    resumed to 4: scores at steps 2 and 4 (console and metrics.jsonl), and the losses of the uninterrupted run
    without evaluation (conftest's `reference`, the same keys): evaluation disturbs neither state nor data."""
    from training_runs import losses, train

    first = train(env, tmp_path, *IN_LOOP, "steps=2")
    assert "eval_tasks at step 2: local_choice: acc " in first
    second = train(env, tmp_path, *IN_LOOP, "steps=4")
    assert "resuming from step 2" in second and "eval_tasks at step 4: local_rolling: word_perplexity " in second
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval_tasks/local_choice/acc" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    assert all(r["eval_tasks/local_rolling/bits_per_byte"] > 0 for r in evaluated)
    want = losses(reference)
    assert losses(tmp_path) == {step: want[step] for step in (1, 2, 3, 4)}
