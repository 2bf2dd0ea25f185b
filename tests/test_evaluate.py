"""Evaluation: scorers on hand-written answers, deterministic batched greedy generation, adapters
from a folder, an MLflow run and the Model Registry, merged vs unmerged (merged by default in fp32),
the evaluate/export jobs, bad input and damaged adapter files, the printed comparison's units, Ray
Data actors vs one process, and the eval section of a training job, with Ray and without. Tiny
model, real peft, real MLflow store in a temp dir, real Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_overrides
from zerolab.config import BUILTIN_TINY_MODEL, ConfigError, ModelSpec, load_config
from zerolab.errors import EvaluationError
from zerolab.evaluate import EvalOptions, run_evaluation
from zerolab.generation import Example, Generator, default_eval_path, generate_answers, load_examples, plan_batches
from zerolab.reference import LoadSpec, Target, resolve_target
from zerolab.scoring import score_answers
from zerolab.tasks import generate_dataset, math_sum

P = math_sum.PREFIX
GEN = {"batch_size": 4, "max_new_tokens": 12}


def math_example(x: int, index: int = 0) -> Example:
    return Example(index=index, messages=[{"role": "user", "content": f"{x}="}], reference=f"{P}1 + {x - 1}")


# --- scoring -------------------------------------------------------------------------------------


def test_math_scores_prefix_and_sum_separately():
    examples = [math_example(5, i) for i in range(5)]
    answers = [f"{P}2 + 3", "2 + 3", f"{P}2 + 4", f"{P}1 + 4", "王大丫丫的回答是>2 + 3"]
    per_example, summary = score_answers("math_sum", examples, answers)
    # right; right sum without prefix; wrong sum; the reference itself; wrong prefix
    assert [(s["format_ok"], s["correct"]) for s in per_example] == [(1, 1), (0, 0), (1, 0), (1, 1), (0, 0)]
    assert [s["exact_match"] for s in per_example] == [0, 0, 0, 1, 0]  # generic exact match vs the reference
    assert summary["accuracy"] == summary["correct"] == pytest.approx(2 / 5)
    assert summary["format_ok"] == pytest.approx(3 / 5) and summary["exact_match"] == pytest.approx(1 / 5)


def test_ner_scores_malformed_json_and_partial_matches():
    gold = json.dumps({"name": ["张伟"], "address": ["北京"]}, ensure_ascii=False)
    examples = [Example(index=i, messages=[{"role": "user", "content": "张伟在北京。"}], reference=gold) for i in range(3)]
    answers = [gold, '{"name": ["张伟"', json.dumps({"name": ["张伟"], "company": ["华为"]}, ensure_ascii=False)]
    per_example, summary = score_answers("ner_json", examples, answers)
    assert [s["valid_json"] for s in per_example] == [1, 0, 1]
    assert (per_example[2]["tp"], per_example[2]["fp"], per_example[2]["fn"]) == (1, 1, 1)
    assert summary["precision"] == pytest.approx(3 / 4) and summary["recall"] == pytest.approx(3 / 6)
    assert summary["accuracy"] == summary["exact_match"] == pytest.approx(1 / 3)


def test_batches_are_longest_first_and_cover_every_example():
    examples = [math_example(x, i) for i, x in enumerate([5, 12345, 77, 999, 3, 4242])]
    batches = plan_batches(examples, 4)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert batches[0][:2] == [1, 5] and [len(b) for b in batches] == [4, 2]


def test_eval_file_rows_become_prompts_and_references(tmp_path):
    path = generate_dataset("math_sum", 5, 7, tmp_path / "eval.json")
    examples = load_examples(str(path), "math_sum", limit=3)
    rows = json.loads(path.read_text())
    assert [e.prompt for e in examples] == [r["instruction"] for r in rows[:3]]
    assert [e.reference for e in examples] == [r["output"] for r in rows[:3]]
    assert examples[0].messages[0] == {"role": "system", "content": math_sum.SYSTEM_PROMPT}


def test_eval_section_needs_an_eval_split():
    assert load_config(None, ["eval.enabled=true"]).eval.enabled
    with pytest.raises(ConfigError, match=r"eval.enabled: there is no eval split"):
        load_config(None, ["eval.enabled=true", "data.num_eval_rows=0"])
    with pytest.raises(ConfigError, match=r"eval.batch_size: 0 is not allowed"):
        load_config(None, ["eval.batch_size=0"])


# --- generation ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> list[Example]:
    path = generate_dataset("math_sum", 7, 11, tmp_path_factory.mktemp("data") / "eval.json")
    mixed = load_examples(str(path), "math_sum")
    # One much longer prompt, so batches need real left padding.
    long = Example(index=len(mixed), messages=[{"role": "user", "content": "张伟是华为的工程师。" * 3 + "1234="}], reference=f"{P}1 + 1233")
    return [*mixed, long]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_path) -> Path:
    """A LoRA adapter with random (non-zero) weights: it changes the answers without training."""
    from peft import LoraConfig, get_peft_model

    from zerolab.models import load_model

    torch.manual_seed(0)
    model = get_peft_model(load_model(ModelSpec(), torch.float32),
                           LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    folder = tmp_path_factory.mktemp("trained") / "adapter"
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def base_answers(examples, tiny_model_path) -> list[str]:
    return generate_answers(LoadSpec(BUILTIN_TINY_MODEL), examples, **GEN).texts


@pytest.fixture(scope="module")
def tuned_answers(examples, adapter_dir) -> list[str]:
    return generate_answers(LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(adapter_dir)), examples, **GEN).texts


def test_greedy_generation_is_deterministic_and_batching_does_not_change_answers(examples, base_answers):
    generator = Generator({"name_or_path": BUILTIN_TINY_MODEL}, device="cpu", dtype="fp32", max_new_tokens=GEN["max_new_tokens"])
    conversations = [e.messages for e in examples]
    batched, counts = generator.generate(conversations)
    assert batched == generator.generate(conversations)[0] == base_answers
    assert [generator.generate([c])[0][0] for c in conversations] == batched  # left padding is invisible
    assert len(set(batched)) > 1 and all(0 < n <= GEN["max_new_tokens"] for n in counts)

    # The KV cache gives what a plain argmax loop over full forward passes gives.
    tok, model = generator.tokenizer, generator.model
    ids = tok(tok.apply_chat_template(examples[-1].messages, tokenize=False, add_generation_prompt=True),
              return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        for _ in range(counts[-1]):
            nxt = model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt.item() in generator.eos_ids:
                break
    assert tok.decode(ids[0, -counts[-1]:], skip_special_tokens=True) == batched[-1]


def test_figures_are_reported(examples, tiny_model_path):
    answers = generate_answers(LoadSpec(BUILTIN_TINY_MODEL), examples[:3], batch_size=2, max_new_tokens=6)
    f = answers.figures
    assert f["generated_tokens"] == sum(answers.num_tokens) > 0
    assert f["tokens_per_s"] == pytest.approx(f["generated_tokens"] / f["generate_s"])
    assert f["wall_s"] >= f["generate_s"] > 0 and f["load_s"] > 0 and f["host_rss_peak_gib"] > 0.05
    assert "gpu_peak_load_gib" not in f  # CPU run: no GPU figures


def test_merged_adapter_and_exported_folder_give_the_same_answers(examples, adapter_dir, base_answers, tuned_answers, tmp_path):
    from transformers import AutoModelForCausalLM

    from zerolab.export import export_merged

    assert tuned_answers != base_answers
    merged = generate_answers(LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(adapter_dir), merge=True), examples, **GEN).texts
    assert merged == tuned_answers

    target = resolve_target(str(adapter_dir), BUILTIN_TINY_MODEL, f"sqlite:///{tmp_path / 'unused.db'}", tmp_path)
    result = export_merged(target, tmp_path / "merged")
    assert result["max_logit_diff"] < 1e-4 and "model.safetensors" in result["files"]
    model = AutoModelForCausalLM.from_pretrained(result["output"])
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert generate_answers(LoadSpec(result["output"]), examples, **GEN).texts == tuned_answers
    with pytest.raises(EvaluationError, match="exists and is not empty; choose a new folder or let the export overwrite it") as exc:
        export_merged(target, tmp_path / "merged")
    assert exc.value.input == "output"


# --- adapters from MLflow ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory, adapter_dir):
    """A real MLflow store holding a training-like run with the adapter logged as `adapter` and
    registered as version 1 (alias `candidate`); version 2's source is gone (falls back to the run)."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("tests", artifact_location=str(root / "artifacts"))
    run = client.create_run(experiment, run_name="math-tiny-lora")
    for key, value in {"model.name_or_path": BUILTIN_TINY_MODEL, "data.task": "math_sum", "data.eval_path": "",
                       "data.num_eval_rows": "16", "data.seed": "0", "data.system_prompt": ""}.items():
        client.log_param(run.info.run_id, key, value)
    client.log_artifacts(run.info.run_id, str(adapter_dir), "adapter")
    client.set_terminated(run.info.run_id)
    client.create_registered_model("tiny-math")
    v1 = client.create_model_version("tiny-math", f"{run.info.artifact_uri}/adapter", run_id=run.info.run_id)
    client.set_registered_model_alias("tiny-math", "candidate", v1.version)
    client.create_model_version("tiny-math", str(root / "deleted" / "adapter"), run_id=run.info.run_id)
    return uri, run.info.run_id


