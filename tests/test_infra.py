"""infra/ and the examples' scripts stay valid: files parse, say what they are for, and the IAM
policy grants exactly the S3 actions the storage layer calls (derived here from its source);
examples/train.py resumes a checkpoint saved by 2 processes on 1, and its loss continues.

YAML is parsed with PyYAML, JSON lifecycle rules are validated against botocore's S3 model, the
torchrun command of the Kubernetes Job with torchrun's own argument parser, and the Dockerfile
with dockerfile-parse (all in the test extra).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
STORAGE = ROOT / "cloudckpt" / "storage"

# S3 client method (as called in cloudckpt/storage) -> the IAM actions it needs.
S3_CALL_TO_IAM = {
    "put_object": {"s3:PutObject"},
    "create_multipart_upload": {"s3:PutObject"},
    "upload_part": {"s3:PutObject"},
    "complete_multipart_upload": {"s3:PutObject"},
    "copy_object": {"s3:GetObject", "s3:PutObject"},
    "upload_part_copy": {"s3:GetObject", "s3:PutObject"},
    "get_object": {"s3:GetObject"},
    # signs a GetObject URL locally (no request); the ranged GETs sent with it need GetObject
    "generate_presigned_url": {"s3:GetObject"},
    "head_object": {"s3:GetObject"},
    "list_objects_v2": {"s3:ListBucket"},
    "list_objects": {"s3:ListBucket"},
    "delete_object": {"s3:DeleteObject"},
    "delete_objects": {"s3:DeleteObject"},
    "abort_multipart_upload": {"s3:AbortMultipartUpload"},
    "list_multipart_uploads": {"s3:ListBucketMultipartUploads"},
    "list_parts": {"s3:ListMultipartUploadParts"},
    "head_bucket": {"s3:ListBucket"},
    "get_object_attributes": {"s3:GetObject", "s3:GetObjectAttributes"},
}
NOT_S3_REQUESTS = {"close", "get_paginator", "can_paginate", "meta"}
OBJECT_ACTIONS = {
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
    "s3:GetObjectAttributes",
}
# ``client.<method>(`` and the one-line form of the choke point, ``conn.request("<method>", ...)``
# / ``conn.send("<method>", ...)`` (storage/s3/conn.py)
_CLIENT_CALL = re.compile(
    r"\bclient\s*\.\s*([a-z][a-z0-9_]*)\s*\(|\.(?:request|send)\(\s*\"([a-z][a-z0-9_]*)\""
)


def s3_calls_of_storage_layer() -> set[str]:
    """Every ``client.<method>(`` of the aiobotocore client in cloudckpt/storage/**/*.py."""
    calls: set[str] = set()
    for path in sorted(STORAGE.rglob("*.py")):
        calls |= {a or b for a, b in _CLIENT_CALL.findall(path.read_text())}
    return calls - NOT_S3_REQUESTS


def load_yaml_documents(path: Path) -> list:
    """Every non-empty document of a YAML file (PyYAML, safe loader)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# -- tests --------------------------------------------------------------------------------------


def infra_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and p.suffix in suffixes)


def test_infra_has_the_expected_files():
    names = {p.relative_to(INFRA).as_posix() for p in INFRA.rglob("*") if p.is_file()}
    assert {
        "README.md",
        "kubernetes/train-job.yaml",
        "slurm/train.sbatch",
        "aws/iam-policy.json",
        "aws/lifecycle-abort-incomplete-uploads.json",
        "aws/lifecycle-versioned-bucket.json",
        "docker/Dockerfile",
        "docker/Dockerfile.dockerignore",
    } <= names


def _readme_table() -> dict[str, str]:
    """infra/README.md's file table: linked path -> its description."""
    text = (INFRA / "README.md").read_text()
    rows = re.findall(r"^\| \[([^\]]+)\]\(\1\) \| (.+) \|$", text, re.M)
    return dict(rows)


