"""The CI that builds and publishes the site: .github/workflows, audited and checked."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
PINNED = re.compile(
    r"^\s*(?:-\s+)?uses:\s+[\w.-]+/[\w./-]+@[0-9a-f]{40}\s+#\s+v\d+\S*\s*$"
)
SELF_HOSTED = "self-hosted"


def load(path):
    workflow = yaml.safe_load(path.read_text())
    workflow["on"] = workflow.pop(
        True, workflow.get("on")
    )  # YAML 1.1 reads `on:` as True
    return workflow


def triggers(workflow):
    on = workflow["on"]
    return {on} if isinstance(on, str) else set(on)


def runs_on(job):
    labels = job["runs-on"]
    return [labels] if isinstance(labels, str) else labels


def steps_text(job):
    return [
        (step.get("name", ""), step.get("run", ""), step.get("uses", ""))
        for step in job["steps"]
    ]


@pytest.fixture(scope="module")
def workflows():
    assert {p.name for p in WORKFLOWS} == {"pull-request.yml", "publish.yml"}
    return {path.name: load(path) for path in WORKFLOWS}


def test_zizmor_finds_nothing():
    zizmor = Path(sys.executable).with_name("zizmor")
    result = subprocess.run(
        [
            str(zizmor),
            "--offline",
            "--no-progress",
            str(REPO / ".github" / "workflows"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "No findings to report" in result.stdout + result.stderr


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_action_is_pinned_to_a_commit_with_its_version(path):
    uses = [
        line
        for line in path.read_text().splitlines()
        if re.match(r"^\s*(-\s+)?uses:", line)
    ]
    assert uses
    unpinned = [line.strip() for line in uses if not PINNED.match(line)]
    assert not unpinned, f"not pinned to a full SHA with a version comment: {unpinned}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_least_privilege_timeouts_and_no_secrets(path):
    workflow = load(path)
    assert workflow["permissions"] == {"contents": "read"}
    assert "secrets." not in path.read_text()
    for name, job in workflow["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), (
            f"{name}: no timeout-minutes"
        )
        permissions = job.get("permissions")
        assert isinstance(permissions, dict), f"{name}: no job-level permissions"
        writes = {scope for scope, level in permissions.items() if level == "write"}
        allowed = {
            "deploy": {"pages", "id-token"},
            "mirror-for-colab": {"contents"},
        }.get(name, set())
        assert writes == allowed, f"{name} may write {writes}, expected {allowed}"


def shard_matrix(job):
    """The shard numbers of a matrix job, checked against the SHARD=i/N it passes to make."""
    shards = job["strategy"]["matrix"]["shard"]
    assert shards == list(range(1, len(shards) + 1)), shards
    assert job["env"]["SHARD"] == f"${{{{ matrix.shard }}}}/{len(shards)}"
    return shards


def uploaded_gallery(job):
    (upload,) = [
        s
        for s in job["steps"]
        if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert upload["with"]["name"] == "gallery-shard-${{ matrix.shard }}"
    assert upload["with"]["path"] == "docs/auto_examples"
    assert upload["with"]["if-no-files-found"] == "error"
    return upload


def merges_the_shards(job, shard_job_name):
    """A hosted job after the shards: download every shard's gallery, then make merge."""
    assert job["needs"] == shard_job_name
    assert not any(SELF_HOSTED in label for label in runs_on(job))
    assert job["permissions"].get("actions") == "read"
    runs = [run for _, run, _ in steps_text(job)]
    (download,) = [i for i, run in enumerate(runs) if "gh run download" in run]
    assert "--pattern 'gallery-shard-*' --dir shards" in runs[download]
    assert '"$GITHUB_RUN_ID"' in runs[download]
    merge = runs.index("make merge FROM=shards")
    assert download < merge
    return runs, merge


