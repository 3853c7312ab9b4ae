"""The model-family seam (config/families.py): every registered stage imports, and a family added as docs/hybrid.md
shows is what the sweep, export, compare and the run-folder check call."""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from autocompress.config import families
from autocompress.config.families import FAMILIES, STAGES, Family, family

DOC = Path(__file__).resolve().parents[1] / "docs" / "hybrid.md"


def test_every_registered_stage_imports() -> None:
    for fam in FAMILIES.values():
        assert set(fam.stages) <= set(STAGES)
        for stage in fam.stages:
            assert callable(fam.stage(stage)), (fam.name, stage)
    assert families.with_stage("prepare") == (families.LLAMA, families.HYBRID_MOE)


def test_a_missing_stage_or_family_is_one_clear_line() -> None:
    from autocompress.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nemotron_h models have no export stage: Nemotron-H models are planned"):
        family(families.NEMOTRON_H).stage("export")
    with pytest.raises(ConfigError, match=r"model family 'gpt2' is not registered; known: llama, granitemoehybrid"):
        family("gpt2")
    assert family(None) is family("") is FAMILIES[families.LLAMA]  # a run from before the family column
    with pytest.raises(ValueError, match="unknown stages"):
        Family("x", {"train": "m:f"})


@pytest.fixture
def mine(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """docs/hybrid.md's module, run as written under the name mine_family (unregistered again afterwards)."""
    section = DOC.read_text().split("## Adding a model family", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    module = types.ModuleType("mine_family")
    monkeypatch.setitem(sys.modules, "mine_family", module)
    monkeypatch.setitem(FAMILIES, "mine", Family("mine", {}))  # undone after the test, whatever the code registers
    exec(compile(textwrap.dedent(code), "mine_family.py", "exec"), module.__dict__)
    assert family("mine").stage("shape") is module.shape
    return module


def _mine_run(finished_run: Path, tmp_path: Path) -> Path:
    run = shutil.copytree(finished_run, tmp_path / "results" / "cpu_interactive" / "r")
    for name in ("trials.parquet", "pareto.parquet"):
        frame = pd.read_parquet(run / name).assign(family="mine", architecture=json.dumps({"layers": [0, 1]}))
        frame.to_parquet(run / name)
    return run


def test_adding_a_model_family_as_documented(
    mine: types.ModuleType, finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autocompress.baselines.comparison import job_from_dict
    from autocompress.baselines.context import build_context
    from autocompress.checkpoints.pipeline import ExportRequest, export
    from autocompress.config.build import run_spec_from_dict
    from autocompress.config.compose import compose_dict
    from autocompress.model.base import model_family
    from autocompress.results.runcheck import RunFolderError, check_run_folder
    from autocompress.search import tune

    # the sweep: a base model whose config.json says "mine" is prepared by the family's stage
    folder = tmp_path / "mine-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mine"}))
    spec = run_spec_from_dict(compose_dict("+scenario=cpu_interactive", "model=hf", f"model.path={folder}"))
    assert model_family(spec.model) == "mine" and "mine" in families.with_stage("prepare")
    with pytest.raises(NotImplementedError, match="the mine family's preparation"):
        tune._prepare(spec)

    # a run folder of its trials: checked by its shape, exported and compared by its stages
    run = _mine_run(finished_run, tmp_path)
    assert len(check_run_folder(run, tables=(run / "trials.parquet",)).metadata) > 0
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(mine, "export", lambda req, row, run: calls.append(("export", row["trial_id"])) or {"out": req.out})
    monkeypatch.setattr(mine, "compare", lambda job, run, spec, row: calls.append(("compare", row["trial_id"])) or "context")
    assert export(ExportRequest(run / "pareto.parquet", tmp_path / "out", index=0)) == {"out": tmp_path / "out"}
    job = job_from_dict(compose_dict("+scenario=cpu_interactive", "model=tiny_llama", f"compare.run={run}"))
    assert build_context(job, run) == "context"
    assert [c for c, _ in calls] == ["export", "compare"] and calls[0][1] == calls[1][1]  # the same trial, the best

    from autocompress.baselines.context import Context
    from autocompress.baselines.interface import minitron_pick

    assert Context(*[None] * 9, family="mine").hybrid  # not per-layer: compare leaves out the Llama-only steps
    with pytest.raises(NotImplementedError, match="Minitron for the mine family"):
        minitron_pick(types.SimpleNamespace(family="mine"), None)  # type: ignore[arg-type]

    broken = pd.read_parquet(run / "trials.parquet").assign(architecture=json.dumps({"layers": 3}))
    broken.to_parquet(run / "trials.parquet")
    with pytest.raises(RunFolderError, match=r"trial t0's architecture .* is not an architecture \(ValueError: no list of kept layers\)"):
        check_run_folder(run, tables=(run / "trials.parquet",))
