"""Generation-based evaluation: answer held-out prompts with a model, score the answers with the
task's scorer, and compare a fine-tuned model with its base on the same prompts; the report goes
to MLflow. What is evaluated is a :class:`~zerolab.reference.Target`; the answers come from
:mod:`zerolab.generation` and their scores from :mod:`zerolab.scoring`.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zerolab import tracking
from zerolab.data import dataset_paths
from zerolab.errors import EvaluationError
from zerolab.generation import (
    DTYPES,
    MERGEABLE_METHODS,
    Device,
    DType,
    adapter_method,
    check_target_files,
    default_eval_path,
    generate_answers,
    load_examples,
    resolve_device,
    resolve_dtype,
)
from zerolab.reference import LoadSpec, Target, find_model_folder
from zerolab.scoring import EvalReport, ModelResult, score_answers
from zerolab.tasks import TASKS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalOptions:
    task: str
    data_path: str
    num_examples: int | None = None
    """The first N rows of the eval file; None: all."""
    system_prompt: str | None = None
    batch_size: int = 16
    max_new_tokens: int = 64
    compare_base: bool = False
    merge: bool | None = None
    """Generate with the adapter merged into the base weights (True) or on top of them (False);
    None: merged where that gives the same answers (:func:`merge_choice`)."""
    workers: int = 0
    """0: generate in this process; N: on N Ray Data actors (one GPU each on cuda)."""
    device: Device = "auto"
    dtype: DType = "auto"


def run_evaluation(target: Target, options: EvalOptions) -> EvalReport:
    """Generate and score the answers of the tuned model (and, with ``compare_base``, of the base
    model first) on the same prompts."""
    if options.task not in TASKS:
        raise EvaluationError(f"unknown task '{options.task}'; choose one of {', '.join(TASKS)}", input="task")
    if options.compare_base and (target.tuned_path is None or target.base is None):
        raise EvaluationError("comparing with the base model needs both a tuned model (an adapter or model folder, runs:/ or models:/ reference) and its base model (given, or named by the training run)",
                              input="base comparison")
    device = resolve_device(options.device)
    dtype = {v: k for k, v in DTYPES.items()}[resolve_dtype(options.dtype, device)]
    check_target_files(target)
    merge, how = merge_choice(target, options.merge, dtype)
    examples = load_examples(options.data_path, options.task, system_prompt=options.system_prompt, limit=options.num_examples)
    tuned = target.tuned_spec(merge=merge)
    runs: list[tuple[str, LoadSpec, str]] = []
    if options.compare_base or tuned is None:
        runs.append(("base", target.base_spec(), str(target.base)))  # type: ignore[arg-type]
    if tuned is not None:
        what = f"adapter {target.source} on {target.base}, {how}" if target.tuned_kind == "adapter" \
            else f"fully fine-tuned model {target.source}"
        runs.append(("tuned", tuned, what))
    results = {}
    for label, spec, description in runs:
        logger.info("evaluating %s (%s) on %d prompts", label, description, len(examples))
        answers = generate_answers(spec, examples, batch_size=options.batch_size, max_new_tokens=options.max_new_tokens,
                                   device=device, dtype=dtype, workers=options.workers)
        scores, summary = score_answers(options.task, examples, answers.texts)
        results[label] = ModelResult(label=label, description=description, answers=answers, scores=scores, summary=summary)
    return EvalReport(task=options.task, data_path=options.data_path, examples=examples, results=results,
                      options={**asdict(options), "merge": merge, "device": device, "dtype": dtype})


def merge_choice(target: Target, asked: bool | None, dtype: str) -> tuple[bool, str]:
    """Whether the tuned model generates with its adapter merged into the base weights, and how
    the report says so. A merged layer computes one matrix product where the unmerged one computes
    three (W·x, A·x and B·(A·x)) and adds, so the merged model generates as fast as the base model
    (1.6× the unmerged speed for the tiny model's trained adapter, docs/evaluation.md). ``asked``
    None merges where the answers stay those of the unmerged adapter: a LoRA-family adapter
    (MERGEABLE_METHODS) in fp32, where W + s·BA is exact to fp32 rounding (the same greedy answers,
    200 of 200). In bf16 or fp16 it stays unmerged unless asked: the sum is rounded to the 16-bit
    weight's 8 (bf16) or 11 (fp16) significant bits, an update smaller than half the weight's
    rounding step is lost, and the merged tiny model answered 46 of 200 prompts differently in bf16."""
    if target.tuned_kind != "adapter" or target.tuned_path is None:
        return bool(asked), ""
    method = adapter_method(target.tuned_path)
    mergeable = method in MERGEABLE_METHODS
    if asked and not mergeable:
        raise EvaluationError(f"the adapter {target.source} is a {method} adapter, which peft cannot merge into the base weights; evaluate it unmerged",
                              input="merge")
    if target.quantization != "none":
        if asked:
            raise EvaluationError(f"the adapter {target.source} was trained on a {target.quantization} base, whose weights peft can "
                                  "merge into only by quantizing the sum again (losing the update); evaluate it unmerged, or "
                                  "export it merged into the dequantized base (jobs/export.py) and evaluate that folder", input="merge")
        return False, f"unmerged (on the {target.quantization} base it was trained on)"
    if asked is not None:
        return asked, "merged into the base weights" if asked else "unmerged (on top of the base weights)"
    if not mergeable:
        return False, f"unmerged ({method} adapters do not merge into the weights)"
    if dtype != "fp32":
        return False, f"unmerged (in {dtype} merging would round the adapted weights once more)"
    return True, "merged into the base weights (fp32: the unmerged adapter's answers)"


def options_for(target: Target, *, task: str | None = None, data_path: str | None = None, **kwargs: Any) -> EvalOptions:
    """EvalOptions with the task, eval file and system prompt taken from the training run of
    ``target`` where not given: its ``data.task``, its ``data.eval_path`` (when that file is
    here), else the generated eval split its run held out."""
    task = task or target.param("data.task")
    if task is None:
        raise EvaluationError(f"no task given and none known from a training run; choose one of {', '.join(TASKS)}", input="task")
    if task not in TASKS:
        raise EvaluationError(f"unknown task '{task}'; choose one of {', '.join(TASKS)}", input="task")
    if data_path is None:
        run_eval = target.param("data.eval_path")
        if run_eval and ("://" in run_eval or Path(run_eval).expanduser().exists()):
            data_path = run_eval
        else:
            if run_eval:
                logger.warning("the run's eval file %s is not on this machine; using the task's generated eval split", run_eval)
            data_path = default_eval_path(task, int(target.param("data.num_eval_rows") or 200), int(target.param("data.seed") or 0) + 1)
    elif "://" not in data_path and not Path(data_path).expanduser().exists():
        raise EvaluationError(f"there is no eval file or folder {data_path}; give a JSON/JSONL/Parquet eval file", input="data")
    return EvalOptions(task=task, data_path=data_path, system_prompt=target.param("data.system_prompt"), **kwargs)


# --- MLflow --------------------------------------------------------------------------------------


def log_report(report: EvalReport, uri: str, run_id: str, *, step: int = 0) -> None:
    """Metrics (``eval/*``), the per-example table (``mlflow.log_table``: ``eval/examples.json``)
    and the files of :meth:`EvalReport.write` (under ``eval/``) into the MLflow run ``run_id``."""

    tracking.MetricsLogger(uri, run_id).log({k: v for k, v in report.metrics().items() if math.isfinite(v)}, step=step)
    rows = report.table()
    tracking.log_table(uri, run_id, {k: [row[k] for row in rows] for k in rows[0]}, "eval/examples.json")
    with tempfile.TemporaryDirectory() as tmp:
        report.write(tmp)
        tracking.log_artifact(uri, run_id, tmp, "eval")


def log_eval_run(report: EvalReport, target: Target, uri: str, *, experiment: str | None = None, run_name: str | None = None) -> str:
    """Record a standalone evaluation as its own MLflow run (tagged with the training run it
    evaluates) in ``experiment``, else the training run's experiment, else ``zerolab``; returns its id."""

    if experiment is None:
        experiment = tracking.mlflow_client(uri).get_experiment(target.experiment_id).name if target.experiment_id else "zerolab"
    run_name = run_name or default_run_name(target)
    tags = {"zerolab.kind": "eval", "task": report.task, "model": str(target.base)}
    if target.run_id:
        tags["zerolab.source_run_id"] = target.run_id
    with tracking.tracked_run(uri, experiment, run_name, tags=tags, new=True) as run:
        params = {f"eval.{k}": v for k, v in report.options.items()}
        params.update({"eval.base_model": target.base, "eval.tuned": target.source, "eval.num_prompts": len(report.examples)})
        run.log_params(params)
        log_report(report, uri, run.run_id)
        run.status = "FINISHED"
    return run.run_id


def default_run_name(target: Target) -> str:
    """``eval-<training run name>``, else ``eval-<adapter or model folder name>``, as MLflow and folders accept it."""
    import re

    what = target.run_name or Path(str(target.source or target.base).rstrip("/")).name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"eval-{what}")[:128]


def evaluate_after_training(cfg: Any, uri: str, run_id: str, tuned_folder: str | Path, *, step: int = 0) -> EvalReport:
    """The ``eval`` section of a training job: evaluate what was just trained (against its base
    with ``eval.compare_base``) on the job's eval split and log it into the training run."""

    e = cfg.eval
    tuned, kind = find_model_folder(Path(tuned_folder), str(tuned_folder))
    target = Target(base=cfg.model.name_or_path, tuned_path=str(tuned), tuned_kind=kind, source=str(tuned_folder), run_id=run_id,
                    quantization=cfg.model.quantization,
                    rope=(cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_original_max_position_embeddings))
    options = EvalOptions(task=cfg.data.task, data_path=dataset_paths(cfg)["eval"], num_examples=e.num_examples or None,
                          system_prompt=cfg.data.system_prompt, batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                          compare_base=e.compare_base, workers=eval_workers(cfg), device="cuda" if cfg.scaling.use_gpu else "cpu",
                          dtype=cfg.precision())
    report = run_evaluation(target, options)
    log_report(report, uri, run_id, step=step)
    logger.info("evaluation after training:\n%s", report.format())
    return report


def eval_workers(cfg: Any) -> int:
    """Where the ``eval`` section generates: 0 for the job's own process, else that many Ray Data
    actors. With Ray connected, a GPU job generates on GPU actors (its driver may have no GPU) and
    a CPU job on ``eval.num_workers`` actors when that is more than one. A job that trained in its
    own process without Ray (one worker on a machine of its own, ``cluster.needs_ray``) has no
    actors to use, and that process holds the device it trained on: it generates there."""
    import ray

    e = cfg.eval
    if not ray.is_initialized():
        if e.num_workers > 1:
            logger.info("eval.num_workers=%d: the job trained in this process without Ray (so without Ray Data actors); "
                        "it evaluates in this process, on the %s it trained on", e.num_workers, "GPU" if cfg.scaling.use_gpu else "CPU")
        return 0
    return e.num_workers if cfg.scaling.use_gpu or e.num_workers > 1 else 0
