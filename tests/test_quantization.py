"""Quantized bases (``model.quantization``): bitsandbytes' CPU backend loads and trains the tiny
model, so the QLoRA path runs here as it does on GPUs — the config's refusals, the loader, the
estimator's figures, DeepSpeed's ZeRO-2 and ZeRO-3 over two ranks (gloo), a whole job through Ray
with its evaluation, resume and export."""

from __future__ import annotations

import gc
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from conftest import on_two_ranks, save_random_qwen2, tiny_overrides
from zerolab import quantization
from zerolab.config import ConfigError, ModelSpec, load_config

bnb = pytest.importorskip("bitsandbytes")

PROBE = torch.tensor([[3, 17, 250, 99, 5, 61, 400, 12]])


def test_combinations_a_quantized_base_cannot_train_are_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.quantization=nf4", "adapter.method=full", "model.compile=true"])
    problems = err.value.problems
    assert any(p.startswith("model.quantization: a nf4 base is frozen") and "adapter.method=full" in p and "lora" in p for p in problems)
    assert any(p.startswith("model.compile: not with a nf4 base") and "model.compile=false" in p for p in problems)
    with pytest.raises(ConfigError, match=r"model.fp8: .*set one of model.fp8=false or model.quantization=none"):
        load_config(None, ["model.quantization=int8", "model.fp8=true", "scaling.use_gpu=true"])
    with pytest.raises(ConfigError, match=r"model.quantization: 'q3' is not one of"):
        load_config(None, ["model.quantization=q3"])
    # Every adapter method and ZeRO stage (parameter offload included) is accepted.
    for extra in (["adapter.method=dora", "deepspeed.stage=3"], ["adapter.method=adalora", "deepspeed.stage=0", "train.precision=fp32"],
                  ["deepspeed.stage=3", "deepspeed.offload_optimizer=true", "deepspeed.offload_param=true"]):
        assert load_config(None, ["model.quantization=int8", *extra]).model.quantization == "int8"


