"""The worker's training step on a real 2-rank DeepSpeed engine (gloo, CPU): one optimizer step
applies the token mean gradient over every micro-batch of both ranks whatever the ZeRO stage, and
reports that gradient's norm under ZeRO-0; AdamW's first bf16 step is a full step on every stage;
the fused loss reads ZeRO-3's partitioned head; ZeRO-3 with the decoder layers as leaf modules
trains as per-module ZeRO-3 and ZeRO-2 do and gathers each layer in one collective; ZeRO-3 on one
rank keeps every parameter gathered and trains and resumes as DeepSpeed's own release does; leftovers
of interrupted op builds are cleared."""

from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import free_port, on_ranks, on_two_ranks, rows_of, step_gradients

ACCUM = 2


def micro_batches(rank: int) -> list:
    """This rank's ACCUM micro-batches of 2 rows, collated by zerolab (padded per batch); rows of
    different lengths and prompt lengths, where a mean of per-batch means would be wrong."""
    from zerolab.batches import MicroBatches

    rows = rows_of([6, 7, 9, 14][: 2 * ACCUM], seed=100 + rank)
    return MicroBatches(rows, micro_batch_size=2, max_seq_length=64, packing=False, pad_id=0, seed=0).sequential()


def reference_gradient() -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch: sum of token losses over all four micro-batches / all their targets."""
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32)
    batches = micro_batches(0) + micro_batches(1)
    n = float(sum(b.num_targets for b in batches))
    for b in batches:
        model(**b.inputs, num_items_in_batch=torch.tensor(n)).loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return grads, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def join_group(rank: int, port: int, world: int = 2) -> None:
    """Join a gloo process group of ``world`` ranks on this machine's CPU as the jobs form it
    (``zerolab.ds_runtime.init_distributed``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    from zerolab.ds_runtime import init_distributed

    init_distributed("gloo")


def worker(rank: int, stage: int, mode: str, port: int, results: dict) -> None:
    join_group(rank, port)
    import deepspeed

    from zerolab.config import load_config
    from zerolab.engine import initialize_engine
    from zerolab.models import load_model
    from zerolab.train import optimizer_step

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if mode == "sgd":  # fp32, SGD with lr 1 and no momentum: the update is exactly the applied gradient
        cfg = load_config(None, [])
        model = load_model(cfg.model, torch.float32)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config)
    else:  # bf16 as on GPUs, zerolab's AdamW at a constant learning rate
        cfg = load_config(None, ["adapter.method=full", "train.lr=1e-2", "train.warmup_ratio=0", "train.lr_scheduler=constant"])
        model = load_model(cfg.model, torch.bfloat16)
        engine = initialize_engine(model, cfg, {**config, "bf16": {"enabled": True}}, total_steps=10)
    before = {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}
    _, norm = optimizer_step(engine, micro_batches(rank), torch.device("cpu"), want_grad_norm=True)
    if rank == 0:
        results["applied"] = {k: before[k] - p.detach().float() for k, p in engine.module.named_parameters()}
        results["norm"] = None if norm is None else float(norm)


