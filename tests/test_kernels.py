"""Optional GPU kernels: their plumbing on CPU with reference stand-ins, the kernels themselves on
the GPU (the ``cuda`` cases, part of the GPU tier: ``pytest -m gpu``), and clean fallbacks.

The kernels (PyTorch's FlashAttention varlen, Liger's Triton kernels) run only on GPUs. On CPU the
stand-ins compute the same functions in plain torch, so what is tested is everything around them:
the boundaries the batcher computes, the reshapes, the kwargs that reach attention, the loss's
shift and reduction. The ``cuda`` cases run the same checks with the real kernels on the GPU tier's
random-init Qwen2 in bf16: every fused path's loss and gradients against the plain path's.
"""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import rows_of
from zerolab import batches, kernels, lora_nodes
from zerolab.batches import MicroBatches
from zerolab.config import ModelSpec
from zerolab.models import load_model

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
"""CPU: the built-in tiny model in fp32 with stand-in kernels; cuda: the GPU tier's shape in bf16, real kernels."""

BF16_TOL = {"loss": 1e-2, "grads": 3e-2, "grad": 0.1}
"""Relative errors allowed between two bf16 computations of the same function by different kernels: the
loss; all gradients as one vector; any one tensor's gradient (q and k gradients of a random-init model
are small against the rounding of the attention scores that produce them). Padded SDPA against packed
attention in bf16 on CPU: 2e-5, 7e-3 and 2e-2."""

FP32_TOL = {"loss": 1e-5, "grads": 1e-5, "grad": 1e-4}
"""The same in fp32 (measured 1e-7, 4e-7, 1e-6)."""


def model_for(request: pytest.FixtureRequest, device: str, **spec: object) -> tuple[ModelSpec, torch.dtype]:
    if device == "cpu":
        request.getfixturevalue("tiny_model_path")
        return ModelSpec(**spec), torch.float32
    return ModelSpec(name_or_path=request.getfixturevalue("gpu_model_path"), **spec), torch.bfloat16


def varlen_model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, device: str) -> tuple[torch.nn.Module, torch.dtype]:
    """The model for ``device`` with varlen attention (on CPU through the stand-in kernel), in eval mode:
    no dropout; gradients flow all the same."""
    if device == "cpu":
        monkeypatch.setattr(kernels, "varlen_unavailable_reason", lambda device=None: None)
        monkeypatch.setattr(kernels, "_varlen_call", reference_varlen)
    spec, dtype = model_for(request, device, attn_implementation="varlen")
    torch.manual_seed(0)
    model = load_model(spec, dtype).to(device).eval()
    assert model.config._attn_implementation == kernels.VARLEN_ATTENTION
    model.config.use_cache = False
    return model, dtype


def on(inputs: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in inputs.items()}