def test_a_missing_bitsandbytes_is_an_environment_problem_naming_the_extra(monkeypatch):
    from zerolab.errors import EnvironmentProblem

    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(quantization.importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(EnvironmentProblem, match=r"model.quantization=nf4 .*bitsandbytes, which is not installed.*\[quantization\]"):
        quantization.check_available("nf4")
    quantization.check_available("none")


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_the_loader_quantizes_every_decoder_projection_and_nothing_else(kind, tiny_model_path):
    from zerolab.adapters import parameter_counts
    from zerolab.models import load_model

    plain = load_model(ModelSpec(), torch.bfloat16)
    model = load_model(ModelSpec(quantization=kind), torch.bfloat16)
    layers = quantization.quantized_layers(model)
    projections = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert sorted(layers) == sorted(projections)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # Counted as the weights they stand for, not the packed elements that hold them.
    assert parameter_counts(model)[1] == parameter_counts(plain)[1]
    weight = model.model.layers[0].mlp.down_proj.weight
    packed = weight.detach().view(torch.uint8).clone()
    model.eval()
    with torch.no_grad():
        quantized_logits = model(PROBE).logits.float()
        plain_logits = plain(PROBE).logits.float()
    # An evaluation pass keeps the training layout (bitsandbytes would repack it for its CPU kernel).
    assert torch.equal(weight.detach().view(torch.uint8), packed)
    # Quantization error, not another model: close to the bf16 model's logits. FP4's grid is coarser
    # than NF4's (its error measured 3-5 times NF4's on this model, 0.21-0.32 of the logits' mean
    # magnitude depending on the CPU's kernels).
    bound = 0.45 if kind == "fp4" else 0.2
    assert (quantized_logits - plain_logits).abs().mean() < bound * plain_logits.abs().mean()


def test_dequantized_layers_compute_what_the_quantized_ones_did(tiny_model_path):
    from zerolab.models import load_model

    model = load_model(ModelSpec(quantization="nf4"), torch.float32).eval()
    with torch.no_grad():
        expected = model(PROBE).logits
    assert quantization.dequantize(model, torch.float32) == 28
    assert not quantization.quantized_layers(model) and not hasattr(model.config, "quantization_config")
    with torch.no_grad():
        torch.testing.assert_close(model(PROBE).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_zero3_product_computes_what_bitsandbytes_does_and_caches_nothing(kind, device, tiny_model_path):
    """The product ZeRO-3 runs (zerolab.quantized_products) is bitsandbytes' own, to the bit: the
    outputs and the input gradients of every kind of projection, in training and in evaluation (on
    CPU bitsandbytes' CPU kernels; ``cuda``, part of the GPU tier: its CUDA kernels, LLM.int8()'s int8
    product and outlier columns); an int8 layer keeps no copy of its weight after it (bitsandbytes'
    caches it in ``state.CB``)."""
    from zerolab.models import load_model
    from zerolab.quantized_products import keep_nothing_between_products

    model = load_model(ModelSpec(quantization=kind), torch.bfloat16, torch.device(device) if device == "cuda" else None)
    layers = quantization.quantized_layers(model)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj", "model.layers.2.mlp.down_proj"]
    torch.manual_seed(0)
    # Scaled so that some of the inputs pass LLM.int8()'s outlier threshold (6): both of its paths run.
    inputs = {n: torch.randn(2, 5, layers[n].in_features, dtype=torch.bfloat16, device=device) * 3 for n in names}

    def run(training: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        out = {}
        for name in names:
            layer = layers[name].train(training)
            x = inputs[name].clone().requires_grad_(training)
            y = layer(x)
            if training:
                y.float().square().sum().backward()
            out[name] = (y.detach(), x.grad)
        return out

    expected = {mode: run(mode) for mode in (True, False)}
    assert keep_nothing_between_products(model) == len(layers) == 28
    for mode in (True, False):
        for name, (y, grad) in run(mode).items():
            assert torch.equal(y, expected[mode][name][0]), name
            assert (grad is None) == (not mode) and (grad is None or torch.equal(grad, expected[mode][name][1])), name
    if kind == "int8":
        assert all(layers[n].weight.CB is None and layers[n].state.CB is None and layers[n].weight.SCB is not None for n in names)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_fused_lora_on_a_quantized_base_gives_peft_loss_and_gradients(kind, device, tiny_model_path):
    """The fused LoRA forward on an nf4 or int8 base (one autograd node per projection:
    bitsandbytes' product, the adapter's and their sum; Q/K/V as one, gate/up as one, SwiGLU with
    down's as one) against peft's own on the same weights and rows: the loss and every adapter
    gradient; with dropout the layers keep peft's forward, to the bit."""
    from zerolab import lora_nodes
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec
    from zerolab.models import load_model

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)

    def run(fuse: bool, dropout: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor], set[str]]:
        torch.manual_seed(0)
        model = load_model(ModelSpec(quantization=kind), torch.bfloat16, torch.device(device) if device == "cuda" else None)
        model = apply_adapter(model, AdapterSpec(method="lora", r=4, alpha=8, dropout=dropout), 10).train()
        with torch.no_grad():  # lora_B starts at zero, which would hide its product
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        if fuse:
            assert lora_nodes.fuse_lora(model) == len(quantization.quantized_layers(model)) == 28
            assert lora_nodes.fuse_shared_inputs(model) == (8 if dropout == 0 else 0)
            assert lora_nodes.fuse_swiglu_down(model) == (4 if dropout == 0 else 0)
        nodes: set[str] = set()
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp"):
            model.get_submodule(f"base_model.model.model.layers.1.{name}").register_forward_hook(
                lambda module, args, out: nodes.add(type(out.grad_fn.next_functions[0][0]).__name__))  # under the view to 3-D
        torch.manual_seed(1)  # the same dropout masks
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}, nodes

    (loss, grads, nodes), (ref_loss, ref_grads, ref_nodes) = run(True), run(False)
    assert nodes == {"_SharedInputLoRABackward", "_LoRALinearBackward", "_SwiGLULoRADownBackward"} and not ref_nodes & nodes
    # bf16: peft rounds B's product, its scaling and the sum; addmm rounds once.
    assert abs(loss - ref_loss) / ref_loss < 4e-3
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 28
    flat, ref_flat = (torch.cat([g[k].flatten() for k in sorted(ref_grads)]) for g in (grads, ref_grads))
    assert ((flat - ref_flat).norm() / ref_flat.norm()).item() < 4e-2
    (loss, grads, nodes), (ref_loss, ref_grads, _) = run(True, dropout=0.1), run(False, dropout=0.1)
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, ref_grads[k]) for k, g in grads.items())


