"""Offline checks of infra/: every cluster launcher file passes Ray's own config validation (prepare,
then validate, as Ray's tests do) and its shell commands do what they claim in a sandbox; the KubeRay
manifests have the structure KubeRay needs; nothing is exposed or holds a credential; and every
dependency pin matches pyproject.toml."""

from __future__ import annotations

import configparser
import copy
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO
from zerolab.config import load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

INFRA = REPO / "infra"
YAML_FILES = sorted(INFRA.rglob("*.yaml"))
TEXT_FILES = sorted(p for p in INFRA.rglob("*") if p.is_file())


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


LAUNCHER_FILES = [p for p in YAML_FILES if any("provider" in d for d in documents(p))]
MANIFEST_FILES = [p for p in YAML_FILES if all("apiVersion" in d for d in documents(p))]
MANIFESTS = [(p, d) for p in MANIFEST_FILES for d in documents(p)]


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(INFRA)) for p in paths]


# --- the project's pins ---------------------------------------------------------------------

def project_requirements() -> dict[str, Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return {canonicalize_name(r.name): r for r in map(Requirement, pyproject["project"]["dependencies"])}


def constraint_pins() -> dict[str, str]:
    """Exact versions from constraints.txt (torch: the version the README installs)."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = str(req.specifier)
    return pins


def expected_specifier(name: str) -> str:
    """What infra must pin ``name`` to: pyproject's own pin, or constraints.txt's where pyproject
    only gives a lower bound that the cluster must not resolve differently from CI."""
    project = project_requirements()[name]
    if any(s.operator == "==" for s in project.specifier):
        return str(project.specifier)
    pinned = constraint_pins().get(name)
    if pinned is not None:
        assert project.specifier.contains(pinned.lstrip("="), prereleases=True), f"constraints.txt {name}{pinned} violates pyproject {project}"
        return pinned
    return str(project.specifier)


def requirement_mentions(text: str) -> list[Requirement]:
    """Every ``name[extras]<op>version`` of a project dependency written in ``text``."""
    names = "|".join(sorted((re.escape(n) for n in project_requirements()), key=len, reverse=True))
    op = r"(?:===|==|~=|!=|<=|>=|<|>)\s*[\w.*+!-]+"
    pattern = re.compile(rf"(?<![\w./:-])({names})(\[[\w,\s-]*\])?\s*({op}(?:\s*,\s*{op})*)", re.IGNORECASE)
    return [Requirement(m.group(0)) for m in pattern.finditer(text)]


def test_every_infra_yaml_is_a_launcher_config_or_a_kubernetes_manifest():
    assert {p.name for p in LAUNCHER_FILES} >= {"aws.yaml", "gcp.yaml", "local.yaml"}
    assert sorted(set(YAML_FILES) - set(LAUNCHER_FILES) - set(MANIFEST_FILES)) == []
    kinds = {d["kind"] for _, d in MANIFESTS}
    assert {"RayCluster", "RayJob"} <= kinds


@pytest.mark.parametrize("path", TEXT_FILES, ids=ids(TEXT_FILES))
def test_dependency_pins_match_pyproject(path):
    project = project_requirements()
    text = path.read_text(encoding="utf-8")
    for req in requirement_mentions(text):
        name = canonicalize_name(req.name)
        assert str(req.specifier) == expected_specifier(name), f"{path.name}: {req} but the project pins {name}{expected_specifier(name)}"
    if "pip install" in text and path.suffix != ".md":
        # A place that installs the cluster's packages installs all of them, with the project's extras.
        installed = {canonicalize_name(r.name): r for r in requirement_mentions(text)}
        assert set(project) <= set(installed), f"{path.name} does not install {sorted(set(project) - set(installed))}"
        for name, req in installed.items():
            assert req.extras >= project[name].extras, f"{path.name}: {req} lacks the extras {sorted(project[name].extras)}"


def test_ray_and_python_versions_of_images_and_manifests_match_the_project():
    ray_version = expected_specifier("ray").lstrip("=")
    requires_python = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    tags = [m for p in TEXT_FILES for m in re.findall(r"rayproject/ray:([\w.-]+)", p.read_text(encoding="utf-8"))]
    assert tags
    for tag in tags:
        m = re.fullmatch(r"(?P<ray>[\d.]+)-py(?P<major>\d)(?P<minor>\d+)(-\w+)?", tag)
        assert m is not None, f"rayproject/ray:{tag} does not name a Ray and a Python version"
        assert m["ray"] == ray_version, f"image rayproject/ray:{tag} is not Ray {ray_version}"
        assert Requirement(f"python{requires_python}").specifier.contains(f"{m['major']}.{m['minor']}"), tag
    for _, doc in MANIFESTS:
        spec = doc.get("spec", {})
        if doc["kind"] == "RayCluster":
            assert spec["rayVersion"] == ray_version


# --- cluster launcher files -----------------------------------------------------------------

def launcher_config(path: Path) -> dict[str, Any]:
    (doc,) = documents(path)
    return doc


def prepared(path: Path) -> dict[str, Any]:
    """The config as `ray up` hands it to the autoscaler (defaults merged, node types filled in),
    validated against Ray's schema and rules: Ray's own `prepare_config` then `validate_config`."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(launcher_config(path)))
    validate_config(config)
    return config


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=ids(LAUNCHER_FILES))
def test_launcher_config_passes_ray_validation(path):
    config = prepared(path)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    if config["provider"]["type"] == "local":
        assert len(config["provider"]["worker_ips"]) >= 1  # a fixed set of hosts; Ray detects their GPUs
        return
    head = types.pop(config["head_node_type"])
    assert "GPU" not in head["resources"] and head["max_workers"] == 0
    assert types and all(t["resources"].get("GPU", 0) == 8 for t in types.values()), "GPU worker types are 8-GPU nodes"
    assert sum(t["min_workers"] for t in types.values()) >= 1, "zerolab's driver needs GPUs present to start a job"
    enabled = [name for name, t in types.items() if t["max_workers"] > 0]
    assert len(enabled) == 1, f"one GPU type at a time (a job must not mix GPU types), got {enabled}"
    spot = [t["node_config"] for name, t in types.items() if "spot" in name]
    assert spot, "a spot node type to switch to"


