"""Compose the project's Hydra config outside `@hydra.main` (benchmarks, tests, notebooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from autocompress.config.build import build, run_spec_from_dict
from autocompress.config.schema import RunSpec, Workload
from autocompress.errors import ConfigError
from autocompress.io import RunPaths

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain data; `ray.address` folds into the sweep section."""
    try:
        data: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[assignment]
    except Exception as exc:
        raise ConfigError(f"incomplete configuration: {exc}") from exc
    ray_cfg = data.pop("ray", None) or {}
    sweep = data.setdefault("sweep", {})
    sweep["ray_address"] = ray_cfg.get("address")
    if isinstance(sweep.get("definition"), str):
        sweep["definition"] = _named_definition(sweep["definition"])
    return data


def _named_definition(name: str) -> dict[str, Any]:
    """sweep.definition given as a name: the run folders of earlier versions (which kept the
    definitions in sweeps/), and `sweep.definition=NAME` typed in place of `sweep/definition=NAME`."""
    path = CONF_DIR / "sweep" / "definition" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"sweep.definition={name!r} is not in conf/sweep/definition/ {known}; choose one with sweep/definition=NAME")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)  # type: ignore[return-value]


def compose_dict(*overrides: str, config_dir: str | Path | None = None) -> dict[str, Any]:
    """The config `python -m autocompress.sweep [--config-dir DIR] OVERRIDES...` would see, as plain data. `config_dir`:
    a folder of your own groups (scenario/, hardware/, workload/, model/ ...) searched beside the package's conf/."""
    from hydra import compose, initialize_config_dir

    extra = []
    if config_dir is not None:
        folder = Path(config_dir).expanduser().resolve()
        if not folder.is_dir():
            raise ConfigError(f"config_dir={config_dir} is not a folder; give the folder that holds your scenario/, hardware/ ... files")
        extra = [f"hydra.searchpath=[file://{folder}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return plain(compose("config", overrides=[*extra, *overrides]))


def compose_spec(*overrides: str, config_dir: str | Path | None = None) -> RunSpec:
    """The typed RunSpec of `compose_dict(*overrides, config_dir=...)`."""
    return run_spec_from_dict(compose_dict(*overrides, config_dir=config_dir))


def load_workload(name: str) -> Workload:
    """A workload of conf/workload/ by name."""
    path = CONF_DIR / "workload" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"workload {name!r} does not exist; known: {known}")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return build(Workload, data, f"workload {name}")


def run_spec_of(run_dir: str | Path) -> RunSpec:
    """The RunSpec a finished sweep ran with (from its config.yaml)."""
    path = RunPaths(Path(run_dir)).config_file
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a sweep run folder (results/<scenario>/<run_id>)")
    cfg = OmegaConf.load(path)
    assert isinstance(cfg, DictConfig)
    return run_spec_from_dict(plain(cfg))
