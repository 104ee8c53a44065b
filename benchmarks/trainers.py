"""Trainer integrations: how long training is blocked per save, against the trainer's own path.

Each trainer has a module `benchmarks/_trainer_<name>.py` (lightning, hf, dcp, ...) with

    TITLE: str                                    # the section's heading
    def available() -> str | None                 # None, or why the section is skipped
    def measure(server, args) -> list[Row]        # rows of one section, baseline first

where `server` is the local SeaweedFS started here (`.info` has endpoint and credentials) and
`args` has `mib` (state size), `saves` (saves per method) and `tmp` (a scratch folder).
`blocked_s` is the median time the training loop waited for one save (the call's wall time, or,
for an asynchronous save, until the call returned); `rss_bytes` the peak RSS growth over the
method's saves. The first row of a section is its baseline (the trainer's own local
`torch.save` path); ratios are against it, measured in the same run.

    python benchmarks/trainers.py [--mib 64] [--saves 5] [--only lightning,hf]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Table, describe_machine, fmt_mib, fmt_s, start_server  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Row:
    """One method of one trainer section."""

    method: str
    blocked_s: float
    rss_bytes: int
    note: str = ""


def section_modules() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(p.stem for p in here.glob("_trainer_*.py"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="state size in MiB (default 64)")
    ap.add_argument("--saves", type=int, default=5, help="saves per method (default 5)")
    ap.add_argument("--only", default="", help="comma-separated trainer names (default: all)")
    args = ap.parse_args(argv)
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    print(
        f"# trainer integrations ({describe_machine()}); state {args.mib} MiB, {args.saves} saves"
    )
    server = start_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.tmp = tmp
            for name in section_modules():
                short = name.removeprefix("_trainer_")
                if wanted and short not in wanted:
                    continue
                mod = importlib.import_module(name)
                why = mod.available()
                print(f"\n## {mod.TITLE}")
                if why is not None:
                    print(f"skipped: {why}")
                    continue
                rows = mod.measure(server, args)
                base = rows[0].blocked_s if rows else None
                table = Table(
                    ["method", "blocked per save", "x baseline", "peak RSS + (MiB)", "note"]
                )
                for r in rows:
                    ratio = f"{r.blocked_s / base:.2f}" if base else "-"
                    table.add(r.method, fmt_s(r.blocked_s), ratio, fmt_mib(r.rss_bytes), r.note)
                print(table.render())
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
