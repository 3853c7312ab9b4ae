"""The analytic model calibrated to engine measurements: fitted efficiency and overhead terms per hardware + engine.

Fit: the terms (decode eta_c, eta_m, step and per-block overheads; prefill eta_c and per-chunk
overhead) minimise the squared log-error of TTFT and TPOT over the fit architectures, by
scipy's least squares in log-parameter space (so they stay positive). The prediction stays the
analytic formula, hence differentiable for the search. Validation: architectures never used in
the fit; per metric MAPE, max error, share within +-10% and Spearman rank correlation.
A fitted model lives in a versioned JSON file under results/cost_models/.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autocompress.arch.space import Architecture, SearchSpace
from autocompress.config.metrics import ENGINE_MEASURED
from autocompress.config.schema import Hardware, Workload
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.base import ArchDistribution, CostModel
from autocompress.errors import ConfigError
from autocompress.io import write_text

FITTED = (
    "eta_compute",
    "eta_memory",
    "step_overhead_ms",
    "block_overhead_us",
    "prefill_eta_compute",
    "prefill_overhead_ms",
    "gemm_half_rows",
    "prefill_attn_eta",
    "prefill_block_overhead_us",
)
PEAKS = ("peak_tflops", "mem_bandwidth_gbs")
MEASURED_TERMS = ("memory_overhead_gib",)  # read off the measurements, not fitted (CPU engines: the runtime's baseline RSS)
UPPER = {  # upper bounds of the fit: efficiencies are shares of a peak
    "eta_compute": 1.0,
    "eta_memory": 1.0,
    "step_overhead_ms": 1e4,
    "block_overhead_us": 1e6,
    "prefill_eta_compute": 1.0,
    "prefill_overhead_ms": 1e5,
    "gemm_half_rows": 1e4,
    "prefill_attn_eta": 1.0,
    "prefill_block_overhead_us": 1e6,
}
VALIDATED = ENGINE_MEASURED  # the fit is validated on what the engine measured (config.metrics)


@dataclasses.dataclass
class Measurement:
    """One measured (architecture, workload) point."""

    arch: Architecture
    workload: Workload
    values: dict[str, float]  # measured ttft_ms, tpot_ms, throughput_tok_s, kv_capacity_tokens


def with_terms(hardware: Hardware, parameters: dict[str, float]) -> Hardware:
    """`hardware` with a fit's terms, the peaks they were fitted against and the terms read off the measurements
    (other keys of `parameters` ignored)."""
    terms: dict[str, Any] = {k: v for k, v in parameters.items() if k in (*FITTED, *PEAKS, *MEASURED_TERMS)}
    return dataclasses.replace(hardware, **terms)


class FittedCostModel(CostModel):
    """AnalyticCostModel with fitted hardware terms; knows the ranges it was fitted on."""

    def __init__(self, space: SearchSpace, hardware: Hardware, workload: Workload, record: dict[str, Any]) -> None:
        self.space, self.record = space, record
        self.workload = workload
        shapes = {w["name"]: (w["prompt_len"], w["output_len"], w["concurrency"]) for w in record.get("workloads", [])}
        own = shapes.get(workload.name) == (workload.prompt_len, workload.output_len, workload.concurrency)
        by_workload = record.get("by_workload", {}).get(workload.name) if own else None
        self.parameters: dict[str, float] = by_workload or record["parameters"]
        # the peaks the terms were fitted against (a CPU's measured peaks may be re-measured since); a
        # workload fitted on its own (same name and shape) uses its own terms
        self._inner = AnalyticCostModel(space, with_terms(hardware, self.parameters), workload)

    @property
    def id(self) -> str:
        """fitted/<hardware>/<engine>/v<n>, then /aiconfigurator for a fit to its kernel estimates and
        /derived:<system> when those estimates were of another GPU (the efficiencies carried over)."""
        out = f"fitted/{self.record['hardware']}/{self.record['engine']}/v{self.record['version']}"
        if self.record.get("source_kind") == "aiconfigurator":
            out += "/aiconfigurator"
        if self.record.get("derived_from"):
            out += f"/derived:{self.record['derived_from']}"
        return out

    def expected(self, dist: ArchDistribution) -> dict[str, torch.Tensor]:
        return self._inner.expected(dist)

    def extrapolates(self, arch: Architecture) -> bool:
        """Outside the fitted workloads' prompt/output/concurrency ranges or the measured ranges of parameters,
        query heads, hidden size, kept attention / FFN blocks and KV heads summed over layers (files fitted before a coordinate was
        recorded skip it; before the query-head axis: the base count only)."""
        ranges, wl = self.record["ranges"], self.workload
        points = {"prompt_len": wl.prompt_len, "output_len": wl.output_len, "concurrency": wl.concurrency, **_shape(arch)}
        heads = ranges.get("query_heads", [self.space.base.num_attention_heads] * 2)
        return any(not lo <= points[k] <= hi for k, (lo, hi) in {**ranges, "query_heads": heads}.items() if k in points)

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "file": self.record.get("file"),
            "validation": self.record.get("validation"),
            "parameters": self.parameters,
        }


# --------------------------------------------------------------------------- fitting


def _predict(space: SearchSpace, hardware: Hardware, m: Measurement) -> dict[str, float]:
    return AnalyticCostModel(space, hardware, m.workload).predict(m.arch)


def predictions(space: SearchSpace, hardware: Hardware, data: Sequence[Measurement]) -> list[dict[str, float]]:
    """The model's prediction for each measurement's architecture and workload, in order."""
    return [_predict(space, hardware, m) for m in data]


def fit_parameters(
    space: SearchSpace,
    hardware: Hardware,
    data: Sequence[Measurement],
    prior_weight: float = 0.3,
    gemm_prior_weight: float = 0.05,
    fixed: Sequence[str] = (),
    robust: float | None = None,
) -> dict[str, float]:
    """Least-squares fit of the FITTED terms on log(TTFT) and log(TPOT), pulled towards the hardware config's values.

    The pull (prior_weight * log(value / prior) per term, a Gaussian prior in log space) keeps terms
    that few measurements cannot pin down near their datasheet-based priors; with many
    measurements the data dominate. `fixed` terms keep their starting values (e.g. the per-step
    overheads when the data are kernel estimates that have none). `robust` = a log-error scale
    (0.1 ~ 10 %) past which residuals count less (Cauchy loss): a few points the analytic form
    cannot follow (a table entry far off its neighbours) then do not pull the rest off.
    """
    from scipy.optimize import least_squares

    start = {k: getattr(hardware, k) for k in FITTED}
    start["prefill_eta_compute"] = start["prefill_eta_compute"] or hardware.eta_compute
    start["prefill_overhead_ms"] = hardware.step_overhead_ms if start["prefill_overhead_ms"] is None else start["prefill_overhead_ms"]
    start["prefill_attn_eta"] = start["prefill_attn_eta"] or start["prefill_eta_compute"]
    start["prefill_block_overhead_us"] = start["prefill_block_overhead_us"] or hardware.block_overhead_us
    start["gemm_half_rows"] = start["gemm_half_rows"] or 1.0  # no prior knowledge: start at one row ...
    free = [k for k in FITTED if k not in fixed]
    x0 = np.log(np.maximum([start[k] for k in free], 1e-6))
    pull = np.array([gemm_prior_weight if k == "gemm_half_rows" else prior_weight for k in free])  # ... and pull it only weakly

    def params(x: np.ndarray) -> dict[str, float]:
        values = {**start, **dict(zip(free, np.exp(x).tolist(), strict=True))}
        for key in ("eta_compute", "eta_memory", "prefill_eta_compute", "prefill_attn_eta"):
            values[key] = min(values[key], 1.0)
        return values

    def residuals(x: np.ndarray) -> np.ndarray:
        hw = dataclasses.replace(hardware, **params(x))  # type: ignore[arg-type]
        out = []
        for m in data:
            pred = _predict(space, hw, m)
            out += [np.log(pred[k] / m.values[k]) for k in ("ttft_ms", "tpot_ms")]
        out += list(pull * (x - x0))
        return np.asarray(out)

    upper = np.log([UPPER[k] for k in free])
    loss = {"loss": "cauchy", "f_scale": robust} if robust else {}
    bounds = (np.log(1e-6) * np.ones(len(free)), upper)
    result = least_squares(residuals, np.minimum(x0, upper - 1e-9), bounds=bounds, x_scale=1.0, **loss)
    return params(result.x)


def validate(space: SearchSpace, hardware: Hardware, data: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    """Per metric: MAPE (%), max |error| (%), share within +-10% (%), Spearman rank correlation, n."""
    return validate_each(space, [(hardware, m) for m in data])


def validate_each(space: SearchSpace, pairs: Sequence[tuple[Hardware, Measurement]]) -> dict[str, dict[str, float]]:
    """`validate` where each measurement has its own fitted terms (per-workload fits pooled)."""
    from scipy.stats import spearmanr

    out: dict[str, dict[str, float]] = {}
    preds = [_predict(space, hw, m) for hw, m in pairs]
    for key in VALIDATED:
        found = [
            (p[key], m.values[key])
            for p, (_, m) in zip(preds, pairs, strict=True)
            if m.values.get(key) is not None and np.isfinite(m.values[key])
        ]
        if not found:
            continue
        pred, meas = np.array(found).T
        err = np.abs(pred - meas) / meas * 100
        rho = float(spearmanr(pred, meas).statistic) if len(found) > 2 and np.ptp(meas) > 0 else float("nan")
        out[key] = {
            "mape": float(err.mean()),
            "max_error": float(err.max()),
            "within_10": float((err <= 10).mean() * 100),
            "spearman": rho,
            "n": len(found),
        }
    return out


def ranges(data: Sequence[Measurement]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {key: [] for key in RANGED}
    for m in data:
        for key, value in _shape(m.arch).items():
            values[key].append(value)
        values["prompt_len"].append(m.workload.prompt_len)
        values["output_len"].append(m.workload.output_len)
        values["concurrency"].append(m.workload.concurrency)
    return {k: [float(min(v)), float(max(v))] for k, v in values.items()}


RANGED = (
    "prompt_len",
    "output_len",
    "concurrency",
    "params",
    "query_heads",
    "hidden_size",
    "attention_blocks",
    "ffn_blocks",
    "kv_heads",
)


def _shape(arch: Architecture) -> dict[str, float]:
    """The architecture's coordinates a fit's ranges cover (besides the workload's)."""
    return {
        "params": arch.num_params(),
        "query_heads": arch.num_attention_heads,
        "hidden_size": arch.hidden_size,
        "attention_blocks": sum(1 for b in arch.blocks if b.kv_heads),  # kept blocks: the no-op pattern's extent
        "ffn_blocks": sum(1 for b in arch.blocks if b.ffn),
        "kv_heads": sum(b.kv_heads for b in arch.blocks),  # the KV mix: what the KV cache and decode reads scale with
    }


# --------------------------------------------------------------------------- files


SHIPPED = Path(__file__).resolve().parent / "fits"  # fits shipped with the package (cost_model=auto falls back to them)


def model_dir(results_dir: str | Path) -> Path:
    return Path(results_dir) / "cost_models"


def _stem(hardware: str, engine: str) -> str:
    return f"{hardware}__{engine}"


def save_record(record: dict[str, Any], results_dir: str | Path) -> Path:
    """Write the next version of this hardware + engine's fitted model; returns its path."""
    folder = model_dir(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = _stem(record["hardware"], record["engine"])
    versions = [int(p.stem.rsplit("__v", 1)[1]) for p in folder.glob(f"{stem}__v*.json")]
    record = {**record, "version": max(versions, default=0) + 1, "created": dt.datetime.now().isoformat(timespec="seconds")}
    path = folder / f"{stem}__v{record['version']}.json"
    return write_text(json.dumps(record, indent=2) + "\n", path)


def records(results_dir: str | Path | None, hardware: str, engine: str) -> list[dict[str, Any]]:
    """Every fitted model of this hardware + engine in `results_dir`/cost_models (None: the ones shipped
    in the package, autocompress/cost/fits), oldest version first."""
    folder = SHIPPED if results_dir is None else model_dir(results_dir)
    files = sorted(folder.glob(f"{_stem(hardware, engine)}__v*.json"), key=lambda p: int(p.stem.rsplit("__v", 1)[1]))
    return [load_record(f) for f in files]


def latest_record(results_dir: str | Path | None, hardware: str, engine: str, cpu: str | None = None) -> dict[str, Any] | None:
    """The newest fit of this hardware + engine; with `cpu`, the newest fitted on that CPU (files without one never match)."""
    found = [r for r in records(results_dir, hardware, engine) if cpu is None or r.get("cpu") == cpu]
    return found[-1] if found else None


def load_record(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cost model file {path} cannot be read ({exc}); refit it with python -m autocompress.profile") from exc
    missing = {"hardware", "engine", "version", "parameters", "ranges"} - set(record)
    if missing:
        raise ConfigError(f"cost model file {path} lacks {sorted(missing)}; refit it with python -m autocompress.profile")
    record["file"] = str(path)
    return record
