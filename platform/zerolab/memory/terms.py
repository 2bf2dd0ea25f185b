"""Device terms: what one worker holds on its GPU (or, training on CPU, in host memory) for the
model's parameters, their gradients and the optimizer — bytes per worker, one function per component."""

from __future__ import annotations

import math

from zerolab.memory.context import EstimateContext
from zerolab.memory.shapes import PROJECTIONS
from zerolab.quantization import FOUR_BIT, bytes_per_row, bytes_per_weight


def weights(job: EstimateContext) -> int:
    """ZeRO 0-2: every parameter on every rank, P·e (a quantized base's projections: their packed
    bytes). ZeRO-3: persistent parameters whole, the rest ⌈bytes/N⌉ each; with parameter offload
    only the persistent ones stay. Plus a quantized base's constants (:func:`quantization_constants`)."""
    if job.stage < 3:
        return sum(job.stored_bytes(p) * p.count for p in job.inv) + quantization_constants(job)
    total = 0
    for p in job.inv:
        if job.persistent(p):
            total += job.stored_bytes(p) * p.count
        elif not job.offload_param:
            total += job.part(job.stored_bytes(p)) * p.count
    return total + quantization_constants(job)


def quantization_constants(job: EstimateContext) -> int:
    """What bitsandbytes keeps beside each quantized weight, whole on every rank (ZeRO-3 partitions
    only the weight tensor): 4-bit, the absmax per block of 64 weights (nf4: 8-bit, plus an fp32
    constant per 256 blocks; fp4: fp32); int8, an fp32 scale per output row. The products keep
    nothing of their inputs beyond what a bf16 base's keep (``zerolab.quantized_products``)."""
    if job.quantization == "none":
        return 0

    packed = 1.0 if job.quantization == "int8" else 0.5
    shapes = job.shape.linear_shapes()
    total = 0.0
    for p in job.inv:
        if job.quantized(p):
            rows = shapes[p.module.removeprefix("layers.")][1]
            total += p.count * (p.numel * (bytes_per_weight(job.quantization) - packed) + rows * bytes_per_row(job.quantization))
    return int(total)


def dequantized_transient(job: EstimateContext) -> int:
    """A quantized base, during a projection's product: its weight dequantized, in·out elements of
    the compute dtype (4-bit: the training dtype; int8: fp16), for the largest projection."""
    if job.quantization == "none":
        return 0
    largest = max(i * o for i, o in job.shape.linear_shapes().values())
    return largest * (job.e if job.quantization != "int8" else 2)


def int8_product_transient(job: EstimateContext) -> int:
    """An int8 base, during a projection's forward product (bitsandbytes' ``int8_scaled_mm``): the
    input's int8 rows (in bytes per token) beside the int32 product and its fp16 dequantization
    (4 + 2 bytes per output element) before the output in the training dtype, which the layer's
    activations count, replaces them; or, while the input is quantized, its fp16 copy beside its
    int8 rows (3·in). For the projection where it is largest, B·S tokens. 0 for other bases."""
    if job.quantization != "int8":
        return 0
    return job.tokens * max(max(i + 4 * o, 3 * i) for i, o in job.shape.linear_shapes().values())


def quantized_load(job: EstimateContext) -> int:
    """ZeRO-3 with a quantized base, before ``deepspeed.initialize`` partitions it: transformers loads
    the base whole on every rank's device (quantized tensor by tensor as it arrives, through a device
    map, which its ZeRO-3 loading switch refuses), and peft adds the adapters. Every parameter whole
    (a quantized weight packed) with the quantization constants, plus what is in flight: the largest
    projection as read, in 16 bits, on its way to being quantized (:func:`dequantized_transient`), or
    the partition ``deepspeed.initialize`` allocates for the largest parameter while it converts them
    one by one, each whole copy freed once its partition is made. 0 for other jobs, which load
    partitioned or keep every parameter whole anyway (ZeRO 0-2: :func:`weights`)."""
    if job.stage < 3 or job.quantization == "none":
        return 0
    whole = sum(job.stored_bytes(p) * p.count for p in job.inv) + quantization_constants(job)
    partition = job.part(max(job.stored_bytes(p) for p in job.inv))
    return whole + max(dequantized_transient(job), partition)


def fp8_weights(job: EstimateContext) -> int:
    """``model.fp8``: the e4m3 copy of every FP8 projection and its transpose, two bytes per
    weight, beside the bf16 one."""
    return 2 * job.shape.num_layers * sum(i * o for i, o in job.fp8_shapes)