def loss_and_grads(model: torch.nn.Module, inputs: dict[str, torch.Tensor], **kwargs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, **kwargs).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(got: tuple, expected: tuple, tol: dict[str, float]) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, expected
    assert abs(loss - ref_loss) / abs(ref_loss) < tol["loss"], (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and grads
    flat, ref_flat = (torch.cat([g[k].flatten() for k in sorted(ref_grads)]) for g in (grads, ref_grads))
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < tol["grads"]
    # A key bias adds the same term to every score of a query's row, which the softmax cancels: its
    # exact gradient is zero, and the computed one is the two kernels' rounding noise.
    errors = {k: ((g - ref_grads[k]).norm() / ref_grads[k].norm().clamp(min=1e-30)).item() for k, g in grads.items()
              if not k.endswith("k_proj.bias")}
    assert max(errors.values()) < tol["grad"], sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def assert_as_close_as_peft(got: tuple, peft_own: tuple, fp32: tuple, tol: dict[str, float], slack: float = 1.5) -> None:
    """``got`` (a bf16 path) is no further from the fp32 computation ``fp32`` than ``peft_own`` (peft's
    bf16 path) is, times ``slack``, or within ``tol``: in the loss, all gradients and each one."""
    def errors(run: tuple) -> tuple[float, float, dict[str, float]]:
        (loss, grads), (ref_loss, ref_grads) = run, fp32
        assert grads.keys() == ref_grads.keys() and grads
        flat, ref_flat = (torch.cat([g[k].flatten() for k in sorted(ref_grads)]) for g in (grads, ref_grads))
        each = {k: ((g - ref_grads[k]).norm() / ref_grads[k].norm().clamp(min=1e-30)).item() for k, g in grads.items()
                if not k.endswith("k_proj.bias")}  # zero in exact arithmetic: see assert_same_loss_and_grads
        return (abs(loss - ref_loss) / abs(ref_loss)).item(), ((flat - ref_flat).norm() / ref_flat.norm()).item(), each

    (loss, whole, each), (peft_loss, peft_whole, peft_each) = errors(got), errors(peft_own)
    assert loss < max(tol["loss"], slack * peft_loss), (loss, peft_loss)
    assert whole < max(tol["grads"], slack * peft_whole), (whole, peft_whole)
    worse = {k: (e, peft_each[k]) for k, e in each.items() if e >= max(tol["grad"], slack * peft_each[k])}
    assert not worse, sorted(worse.items(), key=lambda kv: -kv[1][0])[:3]


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


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_attention_gives_the_padded_loss_and_gradients(request, monkeypatch, device):
    if device == "cuda":
        assert kernels.varlen_unavailable_reason(torch.device(device)) is None
    model, dtype = varlen_model(request, monkeypatch, device)
    rows = rows_of([12, 25, 9, 30, 17, 21], seed=1)
    padded = MicroBatches(rows, micro_batch_size=6, max_seq_length=64, packing=False, pad_id=0, seed=0).sequential()[0]
    packed = MicroBatches(rows, micro_batch_size=6, max_seq_length=64, packing=True, pad_id=0, seed=0).sequential()[0]
    assert 2 <= packed.inputs["input_ids"].shape[0] < 6 and packed.num_targets == padded.num_targets
    calls, kernel = [], kernels._varlen_call
    monkeypatch.setattr(kernels, "_varlen_call", lambda *a: calls.append(a[3]) or kernel(*a))
    expected = loss_and_grads(model, on(padded.inputs, device), num_items_in_batch=padded.num_targets)  # right-padded: SDPA, causal
    assert not calls
    got = loss_and_grads(model, on(packed.inputs, device), num_items_in_batch=packed.num_targets)
    assert len(calls) == model.config.num_hidden_layers  # every layer took the varlen path for the packed batch
    assert_same_loss_and_grads(got, expected, FP32_TOL if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_attention_takes_padding_free_batches_in_transformers_format(request, monkeypatch, device):
    """TRL's padding-free batches (one flattened row, ``cu_seq_lens_q`` and ``max_length_q``: the
    benchmark registers zerolab's function for TRL) give the packed batch's loss and gradients, with
    their longest sample, not the flattened row, as the kernel's bound."""
    model, dtype = varlen_model(request, monkeypatch, device)
    rows = rows_of([12, 25, 9, 30, 17, 21], seed=1)
    packed = MicroBatches(rows, micro_batch_size=6, max_seq_length=64, packing=True, pad_id=0, seed=0).sequential()[0]
    expected = loss_and_grads(model, on(packed.inputs, device), num_items_in_batch=packed.num_targets)
    # Each row's padding is one more sequence, whose labels are ignored: the flattened rows are TRL's layout.
    cu = packed.inputs[batches.CU_SEQLENS_KEY]
    flat = {k: packed.inputs[k].reshape(1, -1) for k in ("input_ids", "labels", "position_ids")}
    longest = int(cu.diff().max())
    calls, kernel = [], kernels._varlen_call
    monkeypatch.setattr(kernels, "_varlen_call", lambda *a: calls.append(a[4]) or kernel(*a))
    got = loss_and_grads(model, on(flat, device), cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device), max_length_q=longest,
                         max_length_k=longest, num_items_in_batch=packed.num_targets)
    assert calls == [longest] * model.config.num_hidden_layers and longest < flat["input_ids"].shape[1]
    assert_same_loss_and_grads(got, expected, FP32_TOL if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_one_sample_take_causal_attention_without_boundaries(request, monkeypatch, device):
    """Packed rows that hold one sample each (long rows) carry no boundaries: causal SDPA over the
    right-padded rows gives the padded batch's loss and gradients, without the varlen kernel (on
    a Hopper GPU through cuDNN's attention, which SDPA tries first there)."""
    model, dtype = varlen_model(request, monkeypatch, device)
    rows = rows_of([40, 52, 33], seed=2)  # no two fit one row of 64
    padded = MicroBatches(rows, micro_batch_size=3, max_seq_length=64, packing=False, pad_id=0, seed=0).sequential()[0]
    packed = MicroBatches(rows, micro_batch_size=3, max_seq_length=64, packing=True, pad_id=0, seed=0).sequential()[0]
    assert packed.inputs["input_ids"].shape[0] == 3 and batches.CU_SEQLENS_KEY not in packed.inputs
    calls, call = [], kernels._varlen_call
    monkeypatch.setattr(kernels, "_varlen_call", lambda *a: calls.append(a) or call(*a))
    expected = loss_and_grads(model, on(padded.inputs, device), num_items_in_batch=padded.num_targets)
    got = loss_and_grads(model, on(packed.inputs, device), num_items_in_batch=packed.num_targets)
    assert not calls
    assert_same_loss_and_grads(got, expected, FP32_TOL if dtype == torch.float32 else BF16_TOL)


def test_varlen_falls_back_to_sdpa_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert kernels.resolve_attention("varlen") == "sdpa"
    assert kernels.resolve_attention("eager") == "eager"
    assert kernels.varlen_unavailable_reason() == "no CUDA device"


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in for liger_kernel.transformers.functional computing the fused loss in plain torch;
    yields the targets and the chunk memory constant of each call."""
    calls = []

    def fused(hidden, weight, target, ignore_index=-100, reduction="mean", chunk_mem_const=1):
        calls.append((target, chunk_mem_const))
        return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    for name, module in {"liger_kernel": types.ModuleType("liger_kernel"),
                         "liger_kernel.transformers": types.ModuleType("liger_kernel.transformers"),
                         "liger_kernel.transformers.functional": functional}.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_items", [None, 37.0])
def test_fused_loss_forward_matches_the_models_loss(request, device, num_items):
    if device == "cpu":
        request.getfixturevalue("fake_liger")
    else:
        pytest.importorskip("liger_kernel.transformers.functional")
    spec, dtype = model_for(request, device)
    torch.manual_seed(0)
    model = load_model(spec, dtype).to(device).train()  # the fused loss is for training
    model.config.use_cache = False
    batch = MicroBatches(rows_of([12, 25, 9, 30], seed=2), micro_batch_size=2, max_seq_length=64, packing=True,
                         pad_id=0, seed=0).sequential()[0]
    inputs = on(batch.inputs, device)
    expected = loss_and_grads(model, inputs, num_items_in_batch=num_items)
    model.forward = types.MethodType(kernels._fused_loss_forward, model)
    assert model(**inputs, num_items_in_batch=num_items).logits is None
    got = loss_and_grads(model, inputs, num_items_in_batch=num_items)
    assert model.lm_head.weight.grad is not None and all(p.grad is not None for p in model.model.layers[0].parameters())
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert_same_loss_and_grads(got, expected, tol)
    model.eval()  # the evaluation loss is the fused one too; generation (no labels) keeps the model's own forward
    with torch.no_grad():
        assert abs(model(**inputs, num_items_in_batch=num_items).loss.float() - expected[0]) / abs(expected[0]) < tol["loss"]
        assert model(**{k: v for k, v in inputs.items() if k != "labels"}).logits is not None
    if device == "cpu":  # the head and the loss saw the tokens with a target only (half of each row is prompt), evaluation too,
        calls = request.getfixturevalue("fake_liger")  # in one chunk (Liger's own chunks would be smaller)
        assert [len(t) for t, _ in calls] == [batch.num_targets] * 3 and all((t != -100).all() for t, _ in calls)
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
        assert kernels._liger_chunk_rows(batch.num_targets, vocab, hidden, 1) < batch.num_targets
        assert all(kernels._liger_chunk_rows(batch.num_targets, vocab, hidden, c) == batch.num_targets for _, c in calls)


def test_fused_loss_chunks_have_enough_rows_to_compute_rather_than_read_the_head():
    """(chunk_mem_const, rows per chunk) at the 7B's vocabulary and width: Liger's own chunks where
    they have 1,024 rows or more; else the smallest constant that gives 1,024, or all the rows."""
    vocab, hidden = 152064, 3584
    assert kernels._liger_chunk_rows(1120, vocab, hidden, 1) == 32  # Liger's: 35 chunks over the benchmark's target tokens
    assert kernels.fused_loss_chunk(1120, vocab, hidden) == (22, 1024)
    assert kernels.fused_loss_chunk(8192, vocab, hidden) == (3, 1024)  # Liger's own: 256
    assert kernels.fused_loss_chunk(500, vocab, hidden) == (43, 500)
    assert kernels.fused_loss_chunk(262144, vocab, hidden) == (1, 8192)


def test_the_fused_loss_drops_only_rows_without_a_target():
    hidden = torch.arange(12.0).reshape(6, 2)
    rows, targets = kernels._target_rows(hidden, torch.tensor([-100, 4, -100, 7, 9, -100]))
    assert rows.tolist() == [[2.0, 3.0], [6.0, 7.0], [8.0, 9.0]] and targets.tolist() == [4, 7, 9]
    for kept in (torch.tensor([1, 2, 3, 4, 5, 6]), torch.full((6,), -100)):  # nothing to drop; no target at all
        rows, targets = kernels._target_rows(hidden, kept)
        assert rows is hidden and targets is kept


@pytest.fixture
def restore_qwen2_module():
    """Liger's patch replaces module-level names of transformers' Qwen2 code (RoPE, RMSNorm and MLP
    classes), which would reach every model built later in this process; put them back."""
    from transformers.models.qwen2 import modeling_qwen2

    saved = dict(vars(modeling_qwen2))
    yield
    for name in set(vars(modeling_qwen2)) - set(saved):
        delattr(modeling_qwen2, name)
    for name, value in saved.items():
        if vars(modeling_qwen2).get(name) is not value:
            setattr(modeling_qwen2, name, value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused_loss", [False, True], ids=["rmsnorm-swiglu-rope", "and-fused-linear-cross-entropy"])
def test_liger_kernels_give_the_plain_loss_and_gradients(request, restore_qwen2_module, fused_loss):
    """``apply_liger`` as the trainer calls it, against Hugging Face's own modules on the same weights and batch."""
    pytest.importorskip("liger_kernel")
    spec, dtype = model_for(request, "cuda")
    batch = MicroBatches(rows_of([12, 25, 9, 30, 40], seed=4), micro_batch_size=2, max_seq_length=64, packing=True,
                         pad_id=0, seed=0).sequential()[0]
    inputs = on(batch.inputs, "cuda")

    def run(liger: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = load_model(spec, dtype)
        model.config.use_cache = False
        if liger:
            applied = kernels.apply_liger(model, fused_loss=fused_loss)
            assert {"rope", "rms_norm", "swiglu"} <= set(applied) and ("fused_linear_cross_entropy" in applied) == fused_loss, applied
        return loss_and_grads(model.to("cuda").train(), inputs, num_items_in_batch=batch.num_targets)

    assert_same_loss_and_grads(run(True), run(False), BF16_TOL)


def test_liger_is_skipped_where_it_cannot_run(tiny_model_path):
    model = load_model(ModelSpec(), torch.float32)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert kernels.apply_liger(model, fused_loss=True) == []
    assert not kernels.use_fused_loss("auto", use_gpu=False, head_trains=False)
    assert not kernels.use_fused_loss("liger", use_gpu=True, head_trains=True)
    assert kernels.use_fused_loss("liger", use_gpu=True, head_trains=False)
    assert not kernels.use_fused_loss("none", use_gpu=True, head_trains=False)


def test_liger_required_but_not_installed_is_an_environment_problem_naming_the_extra(monkeypatch):
    """``model.kernels=liger`` on GPUs without the package: the job's plan refuses it before anything
    loads, naming zerolab's gpu extra; ``auto`` trains without it, and on CPU the config check speaks."""
    from zerolab.config import load_config
    from zerolab.errors import EnvironmentProblem
    from zerolab.plan import plan_job

    real = kernels.importlib.util.find_spec
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    with pytest.raises(EnvironmentProblem, match=r"model.kernels=liger .*not installed here.*\[gpu\].*model.kernels=auto"):
        plan_job(load_config(None, ["model.kernels=liger", "scaling.use_gpu=true"]))
    for setting, use_gpu in (("auto", True), ("none", True), ("liger", False)):
        kernels.check_available(setting, use_gpu=use_gpu)


@pytest.mark.parametrize(("method", "dtype", "dropout", "device"), [
    ("lora", torch.float32, 0.0, "cpu"), ("rslora", torch.bfloat16, 0.0, "cpu"), ("lora", torch.float32, 0.1, "cpu"),
    ("dora", torch.float32, 0.0, "cpu"),
    *[pytest.param(*case, "cuda", marks=DEVICES[1].marks) for case in (("lora", torch.float32, 0.0), ("lora", torch.bfloat16, 0.0),
                                                                      ("rslora", torch.bfloat16, 0.0), ("lora", torch.bfloat16, 0.1),
                                                                      ("dora", torch.bfloat16, 0.0))],
])
def test_fused_lora_forward_gives_peft_outputs_and_gradients(request, method, dtype, dropout, device):
    """The addmm forward, and SwiGLU with down's LoRA as one node, against peft's own on the same
    weights and batch: loss and every adapter gradient (DoRA and adapter dropout keep peft's
    forward or the MLP's own: the same by construction, and must still be). On ``cuda`` the node's
    SwiGLU is zerolab's Triton kernels."""
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    spec, _ = model_for(request, device)
    batch = MicroBatches(rows_of([12, 25, 9, 30], seed=3), micro_batch_size=2, max_seq_length=64, packing=True,
                         pad_id=0, seed=0).sequential()[0]
    inputs = on(batch.inputs, device)

    def run(fuse: bool, dtype: torch.dtype = dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = apply_adapter(load_model(spec, dtype), AdapterSpec(method=method, r=4, alpha=8, dropout=dropout), 10)
        model.to(device=device, dtype=dtype)  # peft keeps adapters in fp32; a bf16 run's engine casts them
        with torch.no_grad():  # lora_B starts at zero, which would hide its product
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        if fuse:
            assert lora_nodes.fuse_lora(model) > 0
            fused_mlps = method != "dora" and dropout == 0
            assert lora_nodes.fuse_shared_inputs(model) == (2 * model.config.num_hidden_layers if fused_mlps else 0)
            assert lora_nodes.fuse_swiglu_down(model) == (model.config.num_hidden_layers if fused_mlps else 0)
        torch.manual_seed(1)  # the same dropout masks
        return loss_and_grads(model, inputs)

    if dtype == torch.float32:
        assert_same_loss_and_grads(run(True), run(False), {"loss": 1e-6, "grads": 1e-5, "grad": 1e-5})
        return
    # bf16: peft rounds B's product, its scaling and the sum; addmm rounds once. So the two differ by
    # bf16's rounding, how much depending on the CPU's bf16 kernels (a small gradient of one layer
    # differed by 8.6% on an AVX2 machine): each is held to the fp32 computation of the same weights,
    # the fused path no further from it than peft's own (with slack), or within 4%.
    assert_as_close_as_peft(run(True), run(False), run(False, torch.float32), {"loss": 4e-3, "grads": 4e-2, "grad": 4e-2})


def _graph_nodes(out: torch.Tensor) -> collections.Counter:
    """The autograd graph behind ``out``, by node type."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return collections.Counter(type(node).__name__ for node in seen)


def test_projections_that_share_an_input_are_one_node(tiny_model_path):
    """Q/K/V and gate/up as one node each (``fuse_shared_inputs``) against each projection its own
    node, on the same weights and batch: the same loss and gradients (float32), one node for Q/K/V
    and one for gate/up where each projection had its own; with adapters on Q and V only, the two as one node
    around K's plain product, and up alone its own node. A kept output goes only to a sibling called
    with the very tensor it was computed from, unchanged; siblings fed different tensors each compute
    their own until the module's forward ends, which drops what is kept, also when it fails. Every
    output is peft's for its own input."""
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    inputs = {"input_ids": torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))}
    inputs["labels"] = inputs["input_ids"]

    def build(shared: bool, **spec: object) -> torch.nn.Module:
        torch.manual_seed(0)
        model = apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0, **spec), 10)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        lora_nodes.fuse_lora(model)
        if shared:
            lora_nodes.fuse_shared_inputs(model)
        lora_nodes.fuse_swiglu_down(model)
        return model

    layers = build(False).config.num_hidden_layers
    for targets, groups, single in ((None, 2, 1), (("q_proj", "v_proj", "up_proj"), 1, 1)):
        spec = {"target_modules": targets} if targets else {}
        model, ref = build(True, **spec), build(False, **spec)
        assert sum("zerolab_siblings" in m.__dict__ for m in model.modules()) == (3 + 2 if groups == 2 else 2) * layers
        assert_same_loss_and_grads(loss_and_grads(model, inputs), loss_and_grads(ref, inputs), FP32_TOL)
        nodes, ref_nodes = (_graph_nodes(m(**inputs).loss) for m in (model, ref))
        assert nodes["_SharedInputLoRABackward"] == groups * layers and not ref_nodes["_SharedInputLoRABackward"]
        assert nodes["_LoRALinearBackward"] == single * layers  # o_proj; up_proj alone in its MLP
        assert ref_nodes["_LoRALinearBackward"] == (6 if targets is None else 3) * layers

    attn = model.get_submodule("base_model.model.model.layers.0.self_attn")
    siblings = attn.q_proj.__dict__["zerolab_siblings"]
    x, other = torch.randn(2, 5, model.config.hidden_size), torch.randn(2, 5, model.config.hidden_size)
    calls = []
    with torch.no_grad():
        calls += [(attn.q_proj, x.clone()), (attn.k_proj, x.clone())]  # k takes the output q's call kept
        got = [attn.q_proj(x), attn.k_proj(x)]
        assert siblings.kept[2].keys() == {attn.v_proj}
        x.mul_(2)  # changed in place since: v computes its own
        calls += [(attn.v_proj, x), (attn.q_proj, x), (attn.k_proj, other), (attn.v_proj, x)]
        got += [attn.v_proj(x), attn.q_proj(x), attn.k_proj(other), attn.v_proj(x)]
        assert siblings.kept is lora_nodes._APART  # fed different tensors: each its own until the module's forward ends
        attn.q_proj(x)
        assert siblings.kept is lora_nodes._APART
        expected = [type(layer).forward(layer, t) for layer, t in calls]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    # The module's forward drops what is kept, also when it fails.
    model(**inputs)
    assert all(s.kept is None for s in {m.__dict__["zerolab_siblings"] for m in model.modules() if "zerolab_siblings" in m.__dict__})
    failing = attn.k_proj.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("k_proj failed")))
    with pytest.raises(RuntimeError, match="k_proj failed"):
        model(**inputs)
    failing.remove()
    assert siblings.kept is None