@pytest.mark.parametrize("ref, generate", [("runs:/{run_id}", True), ("runs:/{run_id}/adapter", False), ("models:/tiny-math/1", False),
                                           ("models:/tiny-math@candidate", True), ("models:/tiny-math/2", False)])
def test_adapter_from_mlflow_gives_the_local_folders_answers(ref, generate, mlflow_store, adapter_dir, examples, tuned_answers, tmp_path):
    uri, run_id = mlflow_store
    target = resolve_target(ref.format(run_id=run_id), None, uri, tmp_path)
    assert target.base == BUILTIN_TINY_MODEL and target.run_id == run_id and target.tuned_kind == "adapter"
    assert target.param("data.task") == "math_sum" and target.param("data.eval_path") is None
    # Version 2's source is gone: the run's adapter is used instead. The same bytes give the same answers.
    weights = "adapter_model.safetensors"
    assert (Path(target.tuned_path) / weights).read_bytes() == (adapter_dir / weights).read_bytes()
    if generate:
        assert generate_answers(target.tuned_spec(), examples, **GEN).texts == tuned_answers


def test_evaluate_job_compares_base_and_tuned_and_logs_both(mlflow_store, tmp_path, capsys):
    from mlflow import MlflowClient

    sys.path.insert(0, str(REPO / "jobs"))
    import evaluate as job

    uri, run_id = mlflow_store
    out = tmp_path / "out"
    rc = job.main(["--adapter", f"runs:/{run_id}", "--compare-base", "--num-examples", "5", "--max-new-tokens", "8",
                   "--tracking-uri", uri, "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "base" in printed and "tuned" in printed and "delta" in printed and "format_ok" in printed

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id], "tags.`zerolab.kind` = 'eval'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "eval-math-tiny-lora" and run.data.tags["zerolab.source_run_id"] == run_id
    m = run.data.metrics
    for side in ("base", "tuned"):
        assert {f"eval/{side}/accuracy", f"eval/{side}/format_ok", f"eval/{side}/tokens_per_s", f"eval/{side}/wall_s"} <= set(m)
    assert m["eval/delta/format_ok"] == pytest.approx(m["eval/tuned/format_ok"] - m["eval/base/format_ok"])
    assert m["eval/accuracy"] == m["eval/tuned/accuracy"]
    assert run.data.params["eval.task"] == "math_sum" and run.data.params["eval.num_prompts"] == "5"

    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/examples.json", str(tmp_path))).read_text())
    assert {"prompt", "reference", "base_answer", "tuned_answer", "base_correct", "tuned_format_ok"} <= set(table["columns"])
    assert len(table["data"]) == 5
    rows = [json.loads(line) for line in (out / "examples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 5 and (out / "examples.csv").is_file()
    assert rows[0]["reference"].startswith(P)  # the run's generated eval split was used
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["eval/tuned/generated_tokens"] == sum(r["tuned_num_tokens"] for r in rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--adapter", "/no/such/adapter"], "error: --adapter: there is no adapter folder /no/such/adapter; give the adapter folder"),
        (["--adapter", "runs:/0123456789abcdef0123456789abcdef"],
         "error: --adapter: there is no MLflow run '0123456789abcdef0123456789abcdef' in sqlite:"),
        (["--adapter", "models:/no-such-model/3"], "error: --adapter: no such registered model version models:/no-such-model/3 in sqlite:"),
        (["--adapter", "runs:/{run_id}", "--task", "poetry"], "error: --task: unknown task 'poetry'; choose one of math_sum, ner_json, long_context, custom"),
        (["--adapter", "runs:/{run_id}", "--data", "/no/such/eval.json"],
         "error: --data: there is no eval file or folder /no/such/eval.json; give a JSON/JSONL/Parquet eval file"),
        (["--model", BUILTIN_TINY_MODEL, "--task", "math_sum", "--compare-base"],
         "error: --compare-base: comparing with the base model needs both a tuned model"),
        (["--adapter", "runs:/{run_id}", "--batch-size", "0"], "error: --batch-size: 0 is not allowed"),
    ],
    ids=["missing-folder", "bad-run-id", "bad-model-version", "unknown-task", "missing-data", "compare-without-adapter", "bad-batch"],
)
def test_bad_input_is_one_error_and_exit_2(args, message, mlflow_store, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "jobs"))
    import evaluate as job

    uri, run_id = mlflow_store
    rc = job.main([a.format(run_id=run_id) for a in args] + ["--tracking-uri", uri, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_bad_run_id_from_the_command_line_prints_no_traceback(mlflow_store):
    uri, _ = mlflow_store
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "evaluate.py"), "--adapter", "runs:/feedface", "--tracking-uri", uri],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: --adapter: there is no MLflow run 'feedface' in sqlite:" in proc.stderr
    assert "for the adapter reference runs:/feedface; check the run id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_export_job_writes_a_loadable_merged_model(mlflow_store, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "jobs"))
    import export as job

    uri, _ = mlflow_store
    assert job.main(["--adapter", "models:/tiny-math@candidate", "--output", str(tmp_path / "m"), "--tracking-uri", uri]) == 0
    assert "next-token agreement 100.0%" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "m").iterdir()}
    assert job.main(["--adapter", str(tmp_path / "m"), "--output", str(tmp_path / "again"), "--tracking-uri", uri]) == 2
    assert f"error: --adapter: export merges an adapter, but {tmp_path / 'm'} is a fully fine-tuned model folder" in capsys.readouterr().err