def fp8_transient(job: EstimateContext) -> int:
    """``model.fp8``, during a product: the input's (or gradient's) e4m3 copy, B·S·max(in, out) bytes."""
    return job.tokens * max((max(i, o) for i, o in job.fp8_shapes), default=0)


def gathered(job: EstimateContext) -> int:
    """ZeRO-3 at the start of the backward pass: parameters gathered whole and still held.

    With leaf decoder layers (zerolab's default) see :func:`_held_by_leaf_coordinator`. Per module,
    DeepSpeed releases a module's parameters after use unless they are used again within the
    next ``stage3_max_reuse_distance`` elements of the recorded module trace (forward, then
    backward, re-running each layer's forward first under gradient checkpointing). Simulating
    that rule on the trace gives what is held when the loss is computed, plus what is prefetched
    for what comes next (``_prefetched``). The prefetch's run-ahead that keeps every layer gathered
    under leaf layers does the same per module (the CPU check of :func:`_held_by_leaf_coordinator`
    without leaf layers: all 10 layers at the loss with checkpointing, 10 of 10 in the forward pass
    without, where this simulation keeps 2-3), so the larger of the two counts where the
    live-parameter cap leaves room for the whole model. With N = 1 and no parameter offload,
    gathering is a view of the partition (0 bytes).
    """
    if not job.gathers():
        return 0
    if job.cfg.deepspeed.z3_leaf_layers:
        return _held_by_leaf_coordinator(job)
    # Module -> its non-persistent parameters (name, elements, bytes); a tied head uses the embedding's.
    modules: dict[str, list[tuple[str, int, int]]] = {}
    for p in job.inv:
        if not job.persistent(p):
            key = p.module.removeprefix("layers.")
            modules.setdefault(key, []).append((p.name, job.stored_numel(p), job.stored_bytes(p)))
    if job.shape.tie_word_embeddings:
        modules["lm_head"] = modules.get("lm_head", []) + [m for m in modules.get("embed_tokens", []) if m[0] == "embed_tokens.weight"]
    layer_mods = [m for m in PROJECTIONS if m in modules]
    Step = tuple[str, int | None]
    forward: list[Step] = [("embed_tokens", None)]
    forward += [(m, i) for i in range(job.shape.num_layers) for m in layer_mods]
    forward.append(("lm_head", None))
    if job.cfg.model.gradient_checkpointing:
        backward: list[Step] = [("lm_head", None)]
        for i in reversed(range(job.shape.num_layers)):
            backward += [(m, i) for m in layer_mods] + [(m, i) for m in reversed(layer_mods)]
        backward.append(("embed_tokens", None))
    else:
        backward = list(reversed(forward))
    trace = forward + backward

    def params_of(step: Step) -> list[tuple[tuple[str, int | None], int, int]]:
        name, layer = step
        return [((pname, layer), numel, size) for pname, numel, size in modules.get(name, [])]

    held: dict[tuple[str, int | None], int] = {}
    peak_step = len(forward) - 1  # the head's forward: the loss follows and the backward starts
    for k in range(peak_step + 1):
        for pid, _, size in params_of(trace[k]):
            held[pid] = size
        if k == peak_step:
            break
        candidates = {pid for pid, _, _ in params_of(trace[k])}
        traversed = 0
        for later in trace[k + 1:]:
            if traversed >= job.knobs.max_reuse_distance or not candidates:
                break
            for pid, numel, _ in params_of(later):
                candidates.discard(pid)
                traversed += numel
        for pid in candidates:
            held.pop(pid, None)
    per_module = sum(held.values()) + _prefetched(job)
    # The run-ahead needs a live-parameter cap that leaves room for it (a user's uncapped JSON); under a
    # cap below the model's size (zerolab's derived cap, Hugging Face's 1e9, measured with
    # bench/memory_trace.py) this simulation is what was measured.
    if job.knobs.max_live_parameters >= sum(job.stored_numel(p) for p in job.inv if not job.persistent(p)):
        return max(per_module, _held_by_leaf_coordinator(job))
    return per_module


def gathered_most(job: EstimateContext) -> int:
    """ZeRO-3: the most gathered at once, at the start of the backward pass or of the forward pass
    (the all-gather stream holds it, and with leaf layers at times more: :func:`gather_stream_held`)."""
    return max(gathered(job), gathered_at_start(job))