def test_the_swiglu_down_node_keeps_the_gate_and_up_outputs_only(tiny_model_path):
    """What a LoRA step keeps for its backward, counted by autograd's saved-tensor hook: with SwiGLU
    and down's LoRA as one node, neither down's input SiLU(gate)·up (which down's adapter reads) nor
    SiLU(gate) (Hugging Face's product keeps it): 2·e·I bytes per token and layer less, the same
    loss. The memory estimate counts the node's e·I against Liger's SwiGLU, which already keeps
    gate and up only; off with adapter dropout, DoRA, compiled layers."""
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec, load_config
    from zerolab.memory.activations import activations
    from zerolab.memory.context import EstimateContext, ZeroKnobs
    from zerolab.memory.options import Option
    from zerolab.memory.shapes import ModelShape
    from zerolab.models import KNOWN_CONFIGS

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))

    def saved(node: bool) -> tuple[float, int, torch.nn.Module]:
        torch.manual_seed(0)
        model = apply_adapter(load_model(ModelSpec(), torch.bfloat16), AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0), 10)
        lora_nodes.fuse_lora(model)
        if node:
            lora_nodes.fuse_swiglu_down(model)
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), sum(storages.values()), model

    (loss, kept, model), (ref_loss, ref_kept, _) = saved(True), saved(False)
    layers, inter = model.config.num_hidden_layers, model.config.intermediate_size
    assert loss == ref_loss and ref_kept - kept == 2 * layers * ids.numel() * inter * 2

    shape = ModelShape.from_config(KNOWN_CONFIGS["Qwen/Qwen2.5-7B"])

    def job(*extra: str, stage: int = 2) -> EstimateContext:
        cfg = load_config(None, ["adapter.method=lora", "adapter.dropout=0.0", "scaling.use_gpu=true", "scaling.num_workers=1",
                                 "train.precision=bf16", "model.kernels=liger", "data.max_seq_length=4096", "train.micro_batch_size=2",
                                 f"deepspeed.stage={stage}", *extra])
        return EstimateContext(cfg, shape, [], ZeroKnobs.resolve(cfg, shape), Option(stage), None, ())  # type: ignore[arg-type]

    fused, unfused = job(), job()
    unfused.swiglu_down = False
    assert fused.swiglu_down and activations(unfused) - activations(fused) == shape.num_layers * fused.tokens * 2 * shape.intermediate_size
    for extra, stage in ((("adapter.dropout=0.05",), 2), (("adapter.method=dora",), 2), (("model.compile=true",), 2),
                         (("model.kernels=none",), 2), (("adapter.target_modules=[q_proj,v_proj]",), 2),
                         (("deepspeed.z3_leaf_layers=false",), 3)):
        assert not job(*extra, stage=stage).swiglu_down, extra
    assert job(stage=3).swiglu_down


