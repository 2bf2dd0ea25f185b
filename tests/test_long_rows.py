"""Long rows on one GPU (``zerolab.long_rows``, RoPE scaling): the config's checks; checkpoint
offload and the tiled MLP against the plain path on the tiny model (fp32, CPU), model by model and,
on two gloo ranks, through the real engine and training step under ZeRO 0-3 with LoRA, DoRA, rsLoRA
and full fine-tuning, padded and packed; RoPE scaling set on the model as it loads and the plan's
refusal of rows past the positions a model reaches."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import on_two_ranks, rows_of, step_gradients

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
"""CPU: host copies are plain copies; cuda (the GPU tier): pinned host memory, side-stream copies."""


def tiny_model(method: str = "lora", *, dropout: float = 0.0, checkpointing: bool = True, seed: int = 0,
               device: str = "cpu") -> torch.nn.Module:
    """The tiny model in fp32 on ``device`` with ``method``'s adapter (every LoRA B random, so every
    adapter weight gets a gradient), in training mode, checkpointed as zerolab's engine checkpoints it."""
    from zerolab import adapters
    from zerolab.config import AdapterSpec, ModelSpec
    from zerolab.models import load_model

    torch.manual_seed(seed)
    model = load_model(ModelSpec(gradient_checkpointing=checkpointing), torch.float32)
    if checkpointing and method != "full":
        model.enable_input_require_grads()
    model = adapters.apply_adapter(model, AdapterSpec(method=method, r=4, dropout=dropout), total_steps=1)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.to(device).train()


def loss_and_gradients(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(2)
    ids = ids.to(next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: tuple[float, dict], expected: tuple[float, dict], rtol: float = 1e-6) -> None:
    assert got[0] == pytest.approx(expected[0], rel=rtol)
    assert got[1].keys() == expected[1].keys() and expected[1]
    for name, grad in expected[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=rtol, atol=rtol * grad.abs().max().item(), msg=name)


IDS = torch.randint(5, 1000, (2, 37), generator=torch.Generator().manual_seed(3))


# --- configuration --------------------------------------------------------------------------------


def test_config_checks_the_long_row_settings():
    from zerolab.config import ConfigError, load_config

    cfg = load_config(None, ["model.gradient_checkpointing=true", "model.offload_checkpoints=true", "model.tiled_mlp=auto",
                             "model.rope_scaling=yarn", "model.rope_factor=4", "model.rope_original_max_position_embeddings=1024"])
    assert cfg.model.tiles_mlp() and cfg.model.positions(2048) == 4096
    assert load_config(None, ["model.rope_scaling=linear", "model.rope_factor=2.5"]).model.positions(2048) == 5120
    assert not load_config(None, ["model.tiled_mlp=1"]).model.tiles_mlp() and load_config(None, []).model.positions(2048) == 2048
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["model.offload_checkpoints=true", "model.tiled_mlp=-2", "model.rope_scaling=yarn"])
    text = "\n".join(exc.value.problems)
    assert "model.offload_checkpoints: offloads the checkpoints of gradient checkpointing, which is off" in text
    assert "model.tiled_mlp: -2 is not allowed" in text
    assert "model.rope_factor: 1.0 with model.rope_scaling=yarn would not reach past the model's trained length" in text
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["model.tiled_mlp=4", "model.compile=true", "model.rope_factor=2",
                           "model.rope_original_max_position_embeddings=4096"])
    text = "\n".join(exc.value.problems)
    assert "model.tiled_mlp: not with model.compile" in text
    assert "model.rope_factor: 2.0 is set but model.rope_scaling is none" in text
    assert "model.rope_original_max_position_embeddings: only model.rope_scaling=yarn takes it" in text
    # auto tiles follow each rank's rows: refused where ZeRO-3 gathers the MLP's weights per tile.
    with pytest.raises(ConfigError, match="model.tiled_mlp: auto sizes the tiles by each rank's own rows"):
        load_config(None, ["model.tiled_mlp=auto", "deepspeed.stage=3", "deepspeed.z3_leaf_layers=false"])
    load_config(None, ["model.tiled_mlp=4", "deepspeed.stage=3", "deepspeed.z3_leaf_layers=false"])
    with pytest.raises(ConfigError, match="model.rope_scaling: 'longrope' is not one of"):
        load_config(None, ["model.rope_scaling=longrope"])