def gather_stream_held(job: EstimateContext) -> int:
    """ZeRO-3: the most the all-gather stream holds allocated at once. With leaf decoder layers, the
    most gathered, or more where a coalesced gather's parameters are copied out of its flat buffer
    beside what is gathered (:func:`_leaf_coordinator_replay`); otherwise :func:`gathered_most`."""
    if job.gathers() and job.cfg.deepspeed.z3_leaf_layers:
        return max(gathered_most(job), _leaf_coordinator_replay(job)[1])
    return gathered_most(job)


def _held_by_leaf_coordinator(job: EstimateContext) -> int:
    """ZeRO-3 with leaf decoder layers: the most gathered at once in a step (:func:`_leaf_coordinator_replay`)."""
    return _leaf_coordinator_replay(job)[0]


def _leaf_coordinator_replay(job: EstimateContext) -> tuple[int, int]:
    """ZeRO-3 with leaf decoder layers: the most gathered at once in a step, by replaying DeepSpeed
    0.19.8's ``PartitionedParameterCoordinator`` on the step's module trace (the outer modules,
    embeddings, rotary, the layers, norm, the head where it runs as a module; the backward, with
    each layer twice under checkpointing, then the embeddings).

    Each fetch prefetches ``stage3_prefetch_bucket_size`` elements of *not yet gathered* parameters
    from the trace; entries already gathered or in flight are passed over for free, and each one
    passed marks its parameter as fetched for that later use (``__most_recent_step_id_param_fetched_for``),
    which ``__params_to_release`` then keeps gathered. The outer modules' fetches before the first
    layer put the prefetch several buckets ahead; once it reaches the end of the forward pass it
    walks the backward part of the trace over every layer still gathered, pinning each until its
    backward, and goes on gathering the released ones for the backward. With
    ``stage3_max_live_parameters`` uncapped nothing stops it: on the 7B shape 26 of 28 layers are gathered
    at the loss, on a 4-bit base (four weights per stored element, so a bucket spans ~7 layers)
    every layer and the embeddings. Checked on CPU with DeepSpeed's coordinator (2 gloo ranks,
    24-layer tiny Qwen2, counting gathers in flight: every layer at the loss, with and without
    checkpointing, reuse distance 0 or ~4 layers). A finite cap stops the run-ahead (the same CPU
    check capped at the head, the embeddings and one or three layers: 4 of 10 layers, the embeddings
    and the head at the loss). zerolab derives such a cap for adapter training
    (``ds_config.live_parameter_cap``).

    The reuse-distance rule is applied as ``__params_to_release`` scans: it counts every parameter of
    each later module, persistent ones too, recursing into a module only where the module being
    released is a leaf. From a decoder layer it counts whole layers, and at an outer module the whole
    model, which it then keeps: the layers within the reuse distance of the forward pass's end stay
    gathered, and once the prefetch has stopped at the cap the last of them are gathered on demand,
    past it. From the embeddings it counts no decoder layer (their weights are their submodules') and
    only the fused loss's head (an external parameter of the causal LM) before it meets the
    embeddings again at the end of the backward pass: they stay gathered all step. Counting the
    layers there instead released the embeddings after their forward and filled the cap with layers
    (14B nf4 over two GPUs: the head and 23 layers, 5.85 GiB, where the allocator trace of lease
    h200x2-81 has the embeddings, the head and 15 layers at the allocated peak, 4.82 GiB; allocated
    +8.6%). Checked against DeepSpeed's coordinator on CPU (2 gloo ranks, a 48-layer Qwen2 with the 14B
    nf4 shape's proportions of embeddings, layer, cap, bucket and reuse distance): the same gathered
    elements at every fetch and release of a step.

    Returns the most gathered at once and the most the all-gather stream holds allocated at once. A
    coalesced gather (more than one parameter) lands in one flat buffer; waiting for it copies each
    parameter out (``AllGatherCoalescedHandle.wait``, on the all-gather stream), and the buffer lives
    as long as the handle, which the coordinator keeps for each of the bucket's parameters until its
    fetch. So the stream holds, beside what is gathered, the buffer of each bucket waited for and not
    yet fully fetched, and at a wait that bucket's: 5.848 GiB for 14B nf4 at the forward pass's start,
    where its prefetch buckets span 7.75 and 4.5 layers (measured: 5.848, lease h200x2-81)."""
    s, k = job.shape, job.knobs
    layer = [(job.stored_numel(p), job.stored_bytes(p)) for p in job.inv
             if p.module.startswith("layers.") and not job.persistent(p)]
    big = {p.module: (job.stored_numel(p), job.stored_bytes(p)) for p in job.inv
           if p.module in ("embed_tokens", "lm_head") and not p.adapter and not job.persistent(p)}
    size = {"E": big.get("embed_tokens", (0, 0))}
    head = "E" if s.tie_word_embeddings else "H"
    if not s.tie_word_embeddings:
        size["H"] = big.get("lm_head", (0, 0))
    for i in range(s.num_layers):
        for j, nb in enumerate(layer):
            size[(i, j)] = nb
    fused = job.fused_loss
    outer = ["peft", "lora", "causal_lm", "model"]

    def params(m):
        if m == "embed":
            return ["E"] if size["E"][0] else []
        if m == "head":
            return [head] if size[head][0] else []
        return [(m[1], j) for j in range(len(layer))] if isinstance(m, tuple) else []

    layers = [("L", i) for i in range(s.num_layers)]
    forward = outer + ["embed", "rotary"] + layers + ["norm"] + ([] if fused else ["head"])
    backward = outer[:3] + ([] if fused else ["head"]) + [outer[3], "norm"]
    for m in reversed(layers):
        backward += [m, m] if job.cfg.model.gradient_checkpointing else [m]
    order = forward + backward + ["embed"]
    queue = [(p, t) for t, m in enumerate(order) for p in params(m)]
    gathered = {p: False for p in size}
    state = {"q": 0, "step": 0, "peak": 0, "numel": 0, "bytes": 0, "copying": 0}  # numel and bytes: what is gathered
    latest: dict = {}
    in_flight: list[set] = []  # coalesced gathers not yet waited for
    copied_out: list[tuple[set, set]] = []  # coalesced gathers waited for, and their parameters not yet fetched
    buffers: dict[int, int] = {}

    def mark(p, on: bool) -> None:
        if gathered[p] != on:
            gathered[p] = on
            sign = 1 if on else -1
            state["numel"] += sign * size[p][0]
            state["bytes"] += sign * size[p][1]

    if fused:
        mark(head, True)  # read outside its module by the fused loss: an external parameter, kept

    def fetch(m) -> None:
        step = state["step"]
        own = params(m)
        fresh = [p for p in own if not gathered[p]]
        for p in own:
            mark(p, True)
        # Waiting for a coalesced gather (more than one parameter) copies each parameter out of its flat
        # buffer, on the all-gather stream; the buffer stays with DeepSpeed's handle until the bucket's
        # last parameter is fetched, beside the copies.
        waited = [b for b in in_flight if not b.isdisjoint(own)]
        flat = (sum(size[p][1] for p in fresh) if len(fresh) > 1 else 0) + sum(buffers[id(b)] for b in waited)
        state["copying"] = max(state["copying"], state["bytes"] + flat + sum(buffers[id(b)] for b, _ in copied_out))
        in_flight[:] = [b for b in in_flight if b.isdisjoint(own)]
        copied_out[:] = [(b, left - set(own)) for b, left in copied_out + [(b, b) for b in waited] if left - set(own)]
        pending = {p for p in own if latest.get(p, -1) < step}
        seen: set = set()
        while state["q"] < len(queue) and len(seen) < len(pending):
            p, t = queue[state["q"]]
            state["q"] += 1
            latest[p] = t
            seen.add(p)
        # DeepSpeed prefetches at most stage3_max_live_parameters minus what is gathered (and nothing,
        # passing no entry, once that is reached): a finite cap stops the run-ahead.
        numel, bucket, limit = 0, set(), min(k.max_live_parameters - state["numel"], k.prefetch_bucket_size)
        while state["q"] < len(queue) and numel < limit:
            p, t = queue[state["q"]]
            state["q"] += 1
            latest[p] = max(latest.get(p, -1), t)
            if not gathered[p] and p not in bucket:
                bucket.add(p)
                numel += size[p][0]
        for p in bucket:
            mark(p, True)
        if len(bucket) > 1:
            in_flight.append(bucket)
            buffers[id(bucket)] = sum(size[p][1] for p in bucket)
        state["step"] += 1
        state["peak"] = max(state["peak"], state["bytes"])

    # DeepSpeed's reuse scan (``__params_to_release``) counts every parameter of a later module, persistent
    # ones included, and enters its submodules only where the module being released is a leaf: from a
    # decoder layer it counts whole layers and, at an outer module, the whole model; from the embeddings
    # (or the norm, or an unfused head) it counts only what a module holds itself, which for a decoder
    # layer or an outer module is nothing but an external parameter (the fused loss's head).
    layer_all = sum(job.stored_numel(p) for p in job.inv if p.module.startswith("layers."))
    model_all = sum(job.stored_numel(p) * p.count for p in job.inv)

    def held_itself(m) -> list:
        """The parameters ``m`` holds itself (not through a submodule)."""
        if m == "causal_lm" and fused and size[head][0]:
            return [head]
        return [] if isinstance(m, tuple) else params(m)

    def release(m, backward: bool = False) -> None:
        step = state["step"]
        candidates = {p for p in params(m) if latest.get(p, -1) <= step}
        leaf = isinstance(m, tuple)
        traversed = 0
        for later in order[step:]:
            if traversed >= k.max_reuse_distance or not candidates:
                break
            if leaf and later in outer:
                candidates.difference_update(size)
                traversed += model_all
            elif leaf and isinstance(later, tuple):
                candidates.difference_update(params(later))
                traversed += layer_all
            else:
                candidates.difference_update(held_itself(later))
                traversed += sum(size[p][0] for p in held_itself(later))
        if backward:
            candidates |= set(params(m))
        for p in candidates:
            if not (fused and p == head):
                mark(p, False)

    for m in forward:
        fetch(m)
        if m not in outer:
            release(m)
    for t, m in enumerate(backward):
        fetch(m)
        last = t + 1 == len(backward) or backward[t + 1] != m
        if m in ("head", "norm") or (isinstance(m, tuple) and last):
            release(m, backward=True)
    fetch("embed")
    return state["peak"], max(state["peak"], state["copying"])