def test_every_infra_file_says_what_it_is_for():
    """In its first lines (a comment) where the format has comments, and in the README's table."""
    table = _readme_table()
    for path in sorted(p for p in INFRA.rglob("*") if p.is_file() and p.name != "README.md"):
        rel = path.relative_to(INFRA).as_posix()
        assert len(table.get(rel, "")) > 30, f"{rel}: no row in infra/README.md's table"
        if path.suffix == ".json":  # JSON has no comments: lifecycle rules carry a telling ID
            for rule in json.loads(path.read_text()).get("Rules", []):
                assert rule["ID"].startswith("cloudckpt-") and len(rule["ID"]) > 30, rel
            continue
        head = path.read_text().splitlines()[:3]
        assert any(re.match(r"^#!?\s*\S", line) and len(line) > 30 for line in head), (
            f"{path}: no description in its first lines"
        )


def test_yaml_files_parse():
    files = infra_files(".yaml", ".yml")
    assert files
    for path in files:
        docs = load_yaml_documents(path)
        assert docs and all(isinstance(d, dict) and d.get("kind") for d in docs), path


def test_slurm_script_signals_before_the_time_limit():
    text = (INFRA / "slurm" / "train.sbatch").read_text()
    lead = int(re.search(r"^#SBATCH --signal=(?:[RB]:)?(?:TERM|15)@(\d+)", text, re.M).group(1))
    shutdown = int(re.search(r"--shutdown-timeout\s+(\d+)", text).group(1))
    assert shutdown < lead
    assert "torchrun" in text and "--requeue" in text
    assert "--preempted-marker" in text and "scontrol requeue" in text


