"""benchmarks/headline.py: the frozen protocol file is checked, and a compare output becomes the headline's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest

from autocompress.baselines.comparison import job_from_dict
from autocompress.config.compose import compose_dict

from .conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def headline() -> ModuleType:
    return load_benchmark("headline")


def test_the_shipped_protocol_composes_for_every_scenario() -> None:
    """Every scenario of benchmarks/headline.yaml takes its overrides: the methods, three seeds, the test split, and no
    benchmark item of the subsets scored while defaults were chosen."""
    from autocompress.quality.tasks import subset

    hl = headline()
    proto = hl.protocol(hl.PROTOCOL)
    for scenario in proto["scenarios"]:
        job = job_from_dict(compose_dict(f"+scenario={scenario}", *proto["overrides"], *proto["compare"]))
        assert job.compare.methods == ("autocompress", "minitron", "minitron_default", "puzzletron")
        assert len(job.compare.seeds) >= 3 and job.compare.test_split and job.compare.runner_up and job.spec.data.source == "jsonl"
        assert not set(job.evaluate.names) & set(proto["apart"])
        trials = job.spec.sweep.num_trials  # equal budgets: every tuned method picks among as many scored candidates
        assert job.compare.settings_of("minitron").budget == job.compare.settings_of("puzzletron").choices == trials == 8
    seen = set(subset(1172, 500, 0, "arc_challenge"))
    assert not seen & set(subset(1172, 300, 1, "arc_challenge", ((50, 0), (200, 0), (500, 0))))


def test_a_protocol_that_reports_a_task_twice_is_refused(tmp_path: Path) -> None:
    hl = headline()
    bad = tmp_path / "p.yaml"
    bad.write_text("scenarios: [rtx5070_coding]\ncompare: ['evaluate.tasks=[piqa,openbookqa]']\napart: {openbookqa: seen}\n")
    with pytest.raises(SystemExit, match=r"openbookqa is both in evaluate\.tasks and reported apart"):
        hl.protocol(bad)
    bad.write_text("overrides: []\n")
    with pytest.raises(SystemExit, match="names no scenarios"):
        hl.protocol(bad)


def test_a_compare_output_becomes_the_headline_record(tmp_path: Path) -> None:
    hl = headline()
    rows = [
        {"model": "base", "label": "unpruned", "params": 100, "average": 50.0, "kl_pruned": 0.0, "test_kl": 0.0, "test_ppl": 10.0},
        {"model": "autocompress", "label": "t1", "params": 60, "average": 45.0, "kl_pruned": 1.2, "test_kl": 0.4, "test_ppl": 14.0},
        {"model": "minitron", "label": "M", "params": 58, "average": 43.0, "kl_pruned": 1.9, "test_kl": 0.5, "test_ppl": 15.0},
        {"model": "minitron/runner_up", "label": "M2", "params": 57, "average": 44.0, "kl_pruned": 2.0, "test_kl": 0.6, "test_ppl": 16.0},
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "compare.parquet")
    summary = {
        "methods": ["autocompress", "minitron"],
        "seeds": [0, 1, 2],
        "evaluate": {"limit": 300, "exclude": ["500:0"]},
        "diff_vs": {"minitron": {"mean": 2.0, "low": 0.5, "high": 3.5}},
        "seconds": {"minitron/pruned": 12.0, "autocompress/probe": "reused", "minitron/eval-seed0": 5.0},
    }
    (tmp_path / "compare.json").write_text(json.dumps(summary))
    proto = {"scenarios": ["rtx5070_coding"], "overrides": [], "compare": [], "apart": {"openbookqa": "seen"}}
    missing = tmp_path / "absent"
    rec = hl.record("rtx5070_coding", tmp_path, proto, "abc123", {"compare": 60.0}, missing / "x.log", missing)
    assert rec["code"] == "abc123" and rec["seeds"] == [0, 1, 2] and rec["items"]["apart"] == {"openbookqa": "seen"}
    mt = rec["methods"]["minitron"]
    assert (mt["params"], mt["average"], mt["test_kl"], mt["test_ppl"]) == (58, 43.0, 0.5, 15.0)
    assert mt["budget"]["pick_seconds"] == {"minitron/pruned": 12.0}  # the pick, not its distillation or evaluation
    assert rec["methods"]["autocompress"]["budget"]["pick_seconds"] == {"autocompress/probe": "reused"}
    assert rec["methods"]["autocompress"]["budget"]["sweep_seconds"] == "reused"
    # A stage an earlier run built keeps the seconds that run's log line gives; the sweep's come from its run folder.
    log, run_dir = tmp_path / "rtx5070_coding.log", tmp_path / "headline"
    log.write_text(
        "[autocompress] autocompress/probe: 1194s -> /x/probe.json\nstep 3/8\r[autocompress] minitron/pruned: 99s -> /x/m\n"
        "[autocompress] autocompress/probe: reusing /x/probe.json\n"
    )
    run_dir.mkdir()
    (run_dir / "metadata.json").write_text(json.dumps({"status": "complete", "sweep_wall_s": 3762.2}))
    rec = hl.record("rtx5070_coding", tmp_path, proto, "abc123", {}, log, run_dir)
    assert rec["methods"]["autocompress"]["budget"] == {"pick_seconds": {"autocompress/probe": 1194.0}, "sweep_seconds": 3762.2}
    assert rec["methods"]["minitron"]["budget"]["pick_seconds"] == {"minitron/pruned": 12.0}  # this run's own seconds stay
    assert rec["diff"]["minitron"] == {"mean": 2.0, "low": 0.5, "high": 3.5}
    assert mt["runner_up"]["average"] == 44.0 and mt["runner_up"]["label"] == "M2" and rec["methods"]["autocompress"]["runner_up"] is None


def test_rerecord_keeps_the_run_and_fills_what_the_log_knows(tmp_path: Path) -> None:
    """`--rerecord` writes a JSON again from its comparison with the current record, keeping its commit, protocol,
    seconds, CPU and date; it refuses a scenario without a JSON or a finished comparison."""
    hl = headline()
    results, out = tmp_path / "runs", tmp_path / "out"
    compare_dir = results / "rtx5070_coding" / "compare"
    compare_dir.mkdir(parents=True)
    out.mkdir()
    rows = [{"model": m, "label": m, "params": 9, "average": 1.0, "kl_pruned": 0.0} for m in ("base", "autocompress")]
    pd.DataFrame(rows).to_parquet(compare_dir / "compare.parquet")
    summary = {"methods": ["autocompress"], "seeds": [0], "evaluate": {}, "diff_vs": {}, "seconds": {"autocompress/probe": "reused"}}
    (compare_dir / "compare.json").write_text(json.dumps(summary))
    (results / "rtx5070_coding.log").write_text("[autocompress] autocompress/probe: 70s -> /x\n")
    proto = {"scenarios": ["rtx5070_coding"], "overrides": ["a=1"], "compare": [], "apart": {}}
    first = {"code": "1021c2e", "protocol": proto, "seconds": {"compare": 5.0}, "cpu": {"model": "then"}, "date": "2026-12-06"}
    with pytest.raises(SystemExit, match=r"needs .*rtx5070_coding\.json and a finished"):
        hl.rerecord(["rtx5070_coding"], results, out)
    (out / "rtx5070_coding.json").write_text(json.dumps(first))
    hl.rerecord(["rtx5070_coding"], results, out)
    rec = json.loads((out / "rtx5070_coding.json").read_text())
    assert {k: rec[k] for k in first} == first
    assert rec["methods"]["autocompress"]["budget"]["pick_seconds"] == {"autocompress/probe": 70.0}


def test_the_results_page_table_comes_from_the_headline_jsons(tmp_path: Path) -> None:
    """`headline.py --table` writes docs/results.md's table from the JSONs alone, each row linked to its file, and keeps
    the rest of the page; JSONs of two commits are refused (the headline is one commit's)."""
    hl = headline()
    folder, page = tmp_path / "benchmarks" / "results" / "headline", tmp_path / "docs" / "results.md"
    folder.mkdir(parents=True)
    page.parent.mkdir()
    method = {"params": 97_600_000, "average": 33.1, "test_kl": 0.912, "test_ppl": 21.4, "runner_up": {"average": 32.8}}
    for scenario, code in (("rtx5070_coding", "abc1234"), ("h100_batched", "abc1234")):
        rec = {
            "scenario": scenario,
            "code": code,
            "cpu": {"model": "AMD EPYC", "simd": "avx2", "cores": "2"},
            **(
                {"carried": [{"cpu": {"model": "Intel Xeon", "simd": "avx512f", "cores": "2"}}] * 2} if scenario == "rtx5070_coding" else {}
            ),
            "base": {"params": 134_515_008, "average": 40.2, "test_ppl": 11.6},
            "methods": {"autocompress": method, "minitron": method | {"average": 31.0, "runner_up": None}},
            "diff": {"minitron": {"mean": 2.1, "low": 0.4, "high": 3.9}},
        }
        (folder / f"{scenario}.json").write_text(json.dumps(rec))
    page.write_text(f"# Results\n\nintro\n\n{hl.TABLE_START}\nold\n{hl.TABLE_END}\n\nafter\n")
    hl.fill_page(page, folder)
    text = page.read_text()
    assert text.startswith("# Results\n\nintro\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| rtx5070_coding")]
    assert rows == [
        "| rtx5070_coding | unpruned | 134.5 M | 40.20 | 0 | 11.60 | | | [json](../benchmarks/results/headline/rtx5070_coding.json) |",
        "| rtx5070_coding | AutoCompress | 97.6 M | 33.10 | 0.912 | 21.40 | 32.80 |  | "
        "[json](../benchmarks/results/headline/rtx5070_coding.json) |",
        "| rtx5070_coding | Minitron (tuned) | 97.6 M | 31.00 | 0.912 | 21.40 | - | +2.10 [+0.40, +3.90] | "
        "[json](../benchmarks/results/headline/rtx5070_coding.json) |",
    ]
    # every scenario names the machines its sessions ran on (carried ones first), each once
    machines = "h100_batched on AMD EPYC (avx2, 2 cores); rtx5070_coding on Intel Xeon (avx512f, 2 cores) then AMD EPYC (avx2, 2 cores)"
    assert f"Code abc1234; {machines}. " in text
    assert "Code abc1234" in text and text.index("| h100_batched") < text.index("| rtx5070_coding")
    (folder / "h100_batched.json").write_text(json.dumps(json.loads((folder / "h100_batched.json").read_text()) | {"code": "def5678"}))
    with pytest.raises(SystemExit, match="several commits"):
        hl.fill_page(page, folder)


