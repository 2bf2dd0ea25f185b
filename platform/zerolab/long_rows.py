"""What lets one GPU train rows of 100K tokens and more beyond gradient checkpointing, as ALST does
(arXiv 2506.13996): the checkpoints kept in host memory and the MLP computed over sequence tiles.

- Checkpoint offload (``model.offload_checkpoints``, :func:`offload_checkpoints`). Under
  non-reentrant gradient checkpointing each decoder layer keeps one tensor between the forward and
  the backward pass: its input, the hidden states (L·e·h bytes per token; 7B at 256K tokens:
  47 GiB). Here each layer's input goes to pinned host memory as the layer starts, copied on a side
  stream while the layer computes, and comes back for the layer's recomputation in the backward
  pass; when a layer's input comes back, the next one the backward needs (the layer below's) starts
  copying too, so that copy overlaps the layer's recomputation and backward. The last layer's input
  stays on the GPU: the backward starts with it. On a CPU the "host copy" is a plain copy, so the
  same path runs (and is tested) without a GPU.

  DeepSpeed 0.19.8 ships the same idea (``deepspeed.runtime.activation_checkpointing.
  offload_activations.CheckpointHiddenStatesOffload``), which zerolab does not use: it keeps every
  restored input on the GPU until its context closes (a cache for repeated unpacking), so by the
  end of the backward pass all L inputs are back on the GPU; its context must span the forward and
  the backward pass and patches transformers' ``GradientCheckpointingLayer`` for the whole process;
  and it copies nothing on CPU devices. Here the offload is a property of each layer's checkpoint
  call (the wrapper of ``_gradient_checkpointing_func`` below), whose saved-tensor hooks torch keeps
  with the saved input itself, so the training loop does not change.

- Tiled MLP (``model.tiled_mlp``, :func:`tile_mlps`): each decoder layer's MLP runs over tiles of
  the micro-batch's tokens, and its backward pass recomputes one tile at a time, so the B·S × I
  intermediate tensors (gate, up, their product, and their gradients: 7B, 111 KiB per token each
  way) exist for one tile only. DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.
  ulysses_sp``) is the model; this one also restores each tile's random state for its
  recomputation, so adapter dropout draws the same masks in the backward pass as in the forward
  (DeepSpeed's draws new ones), and it keeps DeepSpeed's ``ds_grad_is_ready`` convention: the
  gradient hooks of ZeRO 1-3 reduce a trainable MLP weight once, after its last tile.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zerolab.models import decoder_layers

# --- checkpoint offload ---------------------------------------------------------------------------


@dataclass
class OffloadStats:
    """What :class:`CheckpointOffload` moved since it was made."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    prefetched_tensors: int = 0
    """Inputs whose copy back started before the backward pass asked for them (with the layer above's)."""
    kept_tensors: int = 0
    """Inputs of the last layer, which stay on the device."""


class _HostCopy:
    """One layer's input in host memory, and its way back to the device."""

    __slots__ = ("host", "device", "copied", "restored", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any) -> None:
        self.host, self.device, self.copied = host, device, copied
        self.restored: torch.Tensor | None = None
        self.ready: Any = None