@pytest.mark.parametrize("script", ["infra/slurm/train.sbatch", "examples/demo.sh"])
def test_shell_scripts_have_valid_syntax(script):
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the scripts"
    proc = subprocess.run([bash, "-n", str(ROOT / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


LIFECYCLE_FILES = sorted((INFRA / "aws").glob("lifecycle-*.json"))


@pytest.mark.parametrize("path", LIFECYCLE_FILES, ids=lambda p: p.name)
def test_lifecycle_configuration_is_valid_for_s3(path):
    """The file is what `aws s3api put-bucket-lifecycle-configuration --lifecycle-configuration
    file://...` sends: validated against botocore's S3 model (key names, types, nesting)."""
    import botocore.session
    from botocore.validate import ParamValidator

    doc = json.loads(path.read_text())
    operation = (
        botocore.session.get_session()
        .get_service_model("s3")
        .operation_model("PutBucketLifecycleConfiguration")
    )
    report = ParamValidator().validate(
        {"Bucket": "BUCKET", "LifecycleConfiguration": doc}, operation.input_shape
    )
    assert not report.has_errors(), report.generate_report()
    ids = [r["ID"] for r in doc["Rules"]]
    assert len(set(ids)) == len(ids) and all(len(i) <= 255 for i in ids)
    for rule in doc["Rules"]:
        assert rule["Status"] == "Enabled"
        assert rule["Filter"] == {"Prefix": "PREFIX/"}, "only the checkpoints' prefix"
        assert "Days" not in rule.get("Expiration", {}), "never expire current checkpoint objects"
    # putting a lifecycle configuration replaces the bucket's whole one: each file stands alone,
    # so each aborts the multipart uploads a killed save leaves behind
    aborts = [r for r in doc["Rules"] if "AbortIncompleteMultipartUpload" in r]
    assert aborts and all(
        r["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1 for r in aborts
    )


def test_versioned_bucket_rule_frees_what_pruning_deletes():
    """On a versioned bucket a DELETE only adds a delete marker; the bytes stay as a noncurrent
    version until a NoncurrentVersionExpiration rule removes them."""
    doc = json.loads((INFRA / "aws" / "lifecycle-versioned-bucket.json").read_text())
    rules = doc["Rules"]
    assert any(
        r.get("NoncurrentVersionExpiration", {}).get("NoncurrentDays", 0) >= 1 for r in rules
    )
    assert any(r.get("Expiration", {}).get("ExpiredObjectDeleteMarker") is True for r in rules)
    readme = (INFRA / "README.md").read_text()
    assert "lifecycle-versioned-bucket.json" in readme and "noncurrent" in readme.lower()
    assert "get-bucket-versioning" in readme


def test_iam_policy_is_an_identity_policy():
    """Only what IAM accepts in an identity-based policy: no top-level Id, no Principal,
    alphanumeric unique Sids."""
    policy = json.loads((INFRA / "aws" / "iam-policy.json").read_text())
    assert set(policy) == {"Version", "Statement"}, sorted(policy)
    sids = [s.get("Sid", "") for s in policy["Statement"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]*", sid) for sid in sids), sids
    assert len(set(sids)) == len(sids)
    for statement in policy["Statement"]:
        assert set(statement) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, statement


def test_the_typed_boundary_names_exactly_the_requests_the_storage_layer_sends():
    from typing import get_args

    from cloudckpt.storage.s3.shapes import S3Method

    sent = s3_calls_of_storage_layer() - {"generate_presigned_url"}  # signed locally, no request
    assert set(get_args(S3Method)) == sent


def test_storage_layer_calls_are_known():
    calls = s3_calls_of_storage_layer()
    assert {"put_object", "get_object", "list_objects_v2"} <= calls, (
        f"the grep of cloudckpt/storage found too little: {sorted(calls)}"
    )
    unknown = calls - set(S3_CALL_TO_IAM)
    assert not unknown, (
        f"cloudckpt/storage calls {sorted(unknown)}: add them to S3_CALL_TO_IAM "
        "here and the IAM actions they need to infra/aws/iam-policy.json"
    )


def test_iam_policy_grants_exactly_the_actions_cloudckpt_calls():
    policy = json.loads((INFRA / "aws" / "iam-policy.json").read_text())
    assert policy["Version"] == "2012-10-17"
    granted: set[str] = set()
    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow"
        actions = statement["Action"]
        actions = {actions} if isinstance(actions, str) else set(actions)
        resources = statement["Resource"]
        resources = [resources] if isinstance(resources, str) else resources
        assert not any("*" in a for a in actions), "no wildcard actions"
        for resource in resources:
            assert resource.startswith("arn:aws:s3:::BUCKET"), resource
            if actions & OBJECT_ACTIONS:  # object actions only under the prefix
                assert resource == "arn:aws:s3:::BUCKET/PREFIX/*", resource
            else:
                assert resource == "arn:aws:s3:::BUCKET", resource
        granted |= actions
    needed = set().union(*(S3_CALL_TO_IAM[c] for c in s3_calls_of_storage_layer()))
    assert granted == needed, (
        f"missing {sorted(needed - granted)}, not needed {sorted(granted - needed)}"
    )


# -- examples/train.py: a checkpoint saved by 2 processes resumes on 1 ---------------------------


def _read_losses(path: Path) -> dict[tuple[int, int], float]:
    losses = {}
    for line in path.read_text().splitlines():
        step, loss, world = line.split()
        losses[(int(step), int(world))] = float(loss)
    return losses


def test_train_example_resumes_on_another_world_size(s3_env, s3_url, tmp_path):
    import os
    import sys

    from cloudckpt import CheckpointManager

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    losses = tmp_path / "losses.txt"
    common = [
        str(ROOT / "examples" / "train.py"),
        "--url",
        s3_url,
        "--steps",
        "8",
        "--save-every",
        "4",
        "--loss-log",
        str(losses),
        "--dim",
        "64",
        "--layers",
        "2",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    first = subprocess.run(torchrun + common, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    mgr = CheckpointManager(s3_url)
    assert [c.step for c in mgr.list() if c.complete] == [4, 8]
    mgr.delete(8)  # as if the job had died after step 8 and before its save

    second = subprocess.run(
        [sys.executable] + common, env=env, capture_output=True, text=True, timeout=240
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from step 4" in second.stdout and "world size 1" in second.stdout
    by_step = _read_losses(losses)
    for step in range(5, 9):  # the same batches from the same state: the same loss
        assert by_step[(step, 1)] == pytest.approx(by_step[(step, 2)], abs=1e-3), step
    assert mgr.latest().step == 8
