"""docs/scenarios.md, run as written: its YAML files written where it says, its commands and its Python snippet run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scenarios.md"
FILES = re.compile(r"`(my_conf/[\w/]+\.yaml)`:\n\n```yaml\n(.*?)```", re.S)


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def my_conf(tmp_path: Path) -> Path:
    files = FILES.findall(DOC.read_text())
    assert {name for name, _ in files} == {"my_conf/hardware/l40s.yaml", "my_conf/scenario/l40s_chat.yaml"}
    for name, text in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_walkthroughs_python_runs_as_written(my_conf: Path) -> None:
    (snippet,) = _blocks("python")
    out = subprocess.run([sys.executable, "-c", snippet], cwd=my_conf, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("l40s (Constraint(metric='tpot_ms', value=0.6, relative=True), Constraint(metric='memory_gib', value=8.0")


def test_the_walkthroughs_config_check_runs_as_written(my_conf: Path) -> None:
    """The `--cfg job` line (the sweep line itself starts a sweep: composed here, not run)."""
    (commands,) = _blocks("bash")
    check = next(line.split("#")[0].split() for line in commands.splitlines() if "--cfg job" in line)
    assert check[0] == ".venv/bin/python"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *check[1:]], cwd=my_conf, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "name: l40s\n" in out.stdout and "tpot_ms: 0.6x" in out.stdout and "memory_gib: 8" in out.stdout
    typo = [*check[1:5], "+scenario=l40s_chatt", "--cfg", "job"]
    wrong = subprocess.run([sys.executable, *typo], cwd=my_conf, capture_output=True, text=True, timeout=120, env=env)
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: scenario=l40s_chatt is not a shipped scenario nor one of")
    assert "choose one of l40s_chat, " in wrong.stderr and "provider=" not in wrong.stderr  # not Hydra's search-path lines


def test_a_config_dir_that_is_not_a_folder_is_one_error(tmp_path: Path) -> None:
    from autocompress.config.compose import compose_spec
    from autocompress.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config_dir=.* is not a folder"):
        compose_spec("+scenario=l40s_chat", config_dir=tmp_path / "nope")