def test_ray_validation_rejects_what_it_should():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = launcher_config(INFRA / "aws.yaml")
    typo = copy.deepcopy(config)
    typo["available_node_types"]["gpu_8x_h100"]["min_worker"] = typo["available_node_types"]["gpu_8x_h100"].pop("min_workers")
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(typo))
    too_small = copy.deepcopy(config)
    too_small["max_workers"] = 0
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(too_small))


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=ids(LAUNCHER_FILES))
def test_launcher_exposes_nothing_and_requires_the_cluster_token(path):
    config = launcher_config(path)
    text = path.read_text(encoding="utf-8")
    assert "0.0.0.0" not in text, "nothing listens on all interfaces"
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "--ray-client-server-port" not in head_start and "--include-dashboard" not in head_start
    # The token and MLflow's password travel as files from the user's machine, never as text in the config.
    assert config["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token", MLFLOW_PASSWORD_FILE: MLFLOW_PASSWORD_FILE}
    for permission in config["provider"].get("security_group", {}).get("IpPermissions", []):
        assert permission["FromPort"] == permission["ToPort"] == 22, f"only SSH may be opened: {permission}"


MLFLOW_PASSWORD_FILE = "~/.zerolab/mlflow_password"


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=ids(LAUNCHER_FILES))
def test_launcher_asks_docker_for_the_gpus(path):
    """Every node that trains gets its GPUs from an explicit ``--gpus all``, not from Ray's guess of
    ``--runtime=nvidia`` (added only when Docker names that runtime and nvidia-smi works)."""
    docker = launcher_config(path)["docker"]
    if launcher_config(path)["provider"]["type"] == "local":  # every host may train, the head too
        assert "--gpus all" in docker["run_options"]
        assert docker.get("disable_automatic_runtime_detection") is True
    else:  # the head is a CPU node; the GPU worker types get them
        assert "--gpus all" in docker["worker_run_options"] and "--gpus all" not in docker["run_options"]


def _stub(bin_dir: Path, name: str, log: Path) -> None:
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "env = {k: v for k, v in os.environ.items() if k.split('_')[0] in {'RAY', 'MLFLOW', 'ZEROLAB', 'NCCL', 'TORCH', 'DS', 'HF', 'TOKENIZERS', 'PIP'}}\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': [os.path.basename(sys.argv[0]), *sys.argv[1:]], 'env': env}) + '\\n')\n"
    )
    script.chmod(0o755)


TEST_MLFLOW_PASSWORD = "sandbox-mlflow-password"