def test_bitsandbytes_int8_product_keeps_its_input_and_its_outlier_columns_on_the_context():
    """Why zerolab runs a quantized base's products itself (``zerolab.quantized_products``): with a
    frozen int8 weight and an input that needs a gradient, bitsandbytes' ``MatMul8bitLt`` keeps
    ``(CAt, subA, A)`` as a plain attribute of its context (nothing in ``save_for_backward``, so
    checkpointing cannot drop them): the input itself (same storage) and a copy of its outlier
    columns (those with a value of at least the threshold), which a frozen weight's backward never reads."""
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul8bitLt

    torch.manual_seed(0)
    layer = bnb.nn.Linear8bitLt(16, 8, bias=False, has_fp16_weights=False, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(torch.randn(8, 16) * 0.1, requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu")  # quantizes the weight: int8 rows and their scales
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        x[0, 1, 3], x[1, 2, 11] = 9.0, -7.0  # two outlier columns, one token each
    out = MatMul8bitLt.apply(x, layer.weight, None, None, layer.state)
    cat, sub_a, a = out.grad_fn.tensors
    assert cat is None and len(out.grad_fn.saved_tensors) == 0
    assert a.data_ptr() == x.data_ptr() and a.shape == (10, 16)
    assert sub_a.shape == (10, 2) and sub_a.dtype == torch.bfloat16 and sub_a.data_ptr() != x.data_ptr()
    assert out.grad_fn.tensor_states[1].tolist() == [3, 11]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_quantized_step_keeps_nothing_outside_autograds_saved_tensors(kind, dropout, tiny_model_path):
    """Through zerolab's products (the fused LoRA node; with dropout peft's forward over
    ``keep_nothing_between_products``) no node of a QLoRA step's graph holds a tensor outside its
    saved tensors, which checkpointing drops and the memory estimate counts; bitsandbytes' own
    layers hold the input (and LLM.int8()'s outlier columns; on CPU its ``MatMul8bitFp`` the input)
    on their nodes."""
    from zerolab import lora_nodes
    from zerolab.adapters import apply_adapter
    from zerolab.config import AdapterSpec
    from zerolab.models import load_model
    from zerolab.quantized_products import keep_nothing_between_products

    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))

    def held_outside(ours: bool) -> int:
        torch.manual_seed(0)
        model = load_model(ModelSpec(quantization=kind), torch.bfloat16)
        model = apply_adapter(model, AdapterSpec(method="lora", r=4, alpha=8, dropout=dropout), 10).train()
        if ours:
            lora_nodes.fuse_lora(model)
            lora_nodes.fuse_shared_inputs(model)
            keep_nothing_between_products(model)
        loss = model(input_ids=ids, labels=ids).loss
        seen, stack, holding = set(), [loss.grad_fn], 0
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            kept = [v for value in getattr(node, "__dict__", {}).values()  # an autograd function's context
                    for v in (value if isinstance(value, tuple | list) else (value,))]
            holding += any(isinstance(v, torch.Tensor) for v in kept)
            stack.extend(n for n, _ in node.next_functions)
        loss.backward()  # the graph is whole: every adapter gets its gradient
        assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
        return holding

    # All but the first layer's q/k/v, whose input (from the frozen embeddings) needs no gradient.
    assert held_outside(ours=False) == 25
    assert held_outside(ours=True) == 0


