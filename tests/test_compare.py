"""AutoCompress vs Minitron: the paired bootstrap, the trial it picks, and the whole pipeline on the tiny model (no Ray)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from autocompress.baselines.comparison import job_from_dict, known_methods, paired_bootstrap
from autocompress.baselines.context import pick_trial, top_trials
from autocompress.compare import run_compare
from autocompress.config.build import run_spec_from_dict
from autocompress.config.schema import LagrangianSettings
from autocompress.errors import ConfigError
from autocompress.io import write_json, write_parquet
from autocompress.results.pareto import pareto_frame
from autocompress.results.store import trials_frame
from autocompress.search.differentiable import run_search
from autocompress.search.prepare import prepare
from autocompress.search.tune import trial_row

from .conftest import SHARED_DATA, TINY_CPU, compose_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads


def items(correct: list[float], task: str = "piqa") -> pd.DataFrame:
    return pd.DataFrame({"task": task, "index": range(len(correct)), "correct": correct})


def test_paired_bootstrap() -> None:
    right, wrong = items([1.0] * 20), items([0.0] * 20)
    diff = paired_bootstrap(right, wrong, n=200).set_index("task")
    assert diff.loc["piqa", ["diff", "lo", "hi"]].tolist() == [100.0, 100.0, 100.0]
    rng = np.random.default_rng(0)
    a = pd.concat([items(list(rng.integers(0, 2, 300).astype(float))), items(list(rng.integers(0, 2, 300).astype(float)), "sciq")])
    b = pd.concat([items(list(rng.integers(0, 2, 300).astype(float))), items(list(rng.integers(0, 2, 300).astype(float)), "sciq")])
    out = paired_bootstrap(a, b, n=500).set_index("task")
    assert list(out.index) == ["piqa", "sciq", "average"]
    assert out.loc["average", "diff"] == pytest.approx((out.loc["piqa", "diff"] + out.loc["sciq", "diff"]) / 2)
    assert all(out["lo"] <= out["diff"]) and all(out["diff"] <= out["hi"]) and out.loc["average", "hi"] - out.loc["average", "lo"] > 1
    same = paired_bootstrap(a, a, n=200)
    assert (same[["diff", "lo", "hi"]] == 0).all().all()  # pairing: identical models never differ


def test_bootstrap_interval_covers_distillation_seeds() -> None:
    """Two seeds of a that disagree item by item widen the interval; the point is the mean over seeds."""
    rng = np.random.default_rng(1)
    b = items([0.5] * 200)
    seed0, seed1 = items(list(rng.integers(0, 2, 200).astype(float))), items(list(rng.integers(0, 2, 200).astype(float)))
    both = paired_bootstrap([seed0, seed1], [b], n=1000).set_index("task")
    one = paired_bootstrap(seed0, b, n=1000).set_index("task")
    want = 100 * (seed0["correct"].mean() + seed1["correct"].mean()) / 2 - 50
    assert both.loc["piqa", "diff"] == pytest.approx(want)
    constant = paired_bootstrap([items([1.0] * 50), items([0.0] * 50)], [items([0.0] * 50)], n=400).set_index("task")
    assert constant.loc["piqa", "lo"] == 0.0 and constant.loc["piqa", "hi"] == 100.0  # items agree; only the seed varies
    assert one.loc["piqa", "hi"] - one.loc["piqa", "lo"] < 100


def test_pick_trial(tmp_path: Path) -> None:
    trials = pd.DataFrame(
        {
            "trial_id": ["a", "b", "c", "d"],
            "status": ["ok", "ok", "ok", "error"],
            "feasible": [True, True, False, False],
            "kl": [0.3, 0.2, 0.1, 0.0],
        }
    )
    assert pick_trial(trials, None, tmp_path)["trial_id"] == "b"  # c has a lower KL but misses a constraint
    trials["kl_select"] = [0.1, 0.4, 0.0, 0.0]  # the selection split picks; the report split only reports
    assert pick_trial(trials, None, tmp_path)["trial_id"] == "a"
    trials = trials.drop(columns="kl_select")
    assert pick_trial(trials, "a", tmp_path)["trial_id"] == "a"
    with pytest.raises(ConfigError, match="misses a constraint"):
        pick_trial(trials, "c", tmp_path)
    with pytest.raises(ConfigError, match="no feasible trial"):
        pick_trial(trials[~trials["feasible"]], None, tmp_path)


def test_top_trials_one_per_architecture() -> None:
    trials = pd.DataFrame(
        {
            "trial_id": ["a", "b", "c", "d", "e"],
            "status": ["ok", "ok", "ok", "ok", "error"],
            "feasible": [True, True, True, False, False],
            "architecture": ["x", "x", "y", "z", "w"],
            "kl_select": [0.3, 0.2, 0.4, 0.0, 0.0],
        }
    )
    assert list(top_trials(trials, 3)["trial_id"]) == ["b", "c"]  # a repeats b's shape; d misses a constraint; e failed
    assert list(top_trials(trials, 1)["trial_id"]) == ["b"]


def test_probe_settings_are_checked() -> None:
    job = job_from_dict(compose_dict("+scenario=rtx5070_coding"))
    probe = job.compare.probe  # the default: resolved by the run's family once compare has read the run
    assert probe.candidates is None and not probe.on
    assert probe.resolved(hybrid=False).candidates == 3 and probe.resolved(hybrid=False).on  # Llama family: the top 3
    assert not probe.resolved(hybrid=True).on  # hybrid-MoE: off (the probe picks among Llama-family candidates only)
    off = job_from_dict(compose_dict("+scenario=rtx5070_coding", "compare.probe.candidates=0")).compare.probe
    assert off.resolved(hybrid=False).candidates == 0  # an explicit setting is kept
    for bad in ("compare.probe.candidates=1", "compare.probe.candidates=-2", "compare.probe.tokens=0"):
        with pytest.raises(ConfigError, match=r"compare\.probe\."):
            job_from_dict(compose_dict("+scenario=rtx5070_coding", bad))


def test_shipped_config_composes() -> None:
    job = job_from_dict(compose_dict("+scenario=rtx5070_coding"))
    assert job.compare.minitron.top_k == 10 and job.distill.steps > 0 and len(job.evaluate.tasks) == 8
    assert job.compare.puzzletron.objective == "cosine" and job.compare.methods is None
    assert job.compare.resolved_methods(hybrid=False) == ("autocompress", "minitron", "puzzletron")
    assert job.compare.resolved_methods(hybrid=True) == ("autocompress", "minitron")  # puzzletron prunes Llama-family models
    for bad, match in (
        ("[minitron,autocompress]", "start with autocompress"),
        ("[autocompress,magic]", "known methods"),
        ("[autocompress]", "start with autocompress"),
    ):
        with pytest.raises(ConfigError, match=match):
            job_from_dict(compose_dict("+scenario=rtx5070_coding", f"compare.methods={bad}"))
    named = job_from_dict(compose_dict("+scenario=rtx5070_coding", "compare.methods=[autocompress,puzzletron]"))
    with pytest.raises(ConfigError, match=r"puzzletron prune\(s\) Llama-family models only"):
        named.compare.resolved_methods(hybrid=True)
    with pytest.raises(ConfigError, match=r"compare\.measure"):
        job_from_dict(compose_dict("+scenario=rtx5070_coding", "compare.measure=maybe"))


def fake_run(results: Path, overrides: list[str]) -> Path:
    """A finished two-trial sweep run of the tiny model, written as the sweep writes it (without Ray)."""
    cfg = compose_dict(*overrides)
    spec = run_spec_from_dict(cfg)
    prepared = prepare(spec, progress=False)
    run = results / spec.scenario.name / "fake"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    prepared.inputs.ranking.save(run / "ranking.safetensors")
    rows = []
    for seed in (0, 1):
        settings = LagrangianSettings(seed=seed)
        result = run_search(prepared.base.model, prepared.inputs, prepared.cost_model, spec.search, settings)
        rows.append({**trial_row(settings, result, prepared.inputs.constraints, prepared.cost_model), "trial_id": f"t{seed}"})
    trials = trials_frame(rows)
    write_parquet(trials, run / "trials.parquet")
    write_parquet(pareto_frame(trials), run / "pareto.parquet")
    constraints = {c.metric: {"sense": c.sense, "value": c.value} for c in prepared.inputs.constraints}
    write_json(
        {"status": "complete", "scenario": spec.scenario.name, "constraints": constraints, "base_costs": prepared.base_costs},
        run / "metadata.json",
    )
    return run


@pytest.mark.skipif(not (SHARED_DATA / "benchmarks").is_dir(), reason=f"evaluation data not found at {SHARED_DATA}")
def test_compare_runs_every_stage_and_reuses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autocompress import cluster as raycluster
    from autocompress.cost import engine

    def fake_engine(archs: list[Any], *args: Any) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
        for arch in archs:  # the engine is measured elsewhere (tests/test_profile.py); here only how its rows land
            yield arch, [{"status": "ok", "ttft_ms": 1.0, "tpot_ms": arch.num_params() / 1e5, "throughput_tok_s": 5.0, "peak_gib": 2.0}]

    monkeypatch.setattr(engine, "measure_many", fake_engine)
    monkeypatch.setattr(engine, "require_vllm", lambda name: None)
    monkeypatch.setattr(raycluster, "init_ray", lambda address: None)
    overrides = ["+scenario=cpu_interactive", *TINY_CPU, f"results.dir={tmp_path}"]
    run = fake_run(tmp_path, overrides)
    small = [
        f"compare.run={run}",
        "compare.measure=always",
        "compare.bootstrap=200",
        "compare.probe.candidates=0",  # off here (picks by selection KL before distillation); the run below turns it on
        "compare.minitron.importance_sequences=4",
        "compare.minitron.score_sequences=2",
        "distill.tokens=512",
        "compare.seeds=[0,1]",
        "distill.seq_len=32",
        "distill.eval_sequences=2",
        "evaluate.tasks=[piqa,winogrande,lambada_openai]",
        "evaluate.limit=4",
        "evaluate.corpus_windows=2",
        "evaluate.corpus_seq_len=64",
    ]
    job = job_from_dict(compose_dict(*overrides, *small))
    out = run_compare(job)
    assert out == run / "compare"
    frame = pd.read_parquet(out / "compare.parquet").set_index("model")
    assert list(frame.index) == ["base", "autocompress", "minitron", "puzzletron"]  # compare.methods' default
    assert frame.loc["autocompress", "feasible"] and frame.loc["minitron", "feasible"] and not frame.loc["base", "feasible"]
    assert frame.loc["autocompress", "label"] in ("t0", "t1") and frame.loc["minitron", "params"] < frame.loc["base", "params"]
    assert {"piqa", "winogrande", "lambada_openai", "average", "corpus_ppl", "kl_distilled"} <= set(frame.columns)
    assert frame.loc["minitron", "measured_tpot_ms"] == pytest.approx(frame.loc["minitron", "params"] / 1e5)
    assert frame.loc["base", "measured_memory_gib"] == 2.0
    diff = pd.read_parquet(out / "diff.parquet")
    assert list(diff["task"]) == ["piqa", "winogrande", "lambada_openai", "average"] and (diff["n"].iloc[:3] == 4).all()
    text = capsys.readouterr().out
    assert "AutoCompress - Minitron (95% CI)" in text and "AutoCompress - Puzzletron (95% CI)" in text and (out / "compare.md").exists()
    for name in ("autocompress", "minitron", "puzzletron"):
        for seed in (0, 1):
            distilled = json.loads((out / name / f"distilled-seed{seed}" / "distill.json").read_text())
            assert distilled["tokens"] == 512 and distilled["data"]["source"] == "stdlib"  # calibration text, never evaluation data
    summary = json.loads((out / "compare.json").read_text())
    assert summary["seeds"] == [0, 1] and summary["scenario"] == "cpu_interactive"
    assert summary["minitron"]["num_key_value_heads"] == 2  # the tiny model's KV groups, all kept
    assert set(summary["minitron"]["limits"]) == {"max_width_pruning", "max_depth_pruning", "widened", "tried"}
    assert summary["diff"]["low"] <= summary["diff"]["mean"] <= summary["diff"]["high"]
    assert summary["minitron"]["average"] == pytest.approx(frame.loc["minitron", "average"])
    assert "Minitron (ModelOpt" in frame.loc["minitron", "label"] and (frame["seeds"] == [1, 2, 2, 2]).all()
    assert summary["methods"] == ["autocompress", "minitron", "puzzletron"] and summary["diff"] == {
        **summary["diff_vs"]["minitron"],
        "vs": "minitron",
    }
    pz = summary["puzzletron"]
    assert frame.loc["puzzletron", "feasible"] and pz["average"] == pytest.approx(frame.loc["puzzletron", "average"])
    assert pz["params"] == frame.loc["puzzletron", "params"] and pz["solves"] and not pz["solves"][-1]["overshoot"]
    assert len(pz["attention"]) == len(pz["ffn"]) == 4 and pz["attention"][0] != "-"  # per layer of tiny_llama; layer 0 keeps attention
    low, high = summary["diff_vs"]["puzzletron"]["low"], summary["diff_vs"]["puzzletron"]["high"]
    assert low <= summary["diff_vs"]["puzzletron"]["mean"] <= high
    with pytest.raises(ConfigError, match=r"holds a finished comparison; choose another compare\.out, or add overwrite=true"):
        run_compare(job)  # a finished comparison is not written over unless asked
    assert (out / "compare.json").exists()
    copies = {p: p.stat().st_mtime_ns for p in out.glob("*/distill-seed*.json")}
    run_compare(job, overwrite=True)  # a rerun with the same settings reuses every stage
    seconds = json.loads((out / "compare.json").read_text())["seconds"]
    assert all(seconds[s] == "reused" for s in seconds if "/" in s), seconds
    assert len(copies) == 6 and all(p.stat().st_mtime_ns == t for p, t in copies.items())  # equal copies are not written again
    probe = ["compare.probe.candidates=3", "compare.probe.tokens=256"]  # pick after a short distillation, both alike
    other = job_from_dict(compose_dict(*overrides, *small, *probe, "compare.runner_up=true", f"compare.out={tmp_path / 'other'}"))
    run_compare(other)  # another run (another scenario's, say) reuses the unpruned model's scores
    assert "test_kl" not in summary["autocompress"] and "test_kl" not in frame  # the test split is the headline's alone
    methods = ["compare.methods=[autocompress,puzzletron,greedy]", "compare.test_split=true"]
    elsewhere = [*overrides[:-1], f"results.dir={tmp_path / 'mine'}"]  # the command's results.dir, not the run's
    only = job_from_dict(compose_dict(*elsewhere, *small, *methods, f"compare.out={tmp_path / 'pz'}"))
    run_compare(only)  # a method list without Minitron: neither its stage nor its rows
    assert not (tmp_path / "pz" / "minitron").exists()
    assert [p.is_dir() for p in (tmp_path / "mine" / "evaluate").glob("base-*")].count(True) == 1  # where results.dir says
    tested = pd.read_parquet(tmp_path / "pz" / "compare.parquet").set_index("model")
    assert list(tested.index) == ["base", "autocompress", "puzzletron", "greedy"]
    assert tested.loc["base", "test_kl"] == pytest.approx(0, abs=1e-6) and (tested["test_kl"].iloc[1:] > 0).all()
    assert (tested["test_ppl"] > 1).all()
    summary = json.loads((tmp_path / "pz" / "compare.json").read_text())
    assert summary["greedy"]["test_kl"] == pytest.approx(tested.loc["greedy", "test_kl"]) and summary["autocompress"]["test_perplexity"] > 1
    assert summary["diff"]["vs"] == "puzzletron" and set(summary["diff_vs"]) == {"puzzletron", "greedy"}
    assert summary["greedy"]["label"] == "greedy sublayer removal" and summary["greedy"]["hidden_size"] == 64
    seconds = json.loads((tmp_path / "other" / "compare.json").read_text())["seconds"]
    assert seconds["base/eval"] == "reused" and seconds["autocompress/eval-seed0"] != "reused", seconds
    check_probe(tmp_path / "other", pd.read_parquet(run / "trials.parquet"))
    check_runner_ups(tmp_path / "other")
    check_carried(other, tmp_path / "other", monkeypatch)
    budgets = {m: s["budget"] for m, s in json.loads((tmp_path / "other" / "compare.json").read_text()).items() if m in known_methods()}
    assert budgets["autocompress"]["selection_evaluations"] == 2 and budgets["puzzletron"]["selection_evaluations"] == 3
    assert budgets["minitron"]["selection_evaluations"] == len(pd.read_parquet(tmp_path / "other" / "minitron" / "candidates.parquet"))
    assert budgets["puzzletron"]["one_block_evaluations"] > 0


def check_carried(job: Any, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A comparison whose checkpoints are gone (carried to a fresh machine with its small files only) finishes without
    distilling or picking again: the scores are kept, the baselines' checkpoints are sliced again from their records."""
    from autocompress.baselines import interface

    before = json.loads((out / "compare.json").read_text())
    gone = [
        *out.glob("*/pruned"),
        *out.glob("*/distilled-seed*"),
        *out.glob("*/runner_up/pruned"),
        *out.glob("*/runner_up/distilled-seed*"),
    ]
    assert len(gone) == 2 * 3 + 2 * 3 * 2  # pick and runner-up of 3 methods; each distilled with 2 seeds
    written = {p: p.read_bytes() for p in out.glob("minitron/**/pruned/*") if p.suffix in (".safetensors", ".md", ".json")}
    for folder in gone:
        shutil.rmtree(folder)

    def no_pick(*args: Any) -> None:
        raise AssertionError("picked again")

    with monkeypatch.context() as mp:
        for name in ("minitron", "puzzletron"):
            mp.setitem(interface.BASELINES, name, dataclasses.replace(interface.BASELINES[name], pick=no_pick))
        run_compare(job, overwrite=True)
    after = json.loads((out / "compare.json").read_text())
    for name in ("autocompress", "minitron", "puzzletron"):
        assert after[name]["average"] == before[name]["average"] and after[name]["params"] == before[name]["params"]
        assert after[name]["runner_up"] == before[name]["runner_up"]
        assert (out / name / "runner_up" / "pruned" / "config.json").exists() and not (out / name / "distilled-seed0").exists()
    assert after["diff_vs"] == before["diff_vs"] and len(written) >= 6
    assert all(p.read_bytes() == data for p, data in written.items())  # the same checkpoints, card and verification included
    exported = ("autocompress/pruned", "autocompress/runner_up/pruned")  # exported again from the sweep run (seconds)
    assert all(after["seconds"][s] == "reused" for s in after["seconds"] if "/" in s and s not in exported), after["seconds"]
    shutil.rmtree(out / "minitron" / "pruned")
    (out / "minitron" / "ranking.safetensors").unlink()  # no ranking kept: picked again (not the scores' checkpoint sliced blind)
    run_compare(job, overwrite=True)
    assert json.loads((out / "compare.json").read_text())["seconds"]["minitron/pruned"] != "reused"