def test_fused_lora_leaves_disabled_and_merged_adapters_to_peft(tiny_model_path):
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    torch.manual_seed(0)
    model = apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0), 10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora_nodes.fuse_lora(model)
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    with model.disable_adapter():
        base = model(input_ids=ids).logits
    adapted = model(input_ids=ids).logits
    assert not torch.allclose(base, adapted)
    model.merge_adapter()
    torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_decoder_layers_give_the_eager_loss_and_gradients(request, device):
    """Regional compilation (``model.compile``) against the same layers run eagerly, on padded
    batches of three lengths and two sizes: the loss and every adapter gradient; the compiled
    graphs serve every layer and every shape (one for the first layer, whose input needs no
    gradient, one for the rest) and nothing breaks the graph. Compiled in a fresh process, so
    Inductor's state and compile workers stay out of the rest of the suite."""
    import concurrent.futures
    import multiprocessing

    spec, dtype = model_for(request, device)
    batches = MicroBatches(rows_of([6, 7, 19, 22, 30, 31, 12, 9], seed=4), micro_batch_size=3, max_seq_length=64, packing=False,
                           pad_id=0, seed=0).sequential()
    assert [tuple(b.inputs["input_ids"].shape) for b in batches] == [(3, 19), (3, 31), (2, 12)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pairs, graphs, breaks = pool.submit(_compiled_and_eager, spec, dtype, device, [b.inputs for b in batches]).result()
    tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    for compiled, eager in pairs:
        assert_same_loss_and_grads(compiled, eager, tol)
    assert not breaks, breaks
    assert graphs == 2, graphs


def _compiled_and_eager(spec: ModelSpec, dtype: torch.dtype, device: str, batches: list) -> tuple:
    """((compiled, eager) loss and gradients per batch, Dynamo's graphs, its graph breaks)."""
    import torch._dynamo

    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec
    from zerolab.models import decoder_layers

    def build(compiled: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        base = load_model(spec, dtype)
        base.config.use_cache = False  # as the workers build it
        model = apply_adapter(base, AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0), 10).to(device=device, dtype=dtype)
        with torch.no_grad():  # lora_B starts at zero, which would hide its product
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        lora_nodes.fuse_lora(model)
        if compiled:
            assert kernels.compile_layers(decoder_layers(model)) == len(decoder_layers(model)) > 1
        return model

    compiled, eager = build(True), build(False)
    pairs = []
    for inputs in batches:
        inputs = on(inputs, device)
        pairs.append(tuple((loss.cpu(), {k: g.cpu() for k, g in grads.items()})
                           for loss, grads in (loss_and_grads(compiled, inputs), loss_and_grads(eager, inputs))))
    counters = torch._dynamo.utils.counters
    return pairs, counters["stats"]["unique_graphs"], dict(counters["graph_break"])


def test_compiled_layers_hand_the_compiler_the_lora_products_not_the_fused_node(tiny_model_path):
    """Inside a compiled layer the fused LoRA forward gives Dynamo plain products, which Inductor
    differentiates and fuses itself: no autograd.Function reaches the graph (on CUDA, torch 2.11's
    Dynamo failed to trace ``_LoRALinear`` and the adapters got no gradient at all). Eager layers
    keep the one-node form."""
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec
    from zerolab.models import decoder_layers

    torch.manual_seed(0)
    model = apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(method="lora", r=4, alpha=8, dropout=0.0), 10)
    with torch.no_grad():  # lora_B starts at zero, which would leave lora_A without a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    assert lora_nodes.fuse_lora(model)
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    kernels.compile_layers(decoder_layers(model), backend=recording)
    model(input_ids=torch.tensor([[5, 9, 13, 2, 7, 11]])).logits.float().pow(2).mean().backward()
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes}
    assert graphs and any("addmm" in op for op in ops), ops
    assert not any("autograd_function" in op for op in ops), ops
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_A" in n)


