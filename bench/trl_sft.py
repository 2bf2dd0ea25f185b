"""TRL's ``SFTTrainer`` on the benchmark's model and rows, set up as TRL's documentation advises for speed.

    python bench/trl_sft.py --model M --data D --out R --steps 12 --window 6 --micro-batch 2 --attn auto
    torchrun --nproc_per_node 2 bench/trl_sft.py ...   # several GPUs (one GPU: plain python, as TRL's users start it)

The rows are the benchmark's own tokenization (``bench/workload.py``, which tokenizes as zerolab's
pipeline does), rows longer than ``--max-seq-length`` left out as zerolab leaves them out, handed to
TRL pre-tokenized with their labels (prompt tokens -100): TRL trains the same tokens and loss
targets as every other system. The adapter is the benchmark's (LoRA r=16, alpha 32, no dropout, all
seven linear projections), AdamW at 1e-4 with cosine decay, 3% warm-up, weight decay 0.1, gradient
clipping at 1.0, seed 42, gradient accumulation 1.

TRL's advice for speed: packing with best-fit decreasing into sequences of ``--max-seq-length``
tokens (``packing=True, packing_strategy="bfd"``) and padding-free batches (``padding_free=True``),
``--micro-batch`` packed sequences per step, which is zerolab's tokens per step; Liger's layer
kernels (``use_liger_kernel``) on a GPU where ``liger_kernel`` imports, with TRL's own fused LM head
(always on in TRL 1.x: the loss chunk by chunk, no full logits; TRL turns Liger's fused loss off
for it); torch's fused AdamW; bf16 (fp32 on CPU, as the other CPU smoke runs). With
``--quantization nf4|int8`` the base loads quantized as TRL's and peft's QLoRA guides do
(``BitsAndBytesConfig``: nf4 with double quantization and bf16 compute, packed bytes in uint8;
LLM.int8()), and SFTTrainer prepares it itself (peft's ``prepare_model_for_kbit_training``). Attention
(``--attn auto``): ``flash_attention_2`` where the flash-attn package imports, else PyTorch's
varlen FlashAttention (zerolab's ``varlen_attention_forward``, registered with transformers'
``AttentionInterface`` after its self-check on this GPU), else ``sdpa``; the result names the one used.

Timing is the seeds recipe's: :class:`bench.measure.StepMeter` at each optimizer step's end (a
``TrainerCallback``), the step's non-padding tokens counted on the device. The result also holds
what TRL's prepared (packed) dataset contains: its rows, tokens and loss targets, which must be
zerolab's (``train_rows``, ``train_tokens``, ``train_target_tokens``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench.measure import StepMeter, model_counts, write_rank_result  # noqa: E402
from bench.workload import tokenized_rows  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ("auto", "flash_attention_2", "varlen", "flex_attention", "sdpa")

logger = logging.getLogger("bench.trl_sft")


def pick_attention(requested: str, device: torch.device) -> str:
    """The ``attn_implementation`` to load the model with (see the module's docstring for ``auto``);
    ``varlen`` becomes zerolab's registered varlen function, or ``sdpa`` where that kernel cannot run."""
    from zerolab.kernels import resolve_attention

    if requested == "auto":
        if device.type == "cuda" and _flash_attn_imports():
            return "flash_attention_2"
        requested = "varlen"
    return resolve_attention(requested, device if device.type == "cuda" else None)


def _flash_attn_imports() -> bool:
    try:
        import flash_attn  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # a wheel built for another torch or CUDA fails to load
        logger.info("flash-attn does not import (%s: %s)", type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return False
    return True


def qlora_config(quantization: str, dtype: torch.dtype):
    """The ``BitsAndBytesConfig`` of TRL's and peft's QLoRA examples: nf4, double quantization,
    ``dtype`` compute, bitsandbytes' default (uint8) storage; or LLM.int8()."""
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)


def trained_data(dataset) -> dict[str, int]:
    """Rows, tokens and loss targets of TRL's prepared (packed) dataset, read back from its columns."""
    import numpy as np
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    seq_lengths = pc.list_flatten(table["seq_lengths"]).to_numpy()
    labels = pc.list_flatten(table["labels"]).to_numpy()
    return {"train_rows": int(len(seq_lengths)), "train_tokens": int(seq_lengths.sum()),
            "train_target_tokens": int(np.count_nonzero(labels != -100))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--max-seq-length", type=int, default=4096)
    p.add_argument("--attn", choices=ATTENTION, default="auto")
    p.add_argument("--kernels", choices=["auto", "none"], default="auto", help="auto: Liger's layer kernels where they run")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--quantization", choices=["none", "nf4", "int8"], default="none", help="a quantized base (QLoRA)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the measured steps, profile this many more, then as many again with the GPU's activity alone, "
                        "and print where the GPU time goes (as bench/torchrun_loop.py does for zerolab's step)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    liger = args.kernels == "auto" and cuda and importlib.util.find_spec("liger_kernel") is not None
    training_args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sft-"), max_length=args.max_seq_length, packing=True, packing_strategy="bfd",
        padding_free=True, per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1,
        gradient_checkpointing=args.gradient_checkpointing, use_liger_kernel=liger, optim="adamw_torch_fused", bf16=cuda,
        max_steps=args.steps + 2 * args.profile_steps, learning_rate=1e-4, lr_scheduler_type="cosine", warmup_steps=0.03, weight_decay=0.1,
        max_grad_norm=1.0, seed=42, logging_steps=args.steps, save_strategy="no", report_to=[], disable_tqdm=True)
    device = training_args.device
    attn = pick_attention(args.attn, device)
    rows = [r for r in tokenized_rows(args.data, args.model) if len(r[0]) <= args.max_seq_length]
    dataset = Dataset.from_dict({"input_ids": [ids.tolist() for ids, _ in rows], "labels": [lab.tolist() for _, lab in rows]})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.bfloat16 if cuda else torch.float32
    quantized = {"device_map": {"": device}, "quantization_config": qlora_config(args.quantization, dtype)} if args.quantization != "none" else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attn, **quantized)
    model.config.use_cache = False
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    meter = StepMeter(device)
    counted: list[torch.Tensor | int] = []

    class MeteredTrainer(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):  # type: ignore[override]
            # Padding-free batches have no padding and no attention mask; any other counts its mask (no sync either way).
            counted.append(inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["input_ids"].numel())
            return super().training_step(model, inputs, *rest, **kwargs)

    class Meter(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):  # type: ignore[override]
            if state.global_step <= args.steps:
                meter.step_done(sum(counted) if counted else 0)
            counted.clear()

    class Profiler(TrainerCallback):
        """The ``n`` steps after the measured ones with the host and the GPU recorded (the GPU's time
        by kind of kernel), then ``n`` more with the GPU's activity alone (where it waits for the host)."""

        prof, start, n = None, 0.0, args.profile_steps

        def on_step_begin(self, args_, state, control, **kwargs):  # type: ignore[override]
            from torch.profiler import ProfilerActivity, profile

            if state.global_step in (args.steps, args.steps + self.n):
                activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if state.global_step == args.steps else [])
                torch.cuda.synchronize()
                self.prof, self.start = profile(activities=activities, record_shapes=True).__enter__(), time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):  # type: ignore[override]
            from bench.torchrun_loop import print_idle_gaps, print_kernel_time

            if self.prof is not None and state.global_step in (args.steps + self.n, args.steps + 2 * self.n):
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - self.start) * 1e3 / self.n
                self.prof.__exit__(None, None, None)
                if state.global_step == args.steps + self.n:
                    print_kernel_time(self.prof, self.n, wall_ms)
                else:
                    print_idle_gaps(self.prof.events(), self.n, wall_ms)
                self.prof = None

    callbacks = [Meter(), *([Profiler()] if args.profile_steps else [])]

    trainer = MeteredTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                             callbacks=callbacks)
    total, trainable = model_counts(trainer.model)
    logger.info("TRL %s: attention %s, Liger layer kernels %s, base %s, %d packed sequences", importlib.metadata.version("trl"), attn,
                "on" if liger else "off", args.quantization, len(trainer.train_dataset))
    trainer.train()
    result = meter.result(args.window)
    result.update(trained_data(trainer.train_dataset), attn=attn, total_params=total, trainable_params=trainable,
                  world=training_args.world_size, device=torch.cuda.get_device_name() if cuda else "cpu")
    write_rank_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