def run_step(stage: int, mode: str) -> tuple[dict[str, torch.Tensor], float | None]:
    results = on_two_ranks(worker, stage, mode)
    return results["applied"], results["norm"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_accumulated_step_applies_the_token_mean_gradient(stage):
    expected, expected_norm = reference_gradient()
    applied, norm = run_step(stage, "sgd")
    for key, grad in expected.items():
        torch.testing.assert_close(applied[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    if stage == 0:
        assert norm == pytest.approx(expected_norm, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_first_adamw_step_in_bf16_moves_each_weight_by_the_learning_rate(stage):
    """AdamW's first step is m/sqrt(v) = g/|g| per weight (bias-corrected): every weight with a
    gradient moves by the learning rate, on every stage (ZeRO-0 wraps the optimizer in bf16)."""
    applied, _ = run_step(stage, "adamw")
    moved = torch.cat([d.flatten() for d in applied.values()])
    moved = moved[moved != 0]  # embedding rows of tokens absent from the batches get no gradient
    assert moved.abs().mean().item() / 1e-2 == pytest.approx(1.0, abs=0.05)


def step_checks_worker(rank: int, stage: int, port: int, results: dict) -> None:
    """One bf16 ZeRO-2 or ZeRO-3 step with gradient clipping, DeepSpeed's own gradient checks against
    zerolab's batched ones (``train.batch_zero_step_checks``, ``train.batch_zero3_grad_norm``), once
    clean and once with rank 0's gradient of one weight made NaN."""
    join_group(rank, port)
    import deepspeed

    from zerolab.config import load_config
    from zerolab.engine import initialize_engine
    from zerolab.models import load_model
    from zerolab.train import optimizer_step

    cfg = load_config(None, ["adapter.method=full", "train.lr=1e-2", "train.warmup_ratio=0", "train.lr_scheduler=constant"])
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}}

    def weights(engine) -> dict[str, torch.Tensor]:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            return {k: p.detach().float().clone() for k, p in engine.module.named_parameters()}

    for batched in (False, True):
        for poisoned in (False, True):
            torch.manual_seed(0)
            engine = initialize_engine(load_model(cfg.model, torch.bfloat16), cfg, config, total_steps=10)
            assert "get_grad_norm_direct" in vars(engine.optimizer)  # applied
            if not batched:  # back to DeepSpeed's own methods
                del engine.optimizer.get_grad_norm_direct
                vars(engine.optimizer).pop("check_overflow", None)
            weight = engine.module.model.layers[0].mlp.down_proj.weight
            if poisoned and rank == 0:
                weight.register_hook(lambda g: torch.full_like(g, float("nan")))
            before = weights(engine)
            optimizer_step(engine, micro_batches(rank), torch.device("cpu"))
            after = weights(engine)
            if rank == 0:
                results[(batched, poisoned)] = (float(engine.get_global_grad_norm()), {k: before[k] - after[k] for k in before})
            engine.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_batched_zero_step_checks_give_deepspeeds_norm_update_and_skipped_step(stage):
    results = on_two_ranks(step_checks_worker, stage)
    (own_norm, own), (norm, applied) = results[(False, False)], results[(True, False)]
    assert norm == pytest.approx(own_norm, rel=1e-3) and 0 < norm < float("inf")
    assert norm > 1.0  # clipping applied in both
    for key, delta in own.items():
        torch.testing.assert_close(applied[key], delta, rtol=0.02, atol=1e-4, msg=key)
    assert any(d.abs().max() > 0 for d in applied.values())
    for batched in (False, True):  # a NaN gradient on one rank: the step is skipped on every rank's record
        _, skipped = results[(batched, True)]
        assert all(d.abs().max() == 0 for d in skipped.values()), batched


def fused_loss_worker(rank: int, port: int, results: dict) -> None:
    """ZeRO-3 partitions the head's weight, and the fused loss (Liger's, here a plain-torch stand-in
    of the same function) reads it outside the head's forward: DeepSpeed must gather it there, and
    the loss must be the model's own."""
    import sys
    import types

    import torch.nn.functional as F

    join_group(rank, port)
    import deepspeed

    from zerolab import kernels
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    def fused(hidden, weight, target, ignore_index=-100, reduction="mean"):
        return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    sys.modules["liger_kernel.transformers.functional"] = functional
    torch.manual_seed(0)
    model = load_model(ModelSpec(), torch.float32)
    model.config.use_cache = False
    # An untied head, as in 7B models (a tied one is gathered for the embedding's own forward).
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.requires_grad_(False)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    # Nothing persistent and nothing kept for reuse: every weight is released after its module runs.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD([model.model.layers[0].mlp.down_proj.weight], lr=0.0),
                                      config=config)
    engine.train()  # the fused loss is for training
    batch = micro_batches(rank)[0]
    # The fused loss first: once the head's own forward has run, ZeRO-3 prefetches it by its trace.
    engine.module.forward = types.MethodType(kernels._fused_loss_forward, engine.module)
    got = engine(**batch.inputs)
    engine.backward(got.loss)
    head_shape = tuple(engine.module.lm_head.weight.shape)
    del engine.module.forward
    expected = engine(**batch.inputs).loss.item()
    results[rank] = (got.loss.item(), expected, head_shape)


@pytest.mark.slow
def test_fused_loss_reads_the_zero3_partitioned_head():
    results = on_two_ranks(fused_loss_worker)
    for got, expected, head_shape in results.values():
        assert got == pytest.approx(expected, rel=1e-5)
        assert 0 in head_shape  # partitioned again after the loss


LEAF_VARIANTS = {"ZeRO-2": (2, False), "ZeRO-3": (3, False), "ZeRO-3 leaf layers": (3, True)}


def leaf_config(stage: int, leaf: bool, method: str, gradient_checkpointing: bool, compiled: bool = False) -> tuple:
    """zerolab's config and resolved DeepSpeed JSON for 2 ranks. Under ZeRO-3 nothing is prefetched
    or kept for reuse, so every frozen weight is released after each use and gathered again (in the
    backward pass and in the recomputation of gradient checkpointing)."""
    from transformers import AutoConfig

    from zerolab import ds_config
    from zerolab.config import load_config
    from zerolab.models import build_tiny_model

    cfg = load_config(None, [f"deepspeed.stage={stage}", f"deepspeed.z3_leaf_layers={str(leaf).lower()}", f"adapter.method={method}",
                             f"model.gradient_checkpointing={str(gradient_checkpointing).lower()}", "adapter.dropout=0",
                             f"model.compile={str(compiled).lower()}",
                             "train.micro_batch_size=2", f"train.grad_accum_steps={ACCUM}", "train.lr=1e-2", "train.warmup_ratio=0",
                             "train.lr_scheduler=constant"])
    resolved = ds_config.resolve(cfg, AutoConfig.from_pretrained(build_tiny_model()))
    if stage == 3:
        resolved["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    return cfg, resolved


def leaf_worker(rank: int, method: str, gradient_checkpointing: bool, port: int, results: dict) -> None:
    join_group(rank, port)
    from zerolab import lora_nodes

    fused: list[str] = []
    for node in (lora_nodes._LoRALinear, lora_nodes._SharedInputLoRA):  # counts the one-node LoRA products by kind
        node.apply = staticmethod(lambda *args, apply=node.apply, kind=node.__name__: fused.append(kind) or apply(*args))
    for name, (stage, leaf) in LEAF_VARIANTS.items():
        fused.clear()
        trained = train_variant(rank, stage, leaf, method, gradient_checkpointing)
        if rank == 0:
            results[name] = trained
            results[name, "fused"] = set(fused)


def train_variant(rank: int, stage: int, leaf: bool, method: str, gradient_checkpointing: bool, compiled: bool = False) -> tuple:
    """The losses of two optimizer steps, then the trainable parameters' gradients of a third and
    the weights after it."""
    import deepspeed

    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.train import optimizer_step

    cfg, resolved = leaf_config(stage, leaf, method, gradient_checkpointing, compiled)
    torch.manual_seed(0)
    zero3 = Zero3Loading()  # ZeRO-3's loading switch, on while this function trains
    engine = initialize_engine(build_model(cfg, resolved, total_steps=10, zero3=zero3), cfg, resolved, total_steps=10)
    engine.train()
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    losses = [optimizer_step(engine, micro_batches(rank), torch.device("cpu"))[0].item() for _ in range(2)]
    with step_gradients(engine) as grads:
        optimizer_step(engine, micro_batches(rank), torch.device("cpu"))
    with deepspeed.zero.GatheredParameters([p for _, p in trainable], enabled=stage == 3):
        weights = {n: p.detach().float().clone() for n, p in trainable}
    engine.destroy()
    return losses, grads, weights


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_zero3_leaf_layers_train_as_per_module_zero3_and_zero2(method, gradient_checkpointing):
    """Gradients of leaf parameters are reduced by one hook per layer after its backward pass; the
    first layer's input comes from frozen embeddings under LoRA, where that hook would fire before
    the layer's backward had produced them (the gradients then arrive after the reduction). LoRA
    in leaf layers takes the one-node products (Q/K/V and gate/up sharing theirs), per-module ZeRO-3
    peft's forward."""
    results = on_two_ranks(leaf_worker, method, gradient_checkpointing)
    # LoRA's one-node product reads its weights directly: whole in a leaf layer, gathered module by
    # module (so not whole there) without.
    if method == "lora":
        both = {"_LoRALinear", "_SharedInputLoRA"}
        assert results["ZeRO-3 leaf layers", "fused"] == results["ZeRO-2", "fused"] == both and not results["ZeRO-3", "fused"]
    losses, grads, weights = results["ZeRO-3 leaf layers"]
    layer0 = [n for n in grads if ".layers.0." in n]
    assert layer0 and len(grads) > len(layer0)
    for reference in ("ZeRO-3", "ZeRO-2"):
        ref_losses, ref_grads, ref_weights = results[reference]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            # Summation order differs between the stages (~2e-5 of the largest element in fp32).
            torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=2e-4 * g.abs().max().item(), msg=f"{reference}: {n}")
            # lr 1e-2: a weight AdamW moves by the wrong gradient is off by about that much.
            torch.testing.assert_close(weights[n], ref_weights[n], rtol=0, atol=1e-3, msg=f"{reference}: {n}")


ONE_RANK_VARIANTS = ("kept gathered", "DeepSpeed's release at each step", "gathered per layer")


def one_rank_worker(rank: int, checkpoints: str, port: int, results: dict) -> None:
    """ZeRO-3 LoRA on one rank, leaf layers: as zerolab builds it (every parameter persistent, kept
    gathered across the optimizer step), with DeepSpeed's own release and gather around each step,
    and with the persistence threshold of several ranks (each layer's weights gathered and released
    around it). Two steps, a checkpoint as the jobs save it, a third step; then a new engine loads the
    checkpoint and takes the third step again."""
    join_group(rank, port, world=1)
    import deepspeed
    from transformers import AutoConfig

    from zerolab import ds_config
    from zerolab.config import load_config
    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.models import build_tiny_model
    from zerolab.train import optimizer_step

    cfg = load_config(None, ["deepspeed.stage=3", "scaling.num_workers=1", "adapter.dropout=0", "train.micro_batch_size=2",
                             f"train.grad_accum_steps={ACCUM}", "train.lr=1e-2", "train.warmup_ratio=0", "train.lr_scheduler=constant"])
    model_config = AutoConfig.from_pretrained(build_tiny_model())

    def engine_of(variant: str, released: list) -> tuple:
        resolved = ds_config.resolve(cfg, model_config)
        if variant == "gathered per layer":
            resolved["zero_optimization"]["stage3_param_persistence_threshold"] = 10 * model_config.hidden_size
        torch.manual_seed(0)
        engine = initialize_engine(build_model(cfg, resolved, total_steps=10, zero3=Zero3Loading()), cfg, resolved, total_steps=10)
        if variant != "kept gathered":
            vars(engine.optimizer).pop("step", None)  # DeepSpeed's own step
        offload = engine.optimizer.parameter_offload
        offload.partition_all_parameters = lambda release=offload.partition_all_parameters: released.append(1) or release()
        engine.train()
        return engine, resolved

    def step(engine) -> float:
        return optimizer_step(engine, micro_batches(0), torch.device("cpu"))[0].item()

    for i, variant in enumerate(ONE_RANK_VARIANTS):
        released = []
        engine, resolved = engine_of(variant, released)
        losses = [step(engine), step(engine)]
        in_steps = len(released)
        folder = f"{checkpoints}/{i}"
        engine.save_checkpoint(folder, tag="state", exclude_frozen_parameters=True)
        losses.append(step(engine))
        params = list(engine.module.parameters())
        aliased = all(p.data.data_ptr() == p.ds_tensor.data_ptr() for p in params)
        with deepspeed.zero.GatheredParameters(params):
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
        engine.destroy()
        resumed, _ = engine_of(variant, [])
        resumed.load_checkpoint(folder, tag="state", load_module_strict=False)
        threshold = resolved["zero_optimization"]["stage3_param_persistence_threshold"]
        results[variant] = (threshold, in_steps, aliased, losses, step(resumed), weights)
        resumed.destroy()


def test_one_rank_zero3_keeps_every_parameter_gathered_and_trains_as_deepspeeds_own_release(tmp_path):
    """On one rank each parameter is its own partition: zerolab keeps every one gathered, never
    releases them around an optimizer step (each already reads its partition's memory, which the
    step updates), and trains to the same losses and weights as DeepSpeed's release and gather around
    every step and as gathering each layer around its use; a checkpoint saved and loaded between
    steps resumes to the same loss."""
    from zerolab.ds_config import UNCAPPED

    results = on_ranks(1, one_rank_worker, str(tmp_path))
    threshold, in_steps, aliased, losses, resumed, weights = results["kept gathered"]
    assert threshold == UNCAPPED and in_steps == 0 and aliased
    assert losses[2] < losses[0]  # the steps' updates reach the parameters the forward reads
    assert resumed == pytest.approx(losses[2], rel=1e-6)
    assert results["DeepSpeed's release at each step"][1] == 2
    # Not every parameter persistent: DeepSpeed's own step, released before each.
    assert results["gathered per layer"][0] < UNCAPPED and results["gathered per layer"][1] == 2
    for variant in ONE_RANK_VARIANTS[1:]:
        _, _, _, ref_losses, ref_resumed, ref_weights = results[variant]
        assert losses == pytest.approx(ref_losses, rel=1e-6), variant
        assert resumed == pytest.approx(ref_resumed, rel=1e-6), variant
        assert weights.keys() == ref_weights.keys()
        for n, w in ref_weights.items():
            torch.testing.assert_close(weights[n], w, rtol=0, atol=1e-6, msg=f"{variant}: {n}")


def compile_worker(rank: int, gradient_checkpointing: bool, port: int, results: dict) -> None:
    join_group(rank, port)

    import torch._dynamo

    counters = torch._dynamo.utils.counters
    for name in ("ZeRO-2", "ZeRO-3 leaf layers"):
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            trained = train_variant(rank, *LEAF_VARIANTS[name], "lora", gradient_checkpointing, compiled)
            if rank == 0:
                results[(name, compiled)] = trained
            if rank == 0 and compiled:
                results[(name, "graphs")] = (counters["stats"]["unique_graphs"], dict(counters["graph_break"]))


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["no-checkpointing", "checkpointing"])
def test_compiled_decoder_layers_train_as_eager_ones_under_zero2_and_zero3(gradient_checkpointing):
    """``model.compile`` under DeepSpeed on 2 ranks: ZeRO-2 (fused LoRA inside the compiled layer)
    and ZeRO-3 with leaf layers (the gathers stay in the eager hooks around the compiled forward),
    with and without recomputation: the losses, gradients and updated weights of eager layers."""
    results = on_two_ranks(compile_worker, gradient_checkpointing)
    for name in ("ZeRO-2", "ZeRO-3 leaf layers"):
        graphs, breaks = results[(name, "graphs")]
        assert 0 < graphs <= 4 and not breaks, (name, graphs, breaks)  # one graph per shape serves every layer, whole
        (losses, grads, weights), (ref_losses, ref_grads, ref_weights) = results[(name, True)], results[(name, False)]
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert grads.keys() == ref_grads.keys() and grads
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=2e-4 * g.abs().max().item(), msg=f"{name}: {n}")
            torch.testing.assert_close(weights[n], ref_weights[n], rtol=0, atol=1e-3, msg=f"{name}: {n}")