def test_a_layer_that_fails_to_compile_runs_eagerly_and_says_why(caplog):
    """``model.compile`` on a layer its compiler cannot handle: the layer runs eagerly (the same
    outputs) and Dynamo's warning names the failure, instead of the job dying at its first step."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(2)]
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = [layer(x) for layer in layers]

    def failing(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        raise RuntimeError("no kernel for this op")

    assert kernels.compile_layers(layers, backend=failing) == 2
    with torch.no_grad():
        got = [layer(x) for layer in layers]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert "no kernel for this op" in caplog.text  # Dynamo's warning, through logging


def _random_batch(rows: int, length: int, device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 1000, (rows, length), generator=torch.Generator().manual_seed(rows * length))
    return on({"input_ids": ids, "labels": ids}, device)


def _adapted(spec: ModelSpec, method: str, device: str, *, fp8: bool) -> torch.nn.Module:
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec

    torch.manual_seed(0)
    model = apply_adapter(load_model(spec, torch.bfloat16), AdapterSpec(method=method, r=4, alpha=8, dropout=0.0), 10)
    model.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():  # lora_B starts at zero, which would hide its product
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    lora_nodes.fuse_lora(model)
    lora_nodes.fuse_shared_inputs(model)  # as the job does: Q/K/V's and gate/up's FP8 products in their shared node
    lora_nodes.fuse_swiglu_down(model)  # and down's inside the SwiGLU-down node
    if fp8:  # every projection: the test models' are narrower than model.fp8_min_features
        if device == "cuda":
            assert kernels.fp8_unavailable_reason(torch.device(device)) is None
        assert kernels.fp8_layers(model, min_features=16) == 7 * model.config.num_hidden_layers
        # The e4m3 copies exist before the first forward (made there, they fragmented the first
        # step's activations: 16 GiB more reserved on the 7B shape).
        marked = [m for m in model.modules() if getattr(m, "zerolab_fp8", False)]
        assert all(m.__dict__["_fp8_weight"].device == m.weight.device for m in marked)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["lora", "dora"])
def test_fp8_base_products_track_the_bf16_loss_and_gradients(request, device, method):
    """``model.fp8`` against the same bf16 model and batch: the loss within 2% and the adapter
    gradients within 10% (e4m3 keeps 3 mantissa bits; the tiny model on CPU: 0.3% and 3%), and not
    equal to them (the FP8 products ran). LoRA takes the fused node's FP8 products, DoRA peft's
    forward through the base layer's."""
    spec, _ = model_for(request, device)
    inputs = _random_batch(3, 31, device)  # 93 rows of tokens
    (loss, grads), (ref_loss, ref_grads) = (loss_and_grads(_adapted(spec, method, device, fp8=fp8), inputs) for fp8 in (True, False))
    assert grads.keys() == ref_grads.keys() and grads
    flat, ref_flat = torch.cat([g.flatten() for g in grads.values()]), torch.cat([g.flatten() for g in ref_grads.values()])
    assert 0 < abs(loss - ref_loss) / ref_loss < 2e-2, (loss, ref_loss)
    assert 0 < (flat - ref_flat).norm() / ref_flat.norm() < 0.1