def run_node_commands(tmp: Path, commands: list[str], extra_env: dict[str, str]) -> list[dict[str, Any]]:
    """Run a node's commands as Ray's updater does (one `bash -c` each, in order) with `ray`,
    `mlflow`, `pip` and `sudo` replaced by stubs that record their arguments and environment.
    Host paths map to temp folders; `ulimit` is a no-op (the container's limit comes from its
    run options)."""
    home, bin_dir, opt = tmp / "home", tmp / "bin", tmp / "opt"
    for d in (home, bin_dir, opt):
        d.mkdir(parents=True)
    password = home / MLFLOW_PASSWORD_FILE.removeprefix("~/")  # what `ray up` copies from the user's machine
    password.parent.mkdir()
    password.write_text(f"{TEST_MLFLOW_PASSWORD}\n")
    host_paths = {"/opt/zerolab": str(opt), "/tmp/zerolab-constraints.txt": str(tmp / "constraints.txt")}
    log = tmp / "calls.jsonl"
    for name in ("ray", "mlflow", "pip", "sudo"):
        _stub(bin_dir, name, log)
    (tmp / "bash_env").write_text("ulimit() { :; }\n")
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home), "BASH_ENV": str(tmp / "bash_env"),
           **extra_env}
    for command in commands:
        for host_path, sandbox_path in host_paths.items():
            command = command.replace(host_path, sandbox_path)
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
    deadline = time.time() + 10  # MLflow is started in the background
    while any("mlflow server" in c for c in commands) and '"mlflow"' not in log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    return [json.loads(line) for line in log.read_text().splitlines()]


def calls_of(calls: list[dict[str, Any]], *argv: str) -> list[dict[str, Any]]:
    return [c for c in calls if c["argv"][: len(argv)] == list(argv)]


