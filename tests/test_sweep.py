"""A 2-trial sweep of the tiny model on local Ray writes both Parquet files with the documented columns."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from autocompress.arch.masking import Ranking
from autocompress.config.compose import run_spec_of
from autocompress.results import store as results
from autocompress.results.store import FRONT_COLUMNS, TRIAL_SCHEMA

from .conftest import TINY_CPU, run_cli


@pytest.mark.ray
@pytest.mark.parametrize("sweep", ["default", "optuna"])
def test_two_trial_sweep_writes_parquet(tmp_path: Path, sweep: str, request: pytest.FixtureRequest) -> None:
    if sweep == "default":  # the grid run conftest makes once for every test that reads a run
        run, out = request.getfixturevalue("tiny_sweep")
    else:
        out = run_cli(
            "autocompress.sweep",
            "+scenario=cpu_interactive",
            *TINY_CPU,
            f"sweep={sweep}",
            "sweep.num_trials=2",
            "sweep.report_every=2",
            "sweep.tracking=[mlflow]",
            f"results.dir={tmp_path}",
            "results.run_id=test",
        )
        run = tmp_path / "cpu_interactive" / "test"
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"trials: {run / 'trials.parquet'}" in out.stdout and f"pareto: {run / 'pareto.parquet'}" in out.stdout
    trials = pd.read_parquet(run / "trials.parquet")
    pareto = pd.read_parquet(run / "pareto.parquet")
    assert list(trials.columns) == list(TRIAL_SCHEMA)
    assert list(pareto.columns) == list(TRIAL_SCHEMA) + FRONT_COLUMNS
    assert len(trials) == 2 and (trials["status"] == "ok").all(), trials[["status", "error"]]
    assert trials["trial_id"].is_unique and trials["cost_model"].eq("analytic/cpu/v1").all()
    # every trial marked feasible meets every constraint under the cost model that judged it
    meta = json.loads((run / "metadata.json").read_text())
    assert meta["status"] == "complete"
    stages = ["model", "space", "text", "importance", "teacher", "base_eval", "rival"]  # where the preparation's time went
    assert list(meta["prepare_seconds"]) == stages and all(v >= 0 for v in meta["prepare_seconds"].values())
    phases = trials[["steps_s", "repair_s", "fill_s", "rival_s", "score_s"]]  # ... and each trial's
    assert (phases >= 0).all().all() and (trials["steps_s"] > 0).all() and (phases.sum(axis=1) <= trials["wall_s"] + 1e-6).all()
    assert meta["git_sha"] is None or isinstance(meta["git_sha"], str)
    for _, row in trials[trials["feasible"]].iterrows():
        for metric, bound in meta["constraints"].items():
            value = row[metric]
            assert value <= bound["value"] * (1 + 1e-9) if bound["sense"] == "max" else value >= bound["value"] * (1 - 1e-9)
    assert set(pareto["trial_id"]) <= set(trials.loc[trials["feasible"], "trial_id"])
    assert trials["kl_select"].notna().all() and trials["kl"].notna().all() and (trials["kl_select"] != trials["kl"]).any()
    assert pareto["kl_select"].is_monotonic_increasing  # fronts are ranked on the selection split
    assert set(trials["origin"]) <= {"search", "homogeneous"}
    own = trials[trials["origin"] == "search"]  # the search's own result is the row's where it was kept ...
    assert (own["searched_kl_select"] == own["kl_select"]).all() and (own["searched_params"] == own["params"]).all()
    rival = trials[trials["origin"] == "homogeneous"]  # ... and lost where the rival was kept
    assert (rival["searched_kl_select"] > rival["kl_select"]).all()
    loaded_trials, loaded_pareto = results.load(run)
    assert len(loaded_trials) == 2 and len(loaded_pareto) == len(pareto)
    assert run_spec_of(run).scenario.name == "cpu_interactive"
    assert Ranking.load(run / "ranking.safetensors").hidden.shape == (64,)
    check_curves(run, trials, every=1 if sweep == "default" else 2, mlflow=sweep == "optuna")


def check_curves(run: Path, trials: pd.DataFrame, every: int, mlflow: bool) -> None:
    """Every trial's search curves (sweep.report_every): in curves.parquet, in Ray Tune's progress.csv (TensorBoard's
    events beside it) and, with sweep.tracking=[mlflow], as MLflow metric histories, one MLflow run per trial."""
    curves = pd.read_parquet(run / "curves.parquet")
    steps = list(range(0, 6, every))  # TINY: search.steps=6
    assert curves.groupby("trial_id")["step"].apply(list).to_dict() == {t: steps for t in trials["trial_id"]}
    assert {"loss", "kl", "tau", "lambda_tpot_ms", "lambda_ttft_ms", "expected_tpot_ms", "expected_memory_gib"} <= set(curves.columns)
    assert curves["lambda_tpot_ms"].notna().all() and (curves["kl"] >= 0).all()
    progress = [pd.read_csv(p) for p in sorted((run / "tune").glob("*/progress.csv"))]
    assert len(progress) == 2 and all(p["search_kl"].notna().sum() == len(steps) for p in progress)
    assert len(list((run / "tune").glob("*/events.out.tfevents.*"))) == 2
    if mlflow:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
        (exp,) = [e for e in client.search_experiments() if e.name == f"autocompress/cpu_interactive/{run.name}"]
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 2 and all(len(client.get_metric_history(r.info.run_id, "search_kl")) == len(steps) for r in runs)
        assert sorted(r.data.metrics["kl_select"] for r in runs) == pytest.approx(sorted(trials["kl_select"]))


def test_existing_run_id_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cpu_interactive" / "taken").mkdir(parents=True)
    out = run_cli("autocompress.sweep", "+scenario=cpu_interactive", *TINY_CPU, f"results.dir={tmp_path}", "results.run_id=taken")
    assert out.returncode == 2 and "already exists" in out.stderr


@pytest.mark.ray
def test_trial_no_node_can_run_is_refused_before_the_run_folder(tmp_path: Path) -> None:
    """sweep.cpus_per_trial beyond every node: one clear line and exit 2, not a Tune run that waits forever."""
    args = [
        "+scenario=cpu_interactive",
        *TINY_CPU,
        "sweep.num_trials=1",
        "sweep.cpus_per_trial=64",
        f"results.dir={tmp_path}",
        "results.run_id=r",
    ]
    out = run_cli("autocompress.sweep", *args, timeout=180)
    assert out.returncode == 2, out.stderr[-2000:]
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "sweep.cpus_per_trial=64" in line[0] and "no node of the Ray cluster" in line[0], out.stderr[-2000:]
    assert not (tmp_path / "cpu_interactive" / "r").exists()  # a corrected rerun with the same id is not blocked


def test_trial_fits_only_on_a_node_that_has_all_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpus_per_trial=1 on a cluster without GPUs is refused (it hung); a node with both CPUs and the GPU is enough."""
    import ray

    from autocompress.cluster import check_trial_fits
    from autocompress.errors import ConfigError

    nodes = [{"Alive": True, "Resources": {"CPU": 16.0}}, {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_trial_fits(2, 1)
    check_trial_fits(16, 0)
    with pytest.raises(ConfigError, match=r"sweep\.gpus_per_trial=1, but no node .*at most 16 CPUs, at most 1 GPUs"):
        check_trial_fits(4, 1)  # 16 CPUs on one node, the GPU on another: no single node runs the trial
    nodes[1]["Alive"] = False
    with pytest.raises(ConfigError, match=r"sweep\.cpus_per_trial=2 and sweep\.gpus_per_trial=1"):
        check_trial_fits(2, 1)


def test_a_run_that_fails_before_it_starts_leaves_no_folder(tmp_path: Path) -> None:
    """The run id is claimed at once (mkdir), and given back when the sweep fails before config.yaml: a corrected rerun is not blocked."""
    args = ["+scenario=cpu_interactive", *TINY_CPU, f"results.dir={tmp_path}", "results.run_id=again"]
    out = run_cli("autocompress.sweep", *args, "scenario.constraints.tpot_ms=0.01x", timeout=180)  # refused in prepare, after the claim
    assert out.returncode == 2 and "cannot be met" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "cpu_interactive").exists()  # nor its scenario folder, which held nothing else
    (tmp_path / "cpu_interactive" / "again").mkdir(parents=True)  # another sweep holds the claim: refused at once, its folder untouched
    out = run_cli("autocompress.sweep", *args, timeout=180)
    assert out.returncode == 2 and "another sweep is starting it" in out.stderr and (tmp_path / "cpu_interactive" / "again").is_dir()


def test_bad_optuna_storage_is_refused_before_the_run_folder(tmp_path: Path) -> None:
    """A sweep.optuna_storage that cannot be opened: one error line naming it, and no failed run folder left behind."""
    args = [
        "+scenario=cpu_interactive",
        *TINY_CPU,
        "sweep=optuna",
        "sweep.optuna_storage=nosuchdb://x",
        f"results.dir={tmp_path}",
        "results.run_id=o",
    ]
    out = run_cli("autocompress.sweep", *args, timeout=120)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "sweep.optuna_storage='nosuchdb://x' cannot be opened" in errors[0], out.stderr[
        -2000:
    ]
    assert not (tmp_path / "cpu_interactive" / "o").exists()


def test_memory_per_trial_is_checked_against_the_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """sweep.memory_per_trial_gib beyond every node's Ray memory is refused like CPUs and GPUs."""
    import ray

    from autocompress.cluster import GIB, check_trial_fits
    from autocompress.errors import ConfigError

    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0, "memory": 6.0 * GIB}},
        {"Alive": True, "Resources": {"CPU": 1.0, "memory": 40.0 * GIB}},
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    check_trial_fits(4, 0, 5)
    check_trial_fits(1, 0, 30)
    with pytest.raises(ConfigError, match=r"sweep\.memory_per_trial_gib=30, but no node .*at most 40\.0 GiB of Ray memory"):
        check_trial_fits(4, 0, 30)  # the memory on one node, the CPUs on the other


