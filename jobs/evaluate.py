"""Evaluate a fine-tuned model on its task, side by side with its base model: greedy answers to
held-out prompts, the task's scores, generation speed and peak memory.

    ray job submit --working-dir . -- python jobs/evaluate.py --adapter runs:/<run_id> --compare-base
    python jobs/evaluate.py --adapter models:/math-tiny-lora@candidate --compare-base --num-examples 100
    python jobs/evaluate.py --adapter ~/zerolab_runs/math-tiny-lora/checkpoint_0000114/adapter --task math_sum --data held_out.json
    python jobs/evaluate.py --model Qwen/Qwen2.5-7B-Instruct --task ner_json --data ner_eval.jsonl --workers 4 --device cuda

--adapter takes a folder (a PEFT adapter, or a fully fine-tuned model), runs:/<run_id>[/<path>] (the
adapter a training run logged) or models:/<name>/<version> | models:/<name>@<alias> (a registered
version). The base model, task, system prompt and eval split come from the training run when not
given. Results go to a new MLflow run (eval/*, eval/base/*, eval/tuned/*, eval/delta/* and the
per-example table) and to --output-dir. A LoRA, rsLoRA, DoRA or AdaLoRA adapter generates merged
into the base weights in fp32 (as fast as the base model, the same answers); in bf16/fp16 on top of
them unless --merge. Exit codes: 0 done, 2 bad input, a damaged adapter included (nothing was evaluated).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)

FLAGS = {"adapter": "--adapter", "model": "--model", "task": "--task", "data": "--data", "base comparison": "--compare-base",
         "merge": "--merge", "workers": "--workers", "device": "--device", "dtype": "--dtype"}
"""The flag that gives each input an EvaluationError can be about (its ``input``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", help="folder, runs:/<run_id>[/<path>], models:/<name>/<version> or models:/<name>@<alias>")
    parser.add_argument("--model", help="base model: hub id, folder or builtin:tiny-qwen2 (default: the training run's)")
    parser.add_argument("--quantization", choices=["none", "nf4", "fp4", "int8"],
                        help="load the base quantized (bitsandbytes), as a QLoRA adapter was trained (default: the training run's model.quantization)")
    parser.add_argument("--task", help="math_sum, ner_json or custom (default: the training run's)")
    parser.add_argument("--data", help="eval file or folder (default: the training run's eval split)")
    parser.add_argument("--num-examples", type=int, help="evaluate the first N prompts only")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated together (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest answer (default 64)")
    parser.add_argument("--compare-base", action="store_true", help="also evaluate the base model on the same prompts")
    parser.add_argument("--merge", action=argparse.BooleanOptionalAction,
                        help="generate with the adapter merged into the base weights (--merge) or on top of them (--no-merge); "
                             "default: merged where that gives the same answers (a LoRA-family adapter in fp32)")
    parser.add_argument("--workers", type=int, default=0, help="Ray Data actors that generate (one GPU each on cuda); 0: this process")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ~/zerolab_runs/mlflow.db, beside the runs)")
    parser.add_argument("--experiment", help="MLflow experiment of the eval run (default: the training run's)")
    parser.add_argument("--run-name", help="MLflow run name (default: eval-<training run name>)")
    parser.add_argument("--output-dir", help="where examples.jsonl/.csv and summary.json go (default: eval_outputs/<run name>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    from mlflow.exceptions import MlflowException

    from zerolab.cli import USER_ERROR
    from zerolab.errors import EvaluationError, UserError
    from zerolab.evaluate import default_run_name, log_eval_run, options_for, run_evaluation
    from zerolab.reference import resolve_target
    from zerolab.tracking import tracking_uri

    uri = tracking_uri(args.tracking_uri)
    try:
        problems = [f"--{k.replace('_', '-')}: {v} is not allowed; use a positive number" for k, v in
                    (("num_examples", args.num_examples), ("batch_size", args.batch_size), ("max_new_tokens", args.max_new_tokens))
                    if v is not None and v < 1]
        if args.workers < 0:
            problems.append(f"--workers: {args.workers} is not allowed; use 0 (this process) or more")
        if problems:
            raise EvaluationError("; ".join(problems))
        with tempfile.TemporaryDirectory(prefix="zerolab-eval-") as tmp:
            target = resolve_target(args.adapter, args.model, uri, tmp, quantization=args.quantization)
            options = options_for(target, task=args.task, data_path=args.data, num_examples=args.num_examples,
                                  batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, compare_base=args.compare_base,
                                  merge=args.merge, workers=args.workers, device=args.device, dtype=args.dtype)
            if args.workers > 0:
                _connect_ray(args.device)
            report = run_evaluation(target, options)
            run_name = args.run_name or default_run_name(target)
            written = report.write(args.output_dir or Path("eval_outputs") / run_name)
            run_id = log_eval_run(report, target, uri, experiment=args.experiment, run_name=run_name)
    except (UserError, MlflowException) as exc:
        flag = FLAGS.get(exc.input) if isinstance(exc, EvaluationError) and exc.input else None
        print(f"\nerror: {flag + ': ' if flag else ''}{exc}", file=sys.stderr)
        return USER_ERROR

    print()
    print(report.format())
    print(f"\nper-example answers  {written[0].parent}/  (examples.jsonl, examples.csv, summary.json)")
    print(f"MLflow run           {run_name} ({run_id}); mlflow ui --backend-store-uri {uri}")
    return 0


def _connect_ray(device: str) -> None:
    from zerolab.cluster import connect_ray
    from zerolab.config import load_config
    from zerolab.generation import resolve_device

    connect_ray(load_config(None, [f"scaling.use_gpu={str(resolve_device(device) == 'cuda').lower()}"]))


if __name__ == "__main__":
    sys.exit(main())