# --- checkpoint offload ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["lora", "dora", "rslora", "full"])
def test_offloaded_checkpoints_give_the_same_loss_and_gradients(tiny_model_path, method, device):
    """Each layer's input but the last goes to a host copy in the forward pass (pinned, on a GPU) and
    a copy of that comes back for its recomputation, the next one's started with it: (L − 1)·B·S·h·4
    bytes per step, the same loss and gradients."""
    from zerolab.long_rows import offload_checkpoints
    from zerolab.models import decoder_layers

    expected = loss_and_gradients(tiny_model(method, device=device), IDS)
    model = tiny_model(method, device=device)
    layers = decoder_layers(model)
    inputs, restored, copies = [], [], []
    # The forward pass's layer inputs, held here so that their memory is not reused by what comes back.
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()) if len(inputs) < len(layers) else None)
             for layer in layers]
    offload = offload_checkpoints(model)
    to_host, from_host = offload._to_host, offload._from_host
    offload._to_host = lambda index, t: copies.append(c := to_host(index, t)) or c
    # Only the host copies: on CUDA the checkpoint also saves tensors the offload passes through (its
    # empty placeholder among them), which come back as they went.
    offload._from_host = lambda index, saved: (t := from_host(index, saved), None if isinstance(saved, torch.Tensor) else restored.append(t))[0]
    got = loss_and_gradients(model, IDS)
    # CUDA's fp32 attention backward sums in no fixed order.
    assert_same(got, expected, rtol=1e-6 if device == "cpu" else 1e-5)
    layers_count, hidden = len(layers), 128
    stats = offload.stats
    assert (stats.offloaded_tensors, stats.restored_tensors, stats.kept_tensors) == (layers_count - 1, layers_count - 1, 1)
    assert stats.prefetched_tensors == layers_count - 2  # each restore but the lowest layer's started a layer early
    assert stats.offloaded_bytes == (layers_count - 1) * IDS.numel() * hidden * 4
    assert all(c.host.device.type == "cpu" and c.host.is_pinned() == (device == "cuda") for c in copies)
    # What the recomputation read came back from the host copies (the lowest layer last), not the forward pass's tensors.
    assert len(restored) == layers_count - 1 and all(t.device.type == device for t in restored)
    for came_back, sent in zip(restored, reversed(inputs[:-1])):
        assert torch.equal(came_back, sent) and came_back.data_ptr() != sent.data_ptr()
    for hook in hooks:
        hook.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_restore_waits_for_the_compute_streams_queued_work():
    """A restore's device memory comes from the compute stream's pool, which hands a block out again
    as soon as the compute stream frees it, while kernels queued there before may still write it:
    the side stream's copy into it starts after them. Here a fill queued behind a sleep writes the
    very block the restore then gets; without the wait the copy lands first and the fill overwrites
    it. Once before, untimed: a kernel's first launch loads it, which can wait for the whole device."""
    from zerolab.long_rows import CheckpointOffload

    sent = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    for _ in range(2):
        offload = CheckpointOffload(2)
        copy = offload._to_host(0, sent)
        torch.cuda.synchronize()
        busy = torch.empty_like(sent)
        torch.cuda._sleep(500_000_000)  # holds the compute stream for a few hundred milliseconds
        busy.fill_(-1.0)  # queued behind the sleep
        block = busy.data_ptr()
        del busy  # back in the pool at once, for the compute stream's next allocation
        restored = offload._from_host(0, copy)
        torch.cuda.synchronize()
        assert restored.data_ptr() == block
        assert torch.equal(restored, sent)
        del restored


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_layer_inputs_leave_the_device_until_the_backward_pass(tiny_model_path, device):
    """Between the forward and the backward pass nothing holds an offloaded layer's input but its
    host copy: the forward's tensors of the layers between the first and the last are gone (the
    first layer's input, the embeddings' output made to require gradients, is held by its gradient
    accumulator; the last layer's stays by design). A pack hook that closed over the hidden states
    kept every one of them on the device: torch keeps the hook with the tensors it saved."""
    import gc
    import weakref

    from zerolab.long_rows import offload_checkpoints
    from zerolab.models import decoder_layers

    model = tiny_model("lora", device=device)
    layers = decoder_layers(model)
    inputs: list[weakref.ref] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0]))) for layer in layers]
    offload_checkpoints(model)
    loss = model(input_ids=IDS.to(device), labels=IDS.to(device)).loss
    gc.collect()
    alive = [ref() is not None for ref in inputs]
    assert alive[1:-1] == [False] * (len(layers) - 2) and alive[-1], alive
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    for hook in hooks:
        hook.remove()


