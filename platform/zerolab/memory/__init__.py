"""Memory estimator and preflight: what a job needs per GPU and per node, before anything launches.

:func:`estimate` turns a job config and the model's Hugging Face config (no weights are loaded)
into an :class:`Estimate`: bytes per worker on the accelerator, component by component, and bytes
per node of host RAM. :func:`plan_options` repeats it over ZeRO stage × offload, :func:`recommend`
picks the fastest option that fits, and :func:`preflight` refuses a job that cannot fit with a
:class:`MemoryPreflightError` naming the estimate, the limit and the options that would fit.

The formulas follow what the training loop really does (``zerolab.train``):

- the model is loaded in the training precision ``e`` bytes per element (bf16/fp16: 2, fp32: 4);
  peft creates adapter weights in fp32 and DeepSpeed casts every parameter to bf16/fp16 at
  ``deepspeed.initialize`` — except under ZeRO-3, whose parameters were partitioned at load time
  (``zero.Init``) and are not cast, so there the adapters stay fp32 and so does their compute;
- the client optimizer is torch AdamW (fp32 ``exp_avg`` and ``exp_avg_sq``: 8 bytes per trainable
  parameter), or DeepSpeedCPUAdam in host memory under optimizer offload;
- in bf16/fp16 DeepSpeed keeps an fp32 master copy of every trainable parameter (ZeRO-0: the whole
  copy plus fp32 gradient copies at the step; ZeRO 1-3: this rank's partition), and ZeRO 1-3 keep
  that fp32 partition even in fp32 training;
- the loss is Hugging Face's ``ForCausalLMLoss`` on the full logits: the logits in ``e`` bytes,
  upcast to fp32, log-softmax (fp32, saved), and in the backward two more fp32 tensors of the
  logits' size; with 150k-token vocabularies this is often the largest single item;
- every Ray Train worker is its own process with its own host RSS (Python, torch, CUDA runtime,
  its dataset shard; on GPU the checkpoint passes through host memory while it loads: one file at
  a time where it loads lazily, ZeRO 0-2 in its own dtype; whole otherwise).

Sizes of saved activations were checked tensor by tensor against autograd's saved tensors on
CPU (``tests/test_memory.py`` repeats that check on tiny models). Terms that depend on the
software stack rather than on arithmetic (CUDA context, allocator fragmentation, process RSS) are
the named constants of :class:`Calibration`, fitted from measurements with
``bench/calibrate_memory.py``; ``docs/calibration/memory_calibration.md`` lists the measured errors.

The model's config comes from :func:`zerolab.models.load_model_config`. Everything here is
arithmetic on configs: importing this package starts nothing (nor torch), and only
:meth:`Limits.detect` and :func:`worker_imports_rss` (what the installed software costs a CPU
worker, measured once per environment) look at the machine.

Modules, lowest first (each imports only modules named before it): ``units``, ``errors``;
``calibration`` (the measured constants); ``shapes`` (the model's parameters by module); ``batch``
(the data's largest micro-batch); ``limits`` (the machine); ``options`` (options, estimates,
verdicts); ``context``, then ``terms``, ``activations`` and ``host`` (the formulas) and
``estimator`` (which composes them); ``planner`` (options, micro-batch, longest row); ``preflight``; ``report`` (formatting).
"""

from zerolab.memory.batch import BatchShape, MicroBatch, ShardLengths, worst_micro_batch
from zerolab.memory.calibration import (
    DEFAULT_CALIBRATION,
    DEFAULT_IMPORTS_CPU_BYTES,
    WORKER_IMPORTS,
    Calibration,
    measure_worker_imports_meanwhile,
    without_ray,
    worker_imports_rss,
)
from zerolab.memory.errors import MemoryEstimateError
from zerolab.memory.estimator import estimate
from zerolab.memory.limits import Limits, parse_size
from zerolab.memory.options import ALL_OPTIONS, RELATIVE_STEP_TIME, Estimate, Fit, PlanRow, Recommendation
from zerolab.memory.planner import (
    LONGEST_ROW_LIMIT,
    LongerRow,
    largest_micro_batch,
    long_row_config,
    longer_row_settings,
    longest_row,
    plan_options,
    recommend,
    worst_case_by_config,
)
from zerolab.memory.preflight import MemoryPreflightError, preflight
from zerolab.memory.report import format_longest_row, format_table
from zerolab.memory.shapes import PROJECTIONS, ModelShape, ParamSpec, parameter_inventory, target_projections, trainable_params
from zerolab.memory.units import GIB, KIB, MIB
from zerolab.zero import OffloadMode, Option

__all__ = [
    "ALL_OPTIONS", "BatchShape", "LONGEST_ROW_LIMIT", "LongerRow", "long_row_config", "longer_row_settings", "longest_row", "Calibration", "DEFAULT_CALIBRATION", "DEFAULT_IMPORTS_CPU_BYTES", "Estimate", "Fit", "GIB", "KIB",
    "Limits", "MIB", "MemoryEstimateError", "MemoryPreflightError", "MicroBatch", "ModelShape", "OffloadMode", "Option", "PROJECTIONS",
    "ParamSpec", "PlanRow", "RELATIVE_STEP_TIME", "Recommendation", "ShardLengths", "WORKER_IMPORTS", "estimate", "format_longest_row", "format_table",
    "largest_micro_batch", "measure_worker_imports_meanwhile", "parameter_inventory", "parse_size", "plan_options", "preflight", "recommend", "target_projections",
    "trainable_params", "without_ray", "worker_imports_rss", "worst_case_by_config", "worst_micro_batch",
]
