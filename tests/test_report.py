"""The report: typed loaders, figure data checked without drawing, and the CLI on a tiny sweep's folder."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from autocompress import io
from autocompress.arch.space import Architecture, Block
from autocompress.charts import figures
from autocompress.report import main, without_reports
from autocompress.results import store as results
from autocompress.results.pareto import COST_DIRECTIONS, pareto_frame
from autocompress.results.store import FRONT_COLUMNS, TRIAL_SCHEMA, Run, RunFolderError

from .conftest import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- the tiny sweep of conftest, once per session


@pytest.fixture(scope="module")
def tiny_run(tiny_sweep: tuple[Path, Any]) -> Path:
    run, out = tiny_sweep
    assert out.returncode == 0, out.stderr[-3000:]
    return run


# --------------------------------------------------------------------------- a hand-made run with the columns later stages add


def _arch(hidden: int, kv: list[int], ffn: list[int]) -> str:
    blocks = tuple(Block(k, f) for k, f in zip(kv, ffn, strict=True))
    return Architecture(hidden, 4, 16, 256, True, blocks).to_json()


def _row(trial_id: str, kl: float, ttft: float, feasible: bool = True, **extra: object) -> dict[str, object]:
    arch = Architecture.from_json(_arch(64, [2, 0, 1], [96, 32, 0]))
    row: dict[str, object] = {"trial_id": trial_id, "status": "ok", "error": "", **results.architecture_columns(arch)}
    row.update(
        kl_select=kl, kl=kl, perplexity=float(np.exp(kl + 3)), ttft_ms=ttft, tpot_ms=ttft / 10, throughput_tok_s=1000 / ttft, memory_gib=1.0
    )
    row.update(feasible=feasible, feasible_ttft_ms=feasible, cost_model="analytic/cpu/v1", seed=0)
    row.update(extra)
    return row


def handmade_run(path: Path) -> Run:
    """Five search trials (one infeasible), one failed trial, a Minitron baseline row, measured costs and accuracy for some."""
    rows = [
        _row("t_00000", kl=0.5, ttft=9.0, measured_ttft_ms=9.5, accuracy_mmlu=0.40),
        _row("t_00001", kl=0.3, ttft=12.0, measured_ttft_ms=11.0, accuracy_mmlu=0.45),
        _row("t_00002", kl=0.6, ttft=13.0, accuracy_mmlu=0.30),  # dominated by 00001 on KL
        _row("t_00003", kl=0.1, ttft=20.0, feasible=False),  # best KL, breaks the bound
        _row("t_00004", kl=0.9, ttft=5.0, architecture=_arch(32, [1, 1], [32, 32])),  # fewer layers
        _row("minitron", kl=0.4, ttft=10.0, baseline="minitron"),
    ]
    trials = results.trials_frame(rows)
    later = pd.DataFrame(rows).set_index("trial_id")[["measured_ttft_ms", "accuracy_mmlu", "baseline"]]
    trials = trials.join(later, on="trial_id")
    failed = results.trials_frame([{"trial_id": "t_00005", "status": "error", "error": "Traceback\nRuntimeError: boom", "feasible": False}])
    trials = pd.concat([trials, failed.assign(baseline=None)], ignore_index=True)
    trials.loc[trials["trial_id"] == "t_00004", ["hidden_size"]] = 32
    meta = {
        "status": "complete",
        "scenario": "handmade",
        "model": "tiny",
        "base_costs": {"ttft_ms": 25.0, "tpot_ms": 2.5, "throughput_tok_s": 40.0, "memory_gib": 1.2},
        "constraints": {"ttft_ms": {"sense": "max", "value": 15.0}},
        "base_params": 200_000,
        "base_perplexity": 20.0,
    }
    return Run(path=path, trials=trials, pareto=pareto_frame(trials), metadata=meta, spec=None)


# --------------------------------------------------------------------------- loaders


def test_load_run_is_typed_and_layers_match_summary_columns(tiny_run: Path) -> None:
    run = results.load_run(tiny_run)
    assert run.label == "cpu_interactive/r1" and run.spec is not None and run.spec.scenario.name == "cpu_interactive"
    assert set(run.constraints) == {"ttft_ms", "tpot_ms"} and run.constraints["ttft_ms"].sense == "max"
    for col, (dtype, _) in TRIAL_SCHEMA.items():
        assert str(run.trials[col].dtype) == dtype, col
    assert all(run.pareto[c].dtype == bool for c in FRONT_COLUMNS)
    trials, pareto = results.load(tiny_run)
    pd.testing.assert_frame_equal(trials, run.trials)
    pd.testing.assert_frame_equal(pareto, run.pareto)
    per_layer = results.layers(run.trials)
    assert len(per_layer) == 4 * len(run.trials)  # tiny_llama has 4 layers
    kept = per_layer.groupby("trial_id")[["attention_kept", "ffn_kept"]].sum()
    expected = run.trials.set_index("trial_id")[["num_attention_kept", "num_ffn_kept"]].loc[kept.index]
    assert (kept["attention_kept"] == expected["num_attention_kept"]).all() and (kept["ffn_kept"] == expected["num_ffn_kept"]).all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "metadata.json does not exist"),
        (lambda p: (p / "metadata.json").write_text('{"status": "running"}'), "not finished"),
        (lambda p: (p / "metadata.json").write_text('{"status": "failed", "error": "InfeasibleError: x"}'), "InfeasibleError"),
        (lambda p: (p / "metadata.json").write_text('{"status": "complete", "constraints": {}}'), "trials.parquet does not exist"),
    ],
)
def test_unfinished_folders_are_refused_by_name(tmp_path: Path, make: object, message: str) -> None:
    make(tmp_path)  # type: ignore[operator]
    with pytest.raises(RunFolderError, match=message):
        results.load_run(tmp_path)


# --------------------------------------------------------------------------- figure data


def test_pareto_info_agrees_with_pareto_parquet(tiny_run: Path) -> None:
    run = results.load_run(tiny_run)
    for cost in COST_DIRECTIONS:
        info = figures.pareto_info(run, "kl_select", cost)  # pareto.parquet's fronts are on the selection split
        on_front = set(info.points.loc[info.points["on_front"], "trial_id"])
        assert on_front == set(run.pareto.loc[run.pareto[f"front_{cost}"], "trial_id"])
        assert info.base == (run.base_costs[cost], 0.0)
        assert (info.constraint is not None) == (cost in ("ttft_ms", "tpot_ms"))
        assert info.measured.empty and info.baselines.empty  # a plain sweep has neither


def test_pareto_info_greys_infeasible_and_draws_later_columns(tmp_path: Path) -> None:
    run = handmade_run(tmp_path)
    info = figures.pareto_info(run, "kl", "ttft_ms")
    pts = info.points.set_index("trial_id")
    assert "minitron" not in pts.index and "t_00005" not in pts.index  # baseline and failed trial are not search points
    assert not pts.loc["t_00003", "feasible"] and not pts.loc["t_00003", "on_front"]
    assert list(info.front["trial_id"]) == ["t_00004", "t_00000", "t_00001"]  # sorted by cost; 00002 is dominated
    assert list(info.front["point"]) == ["4", "0", "1"]
    assert info.measured[["trial_id", "predicted", "cost"]].values.tolist() == [["t_00000", 9.0, 9.5], ["t_00001", 12.0, 11.0]]
    assert info.baselines.values.tolist() == [["minitron", 10.0, 0.4]]
    assert info.constraint is not None and info.constraint.value == 15.0 and info.base == (25.0, 0.0)
    ppl = figures.pareto_info(run, "perplexity", "tpot_ms")
    assert ppl.base == (2.5, 20.0) and ppl.measured.empty  # no measured_tpot_ms column
    assert figures.quality_metrics(run.trials) == ["kl", "perplexity", "accuracy_mmlu"]
    acc = figures.pareto_info(run, "accuracy_mmlu", "ttft_ms")  # higher is better; only evaluated trials
    assert not acc.lower_quality_is_better and acc.base == (25.0, None)
    assert set(acc.points["trial_id"]) == {"t_00000", "t_00001", "t_00002"}
    assert set(acc.front["trial_id"]) == {"t_00000", "t_00001"}


def test_coinciding_front_points_share_one_label() -> None:
    trials = results.trials_frame([_row("a_00001", 0.2, 5.0), _row("a_00002", 0.2, 5.0)])
    run = Run(Path("."), trials, pareto_frame(trials), {"base_costs": {}}, None)
    info = figures.pareto_info(run, "kl", "ttft_ms")
    assert info.front_labels["label"].tolist() == ["1, 2"]


def test_architecture_data_pads_shorter_models(tmp_path: Path) -> None:
    run = handmade_run(tmp_path)
    info = figures.run_architectures(run)
    # the joint front without the baseline row, best KL first; trial 4 has two layers, the others three
    assert [lab.split(":")[0] for lab in info.labels] == ["1", "0", "4"] and info.labels[0].startswith("1: KL 0.3")
    assert info.kv_heads.shape == (3, 3) and info.hidden == [64, 64, 32]
    np.testing.assert_array_equal(info.kv_heads[2], [1, 1, np.nan])
    np.testing.assert_array_equal(info.kv_heads[0], [2, 0, 1])
    np.testing.assert_array_equal(info.ffn[0], [96, 32, 0])
    assert info.max_kv_heads == 2 and info.max_ffn == 96
    side = figures.compare_architectures([run, run])
    assert len(side.labels) == 2 and side.labels[0].startswith("handmade/") and "KL 0.3" in side.labels[0]


def test_chosen_points_spread_over_a_long_front(tmp_path: Path) -> None:
    run = handmade_run(tmp_path)
    assert list(figures.chosen_points(run, limit=2)["trial_id"]) == ["t_00001", "t_00004"]  # ends of the front


def test_tables(tmp_path: Path) -> None:
    run = handmade_run(tmp_path)
    table = figures.pareto_table(run)
    assert list(table["trial_id"]) == ["t_00001", "t_00000", "t_00004"]
    assert {"point", "kl", "perplexity", "accuracy_mmlu", "measured_ttft_ms", *COST_DIRECTIONS} <= set(table.columns)
    for _, row in table.iterrows():  # `index` is the pareto.parquet row that export's index= takes
        assert run.pareto.iloc[int(row["index"])]["trial_id"] == row["trial_id"]
    same = table.set_index("trial_id")["same_as"]  # t_00000 found t_00001's shape (the default _row architecture)
    assert same["t_00000"] == table.set_index("trial_id").loc["t_00001", "point"] and same["t_00001"] == same["t_00004"] == ""
    summary = figures.summary_table([run])
    assert summary.loc[0, ["trials", "finished", "feasible"]].tolist() == [6, 5, 4]
    assert summary.loc[0, "best_kl"] == 0.3 and summary.loc[0, "ttft_ms_share"] == pytest.approx(12.0 / 25.0)


def test_a_run_without_feasible_trials_has_empty_fronts(tmp_path: Path) -> None:
    run = handmade_run(tmp_path)
    trials = run.trials.assign(feasible=False)
    run = Run(tmp_path, trials, pareto_frame(trials), run.metadata, None)
    assert run.pareto.empty and not figures.pareto_info(run, "kl", "ttft_ms").points["on_front"].any()
    assert figures.pareto_table(run).empty and figures.run_architectures(run).labels == []
    assert figures.compare_architectures([run]).labels == [] and np.isnan(figures.summary_table([run]).loc[0, "best_kl"])


# --------------------------------------------------------------------------- files


def test_report_cli_on_a_sweep_folder(tiny_run: Path, tmp_path: Path) -> None:
    out = run_cli("autocompress.report", str(tiny_run), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = tiny_run / "report"
    assert f"report: {folder / 'report.md'}" in out.stdout
    run = results.load_run(tiny_run)
    assert all(t in out.stdout for t in run.pareto["trial_id"])  # the key table
    pngs = sorted(folder.glob("*.png"))
    assert [p.name for p in pngs] == ["architectures.png", "pareto_kl.png", "pareto_perplexity.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in pngs)
    text = (folder / "report.md").read_text()
    assert all(f"]({p.name})" in text for p in pngs) and "## cpu_interactive/r1" in text
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary files left


def save_run(run: Run) -> Path:
    """Write a run's files as a sweep would (no config.yaml: an older run whose spec no longer parses)."""
    run.path.mkdir(parents=True)
    io.write_parquet(run.trials, run.path / "trials.parquet")
    io.write_parquet(run.pareto, run.path / "pareto.parquet")
    io.write_json(run.metadata, run.path / "metadata.json")
    return run.path


