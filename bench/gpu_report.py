"""Record a run of the GPU test tier in the repository: its JUnit XML as a Markdown page.

    pytest -m gpu -n 4 --junitxml=gpu.xml; python bench/gpu_report.py gpu.xml --out docs/gpu_tests.md

The page lists every test with its outcome, time and, for a failure or skip, the first line of
its message, under the machine and versions the suite recorded (``tests/conftest.py`` writes
them into the XML as test-suite properties).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ENVIRONMENT_KEYS = ("device", "gpus", "torch", "cuda", "deepspeed", "ray", "transformers", "peft", "mlflow", "liger_kernel", "commit")
"""Test-suite properties shown in the page's header, in this order (others follow)."""


@dataclass
class Case:
    test: str
    """File and function, e.g. ``test_gpu_tier.py::test_method_and_zero_stage_on_gpus``."""
    params: str
    """The parametrisation id (empty when none)."""
    outcome: str
    """passed, failed, error or skipped."""
    seconds: float
    message: str = ""


@dataclass
class Report:
    timestamp: str
    hostname: str
    seconds: float
    properties: dict[str, str] = field(default_factory=dict)
    cases: list[Case] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in ("passed", "failed", "error", "skipped")}
        for c in self.cases:
            out[c.outcome] += 1
        return out


def read_junit(path: str | Path) -> Report:
    """The cases of a pytest JUnit XML file (one or several test suites)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    first = suites[0]
    report = Report(timestamp=first.get("timestamp", ""), hostname=first.get("hostname", ""),
                    seconds=sum(float(s.get("time", 0)) for s in suites))
    for suite in suites:
        for prop in suite.iter("property"):
            report.properties[prop.get("name", "")] = prop.get("value", "")
        for case in suite.iter("testcase"):
            if case.get("name"):  # pytest writes a nameless entry for the session an interrupt cut short
                report.cases.append(_case(case))
    return report


def _case(element: ET.Element) -> Case:
    module = element.get("classname", "").rsplit(".", 1)[-1]
    name = element.get("name", "")
    function, _, params = name.partition("[")
    outcome, message = "passed", ""
    for tag in ("failure", "error", "skipped"):
        child = element.find(tag)
        if child is not None:
            outcome = {"failure": "failed"}.get(tag, tag)
            message = child.get("message") or (child.text or "")
            break
    first_line = next((line.strip() for line in message.splitlines() if line.strip()), "")
    return Case(test=f"{module}.py::{function}", params=params.rstrip("]"), outcome=outcome,
                seconds=float(element.get("time", 0)), message=first_line[:200])


def render(report: Report) -> str:
    """The Markdown page for ``report``."""
    counts = report.counts()
    env = {k: report.properties[k] for k in ENVIRONMENT_KEYS if k in report.properties}
    env.update({k: v for k, v in report.properties.items() if k not in env})
    lines = [
        "# GPU test tier: last run",
        "",
        "Written by `bench/gpu_report.py` from the JUnit XML of",
        "",
        "```bash",
        "pytest -m gpu -n 4 --junitxml=gpu.xml; python bench/gpu_report.py gpu.xml --out docs/gpu_tests.md",
        "```",
        "",
        f"Run {report.timestamp or 'at an unrecorded time'} on {report.hostname or 'an unrecorded host'}: "
        + ", ".join(f"{counts[k]} {k}" for k in counts if counts[k] or k in ("passed", "failed"))
        + f" in {report.seconds:.0f} s.",
        "",
    ]
    if env:
        lines += ["| | |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in env.items()), ""]
    lines += ["| test | case | result | s | message |", "|---|---|---|---:|---|"]
    for c in sorted(report.cases, key=lambda c: (c.test, c.params)):  # pytest-xdist reports cases as they finish
        lines.append(f"| `{c.test}` | {_cell(c.params)} | {c.outcome} | {c.seconds:.1f} | {_cell(c.message)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", type=Path, help="the XML written by pytest --junitxml")
    parser.add_argument("--out", type=Path, default=Path("docs/gpu_tests.md"))
    args = parser.parse_args(argv)
    report = read_junit(args.junit)
    args.out.write_text(render(report), encoding="utf-8")
    counts = report.counts()
    print(f"{args.out}: {len(report.cases)} tests, " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