def test_checkpoint_offload_needs_transformers_checkpointing_layers(tiny_model_path):
    from zerolab.long_rows import offload_checkpoints

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    with pytest.raises(ValueError, match="model.offload_checkpoints=false"):
        offload_checkpoints(Stack())


# --- tiled MLP ------------------------------------------------------------------------------------


def test_tile_counts():
    from zerolab.long_rows import mlp_tiles

    assert mlp_tiles("auto", 262144, 3584) == 74  # ⌈262144 / 3584⌉ tiles of at most h tokens
    assert mlp_tiles("auto", 3584, 3584) == 1 and mlp_tiles("auto", 3585, 3584) == 2
    assert mlp_tiles(8, 100, 64) == 8 and mlp_tiles(8, 5, 64) == 5 and mlp_tiles(0, 100, 64) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_tiled_mlp_gives_the_same_loss_and_gradients(tiny_model_path, method, checkpointing, device):
    from zerolab.long_rows import tile_mlps

    expected = loss_and_gradients(tiny_model(method, checkpointing=checkpointing, device=device), IDS)
    model = tiny_model(method, checkpointing=checkpointing, device=device)
    assert tile_mlps(model, 5) == 4
    # 74 tokens in 5 tiles: the sums of the MLP weights' gradients run in another order (fp32 rounding).
    assert_same(loss_and_gradients(model, IDS), expected, rtol=2e-5)
    with torch.no_grad():
        model.eval()
        plain = tiny_model(method, checkpointing=checkpointing, device=device).eval()
        ids = IDS.to(device)
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_tiled_mlp_recomputes_each_tile_with_its_forward_dropout_and_reduces_once(tiny_model_path, device):
    """With adapter dropout each tile draws its own masks; the backward pass recomputes the tile
    under the same random state, so output and gradients are those of the tiles computed one after
    another with autograd (a recomputation drawing new masks would differ). A trainable weight is
    marked ready for ZeRO's gradient reduction at its last tile only."""
    from zerolab.long_rows import tile_mlps
    from zerolab.models import decoder_layers

    model = tiny_model("lora", dropout=0.5, checkpointing=False, device=device)
    mlp = decoder_layers(model)[1].mlp
    forward = mlp.forward
    x = torch.randn(2, 37, 128, generator=torch.Generator().manual_seed(4)).to(device)
    grad = torch.randn(2, 37, 128, generator=torch.Generator().manual_seed(5)).to(device)

    def run(tiled: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        mlp.zero_grad()
        inp = x.clone().requires_grad_()
        torch.manual_seed(6)
        out = mlp(inp) if tiled else torch.cat([forward(t) for t in inp.reshape(-1, 128).chunk(3)]).view(2, 37, 128)
        out.backward(grad)
        return out.detach(), inp.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.grad is not None}

    reference = run(False)
    assert tile_mlps(model, 3) == 4
    lora_a = mlp.down_proj.lora_A["default"].weight
    ready = []
    lora_a.register_hook(lambda g: ready.append(lora_a.ds_grad_is_ready))
    got = run(True)
    torch.testing.assert_close(got[0], reference[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], reference[1], rtol=1e-6, atol=1e-7)
    assert got[2].keys() == reference[2].keys() and len(got[2]) == 6
    for name, g in reference[2].items():
        # The tiles' weight gradients add up in another order than one product over all tokens (CUDA's fp32
        # products differ in the last bits by that), hence a bound relative to the gradient's size.
        torch.testing.assert_close(got[2][name], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=name)
    assert ready == [False, False, True]


# --- RoPE scaling ---------------------------------------------------------------------------------


def test_rope_scaling_is_set_on_the_model_as_it_loads(tiny_model_path):
    from zerolab.config import ModelSpec
    from zerolab.models import load_model

    plain = load_model(ModelSpec(), torch.float32)
    yarn = load_model(ModelSpec(rope_scaling="yarn", rope_factor=4.0), torch.float32)
    assert plain.config.rope_parameters["rope_type"] == "default"
    params = yarn.config.rope_parameters
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"]) == ("yarn", 4.0, 2048)
    assert params["rope_theta"] == plain.config.rope_parameters["rope_theta"]  # the model's own base stays
    rotary = yarn.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling > 1
    assert not torch.allclose(rotary.inv_freq, plain.model.rotary_emb.inv_freq)
    linear = load_model(ModelSpec(rope_scaling="linear", rope_factor=2.0), torch.float32)
    torch.testing.assert_close(linear.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq / 2)
    with torch.no_grad():  # past the 2,048 trained positions
        assert yarn(input_ids=torch.randint(5, 1000, (1, 3000))).logits.isfinite().all()


