"""The model families AutoCompress prunes: each named once, by the `model_type` its config.json carries (also the
`family` column of trials.parquet), and registered once with the seam the stages call it through.

A family's stages are `module:function` names, imported when a stage first needs them (so this module, at the
bottom of the house, imports none of them):

- `shape(text)`: a trial's `architecture` JSON parsed (ValueError / KeyError / TypeError when it is not one): how
  every command that reads a run folder checks it (results/runcheck.py);
- `prepare(spec, progress=True, on_checked=None)`: the sweep's preparation (base model, space, cost model,
  teacher outputs); returns what `trainable` takes;
- `trainable(spec, prepared)`: the Ray Tune trainable of one trial (`tune.with_parameters(...)`);
- `export(req, row, run)`: write trial `row` of the checked run folder `run` to `req.out` (an ExportRequest);
- `compare(job, run, spec, row)`: compare's Context (model, space, cost model, constraints, text) for that trial;
- `minitron(ctx, settings)`: NVIDIA ModelOpt's Minitron pick for this family (a PickContext, a MinitronSpec).

`per_layer`: the family's trials are Llama-family shapes with per-layer block configs. compare gives only such runs
what needs them: the teacher's hidden states for the probe, engine measurement, Puzzletron and the naive baselines.

A stage a family does not have is refused with its `help` line. Adding a family: one module holding its stages,
one `register(Family(...))` here (docs/hybrid.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from autocompress.errors import ConfigError

LLAMA = "llama"  # dense Llama-family models: the gradient search, Minitron, Puzzletron
HYBRID_MOE = "granitemoehybrid"  # hybrid Mamba-2 / attention / MoE (GraniteMoeHybrid): the exact search of search/moe.py
NEMOTRON_H = "nemotron_h"  # hybrid Mamba-2 / attention / MoE (Nemotron-H, Nemotron 3 Super): planned from its config
DECILM = "nemotron-nas"  # what a heterogeneous Llama export is (DeciLM / NemotronNAS block_configs)

STAGES = ("shape", "prepare", "trainable", "export", "compare", "minitron")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # config.json's model_type
    stages: Mapping[str, str]  # stage -> "module:function"
    help: str = ""  # what to do with a folder of this family where a stage is missing
    per_layer: bool = False  # trials hold per-layer block configs (report draws them; export writes DeciLM)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.stages) - set(STAGES))
        if unknown:
            raise ValueError(f"family {self.name}: unknown stages {unknown}; a family's stages are {', '.join(STAGES)}")

    def stage(self, name: str) -> Callable[..., Any]:
        """The family's function for stage `name`, imported now."""
        target = self.stages.get(name)
        if target is None:
            raise ConfigError(f"{self.name} models have no {name} stage" + (f": {self.help}" if self.help else ""))
        module, _, attr = target.partition(":")
        found: Any = importlib.import_module(module)
        for part in attr.split("."):  # a function, or a class's static method (Architecture.from_json)
            found = getattr(found, part)
        return found


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` known to every stage (a second family of the same name replaces the first)."""
    FAMILIES[family.name] = family
    return family


def family(name: str | None) -> Family:
    """The registered family `name` (a run recorded before the family column: Llama)."""
    if not name or name != name:  # None, "" or NaN from an older trials.parquet
        name = LLAMA
    if name not in FAMILIES:
        raise ConfigError(f"model family {name!r} is not registered; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def with_stage(stage: str) -> tuple[str, ...]:
    """The families that have `stage` (e.g. the model types a sweep takes)."""
    return tuple(name for name, f in FAMILIES.items() if stage in f.stages)


register(
    Family(
        LLAMA,
        {
            "shape": "autocompress.arch.space:Architecture.from_json",
            "prepare": "autocompress.search.prepare:prepare",
            "trainable": "autocompress.search.tune:llama_trainable",
            "export": "autocompress.checkpoints.pipeline:export_llama",
            "compare": "autocompress.baselines.context:llama_context",
            "minitron": "autocompress.baselines.minitron:pick",
        },
        per_layer=True,
    )
)
register(
    Family(
        HYBRID_MOE,
        {
            "shape": "autocompress.arch.moe_pruning:MoEShape.from_json",
            "prepare": "autocompress.search.moe:prepare_moe",
            "trainable": "autocompress.search.moe:moe_trainable",
            "export": "autocompress.checkpoints.moe_export:export_trial",
            "compare": "autocompress.baselines.context:hybrid_context",
            "minitron": "autocompress.baselines.minitron_moe:pick",
        },
        help="GraniteMoeHybrid models: sweep, export and compare take them; distill / evaluate as a checkpoint folder",
    )
)
register(Family(NEMOTRON_H, {}, help="Nemotron-H models are planned from their config: python -m autocompress.plan architecture.path=DIR"))
register(
    Family(DECILM, {}, help="a DeciLM export of a pruned model: evaluate or distill it as a checkpoint; sweep the model it was pruned from")
)