def _layer_gathered(job: EstimateContext) -> int:
    """One decoder layer's non-persistent parameters, whole: Σ bytes (e·numel, or packed)."""
    return sum(job.stored_bytes(p) for p in job.inv if p.module.startswith("layers.") and not job.persistent(p))


def _prefetched(job: EstimateContext) -> int:
    """Parameters DeepSpeed fetches ahead of their use: one prefetch bucket (``stage3_prefetch_bucket_size``·e)."""
    return job.knobs.prefetch_bucket_size * job.e


def gathered_at_start(job: EstimateContext) -> int:
    """ZeRO-3 at the first decoder layer of the forward pass: the embeddings whole, the first
    layer and one prefetch bucket (the next layer, at zerolab's bucket size); with Liger's fused
    loss the output head's weight as well (the loss reads it outside the head module, so
    DeepSpeed keeps it gathered into the next step); with parameter offload over N > 1 ranks,
    the partition copied to the GPU for a gather in flight, ⌈numel/N⌉·e of the largest
    parameter. Measured with ``bench/memory_trace.py`` (7B LoRA, parameter offload, 2 GPUs:
    the step's peak is here; ``docs/benchmark/results/h200x2-4/memory_trace.txt``)."""
    if not job.gathers():
        return 0
    big = {p.module: p.numel for p in job.inv if p.module in ("embed_tokens", "lm_head") and not p.adapter}
    held = big.get("embed_tokens", 0) + (big.get("lm_head", 0) if job.fused_loss else 0)
    staging = job.part(max(job.stored_bytes(p) for p in job.inv if not job.persistent(p))) if job.offload_param and job.n > 1 else 0
    return job.e * held + staging + _layer_gathered(job) + _prefetched(job)