def test_compare_base_needs_a_base_for_a_full_model(tmp_path, tiny_model_path):
    target = Target(base=None, tuned_path=tiny_model_path, tuned_kind="full", source=tiny_model_path)
    options = EvalOptions(task="math_sum", data_path=default_eval_path("math_sum", 16, 1), num_examples=2, compare_base=True)
    with pytest.raises(EvaluationError, match="comparing with the base model needs both") as exc:
        run_evaluation(target, options)
    assert exc.value.input == "base comparison"
    with pytest.raises(EvaluationError, match="nothing to merge: evaluate it unmerged") as exc:
        target.tuned_spec(merge=True)
    assert exc.value.input == "merge" and "--" not in str(exc.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_generation_reports_peak_memory_and_is_deterministic(examples, adapter_dir):
    spec = LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(adapter_dir))
    first = generate_answers(spec, examples, device="cuda", dtype="bf16", **GEN)
    assert generate_answers(spec, examples, device="cuda", dtype="bf16", **GEN).texts == first.texts
    f = first.figures
    # The weights stay resident, so the generation peak is at least what loading left allocated.
    assert f["gpu_peak_load_gib"] > 0 and f["gpu_peak_generate_gib"] >= 0.9 * f["gpu_peak_load_gib"]
    assert f["tokens_per_s"] > 0
    merged = generate_answers(LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(adapter_dir), merge=True), examples,
                              device="cuda", dtype="fp32", **GEN)
    assert merged.texts == generate_answers(spec, examples, device="cuda", dtype="fp32", **GEN).texts