def test_a_worker_logs_the_int8_cast_warning_once(tiny_model_path, caplog, monkeypatch):
    """bitsandbytes' LLM.int8() product warns at every call that it casts bf16 inputs to fp16; a
    training worker's logging passes it once."""
    from zerolab.models import load_model
    from zerolab.worker_log import setup_worker_logging

    # A fresh worker: another test in this process may have set up worker logging and seen the line.
    monkeypatch.setattr(logging.getLogger("bitsandbytes.autograd._functions"), "filters", [])
    model = load_model(ModelSpec(quantization="int8"), torch.bfloat16).eval()
    setup_worker_logging(own_handler=False)
    setup_worker_logging(own_handler=False)  # a warm trainer's next run sets it up again
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"), torch.no_grad():
        model(PROBE)
        model(PROBE)
    casts = [r for r in caplog.records if "inputs will be cast" in r.getMessage()]
    assert len(casts) == 1, len(casts)


def test_a_worker_drops_bitsandbytes_hint_about_a_hub_kernel(caplog):
    """bitsandbytes' import warns on an AVX-512 BF16 CPU that it could not fetch a Hub kernel (every
    worker of every CPU job, where peft imports it); a worker's logging drops that line, not errors."""
    from zerolab.worker_log import setup_worker_logging

    setup_worker_logging(own_handler=False)
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        cpu_ops.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.")
        cpu_ops.error("a real failure")
    assert [r.getMessage() for r in caplog.records] == ["a real failure"]


def test_the_estimate_counts_packed_weights_and_their_constants():
    """7B shape: nf4 stores each projection weight in half a byte plus its constants; the
    embeddings, head and norms stay bf16; ZeRO-3 over two GPUs splits the packed bytes but not the
    constants; a dequantized copy of the largest projection is counted at the peak."""
    from zerolab.memory import estimate
    from zerolab.memory.shapes import ModelShape
    from zerolab.models import KNOWN_CONFIGS

    config = KNOWN_CONFIGS["Qwen/Qwen2.5-7B"]
    shape = ModelShape.from_config(config)
    overrides = ["model.name_or_path=Qwen/Qwen2.5-7B", "scaling.use_gpu=true", "scaling.num_workers=1", "train.precision=bf16",
                 "adapter.target_modules=[all-linear]", "adapter.r=16", "model.gradient_checkpointing=true", "data.max_seq_length=4096"]
    plain = estimate(load_config(None, overrides), config)
    nf4 = estimate(load_config(None, [*overrides, "model.quantization=nf4"]), config)
    linear = sum(i * o for i, o in shape.linear_shapes().values()) * shape.num_layers
    rest = shape.num_params() - linear
    adapters = 2 * nf4.trainable_params  # bf16 beside each projection
    expected = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + rest * 2 + adapters
    assert nf4.device["weights"] == pytest.approx(expected, rel=1e-6)
    assert plain.device["weights"] == shape.num_params() * 2 + adapters
    assert nf4.device_peak < plain.device_peak - (plain.device["weights"] - nf4.device["weights"]) + 2 * 18944 * 3584 + 1
    sharded = estimate(load_config(None, [*overrides, "model.quantization=nf4", "deepspeed.stage=3", "scaling.num_workers=2"]), config)
    assert sharded.device["weights"] < 0.6 * nf4.device["weights"]
    int8 = estimate(load_config(None, [*overrides, "model.quantization=int8"]), config)
    rows = sum(o for _, o in shape.linear_shapes().values()) * shape.num_layers
    assert int8.device["weights"] == pytest.approx(linear + 4 * rows + rest * 2 + adapters, rel=1e-6)
    # zerolab's products keep nothing of their inputs (zerolab.quantized_products): the activations
    # are a 4-bit base's, at every stage.
    for stage in (2, 3):
        assert estimate(load_config(None, [*overrides, "model.quantization=int8", f"deepspeed.stage={stage}"]), config).device[
            "activations"] == estimate(load_config(None, [*overrides, "model.quantization=nf4", f"deepspeed.stage={stage}"]),
                                       config).device["activations"]