def master_weights(job: EstimateContext) -> int:
    """fp32 copies of the trainable parameters: ZeRO-0 keeps 4·T when training in bf16/fp16 (none
    in fp32); ZeRO 1-3 keep this rank's partition, 4·⌈T/N⌉, in any precision. Offload: on host."""
    if job.stage == 0:
        return 4 * job.T if job.e != 4 else 0
    return 0 if job.offload_opt else 4 * job.part(job.T)


def optimizer_states(job: EstimateContext) -> int:
    """AdamW's exp_avg and exp_avg_sq in fp32: 8·T (ZeRO-0) or 8·⌈T/N⌉; on host under offload.
    AdaLoRA adds its rank allocator's three fp32 importance tensors per adapter weight (12·T)."""
    states = 0 if job.offload_opt else 8 * (job.T if job.stage == 0 else job.part(job.T))
    if job.cfg.adapter.method == "adalora":
        states += 12 * job.T
    return states


def gradients(job: EstimateContext) -> int:
    """Gradients alive after the backward pass (DeepSpeed 0.19, ``stage_1_and_2.py``).

    ZeRO-0: every trainable parameter's gradient, T·e. ZeRO-2 (``partition_gradients``): each
    gradient is reduced in the backward hooks as it is produced; this rank's partition is kept,
    ⌈T/N⌉·e (``copy_grads_in_partition`` into ``grads_in_partition``), or streamed to the host under
    optimizer offload (0). ZeRO-1 reduces in the hooks only at the accumulation boundary and only
    with ``overlap_comm`` (``process_gradients``, ``reduce_ready_partitions_and_remove_grads``) and
    with ``contiguous_gradients`` (which offload forces on) points the other ranks' gradients into
    the reduce buckets: then as ZeRO-2; otherwise — micro-batches before the boundary under gradient
    accumulation, or ``overlap_comm`` off — every gradient stays whole on the GPU, T·e, with or
    without offload. ZeRO-3: the flat partition buffer, ⌈T/N⌉·e (0 under offload)."""
    if job.stage == 0:
        return job.T * job.e
    if job.stage == 1:
        k = job.knobs
        reduced_in_hooks = k.overlap_comm and job.cfg.train.grad_accum_steps == 1
        if not reduced_in_hooks or not (k.contiguous_gradients or job.offload_opt):
            return job.T * job.e
    if job.offload_opt:
        return 0
    return job.part(job.T) * job.e


