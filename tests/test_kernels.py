"""Optional GPU kernels: their plumbing on CPU with reference stand-ins, and clean fallbacks.

The kernels themselves (PyTorch's FlashAttention varlen, Liger's Triton kernels) run only on GPUs;
``zerolab.kernels`` checks the varlen kernel against SDPA on the device before using it, and
``jobs/benchmark.py`` compares losses with and without them there. Here the stand-ins compute the
same functions in plain torch, so what is tested is everything around them: the boundaries the
batcher computes, the reshapes, the kwargs that reach attention, the loss's shift and reduction.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import rows_of
from zerolab import batches, kernels
from zerolab.batches import MicroBatches
from zerolab.config import ModelSpec
from zerolab.models import load_model


def reference_varlen(q, k, v, cu, max_len, scale):
    """What the varlen kernel computes: causal attention within each [cu[i], cu[i+1]) span."""
    assert max_len >= int(cu.diff().max())
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0),
                                           is_causal=True, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def test_cu_seqlens_mark_every_sample_and_each_rows_padding():
    mb = MicroBatches(rows_of([10, 20, 30, 15, 40]), micro_batch_size=8, max_seq_length=50, packing=True, pad_id=0, seed=0)
    (batch,) = mb.sequential()
    cu = batch.inputs[batches.CU_SEQLENS_KEY].tolist()
    assert cu[0] == 0 and cu[-1] == batch.inputs["input_ids"].numel()
    # Each sample starts where position_ids restart at 0 in the flattened batch.
    starts = (batch.inputs["position_ids"].flatten() == 0).nonzero().flatten().tolist()
    assert cu[:-1] == starts and all(b > a for a, b in zip(cu, cu[1:]))
    assert batches.packed_cu_seqlens([[3, 4], [7]], width=8).tolist() == [0, 3, 7, 8, 15, 16]


def test_varlen_attention_gives_the_padded_loss(tiny_model_path, monkeypatch):
    monkeypatch.setattr(kernels, "varlen_unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(kernels, "_varlen_call", reference_varlen)
    torch.manual_seed(0)
    model = load_model(ModelSpec(attn_implementation="varlen"), torch.float32).eval()
    assert model.config._attn_implementation == kernels.VARLEN_ATTENTION
    model.config.use_cache = False
    rows = rows_of([12, 25, 9, 30, 17, 21], seed=1)
    padded = MicroBatches(rows, micro_batch_size=6, max_seq_length=64, packing=False, pad_id=0, seed=0).sequential()[0]
    packed = MicroBatches(rows, micro_batch_size=6, max_seq_length=64, packing=True, pad_id=0, seed=0).sequential()[0]
    assert 2 <= packed.inputs["input_ids"].shape[0] < 6 and packed.num_targets == padded.num_targets
    calls = []
    monkeypatch.setattr(kernels, "_varlen_call", lambda *a: calls.append(a[3]) or reference_varlen(*a))
    with torch.no_grad():
        a = model(**padded.inputs, num_items_in_batch=padded.num_targets).loss  # right-padded: SDPA, causal
        b = model(**packed.inputs, num_items_in_batch=packed.num_targets).loss
    assert len(calls) == model.config.num_hidden_layers  # every layer took the varlen path for the packed batch
    assert torch.allclose(a, b, rtol=1e-4), (a, b)


def test_varlen_falls_back_to_sdpa_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert kernels.resolve_attention("varlen") == "sdpa"
    assert kernels.resolve_attention("eager") == "eager"
    assert kernels.varlen_unavailable_reason() == "no CUDA device"


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in for liger_kernel.transformers.functional computing the fused loss in plain torch."""
    def fused(hidden, weight, target, ignore_index=-100, reduction="mean"):
        return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    for name, module in {"liger_kernel": types.ModuleType("liger_kernel"),
                         "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
                         "liger_kernel.transformers.functional": functional}.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("num_items", [None, 37.0])
def test_fused_loss_forward_matches_the_models_loss(tiny_model_path, fake_liger, num_items):
    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32).train()  # the fused loss is for training
    model.config.use_cache = False
    batch = MicroBatches(rows_of([12, 25, 9, 30], seed=2), micro_batch_size=2, max_seq_length=64, packing=True,
                         pad_id=0, seed=0).sequential()[0]
    expected = model(**batch.inputs, num_items_in_batch=num_items).loss
    model.forward = types.MethodType(kernels._fused_loss_forward, model)
    got = model(**batch.inputs, num_items_in_batch=num_items)
    assert got.logits is None and torch.allclose(got.loss, expected, rtol=1e-5), (got.loss, expected)
    got.loss.backward()
    assert all(p.grad is not None for p in model.model.layers[0].parameters())
    model.eval()  # evaluation keeps the model's own forward, with logits
    assert model(**batch.inputs).logits is not None


def test_liger_is_skipped_where_it_cannot_run(tiny_model_path):
    model = load_model(ModelSpec(), torch.float32)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert kernels.apply_liger(model, fused_loss=True) == []
    assert not kernels.use_fused_loss("auto", use_gpu=False, head_trains=False)
    assert not kernels.use_fused_loss("liger", use_gpu=True, head_trains=True)
    assert kernels.use_fused_loss("liger", use_gpu=True, head_trains=False)
    assert not kernels.use_fused_loss("none", use_gpu=True, head_trains=False)


@pytest.mark.parametrize(("method", "dtype", "dropout"), [("lora", torch.float32, 0.0), ("rslora", torch.bfloat16, 0.0),
                                                          ("lora", torch.float32, 0.1), ("dora", torch.float32, 0.0)])
def test_fused_lora_forward_gives_peft_outputs_and_gradients(tiny_model_path, method, dtype, dropout):
    """The addmm forward against peft's own on the same weights and batch: loss and every
    adapter gradient (DoRA keeps peft's forward: the same by construction, and must still be)."""
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    batch = MicroBatches(rows_of([12, 25, 9, 30], seed=3), micro_batch_size=2, max_seq_length=64, packing=True,
                         pad_id=0, seed=0).sequential()[0]

    def loss_and_grads(fuse: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = apply_adapter(load_model(ModelSpec(), dtype), AdapterSpec(method=method, r=4, alpha=8, dropout=dropout), 10)
        model.to(dtype)  # peft keeps adapters in fp32; a bf16 run's engine casts them
        with torch.no_grad():  # lora_B starts at zero, which would hide its product
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        if fuse:
            assert kernels.fuse_lora(model) > 0
        torch.manual_seed(1)  # the same dropout masks
        loss = model(**batch.inputs).loss
        loss.backward()
        return loss.detach(), {k: p.grad.float() for k, p in model.named_parameters() if p.requires_grad}

    (expected, expected_grads), (got, grads) = loss_and_grads(False), loss_and_grads(True)
    # bf16: peft rounds B's product, its scaling and the sum; addmm rounds once.
    tol = 4e-2 if dtype == torch.bfloat16 else 1e-5
    assert abs(got - expected) / expected < tol / 10, (got, expected)
    assert grads.keys() == expected_grads.keys() and grads
    errors = {k: ((g - expected_grads[k]).norm() / expected_grads[k].norm()).item() for k, g in grads.items()}
    assert max(errors.values()) < tol, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_fused_lora_leaves_disabled_and_merged_adapters_to_peft(tiny_model_path):
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    torch.manual_seed(0)
    model = apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0), 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    kernels.fuse_lora(model)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    adapted = model(input_ids=ids).logits
    assert not torch.allclose(base, adapted)
    model.merge_adapter()
    torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)