def test_report_of_several_scenarios_compares_them(tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handmade = save_run(handmade_run(tmp_path / "handmade" / "h1"))
    tiny = tmp_path / "cpu_interactive" / "r1"
    shutil.copytree(tiny_run, tiny, ignore=shutil.ignore_patterns("report", "tune"))
    assert main([str(handmade), str(tiny)]) == 0
    assert "summary" in capsys.readouterr().out
    folder = tmp_path.resolve() / "report"  # beside the scenario folders
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "compare_architectures.png",
        "cpu_interactive_r1_architectures.png",
        "cpu_interactive_r1_pareto_kl.png",
        "cpu_interactive_r1_pareto_perplexity.png",
        "handmade_h1_architectures.png",
        "handmade_h1_pareto_accuracy_mmlu.png",
        "handmade_h1_pareto_kl.png",
        "handmade_h1_pareto_perplexity.png",
        "report.html",
        "report.md",
    ]
    text = (folder / "report.md").read_text()
    page = (folder / "report.html").read_text()  # the same report in a browser: every table and every figure
    tables = sum(line.startswith("|---") for line in text.splitlines())
    assert page.count("<table>") == tables > 0 and page.count("<img ") == text.count("![") == len(names) - 2
    assert all(f'src="{name}"' in page for name in names if name.endswith(".png"))
    assert "failed (last line of the first error: `RuntimeError: boom`)" in text and "TTFT ≤ 15 ms (0.60x base)" in text
    assert text.index("## Summary") < text.index("## handmade/h1") < text.index("## cpu_interactive/r1")


