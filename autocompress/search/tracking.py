"""What a sweep shows and watches while it runs, beyond its own log lines: the search's step curves (reported to Ray
Tune, so they land in each trial's TensorBoard files and progress.csv and in the run's curves.parquet), Ray Tune's
MLflow / Weights & Biases logger callbacks (sweep.tracking), a failed trial's error, and the callbacks that end a
sweep whose trials no node can place (cluster.PendingWatch)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from autocompress.cluster import PendingWatch
from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.results.runfolder import RunFolder

CURVE = "search_"  # prefix of a trial's step reports (its final row has none): `search_step`, `search_kl`, ...


TRACKER_PACKAGES = {"mlflow": ("mlflow", "pip install -e '.[tracking]' (or pip install mlflow)"), "wandb": ("wandb", "pip install wandb")}


def check_trackers(tracking: tuple[str, ...]) -> None:
    """sweep.tracking's packages installed, before any work."""
    import importlib.util

    for name in tracking:
        module, install = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"sweep.tracking=[{name}] needs the {module} package: {install}; or drop {name} from sweep.tracking")


def trackers(spec: RunSpec, run: RunFolder) -> list[Any]:
    """Ray Tune's own logger callbacks for sweep.tracking: each trial is one MLflow run / W&B run (its settings as
    parameters, its step curves and final row as metrics), grouped by the scenario and this run's id."""
    callbacks: list[Any] = []
    name = f"autocompress/{spec.scenario.name}/{run.path.name}"
    if "mlflow" in spec.sweep.tracking:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        uri = spec.sweep.tracking_uri or f"sqlite:///{(run.path / 'mlflow.db').resolve()}"
        callbacks.append(MLflowLoggerCallback(tracking_uri=uri, experiment_name=name, save_artifact=False))
    if "wandb" in spec.sweep.tracking:
        from ray.air.integrations.wandb import WandbLoggerCallback

        callbacks.append(WandbLoggerCallback(project="autocompress", group=name))
    return callbacks


def last_error(trial: Any) -> str:
    """The latest failure of a Tune trial, as text (Tune appends each to the driver's copy of error.txt)."""
    path = trial.error_file
    text = Path(path).read_text(errors="replace") if path and os.path.exists(path) else str(trial.get_error() or "")
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # colour codes of Ray tracebacks
    last = text.rsplit("Failure # ", 1)[-1].split("\n", 1)[-1] if "Failure # " in text else text
    return last.strip() or "unknown error"


def watcher(watch: PendingWatch) -> Any:
    """A Tune callback that feeds every controller step's trial states to `watch`."""
    from ray import tune

    class Watcher(tune.Callback):
        def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
            watch.step([t.status for t in trials])

    return Watcher()


def stopper(watch: PendingWatch) -> Any:
    """A Tune stopper that ends the experiment once `watch` has timed out (trials never stop on their own results)."""
    from ray import tune

    class Stopper(tune.Stopper):
        def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
            return False

        def stop_all(self) -> bool:
            return watch.timed_out

    return Stopper()