def gather_count_worker(rank: int, port: int, results: dict) -> None:
    join_group(rank, port)
    import deepspeed
    import deepspeed.comm
    from deepspeed.utils import z3_leaf_module

    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.models import decoder_layers
    from zerolab.train import optimizer_step

    cfg, resolved = leaf_config(3, True, "lora", False)
    zero3 = Zero3Loading()  # ZeRO-3's loading switch, on while this function trains
    engine = initialize_engine(build_model(cfg, resolved, total_steps=10, zero3=zero3), cfg, resolved, total_steps=10)
    layers = decoder_layers(engine.module)
    gathers = []
    allgather = deepspeed.comm.allgather_fn

    def counted(*args, **kwargs):
        gathers.append(1)
        return allgather(*args, **kwargs)

    engine.train()
    # DeepSpeed keeps the persistent parameters (norms, adapters) gathered once it has recorded a
    # step's module trace; until then it gathers and releases them with the rest.
    for _ in range(2):
        optimizer_step(engine, micro_batches(rank), torch.device("cpu"))
    deepspeed.comm.allgather_fn = counted
    with torch.no_grad():
        engine(**micro_batches(rank)[0].inputs)
    deepspeed.comm.allgather_fn = allgather
    # DeepSpeed registered them as leaves at initialize: each parameter knows its leaf.
    registered = all(z3_leaf_module(m) and all(p.ds_z3_leaf_module is m for p in m.parameters()) for m in layers)
    results[rank] = (len(layers), registered, len(gathers))


