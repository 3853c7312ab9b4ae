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
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autocompress.arch import Architecture, SearchSpace
from autocompress.config import Hardware, Workload
from autocompress.cost.analytic import AnalyticCostModel
from autocompress.cost.base import ArchDistribution, CostModel
from autocompress.errors import ConfigError

FITTED = (
    "eta_compute",
    "eta_memory",
    "step_overhead_ms",
    "block_overhead_us",
    "prefill_eta_compute",
    "prefill_overhead_ms",
    "gemm_half_rows",
)
PEAKS = ("peak_tflops", "mem_bandwidth_gbs")
VALIDATED = ("ttft_ms", "tpot_ms", "throughput_tok_s", "kv_capacity_tokens")


@dataclasses.dataclass
class Measurement:
    """One measured (architecture, workload) point."""

    arch: Architecture
    workload: Workload
    values: dict[str, float]  # measured ttft_ms, tpot_ms, throughput_tok_s, kv_capacity_tokens


class FittedCostModel(CostModel):
    """AnalyticCostModel with fitted hardware terms; knows the ranges it was fitted on."""

    def __init__(self, space: SearchSpace, hardware: Hardware, workload: Workload, record: dict[str, Any]) -> None:
        self.space, self.record = space, record
        self.workload = workload
        # the peaks the terms were fitted against (a CPU's measured peaks may be re-measured since)
        fitted = {k: record["parameters"][k] for k in (*FITTED, *PEAKS) if k in record["parameters"]}
        self._inner = AnalyticCostModel(space, dataclasses.replace(hardware, **fitted), workload)

    @property
    def id(self) -> str:
        return f"fitted/{self.record['hardware']}/{self.record['engine']}/v{self.record['version']}"

    def expected(self, dist: ArchDistribution) -> dict[str, torch.Tensor]:
        return self._inner.expected(dist)

    def extrapolates(self, arch: Architecture) -> bool:
        """Outside the fitted workloads' prompt/output/concurrency ranges, the fitted parameter range, or the
        query-head counts measured (files fitted before the query-head axis hold none: the base count only)."""
        ranges, wl = self.record["ranges"], self.workload
        points = {"prompt_len": wl.prompt_len, "output_len": wl.output_len, "concurrency": wl.concurrency, "params": arch.num_params()}
        heads = ranges.get("query_heads", [self.space.base.num_attention_heads] * 2)
        points["query_heads"] = arch.num_attention_heads
        return any(not lo <= points[k] <= hi for k, (lo, hi) in {**ranges, "query_heads": heads}.items() if k in points)

    def describe(self) -> dict[str, object]:
        return {
            "id": self.id,
            "file": self.record.get("file"),
            "validation": self.record.get("validation"),
            "parameters": self.record["parameters"],
        }


# --------------------------------------------------------------------------- fitting


def _predict(space: SearchSpace, hardware: Hardware, m: Measurement) -> dict[str, float]:
    return AnalyticCostModel(space, hardware, m.workload).predict(m.arch)


def fit_parameters(
    space: SearchSpace, hardware: Hardware, data: Sequence[Measurement], prior_weight: float = 0.3, gemm_prior_weight: float = 0.05
) -> dict[str, float]:
    """Least-squares fit of the FITTED terms on log(TTFT) and log(TPOT), pulled towards the hardware config's values.

    The pull (prior_weight * log(value / prior) per term, a Gaussian prior in log space) keeps terms
    that few measurements cannot pin down near their datasheet-based priors; with many
    measurements the data dominate.
    """
    from scipy.optimize import least_squares

    start = {k: getattr(hardware, k) for k in FITTED}
    start["prefill_eta_compute"] = start["prefill_eta_compute"] or hardware.eta_compute
    start["prefill_overhead_ms"] = hardware.step_overhead_ms if start["prefill_overhead_ms"] is None else start["prefill_overhead_ms"]
    start["gemm_half_rows"] = start["gemm_half_rows"] or 1.0  # no prior knowledge: start at one row ...
    x0 = np.log(np.maximum([start[k] for k in FITTED], 1e-6))
    pull = np.array([gemm_prior_weight if k == "gemm_half_rows" else prior_weight for k in FITTED])  # ... and pull it only weakly

    def params(x: np.ndarray) -> dict[str, float]:
        values = dict(zip(FITTED, np.exp(x).tolist(), strict=True))
        for key in ("eta_compute", "eta_memory", "prefill_eta_compute"):
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

    upper = np.log([1.0, 1.0, 1e4, 1e6, 1.0, 1e5, 1e4])
    result = least_squares(residuals, np.minimum(x0, upper - 1e-9), bounds=(np.log(1e-6) * np.ones(len(FITTED)), upper), x_scale=1.0)
    return params(result.x)


def validate(space: SearchSpace, hardware: Hardware, data: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    """Per metric: MAPE (%), max |error| (%), share within +-10% (%), Spearman rank correlation, n."""
    from scipy.stats import spearmanr

    out: dict[str, dict[str, float]] = {}
    preds = [_predict(space, hardware, m) for m in data]
    for key in VALIDATED:
        pairs = [
            (p[key], m.values[key])
            for p, m in zip(preds, data, strict=True)
            if m.values.get(key) is not None and np.isfinite(m.values[key])
        ]
        if not pairs:
            continue
        pred, meas = np.array(pairs).T
        err = np.abs(pred - meas) / meas * 100
        rho = float(spearmanr(pred, meas).statistic) if len(pairs) > 2 and np.ptp(meas) > 0 else float("nan")
        out[key] = {
            "mape": float(err.mean()),
            "max_error": float(err.max()),
            "within_10": float((err <= 10).mean() * 100),
            "spearman": rho,
            "n": len(pairs),
        }
    return out


def ranges(data: Sequence[Measurement]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {"prompt_len": [], "output_len": [], "concurrency": [], "params": [], "query_heads": []}
    for m in data:
        values["query_heads"].append(m.arch.num_attention_heads)
        values["prompt_len"].append(m.workload.prompt_len)
        values["output_len"].append(m.workload.output_len)
        values["concurrency"].append(m.workload.concurrency)
        values["params"].append(m.arch.num_params())
    return {k: [float(min(v)), float(max(v))] for k, v in values.items()}


# --------------------------------------------------------------------------- files


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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def records(results_dir: str | Path, hardware: str, engine: str) -> list[dict[str, Any]]:
    """Every fitted model of this hardware + engine, oldest version first."""
    folder = model_dir(results_dir)
    files = sorted(folder.glob(f"{_stem(hardware, engine)}__v*.json"), key=lambda p: int(p.stem.rsplit("__v", 1)[1]))
    return [load_record(f) for f in files]


def latest_record(results_dir: str | Path, hardware: str, engine: str, cpu: str | None = None) -> dict[str, Any] | None:
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
