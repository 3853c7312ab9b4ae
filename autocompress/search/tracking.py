"""What a sweep shows while it runs, beyond its own log lines: the search's step curves (reported to Ray Tune, so
they land in each trial's TensorBoard files and progress.csv and in the run's curves.parquet) and Ray Tune's
MLflow / Weights & Biases logger callbacks (sweep.tracking)."""

from __future__ import annotations

from typing import Any

from autocompress.config.schema import RunSpec
from autocompress.errors import ConfigError
from autocompress.search.runfolder import RunFolder

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