# --- Ray -----------------------------------------------------------------------------------------


@pytest.mark.ray
def test_ray_data_actors_give_the_answers_of_one_process(ray_cluster, examples, adapter_dir, tuned_answers):
    spec = LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(adapter_dir))
    on_actors = generate_answers(spec, examples, workers=2, **GEN)
    assert on_actors.texts == tuned_answers
    assert on_actors.figures["generated_tokens"] == sum(on_actors.num_tokens) > 0
    with pytest.raises(EvaluationError, match="64 generation workers: each actor takes one CPU and the Ray cluster has") as exc:
        generate_answers(spec, examples, workers=64, **GEN)
    assert exc.value.input == "workers"


@pytest.mark.ray
@pytest.mark.slow
def test_training_job_with_an_eval_section_evaluates_into_its_run(ray_cluster, tmp_path, tiny_model_path):
    from mlflow import MlflowClient

    from zerolab.run import run_sft

    cfg = load_config(None, tiny_overrides(tmp_path, **{"eval.enabled": "true", "eval.num_examples": 6, "eval.max_new_tokens": 8,
                                                        "train.lr": 1e-2}))
    result = run_sft(cfg)
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert {"eval/base/accuracy", "eval/tuned/accuracy", "eval/delta/format_ok", "eval/tuned/tokens_per_s", "eval/loss"} <= set(m)
    assert [h.step for h in client.get_metric_history(result.run_id, "eval/tuned/format_ok")] == [cfg.train.max_steps]
    assert {a.path for a in client.list_artifacts(result.run_id, "eval")} >= {"eval/examples.json", "eval/examples.jsonl", "eval/summary.json"}

    # The adapter the run logged, evaluated from MLflow, answers as it did inside the training job.
    target = resolve_target(f"runs:/{result.run_id}", None, result.tracking_uri, tmp_path / "dl")
    table = json.loads(Path(client.download_artifacts(result.run_id, "eval/examples.json", str(tmp_path))).read_text())
    column = table["columns"].index("tuned_answer")
    report = run_evaluation(target, EvalOptions(task="math_sum", data_path=default_eval_path("math_sum", 32, 1), num_examples=6,
                                                max_new_tokens=8, batch_size=32))
    assert report.results["tuned"].answers.texts == [row[column] for row in table["data"]]


