"""AutoCompress: hardware-guided compression of LLMs, with the deployment as the objective.

The commands are `python -m autocompress.<command>` (sweep, profile, verify, export, distill, evaluate, compare,
report). The library's public names, importable from here (loaded on first use, so `import autocompress` stays cheap):

- `compose_spec(*overrides)` -> `RunSpec`: a scenario's typed configuration, as the commands compose it;
- `Architecture`, `SearchSpace`: architectures in nemotron-nas `block_configs` form and the space searched;
- `CostModel`, `get_cost_model`: the serving cost-model interface and the one a scenario uses;
- `run_search`: one differentiable search (no Ray), `prepare`: what a sweep computes once before it;
- `load_run`: a finished sweep's trials and Pareto fronts as pandas DataFrames.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "compose_spec": "autocompress.config.compose",
    "RunSpec": "autocompress.config.schema",
    "Architecture": "autocompress.arch.space",
    "SearchSpace": "autocompress.arch.space",
    "CostModel": "autocompress.cost",
    "get_cost_model": "autocompress.cost",
    "run_search": "autocompress.search.differentiable",
    "prepare": "autocompress.search.prepare",
    "load_run": "autocompress.results.store",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'autocompress' has no attribute {name!r}")