def test_bad_folder_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "metadata.json").write_text(json.dumps({"status": "running"}))
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not finished" in err and "rerun" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "metadata.json"]


def test_an_earlier_report_is_refused_unless_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = save_run(handmade_run(tmp_path / "handmade" / "h1"))
    assert main([str(run)]) == 0
    folder = run / "report"
    (folder / "stale.png").write_bytes(PNG_MAGIC)  # a figure of an earlier report that the new one does not draw
    capsys.readouterr()
    assert main([str(run)]) == 2
    assert "already exists; choose another --out, or add --overwrite to replace it" in capsys.readouterr().err
    assert (folder / "stale.png").exists()  # refused: nothing touched
    assert main([str(run), "--overwrite"]) == 0
    assert (folder / "report.md").exists() and not (folder / "stale.png").exists()  # replaced whole
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main([str(run), "--out", str(mine), "--overwrite"]) == 2
    assert "is not a report (no report.md); --overwrite replaces only those" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert not [p for p in (*run.iterdir(), *tmp_path.iterdir()) if p.name.startswith(".")]  # no staging folders left


def test_earlier_report_folders_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, report = tmp_path / "r1", tmp_path / "report"
    run.mkdir(), report.mkdir()
    (report / "report.md").write_text("# AutoCompress report\n")
    assert without_reports([run, report]) == [run]
    assert "skipping report folders" in capsys.readouterr().err
    with pytest.raises(RunFolderError, match="only report folders"):
        without_reports([report])


