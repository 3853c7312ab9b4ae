"""Every shipped config composes; bad input gets one clear message, a non-zero exit, no result files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from autocompress.config.build import run_spec_from_dict
from autocompress.config.metrics import Constraint
from autocompress.errors import ConfigError
from autocompress.search.tune import grid_points

from .conftest import CONF, ROOT, TINY_CPU, compose_dict, compose_spec, run_cli

SCENARIOS = sorted(p.stem for p in (CONF / "scenario").glob("*.yaml"))
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))


def test_shipped_scenarios_are_the_documented_ones() -> None:
    assert SCENARIOS == ["b200_longctx", "cpu_interactive", "h100_batched", "rtx5070_coding", "rtx5080_game"]
    assert HARDWARE == ["b200", "cpu", "h100_sxm", "h200", "rtx5070", "rtx5080"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_composes(scenario: str) -> None:
    spec = compose_spec(f"+scenario={scenario}")
    assert spec.scenario.name == scenario
    assert spec.scenario.constraints and spec.model.name == "smollm2_135m"


@pytest.mark.parametrize("hardware", HARDWARE)
def test_every_hardware_composes(hardware: str) -> None:
    spec = compose_spec("+scenario=h100_batched", f"hardware={hardware}")
    assert spec.scenario.hardware.name == hardware


@pytest.mark.parametrize(("sweep", "searcher"), [("default", "grid"), ("optuna", "optuna")])
def test_every_sweep_composes_its_definition(sweep: str, searcher: str) -> None:
    spec = compose_spec("+scenario=h100_batched", f"sweep={sweep}")
    assert spec.sweep.definition["searcher"] == searcher


def test_sweep_definitions_compose_as_a_hydra_group() -> None:
    """One loader: the definition is the config group sweep/definition, chosen and edited by overrides;
    a name in place of the group (how earlier run folders stored it) resolves to the same file."""
    assert compose_spec("+scenario=h100_batched", "sweep=optuna", "sweep/definition=grid").sweep.definition["searcher"] == "grid"
    edited = compose_spec("+scenario=h100_batched", "sweep.definition.grid.margin=[0,0.5]").sweep.definition
    assert edited["grid"]["margin"] == [0, 0.5] and edited["grid"]["dual_lr"] == [0.5, 2.0]
    by_name = compose_spec("+scenario=h100_batched", "sweep.definition=optuna_mo").sweep.definition
    assert by_name == compose_spec("+scenario=h100_batched", "sweep=optuna").sweep.definition


def test_documented_overrides() -> None:
    spec = compose_spec(
        "+scenario=rtx5070_coding", "results.dir=/tmp/x", "sweep.num_trials=3", "search.steps=5", "model=tiny_llama", "ray.address=auto"
    )
    assert (spec.results_dir, spec.sweep.num_trials, spec.search.steps, spec.model.source, spec.sweep.ray_address) == (
        "/tmp/x",
        3,
        5,
        "tiny",
        "auto",
    )


def test_relative_and_absolute_constraints() -> None:
    assert Constraint.parse("tpot_ms", "0.6x") == Constraint("tpot_ms", 0.6, relative=True)
    assert Constraint.parse("memory_gib", 12) == Constraint("memory_gib", 12.0)
    assert Constraint("tpot_ms", 0.5, relative=True).resolve({"tpot_ms": 8.0}) == Constraint("tpot_ms", 4.0)
    assert Constraint("throughput_tok_s", 100).satisfied(120) and not Constraint("tpot_ms", 10).satisfied(11)


def test_grid_points_cut_and_cycle() -> None:
    grid = {"margin": [0.0, 0.1], "dual_lr": [1.0]}
    assert grid_points(grid, 1, 0) == [{"dual_lr": 1.0, "margin": 0.0, "seed": 0}]
    assert [p["seed"] for p in grid_points(grid, 5, 7)] == [7, 7, 8, 8, 9]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workload.concurrency=-1"], "workload.concurrency must be > 0"),
        (["scenario.constraints.ttft_ms=-2"], "scenario.constraints.ttft_ms must be > 0"),
        (["scenario.constraints.ttft_ms=fast"], "is not understood"),
        (["+scenario.constraints.latency=3"], "not a known metric"),
        (["hardware.peak_tflops=0"], "hardware.peak_tflops must be > 0"),
        (["hardware.eta_memory=1.5"], "hardware.eta_memory must be in (0, 1]"),
        (["sweep.num_trials=0"], "sweep.num_trials must be > 0"),
        (["search.steps=2.5"], "search.steps must be a whole number"),
        (["search.settle_lr=0"], "search.settle_lr must be in (0, 1]"),
        (["search.settle_lr=1.5"], "search.settle_lr must be in (0, 1]"),
        (["sweep.num_trials=nan"], "sweep.num_trials must be a finite number"),
        (["search.steps=inf"], "search.steps must be a finite number"),
        (["search.settings.dual_lr=-inf"], "search.settings.dual_lr must be a finite number"),
        (["scenario.constraints.ttft_ms=nan"], "scenario.constraints.ttft_ms must be a finite number"),
        (["scenario.constraints.ttft_ms=nanx"], "scenario.constraints.ttft_ms='nanx' is not understood"),
        (["workload.context_len=100"], "must be >= prompt_len + output_len"),
        (["results.run_id=../escape"], "results.run_id"),
        (["sweep.memory_per_trial_gib=0"], "sweep.memory_per_trial_gib must be > 0"),
        (["sweep.pending_timeout_s=nan"], "sweep.pending_timeout_s must be a finite number"),
        (["sweep.pending_warn_s=-1"], "sweep.pending_warn_s must be > 0"),
        (
            ["workload.kv_dtype=fp32"],
            "workload.kv_dtype='fp32' cannot be served by vllm with dtype='bf16'",
        ),  # before a sweep, not at export
    ],
)
def test_bad_values_name_their_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_spec("+scenario=h100_batched", *overrides)
    assert message in str(err.value)


def test_missing_scenario_and_unknown_names() -> None:
    with pytest.raises(ConfigError, match=r"add \+scenario=NAME"):
        run_spec_from_dict(compose_dict())
    for overrides in (["+scenario=nope"], ["+scenario=h100_batched", "model=nope"], ["+scenario=h100_batched", "hardware=nope"]):
        with pytest.raises(MissingConfigException, match="nope"):
            compose_dict(*overrides)
    with pytest.raises(ConfigError, match=r"sweep\.definition='nope' is not in conf/sweep/definition/"):
        compose_spec("+scenario=h100_batched", "sweep.definition=nope")
    with pytest.raises(ConfigError, match=r"sweep\.definition must be a mapping"):
        compose_spec("+scenario=h100_batched", "sweep.definition=5")
    with pytest.raises(ConfigError, match=r"sweep\.definition\.searcher must be grid or optuna"):
        compose_spec("+scenario=h100_batched", "sweep.definition.searcher=bogus")
    with pytest.raises(ConfigError, match=r"sweep\.definition\.grid must vary at least one Lagrangian setting; unknown: \['nope'\]"):
        compose_spec("+scenario=h100_batched", "+sweep.definition.grid.nope=[1]")


# ---------------------------------------------------------------------------------------- CLI


def _no_results(tmp: Path) -> None:
    assert not list(tmp.rglob("*.parquet")), "a failed run must not leave result files"


def test_cli_prints_resolved_config() -> None:
    out = run_cli("autocompress.sweep", "+scenario=h100_batched", "--cfg", "job")
    assert out.returncode == 0, out.stderr
    assert "peak_tflops: 989.4" in out.stdout and "throughput_tok_s: 1.5x" in out.stdout


def test_cli_unknown_scenario(tmp_path: Path) -> None:
    out = run_cli("autocompress.sweep", "+scenario=nope", f"results.dir={tmp_path}")
    assert out.returncode == 2  # Hydra's own errors exit 2 like every other bad input, in one line
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith("error: scenario=nope is not a shipped")
    assert "h100_batched" in out.stderr and "conf/scenario/nope.yaml" in out.stderr
    _no_results(tmp_path)


def test_cli_misspelled_key_is_one_line_with_the_nearest_key(tmp_path: Path) -> None:
    out = run_cli("autocompress.sweep", "+scenario=h100_batched", "sweep.num_trial=3", f"results.dir={tmp_path}")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert "error: unknown key sweep.num_trial; did you mean sweep.num_trials" in out.stderr
    _no_results(tmp_path)


def test_cli_unmeetable_constraint_names_it(tmp_path: Path) -> None:
    out = run_cli(
        "autocompress.sweep", "+scenario=cpu_interactive", *TINY_CPU, "scenario.constraints.tpot_ms=0.01x", f"results.dir={tmp_path}"
    )
    assert out.returncode == 2
    assert "constraint tpot_ms <= 0.01x base" in out.stderr and "smallest architecture in the search space reaches tpot_ms" in out.stderr
    _no_results(tmp_path)


def test_cli_negative_value(tmp_path: Path) -> None:
    out = run_cli("autocompress.sweep", "+scenario=h100_batched", "workload.output_len=-5", f"results.dir={tmp_path}")
    assert out.returncode == 2 and "error: workload.output_len must be > 0" in out.stderr
    assert "Traceback" not in out.stderr
    _no_results(tmp_path)


def test_cli_unreachable_ray_address(tmp_path: Path) -> None:
    out = run_cli("autocompress.sweep", "+scenario=cpu_interactive", *TINY_CPU, "ray.address=127.0.0.1:9", f"results.dir={tmp_path}")
    assert out.returncode == 2 and "ray.address='127.0.0.1:9' is unreachable" in out.stderr
    assert not any(tmp_path.iterdir())
    assert (ROOT / "conf").exists()


def test_unwritable_outputs_are_refused_before_any_work(tmp_path: Path) -> None:
    """evaluate, distill and export check their out= folder first: one error line, exit 2, nothing created."""
    import time

    from autocompress.io import check_writable

    afile = tmp_path / "a_file"
    afile.write_text("x")
    for bad, message in (
        (afile, "is a file; give a folder"),
        (afile / "sub", "is a file, not a folder"),
        (Path("/sys/kernel/x"), "cannot be written"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_writable(bad, "out")
    check_writable(tmp_path / "new" / "deeper", "out")
    assert not (tmp_path / "new").exists()  # the check creates nothing
    student = tmp_path / "student"
    student.mkdir()
    (tmp_path / "pareto.parquet").write_bytes(b"")  # export names the results file first; out= is checked before it is read
    for module, args in (
        ("autocompress.evaluate", ["base", f"out={afile / 'sub'}"]),
        ("autocompress.distill", [str(student), f"out={afile / 'sub'}"]),
        ("autocompress.export", [str(tmp_path / "pareto.parquet"), "index=0", f"out={afile / 'sub'}"]),
    ):
        start = time.time()
        out = run_cli(module, *args, timeout=120)
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1, (module, out.stderr[-2000:])
        assert "a_file is a file, not a folder" in errors[0], (module, errors)
        assert time.time() - start < 60  # refused before any model or evaluation ran


def test_folders_appear_whole_or_not_at_all(tmp_path: Path) -> None:
    """io.write_dir: a failed fill leaves neither the folder nor its temporary; a cache folder another process finished
    first is kept (first_wins), while an output folder that is not empty is never merged into."""
    from autocompress.io import write_dir

    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("died half-way")

    with pytest.raises(RuntimeError):
        write_dir(tmp_path / "out", fail)
    assert list(tmp_path.iterdir()) == []
    assert write_dir(tmp_path / "out", lambda tmp: (tmp / "a").write_text("1")) == 1
    cache = tmp_path / "out"  # now a finished folder, as if another process had built it first
    assert write_dir(cache, lambda tmp: (tmp / "b").write_text("22"), first_wins=True) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in cache.iterdir()] == ["a"]
    with pytest.raises(OSError):
        write_dir(cache, lambda tmp: (tmp / "b").write_text("22"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in cache.iterdir()] == ["a"]


def test_fit_without_measurements_is_one_clear_line(tmp_path: Path) -> None:
    """profile.measure=false before anything was measured: the measurements file and the fix, not a KeyError."""
    out = run_cli("autocompress.profile", "+scenario=cpu_interactive", "profile.measure=false", f"results.dir={tmp_path}", timeout=120)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert "holds no measurements to fit" in errors[0] and "drop profile.measure=false" in errors[0]
    assert "Traceback" not in out.stderr and not any(tmp_path.iterdir())


def test_mistyped_compare_run_writes_nothing(tmp_path: Path) -> None:
    """compare.run naming no finished sweep: one error line, exit 2, and no <run>/compare folder that later blocks that run id."""
    typo = tmp_path / "cpu_interactive" / "typo"
    out = run_cli("autocompress.compare", "+scenario=cpu_interactive", *TINY_CPU, f"compare.run={typo}", timeout=120)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "typo" in errors[0], out.stderr[-2000:]
    assert not typo.exists()