def test_pending_watch_warns_once_then_times_out(capsys: pytest.CaptureFixture[str]) -> None:
    """Pending trials with none running: one warning after pending_warn_s, timed out after pending_timeout_s; a running trial resets it."""
    from autocompress.cluster import PendingWatch

    now = [0.0]
    watch = PendingWatch(10, 30, "2 CPUs free for a trial", clock=lambda: now[0])
    for t, statuses in [(0, ["PENDING"]), (5, ["PENDING"]), (6, ["RUNNING", "PENDING"]), (7, ["PENDING"]), (16, ["PENDING"])]:
        now[0] = t
        watch.step(statuses)
    assert not watch.warned and not watch.timed_out  # the clock restarted at 7 when the running trial ended
    for t in (17, 20, 36):
        now[0] = t
        watch.step(["PENDING", "TERMINATED"])
    assert watch.warned and not watch.timed_out
    now[0] = 37
    watch.step(["PENDING"])
    assert watch.timed_out
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no trial has started for 10 s") and "2 CPUs" in err[0]
    assert "sweep.pending_timeout_s" in str(watch.error("resume=/r")) and "resume=/r" in str(watch.error("resume=/r"))
    idle = PendingWatch(1, None, "x", clock=lambda: now[0])
    for t in (0, 1e6):
        now[0] = t
        idle.step(["TERMINATED"])  # nothing pending: nothing to warn about
    assert not idle.warned and not idle.timed_out


@pytest.mark.ray
def test_a_trial_that_never_starts_ends_the_tune_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real Ray Tune: a trial no free node can take (as on an autoscaling cluster that adds none) stops the experiment at the timeout."""
    import time

    import ray
    from ray import tune

    from autocompress.cluster import PendingWatch
    from autocompress.search.tracking import stopper, watcher

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        watch = PendingWatch(1, 4, "2 CPUs free for a trial")
        tuner = tune.Tuner(
            tune.with_resources(lambda config: {"x": 1}, {"cpu": 2}),
            tune_config=tune.TuneConfig(num_samples=1),
            run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[watcher(watch)], stop=stopper(watch)),
        )
        start = time.time()
        tuner.fit()
        assert watch.timed_out and time.time() - start < 60
        assert "warning: no trial has started for 1 s" in capsys.readouterr().err
    finally:
        ray.shutdown()