def offload_gradient_buffer(job: EstimateContext) -> int:
    """ZeRO 1-2 with optimizer offload: the GPU buffer through which each gradient goes to the host,
    ``temp_grad_buffer_for_gpu_offload``, as large as the largest trainable parameter (e bytes
    each), allocated with the optimizer and held for the whole run."""
    return job.largest_trainable() * job.e if job.offload_opt and job.stage in (1, 2) else 0


def deepspeed_buffers(job: EstimateContext) -> int:
    """Reduction and staging buffers at the optimizer step. ZeRO-0, N > 1: the flattened bucket
    of the gradient all-reduce, min(T, 5e8)·e; in bf16/fp16 the fp32 gradient copies the step
    reads, 4·T. ZeRO 1-2: reduce buckets (two with overlap_comm) of reduce_bucket_size·e and the
    fp32 gradient partition of the step, 4·⌈T/N⌉. ZeRO-3: one reduce bucket and the fp32
    gradient partition. ZeRO 1-3 make that partition from a flattened 16-bit copy of the
    partition's gradients, which is alive with them and with the fp32 result while it is cast:
    e·⌈T/N⌉ more (ZeRO 1-2: ``flatten(averaged_gradients)`` then ``.to(float32)`` in
    ``stage_1_and_2.step``; ZeRO-3: ``_prepare_fp32_grad_for_sub_group``); in fp32 the cast
    returns the copy itself, which is the partition. Offload: the buckets only (the gradient
    staging buffer is held all along: :func:`offload_gradient_buffer`)."""
    e, k = job.e, job.knobs
    if job.stage == 0:
        allreduce = min(job.T, 500_000_000) * e if job.n > 1 else 0
        return allreduce + (4 * job.T if e != 4 else 0)
    buckets = (2 if k.overlap_comm and job.stage < 3 else 1) * min(k.reduce_bucket_size, max(job.T, 1)) * e
    if job.offload_opt:
        return buckets
    # In fp32 the cast returns the flattened copy itself: it is the partition counted above.
    return buckets + 4 * job.part(job.T) + (flat_gradient_copy(job) if e != 4 else 0)


def flat_gradient_copy(job: EstimateContext) -> int:
    """The flat 16-bit copy of the gradients each step makes and frees: ZeRO-0's all-reduce
    bucket, min(T, 5e8)·e, made on one GPU as well (``engine.allreduce_bucket``); ZeRO 1-3's
    flattened partition, e·⌈T/N⌉, from which the fp32 partition is cast; none under optimizer
    offload, which streams each gradient to the host."""
    if job.stage == 0:
        return min(job.T, 500_000_000) * job.e
    return 0 if job.offload_opt else job.part(job.T) * job.e