def option(argv: list[str], name: str, key: str | None = None) -> str:
    """The value of ``name`` in ``argv`` (``--name VALUE`` or ``--name=VALUE``); with ``key``, the
    value of the ``--set key=VALUE`` among repeated options."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == name else arg.split("=", 1)[1] if arg.startswith(f"{name}=") else None
        if value is None:
            continue
        if key is None:
            return value
        if value.startswith(f"{key}="):
            return value.split("=", 1)[1]
    raise AssertionError(f"{name} {key or ''} not in {argv}")


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=ids(LAUNCHER_FILES))
def test_launcher_commands_start_a_token_protected_cluster_with_mlflow(path, tmp_path):
    import ray.util

    config = prepared(path)
    provider = config["provider"]["type"]
    head = run_node_commands(tmp_path / "head", config["head_setup_commands"] + config["head_start_ray_commands"], {})
    worker = run_node_commands(tmp_path / "worker", config["worker_setup_commands"] + config["worker_start_ray_commands"],
                               {"RAY_HEAD_IP": "10.1.2.3"})
    private_ip = ray.util.get_node_ip_address()

    (head_start,) = calls_of(head, "ray", "start", "--head")
    env = head_start["env"]
    assert env["RAY_AUTH_MODE"] == "token"
    assert "--dashboard-host=127.0.0.1" in head_start["argv"]
    assert env["MLFLOW_TRACKING_URI"] == f"http://{private_ip}:5000", "job drivers log to the head's MLflow"
    storage = env["ZEROLAB_STORAGE"]
    assert storage.startswith({"aws": "s3://", "gcp": "gs://", "local": "/mnt/shared/"}[provider]), storage
    assert env["NCCL_SOCKET_IFNAME"] and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["DS_ACCELERATOR"] == "cuda"

    (server,) = calls_of(head, "mlflow", "server")
    assert option(server["argv"], "--host") == private_ip, "MLflow listens on the private network only"
    assert option(server["argv"], "--artifacts-destination").startswith(storage)
    # ... behind a login: MLflow's basic-auth app, its admin from the password file, its users in a
    # database on the head's host volume.
    assert option(server["argv"], "--app-name") == "basic-auth"
    assert server["env"]["MLFLOW_AUTH_ADMIN_USERNAME"] == "admin"
    assert server["env"]["MLFLOW_AUTH_ADMIN_PASSWORD"] == TEST_MLFLOW_PASSWORD
    # The app refuses to start without a static key for its CSRF tokens: one made on the head, kept.
    key_file = tmp_path / "head" / "opt" / "mlflow" / "flask_secret_key"
    assert server["env"]["MLFLOW_FLASK_SERVER_SECRET_KEY"] == key_file.read_text().strip()
    assert len(key_file.read_text().strip()) >= 32 and key_file.stat().st_mode & 0o077 == 0
    auth_config = configparser.ConfigParser()
    assert auth_config.read(server["env"]["MLFLOW_AUTH_CONFIG_PATH"])
    assert auth_config["mlflow"]["database_uri"] == f"sqlite:///{tmp_path}/head/opt/mlflow/basic_auth.db"
    assert "admin_password" not in auth_config["mlflow"]

    (worker_start,) = calls_of(worker, "ray", "start")
    assert option(worker_start["argv"], "--address") == "10.1.2.3:6379"
    assert worker_start["env"]["RAY_AUTH_MODE"] == "token"
    # Job drivers (head) and rank-0 workers (any node) log in with the credentials MLflow clients read.
    for start in (head_start, worker_start):
        assert start["env"]["MLFLOW_TRACKING_USERNAME"] == "admin"
        assert start["env"]["MLFLOW_TRACKING_PASSWORD"] == TEST_MLFLOW_PASSWORD

    for node in (head, worker):
        (install,) = calls_of(node, "pip", "install")
        pins = {canonicalize_name(r.name): r for r in map(Requirement, (a for a in install["argv"][2:] if not a.startswith("-")))}
        for name in project_requirements():
            assert str(pins[name].specifier) == expected_specifier(name), pins[name]
        constraints = Path(install["env"]["PIP_CONSTRAINT"]).read_text().split()
        assert constraints == [f"torch{expected_specifier('torch')}"]


# --- KubeRay manifests ----------------------------------------------------------------------

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|[KMGTPE]i?)?$"}]}
RESOURCES = {"type": "object", "additionalProperties": False, "required": ["requests", "limits"],
             "properties": {"requests": {"type": "object", "additionalProperties": QUANTITY},
                            "limits": {"type": "object", "additionalProperties": QUANTITY}}}
ENV_VAR = {"type": "object", "required": ["name"], "additionalProperties": False,
           "properties": {"name": {"type": "string"}, "value": {"type": "string"}, "valueFrom": {"type": "object"}}}
CONTAINER = {"type": "object", "required": ["name", "image", "resources"],
             "properties": {"name": {"type": "string"}, "image": {"type": "string"}, "resources": RESOURCES,
                            "env": {"type": "array", "items": ENV_VAR}, "envFrom": {"type": "array"}}}
POD_TEMPLATE = {"type": "object", "required": ["spec"],
                "properties": {"spec": {"type": "object", "required": ["containers"],
                                        "properties": {"containers": {"type": "array", "minItems": 1, "items": CONTAINER},
                                                       "volumes": {"type": "array"}}}}}
K8S_NAME = {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
METADATA = {"type": "object", "required": ["name", "namespace"], "properties": {"name": K8S_NAME, "namespace": K8S_NAME}}
RAY_CLUSTER_SPEC = {
    # The fields of KubeRay's ray.io/v1 RayClusterSpec; an unknown (misspelt) field is an error.
    "type": "object", "additionalProperties": False, "required": ["rayVersion", "headGroupSpec", "workerGroupSpecs"],
    "properties": {
        "rayVersion": {"type": "string"},
        "authOptions": {"type": "object", "additionalProperties": False,
                        "properties": {"mode": {"enum": ["disabled", "token"]}, "secretName": {"type": "string"},
                                       "enableK8sTokenAuth": {"type": "boolean"}}},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "autoscalerOptions": {"type": "object", "additionalProperties": False,
                              "properties": {k: {} for k in ("resources", "image", "imagePullPolicy", "securityContext", "env", "envFrom",
                                                             "volumeMounts", "version")}
                              | {"idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                                 "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]}}},
        "headGroupSpec": {"type": "object", "additionalProperties": False, "required": ["template"],
                          "properties": {"template": POD_TEMPLATE, "rayStartParams": STRING_MAP, "headService": {"type": "object"},
                                         "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                         "enableIngress": {"type": "boolean"}}},
        "workerGroupSpecs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["groupName", "template", "minReplicas", "maxReplicas"],
            "properties": {"groupName": K8S_NAME, "replicas": {"type": "integer", "minimum": 0},
                           "minReplicas": {"type": "integer", "minimum": 0}, "maxReplicas": {"type": "integer", "minimum": 0},
                           "numOfHosts": {"type": "integer", "minimum": 1}, "idleTimeoutSeconds": {"type": "integer"},
                           "rayStartParams": STRING_MAP, "template": POD_TEMPLATE, "scaleStrategy": {"type": "object"},
                           "suspend": {"type": "boolean"}}}},
        **{k: {} for k in ("suspend", "managedBy", "headServiceAnnotations", "gcsFaultToleranceOptions", "upgradeStrategy")},
    },
}
RAY_JOB_SPEC = {
    # The fields of KubeRay's ray.io/v1 RayJobSpec.
    "type": "object", "additionalProperties": False, "required": ["entrypoint"],
    "oneOf": [{"required": ["clusterSelector"]}, {"required": ["rayClusterSpec"]}],
    "properties": {
        "entrypoint": {"type": "string", "minLength": 1}, "clusterSelector": STRING_MAP, "rayClusterSpec": RAY_CLUSTER_SPEC,
        "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
        "submitterPodTemplate": POD_TEMPLATE, "submitterConfig": {"type": "object", "additionalProperties": False,
                                                                  "properties": {"backoffLimit": {"type": "integer"}}},
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "backoffLimit": {"type": "integer", "minimum": 0},
        "shutdownAfterJobFinishes": {"type": "boolean"}, "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "runtimeEnvYAML": {"type": "string"}, "entrypointNumCpus": {"type": "number"}, "entrypointNumGpus": {"type": "number"},
        "entrypointResources": {"type": "string"}, "jobId": {"type": "string"}, "metadata": STRING_MAP,
        "suspend": {"type": "boolean"}, "deletionStrategy": {"type": "object"}, "managedBy": {"type": "string"},
    },
}
SCHEMAS = {("ray.io/v1", "RayCluster"): RAY_CLUSTER_SPEC, ("ray.io/v1", "RayJob"): RAY_JOB_SPEC}
SECRET_NAMES = {"zerolab-ray-auth", "zerolab-mlflow", "zerolab-mlflow-server", "zerolab-hf"}
"""The Secrets the manifests read; infra/README.md creates them from the user's shell."""
SECRET_LIKE = re.compile(r"(^|_)(TOKEN|PASSWORD|SECRET|CREDENTIALS?|ACCESS_KEY|API_KEY)(_|$)")


