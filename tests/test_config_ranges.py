"""Every numeric setting has a documented valid range, checked up front (issue 46), and every key is documented
(docs/configuration.md, issue 45 item 7).

The numeric fields are found by introspecting the settings dataclasses each command builds; each is fed -1, 0, nan,
inf, 1e308, a word, an empty value, null and the edges of its range (autocompress.config.ranges) through the path the
commands take (the composed config, then `build` / `scenario_from_dict`): a value inside the range is accepted, any
other is one ConfigError naming the key, never another exception. The doc's rows are checked against the composed
config, the dataclasses and the same range table, so neither can drift.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from autocompress.baselines.comparison import CompareSpec
from autocompress.config.build import build, scenario_from_dict
from autocompress.config.compose import CONF_DIR, compose_dict
from autocompress.config.metrics import ABSOLUTE_RANGE, METRICS, RELATIVE_RANGE
from autocompress.config.ranges import RANGES, Range, range_of
from autocompress.config.schema import DataSpec, Hardware, ModelSpec, ProfileSpec, SearchSpec, SweepSpec, Workload
from autocompress.errors import ConfigError
from autocompress.quality.distillation import DistillSpec
from autocompress.quality.evaluation import EvalSpec

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "search": SearchSpec,
    "sweep": SweepSpec,
    "profile": ProfileSpec,
    "distill": DistillSpec,
    "evaluate": EvalSpec,
    "compare": CompareSpec,
    "data": DataSpec,
    "hardware": Hardware,
    "workload": Workload,
}
SCENARIO = ("+scenario=h100_batched", "model=tiny_llama")  # tiny_llama: the model section's shape checks apply
# In-range values another key's rule may still refuse (with a message naming the key): context_len >= prompt_len +
# output_len, heads that divide the hidden size into an even head size, shares that leave calibration documents.
CROSS = {
    "workload.prompt_len",
    "workload.output_len",
    "workload.context_len",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.num_key_value_heads",
    "data.select_share",
    "data.report_share",
    "data.test_share",
}


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str  # as in the composed config
    owner: type  # the settings dataclass holding it
    name: str  # its field there
    hint: Any  # the field's type

    @property
    def kind(self) -> type | None:
        """int or float for a numeric setting (or a tuple of them), else None."""
        inner = _inner(self.hint)
        if typing.get_origin(inner) is tuple:
            inner = typing.get_args(inner)[0]
        return inner if inner in (int, float) else None

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.hint)

    @property
    def is_tuple(self) -> bool:
        return typing.get_origin(_inner(self.hint)) is tuple


def _inner(hint: Any) -> Any:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def settings(cls: type, prefix: str) -> Iterator[Setting]:
    """Every field of `cls` and of the dataclasses nested in it, by its composed-config key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from settings(hints[f.name], key)
        elif key != "sweep.ray_address":  # ray.address in the composed config
            yield Setting(key, cls, f.name, hints[f.name])


ALL = [s for section, cls in SECTIONS.items() for s in settings(cls, section)]
NUMERIC = [s for s in ALL if s.kind is not None]


@pytest.fixture(scope="module")
def composed() -> dict[str, Any]:
    return compose_dict(*SCENARIO)


def _build(cfg: dict[str, Any], section: str) -> None:
    """The section as its commands build it."""
    if section in ("hardware", "workload"):
        scenario_from_dict(cfg)
    else:
        build(SECTIONS[section], cfg.get(section) or {}, section)