def test_plan_refuses_rows_past_the_positions_the_model_reaches(tiny_model_path):
    from zerolab.config import ConfigError, load_config
    from zerolab.ds_config import config_path
    from zerolab.models import load_model_config
    from zerolab.plan import check_against_model

    def check(*overrides: str) -> None:
        cfg = load_config(None, list(overrides))
        check_against_model(cfg, load_model_config(cfg.model), config_path(cfg))

    check("data.max_seq_length=2048")
    check("data.max_seq_length=auto")
    with pytest.raises(ConfigError) as exc:
        check("data.max_seq_length=5000")
    (problem,) = exc.value.problems
    assert problem.startswith("data.max_seq_length: 5,000 tokens is past the 2,048 positions builtin:tiny-qwen2 reaches "
                              "(its max_position_embeddings)")
    assert "set model.rope_scaling=yarn and model.rope_factor=3.0" in problem and "or lower data.max_seq_length to 2048" in problem
    check("data.max_seq_length=5000", "model.rope_scaling=yarn", "model.rope_factor=3")
    with pytest.raises(ConfigError, match=r"past the 4,096 positions .* \(model.rope_scaling=linear with model.rope_factor=2\).*"
                                          r"set model.rope_scaling=linear and model.rope_factor=3.0"):
        check("data.max_seq_length=5000", "model.rope_scaling=linear", "model.rope_factor=2")


def test_auto_length_keeps_rows_up_to_the_scaled_positions(tiny_model_path):
    from zerolab.config import load_config
    from zerolab.memory.shapes import max_position_embeddings, rope_scaling_fix

    config = {"max_position_embeddings": 32768}
    assert max_position_embeddings(config) == 32768
    yarn = load_config(None, ["model.rope_scaling=yarn", "model.rope_factor=8"]).model
    assert max_position_embeddings(config, yarn) == 262144
    assert rope_scaling_fix(262144, config, yarn) == ()
    assert rope_scaling_fix(262145, config, yarn) == ("model.rope_scaling=yarn", "model.rope_factor=9.0")
    assert rope_scaling_fix(100000, config, load_config(None, []).model) == ("model.rope_scaling=yarn", "model.rope_factor=4.0")
    assert rope_scaling_fix(100000, {}, yarn) == ()


def test_evaluation_and_export_load_the_base_with_the_runs_rope_scaling(tiny_model_path, tmp_path):
    """An adapter trained with RoPE scaling is evaluated and merged on the base scaled as in training
    (the training run's params say how), and the exported folder's config carries the scaling."""
    from transformers import AutoConfig

    from zerolab import adapters
    from zerolab.config import AdapterSpec, ModelSpec
    from zerolab.export import export_merged
    from zerolab.models import load_model
    from zerolab.reference import Target, rope_of

    params = {"model.rope_scaling": "yarn", "model.rope_factor": "2.0", "model.rope_original_max_position_embeddings": ""}
    assert rope_of(params) == ("yarn", 2.0, None) and rope_of({}) == ("none", 1.0, None)
    model = adapters.apply_adapter(load_model(ModelSpec(rope_scaling="yarn", rope_factor=2.0), torch.float32), AdapterSpec(r=4),
                                   total_steps=1)
    model.save_pretrained(tmp_path / "adapter")
    target = Target(base=tiny_model_path, tuned_path=str(tmp_path / "adapter"), tuned_kind="adapter", source="test",
                    rope=rope_of(params))
    assert target.base_spec().rope == target.tuned_spec().rope == ("yarn", 2.0, None)
    result = export_merged(target, tmp_path / "merged")
    assert result["max_logit_diff"] < 1e-4
    params = AutoConfig.from_pretrained(tmp_path / "merged").rope_parameters
    assert (params["rope_type"], params["factor"]) == ("yarn", 2.0)


# --- two gloo ranks: the engine and the training step ---------------------------------------------

ACCUM = 2