# --- damaged files -------------------------------------------------------------------------------


def test_safetensors_check_agrees_with_the_loader_at_every_cut(adapter_dir, tmp_path):
    """The header check (shared with the relaunch's checkpoint check) finds a file damaged exactly
    where safetensors cannot load it: cut inside the length, inside the header, inside the
    tensors, or with bytes appended."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from zerolab.integrity import safetensors_problem

    whole = (adapter_dir / "adapter_model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    for size in (0, 5, 8, header_end // 2, header_end, header_end + 100, len(whole) - 1, len(whole), len(whole) + 3):
        data = whole[:size] + b"\0" * max(size - len(whole), 0)
        path = tmp_path / f"cut{size}.safetensors"
        path.write_bytes(data)
        with path.open("rb") as f:
            problem = safetensors_problem(f, len(data))
        try:
            load_file(str(path))
            loads = True
        except SafetensorError:
            loads = False
        assert (problem is None) == loads, (size, problem)
        if size == len(whole) - 1:
            assert problem == f"is truncated or damaged: its tensors need {len(whole)} bytes, the file has {size}"


def damaged_copy(source: Path, dst: Path, name: str, how: str) -> Path:
    import shutil

    shutil.copytree(source, dst)
    path = dst / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "cut" else b'{"r": 4,')
    return dst


@pytest.mark.parametrize(
    "job_name, name, how, problem",
    [
        ("evaluate", "adapter_model.safetensors", "cut", "adapter_model.safetensors is truncated or damaged: its tensors need"),
        ("evaluate", "adapter_config.json", "json", "adapter_config.json is not valid JSON (Expecting property name"),
        ("export", "adapter_model.safetensors", "cut", "adapter_model.safetensors is truncated or damaged: its tensors need"),
        ("export", "adapter_config.json", "json", "adapter_config.json is not valid JSON (Expecting property name"),
    ],
)
def test_a_damaged_adapter_is_one_error_naming_the_file_and_exit_2(job_name, name, how, problem, adapter_dir, tmp_path, capsys):
    import importlib

    sys.path.insert(0, str(REPO / "jobs"))
    job = importlib.import_module(job_name)
    folder = damaged_copy(adapter_dir, tmp_path / "adapter", name, how)
    common = ["--adapter", str(folder), "--model", BUILTIN_TINY_MODEL, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    rest = ["--task", "math_sum", "--num-examples", "2", "--compare-base", "--output-dir", str(tmp_path / "out")] \
        if job_name == "evaluate" else ["--output", str(tmp_path / "merged")]
    assert job.main(common + rest) == 2
    err = capsys.readouterr().err
    assert f"error: --adapter: the adapter {folder} is damaged: {problem}" in err
    assert "copy it again from the training run's checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()  # found before anything ran


def test_a_damaged_adapter_config_without_a_base_model_is_one_error(adapter_dir, tmp_path):
    """Without --model the base is read from the adapter's own config, which must be whole first."""
    from zerolab.reference import resolve_target

    folder = damaged_copy(adapter_dir, tmp_path / "adapter", "adapter_config.json", "json")
    with pytest.raises(EvaluationError, match=r"is damaged: adapter_config.json is not valid JSON") as exc:
        resolve_target(str(folder), None, f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "dl")
    assert exc.value.input == "adapter"