@pytest.mark.parametrize("cols", [1000, 18944])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_quantize_to_e4m3_with_one_scale_each(device, cols):
    """Each row's absolute maximum maps to 448 (e4m3's largest), every value comes back within
    e4m3's rounding (a relative 2⁻⁴, or 2⁻⁹·scale near zero), a zero row stays zero; on GPUs the
    Triton pass gives the torch formula's bits (rows of one block and of many)."""
    t = torch.randn(64, cols, dtype=torch.bfloat16).mul_(torch.logspace(-3, 3, 64).unsqueeze(1).to(torch.bfloat16))
    t[5] = 0
    t[9, cols - 1] = 1e4  # the row's maximum in its last column
    t = t.to(device)
    q, scale = kernels.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = q.float() * scale
    assert torch.equal(q[5].float(), torch.zeros(cols, device=device))
    assert back[9, cols - 1].item() == pytest.approx(t[9, cols - 1].item(), rel=1e-6)
    keep = torch.arange(64, device=device) != 5
    assert torch.allclose(back.abs().amax(1)[keep], t.float().abs().amax(1)[keep], rtol=1e-6)
    assert ((back - t.float()).abs() <= t.float().abs() / 16 + scale * 2**-9).all()
    if device == "cuda":
        amax = t.float().abs().amax(1, keepdim=True).clamp(min=1e-12)
        ref = (t.float() / (amax / kernels.E4M3_MAX)).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert (q.float() == ref.float()).float().mean() > 0.999
