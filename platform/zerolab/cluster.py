"""The Ray cluster a job runs on: joining or starting it, the environment of the training
processes, where one worker trains (``scaling.launch``), and shutting down."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import zerolab
from zerolab.config import SFTConfig
from zerolab.ds_config import DS_CONFIG_DIR
from zerolab.errors import EnvironmentProblem

logger = logging.getLogger("zerolab.cluster")


CUDA_ALLOC_CONF = "expandable_segments:True"
"""The workers' ``PYTORCH_CUDA_ALLOC_CONF`` unless the driver's environment sets one."""

STORAGE_ENV_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL")
"""Where the object store is: passed from the driver's environment to the workers. Credentials are
not (Ray shows a job's runtime_env in its dashboard and job records): workers take those from their
node, as the driver does (instance role, workload identity, or the environment of ``ray start``)."""

GIL_SWITCH_S = 0.0002
"""The interpreter's thread switch interval while Ray starts beside the job's imports."""

PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch of its preemption watcher: off on a Ray instance the job started, unless set."""

TRAIN_POLL_S = "0.5"
"""How often Ray Train's controller polls the workers (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``)."""

CLUSTER_ANSWER_S = 60.0
"""How long the job waits for the Ray cluster to answer one question about itself (:func:`cluster_nodes`)."""

T = TypeVar("T")


def ask_cluster(question: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
    """``question()``, a query of the cluster through Ray's public API (under Ray Client, where
    :func:`cluster_nodes` cannot reach the GCS itself), asked from a thread with a deadline: past it
    (or at Ctrl-C) the wait ends with a message instead of a native wait that no signal interrupts."""
    answer: list[tuple[bool, Any]] = []

    def ask() -> None:
        try:
            answer.append((True, question()))
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            answer.append((False, exc))

    timeout_s = CLUSTER_ANSWER_S if timeout_s is None else timeout_s
    thread = threading.Thread(target=ask, name=f"zerolab-ask-{what.replace(' ', '-')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not answer:
        raise _no_answer(what, timeout_s)
    ok, value = answer[0]
    if not ok:
        raise value
    return value


def cluster_nodes(timeout_s: float | None = None) -> list[dict[str, Any]]:
    """The cluster's nodes as ``ray.nodes()`` lists them (``NodeID``, ``Alive``, ``Resources``), asked of
    the GCS through the client this process already talks to it with, under a deadline. ``ray.nodes()``
    and ``ray.cluster_resources()`` go through a second client (Ray 2.60's ``GlobalStateAccessor``) that
    waits without one: under load it has left a request unanswered for good while the GCS served
    everything else, in native code that no signal interrupts. Asked three times within the deadline;
    past it the job ends with a message."""
    import ray

    if ray.util.client.ray.is_connected():
        return ask_cluster(ray.nodes, "its nodes", timeout_s)
    from ray.core.generated import gcs_pb2

    client = ray._private.worker.global_worker.gcs_client
    timeout_s = CLUSTER_ANSWER_S if timeout_s is None else timeout_s
    for _ in range(3):
        try:
            infos = client.get_all_node_info(timeout=timeout_s / 3)
            break
        except ray.exceptions.RpcError:
            continue
    else:
        raise _no_answer("its nodes", timeout_s)
    return [{"NodeID": info.node_id.hex(), "Alive": info.state == gcs_pb2.GcsNodeInfo.ALIVE, "Resources": dict(info.resources_total)}
            for info in infos.values()]


def cluster_resources(timeout_s: float | None = None) -> dict[str, float]:
    """What ``ray.cluster_resources()`` gives (the alive nodes' resources summed), through :func:`cluster_nodes`."""
    total: dict[str, float] = {}
    for node in cluster_nodes(timeout_s):
        if node["Alive"]:
            for name, amount in node["Resources"].items():
                total[name] = total.get(name, 0.0) + amount
    return total


def _no_answer(what: str, timeout_s: float) -> EnvironmentProblem:
    address = os.environ.get("RAY_ADDRESS")
    fix = ("`ray status` shows its state; restart its head node, or unset RAY_ADDRESS to run on a local Ray instance, then relaunch"
           if address else "this machine may be short of memory or CPU for Ray's own processes; free some and relaunch")
    return EnvironmentProblem(f"the Ray cluster ({f'RAY_ADDRESS={address}' if address else 'the local Ray instance this job started'}) "
                              f"did not answer within {timeout_s:g} s when asked for {what}: its head node's GCS is down, "
                              f"restarting or overloaded. {fix}.")


def quiet_ray_data_logging() -> None:
    """Keep Ray Data's warnings but not its per-dataset INFO lines (a dozen per job) nor the notice
    that progress bars are off (zerolab prints its own data summary)."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def start_data_stats_actor() -> None:
    """Start Ray Data's statistics actor (named and detached, one per cluster) from this process,
    outside any placement group, before a sweep's trials start their worker groups.

    Ray Data starts it where a dataset first executes: for a worker group, in a worker, whose
    placement group captures what the worker starts. The group's end then kills the actor with it,
    and every trial of a sweep started it again, one more process on the trial's way to its first
    step."""
    from ray.data._internal.stats import get_or_create_stats_actor

    get_or_create_stats_actor()


def connect_ray(cfg: SFTConfig, *, log_to_driver: bool = True, importing: Sequence[str] = ()) -> None:
    """Join the cluster named by RAY_ADDRESS (set by ``ray job submit``; ``auto`` joins a local
    ``ray start`` cluster) or start a local one. zerolab itself is shipped to the workers with the
    job (``py_modules``), so they need not have it installed.

    ``importing``: modules to import on another thread meanwhile (:func:`job_imports`). Ray's start
    is mostly waiting for the processes it launches, the imports are the interpreter's work, so the
    two overlap (on an H100 host 21.9 s side by side against 25-27 s one after the other:
    a probe's ``overlap`` measurement, docs/benchmark.md). Ray itself starts on the calling thread: the processes it
    starts die with the thread that started them."""
    import ray

    if ray.is_initialized():
        return
    # Under `ray job submit` RAY_ADDRESS names the cluster; otherwise start a fresh local instance
    # rather than joining whatever `ray start` left registered on this machine.
    address = os.environ.get("RAY_ADDRESS") or "local"
    _check_reachable(address)  # before the imports start: a wrong address fails at once
    with _imported_meanwhile(importing):
        _connect(cfg, address, log_to_driver)


def job_imports(cfg: SFTConfig) -> tuple[str, ...]:
    """The modules an SFT job's process imports after its start (``zerolab.run`` imports none of
    them): the driver's (models, Ray Train), and the training stack where its one worker may train
    in the process (which then needs :func:`adopt_worker_env` first)."""
    driver = ("zerolab.models", "zerolab.train", "ray.train.torch")
    return (*driver, "peft", "deepspeed") if may_train_in_driver(cfg) else driver


def adopt_worker_env(cfg: SFTConfig) -> None:
    """Give this process the training processes' environment (:func:`worker_env`), where it may
    train itself; before DeepSpeed is imported, which picks its accelerator from it. A variable
    already set wins. ``TOKENIZERS_PARALLELISM`` waits for the training function
    (:func:`zerolab.worker_log.setup_worker_logging`): the process first tokenizes its data, and the fast
    tokenizer's batch encoder then runs on all the machine's cores (on a 16-core H100 host 2.5 s
    of a 7B benchmark run's start-up on one core)."""
    for name, value in worker_env(cfg).items():
        if name != "TOKENIZERS_PARALLELISM":
            os.environ.setdefault(name, value)


@contextlib.contextmanager
def _imported_meanwhile(modules: Sequence[str]) -> Iterator[None]:
    if not modules:
        yield
        return

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # imported again where it is used, which raises it there
                logger.debug("import of %s ahead of use failed: %s", name, exc)

    # Ray's start takes the interpreter lock for many short moments between its waits; at the
    # default 5 ms switch interval each of them queued behind the importing thread, which made
    # the start 3× as long (3.2 s → 10.7 s on the 2-core machine).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    thread = threading.Thread(target=load, name="zerolab-imports", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.setswitchinterval(interval)  # for the rest of the imports, the default again
        thread.join()


def _connect(cfg: SFTConfig, address: str, log_to_driver: bool) -> None:
    import ray

    env_vars = worker_env(cfg)

    # ds_configs/ travels too: a Tune trial resolves its DeepSpeed JSON on whichever node it runs.
    modules = [str(Path(zerolab.__file__).parent), *([str(DS_CONFIG_DIR)] if DS_CONFIG_DIR.is_dir() else [])]
    runtime_env = {"py_modules": modules, "env_vars": env_vars}
    options: dict[str, Any] = {}
    if address == "local":
        # Ray Train's controller and placement-group cleaner query the state API without an
        # address; with another Ray instance on the machine (a `ray start` cluster, another job)
        # they cannot tell which is theirs and print tracebacks. Name this instance's API server.
        options["dashboard_port"] = _free_port()
        env_vars["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{options['dashboard_port']}"
        # Ray Train starts an actor per run that watches for nodes being drained (spot preemption); a
        # Ray this job started is its own machine, which nothing drains: one process less per run.
        env_vars[PREEMPTION_WATCHER] = os.environ.get(PREEMPTION_WATCHER, "0")
    # A variable the submitted job's own runtime_env sets reaches the workers already, and Ray
    # refuses a ray.init that sets it again.
    job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env", {}).get("env_vars", {})
    runtime_env["env_vars"] = {k: v for k, v in env_vars.items() if k not in job_env}
    try:
        context = ray.init(address=address, runtime_env=runtime_env, log_to_driver=log_to_driver, logging_level=logging.WARNING,
                           **options)
    except ConnectionError as exc:
        raise EnvironmentProblem(
            f"could not reach the Ray cluster at RAY_ADDRESS={address!r} ({exc}). Start one with "
            "`ray start --head`, fix RAY_ADDRESS, or unset it to run on a local Ray instance."
        ) from None
    if address == "local":
        _started_here.add(ray.get_runtime_context().gcs_address)
        if context.dashboard_url:
            logger.info("Ray dashboard (of the Ray instance this job started; it stops with the job): http://%s", context.dashboard_url)
        else:
            logger.info("Ray's dashboard is not running (it needs ray[default]; Ray's logs: %s/logs)",
                        context.address_info.get("session_dir"))
    quiet_ray_data_logging()


_started_here: set[str] = set()
"""GCS addresses of the Ray instances this process started (nothing else runs on their resources)."""


def worker_env(cfg: SFTConfig) -> dict[str, str]:
    """Environment of the training processes: Ray's workers get it through the job's runtime_env,
    the job's own process (``scaling.launch=driver``) before it trains."""
    # Ray Train's controller polls its workers every 2 s by default, so a finished run (and each
    # report) waited up to that long before the controller acted on it.
    env = {"TOKENIZERS_PARALLELISM": "false",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", TRAIN_POLL_S)}
    if not cfg.scaling.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    else:
        # Segments that grow instead of fixed blocks: the caching allocator then reserves little
        # beyond the peak it allocates (fixed blocks left 1.7-2.8× the peak reserved on 2 GPUs
        # and under ZeRO-3, docs/calibration/). A value the user exported wins.
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)
    for name in ("ZEROLAB_CACHE", *STORAGE_ENV_VARS):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def worker_resources(cfg: SFTConfig) -> dict[str, float]:
    """What one training worker reserves from Ray: its CPUs, and a GPU when it trains on one."""
    return {"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if cfg.scaling.use_gpu else {})}


def may_train_in_driver(cfg: SFTConfig) -> bool:
    """Whether the config lets the job's one worker train in the job's own process: one worker, no
    retries, ``scaling.launch`` not ``workers`` (where it then trains is :func:`resolve_launch`'s)."""
    return cfg.scaling.launch != "workers" and cfg.scaling.num_workers == 1 and not cfg.run.max_failures


def needs_ray(cfg: SFTConfig) -> bool:
    """Whether the job connects to Ray before it trains: it joins a cluster (``RAY_ADDRESS``, which
    ``ray job submit`` sets), runs where Ray is connected already (a Tune trial), or trains in a
    worker group. A job of one worker on a machine of its own trains in its own process (Ray
    Train's local mode), for which a Ray instance would do nothing: it starts none (its processes,
    ports and session files; on the 2-core CPU machine its first step came 2-4 s sooner, on an H100
    host Ray's start hid behind the imports). The job starts one all the same where its inputs take
    Ray Data (:func:`zerolab.data.needs_ray_data`)."""
    import ray

    return bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized() or not may_train_in_driver(cfg)


def import_now(modules: Sequence[str]) -> None:
    """Import ``modules`` (:func:`job_imports`) on this thread: a job without Ray has nothing to
    overlap them with."""
    for name in modules:
        importlib.import_module(name)


def resolve_launch(cfg: SFTConfig) -> str:
    """``driver`` or ``workers`` for this job: ``scaling.launch``, with ``auto`` resolved. Without
    Ray (:func:`needs_ray`) the job's process trains. With Ray it trains only where it owns what
    its one worker needs: a Ray instance this process started (no other job is placed on it), or
    resources Ray reserved for this process (a Tune trial's actor, a job submitted with
    ``--entrypoint-num-gpus 1``); never through Ray Client, whose driver is not on the cluster.
    Raises EnvironmentProblem when ``driver`` is asked for and this node lacks a GPU."""
    import ray

    s = cfg.scaling
    if not ray.is_initialized():
        assert may_train_in_driver(cfg), "a worker group needs Ray (needs_ray)"
        return "driver"
    if not may_train_in_driver(cfg) or ray.util.client.ray.is_connected():
        if s.launch == "driver":
            raise EnvironmentProblem("scaling.launch=driver: the job runs through Ray Client (RAY_ADDRESS=ray://...), so its "
                                     "process is not on the cluster; submit it with `ray job submit` or set scaling.launch=workers")
        return "workers"
    if s.launch == "auto" and ray.get_runtime_context().gcs_address not in _started_here:
        reserved = reserved_resources()
        if not (reserved.get("GPU", 0) >= 1 if s.use_gpu else reserved.get("CPU", 0) >= s.cpus_per_worker):
            return "workers"
    if s.use_gpu:
        node = ray.get_runtime_context().get_node_id()
        gpus = next((n["Resources"].get("GPU", 0) for n in cluster_nodes() if n["NodeID"] == node), 0)
        if gpus < 1:
            if s.launch == "auto":
                return "workers"
            raise EnvironmentProblem("scaling.launch=driver with scaling.use_gpu=true, but the job's node has no GPU; submit the "
                                     "job with `ray job submit --entrypoint-num-gpus 1` (Ray then runs it on a GPU node), or set "
                                     "scaling.launch=workers")
    return "driver"


@functools.cache
def reserved_resources() -> dict[str, float]:
    """What Ray reserved for this process: a task's or actor's resources (a Tune trial), or the
    entrypoint resources of the job it runs (``ray job submit --entrypoint-num-gpus/--entrypoint-num-cpus``),
    which Ray holds in the job's supervisor actor, the process that started this one. Fixed for
    the process's life, so read once (Ray connected)."""
    import ray

    context = ray.get_runtime_context()
    if context.worker.mode == ray.WORKER_MODE:
        return context.get_assigned_resources()
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {}).get("job_submission_id")
    if not job:
        return {}
    from ray.dashboard.modules.job.common import JOB_ACTOR_NAME_TEMPLATE
    from ray.util.state import list_actors
    from ray.util.state.exception import RayStateApiException

    try:
        supervisor = list_actors(filters=[("name", "=", JOB_ACTOR_NAME_TEMPLATE.format(job_id=job))], detail=True,
                                 raise_on_missing_output=False, timeout=10)
    except (RayStateApiException, ConnectionError, TimeoutError) as exc:  # then the job trains in a worker group
        logger.debug("could not read the job's entrypoint resources: %s", exc)
        return {}
    return dict(supervisor[0].required_resources or {}) if supervisor else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAIN_ACTORS = ("TrainController", "PlacementGroupCleaner")
"""Ray Train's actors that outlive ``fit()`` by a moment while they wind down."""


def shutdown_ray(timeout_s: float = 15.0) -> None:
    """Shut down the Ray instance this process started, after Ray Train's own actors have exited.

    ``fit()`` returns while the train controller and its detached placement-group cleaner are
    still winding down; shutting the local cluster down under them made them print GCS time-outs
    and ``GetTimeoutError`` tracebacks after a successful run. A job joined to a cluster
    (``RAY_ADDRESS``) only disconnects, which leaves the cluster's actors alone.
    """
    import ray

    if not ray.is_initialized():
        return
    if not os.environ.get("RAY_ADDRESS"):
        from ray.util.state import list_actors
        from ray.util.state.exception import RayStateApiException

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                alive = list_actors(address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")], timeout=5,
                                    raise_on_missing_output=False)
            except (RayStateApiException, ConnectionError, TimeoutError) as exc:  # best effort: shutting down is what matters
                logger.debug("could not list Ray actors before shutdown: %s", exc)
                break
            if not any(a.class_name in TRAIN_ACTORS for a in alive):
                break
            time.sleep(0.25)
    ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a ``host:port`` (or ``ray://host:port``) that does not accept connections:
    ``ray.init`` would otherwise retry for minutes before giving up."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)/?", address)
    if not match:
        return  # "local", "auto" and URLs of the job API are Ray's to resolve
    host, port = match[1], int(match[2])
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise EnvironmentProblem(
            f"could not reach the Ray cluster at RAY_ADDRESS={address!r} ({exc.strerror or exc}). Start one with "
            "`ray start --head`, fix RAY_ADDRESS (the head's GCS address, host:6379 by default), or unset it to run "
            "on a local Ray instance."
        ) from None