def manifest(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in MANIFESTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def cluster_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The RayClusterSpecs in ``doc``: a RayCluster's, or the one a RayJob creates for itself."""
    if doc["kind"] == "RayCluster":
        return [doc["spec"]]
    if doc["kind"] == "RayJob" and "rayClusterSpec" in doc["spec"]:
        return [doc["spec"]["rayClusterSpec"]]
    return []


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod template's spec in ``doc``: Ray head and worker groups (a RayCluster's or a RayJob's
    own cluster), a RayJob's submitter, a Deployment's or a Job's pods."""
    spec = doc.get("spec", {})
    pods = [p for cluster in cluster_specs(doc)
            for p in (cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in cluster["workerGroupSpecs"]))]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in spec:
        pods.append(spec["submitterPodTemplate"]["spec"])
    if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        pods.append(spec["template"]["spec"])
    if doc["kind"] == "Pod":
        pods.append(spec)
    return pods


def containers() -> list[dict[str, Any]]:
    return [c for _, d in MANIFESTS for pod in pod_specs(d) for c in pod["containers"]]


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=ids(MANIFEST_FILES))
def test_manifest_structure(path):
    for doc in documents(path):
        jsonschema.validate(doc["metadata"], METADATA)
        assert doc["metadata"]["namespace"] == "zerolab"
        schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema is not None:
            jsonschema.validate(doc["spec"], schema)
        for pod in pod_specs(doc):
            for container in pod["containers"]:
                jsonschema.validate(container, CONTAINER)
                limits, requests = container["resources"]["limits"], container["resources"]["requests"]
                assert set(requests) <= set(limits), f"{container['name']}: every request has a limit"


CLUSTERS = [(doc["kind"], spec) for _, doc in MANIFESTS for spec in cluster_specs(doc)]


