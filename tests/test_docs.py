"""The documentation's Python examples run: every ```python block of docs/guide.md and README.md.

Blocks of one file run in file order in one shared namespace (a later block may use names an
earlier one defined), in this process, against the session's local SeaweedFS (``s3_env``: the
standard AWS variables point at it). The docs use the bucket ``my-bucket``; each run rewrites
``s3://my-bucket/`` to a fresh prefix of the test bucket, so runs never see each other's data.
A block whose fence reads ```python no-run is shown but not run (use it sparingly: a multi-rank
sketch that needs torchrun, say).
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = ("docs/guide.md", "README.md")
DOC_BUCKET_URL = "s3://my-bucket/"
_FENCE = re.compile(r"^```(\S*)(.*)$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(first line number, code, runnable)`` of every ```python block, in file order."""
    blocks: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if m is None or not m.group(1) and not m.group(2).strip():
            i += 1
            continue
        lang, info = m.group(1), m.group(2).split()
        start = i + 1
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"unclosed code fence opened at line {start}")
        i += 1
        if lang == "python":
            blocks.append((start + 1, "\n".join(body) + "\n", "no-run" not in info))
    return blocks


def test_block_extraction_honours_fences_and_no_run():
    text = (
        "intro\n```python\na = 1\n```\n```bash\necho no\n```\n"
        "```python no-run\nraise SystemExit\n```\n```\nplain\n```\n```python\nb = a\n```\n"
    )
    assert python_blocks(text) == [
        (3, "a = 1\n", True),
        (9, "raise SystemExit\n", False),
        (15, "b = a\n", True),
    ]


@pytest.mark.parametrize("doc", [d for d in DOC_FILES if (ROOT / d).exists()])
def test_doc_python_blocks_run(doc, s3_env):
    blocks = python_blocks((ROOT / doc).read_text())
    runnable = [b for b in blocks if b[2]]
    if doc == "docs/guide.md":
        assert len(runnable) >= 8, "the guide lost its runnable examples"
        assert len(blocks) - len(runnable) <= 2, "no-run is for the odd multi-rank sketch only"
    prefix = f"s3://{s3_env.bucket}/docs-{Path(doc).stem}-{uuid.uuid4().hex[:8]}/"
    namespace: dict = {"__name__": f"docs_{Path(doc).stem}"}
    for line, code, run in blocks:
        if not run:
            compile(code, f"{doc}:{line}", "exec")  # shown code must at least be valid Python
            continue
        code = code.replace(DOC_BUCKET_URL, prefix)
        try:
            exec(compile(code, f"{doc}:{line}", "exec"), namespace)
        except BaseException as exc:
            raise AssertionError(
                f"the python block at {doc}:{line} failed: {type(exc).__name__}: {exc}"
            ) from exc