def test_every_rank_reads_a_quantized_base_under_zero3_too():
    """ZeRO-3 reads a plain checkpoint once (rank 0, into the partitions), but a quantized base loads
    whole through every rank's device map (14B nf4 and int8 on two GPUs, h200x2-59: 58.1 GiB of host
    memory for the two workers under ZeRO-3 as under ZeRO-2): every worker's load counts it."""
    from zerolab.memory import estimate
    from zerolab.models import KNOWN_CONFIGS

    config = KNOWN_CONFIGS["Qwen/Qwen2.5-7B"]
    overrides = ["model.name_or_path=Qwen/Qwen2.5-7B", "scaling.use_gpu=true", "scaling.num_workers=2", "train.precision=bf16",
                 "deepspeed.stage=3", "data.max_seq_length=4096"]
    plain = estimate(load_config(None, overrides), config)
    nf4 = estimate(load_config(None, [*overrides, "model.quantization=nf4"]), config)
    assert plain.host_other_worker_phases["model load"] < plain.host_worker_phases["model load"] / 2
    assert nf4.host_other_worker_phases["model load"] == nf4.host_worker_phases["model load"]
    assert nf4.host_other_worker_phases["model load"] > 7.6e9 * 2  # the bf16 checkpoint's pages


def test_under_zero3_the_estimate_counts_the_base_whole_while_it_loads():
    """14B shape, one packed 4k row, ZeRO-3: a quantized base loads whole on every GPU (quantized as it arrives) and
    ``deepspeed.initialize`` partitions it, so the load holds every weight packed, the embeddings
    and head, the adapters and, in flight, the larger of a projection in bf16 and the partition
    made for the embeddings. The step's peak is higher over two GPUs and over eight, with the layers
    ZeRO-3 holds gathered under its live-parameter cap (``terms._held_by_leaf_coordinator``). int8's
    measured held bytes belong to bitsandbytes' own product, which ZeRO-3 does not run."""
    from zerolab.memory import estimate
    from zerolab.memory.shapes import ModelShape
    from zerolab.models import KNOWN_CONFIGS

    config = KNOWN_CONFIGS["Qwen/Qwen2.5-14B"]
    shape = ModelShape.from_config(config)
    overrides = ["model.name_or_path=Qwen/Qwen2.5-14B", "scaling.use_gpu=true", "train.precision=bf16", "adapter.target_modules=[all-linear]",
                 "adapter.r=16", "model.gradient_checkpointing=true", "data.max_seq_length=4096", "deepspeed.stage=3",
                 "train.micro_batch_size=1", "data.packing=true", "model.attn_implementation=varlen", "model.kernels=liger"]
    eight = estimate(load_config(None, [*overrides, "model.quantization=nf4", "scaling.num_workers=8"]), config)
    linear = sum(i * o for i, o in shape.linear_shapes().values()) * shape.num_layers
    rest = shape.num_params() - linear
    whole = linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + rest * 2 + 2 * eight.trainable_params
    in_flight = max(2 * 13824 * 5120, math.ceil(shape.vocab_size * shape.hidden_size * 2 / 8))
    assert eight.device_phases["quantized load"] == pytest.approx(whole + in_flight + eight.device["framework"], rel=1e-6)
    assert eight.device_peak_phase == "forward/backward" and eight.device_phases["quantized load"] < eight.device_peak
    two = estimate(load_config(None, [*overrides, "model.quantization=nf4", "scaling.num_workers=2"]), config)
    assert two.device_peak_phase == "forward/backward" and two.device_phases["quantized load"] < two.device_peak
    for other in (["model.quantization=nf4", "deepspeed.stage=2"], ["model.quantization=none"]):
        assert "quantized load" not in estimate(load_config(None, [*overrides, "scaling.num_workers=2", *other]), config).device_phases
    int8 = estimate(load_config(None, [*overrides, "model.quantization=int8", "scaling.num_workers=2"]), config)
    # Half the int8 weights, their scales and half the rest (bf16).
    assert int8.device["weights"] < 0.7 * linear
    assert int8.device_phases["quantized load"] > linear + rest * 2


# --- DeepSpeed over two ranks (gloo) --------------------------------------------------------------


