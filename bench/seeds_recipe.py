"""The seeds' recipe, as their notes train (seeds/002, 003): Hugging Face ``Trainer`` with peft's LoRA
and a DeepSpeed JSON, launched with torchrun, every sample padded to the maximum length.

    torchrun --nproc_per_node 1 bench/seeds_recipe.py --model M --data D --out R --stage 0

As in the notes: bf16, gradient checkpointing with ``enable_input_require_grads``, AdamW at 1e-4 with
cosine decay, 3% warm-up and weight decay 0.1, a DeepSpeed JSON of ``"auto"`` values with the ZeRO
stage set, the Trainer's own optimizer and defaults. Two departures, neither of which changes the
work per step: padding tokens are masked out of the loss (the notes trained on them), and the
adapter is the benchmark's (r=16, alpha 32, no dropout, all linear layers) rather than their r=8.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench.measure import StepMeter, model_counts, write_rank_result  # noqa: E402
from bench.workload import row_counts, tokenized_rows  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class PaddedToMax(torch.utils.data.Dataset):
    """Every row padded on the right to ``max_length``: the seeds' ``padding="max_length"``."""

    def __init__(self, rows: list, max_length: int, pad_id: int) -> None:
        self.rows, self.max_length, self.pad_id = [r for r in rows if len(r[0]) <= max_length], max_length, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.rows[i]
        n, pad = len(ids), self.max_length - len(ids)
        return {"input_ids": torch.tensor(list(ids) + [self.pad_id] * pad),
                "attention_mask": torch.tensor([1] * n + [0] * pad),
                "labels": torch.tensor(list(labels) + [-100] * pad)}


def main(argv: list[str] | None = None) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-seq-length", type=int, default=4096)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="seeds-recipe-"))
    ds_json = work / f"ds_stage{args.stage}.json"
    ds_json.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": args.stage}}))
    training_args = TrainingArguments(
        output_dir=str(work / "out"), per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1,
        gradient_checkpointing=True, max_steps=args.steps, learning_rate=1e-4, warmup_steps=0.03, weight_decay=0.1,
        lr_scheduler_type="cosine", logging_steps=args.steps, save_strategy="no", report_to=[], bf16=torch.cuda.is_available(),
        deepspeed=str(ds_json), seed=42, disable_tqdm=True, dataloader_num_workers=0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32  # fp32 only in the CPU smoke test
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"))
    if training_args.gradient_checkpointing:
        model.enable_input_require_grads()
    total, trainable = model_counts(model)
    dataset = PaddedToMax(tokenized_rows(args.data, args.model), args.max_seq_length, tokenizer.pad_token_id)
    meter = StepMeter(torch.device("cuda", training_args.local_process_index) if torch.cuda.is_available() else torch.device("cpu"))
    counted: list[torch.Tensor] = []

    class MeteredTrainer(Trainer):
        def training_step(self, model, inputs, *rest, **kwargs):  # type: ignore[override]
            counted.append(inputs["attention_mask"].sum())  # stays on the device: no sync
            return super().training_step(model, inputs, *rest, **kwargs)

    class Meter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[override]
            meter.step_done(sum(counted) if counted else 0)
            counted.clear()

    MeteredTrainer(model=model, args=training_args, train_dataset=dataset, callbacks=[Meter()]).train()
    result = meter.result(args.window)
    result.update(row_counts(dataset.rows), total_params=total, trainable_params=trainable, world=training_args.world_size,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    write_rank_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