def _with(cfg: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    *path, last = key.split(".")
    node = out
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _edges(rng: Range, kind: type) -> list[Any]:
    """The range's ends, the values just past them, and one inside."""
    if kind is int:
        return [int(rng.low), int(rng.high), int(rng.low) - 1, int(rng.high) + 1, *rng.also, (int(rng.low) + int(rng.high)) // 2]
    step = 1e-9 * max(1.0, abs(rng.low), abs(rng.high))
    return [rng.low, rng.high, rng.low - step, rng.high + step, *rng.also, (rng.low + rng.high) / 2]


def _valid(setting: Setting, rng: Range, value: Any) -> bool:
    if value is None:
        return setting.optional
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    if setting.kind is int and not float(value).is_integer():
        return False
    return value in rng


FUZZ = [-1, 0, math.nan, math.inf, -math.inf, 1e308, "abc", "", None]


@pytest.mark.parametrize("setting", NUMERIC, ids=[s.key for s in NUMERIC])
def test_every_number_is_accepted_in_its_range_and_refused_by_name_outside_it(setting: Setting, composed: dict[str, Any]) -> None:
    rng = range_of(setting.owner, setting.name)
    assert rng is not None, f"{setting.key} has no range in autocompress.config.ranges.RANGES; add one (and to {DOC.name})"
    section = setting.key.split(".")[0]
    _build(composed, section)  # the shipped value passes
    for value in [*FUZZ, *_edges(rng, setting.kind or float)]:
        cfg = _with(composed, setting.key, [value] if setting.is_tuple and value is not None else value)
        valid = _valid(setting, rng, value)
        try:
            _build(cfg, section)
        except ConfigError as exc:
            assert setting.key in str(exc), f"{setting.key}={value!r}: the message does not name the key: {exc}"
            assert not valid or setting.key in CROSS, f"{setting.key}={value!r} is inside {rng} but refused: {exc}"
            assert "\n" not in str(exc), f"{setting.key}={value!r}: not one line: {exc}"
        except Exception as exc:  # any other type is the bug this test looks for
            pytest.fail(f"{setting.key}={value!r} raised {type(exc).__name__}: {exc}")
        else:
            assert valid, f"{setting.key}={value!r} is outside {rng} but was accepted"


def test_the_range_table_holds_exactly_the_numeric_settings() -> None:
    """No numeric field without a range, no range for a field that is gone; every default inside its range."""
    numeric = {(s.owner.__name__, s.name) for s in NUMERIC}
    table = {(cls, name) for cls, fields in RANGES.items() for name in fields}
    assert numeric - table == set(), "numeric settings without a range"
    assert table - numeric == set(), "ranges of settings that do not exist"
    for s in NUMERIC:
        default = next(f for f in dataclasses.fields(s.owner) if f.name == s.name).default
        rng = range_of(s.owner, s.name)
        assert rng is not None
        for value in default if isinstance(default, tuple) else [default]:
            assert value is dataclasses.MISSING or _valid(s, rng, value), f"{s.key}'s default {value!r} is outside {rng}"


# Through Hydra, as typed on a command line: the same refusals (and `key=` is empty, not "not given").
# Command-line values outside their range, refused by key: rows of the fuzz table (tests/test_bad_inputs.py SETTINGS).


# --------------------------------------------------------------------------- docs/configuration.md


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, node


def _job_config(*overrides: str) -> dict[str, Any]:
    """What `python -m autocompress.sweep OVERRIDES --cfg job` prints (ray.address still its own section)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def documented_keys() -> dict[str, Any]:
    """key -> the default the doc shows: the sweep's `+scenario=h100_batched` config, the keys model=tiny_llama,
    tiny_hybrid_moe and hf add, every field of every settings dataclass (hardware.prefill_*: in no shipped file) and
    every metric a scenario may bound. MISSING where there is no single default."""
    keys: dict[str, Any] = {}
    for model in ("smollm2_135m", "tiny_llama", "tiny_hybrid_moe"):
        for key, value in _leaves(_job_config("+scenario=h100_batched", f"model={model}")):
            keys.setdefault(key, value)
    keys.setdefault("model.path", None)  # model=hf: required (???)
    for s in ALL:
        f = next(f for f in dataclasses.fields(s.owner) if f.name == s.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        keys.setdefault(s.key, list(default) if isinstance(default, tuple) else default)
    for metric in METRICS:
        keys.setdefault(f"scenario.constraints.{metric}", dataclasses.MISSING)
    return keys


def render(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(render(v) for v in value) + "]"
    return str(value)


def expected_range(key: str) -> str | None:
    """The range / choices cell the doc must show (None: free text, not checked)."""
    if key.startswith("scenario.constraints."):
        (rl, rh), (al, ah) = RELATIVE_RANGE, ABSOLUTE_RANGE
        return f"NUMx in [{rl:g}, {rh:g}] or NUM in [{al:g}, {ah:g}]"
    setting = next((s for s in ALL if s.key == key), None)
    if setting is None:
        return None
    rng = range_of(setting.owner, setting.name)
    if rng is not None:
        return f"{'null or ' if setting.optional else ''}{'each in ' if setting.is_tuple else ''}{rng}"
    if typing.get_origin(_inner(setting.hint)) is Literal:
        return ", ".join(str(c) for c in typing.get_args(_inner(setting.hint)))
    return None


ROW = re.compile(r"^\| `([^`]+)` \| (.*?) \| (.*?) \| (.+?) \|$")


def doc_rows() -> dict[str, tuple[str, str, str]]:
    rows: dict[str, tuple[str, str, str]] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def skeleton(key: str, default: Any) -> str:
    """The row to add for an undocumented key (fill in what it does)."""
    shown = "" if default is dataclasses.MISSING else f"`{render(default)}`"
    return f"| `{key}` | {shown} | {expected_range(key) or ''} | WHAT IT DOES |"


def test_every_key_of_the_composed_config_is_documented() -> None:
    rows = doc_rows()
    keys = documented_keys()
    missing = [skeleton(k, v) for k, v in keys.items() if k not in rows]
    assert not missing, f"{DOC} lacks rows for:\n" + "\n".join(missing)
    for key, default in keys.items():
        shown, cell, what = rows[key]
        if default is not dataclasses.MISSING:
            assert shown == f"`{render(default)}`", f"{key}: the doc shows default {shown}, the config has `{render(default)}`"
        want = expected_range(key)
        if want is not None:
            assert cell == want, f"{key}: the doc shows range {cell!r}, the checks enforce {want!r}"
        assert what.strip() and "WHAT IT DOES" not in what, f"{key} has no description"


def test_the_doc_documents_no_key_that_does_not_exist() -> None:
    keys = documented_keys()
    extra = [k for k in doc_rows() if k not in keys and not k.startswith("sweep.definition.")]
    assert not extra, f"{DOC} documents keys no config has: {extra}"


def test_help_config_lists_every_documented_key(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help-config [PREFIX]`: the documented rows from the command line; every key of the composed config is among
    them, and a prefix nothing starts with is one error line, exit 2."""
    from autocompress.config.cliargs import _help_config, help_config

    listed = {line.split(" = ", 1)[0] for line in help_config().splitlines() if " = " in line and not line.startswith(" ")}
    assert set(documented_keys()) <= listed
    assert help_config("search.steps").startswith("search.steps = 96  ([1, 1000000])")
    assert _help_config(["+scenario=x", "--help-config", "sweep.num"]) and "sweep.num_trials = 8" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        _help_config(["--help-config", "nope"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("error: no setting starts with 'nope'")