def gradient_norm_copy(job: EstimateContext) -> int:
    """ZeRO 1-2 where DeepSpeed 0.19.8 takes the gradient norm itself: each gradient slice of this
    rank's partition cast to float64 for its norm (``get_norm_dtype``), one at a time; the largest is
    8 bytes × the largest trainable parameter's elements (at most ⌈T/N⌉). Under optimizer offload
    ``set_norm_for_param_grad_in_gpu`` does it at the end of the backward, as each gradient goes to
    the host; otherwise ``get_grad_norm_direct`` at the step, just before the flat gradient copy
    (:func:`flat_gradient_copy`). Not in bf16 without offload, where zerolab takes the norm in one
    multi-tensor kernel without copies (``zerolab.engine.batch_zero_step_checks``)."""
    if job.stage not in (1, 2) or (job.cfg.precision() == "bf16" and not job.offload_opt):
        return 0
    return 8 * min(job.largest_trainable(), job.part(job.T))


def largest_gathered(job: EstimateContext) -> int:
    """ZeRO-3: the largest parameter gathered whole, e·numel (the embeddings, or an untied head)."""
    return job.e * max((p.numel for p in job.inv if not job.persistent(p)), default=0)


def reserved_share(job: EstimateContext) -> str:
    """The :class:`~zerolab.memory.calibration.Calibration` constant that gives peak reserved / peak
    allocated where the churn of many blocks decides it (:attr:`~zerolab.memory.options.Estimate.device_reserved`):
    ZeRO 0-2's (an int8 base's of its own) or ZeRO-3's (which :func:`stream_pools` may exceed)."""
    if job.stage < 3:
        return "reserved_factor_int8" if job.quantization == "int8" else "reserved_factor"
    return "reserved_factor_zero3"


def gather_pending(job: EstimateContext) -> int:
    """ZeRO-3 without parameter offload: the gathered layers released by the host but not yet by the
    GPU, which the all-gather stream's pool holds beside the gathered ones
    (``Calibration.gather_pending_layers_per_doubling`` per doubling of the tokens per micro-batch
    past 4,096, at most ``gather_pending_layers_max`` and every layer). 0 where the step is host-bound
    (4K tokens and fewer)."""
    if not job.gathers() or job.offload_param or not job.gpu:
        return 0
    doublings = math.log2(max(job.tokens, 1) / 4096)
    layers = min(job.shape.num_layers, job.cal.gather_pending_layers_max,
                 max(0.0, job.cal.gather_pending_layers_per_doubling * doublings))
    return int(layers * _layer_gathered(job))


def reduction_stream_gradients(job: EstimateContext) -> int:
    """ZeRO 1-2 with ``overlap_comm`` and ``contiguous_gradients`` (zerolab's shipped configs), where the
    backward hooks reduce the gradients (ZeRO-2; ZeRO-1 without accumulation) and the optimizer is on
    the GPU: the flat buffer of this rank's gradient partition, e·⌈T/N⌉ (the ``gradients`` term), which
    DeepSpeed 0.19.8 allocates on its reduction stream. ``reduce_ipg_grads`` calls
    ``copy_grads_in_partition`` inside ``with stream(self.reduction_stream)`` when ``overlap_comm`` is on,
    and the first copy of each backward pass allocates ``grads_in_partition`` there; the step frees it
    and the next backward allocates it again. torch's caching allocator never gives one stream's free
    blocks to another, so its range stays in the reduction stream's pool while the main stream's
    forward and loss reach their peak beside it (:func:`stream_pools`). 0 otherwise (offload streams
    each gradient to the host; without ``overlap_comm`` the copy is on the main stream)."""
    k = job.knobs
    in_hooks = job.stage == 2 or (job.stage == 1 and job.cfg.train.grad_accum_steps == 1)
    if not job.gpu or job.offload_opt or not in_hooks or not (k.overlap_comm and k.contiguous_gradients):
        return 0
    return job.part(job.T) * job.e