def test_a_damaged_model_folder_config_is_one_error(tmp_path, tiny_model_path):
    folder = damaged_copy(Path(tiny_model_path), tmp_path / "model", "config.json", "json")
    target = Target(base=None, tuned_path=str(folder), tuned_kind="full", source=str(folder))
    options = EvalOptions(task="math_sum", data_path=default_eval_path("math_sum", 16, 1), num_examples=2)
    with pytest.raises(EvaluationError, match=r"the model folder .* is damaged: config.json is not valid JSON") as exc:
        run_evaluation(target, options)
    assert exc.value.input == "adapter"


# --- merged generation ---------------------------------------------------------------------------


def random_adapter(method: str, folder: Path) -> Path:
    """An adapter of ``method`` made as training makes it (zerolab.adapters), with random weights
    everywhere (peft starts B, and AdaLoRA's E, at zero), saved as peft saves it."""
    from zerolab.adapters import apply_adapter as train_adapter
    from zerolab.config import AdapterSpec
    from zerolab.models import load_model

    torch.manual_seed(1)
    model = train_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method=method, r=4, alpha=8), total_steps=10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name and "magnitude" not in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(folder))
    return folder


def test_an_adalora_adapter_loads_cut_to_its_trained_ranks_without_a_warning(tmp_path):
    """AdaLoRA's pruning leaves a rank pattern in the adapter's config; loading cuts each module to
    it. peft's check of pattern keys against module names warns that those keys "were ignored":
    zerolab's loading leaves that warning out, and keeps it for keys that did not match. (Given the
    gathered state, as zerolab gives it, peft's save does not take a module pruned to no rank for a
    ZeRO-3 shard not gathered.)"""
    import json
    import warnings

    from zerolab.adapters import apply_adapter as train_adapter
    from zerolab.adapters import save_trained
    from zerolab.config import AdapterSpec
    from zerolab.generation import apply_adapter
    from zerolab.models import load_model, load_tokenizer

    torch.manual_seed(0)
    model = train_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="adalora", r=2, adalora_init_r=4), total_steps=10)
    ids = torch.randint(5, 100, (2, 16))
    for step in range(5):  # past the warm-up: the budget falls from 4 ranks per module towards 2
        model(input_ids=ids, labels=ids).loss.backward()
        model.base_model.update_and_allocate(step)
        model.zero_grad()
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_trained(model, trained, tmp_path / "adalora", load_tokenizer(ModelSpec()))
        pattern = json.loads((tmp_path / "adalora" / "adapter_config.json").read_text())["rank_pattern"]
        assert pattern and all(key.endswith(".lora_E") for key in pattern) and min(sum(kept) for kept in pattern.values()) == 0
        loaded = apply_adapter(load_model(ModelSpec(), torch.float32), str(tmp_path / "adalora"), merge=False)
    assert not [str(w.message) for w in caught if "rank_pattern" in str(w.message) or "invalid shape" in str(w.message)]
    for key, kept in pattern.items():
        assert loaded.get_submodule(f"base_model.model.{key}")["default"].shape[0] == sum(kept)

    lora = train_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="lora", r=2, alpha=4), total_steps=10)
    lora.peft_config["default"].rank_pattern = {"model.layers.0.self_attn.qproj": 4}  # a key that names no module
    lora.save_pretrained(str(tmp_path / "lora"))
    with pytest.warns(RuntimeWarning, match="rank_pattern keys did not match"):
        apply_adapter(load_model(ModelSpec(), torch.float32), str(tmp_path / "lora"), merge=False)