def test_a_scenario_is_carried_to_a_fresh_machine_without_its_checkpoints(tmp_path: Path) -> None:
    """--carry-out keeps the small files (a finished sweep, the comparison's records, the stage lines of the log) and
    leaves the checkpoints; --carry-in puts them back on a fresh results dir at the same commit, and nowhere else."""
    hl = headline()
    results, carry = tmp_path / "out", tmp_path / "carry"
    run, cmp = results / "s" / hl.RUN_ID, results / "s" / "compare"
    (run / "tune").mkdir(parents=True)
    (run / "metadata.json").write_text(json.dumps({"status": "complete", "sweep_wall_s": 9.0}))
    (run / "tune" / "result.json").write_text("{}")
    for folder in ("minitron/pruned", "minitron/runner_up/pruned", "minitron/distilled-seed0", "minitron/eval-seed0", ".probe/0"):
        (cmp / folder).mkdir(parents=True)
        (cmp / folder / "items.parquet").write_bytes(b"w" * 10)
    (cmp / "minitron" / "minitron.json").write_text("{}")
    (cmp / "stages.json").write_text("{}")
    (results / "evaluate" / "base-x").mkdir(parents=True)
    (results / "evaluate" / "base-x" / "eval.json").write_text("{}")
    (results / "s.log").write_text("noise\r[autocompress] minitron/pruned: 120s -> /x\nbar 50%\r[autocompress] other\n")
    hl.carry_out(["s"], results, carry, "c1")
    kept = sorted(str(p.relative_to(carry / "s")) for p in (carry / "s").rglob("*") if p.is_file())
    assert kept == [
        "carry.json",
        "compare/minitron/eval-seed0/items.parquet",
        "compare/minitron/minitron.json",
        "compare/stages.json",
        "evaluate/base-x/eval.json",
        "headline/metadata.json",
        "headline/tune/result.json",
        "s.log",
    ]
    assert (carry / "s" / "s.log").read_text() == "[autocompress] minitron/pruned: 120s -> /x\n[autocompress] other\n"
    manifest = json.loads((carry / "s" / "carry.json").read_text())
    assert manifest["code"] == "c1" and manifest["sessions"][0]["carried"] == ["compare", "evaluate", "headline"]
    with pytest.raises(SystemExit, match="carries work of commit c1, not c2"):
        hl.carry_out(["s"], results, carry, "c2")
    with pytest.raises(SystemExit, match=r"holds work of its own; --carry-in only fills a fresh results dir"):
        (tmp_path / "busy" / "s").mkdir(parents=True)
        hl.carry_in(["s"], tmp_path / "busy", carry, "c1")
    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit, match="carries work of commit c1, not this tree's c2"):
        hl.carry_in(["s"], fresh, carry, "c2")
    hl.carry_in(["s", "not-carried"], fresh, carry, "c1")
    hl.carry_in(["s"], fresh, carry, "c1")  # the same command again (a rerun after a failure): carried in already, kept
    assert (fresh / "s" / "compare" / "minitron" / "minitron.json").exists() and not (
        fresh / "s" / "compare" / "minitron" / "pruned"
    ).exists()
    assert hl.sweep_state(fresh / "s" / hl.RUN_ID) == "complete" and (fresh / "evaluate" / "base-x" / "eval.json").exists()
    assert hl.built_seconds(fresh / "s.log") == {"minitron/pruned": 120.0}
    hl.carry_out(["s"], fresh, carry, "c1")  # the next machine's session is added, the first one kept
    assert len(json.loads((carry / "s" / "carry.json").read_text())["sessions"]) == 2
    with pytest.raises(SystemExit, match="was not carried in from; run with --carry-in"):
        hl.carry_out(["s"], results, carry, "c1")  # the first machine's older work would replace the second's
    assert len(json.loads((carry / "s" / "carry.json").read_text())["sessions"]) == 2
    (run / "metadata.json").write_text(json.dumps({"status": "interrupted"}))
    hl.carry_out(["s"], results, tmp_path / "c3", "c1")  # an unfinished sweep is not carried: it starts again
    assert not (tmp_path / "c3" / "s" / hl.RUN_ID).exists() and (tmp_path / "c3" / "s" / "compare" / "stages.json").exists()
    hl.carry_in(["s"], tmp_path / "fresh3", tmp_path / "c3", "c1")
    assert (tmp_path / "fresh3" / "s" / "carry.json").exists() and hl.sweep_state(tmp_path / "fresh3" / "s" / hl.RUN_ID) == "missing"
    (cmp / "minitron" / "big.parquet").write_bytes(b"x" * (hl.CARRY_MAX + 1))
    with pytest.raises(SystemExit, match=r"big\.parquet is 32 MiB, over a carry's 32 MiB per file; nothing was carried"):
        hl.carry_out(["s"], results, tmp_path / "c4", "c1")
    assert not (tmp_path / "c4" / "s").exists()