def _steps_worker(rank: int, overrides: list[str], port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    from zerolab import ds_config
    from zerolab.ds_runtime import init_distributed
    from zerolab.engine import Zero3Loading, build_model, initialize_engine

    init_distributed("gloo")
    cfg = load_config(None, ["scaling.num_workers=2", "train.precision=bf16", "adapter.dropout=0", "train.lr=1e-3", *overrides])
    ds = ds_config.resolve(cfg, {"hidden_size": 128})
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even the tiny model's weights
    zero3 = Zero3Loading()
    torch.manual_seed(0)
    engine = initialize_engine(build_model(cfg, ds, 10, zero3=zero3), cfg, ds, 10)
    torch.manual_seed(rank)
    ids = torch.randint(5, 500, (2, 24))
    losses = []
    for _ in range(4):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weight = next(p for n, p in engine.module.named_parameters() if n.endswith("layers.0.self_attn.q_proj.base_layer.weight"))
    results[rank] = {"losses": losses, "partitioned": weight.numel() == 0}
    zero3.close()


@pytest.mark.slow  # the whole-job test below trains nf4 under ZeRO-3 on two workers in CI
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_zero3_shards_the_quantized_base_and_trains_as_zero2_does(kind):
    """ZeRO-3 partitions the quantized weights (the 4-bit ones packed in bf16, the int8 ones as
    int8) and gathers them back whole with their constants: the first loss is ZeRO-2's to bf16
    rounding, and both train."""
    z2 = on_two_ranks(_steps_worker, [f"model.quantization={kind}", "deepspeed.stage=2"])
    z3 = on_two_ranks(_steps_worker, [f"model.quantization={kind}", "deepspeed.stage=3"])
    assert z3[0]["partitioned"] and not z2[0]["partitioned"]
    for rank in (0, 1):
        assert z3[rank]["losses"][0] == pytest.approx(z2[rank]["losses"][0], rel=2e-3)
        assert z3[rank]["losses"][-1] < z3[rank]["losses"][0] - 0.5 and z2[rank]["losses"][-1] < z2[rank]["losses"][0] - 0.5


WIDE_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
"""A model whose projections hold most of its bytes (nf4: 5.75 MiB of them, the rest 2.8 MiB)."""


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory) -> str:
    return save_random_qwen2(tmp_path_factory.mktemp("wide-qwen2"), WIDE_SHAPE)


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor of this process uses, each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    storages.pop(0, None)
    return sum(storages.values())