@pytest.fixture(scope="module")
def eval16() -> tuple[str, list[str]]:
    """The generated eval split's path and the base model's answers to its first 6 prompts."""
    path = default_eval_path("math_sum", 16, 1)
    return path, generate_answers(LoadSpec(BUILTIN_TINY_MODEL), load_examples(path, "math_sum", limit=6), **GEN).texts


@pytest.mark.parametrize("method", ["lora", "rslora", "dora", "adalora"])
def test_evaluation_merges_the_adapter_in_fp32_with_the_unmerged_answers(method, eval16, tmp_path, tiny_model_path):
    folder = random_adapter(method, tmp_path / "adapter")
    target = Target(base=BUILTIN_TINY_MODEL, tuned_path=str(folder), tuned_kind="adapter", source=str(folder))
    report = run_evaluation(target, EvalOptions(task="math_sum", data_path=eval16[0], num_examples=6, **GEN))
    assert report.options["merge"] is True and report.options["dtype"] == "fp32"
    tuned = report.results["tuned"]
    assert tuned.description.endswith("merged into the base weights (fp32: the unmerged adapter's answers)")
    assert "merged into the base weights" in report.format()
    unmerged = generate_answers(LoadSpec(BUILTIN_TINY_MODEL, adapter_path=str(folder), merge=False), report.examples, **GEN)
    assert tuned.answers.texts == unmerged.texts != eval16[1]


