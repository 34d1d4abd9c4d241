"""The CI tiers: ci/test.sh's gate and full tier, and the GitHub workflows that split them into parallel jobs.

The workflows cannot run here; these tests keep them consistent with the script: every stage a workflow names
exists, the PR workflow's jobs together run exactly the gate's stages and the nightly workflow's exactly the full
tier's, no stage is in both tiers, and .ci/run runs the gate.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
WORKFLOWS = ROOT / ".github" / "workflows"


def tiers() -> dict[str, list[str]]:
    listing = subprocess.run(
        ["bash", "ci/test.sh", "--list"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    return {line.split(":")[0]: line.split(":")[1].split() for line in listing.splitlines()}


def workflow_stages(name: str) -> list[str]:
    """Every stage the workflow's jobs pass to ``ci/test.sh --stages``, a matrix's entries expanded."""
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    stages = []
    for job in workflow["jobs"].values():
        matrix = job.get("strategy", {}).get("matrix", {})
        for step in job.get("steps", []):
            run = step.get("run", "").replace("${{ matrix.stages }}", "MATRIX")
            for arg in re.findall(r"ci/test\.sh\s+--stages\s+(\S+)", run):
                values = matrix["stages"] if arg == "MATRIX" else [arg]
                for value in values:
                    stages += value.split(",")
    return stages


def test_tiers_are_disjoint_and_every_stage_exists():
    found = tiers()
    assert set(found) == {"gate", "full"}
    assert not set(found["gate"]) & set(found["full"])
    script = (ROOT / "ci" / "test.sh").read_text()
    for stage in found["gate"] + found["full"]:
        assert f"stage_{stage}()" in script, stage


@pytest.mark.parametrize(("workflow", "tier"), [("ci.yml", "gate"), ("nightly.yml", "full")])
def test_workflow_runs_exactly_its_tier(workflow, tier):
    stages = workflow_stages(workflow)
    assert sorted(stages) == sorted(tiers()[tier]), f"{workflow}: {sorted(stages)}"


def test_unknown_stage_is_refused():
    run = subprocess.run(["bash", "ci/test.sh", "--stages", "lint,nope"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "unknown stage 'nope'" in run.stderr


def test_ci_entry_point_runs_the_gate():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any(re.fullmatch(r"bash ci/install\.sh && bash ci/test\.sh", line.strip()) for line in lines)