def stream_pools(job: EstimateContext, phases: dict[str, int]) -> dict[str, int]:
    """ZeRO-3 without parameter offload on GPUs: the peak of each CUDA stream's pool. torch's caching
    allocator never gives one stream's free blocks to another, and DeepSpeed gathers parameters on its
    own stream (``__allgather_stream``): the gathered weights have a pool of their own, whose peak
    (what it holds allocated at most, :func:`gather_stream_held`: the most gathered, or with leaf
    layers the gathered weights beside the flat buffers they are copied out of; plus
    :func:`gather_pending`) comes at another moment than the main stream's.
    The main stream's: each phase without its gathered weights, with the allocator's churn
    (``reserved_factor_zero3``), and on a 4-bit base its load (:func:`quantized_load`), whose range
    it keeps (an int8 load's range goes to the gathers: 14B over two H200s, reserved 1.05 × the load).
    Traced over two H200s (lease h200x2-81): 7B split at 32K rows, main 13.77 GiB and gathers 8.98;
    7B nf4, 5.81 (at the load) and 4.10; 14B nf4, 10.17 (at the load) and 5.85 (estimated 5.85, of which
    1.02 the two prefetch buckets' flat buffers at the forward pass's start).

    ZeRO 1-2 (:func:`reduction_stream_gradients`): the reduction stream's pool holds the gradient
    partition's buffer, which the main stream cannot use at its forward/backward peak. Beside that
    peak the main stream keeps one fp32 logits block (4·V per token, where the logits are
    materialised) when the micro-batches are padded: each is padded to its own longest row, so a
    step longer than those before it allocates its logits-sized blocks beyond the ranges the earlier
    steps left. Packed micro-batches have the same tokens every step and take the same ranges back
    (what they keep beyond the peak is :func:`cached_blocks`' share). 0.5B full fine-tuning, ZeRO-2,
    two H200s, 16 padded rows of at most 69 tokens: 1.086 GiB held beyond the peak, the partition's
    0.460 and the logits' 0.625. Empty otherwise."""
    grads = reduction_stream_gradients(job)
    if grads:
        padded = 0 if job.fused_loss or job.cfg.data.packing else 4 * job.shape.vocab_size * job.tokens
        return {"main stream": phases["forward/backward"] + padded, "reduction stream": grads}
    if not job.gathers() or job.offload_param or not job.gpu:
        return {}
    held = {"forward/backward": gathered(job), "forward start": gathered_at_start(job)}
    main = max(v - held.get(k, 0) for k, v in phases.items() if k != "quantized load" or job.quantization in FOUR_BIT)
    return {"main stream": int(main * job.cal.reserved_factor_zero3), "all-gather stream": gather_stream_held(job) + gather_pending(job)}


def cached_blocks(job: EstimateContext) -> dict[str, int]:
    """The large blocks each step frees and allocates again, of which torch's allocator keeps one
    cached beside the peak (:attr:`~zerolab.memory.options.Estimate.device_reserved`): with
    expandable segments a block that no longer fits where it was freed extends the segment at its
    end, and the range it left is taken only in part by the smaller tensors that follow.

    - The loss's fp32 logits, 4·V per token, where the logits are materialised (the head trains, or
      no fused loss): the upcast that cross-entropy's log-softmax reads, freed before the backward
      allocates the two fp32 gradients of the same size.
    - The flat 16-bit copy of the gradients (:func:`flat_gradient_copy`).
    - With parameter offload, the buffers of the largest gathered parameter: its partition copied
      from the host and its gathered whole, freed after its module and fetched again for the next
      (``reserved_param_offload_factor`` × :func:`largest_gathered`).
    - The float64 copy of the largest gradient slice that DeepSpeed's own norm makes
      (:func:`gradient_norm_copy`), with what cannot share its range. Under optimizer offload it is
      made inside ``reduce_ipg_grads``' ``with stream(reduction_stream)`` (``overlap_comm``, as the
      shipped ZeRO 1-2 configs set it): the allocator keeps each stream's blocks apart, so the
      main stream's largest cached block (the fp32 logits) stays reserved beside it. Measured: 0.5B
      full fine-tuning, ZeRO-1 + offload, 2 GPUs, held 1.556 GiB beyond its peak: the fp32 logits'
      0.543 and 8 × the embeddings' 136M elements, 1.014. Without offload (fp32 or fp16) it is made
      just before the step's flat gradient copy: a larger flat copy cannot reuse its range and both
      stay reserved (0.5B full ZeRO-2 in fp32, one GPU: 2.408 GiB beyond the peak; the norm copy
      1.014 and the flat copy 1.840).
    """
    blocks = {"fp32 logits": 0 if job.fused_loss else 4 * job.shape.vocab_size * job.tokens,
              "flat gradient copy": flat_gradient_copy(job)}
    if job.stage == 3 and job.offload_param:
        blocks["gathered parameter buffers"] = int(job.cal.reserved_param_offload_factor * largest_gathered(job))
    norm = gradient_norm_copy(job)
    if norm and job.offload_opt and job.knobs.overlap_comm:
        blocks["float64 norm copy + the largest other block"] = norm + max(blocks.values())
    elif norm:
        flat = blocks["flat gradient copy"]
        blocks["float64 norm copy (+ a larger flat gradient copy)"] = norm + (flat if flat > norm else 0)
    return blocks


def framework(job: EstimateContext) -> int:
    return job.cal.framework_device_bytes if job.gpu else 0
