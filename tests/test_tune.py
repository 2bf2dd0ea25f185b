"""Ray Tune sweeps: the sweep file and its checks (fast tier), then real sweeps of tiny SFT jobs on
CPU with real Tune, DeepSpeed and MLflow: a stage × r × batch grid, a failing and an infeasible
trial, ASHA stopping poor trials, and a killed sweep resumed without repeating finished trials."""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, tiny_overrides
from zerolab import tune
from zerolab.config import ConfigError, SFTConfig, load_config
from zerolab.sweep import SweepError, base_config, parse_sweep, trial_config, validate_space

KEYS = set(SFTConfig().flat())


def test_sweep_file_problems_are_listed_together():
    raw = {"nme": "x", "search": "bayes", "space": {"adapter.rank": {"grid": [8]}, "train.lr": {"loguniform": [0, 1e-3]},
                                                   "deepspeed.zero": {"grid": ["4"]}, "adapter.r": [8, 16]}}
    with pytest.raises(SweepError) as err:
        parse_sweep(raw, KEYS)
    text = str(err.value)
    assert "nme: unknown sweep key" in text
    assert "search: 'bayes' is not one of grid, random, optuna" in text
    assert "space.adapter.rank: not a job config key; did you mean" in text
    assert "space.train.lr.loguniform: needs [low, high] with low < high and low > 0" in text
    assert "space.deepspeed.zero: ['4'] are not options" in text
    assert "space.adapter.r: write one of {grid: [...]}" in text
    assert len(err.value.problems) == 6


def test_optuna_takes_sampled_dimensions_and_builds_its_searcher():
    with pytest.raises(SweepError, match="optuna samples its own points"):
        parse_sweep({"search": "optuna", "space": {"adapter.r": {"grid": [8, 16]}}}, KEYS)
    sweep = parse_sweep({"search": "optuna", "metric": "eval/loss", "num_samples": 3,
                              "space": {"adapter.r": {"choice": [8, 16]}, "train.lr": {"loguniform": [1e-4, 1e-3]}}}, KEYS)
    from ray.tune.search.optuna import OptunaSearch

    assert isinstance(tune._searcher(sweep), OptunaSearch)
    assert len(sweep.samples(5)) == 5 and all(1e-4 <= s["train.lr"] <= 1e-3 for s in sweep.samples(5))


def test_trial_actors_are_reused_unless_asha_may_stop_a_trial_that_drives_workers():
    """A worker-group trial's actor keeps its imports for the next trial; where ASHA can stop such a
    trial while it drives its workers, Tune could not reset the actor and the sweep stalled."""
    group, one = load_config(None, []), load_config(None, ["scaling.num_workers=1"])
    grid = parse_sweep({"space": {"adapter.r": {"grid": [4, 16]}}}, KEYS)
    asha = parse_sweep({"scheduler": "asha", "space": {"adapter.r": {"grid": [4, 16]}}}, KEYS)
    assert group.scaling.num_workers == 2 and not tune.trains_in_trial(group, grid)
    assert tune.reuses_actors(group, grid) and not tune.reuses_actors(group, asha)
    assert tune.reuses_actors(one, grid) and tune.reuses_actors(one, asha)


def test_trial_config_maps_zero_options_and_keeps_the_global_batch():
    sweep = parse_sweep({"name": "s", "batch": "keep_global", "set": {"train.grad_accum_steps": 2},
                              "space": {"deepspeed.zero": {"grid": ["3+all"]}, "train.micro_batch_size": {"grid": [4, 32]}}}, KEYS)
    base = base_config(SFTConfig.from_dict({"train": {"micro_batch_size": 16}, "run": {"storage_path": "/tmp/x"}}), sweep)
    cfg = trial_config(base, sweep, {"deepspeed.zero": "3+all", "train.micro_batch_size": 4}, "s-t1")
    assert (cfg.deepspeed.stage, cfg.deepspeed.offload_optimizer, cfg.deepspeed.offload_param) == (3, True, True)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum_steps) == (4, 8)  # 16 × 2 = 4 × 8
    assert cfg.run.name == "s-t1" and cfg.run.storage_path == "/tmp/x/s/trial_runs"
    with pytest.raises(ConfigError, match="keep_global needs it to divide"):
        trial_config(base, sweep, {"deepspeed.zero": "3+all", "train.micro_batch_size": 24}, "s-t2")