def test_pull_requests_build_shards_then_merge_and_test_on_hosted_cpu_runners(
    workflows,
):
    workflow = workflows["pull-request.yml"]
    assert triggers(workflow) == {"pull_request"}
    assert set(workflow["jobs"]) == {"shard", "merge-and-test"}
    shard = workflow["jobs"]["shard"]
    assert not any(SELF_HOSTED in label for label in runs_on(shard))
    count = len(shard_matrix(shard))
    runs = [run for _, run, _ in steps_text(shard)]
    # Each shard builds its examples, hands its gallery on, then runs the same notebooks.
    build, test = (
        runs.index('make html SHARD="$SHARD"'),
        runs.index('make test-shard SHARD="$SHARD"'),
    )
    upload = shard["steps"].index(uploaded_gallery(shard))
    assert build < upload < test
    merge_job = workflow["jobs"]["merge-and-test"]
    runs, merge = merges_the_shards(merge_job, "shard")
    # The other tests run once, on the merged site, knowing how many shards ran notebooks.
    assert merge < runs.index(f"make test-merged SHARDS={count}")
    upload = [
        s
        for s in merge_job["steps"]
        if s.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert upload and upload[0]["with"]["path"] == "_build/html"


def test_the_cpu_runners_install_the_cpu_build_of_torch(workflows):
    assert workflows["pull-request.yml"]["env"]["PIP_EXTRA_INDEX_URL"].endswith(
        "/whl/cpu"
    )
    publish = workflows["publish.yml"]
    gpu = yaml.safe_dump(publish["jobs"]["build-shard-on-gpu"])
    assert "/whl/cpu" not in gpu and "PIP_EXTRA_INDEX_URL" not in gpu
    merge_runs = [run for _, run, _ in steps_text(publish["jobs"]["merge"])]
    assert "make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu" in merge_runs


def test_pull_requests_cache_pip_with_setup_python_not_by_hand(workflows):
    for job in workflows["pull-request.yml"]["jobs"].values():
        setup = next(
            s for s in job["steps"] if "actions/setup-python@" in s.get("uses", "")
        )
        assert setup["with"]["cache"] == "pip"
        assert setup["with"]["cache-dependency-path"] == "requirements.txt"
        assert not any("actions/cache@" in s.get("uses", "") for s in job["steps"])


def test_no_pull_request_code_reaches_the_gpu_runner(workflows):
    for name, workflow in workflows.items():
        gpu_jobs = [j for j in workflow["jobs"].values() if SELF_HOSTED in runs_on(j)]
        if gpu_jobs:
            assert not triggers(workflow) & {"pull_request", "pull_request_target"}, (
                name
            )
            assert triggers(workflow) <= {"push", "workflow_dispatch"}, name


def test_main_builds_shards_on_the_gpu_then_merges_and_deploys(workflows):
    workflow = workflows["publish.yml"]
    assert workflow["on"]["push"]["branches"] == ["main"]
    assert "workflow_dispatch" in triggers(workflow)
    assert workflow["concurrency"]["cancel-in-progress"] is False

    build = workflow["jobs"]["build-shard-on-gpu"]
    assert runs_on(build)[0] == SELF_HOSTED and "gpu" in runs_on(build)
    shard_matrix(build)
    assert build["strategy"]["fail-fast"] is True
    runs = [run for _, run, _ in steps_text(build)]
    gpu_check = next(
        i for i, run in enumerate(runs) if "torch.cuda.is_available()" in run
    )
    assert "sys.exit(" in runs[gpu_check], "the GPU check must fail the job"
    make_html = runs.index('make html SHARD="$SHARD"')
    assert gpu_check < make_html, "the GPU check must come before the build"
    assert make_html < build["steps"].index(uploaded_gallery(build))

    merge = workflow["jobs"]["merge"]
    merges_the_shards(merge, "build-shard-on-gpu")
    uses = [step.get("uses", "").split("@")[0] for step in merge["steps"]]
    assert "actions/upload-pages-artifact" in uses
    deploy = workflow["jobs"]["deploy"]
    assert deploy["needs"] == "merge"
    assert workflow["jobs"]["mirror-for-colab"]["needs"] == "merge"
    deploy_uses = [step.get("uses", "").split("@")[0] for step in deploy["steps"]]
    assert deploy_uses == ["actions/configure-pages", "actions/deploy-pages"]
