"""Shared fixtures: Hydra compose, tiny models built in the test, the embedded model when installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.compose import compose_dict, compose_spec
from autocompress.config.schema import ModelSpec, SpaceSpec
from autocompress.model.base import tiny_llama

ROOT = Path(__file__).resolve().parents[1]

# `make test` runs the suite on two pytest-xdist workers (-n 2) with the scheduler below: one module is one unit of
# work (its module fixtures run once), modules sharing a session fixture are one unit, and the heaviest units start
# first, so that no worker is left alone with a long one at the end (serial: 1394 s, 2026-12-03). Then the tests
# marked `timing` (tests/test_profile.py) run alone.
HEAVY_FIRST = (
    "test_lm_eval_parity",
    "test_resume",
    "test_sweep",
    "test_moe_sweep",
    "test_verify",
    "test_cluster",
    "test_plan",
    "test_export",
)
SHARED_UNIT = {"test_report": "test_sweep", "test_doc_snippets": "test_sweep"}  # they read the session fixture `tiny_sweep`


def _unit(nodeid: str) -> str:
    name = Path(nodeid.split("::")[0]).stem
    return SHARED_UNIT.get(name, name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {unit: n for n, unit in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(rank)))  # stable: the rest keep pytest's order


class _UnitScheduler:
    """xdist's scheduler hook, registered only where xdist runs (pytest refuses a hook no active plugin defines)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Units as above, handed out in collection order (xdist's loadgroup marks do not reach pytest 9.2's node ids)."""
        from xdist.scheduler import LoadScopeScheduling

        class ByUnit(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _unit(nodeid)

        config.option.loadscopereorder = False  # xdist's default orders units by test count: the few heavy tests last
        return ByUnit(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_UnitScheduler(), "autocompress-unit-scheduler")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Two workers on two cores: one thread each, in this process and (through the environment) in the commands,
        # Ray workers and engines it starts. With torch's default of one thread per core, two workers' processes ran
        # four or more spinning threads on two cores: tests/test_resume.py took 372 s beside the lm-eval parity
        # module, 195 s with one thread each (2026-12-07, docs/benchmarks.md#the-test-suite).
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def load_benchmark(name: str) -> Any:
    """benchmarks/<name>.py as a module, with benchmarks/ on sys.path as `python benchmarks/<name>.py` has it (for its
    common.py)."""
    import importlib.util

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONF = ROOT / "conf"
__all__ = ["compose_dict", "compose_spec"]
SHARED_DATA = ROOT.parent / "shared" / "data"

# a tiny model, a space with several options per decision, constraints it can meet, a fast search
TINY = [
    "model=tiny_llama",
    "search.space.hidden_divisor=16",
    "search.space.ffn_divisor=32",
    "search.steps=6",
    "search.importance_sequences=4",
    "data.seq_len=32",
    "data.calib_sequences=8",
    "data.select_sequences=4",
    "data.report_sequences=4",
]
# The cpu hardware file's own peaks, not this CPU's measured ones: the searches' bounds are shares of the
# largest architecture's cost, and on a fast CPU (AVX-512 bf16 measured 0.35-0.47 TFLOP/s against the
# file's 0.122) the 5 ms step overhead is most of TTFT, so half the largest's TTFT fits no architecture.
TINY_CPU = [*TINY, "hardware.measure_peaks=false", "scenario.constraints.tpot_ms=0.97x", "scenario.constraints.ttft_ms=0.9x"]


def run_cli(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture
def tiny_model() -> Any:
    model = tiny_llama(
        ModelSpec(
            name="tiny", source="tiny", num_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
        )
    )
    model.eval().requires_grad_(False)
    return model


@pytest.fixture
def tiny_space(tiny_model: Any) -> SearchSpace:
    base = Architecture.from_llama_config(tiny_model.config)
    return SearchSpace.from_base(base, SpaceSpec(hidden_divisor=16, ffn_divisor=32, min_hidden_fraction=0.25))


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One 2-trial grid sweep of the tiny model through the CLI and local Ray, shared by the tests that read a run."""
    root = tmp_path_factory.mktemp("results")
    overrides = [*TINY_CPU, "sweep.num_trials=2", f"results.dir={root}", "results.run_id=r1"]
    out = run_cli("autocompress.sweep", "+scenario=cpu_interactive", *overrides)
    return root / "cpu_interactive" / "r1", out


@pytest.fixture
def one_thread() -> Any:
    """Tiny models gain nothing from threads, and the development machine is shared: one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")  # per module: tests copy it, never change it
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run folder as the sweep leaves it (config.yaml, metadata.json, trials and pareto), made without Ray."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from autocompress.arch.space import Architecture, Block
    from autocompress.config.compose import CONF_DIR
    from autocompress.io import write_json, write_parquet
    from autocompress.results.pareto import pareto_frame
    from autocompress.results.store import architecture_columns, trials_frame

    run = tmp_path_factory.mktemp("results") / "cpu_interactive" / "r"
    run.mkdir(parents=True)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+scenario=cpu_interactive", *TINY_CPU])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    rows = []
    for n, ffn in enumerate((64, 96, 128)):
        arch = Architecture(64, 4, 16, 256, True, (Block(2, ffn), Block(1, ffn)))
        costs = {"ttft_ms": 10.0 + n, "tpot_ms": 1.0 + n, "throughput_tok_s": 100.0 - n, "memory_gib": 0.1}
        rows.append({"trial_id": f"t{n}", "status": "ok", "error": "", **architecture_columns(arch), **costs})
        rows[-1].update(kl_select=0.5 - n / 10, kl=0.5 - n / 10, feasible=True, feasible_ttft_ms=True, cost_model="analytic/cpu/v1")
    trials = trials_frame(rows)
    write_parquet(trials, run / "trials.parquet")
    write_parquet(pareto_frame(trials), run / "pareto.parquet")
    meta = {"status": "complete", "scenario": "cpu_interactive", "model": "tiny_llama", "sweep_definition": {"searcher": "grid"}}
    meta |= {"constraints": {"ttft_ms": {"sense": "max", "value": 15.0}}, "base_costs": {"ttft_ms": 20.0, "tpot_ms": 2.0}}
    write_json(meta, run / "metadata.json")
    return run