def test_a_trials_config_is_the_single_jobs_config_for_the_same_overrides(tmp_path):
    base = {"train": {"micro_batch_size": 8, "lr": 2e-4}, "run": {"storage_path": str(tmp_path)}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = parse_sweep({"name": "s", "set": {"train.max_steps": 7},
                              "space": {"deepspeed.zero": {"grid": ["2+optimizer"]}, "adapter.r": {"grid": [32]}}}, KEYS)
    trial = trial_config(base_config(SFTConfig.from_dict(base), sweep), sweep, {"deepspeed.zero": "2+optimizer", "adapter.r": 32}, "s-t1")
    single = load_config(tmp_path / "base.yaml", ["train.max_steps=7", "deepspeed.stage=2", "deepspeed.offload_optimizer=true",
                                                  "adapter.r=32", "run.name=s-t1", f"run.storage_path={tmp_path}/s/trial_runs"])
    assert trial == single


def test_a_space_with_impossible_combinations_fails_before_any_trial():
    sweep = parse_sweep({"space": {"deepspeed.stage": {"grid": [0, 2]}, "deepspeed.offload_optimizer": {"grid": [True]}}}, KEYS)
    with pytest.raises(SweepError) as err:
        validate_space(base_config(SFTConfig(), sweep), sweep)
    assert len(err.value.problems) == 1
    assert "trial {deepspeed.stage=0, deepspeed.offload_optimizer=True}: deepspeed.offload_optimizer: ZeRO stage 0" in str(err.value)


def test_trials_on_the_sweeps_data_take_it_without_reading_a_file(tmp_path, tiny_model_path):
    """The sweep prepares its base job's data once; a trial on the same data takes it as it is (its
    file may exist only on the sweep's node), a trial whose params change the tokens does not."""
    from zerolab.data import DataError
    from zerolab.plan import prepare_data

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"add {k} and {k}", "output": str(2 * k)}) + "\n" for k in range(40)))
    sweep = parse_sweep({"name": "s", "space": {"adapter.r": {"grid": [4, 8]}}}, KEYS)
    base = base_config(load_config(None, tiny_overrides(tmp_path, **{"data.train_path": path, "data.num_eval_rows": 0})), sweep)
    data = tune.SweepData.prepare(base)
    path.unlink()

    trial = trial_config(base, sweep, {"adapter.r": 8, "data.packing": True}, "s-t1")
    splits = prepare_data(trial, tiny_model_path, data.for_trial(trial))
    assert splits["train"].report.source == "sweep" and "prepared once for the sweep" in splits["train"].report.summary()
    assert splits["train"].report.fingerprint == data.splits["train"].report.fingerprint and splits["train"].num_rows == 40
    assert data.splits["train"].report.source in ("driver", "cache")  # the sweep's own copy is left as it was
    other = trial_config(base, sweep, {"adapter.r": 8, "data.max_seq_length": 64}, "s-t2")
    assert data.for_trial(other) is None
    with pytest.raises(DataError, match="no such file"):
        prepare_data(other, tiny_model_path, data.for_trial(other))


def test_config_errors_survive_ray_pickling():
    err = pickle.loads(pickle.dumps(ConfigError(["a.b: wrong", "c.d: also wrong"])))
    assert err.problems == ["a.b: wrong", "c.d: also wrong"]


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def base_job(tmp_path, **extra):
    """A 1-worker tiny job, so two trials share the 2-CPU machine."""
    values = {"scaling.num_workers": 1, "data.num_train_rows": 48, "data.num_eval_rows": 0, "train.micro_batch_size": 4,
              "train.max_steps": 2, "train.log_every_n_steps": 1, **extra}
    return load_config(None, [o for o in tiny_overrides(tmp_path, **values) if not o.startswith("run.name=")])


def child_runs(uri, parent_name):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tests")
    (parent,) = client.search_runs([exp.experiment_id], f"attributes.run_name = '{parent_name}'")
    return parent, client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")