def step_batches(rank: int, packing: bool) -> list:
    """This rank's ACCUM micro-batches of rows of different lengths, padded or packed (the packer's
    per-sample position ids)."""
    from zerolab.batches import MicroBatches

    rows = rows_of([6, 7, 9, 14, 11, 5][: 3 * ACCUM], seed=100 + rank)
    batches = MicroBatches(rows, micro_batch_size=2 if not packing else 1, max_seq_length=24, packing=packing, pad_id=0,
                           seed=0).sequential()
    return batches[:ACCUM]


def variant_worker(rank: int, variants: dict[str, list[str]], port: int, results: dict) -> None:
    """Train each variant (job-config overrides) on two ranks (:func:`train_variant`); rank 0 reports."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu")
    from zerolab import long_rows
    from zerolab.ds_runtime import init_distributed

    init_distributed("gloo")
    moved: list[int] = []
    to_host = long_rows.CheckpointOffload._to_host
    long_rows.CheckpointOffload._to_host = lambda self, index, t: moved.append(t.numel()) or to_host(self, index, t)
    for name, overrides in variants.items():
        moved.clear()
        trained = train_variant(rank, overrides)
        if rank == 0:
            results[name] = (*trained, len(moved), sum(moved))


def train_variant(rank: int, overrides: list[str]) -> tuple:
    """Through ``build_model``, ``initialize_engine`` and ``optimizer_step``: the losses of three
    steps, the trainable parameters' gradients of the first (from the same weights for every
    variant: compared closely) and the weights after the third."""
    import deepspeed
    from transformers import AutoConfig

    from zerolab import ds_config
    from zerolab.config import load_config
    from zerolab.engine import Zero3Loading, build_model, initialize_engine
    from zerolab.models import build_tiny_model
    from zerolab.train import optimizer_step

    cfg = load_config(None, ["adapter.dropout=0", "train.micro_batch_size=2", f"train.grad_accum_steps={ACCUM}", "train.lr=1e-2",
                             "train.warmup_ratio=0", "train.lr_scheduler=constant", *overrides])
    resolved = ds_config.resolve(cfg, AutoConfig.from_pretrained(build_tiny_model()))
    torch.manual_seed(0)
    zero3 = Zero3Loading()
    model = build_model(cfg, resolved, total_steps=10, zero3=zero3)
    gen = torch.Generator().manual_seed(1)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    with deepspeed.zero.GatheredParameters(lora_b, modifier_rank=0, enabled=cfg.deepspeed.stage == 3):
        for p in lora_b:  # peft starts B at zero, which would leave A without a gradient
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    engine = initialize_engine(model, cfg, resolved, total_steps=10)
    engine.train()
    trainable = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    batches = step_batches(rank, cfg.data.packing)
    with step_gradients(engine) as grads:
        losses = [optimizer_step(engine, batches, torch.device("cpu"))[0].item()]
    losses += [optimizer_step(engine, batches, torch.device("cpu"))[0].item() for _ in range(2)]
    with deepspeed.zero.GatheredParameters([p for _, p in trainable], enabled=cfg.deepspeed.stage == 3):
        weights = {n: p.detach().float().clone() for n, p in trainable}
    engine.destroy()
    zero3.close()
    return losses, grads, weights


def assert_trains_as(results: dict, name: str, reference: str) -> None:
    losses, grads, weights, *_ = results[name]
    ref_losses, ref_grads, ref_weights, *_ = results[reference]
    assert losses == pytest.approx(ref_losses, rel=1e-5), name
    assert grads.keys() == ref_grads.keys() and grads, name
    for n, g in ref_grads.items():
        # The tiled MLP sums its weights' gradients tile by tile: fp32 rounding apart, the same.
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(), msg=lambda m, n=n: f"{name}: {n}\n{m}")
        # After three AdamW steps at lr 1e-2, a weight whose gradient is near 0 may have moved by up to the
        # learning rate either way on rounding alone: a wrong gradient would be off by about that much
        # (as tests/test_train_step.py compares).
        torch.testing.assert_close(weights[n], ref_weights[n], rtol=0, atol=1e-3, msg=lambda m, n=n: f"{name}: {n}\n{m}")


CKPT = ["model.gradient_checkpointing=true"]
OFFLOAD = [*CKPT, "model.offload_checkpoints=true"]
BOTH = [*OFFLOAD, "model.tiled_mlp=3"]


def test_long_row_settings_train_as_the_plain_path_under_zero2():
    """LoRA under ZeRO-2 (gradients reduced in DeepSpeed's hooks as they are produced): checkpoint
    offload, the tiled MLP, both, and both on packed rows, each against checkpointing alone."""
    results = on_two_ranks(variant_worker, {"plain": CKPT, "offload": OFFLOAD, "tiled": [*CKPT, "model.tiled_mlp=3"], "both": BOTH,
                            "packed": [*CKPT, "data.packing=true"], "packed both": [*BOTH, "data.packing=true"]})
    for name in ("offload", "tiled", "both"):
        assert_trains_as(results, name, "plain")
    assert_trains_as(results, "packed both", "packed")
    assert results["plain"][3] == results["tiled"][3] == 0
    # Three layers' inputs (of the four) of every micro-batch of the three steps, B·S·h elements each.
    assert results["offload"][3] == results["both"][3] == 3 * ACCUM * 3
    tokens = sum(b.inputs["input_ids"].numel() for b in step_batches(0, packing=False))
    assert results["offload"][4] == results["both"][4] == 3 * 3 * tokens * 128


@pytest.mark.slow
@pytest.mark.parametrize(("method", "stage"), [("full", 2), ("lora", 3), ("full", 3), ("dora", 0), ("rslora", 0)])
def test_long_row_settings_train_as_the_plain_path(method, stage):
    """Checkpoint offload and the tiled MLP under every ZeRO stage and adapter method, ZeRO-3 with and
    without leaf layers (per module, each tile gathers the MLP's weights)."""
    common = [f"adapter.method={method}", f"deepspeed.stage={stage}"]
    variants = {"plain": [*common, *CKPT], "both": [*common, *BOTH]}
    if stage == 3:
        variants["per-module both"] = [*common, *BOTH, "deepspeed.z3_leaf_layers=false"]
    results = on_two_ranks(variant_worker, variants)
    for name in variants:
        if name != "plain":
            assert_trains_as(results, name, "plain")
    assert results["both"][3] == 3 * ACCUM * 3


# --- the benchmark's long-row runs ----------------------------------------------------------------


def test_long_row_benchmark_runs_train_rows_of_their_length(tmp_path, tiny_model_path, monkeypatch):
    """bench/workload.long_rows cuts each document to just under the row length (the tokens the
    pipeline makes of the rendered row); the long-row suites' runs take those rows one per
    micro-batch row at that length, with YaRN past the shapes' 32K positions, and their estimate
    inputs load as job configs."""
    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO))
    from bench import harness, workload
    from bench.calibrate_memory import estimate_overrides

    from zerolab.config import load_config

    path = workload.long_rows(tmp_path / "data", 2048, rows=2)
    assert workload.long_rows(tmp_path / "data", 2048, rows=2) == path  # written once
    lengths = [len(ids) for ids, _ in workload.tokenized_rows(path)]
    assert len(lengths) == 2 and all(2048 - 96 < n <= 2048 for n in lengths), lengths
    runs = harness.SUITES["long-rows-7b"] + harness.SUITES["long-rows-0.5b"]
    assert {r.row_tokens for r in runs} == {4096, 32768, 65536, 131072, 262144, -1}
    ws = harness.Workspace(tmp_path)
    ws.data = tmp_path / "mix.jsonl"
    ws.models = {"qwen2.5-7b": "/models/7b", "qwen2.5-0.5b": "/models/0.5b"}
    ws.long_data = {(n, 2): tmp_path / f"rows-{n}.jsonl" for n in (4096, 32768, 65536, 131072, 262144)}
    for run in runs:
        if run.row_tokens < 0:
            continue
        overrides = harness.zerolab_overrides(run, ws)
        assert f"data.train_path={ws.long_data[run.row_tokens, 2]}" in overrides and f"data.max_seq_length={run.row_tokens}" in overrides
        assert "data.num_train_rows=2" in overrides
        factor = [o for o in overrides if o.startswith("model.rope_factor=")]
        assert factor == ([f"model.rope_factor={run.row_tokens // 32768}"] if run.row_tokens > 32768 else []), run.name
        cfg = load_config(None, estimate_overrides(overrides))
        assert cfg.data.max_seq_length == run.row_tokens and cfg.train.micro_batch_size == 1
    longest = next(r for r in runs if r.row_tokens == 262144)
    cfg = load_config(None, estimate_overrides(harness.zerolab_overrides(longest, ws)))
    assert cfg.model.offload_checkpoints and cfg.model.tiled_mlp == "auto" and cfg.model.gradient_checkpointing
    assert cfg.model.positions(32768) == 262144
