"""The code in README.md and docs/ runs as written (issue 44): every Python block runs against a real run folder (the
tiny sweep; its paths put in for the docs' example paths), and every sweep / compare command line in a bash block
composes and passes the config checks (running them is the benchmarks' job). docs/benchmarks.md and docs/history.md are records of
past runs and docs/scenarios.md has its own test (tests/test_scenarios_doc.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import ROOT, run_cli

DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in ("benchmarks.md", "history.md", "scenarios.md")),
]
RUN_PATH = re.compile(r"results/h100_batched/(RUN_ID|\d{8}-\d{6})")


def _blocks(kind: str) -> list[tuple[str, str]]:
    found = [(p, re.findall(rf"```{kind}\n(.*?)```", p.read_text(), re.S)) for p in DOCS]
    return [(f"{p.name}:{n}", textwrap.dedent(b)) for p, blocks in found for n, b in enumerate(blocks)]  # list items indent


PYTHON = _blocks("python")
COMMANDS = [
    (name, line.split("#")[0].replace("\\\n", " "))
    for name, block in _blocks("bash")
    for line in block.replace("\\\n", " ").splitlines()
    if re.match(r"\.venv/bin/python -m autocompress\.(sweep|compare) ", line)
]


RUNNABLE = [  # report / export lines on an example run folder, nothing else left to fill in: run as written
    (name, line.split("#")[0].strip())
    for name, block in _blocks("bash")
    for line in block.splitlines()
    if re.match(r"\.venv/bin/python -m autocompress\.(report|export) ", line)
    and RUN_PATH.search(line)
    and not re.search(r"\bID\b(?!\w)|=ID|DIR|[*<]", RUN_PATH.sub("", line.split("#")[0]))
]


def test_the_docs_have_code_to_check() -> None:
    assert len(PYTHON) >= 3 and len(COMMANDS) >= 8 and len(RUNNABLE) >= 4, (PYTHON, COMMANDS, RUNNABLE)


@pytest.mark.ray
@pytest.mark.parametrize(("name", "line"), RUNNABLE, ids=[n for n, _ in RUNNABLE])
def test_report_and_export_lines_run_as_written(
    name: str, line: str, tiny_sweep: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """README's and the docs' report / export commands, on a copy of the tiny run (its path for the example's)."""
    import shutil

    work = tmp_path / "cwd"  # the doc's relative paths, as written, from a folder that holds such a run
    example = "results/h100_batched/20261130-002001"
    run = shutil.copytree(tiny_sweep[0], work / example, ignore=shutil.ignore_patterns("report"))  # as the sweep left it
    args = shlex.split(RUN_PATH.sub(example, line))[1:]  # `-m autocompress.X ...`
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *args], cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"{name}: {line}\n{out.stderr[-3000:]}"
    made = {"report": run / "report" / "report.md", "export": work / "pruned" / "README.md"}[args[1].rsplit(".", 1)[1]]
    assert made.exists(), out.stdout


@pytest.fixture(scope="module")
def exported(tiny_sweep: tuple[Path, subprocess.CompletedProcess[str]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Row 0 of the tiny run's front, exported, with a tokenizer as a real model's export has (the tiny model has none)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    run, _ = tiny_sweep
    out = tmp_path_factory.mktemp("exported") / "pruned"
    done = run_cli("autocompress.export", str(run), "index=0", f"out={out}", "verify=false")
    assert done.returncode == 0, done.stderr[-2000:]
    words = {f"w{i}": i for i in range(256)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="w0")), unk_token="w0").save_pretrained(out)
    return out


@pytest.mark.ray
@pytest.mark.parametrize(("name", "code"), PYTHON, ids=[n for n, _ in PYTHON])
def test_every_python_block_runs(name: str, code: str, tiny_sweep: tuple[Path, subprocess.CompletedProcess[str]], exported: Path) -> None:
    run, _ = tiny_sweep
    code = RUN_PATH.sub(str(run), code).replace('"pruned/"', f'"{exported}"')
    script = "import matplotlib\nmatplotlib.use('Agg')\n" + code
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{name}:\n{code}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize(("name", "line"), COMMANDS, ids=[n for n, _ in COMMANDS])
def test_every_sweep_and_compare_line_composes(name: str, line: str) -> None:
    """The line's overrides compose and pass the checks a run applies before any work (keys renamed or values out of
    range in a doc fail here)."""
    from autocompress.baselines.comparison import job_from_dict
    from autocompress.config.build import run_spec_from_dict
    from autocompress.config.compose import compose_dict

    args = shlex.split(line)[3:]  # after `.venv/bin/python -m autocompress.X`
    command = shlex.split(line)[2].rsplit(".", 1)[1]
    overrides = [a for a in args if a not in ("--cfg", "job") and "=" in a]
    overrides = [o for o in overrides if not o.startswith(("resume=", "compare.run="))]  # folders of runs made earlier
    data = compose_dict(*overrides)
    run_spec_from_dict(data) if command == "sweep" else job_from_dict(data)


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", re.sub(r"[`*]", "", heading.strip().lower())).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M):
        slug = _slug(heading)
        out.add(f"{slug}-{found[slug]}" if slug in found else slug)
        found[slug] = found.get(slug, 0) + 1
    return out


def test_every_link_in_the_docs_resolves() -> None:
    """Every relative link in README.md and docs/ names a file that exists and, with #anchor, a heading in it: the docs
    are split by topic and sections move, so a reader must never land on nothing."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "PROVENANCE.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
    assert _slug("Where `make demo`'s time goes (issue 44)") == "where-make-demos-time-goes-issue-44"