def check_runner_ups(out: Path) -> None:
    """compare.runner_up: each method's second by its own selection score, distilled and scored as its pick is."""
    summary = json.loads((out / "compare.json").read_text())
    frame = pd.read_parquet(out / "compare.parquet").set_index("model")
    ac = summary["autocompress"]
    probed = sorted(summary["probe"]["autocompress"], key=lambda r: r["kl_select_probe"])
    assert ac["runner_up"]["label"] == probed[1]["candidate"] != ac["trial"]  # the probe's second
    mt = pd.read_parquet(out / "minitron" / "candidates.parquet")
    second = mt[~mt["chosen"] & mt["kl_select_probe"].notna()].sort_values("kl_select_probe").iloc[0]
    picked = json.loads((out / "minitron" / "minitron.json").read_text())
    assert picked["runner_up"]["architecture"] == second["architecture"] != picked["architecture"]
    pz = json.loads((out / "puzzletron" / "puzzletron.json").read_text())
    probed = sorted(pz["probe"], key=lambda r: (r["kl_select_probe"], r["candidate"]))  # the MIP's 3 best choices, probed
    assert len(probed) == 3 and summary["probe"]["puzzletron"] == pz["probe"]
    assert pz["kl_select"] == probed[0]["kl_select"] and pz["runner_up"]["kl_select"] == probed[1]["kl_select"]
    assert pz["runner_up"]["architecture"] != pz["architecture"]
    for name in ("autocompress", "minitron", "puzzletron"):
        assert frame.loc[f"{name}/runner_up", "seeds"] == 2 and summary[name]["runner_up"]["params"] > 0
        assert (out / name / "runner_up" / "distilled-seed1" / "distill.json").exists()
    assert list(summary["diff_vs"]) == ["minitron", "puzzletron"]  # runner-ups are shown, not compared