def test_best_point_is_picked_on_the_selection_split() -> None:
    trials = pd.DataFrame(
        {"trial_id": ["a", "b", "c"], "status": "ok", "feasible": [True, True, False], "kl_select": [0.2, 0.3, 0.1], "kl": [0.25, 0.2, 0.0]}
    )
    best = figures.best_point(types.SimpleNamespace(trials=trials))  # type: ignore[arg-type]
    assert best is not None and best["trial_id"] == "a"  # b has the lower report KL, but trials are never picked on it
    old = figures.best_point(types.SimpleNamespace(trials=trials.drop(columns="kl_select")))  # type: ignore[arg-type]
    assert old is not None and old["trial_id"] == "b"  # runs recorded before kl_select: kl


@pytest.mark.parametrize("name", ["trials.parquet", "pareto.parquet"])
def test_truncated_parquet_is_one_clear_line(tiny_run: Path, tmp_path: Path, name: str) -> None:
    """A cut-off Parquet file: load_run, report, export and verify name the file and the fix (no pyarrow traceback)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    data = (run / name).read_bytes()
    (run / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(RunFolderError, match=rf"{name} cannot be read .*resume="):
        results.load_run(run)
    if name == "pareto.parquet":
        return  # the commands read both files the same way (results.read_table): one file is enough for them
    clis = [("report", [str(run)]), ("export", [str(run / name), "index=0", f"out={tmp_path / 'o'}"]), ("verify", [str(run / name)])]
    for module, args in ((f"autocompress.{m}", a) for m, a in clis):
        out = run_cli(module, *args, timeout=120)
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1 and f"{name} cannot be read" in errors[0], out.stderr[-2000:]
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "o").exists()


def test_the_cost_model_is_named_in_one_line_without_a_local_path() -> None:
    from autocompress.report import cost_model_name

    fitted = {"id": "fitted/cpu/v1", "file": "/home/me/results/cost_models/cpu__vllm-cpu.json", "parameters": {"a": 1.0}}
    assert cost_model_name(fitted) == "fitted/cpu/v1, fitted: cpu__vllm-cpu.json"
    assert cost_model_name({"id": "analytic/h100_sxm/v1"}) == "analytic/h100_sxm/v1" and cost_model_name("x") == "x"


def test_perplexity_goes_on_a_log_axis_when_the_base_model_sits_far_below() -> None:
    from autocompress.charts.figures import ParetoInfo
    from autocompress.charts.plots import log_quality_axis

    points = pd.DataFrame({"quality": [900.0, 1750.0]})
    empty = pd.DataFrame()

    def info(quality: str, base: float | None) -> ParetoInfo:
        return ParetoInfo(quality, "ttft_ms", points, empty, empty, empty, empty, None, (1.0, base), None, True, True)

    assert log_quality_axis(info("perplexity", 11.6))  # the trials alone span 2x; the base's 11.6 makes it 150x
    assert not log_quality_axis(info("perplexity", None)) and not log_quality_axis(info("kl", 11.6))