@pytest.mark.parametrize(("kind", "spec"), CLUSTERS, ids=[kind for kind, _ in CLUSTERS])
def test_ray_cluster_has_a_cpu_head_and_gpu_workers_with_shared_storage(kind, spec):
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    # The long-lived cluster autoscales; a RayJob's own cluster has the job's fixed size.
    assert spec["enableInTreeAutoscaling"] is (kind == "RayCluster")
    claims = {d["metadata"]["name"]: d for _, d in MANIFESTS if d["kind"] == "PersistentVolumeClaim"}
    for group in spec["workerGroupSpecs"]:
        assert 1 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        pod = group["template"]["spec"]
        (worker,) = pod["containers"]
        gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) > 0 and worker["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert worker["resources"]["requests"] == worker["resources"]["limits"], "GPU pods are never evicted for memory"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod.get("tolerations", []))
        mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[mounts["/dev/shm"]]
        assert shm["emptyDir"]["medium"] == "Memory", "NCCL needs a real /dev/shm"
    for pod in (spec["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in spec["workerGroupSpecs"])):
        (container,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        claim = volumes[mounts["/mnt/zerolab"]]["persistentVolumeClaim"]["claimName"]
        assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"], "every Ray pod writes checkpoints to one volume"


def test_ray_job_runs_sft_on_its_own_cluster_that_goes_when_the_job_ends():
    job = manifest("RayJob")
    spec = job["spec"]
    assert len(job["metadata"]["name"]) <= 47, "KubeRay derives longer names from a RayJob's name"
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "/home/ray/zerolab/jobs/sft.py"]
    cfg = load_job_command(argv)
    assert cfg.run.storage_path.startswith("/mnt/zerolab/"), "checkpoints go to the shared volume"
    assert cfg.train.checkpoint_every_n_steps and cfg.run.max_failures > 0, "a lost pod costs minutes, not the run"
    # KubeRay deletes only a cluster the RayJob created: with clusterSelector, a deadline or the
    # job's end marks the RayJob finished and training (and its GPU bill) goes on.
    assert "clusterSelector" not in spec and "rayClusterSpec" in spec, "the RayJob owns its cluster"
    assert spec["shutdownAfterJobFinishes"] is True
    assert 0 <= spec["ttlSecondsAfterFinished"] <= 600, "idle GPUs are released within minutes of the job's end"
    # zerolab's deadline checkpoints and stops; KubeRay's is the backstop, later by start-up and a save.
    wall = float(option(argv, "--set", "run.max_wall_time_s"))
    assert 0 < wall and spec["activeDeadlineSeconds"] - wall >= 1800, (wall, spec["activeDeadlineSeconds"])
    gpus = sum(int(g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)) * g["replicas"]
               for g in spec["rayClusterSpec"]["workerGroupSpecs"])
    assert cfg.scaling.use_gpu and gpus >= cfg.scaling.num_workers, f"{gpus} GPUs for {cfg.scaling.num_workers} workers"


def test_kubernetes_access_is_private_and_token_protected():
    assert len(CLUSTERS) >= 2, "the long-lived RayCluster and the RayJob's own cluster"
    for _, spec in CLUSTERS:
        assert spec["authOptions"] == {"mode": "token", "secretName": "zerolab-ray-auth"}
        assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
        assert not spec["headGroupSpec"].get("enableIngress", False)
    for _, doc in MANIFESTS:
        assert doc["kind"] not in {"Ingress", "Route"}
        if doc["kind"] == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP"
    (submitter,) = manifest("RayJob")["spec"]["submitterPodTemplate"]["spec"]["containers"]
    env = {e["name"]: e for e in submitter["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "zerolab-ray-auth", "key": "auth_token"}
    policy = manifest("NetworkPolicy")
    assert policy["spec"]["podSelector"] == {} and policy["spec"]["policyTypes"] == ["Ingress"]


RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
"""The volume types the restricted Pod Security Standard allows (no hostPath)."""


def restricted_violations(pod: dict[str, Any], extra_containers: tuple[dict[str, Any], ...] = ()) -> list[str]:
    """What keeps ``pod`` (a pod spec) from the restricted Pod Security Standard, one line each:
    host namespaces, volume types, and for every container and init container (and
    ``extra_containers``, such as KubeRay's autoscaler sidecar) privilege, privilege escalation,
    capabilities, non-root user and seccomp profile, where the container's securityContext overrides
    the pod's."""
    problems = [f"pod: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    problems += [f"volume {v['name']}: type {sorted(set(v) - {'name'})} is not allowed" for v in pod.get("volumes", [])
                 if not set(v) - {"name"} <= RESTRICTED_VOLUME_TYPES]
    pod_sc = pod.get("securityContext", {})
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod: runAsUser 0")
    for c in (*pod.get("initContainers", []), *pod["containers"], *extra_containers):
        sc, name = c.get("securityContext") or {}, c.get("name", "?")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{name}: capabilities.drop lacks ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities.add {caps['add']}")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in {"RuntimeDefault", "Localhost"}:
            problems.append(f"{name}: seccompProfile.type is {seccomp} (pod or container), not RuntimeDefault")
        if any(port.get("hostPort") for port in c.get("ports", [])):
            problems.append(f"{name}: hostPort")
    return problems


def pods_with_sidecars(doc: dict[str, Any]) -> list[tuple[dict[str, Any], tuple[dict[str, Any], ...]]]:
    """Every pod spec of ``doc`` with the containers KubeRay adds to it: the autoscaler runs in the
    head pod with ``autoscalerOptions.securityContext``."""
    heads = {id(c["headGroupSpec"]["template"]["spec"]): c for c in cluster_specs(doc)}
    out = []
    for pod in pod_specs(doc):
        cluster = heads.get(id(pod))
        sidecars = ()
        if cluster is not None and cluster.get("enableInTreeAutoscaling"):
            sidecars = ({"name": "autoscaler", "securityContext": cluster.get("autoscalerOptions", {}).get("securityContext")},)
        out.append((pod, sidecars))
    return out


@pytest.mark.parametrize("path", MANIFEST_FILES, ids=ids(MANIFEST_FILES))
def test_every_pod_passes_the_restricted_pod_security_standard(path):
    pods = [(doc["kind"], pod, sidecars) for doc in documents(path) for pod, sidecars in pods_with_sidecars(doc)]
    for kind, pod, sidecars in pods:
        problems = restricted_violations(pod, sidecars)
        assert not problems, f"{path.name} {kind}: {problems}"


def test_every_pod_template_is_checked_for_pod_security():
    kinds = [doc["kind"] for _, doc in MANIFESTS for _ in pod_specs(doc)]
    # The long-lived cluster (head, GPU group), the RayJob (its head, its GPU group, its submitter), MLflow.
    assert sorted(kinds) == sorted(["RayCluster"] * 2 + ["RayJob"] * 3 + ["Deployment"]), kinds
    sidecars = [s for _, doc in MANIFESTS for _, ss in pods_with_sidecars(doc) for s in ss]
    assert [s["name"] for s in sidecars] == ["autoscaler"]


@pytest.mark.parametrize("breach", ["runAsNonRoot", "seccompProfile", "allowPrivilegeEscalation", "capabilities", "privileged",
                                    "hostNetwork", "hostPath", "initContainer", "autoscaler"])
def test_pod_security_check_finds_each_missing_or_wrong_field(breach):
    doc = copy.deepcopy(manifest("RayCluster"))
    (pod, sidecars), *_ = pods_with_sidecars(doc)
    assert restricted_violations(pod, sidecars) == []
    container = pod["containers"][0]
    if breach in ("runAsNonRoot", "seccompProfile"):
        del pod["securityContext"][breach]
    elif breach in ("allowPrivilegeEscalation", "capabilities"):
        container["securityContext"] = {k: v for k, v in container["securityContext"].items() if k != breach}
    elif breach == "privileged":
        container["securityContext"] = {**container["securityContext"], "privileged": True}
    elif breach == "hostNetwork":
        pod["hostNetwork"] = True
    elif breach == "hostPath":
        pod["volumes"].append({"name": "host", "hostPath": {"path": "/var/run"}})
    elif breach == "initContainer":
        pod["initContainers"] = [{"name": "init", "image": container["image"]}]
    elif breach == "autoscaler":
        del doc["spec"]["autoscalerOptions"]["securityContext"]
        (pod, sidecars), *_ = pods_with_sidecars(doc)
    assert restricted_violations(pod, sidecars), f"{breach} went unnoticed"


def test_credentials_come_from_secrets_and_are_never_inlined():
    assert not [d for _, d in MANIFESTS if d["kind"] == "Secret"], "Secrets are created from the environment, not from files"
    referenced = set()
    for container in containers():
        for var in container.get("env", []):
            source = var.get("valueFrom", {}).get("secretKeyRef")
            if source:
                referenced.add(source["name"])
            elif SECRET_LIKE.search(var["name"]):
                raise AssertionError(f"{container['name']}: {var['name']} is inlined; read it from a Secret")
        referenced |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    assert referenced == SECRET_NAMES
    mlflow_env = [e for c in containers() if c["name"] in {"ray-head", "ray-worker"} for e in c["envFrom"]]
    assert {"secretRef": {"name": "zerolab-mlflow"}} in mlflow_env, "the MLflow URI and credentials come from a Secret"
    (server,) = manifest("Deployment", "zerolab-mlflow")["spec"]["template"]["spec"]["containers"]
    assert "--app-name=basic-auth" in server["args"], "MLflow asks for a login"
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for e in server["env"]}
    # MLflow's basic-auth app refuses to start without a static key for its CSRF tokens.
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == "zerolab-mlflow-server"
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"] == "zerolab-mlflow"
    readme = (INFRA / "README.md").read_text(encoding="utf-8")
    for name in SECRET_NAMES:
        assert f"kubectl -n zerolab create secret generic {name}" in readme, f"README does not create {name}"


def test_one_image_for_every_pod():
    images = {c["image"] for c in containers()}
    assert len(images) == 1, images
    dockerfile = (INFRA / "docker" / "Dockerfile").read_text()
    (image,) = images
    assert f"-t {image}" in dockerfile.splitlines()[0], "the Dockerfile's build command names the image the manifests run"


# --- credentials and documented commands ----------------------------------------------------

CREDENTIAL_PATTERNS = {
    "AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
    "AWS secret key": r"(?i)aws_secret_access_key\s*[=:]",
    "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    "service-account key": r"\"private_key(_id)?\"\s*:",
    "Hugging Face token": r"\bhf_[A-Za-z0-9]{30,}\b",
    "GitHub token": r"\bgh[pousr]_[A-Za-z0-9]{30,}\b",
    "inline password or token": r"(?i)(password|passwd|secret|token)['\"]?[ \t]*[:=][ \t]*['\"]?[A-Za-z0-9+/_-]{12,}",
}


@pytest.mark.parametrize("path", TEXT_FILES, ids=ids(TEXT_FILES))
def test_no_credentials_in_infra(path):
    text = path.read_text(encoding="utf-8")
    for what, pattern in CREDENTIAL_PATTERNS.items():
        match = re.search(pattern, text)
        assert match is None, f"{path.name}: {what}: {match.group(0) if match else ''}"


def documented_commands(text: str, script: str) -> list[list[str]]:
    """The argv of every `python <script> ...` in ``text``'s shell blocks (continuations joined)."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0]
            if f"python {script}" in line:
                argv = shlex.split(line[line.index(f"python {script}"):])
                commands.append(argv)
    return commands


DOCUMENTED_VARIABLES = {"BUCKET": "my-zerolab-bucket", "PROJECT": "my-gcp-project"}
"""Shell variables the README's commands may use (it sets them first)."""


def load_job_command(argv: list[str]) -> Any:
    """Load a documented job command's config exactly as the job would, with the README's shell
    variables filled in and the image's checkout mapped to this one."""
    argv = [re.sub(r"\$\{?(\w+)\}?", lambda m: DOCUMENTED_VARIABLES[m.group(1)], a) for a in argv]
    argv = [a.replace("/home/ray/zerolab/", f"{REPO}/") for a in argv]
    config = option(argv, "--config")
    assert Path(config).is_file(), f"{config} does not exist"
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return load_config(config, sets)


def test_documented_sft_commands_load():
    readme = (INFRA / "README.md").read_text(encoding="utf-8")
    commands = documented_commands(readme, "jobs/sft.py")
    assert len(commands) >= 4, "each target shows a job submission"
    for argv in commands:
        load_job_command(argv)


def test_documented_sweeps_use_existing_job_configs_and_sweep_files():
    from zerolab.sweep import load_sweep

    readme = (INFRA / "README.md").read_text(encoding="utf-8")
    commands = documented_commands(readme, "jobs/tune.py")
    assert len(commands) >= 4, "each target shows a sweep"
    for argv in commands:
        cfg = load_job_command(argv)
        space = option(argv, "--space").replace("/home/ray/zerolab/", f"{REPO}/")
        load_sweep(space if Path(space).is_absolute() else REPO / space, set(cfg.flat()))