def check_probe(out: Path, trials: pd.DataFrame) -> None:
    """compare.probe: each method's top 3 by selection KL distilled briefly; the lowest selection-split KL after it kept."""
    summary = json.loads((out / "compare.json").read_text())
    probe = summary["probe"]
    assert probe["candidates"] == 3 and probe["tokens"] == 256
    ac = probe["autocompress"]
    assert [r["candidate"] for r in ac] == list(top_trials(trials, 3)["trial_id"])  # in order of KL before distillation
    assert all(r["probe_tokens"] == 256 and r["kl_select_probe"] > 0 for r in ac)
    assert summary["autocompress"]["trial"] == min(ac, key=lambda r: r["kl_select_probe"])["candidate"]
    candidates = pd.read_parquet(out / "minitron" / "candidates.parquet")
    probed = candidates[candidates["kl_select_probe"].notna()]
    assert len(probed) == 3 and set(probed.index) == set(candidates.nsmallest(3, "kl").index)  # its top 3 by KL before
    assert candidates.loc[candidates["chosen"], "kl_select_probe"].item() == probed["kl_select_probe"].min()
    assert [r["params"] for r in probe["minitron"]] == list(probed["params"])
    picked = probed.loc[probed["chosen"], "architecture"].item()
    assert json.loads((out / "minitron" / "minitron.json").read_text())["architecture"] == picked
    assert not list(out.rglob(".probe"))  # the probe's checkpoints are removed once measured
    assert "Picks: each method's 3 best by selection-split KL, distilled 256 tokens each" in (out / "compare.md").read_text()