@pytest.mark.ray
@pytest.mark.slow
def test_grid_over_stage_rank_and_batch_gives_one_child_run_per_trial(tmp_path, tiny_model_path):
    base = base_job(tmp_path)
    sweep = parse_sweep({"name": "grid", "metric": "perf/tokens_per_s", "mode": "max",
                              "space": {"deepspeed.zero": {"grid": ["0", "2"]}, "adapter.r": {"grid": [4, 8]},
                                        "train.micro_batch_size": {"grid": [2, 4]}}}, KEYS)
    rows = tune.run_sweep(base, sweep, out_dir=tmp_path / "out")

    assert [r.status for r in rows] == ["FINISHED"] * 8
    assert [r.objective for r in rows] == sorted((r.objective for r in rows), reverse=True)  # ranked by tokens/s
    uri = base.tracking.uri
    parent, children = child_runs(uri, "grid")
    assert parent.info.status == "FINISHED" and len(children) == 8
    assert sorted((c.data.params["deepspeed.stage"], c.data.params["adapter.r"], c.data.params["train.micro_batch_size"])
                  for c in children) == sorted((s, r, b) for s in "02" for r in ("4", "8") for b in ("2", "4"))
    assert all(c.info.status == "FINISHED" and "train/loss" in c.data.metrics for c in children)
    # One worker each: every trial trained in its own Tune actor (reused from trial to trial), no worker group.
    assert {c.data.params["derived.launch"] for c in children} == {"driver"}
    from mlflow import MlflowClient

    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(parent.info.run_id)}
    assert {"search_space.yaml", "best_config.yaml", "results"} <= artifacts
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.startswith("| rank | run | deepspeed.zero | adapter.r | train.micro_batch_size | perf/tokens_per_s |")
    assert "| ZeRO-2, r=8, micro-batch=4 |" in table and "| ZeRO-0, r=4, micro-batch=2 |" in table  # labels, not trial ids
    assert (tmp_path / "out" / "runs.png").stat().st_size > 10_000