class CheckpointOffload:
    """Each gradient-checkpointed decoder layer's input in host memory between the forward and the
    backward pass (see the module's docstring). Made by :func:`offload_checkpoints`; ``stats``
    counts what it moved."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.stats = OffloadStats()
        self._stream: Any = None
        # This forward pass's host copies by layer (weak: the saved tensors own them), for the prefetch.
        self._copies: list[weakref.ref | None] = [None] * num_layers

    def wrap(self, index: int, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        """The checkpoint function of layer ``index``: ``checkpoint`` (transformers'
        ``_gradient_checkpointing_func``) under saved-tensor hooks that move the layer's input
        (its first positional argument, as transformers passes the hidden states) to the host."""
        last = index == self.num_layers - 1

        def offloaded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else None
            if last or not isinstance(hidden, torch.Tensor):
                if isinstance(hidden, torch.Tensor):
                    self.stats.kept_tensors += 1
                return checkpoint(function, *args, **kwargs)
            # Weakly: torch keeps the pack hook with every tensor it saved, so a closure over the
            # hidden states would keep them on the device until the backward pass, copy or not.
            hidden_ref = weakref.ref(hidden)
            del hidden

            def pack(tensor: torch.Tensor) -> Any:
                # The checkpoint saves its inputs first, the hidden states among them; every other
                # tensor it sees is one of the layer's own activations, which it recomputes.
                return self._to_host(index, tensor) if tensor is hidden_ref() else tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: self._from_host(index, saved)):
                return checkpoint(function, *args, **kwargs)

        return offloaded

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, index: int, tensor: torch.Tensor) -> _HostCopy:
        tensor = tensor.detach()
        if tensor.is_cuda:
            stream = self._side_stream(tensor.device)
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor has been computed
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                copied = stream.record_event()
            tensor.record_stream(stream)  # its memory is reused only once the copy is done
        else:  # a plain copy on CPUs: the same path as on GPUs, without streams
            host, copied = tensor.clone(), None
        copy = _HostCopy(host, tensor.device, copied)
        self._copies[index] = weakref.ref(copy)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.numel() * host.element_size()
        return copy

    def _start_restore(self, copy: _HostCopy) -> None:
        if copy.restored is not None:
            return
        if copy.device.type != "cuda":
            copy.restored = copy.host.clone()
            return
        stream = self._side_stream(copy.device)
        restored = torch.empty_like(copy.host, device=copy.device)
        # The allocator hands out memory the compute stream has freed at once, for that stream's later
        # work: kernels queued there before may still write it, so the copy starts after them.
        stream.wait_stream(torch.cuda.current_stream(copy.device))
        restored.record_stream(stream)  # freed unused (a backward pass that stops early): wait for the copy
        with torch.cuda.stream(stream):
            stream.wait_event(copy.copied)
            restored.copy_(copy.host, non_blocking=True)
            copy.ready = stream.record_event()
        copy.restored = restored

    def _from_host(self, index: int, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        self._start_restore(saved)
        # The layer below is recomputed next: its input starts coming back while this layer runs.
        below = self._copies[index - 1]() if index > 0 and self._copies[index - 1] is not None else None
        if below is not None and below.restored is None:
            self._start_restore(below)
            self.stats.prefetched_tensors += 1
        restored, saved.restored = saved.restored, None
        if saved.ready is not None:  # allocated on the compute stream, written on the side stream
            torch.cuda.current_stream(restored.device).wait_event(saved.ready)
        self.stats.restored_tensors += 1
        return restored


def offload_checkpoints(model: torch.nn.Module) -> CheckpointOffload:
    """Keep the checkpoints of ``model``'s decoder layers in host memory (see the module's
    docstring). Call after ``gradient_checkpointing_enable`` (it wraps each layer's
    ``_gradient_checkpointing_func``, which that sets) and after the adapter is applied. Raises
    ValueError where the layers are not transformers' checkpointing layers."""
    layers = decoder_layers(model)
    if not layers or not all(callable(getattr(layer, "_gradient_checkpointing_func", None)) for layer in layers):
        raise ValueError(f"{type(model).__name__}'s decoder layers do not checkpoint through transformers' "
                         "GradientCheckpointingLayer, so their checkpoints cannot be offloaded; set "
                         "model.offload_checkpoints=false")
    offload = CheckpointOffload(len(layers))
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = offload.wrap(index, layer._gradient_checkpointing_func)
        layer.zerolab_offloads_checkpoint = index < len(layers) - 1
    return offload


# --- tiled MLP ------------------------------------------------------------------------------------


def mlp_tiles(tiles: int | str, tokens: int, hidden_size: int) -> int:
    """How many tiles ``model.tiled_mlp`` makes of a micro-batch of ``tokens`` tokens: the number
    given, or with ``auto`` tiles of ``hidden_size`` tokens (ALST's choice, which keeps a tile's
    B·S × I tensors no larger than an I × h weight), at most one per token; 1: not tiled."""
    wanted = math.ceil(tokens / hidden_size) if tiles == "auto" else int(tiles)
    return max(1, min(wanted, tokens))