def _memory_worker(rank: int, model_path: str, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    from zerolab import ds_config
    from zerolab.ds_runtime import init_distributed
    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.quantized_products import _whole

    init_distributed("gloo")
    found = {}
    for kind in ("nf4", "int8"):
        cfg = load_config(None, ["scaling.num_workers=2", "train.precision=bf16", "adapter.dropout=0", f"model.name_or_path={model_path}",
                                 f"model.quantization={kind}", "deepspeed.stage=3", "adapter.target_modules=[all-linear]",
                                 "model.gradient_checkpointing=true"])
        ds = ds_config.resolve(cfg, {"hidden_size": 128})
        # Every weight partitioned, released after its layer and fetched no earlier than its layer: what
        # the forward pass adds is then its activations alone.
        ds["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
        zero3 = Zero3Loading()
        torch.manual_seed(0)
        model = build_model(cfg, ds, 10, zero3=zero3)
        layers = quantization.quantized_layers(model)
        whole = sum(layer.weight.untyped_storage().nbytes() for layer in layers.values())
        loaded = live_tensor_bytes()
        engine = initialize_engine(model, cfg, ds, 10)
        engine.train()
        initialized = live_tensor_bytes()
        ids = torch.randint(5, 500, (1, 32))
        loss = engine(input_ids=ids, labels=ids).loss
        forward = live_tensor_bytes()
        engine.backward(loss)
        engine.step()
        del loss
        stepped = live_tensor_bytes()
        weight = next(iter(layers.values())).weight
        with _whole(weight):  # what the backward does with a weight DeepSpeed released
            gathered = weight.numel() == weight.ds_numel
        found[kind] = {"whole": whole, "loaded": loaded, "initialized": initialized, "forward": forward, "stepped": stepped,
                       "trainable": sum(p.ds_numel for p in engine.module.parameters() if p.requires_grad),
                       "gathered": gathered, "released": weight.numel() == 0}
        zero3.close()
        del engine, model, layers, weight
    results[rank] = found


def test_zero3_holds_half_the_quantized_weights_per_rank_through_a_step(wide_model_path):
    """ZeRO-3 over two ranks, counted by the storages of live tensors: ``deepspeed.initialize`` frees
    half of the quantized weights on each rank (int8: bitsandbytes' cached copy of the weight kept
    all of it), the forward pass adds its activations but no whole weight (4-bit: bitsandbytes'
    autograd context kept every layer's gathered weight until the backward, the whole model again),
    and the step adds the adapters' optimizer state. A weight DeepSpeed released is gathered for a
    backward that needs it and released after."""
    results = on_two_ranks(_memory_worker, wide_model_path)
    problems = []
    for rank in (0, 1):
        for kind, m in results[rank].items():
            checks = {
                "initialize keeps half the quantized weights": m["initialized"] <= m["loaded"] - 0.4 * m["whole"],
                "the forward pass keeps no whole weight": m["forward"] - m["initialized"] <= 0.15 * m["whole"],
                # bf16 gradients, fp32 master weights and two Adam moments of this rank's half of the adapters.
                "the step adds the adapters' state": m["stepped"] - m["initialized"] <= 8 * m["trainable"] + 0.1 * m["whole"],
                "a released weight is gathered and released again": m["gathered"] and m["released"],
            }
            problems += [f"rank {rank}, {kind}: not {check}: {m}" for check, ok in checks.items() if not ok]
    assert not problems, "\n".join(problems)


# --- a whole job ----------------------------------------------------------------------------------


@pytest.mark.ray
def test_a_qlora_job_trains_resumes_evaluates_and_exports(ray_cluster, tmp_path, tiny_model_path):
    """jobs/sft.py's path with an nf4 base under ZeRO-3 on two Ray workers: it trains, the MLflow
    record says the base was quantized, more steps continue from the checkpoint, the evaluation
    after training loads the base quantized, and the export merges into the dequantized base what
    the quantized model with its adapter computes."""
    from mlflow import MlflowClient

    from zerolab.export import export_merged
    from zerolab.reference import resolve_target
    from zerolab.run import run_sft

    base = tiny_overrides(tmp_path, **{"model.quantization": "nf4", "deepspeed.stage": 3, "train.max_steps": 4,
                                       "train.lr": 2e-3, "run.name": "qlora"})
    first = run_sft(load_config(None, base))
    run = MlflowClient(first.tracking_uri).get_run(first.run_id)
    assert run.data.params["model.quantization"] == "nf4" and run.data.tags["base_quantization"] == "nf4"
    more = run_sft(load_config(None, [*base, "train.max_steps=6", "eval.enabled=true", "eval.num_examples=4",
                                      "eval.max_new_tokens=8"]))
    assert more.run_id == first.run_id and more.metrics["step"] == 6
    history = MlflowClient(more.tracking_uri).get_metric_history(more.run_id, "train/loss")
    assert sorted(m.step for m in history) == [2, 4, 6] and history[-1].value < history[0].value
    assert "eval/accuracy" in MlflowClient(more.tracking_uri).get_run(more.run_id).data.metrics

    target = resolve_target(f"runs:/{more.run_id}", None, more.tracking_uri, tmp_path / "download")
    assert target.quantization == "nf4" and target.tuned_spec().quantization == "nf4"
    result = export_merged(target, tmp_path / "merged", dtype="fp32")
    assert result["max_logit_diff"] < 1e-3
    config = (tmp_path / "merged" / "config.json").read_text()
    assert "quantization_config" not in config
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert not quantization.quantized_layers(merged) and math.isfinite(float(merged(PROBE).logits.detach().sum()))
    assert Path(result["output"]).is_dir()
