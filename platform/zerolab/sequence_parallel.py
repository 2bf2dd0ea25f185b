"""Ulysses sequence parallelism (``scaling.sequence_parallel_size``), on DeepSpeed's ALST pieces for
Hugging Face models (``deepspeed.runtime.sequence_parallel``).

The workers form groups of ``sp`` consecutive ranks (DeepSpeed's ``parallel_state_sp``); the ranks of
a group read the same data shard and the same micro-batches, and each keeps one ``1/sp`` slice of
every sequence (:func:`shard_batch`). Everything but attention works on the slice as it is (per-token
layers need no other token); in each attention layer ``UlyssesSPAttentionHF`` swaps the sequence
split for a head split (all-to-all), so each rank attends over the whole sequence for ``1/sp`` of the
heads, and swaps back. The loss of a slice is computed from labels shifted *before* slicing (a slice's
last token predicts the first token of the next slice), so the slices' token losses are exactly the
unsliced sequence's.

The loss: each rank's summed token loss is divided by the step's target count over all ranks times
``1/dp`` (``dp = num_workers / sp``); DeepSpeed, told the sequence-parallel size, sums gradients over
all ranks and divides by ``dp``, which gives the token mean of the step (``zerolab.train.optimizer_step``).

:class:`UlyssesAttention` holds the one process-wide change: transformers' attention function of the
model's implementation replaced by the sequence-parallel one, from :meth:`~UlyssesAttention.enable`
(before the model loads) until :meth:`~UlyssesAttention.close`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from zerolab.batches import CU_SEQLENS_KEY, IGNORE_INDEX, Batch


def head_problems(sp: int, model_config: Any, model_name: str) -> list[str]:
    """What the model's attention heads rule out for ``sp`` ranks per sequence: Ulysses gives each
    rank ``heads / sp`` query heads, and ``kv_heads / sp`` key/value heads (or one, replicated, where
    ``sp`` is a multiple of ``kv_heads``)."""
    if sp <= 1:
        return []

    def get(key: str) -> Any:
        return model_config.get(key) if isinstance(model_config, dict) else getattr(model_config, key, None)

    heads = get("num_attention_heads")
    kv = get("num_key_value_heads") or heads
    if not heads:
        return []
    p = []
    if heads % sp:
        fits = [n for n in range(2, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
        p.append(f"scaling.sequence_parallel_size: {sp} does not divide the {heads} attention heads of {model_name} "
                 f"(each rank attends with heads / sequence_parallel_size of them); use one of {fits}")
    elif kv % sp and sp % kv:
        p.append(f"scaling.sequence_parallel_size: {sp} and the {kv} key/value heads of {model_name} divide neither "
                 f"way (each rank needs whole key/value heads, or one replicated); use a divisor or a multiple of {kv}")
    return p


def shard_batch(batch: Batch, sp_rank: int, sp: int) -> Batch:
    """Rank ``sp_rank``'s slice of every sequence of ``batch`` (of a group of ``sp``): input ids,
    ``position_ids`` (the sequence's own: ``0..S-1``, or the packer's per-sample ones), and as
    ``labels`` the labels already shifted by one (passed as ``shift_labels`` too: transformers'
    loss then takes them as they are; it computes a loss only where ``labels`` is given). The
    attention mask is dropped: the batcher pads on the right, so causal attention alone keeps real
    tokens from padding (ALST's attention discards masks). ``packed_cu_seqlens`` stays whole, since
    attention sees the whole sequence.

    ``num_targets`` counts the slice's targets (what its loss is divided by); ``num_tokens`` (for
    throughput only) is the batch's, split evenly over the group. The batch's width must be a
    multiple of ``sp`` (``MicroBatches(width_multiple=sp)``)."""
    inputs = batch.inputs
    ids = inputs["input_ids"]
    rows, width = ids.shape
    assert width % sp == 0, (width, sp)
    chunk = width // sp
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(width, dtype=torch.long).expand(rows, width)
    shifted = torch.nn.functional.pad(inputs["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
    labels = shifted[:, part].contiguous()
    out = {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
           "labels": labels, "shift_labels": labels}
    if CU_SEQLENS_KEY in inputs:
        out[CU_SEQLENS_KEY] = inputs[CU_SEQLENS_KEY]
    tokens = batch.num_tokens // sp + (sp_rank < batch.num_tokens % sp)
    return Batch(inputs=out, num_tokens=tokens, num_targets=int((labels != IGNORE_INDEX).sum()))


class UlyssesAttention:
    """The sequence-parallel attention and groups of one training run (nothing when ``sp`` is 1).

    :meth:`enable` forms DeepSpeed's sequence-parallel groups and puts the Ulysses attention in
    place of transformers' attention function of the model's implementation (the "sdpa" key
    itself, as ALST's ``register_with_transformers`` does, so that every code path that asks for
    that implementation stays). It is built here rather than by ``register_with_transformers``,
    which fixes the micro-batch's row count when it registers: the last micro-batch of a pass and
    the eval batches hold fewer rows."""

    def __init__(self) -> None:
        self.sp = 1
        self.rank = 0
        self.mpu: Any = None
        self._restore: tuple[str, Any] | None = None

    def enable(self, sp: int, attn_implementation: str, model_config: Any, *, packing: bool, micro_batch_size: int) -> None:
        """For ``sp`` > 1: the groups, and the Ulysses attention around ``attn_implementation`` (the
        name the model loads with, ``zerolab.kernels.resolve_attention``'s)."""
        if sp <= 1:
            return
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if attn_implementation == "eager":
            raise ValueError("Ulysses attention drops the 4D mask eager attention needs; use sdpa")
        if packing and attn_implementation == "sdpa":
            # model.attn_implementation=varlen falls back to sdpa where its kernel is missing.
            raise RuntimeError("data.packing with scaling.sequence_parallel_size > 1 needs attention that reads the "
                               "samples' boundaries (varlen or flash_attention_2), and this worker has sdpa, which would let "
                               "packed samples attend to each other; set data.packing=false")
        mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
        arch = model_config.get_text_config()
        core = ALL_ATTENTION_FUNCTIONS[attn_implementation]
        uattn = _ulysses_attention_class()(
            attn=core, batch_size=micro_batch_size, attn_head_count=arch.num_attention_heads,
            attn_head_size=getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads,
            kv_head_count=arch.num_key_value_heads, num_hidden_layers=arch.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=True)
        uattn.core_attn_implementation = attn_implementation

        def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            # The mask transformers built is the local slice's; attention runs over the whole sequence.
            return uattn(module, query, key, value, None, *args, **kwargs)

        ALL_ATTENTION_FUNCTIONS[attn_implementation] = attention
        self._restore = (attn_implementation, core)
        self.sp, self.rank, self.mpu = sp, mpu.get_sequence_parallel_rank(), mpu

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of ``batch`` (``batch`` itself without sequence parallelism)."""
        return batch if self.sp == 1 else shard_batch(batch, self.rank, self.sp)

    def close(self) -> None:
        """Put transformers' attention function back and forget the groups: a process that trains
        again (the job's own, a reused Tune actor) starts without them."""
        if self._restore is not None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            name, core = self._restore
            ALL_ATTENTION_FUNCTIONS[name] = core
            self._restore = None
        if self.mpu is not None:
            self.mpu._release_sequence_parallel_groups()
            self.mpu = None
        self.sp, self.rank = 1, 0


@functools.cache
def _ulysses_attention_class() -> type:
    """``UlyssesSPAttentionHF`` whose row count follows each batch (the base class reshapes with the
    row count it was built with and checks every shape against it). Made on first use: DeepSpeed is
    imported on workers only."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class RowsFollowBatch(UlyssesSPAttentionHF):
        def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
            rows = query.shape[0]
            if rows != self.batch_size:
                self.batch_size = rows
                # dim 0 (the sequence) is set by the base class's forward for variable lengths
                self.required_query_shape = torch.Size([1, rows, self.attn_head_count, self.attn_head_size])
                self.required_key_value_shape = torch.Size([1, rows, self.global_kv_head_count, self.attn_head_size])
                self.required_context_shape = torch.Size([1, rows, self.attn_head_size * self.attn_head_count // self.world_size])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return RowsFollowBatch
