"""infra/ and the examples' scripts stay valid: files parse, say what they are for, and the IAM
policy grants exactly the S3 actions the storage layer calls (derived here from its source);
examples/train.py resumes a checkpoint saved by 2 processes on 1, and its loss continues.

YAML is parsed with PyYAML when it is installed; otherwise with the small block-YAML reader
below (enough for the subset infra/ uses), so the check still runs where PyYAML is absent.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
OBJECT_ACTIONS = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                  "s3:ListMultipartUploadParts", "s3:GetObjectAttributes"}
_CLIENT_CALL = re.compile(r"\bclient\s*\.\s*([a-z][a-z0-9_]*)\s*\(")


def s3_calls_of_storage_layer() -> set[str]:
    """Every ``client.<method>(`` of the aiobotocore client in cloudckpt/storage/*.py."""
    calls: set[str] = set()
    for path in sorted(STORAGE.glob("*.py")):
        calls |= set(_CLIENT_CALL.findall(path.read_text()))
    return calls - NOT_S3_REQUESTS


# -- a small reader for block YAML (used only when PyYAML is missing) -----------------------------


def _strip_comment(text: str) -> str:
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
    return text.rstrip()


def _scalar(text: str):
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_scalar(part.strip()) for part in inner.split(",")] if inner else []
    if text.startswith("{") and text.endswith("}") and not text[1:-1].strip():
        return {}
    if text in ("true", "True"):
        return True
    if text in ("false", "False"):
        return False
    if text in ("null", "~", ""):
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def load_block_yaml_documents(text: str) -> list:
    """Parse the block-YAML subset: maps, sequences, plain/quoted scalars, flow lists,
    ``>``/``|`` block scalars, comments and ``---`` separators. Raises ValueError otherwise."""
    docs, current = [], []
    for raw in text.splitlines():
        if raw.strip() == "---":
            docs.append(current)
            current = []
        else:
            current.append(raw)
    docs.append(current)
    return [d for d in (_parse_doc(lines) for lines in docs) if d is not None]


def _parse_doc(raw_lines: list[str]):
    lines: list[list] = []  # [indent, text, raw]
    for raw in raw_lines:
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError(f"tab in indentation: {raw!r}")
        text = _strip_comment(raw)
        if text.strip():
            lines.append([len(text) - len(text.lstrip()), text.strip(), raw])
        elif lines:
            lines.append([None, "", raw])  # blank: kept only for block scalars
    while lines and lines[-1][0] is None:
        lines.pop()
    if not lines:
        return None
    value, end = _parse_block(lines, 0, lines[0][0])
    if end != len(lines):
        raise ValueError(f"unexpected line: {lines[end][2]!r}")
    return value


def _next(lines, i):
    while i < len(lines) and lines[i][0] is None:
        i += 1
    return i


_KEY = re.compile(r"^([A-Za-z0-9_.\-/]+|\"[^\"]*\"|'[^']*'):(\s+(.*))?$")


_BLOCK_SCALAR = (">", ">-", "|", "|-")


def _block_scalar(lines, i, indent, indicator):
    """The folded (>) or literal (|) text of the lines deeper than ``indent`` from ``i``."""
    body = []
    while i < len(lines) and (lines[i][0] is None or lines[i][0] > indent):
        body.append(lines[i][2].strip())
        i += 1
    joined = (" " if indicator.startswith(">") else "\n").join(b for b in body if b)
    return (joined if indicator.endswith("-") else joined + "\n"), i


def _parse_block(lines, i, indent):
    i = _next(lines, i)
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        items = []
        while i < len(lines) and lines[i][0] == indent and (
                lines[i][1].startswith("- ") or lines[i][1] == "-"):
            rest = lines[i][1][1:].strip()
            if rest in _BLOCK_SCALAR:
                value, i = _block_scalar(lines, i + 1, indent, rest)
            elif not rest:
                value, i = _parse_block(lines, i + 1, lines[_next(lines, i + 1)][0])
            else:  # the item's text becomes a line of its own, two columns deeper
                lines[i] = [indent + 2, rest, lines[i][2]]
                value, i = _parse_block(lines, i, indent + 2)
            items.append(value)
            i = _next(lines, i)
        return items, i
    if _KEY.match(lines[i][1]):
        mapping = {}
        while i < len(lines) and lines[i][0] == indent:
            m = _KEY.match(lines[i][1])
            if m is None:
                raise ValueError(f"expected 'key: value': {lines[i][2]!r}")
            key, rest = _scalar(m.group(1)), (m.group(3) or "").strip()
            if key in mapping:
                raise ValueError(f"duplicate key {key!r}")
            j = _next(lines, i + 1)
            if rest in _BLOCK_SCALAR:
                mapping[key], i = _block_scalar(lines, i + 1, indent, rest)
            elif rest:
                mapping[key] = _scalar(rest)
                i += 1
            elif j < len(lines) and (lines[j][0] > indent or (
                    lines[j][0] == indent and lines[j][1].startswith("- "))):
                mapping[key], i = _parse_block(lines, j, lines[j][0])
            else:
                mapping[key] = None
                i += 1
            i = _next(lines, i)
        if i < len(lines) and lines[i][0] > indent:
            raise ValueError(f"bad indentation: {lines[i][2]!r}")
        return mapping, i
    value = _scalar(lines[i][1])
    return value, i + 1


def load_yaml_documents(path: Path) -> list:
    text = path.read_text()
    try:
        import yaml
    except ImportError:
        return load_block_yaml_documents(text)
    return [d for d in yaml.safe_load_all(text) if d is not None]


# -- tests --------------------------------------------------------------------------------------


def infra_files(*suffixes: str) -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and p.suffix in suffixes)


def test_infra_has_the_expected_files():
    names = {p.relative_to(INFRA).as_posix() for p in INFRA.rglob("*") if p.is_file()}
    assert {"README.md", "kubernetes/train-job.yaml", "slurm/train.sbatch", "aws/iam-policy.json",
            "aws/lifecycle-abort-incomplete-uploads.json"} <= names


def test_every_infra_file_says_what_it_is_for_in_its_first_lines():
    for path in sorted(p for p in INFRA.rglob("*") if p.is_file()):
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            first = doc.get("Id") or doc.get("Rules", [{}])[0].get("ID", "")
            assert first.startswith("cloudckpt-") and len(first) > 30, path
            continue
        head = path.read_text().splitlines()[:3]
        assert any(re.match(r"^#!?\s*\S", line) and len(line) > 30 for line in head), \
            f"{path}: no description in its first lines"


def test_yaml_files_parse():
    files = infra_files(".yaml", ".yml")
    assert files
    for path in files:
        docs = load_yaml_documents(path)
        assert docs and all(isinstance(d, dict) and d.get("kind") for d in docs), path


def test_block_yaml_reader_agrees_with_pyyaml_on_infra_files():
    yaml = pytest.importorskip("yaml", reason="PyYAML is what the fallback reader is checked against")
    for path in infra_files(".yaml", ".yml"):
        text = path.read_text()
        assert load_block_yaml_documents(text) == \
            [d for d in yaml.safe_load_all(text) if d is not None], path


def test_block_yaml_reader_rejects_broken_yaml():
    with pytest.raises(ValueError):
        load_block_yaml_documents("a:\n  b: 1\n c: 2\n")
    with pytest.raises(ValueError):
        load_block_yaml_documents("a: 1\na: 2\n")


def test_kubernetes_job_matches_the_preemption_budget():
    docs = load_yaml_documents(INFRA / "kubernetes" / "train-job.yaml")
    job = next(d for d in docs if d["kind"] == "Job")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never"
    ignored = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert any(143 in r.get("onExitCodes", {}).get("values", []) for r in ignored)
    assert any(c["type"] == "DisruptionTarget" for r in ignored
               for c in r.get("onPodConditions", []))
    command = " ".join(pod["containers"][0]["args"])
    assert "torchrun" in command and "JOB_COMPLETION_INDEX" in command
    # PID 1 forwards SIGTERM, and a preemption save becomes exit status 143
    assert "trap 'kill -TERM" in command and "--preempted-marker" in command
    assert "exit 143" in command
    shutdown = int(re.search(r"--shutdown-timeout\s+(\d+)", command).group(1))
    assert shutdown < pod["terminationGracePeriodSeconds"] <= 120  # AWS spot notice: 2 minutes
    lines = (INFRA / "kubernetes" / "train-job.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "terminationGracePeriodSeconds:" in line)
    comment = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        comment.append(line)
    assert "--shutdown-timeout" in " ".join(comment) and "save" in " ".join(comment), \
        "the grace period needs the comment above it that explains the match"


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


def test_lifecycle_rule_aborts_incomplete_multipart_uploads():
    doc = json.loads((INFRA / "aws" / "lifecycle-abort-incomplete-uploads.json").read_text())
    rules = [r for r in doc["Rules"] if "AbortIncompleteMultipartUpload" in r]
    assert rules and all(r["Status"] == "Enabled" for r in rules)
    assert all(r["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1 for r in rules)


def test_storage_layer_calls_are_known():
    calls = s3_calls_of_storage_layer()
    assert {"put_object", "get_object", "list_objects_v2"} <= calls, \
        f"the grep of cloudckpt/storage found too little: {sorted(calls)}"
    unknown = calls - set(S3_CALL_TO_IAM)
    assert not unknown, (f"cloudckpt/storage calls {sorted(unknown)}: add them to S3_CALL_TO_IAM "
                         "here and the IAM actions they need to infra/aws/iam-policy.json")


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
    assert granted == needed, (f"missing {sorted(needed - granted)}, "
                               f"not needed {sorted(granted - needed)}")


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
    common = [str(ROOT / "examples" / "train.py"), "--url", s3_url, "--steps", "8",
              "--save-every", "4", "--loss-log", str(losses), "--dim", "64", "--layers", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    first = subprocess.run(torchrun + common, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    mgr = CheckpointManager(s3_url)
    assert [c.step for c in mgr.list() if c.complete] == [4, 8]
    mgr.delete(8)  # as if the job had died after step 8 and before its save

    second = subprocess.run([sys.executable] + common, env=env, capture_output=True, text=True,
                            timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from step 4" in second.stdout and "world size 1" in second.stdout
    by_step = _read_losses(losses)
    for step in range(5, 9):  # the same batches from the same state: the same loss
        assert by_step[(step, 1)] == pytest.approx(by_step[(step, 2)], abs=1e-3), step
    assert mgr.latest().step == 8