@pytest.mark.ray
def test_failing_and_infeasible_trials_are_reported_and_the_sweep_goes_on(tmp_path, tiny_model_path):
    import shutil

    huge = tmp_path / "huge-qwen2"  # the tiny tokenizer with a 70B-shape config: no weights are ever read
    shutil.copytree(tiny_model_path, huge, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    config = json.loads((huge / "config.json").read_text())
    config.pop("layer_types", None)  # one per layer: rebuilt for 80
    config.update(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    (huge / "config.json").write_text(json.dumps(config))
    base = base_job(tmp_path)
    sweep = parse_sweep({"name": "mixed", "space": {
        "model.name_or_path": {"grid": ["builtin:tiny-qwen2", str(huge), str(tmp_path / "no-such-model")]}}}, KEYS)
    rows = tune.run_sweep(base, sweep, out_dir=tmp_path / "out")

    by = {r.params["model.name_or_path"]: r for r in rows}
    assert by["builtin:tiny-qwen2"].status == "FINISHED"
    assert by[str(huge)].status == "SKIPPED" and "memory preflight" in by[str(huge)].note
    assert by[str(tmp_path / "no-such-model")].status == "ERROR" and "no-such-model" in by[str(tmp_path / "no-such-model")].note
    _, children = child_runs(base.tracking.uri, "mixed")
    skipped = [c for c in children if "zerolab.skipped" in c.data.tags]
    assert len(skipped) == 1 and skipped[0].info.status == "KILLED"
    (finished,) = [c for c in children if c.info.status == "FINISHED"]
    assert finished.data.params["data.train.source"] == "sweep"  # the base job's data, prepared once by the sweep
    assert "SKIPPED: memory preflight" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.ray
@pytest.mark.slow
def test_asha_stops_poor_trials_early(tmp_path, tiny_model_path):
    base = base_job(tmp_path, **{"train.max_steps": 8, "train.lr": 3e-3})
    sweep = parse_sweep({"name": "asha", "metric": "train/loss", "mode": "min", "scheduler": "asha", "grace_period": 2,
                              "max_concurrent_trials": 1,
                              "space": {"train.lr": {"grid": [3e-3, 1e-7, 1e-7]}}}, KEYS)
    rows = tune.run_sweep(base, sweep, out_dir=tmp_path / "out")

    statuses = {r.params["train.lr"]: [] for r in rows}
    for r in rows:
        statuses[r.params["train.lr"]].append((r.status, r.metrics.get("step")))
    assert statuses[3e-3] == [("FINISHED", 8)]
    assert all(status == "STOPPED" and step < 8 for status, step in statuses[1e-7])
    uri = base.tracking.uri
    _, children = child_runs(uri, "asha")
    assert sorted(c.info.status for c in children) == ["FINISHED", "KILLED", "KILLED"]
    from mlflow import MlflowClient

    (finished,) = [c for c in children if c.info.status == "FINISHED"]
    assert "adapter" in {a.path for a in MlflowClient(uri).list_artifacts(finished.info.run_id)}


@pytest.mark.ray
@pytest.mark.slow
def test_killed_sweep_resumes_without_repeating_finished_trials(tmp_path, tiny_model_path):
    config = write(tmp_path, "base.yaml", base_job(tmp_path, **{"train.max_steps": 4}).to_dict())
    space = write(tmp_path, "space.yaml", {"name": "resumable", "max_concurrent_trials": 1,
                                           "space": {"adapter.r": {"grid": [2, 4, 8]}}})
    cmd = [sys.executable, str(REPO / "jobs" / "tune.py"), "--config", str(config), "--space", str(space), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    done = []
    for line in proc.stdout:
        if "] done" in line:
            done.append(line.split("]")[0].lstrip("["))
            os.kill(proc.pid, signal.SIGKILL)  # the driver dies with one trial finished
            break
    proc.wait(timeout=60)
    time.sleep(5)  # let the orphaned local Ray notice its driver is gone
    assert done, "no trial finished before the sweep was killed"

    resumed = subprocess.run([sys.executable, str(REPO / "jobs" / "tune.py"), "--config", str(config), "--resume", "resumable",
                              "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[{done[0]}] step" not in resumed.stderr  # the finished trial did not run again (progress is logged)
    assert "] step" in resumed.stderr  # ... while the others did
    assert "3 trials: 3 finished" in resumed.stdout, resumed.stdout[-3000:]
    uri = yaml.safe_load(config.read_text())["tracking"]["uri"]
    parent, children = child_runs(uri, "resumable")
    assert parent.info.status == "FINISHED"
    assert sorted(c.info.run_name for c in children) == sorted(set(c.info.run_name for c in children))  # no duplicates
    assert len(children) == 3 and all(c.info.status == "FINISHED" for c in children)


def test_the_space_is_checked_on_draws_from_tunes_own_domains():
    """Validation draws from the Tune domains the search uses (randint's exclusive upper bound,
    loguniform's range), and every categorical value is checked even where few points are drawn."""
    sweep = parse_sweep({"search": "random", "num_samples": 4,
                              "space": {"train.micro_batch_size": {"randint": [1, 3]}, "train.lr": {"loguniform": [1e-5, 1e-3]},
                                        "deepspeed.zero": {"choice": ["0", "2", "3", "3+all"]}}}, KEYS)
    points = sweep.samples(2)
    assert {p["train.micro_batch_size"] for p in sweep.samples(64)} == {1, 2}
    assert all(1e-5 <= p["train.lr"] <= 1e-3 for p in points)
    assert {p["deepspeed.zero"] for p in points} == {"0", "2", "3", "3+all"}
    assert all(type(p["train.micro_batch_size"]) is int and type(p["train.lr"]) is float for p in points)


STEPS = 120
"""Steps of each trial of the interrupted sweep."""


@pytest.fixture(scope="module")
def interrupted_sweep(tmp_path_factory, tiny_model_path):
    """``python jobs/tune.py`` on a 2-trial ZeRO stage × adapter.r grid, sent SIGINT once both trials
    have reported, then the resume command it printed, run to the end; the TensorBoard test reads
    the sweep's folder."""
    tmp = tmp_path_factory.mktemp("interrupted")
    # Long enough that neither trial finishes before the other reports: on a loaded 2-core machine the
    # second trial has reported its step 5 after the first had run all of 30 steps (3.6 s of training).
    config = write(tmp, "base.yaml", base_job(tmp, **{"train.max_steps": STEPS, "train.log_every_n_steps": 5,
                                                     "train.checkpoint_every_n_steps": 5}).to_dict())
    space = write(tmp, "space.yaml", {"name": "ctrl-c", "space": {"deepspeed.zero": {"grid": ["0", "2"]}, "adapter.r": {"grid": [4]}}})
    cmd = [sys.executable, str(REPO / "jobs" / "tune.py"), "--config", str(config), "--space", str(space), "--out", str(tmp / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp)
    lines, reporting = [], set()
    for line in proc.stdout:
        lines.append(line)
        if found := re.search(r"\[(\w+)\] step \d+", line):
            reporting.add(found[1])
        if len(reporting) == 2:
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=180)
    uri = yaml.safe_load(config.read_text())["tracking"]["uri"]
    _, children = child_runs(uri, "ctrl-c")
    interrupted = SimpleNamespace(returncode=proc.returncode, output="".join(lines) + rest, children=children)
    hint = re.search(r"^resume: (.+)$", interrupted.output, re.MULTILINE)
    resumed = None
    if hint:
        argv = shlex.split(hint[1])
        resumed = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300, cwd=tmp)
    return SimpleNamespace(interrupted=interrupted, resume=hint and hint[1], resumed=resumed, uri=uri,
                           folder=Path(yaml.safe_load(config.read_text())["run"]["storage_path"]) / "ctrl-c")


@pytest.mark.ray
def test_ctrl_c_stops_the_sweep_with_130_and_the_printed_command_finishes_it(interrupted_sweep):
    first = interrupted_sweep.interrupted
    assert first.returncode == 130, first.output[-3000:]
    assert interrupted_sweep.resume and interrupted_sweep.resume.endswith("--resume ctrl-c"), first.output[-3000:]
    assert "jobs/tune.py --config " in interrupted_sweep.resume and "--space" not in interrupted_sweep.resume
    assert "2 trials: 2 interrupted" in first.output, first.output[-3000:]
    assert "INTERRUPTED: at step " in first.output and "stopped early" not in first.output
    assert "Traceback" not in first.output
    # Where to look while it runs: the sweep's lasting folder for TensorBoard, the dashboard of the Ray it started.
    assert f"tensorboard --logdir {interrupted_sweep.folder}" in first.output
    assert re.search(r"Ray dashboard \(of the Ray instance this job started; it stops with the job\): http://127\.0\.0\.1:\d+", first.output)
    # As a stopped job's run: KILLED, set once by the sweep (the trial Tune stops leaves its run open,
    # however late its thread unwinds).
    assert len(first.children) == 2 and {c.info.status for c in first.children} == {"KILLED"}

    resumed = interrupted_sweep.resumed
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "2 trials: 2 finished" in resumed.stdout, resumed.stdout[-3000:]
    assert f"tensorboard --logdir {interrupted_sweep.folder}" in resumed.stdout
    parent, children = child_runs(interrupted_sweep.uri, "ctrl-c")
    assert parent.info.status == "FINISHED"
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)  # the same runs, not new ones
    assert {c.info.run_id for c in children} == {c.info.run_id for c in first.children}


@pytest.mark.ray
def test_the_sweep_folder_holds_each_trials_scalars_and_hparams_for_tensorboard(interrupted_sweep):
    """The folder the sweep names (``tensorboard --logdir``, in ``run.storage_path``, not Ray's
    temporary session folder) read by TensorBoard's own loader: one run per trial, its curves
    (across the interruption) and the HParams plugin's swept keys and values."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata
    from tensorboard.util import tensor_util

    _, children = child_runs(interrupted_sweep.uri, "ctrl-c")
    trials = {c.info.run_name.removeprefix("ctrl-c-"): c for c in children}
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(interrupted_sweep.folder))
    mux.Reload()
    assert set(mux.Runs()) == set(trials) and len(trials) == 2

    hparams = mux.PluginRunToTagToContent(metadata.PLUGIN_NAME)
    for trial_id, child in trials.items():
        experiment = metadata.parse_experiment_plugin_data(hparams[trial_id][metadata.EXPERIMENT_TAG])
        assert {h.name for h in experiment.hparam_infos} == {"deepspeed.zero", "adapter.r"}
        assert {m.name.tag for m in experiment.metric_infos} >= {"ray/tune/train/loss", "ray/tune/perf/tokens_per_s"}
        session = metadata.parse_session_start_info_plugin_data(hparams[trial_id][metadata.SESSION_START_INFO_TAG])
        assert session.hparams["deepspeed.zero"].string_value == child.data.params["deepspeed.stage"]
        assert session.hparams["adapter.r"].number_value == 4
        loss = mux.Tensors(trial_id, "ray/tune/train/loss")
        steps = [tensor_util.make_ndarray(e.tensor_proto).item() for e in mux.Tensors(trial_id, "ray/tune/step")]
        # A resumed trial writes a new event file whose report count starts again: TensorBoard purges
        # the earlier events it overlaps (how many depends on when the sweep was stopped), so only the
        # curve's end is fixed.
        assert steps[-1] == STEPS and loss
        assert tensor_util.make_ndarray(loss[-1].tensor_proto).item() == pytest.approx(child.data.metrics["train/loss"])


def test_the_first_sigint_or_sigterm_asks_tune_to_stop_and_a_second_aborts():
    """``SweepStop`` around ``Tuner.fit()``: a signal before Tune's loop is ready aborts; once fit()
    has set its stop handler (on SIGUSR1), the first SIGINT or SIGTERM asks it to stop and is
    recorded, the next raises KeyboardInterrupt; everything is as before afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    stop = tune.SweepStop()
    asked = []
    with stop.handling():
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"  # Tune's own SIGINT handler stays out
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        signal.signal(signal.SIGUSR1, lambda signum, frame: asked.append(signum))  # as fit() does
        signal.raise_signal(signal.SIGTERM)
        assert stop.signal_name == "SIGTERM" and asked == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before and "TUNE_DISABLE_SIGINT_HANDLER" not in os.environ
    assert tune.SweepStop().unfinished("/no/such/sweep") == set()  # no signal: nothing cut short
