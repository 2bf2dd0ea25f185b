"""Merge a trained adapter into its base model's weights and write a model folder that
``AutoModelForCausalLM.from_pretrained`` (and vLLM, TGI, llama.cpp's converter) loads as is.

    ray job submit --working-dir . -- python jobs/export.py --adapter runs:/<run_id> --output /shared/models/math-tiny-merged
    python jobs/export.py --adapter models:/math-tiny-lora@candidate --output merged/ --dtype bf16
    python jobs/export.py --adapter ~/zerolab_runs/math-tiny-lora/checkpoint_0000114/adapter --output merged/

The base model comes from the training run (or the adapter's config) unless --model gives it. The
written folder is loaded back and its logits are checked against the unmerged adapter's.
Exit codes: 0 written and checked, 2 bad input (a damaged adapter file included) or a failed check.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap  # noqa: E402,F401  (makes zerolab importable from a checkout)

FLAGS = {"adapter": "--adapter", "model": "--model", "output": "--output"}
"""The flag that gives each input an EvaluationError can be about (its ``input``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="folder, runs:/<run_id>[/<path>], models:/<name>/<version> or models:/<name>@<alias>")
    parser.add_argument("--output", required=True, help="folder to write the merged model to (must be new or empty)")
    parser.add_argument("--model", help="base model: hub id, folder or builtin:tiny-qwen2 (default: the training run's)")
    parser.add_argument("--quantization", choices=["none", "nf4", "fp4", "int8"],
                        help="the base the adapter was trained on (default: the training run's model.quantization); a quantized "
                             "base is dequantized and the adapter merged into those weights")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto", help="auto: the base model's stored dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ~/zerolab_runs/mlflow.db, beside the runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

    from mlflow.exceptions import MlflowException

    from zerolab.cli import USER_ERROR
    from zerolab.errors import EvaluationError, UserError
    from zerolab.export import export_merged
    from zerolab.reference import resolve_target
    from zerolab.tracking import tracking_uri

    try:
        with tempfile.TemporaryDirectory(prefix="zerolab-export-") as tmp:
            target = resolve_target(args.adapter, args.model, tracking_uri(args.tracking_uri), tmp, quantization=args.quantization)
            result = export_merged(target, args.output, dtype=args.dtype, overwrite=args.overwrite)
    except (UserError, MlflowException) as exc:
        flag = FLAGS.get(exc.input) if isinstance(exc, EvaluationError) and exc.input else None
        print(f"\nerror: {flag + ': ' if flag else ''}{exc}", file=sys.stderr)
        return USER_ERROR

    base = f"{target.base}, dequantized from {target.quantization}" if target.quantization != "none" else target.base
    print(f"\nmerged {args.adapter} into {base} ({result['dtype']})")
    print(f"wrote  {result['output']}: {', '.join(result['files'])}")
    print(f"check  reloaded logits vs the unmerged adapter: max |diff| {result['max_logit_diff']:.2e}, "
          f"next-token agreement {result['next_token_agreement']:.1%}")
    print(f"load   AutoModelForCausalLM.from_pretrained({result['output']!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
