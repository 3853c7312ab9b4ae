"""The test suite's time as CI sees it: `.ci/run` on a fresh clone of this tree's HEAD (the install included), each
pytest run's counts and seconds, and the wall time, written to benchmarks/results/ci_timing.json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ci_timing.py [--dest /tmp/autocompress-ci] [--note "what ran beside it"]

The clone gets a `shared` link beside it (to this tree's ../shared, as the project expects), so no test that needs the
data skips. The budget (DEVELOPERS.md): both pytest runs of `make test` within 15 minutes on a machine of this kind.
Commit first: the clone holds HEAD, not the working tree's changes. The figure moves with whatever else runs: stop
other work, or say what ran (--note; `_record.others_cores` measures it either way).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import common  # checks that the autocompress imported is this tree's

from autocompress.io import write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "ci_timing.json"
MARK = ".ci_timing_clone"  # a folder holding it was made by this script and may be replaced
BUDGET_S = 900.0
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", re.M)  # pytest's last line: "802 passed, 2 skipped in 830.12s"


def pytest_runs(log: str) -> list[dict[str, Any]]:
    """Each pytest run's outcome counts and seconds, in the order the log shows them."""
    runs = []
    for counts, seconds in SUMMARY.findall(log):
        run: dict[str, Any] = {word: int(n) for n, word in (part.split() for part in counts.split(", "))}
        run["seconds"] = float(seconds)
        runs.append(run)
    return runs


def fresh_clone(dest: Path) -> None:
    if dest.exists():
        if not (dest / MARK).exists():
            raise SystemExit(f"error: {dest} exists and was not made by this script; remove it or give --dest")
        shutil.rmtree(dest)
    shared, want = dest.parent / "shared", ROOT.parent / "shared"
    if not shared.exists():
        shared.symlink_to(want)
    elif shared.resolve() != want.resolve():
        raise SystemExit(f"error: {shared} is not {want}; the clone's tests would read other data: give another --dest")
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    (dest / MARK).touch()  # git ignores nothing here: .ci/run does not read it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=Path("/tmp/autocompress-ci"), help="where the fresh clone goes")
    parser.add_argument("--note", default=None, help="what else ran on the machine meanwhile")
    args = parser.parse_args()
    dest = args.dest.resolve()
    record = common.Record(args.note)
    fresh_clone(dest)
    log = dest.with_name(dest.name + ".log")
    with log.open("w") as fh:
        rc = subprocess.run([".ci/run"], cwd=dest, stdout=fh, stderr=subprocess.STDOUT).returncode
    runs = pytest_runs(log.read_text(errors="replace"))
    names = ["parallel", "timing"][: len(runs)] + [f"run{i}" for i in range(2, len(runs))]
    tests = dict(zip(names, runs, strict=True))
    seconds = sum(r["seconds"] for r in runs)
    earlier = json.loads(OUT.read_text()) if OUT.exists() else None
    if earlier:
        earlier.pop("earlier", None)
    result = {
        "what": ".ci/run on a fresh clone (make test: pytest -n 2 -m 'not timing', then -m timing; make lint; make typecheck), "
        "install included",
        "command": "PYTHONPATH=$PWD .venv/bin/python benchmarks/ci_timing.py" + (f" --note {args.note!r}" if args.note else ""),
        "rc": rc,
        "tests": tests,
        "tests_seconds": round(seconds, 1),
        "budget_seconds": BUDGET_S,
        "within_budget": rc == 0 and seconds <= BUDGET_S,
        "_record": record.as_dict(),
        "earlier": earlier,
    }
    write_json(result, OUT)
    print(json.dumps({k: result[k] for k in ("rc", "tests", "tests_seconds", "within_budget")}, indent=1))
    print(f"wrote {OUT}; the log: {log}")
    if rc:
        sys.exit(f"error: .ci/run failed (exit {rc}); see {log}")


if __name__ == "__main__":
    main()
