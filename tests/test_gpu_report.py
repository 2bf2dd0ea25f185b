"""bench/gpu_report.py, which records the GPU tier's last run: fed the JUnit XML of a real pytest run."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

from conftest import REPO

SAMPLE = '''
import pytest

@pytest.fixture(scope="session", autouse=True)
def env(record_testsuite_property):
    record_testsuite_property("device", "NVIDIA H200")
    record_testsuite_property("gpus", 2)
    record_testsuite_property("extra", "x|y")

@pytest.mark.parametrize("case", ["1gpu-lora-zero0", "2gpu-full-zero3"])
def test_matrix(case):
    assert case.startswith("1gpu"), "logits differ | by 3e-1"

def test_skipped():
    pytest.skip("needs 2 GPUs, 1 found")
'''


def load_report_module():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "bench" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_pytest_junit_report_becomes_the_page(tmp_path):
    gpu_report = load_report_module()
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    xml = tmp_path / "run.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py"),
                           f"--junitxml={xml}", "--rootdir", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]  # one test fails on purpose

    report = gpu_report.read_junit(xml)
    assert report.counts() == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert report.properties["device"] == "NVIDIA H200" and report.properties["gpus"] == "2"
    by_params = {c.params: c for c in report.cases}
    assert by_params["1gpu-lora-zero0"].test == "test_sample.py::test_matrix"
    assert by_params["2gpu-full-zero3"].outcome == "failed" and "logits differ" in by_params["2gpu-full-zero3"].message
    assert by_params[""].outcome == "skipped" and "needs 2 GPUs, 1 found" in by_params[""].message

    out = tmp_path / "gpu_tests.md"
    assert gpu_report.main([str(xml), "--out", str(out)]) == 0
    page = out.read_text()
    assert "1 passed, 1 failed, 1 skipped" in page
    assert "| device | NVIDIA H200 |" in page.splitlines() and "| extra | x\\|y |" in page.splitlines()
    rows = [line for line in page.splitlines() if line.startswith("| `test_sample.py")]
    assert len(rows) == 3 and rows[1].startswith("| `test_sample.py::test_matrix` | 2gpu-full-zero3 | failed |")
    assert "logits differ \\| by 3e-1" in rows[1]  # a '|' in a message does not split the table's cell
    # The rows keep their order whatever order the cases finished in (pytest-xdist writes them so).
    assert gpu_report.render(dataclasses.replace(report, cases=report.cases[::-1])) == page


def test_the_recorded_commit_is_this_checkouts_or_unknown(tmp_path):
    """The commit a report records is this checkout's; a copy of the tree without ``.git`` (``git
    archive``, as carried to the GPU hosts) inside another repository records ``unknown`` rather
    than that repository's commit (``ZEROLAB_COMMIT`` names such a copy's)."""
    from conftest import _checkout_commit

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert _checkout_commit().removesuffix("-dirty") == head

    outer = tmp_path / "outer"
    (outer / "copy" / "tests").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=outer, check=True)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x"], cwd=outer, check=True)
    (outer / "copy" / "tests" / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    code = "import conftest, os; print(conftest._checkout_commit())"
    out = subprocess.run([sys.executable, "-c", code], cwd=outer / "copy" / "tests", capture_output=True, text=True)
    assert out.stdout.strip() == "unknown", out.stderr[-2000:]


def test_a_parallel_run_records_the_machine_and_versions(tmp_path):
    """The GPU tier runs under pytest-xdist (``-n``), whose workers cannot add test-suite properties:
    the process that writes the report records them."""
    gpu_report = load_report_module()
    xml = tmp_path / "run.xml"
    tests = ["tests/test_config.py::test_embedded_default_is_valid_and_round_trips", "tests/test_config.py::test_overrides_are_typed_from_yaml"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *tests, f"--junitxml={xml}"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:]

    report = gpu_report.read_junit(xml)
    assert report.counts()["passed"] == 2
    assert set(gpu_report.ENVIRONMENT_KEYS) <= set(report.properties), report.properties