@pytest.mark.slow
def test_zero3_gathers_each_decoder_layer_in_one_collective():
    """A forward pass with nothing prefetched or reused gathers the embedding, each decoder layer's
    partitioned weights in one collective, and the tied head (per module: 22 collectives, the
    tiny model's layers having five partitioned weights each)."""
    results = on_two_ranks(gather_count_worker)
    for num_layers, registered, gathers in results.values():
        assert num_layers == 4 and registered
        assert gathers == num_layers + 2


def test_decoder_layers_are_the_repeated_blocks_under_peft_and_around_experts(tiny_model_path):
    from zerolab import adapters
    from zerolab.config import AdapterSpec, ModelSpec
    from zerolab.models import decoder_layers, load_model

    model = adapters.apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(r=4), total_steps=1)
    assert decoder_layers(model) == list(model.base_model.model.model.layers)

    class MoELayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(8))  # longer, fewer parameters

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(MoELayer() for _ in range(2))

    stack = Stack()
    assert decoder_layers(stack) == list(stack.layers)


def test_leaf_layers_get_an_input_that_requires_grad(tiny_model_path):
    """LoRA's frozen embeddings give the first layer an input without a gradient: DeepSpeed's
    gradient reduction hook on the leaf would then fire before the layer's backward pass."""
    from deepspeed.utils import z3_leaf_module

    from zerolab import adapters
    from zerolab.config import AdapterSpec, ModelSpec
    from zerolab.engine import make_zero3_leaf_layers
    from zerolab.models import load_model

    model = adapters.apply_adapter(load_model(ModelSpec(), torch.float32), AdapterSpec(r=4), total_steps=1)
    layers = make_zero3_leaf_layers(model)
    assert len(layers) == 4 and all(z3_leaf_module(m) for m in layers)
    assert not any(z3_leaf_module(m) for m in model.modules() if m not in layers)
    seen = []
    layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].requires_grad))
    model(torch.tensor([[1, 5, 9]]))
    with torch.no_grad():
        model(torch.tensor([[1, 5, 9]]))
    assert seen == [True, False]
    with pytest.raises(RuntimeError, match="deepspeed.z3_leaf_layers=false"):
        layers[1](hidden_states=torch.zeros(1, 3, 128))


