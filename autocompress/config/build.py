"""Building the typed configuration from plain data (Hydra's composed dicts), with one clear error per bad key."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from autocompress.config.metrics import Constraint
from autocompress.config.ranges import out_of_range
from autocompress.config.schema import (
    DataSpec,
    Hardware,
    ModelSpec,
    ProfileSpec,
    RunSpec,
    Scenario,
    SearchSpec,
    SweepSpec,
    Workload,
)
from autocompress.errors import ConfigError

T = TypeVar("T")


def build(cls: type[T], data: Any, key: str) -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown and missing keys and numbers outside their documented range
    (config.ranges) by their full name."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(f'{key}.{u}' for u in unknown)}; known: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key {key}.{name}")
            continue
        kwargs[name] = _coerce(hints[name], data[name], f"{key}.{name}")
    try:
        obj = cls(**kwargs)
    except ConfigError as exc:
        # a class used under two keys names its usual one (compare.minitron for compare.minitron_default): the value's own
        if f"{key}." in str(exc) or (own := out_of_range(cls, kwargs, key)) is None:
            raise
        raise ConfigError(own) from None
    own = out_of_range(cls, kwargs, key)  # the documented range (config.ranges), past the class's own checks
    if own is not None:
        raise ConfigError(own)
    return obj


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                return _coerce(option, value, key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key}={value!r} is not one of {list(typing.get_args(hint))}")
        return value
    if origin is tuple:
        if isinstance(value, str) and typing.get_args(hint)[0] is str:  # tasks=piqa or tasks=a,b: one name or a comma list
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        inner = typing.get_args(hint)[0]
        return tuple(_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)  # type: ignore[arg-type]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        if hint is int and float(value) != int(value):
            raise ConfigError(f"{key} must be a whole number, got {value!r}")
        return hint(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        if not value.strip():  # `model.path=` is a typo or an unset variable, never "not given"
            raise ConfigError(f"{key} is empty; give a value, or drop {key}= to keep the default")
        return value
    return value


def scenario_from_dict(cfg: Mapping[str, Any]) -> Scenario:
    """Scenario from the composed config's `scenario`, `hardware` and `workload` sections."""
    scenario = cfg.get("scenario")
    if not isinstance(scenario, Mapping):
        raise ConfigError("no scenario selected: add +scenario=NAME (see conf/scenario/)")
    for section in ("hardware", "workload"):
        if not isinstance(cfg.get(section), Mapping):
            raise ConfigError(f"scenario {scenario.get('name')!r} names no {section}; add /{section}: NAME to its defaults")
    raw = scenario.get("constraints") or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("scenario.constraints must map metric names to bounds, e.g. {tpot_ms: 0.6x}")
    constraints = tuple(Constraint.parse(str(k), v) for k, v in raw.items() if v is not None)
    rest = {k: v for k, v in scenario.items() if k != "constraints"}
    unknown = sorted(set(rest) - {"name", "description"})
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join('scenario.' + u for u in unknown)}")
    workload = build(Workload, cfg["workload"], "workload")
    return Scenario(
        name=str(scenario.get("name") or "unnamed"),
        description=str(scenario.get("description") or ""),
        hardware=on_this_cpu(build(Hardware, cfg["hardware"], "hardware"), workload.dtype),
        workload=workload,
        constraints=constraints,
    )


def on_this_cpu(hw: Hardware, dtype: str) -> Hardware:
    """A CPU hardware config made this CPU's: its identity, and its measured peaks where `measure_peaks` asks."""
    if hw.engine != "vllm-cpu":
        return hw
    from autocompress.config.cpuinfo import key, peaks

    if not hw.measure_peaks:
        return dataclasses.replace(hw, cpu=key())
    measured = peaks(dtype)
    return dataclasses.replace(hw, cpu=key(), peak_tflops=measured["peak_tflops"], mem_bandwidth_gbs=measured["mem_bandwidth_gbs"])


def results_of(cfg: Mapping[str, Any]) -> tuple[str, str | None]:
    """(results.dir, results.run_id) of a composed config, checked: neither empty, the run id one folder name; an empty
    cost_model is refused here too (every command that writes a run reads these)."""
    results = cfg.get("results") or {}
    for key, value in (("results.dir", results.get("dir", "results")), ("cost_model", cfg.get("cost_model", "auto"))):
        if value is None or not str(value).strip():
            raise ConfigError(f"{key} is empty; give a value (default: {'results' if key == 'results.dir' else 'auto'}) or leave it out")
    run_id = results.get("run_id")
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", str(run_id)):
        raise ConfigError(f"results.run_id={run_id!r} may only hold letters, digits, '_', '-' and '.'")
    return str(results.get("dir", "results")), None if run_id is None else str(run_id)


def overwrite_flag(cfg: Mapping[str, Any]) -> bool:
    """The top-level `overwrite` of sweep, plan and compare: true replaces the command's earlier output of that name."""
    value = cfg.get("overwrite", False)
    if not isinstance(value, bool):
        raise ConfigError(f"overwrite={value!r}: expected true or false")
    return value


def run_spec_from_dict(cfg: Mapping[str, Any]) -> RunSpec:
    """RunSpec from a fully resolved config mapping (OmegaConf.to_container(cfg, resolve=True))."""
    results_dir, run_id = results_of(cfg)
    return RunSpec(
        scenario=scenario_from_dict(cfg),
        model=build(ModelSpec, cfg.get("model"), "model"),
        data=build(DataSpec, cfg.get("data") or {}, "data"),
        search=build(SearchSpec, cfg.get("search") or {}, "search"),
        sweep=build(SweepSpec, cfg.get("sweep") or {}, "sweep"),
        results_dir=results_dir,
        run_id=run_id,
        profile=build(ProfileSpec, cfg.get("profile") or {}, "profile"),
        cost_model=str(cfg.get("cost_model") or "auto"),
    )