class _TiledMLP(torch.autograd.Function):
    """``forward(x)`` of an MLP over ``tiles`` tiles of x's tokens, keeping only x for the backward
    pass, which recomputes each tile with gradients (under the tile's random state from the forward
    pass) and runs its backward before the next. ``params``: the MLP's trainable parameters, marked
    not ready for ZeRO's gradient reduction until the last tile."""

    @staticmethod
    def forward(ctx: Any, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int,
                params: list[torch.nn.Parameter], random: bool) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        states, outputs = [], []
        with torch.no_grad():
            for tile in flat.chunk(tiles):
                states.append(_random_state(x.device) if random else None)
                outputs.append(forward(tile))
        ctx.forward, ctx.tiles, ctx.params, ctx.states = forward, tiles, params, states
        ctx.save_for_backward(x)
        out = torch.cat(outputs)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grads = grad.reshape(-1, grad.shape[-1])
        x_grad = torch.empty_like(flat) if ctx.needs_input_grad[1] else None
        start = 0
        for i, (tile, state) in enumerate(zip(flat.chunk(ctx.tiles), ctx.states)):
            for p in ctx.params:  # ZeRO's hooks reduce a gradient once it is complete: after the last tile
                p.ds_grad_is_ready = i == len(ctx.states) - 1
            tile = tile.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad(), _restored_random_state(x.device, state):
                out = ctx.forward(tile)
            torch.autograd.backward(out, grads[start:start + len(tile)])
            if x_grad is not None:
                x_grad[start:start + len(tile)] = tile.grad
            start += len(tile)
        return None, (x_grad.view_as(x) if x_grad is not None else None), None, None, None


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _restored_random_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
    """The random state ``state`` inside the block (None: the block draws from the caller's), the caller's after it."""
    if state is None:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        torch.set_rng_state(state[0])
        if cuda:
            torch.cuda.set_rng_state(state[1], device)
        yield


def tile_mlps(model: torch.nn.Module, tiles: int | str) -> int:
    """Compute the MLP of each of ``model``'s decoder layers over ``tiles`` sequence tiles
    (:func:`mlp_tiles`; see the module's docstring); returns how many MLPs. Call once the MLP's
    forward is final (after Liger's kernels patch it) and the adapter is applied. Where gradients
    are off (evaluation) the tiles run one after another without the autograd function."""
    count = 0
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        size = hidden or next(p.shape[-1] for n, p in mlp.named_parameters() if n.endswith("weight"))
        _tile(mlp, tiles, size)
        mlp.zerolab_tiles = tiles
        count += 1
    return count


def _tile(mlp: torch.nn.Module, tiles: int | str, hidden_size: int) -> None:
    forward = mlp.forward  # Liger's, where it patched the module
    random = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in mlp.modules())

    def tiled_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = mlp_tiles(tiles, x.numel() // x.shape[-1], hidden_size)
        if n == 1 or args or kwargs:
            return forward(x, *args, **kwargs)
        if not torch.is_grad_enabled():
            out = torch.cat([forward(tile) for tile in x.reshape(-1, x.shape[-1]).chunk(n)])
            return out.view(*x.shape[:-1], out.shape[-1])
        params = [p for p in mlp.parameters() if p.requires_grad]
        return _TiledMLP.apply(forward, x, n, params, random and mlp.training)

    mlp.forward = tiled_forward


def long_row_modules(model: torch.nn.Module) -> tuple[int, int]:
    """(decoder layers whose checkpoint goes to host memory, MLPs computed in tiles) of ``model``."""
    modules = list(model.modules())
    return (sum(bool(getattr(m, "zerolab_offloads_checkpoint", False)) for m in modules),
            sum(hasattr(m, "zerolab_tiles") for m in modules))


__all__ = ["CheckpointOffload", "OffloadStats", "long_row_modules", "mlp_tiles", "offload_checkpoints", "tile_mlps"]