def test_stale_build_locks_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    from zerolab.ds_runtime import STALE_BUILD_LOCK_S, clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, live = tmp_path / "cpu_adam" / "lock", tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    assert clear_stale_build_locks() == [stale]
    assert not stale.exists() and live.exists()


def test_a_cpu_process_group_builds_no_inference_only_deepspeed_op(tmp_path):
    """A CPU job's process group forms without compiling DeepSpeed's shared-memory all-reduce, which
    only DeepSpeed's inference calls (it cost ~30 s at the first job of every machine), and DeepSpeed
    then counts the node's ranks from LOCAL_SIZE, as under its own launcher, instead of running
    ``numactl`` in a subprocess each time ZeRO-3 reduces a gradient bucket."""
    import subprocess
    import sys

    code = ("import deepspeed.comm.comm as c, deepspeed.utils.numa as numa\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "from zerolab.ds_runtime import init_distributed\n"
            "init_distributed('gloo', auto_mpi_discovery=False)\n"
            "assert c.cdb.shm_comm_op is None, c.cdb.shm_comm_op\n"
            "def no_subprocess(): raise AssertionError('numactl asked')\n"
            "numa.get_numa_cores = no_subprocess\n"
            "assert get_accelerator().device_count() == 3\n")
    extensions = tmp_path / "extensions"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(extensions.rglob("*shm*"))


def test_only_deepspeeds_cpu_accelerator_has_the_shared_memory_ops_builder():
    """Where zerolab marks the op (``ds_runtime.init_distributed``): DeepSpeed's CUDA accelerator has
    no builder for it, so on a GPU DeepSpeed never reads its table of compatible ops, whose first read
    probes every op builder."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from zerolab.ds_runtime import SHM_COMM_BUILDER

    assert CPU_Accelerator().get_op_builder(SHM_COMM_BUILDER) is not None
    assert CUDA_Accelerator().get_op_builder(SHM_COMM_BUILDER) is None


def test_the_steps_run_with_the_objects_made_before_them_frozen():
    """A full garbage collection during the steps walks only what the steps made (perf.frozen_heap)."""
    import gc

    from zerolab import perf

    made_before = [[i] for i in range(5000)]
    with perf.frozen_heap():
        assert gc.get_freeze_count() >= len(made_before)
        assert not any(x is made_before for x in gc.get_objects())  # frozen: out of every generation
    assert gc.get_freeze_count() == 0
    assert any(x is made_before for x in gc.get_objects())