def test_merging_is_left_where_it_could_change_the_answers(adapter_dir, tmp_path):
    from zerolab.evaluate import merge_choice

    target = Target(base=BUILTIN_TINY_MODEL, tuned_path=str(adapter_dir), tuned_kind="adapter", source=str(adapter_dir))
    assert merge_choice(target, None, "fp32") == (True, "merged into the base weights (fp32: the unmerged adapter's answers)")
    assert merge_choice(target, None, "bf16") == (False, "unmerged (in bf16 merging would round the adapted weights once more)")
    assert merge_choice(target, True, "bf16")[0] and not merge_choice(target, False, "fp32")[0]
    ia3 = tmp_path / "ia3"
    ia3.mkdir()
    (ia3 / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    other = Target(base=BUILTIN_TINY_MODEL, tuned_path=str(ia3), tuned_kind="adapter", source=str(ia3))
    assert merge_choice(other, None, "fp32") == (False, "unmerged (IA3 adapters do not merge into the weights)")
    with pytest.raises(EvaluationError, match="is a IA3 adapter, which peft cannot merge") as exc:
        merge_choice(other, True, "fp32")
    assert exc.value.input == "merge"


# --- the printed comparison ----------------------------------------------------------------------


def test_the_comparison_says_what_each_figure_is(examples):
    from zerolab.generation import Answers
    from zerolab.scoring import EvalReport, ModelResult

    def result(label: str, format_ok: float, tokens: float, tokens_per_s: float) -> ModelResult:
        figures = {"wall_s": 2.5, "generate_s": 2.0, "tokens_per_s": tokens_per_s, "generated_tokens": tokens, "host_rss_gib": 0.5}
        summary = {"format_ok": format_ok, "correct": 0.0, "exact_match": 0.0, "accuracy": 0.0}
        return ModelResult(label=label, description=label, answers=Answers(texts=[], num_tokens=[], figures=figures), scores=[], summary=summary)

    report = EvalReport(task="math_sum", data_path="eval.json", examples=examples,
                        results={"base": result("base", 0.0, 12800, 120.0), "tuned": result("tuned", 1.0, 2207, 38.0)})
    lines = {line.split()[0]: line.split()[1:] for line in report.format().splitlines()[3:-1]}
    assert lines["format_ok"] == ["0.0%", "100.0%", "+100.0", "pts"]
    assert lines["accuracy"] == ["0.0%", "0.0%", "+0.0", "pts"]
    assert lines["generated_tokens"] == ["12,800", "tokens", "2,207", "tokens", "-10,593", "tokens"]
    assert lines["tokens_per_s"] == ["120.0", "tokens/s", "38.0", "tokens/s", "0.32x"]
    assert lines["wall_s"] == ["2.50", "s", "2.50", "s", "+0.00", "s"]
    assert report.format().splitlines()[-1].startswith("scores: % of prompts; delta: tuned - base, in percentage points")
    single = EvalReport(task="math_sum", data_path="eval.json", examples=examples, results={"tuned": report.results["tuned"]})
    assert "100.0%" in single.format() and "delta" not in single.format()


# --- the eval section without Ray ----------------------------------------------------------------


def test_the_eval_section_generates_in_this_process_when_ray_was_not_started(monkeypatch):
    import ray

    from zerolab.evaluate import eval_workers

    gpu = load_config(None, ["scaling.use_gpu=true", "scaling.num_workers=1", "eval.enabled=true"])
    cpu = load_config(None, ["scaling.num_workers=1", "eval.enabled=true", "eval.num_workers=2"])
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert eval_workers(gpu) == eval_workers(cpu) == 0
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert eval_workers(gpu) == 1 and eval_workers(cpu) == 2  # the driver of a GPU job may have no GPU: actors


def test_a_one_worker_job_without_ray_evaluates_after_training(tmp_path, tiny_model_path):
    """A one-worker job trains in its own process without starting Ray (Ray Train's local mode)
    and evaluates there too: with eval.num_workers=2 it took the Ray Data actors' path that a GPU
    job takes with any eval.num_workers, and failed (RaySystemError: Ray has not been started yet)."""
    import os

    from mlflow import MlflowClient

    overrides = tiny_overrides(tmp_path, **{"run.name": "alone-eval", "scaling.num_workers": 1, "train.max_steps": 4,
                                            "eval.enabled": "true", "eval.num_examples": 4, "eval.max_new_tokens": 4,
                                            "eval.num_workers": 2})
    cmd = [sys.executable, str(REPO / "jobs" / "sft.py"), *(a for o in overrides for a in ("--set", o))]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "it trains in this process, without starting Ray" in output and "Started a local Ray instance" not in output
    assert "eval.num_workers=2: the job trained in this process without Ray (so without Ray Data actors); it evaluates in this process" in output
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    (run,) = [r for r in client.search_runs([client.get_experiment_by_name("tests").experiment_id]) if r.info.run_name == "alone-eval"]
    assert run.info.status == "FINISHED" and run.data.params["derived.launch"] == "driver"
    assert {"eval/base/format_ok", "eval/tuned/format_ok", "eval/tuned/tokens_per_s"} <= set(run.data.metrics)
