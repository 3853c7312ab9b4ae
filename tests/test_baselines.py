"""Baselines that could win: homogeneous with every head kept, and greedy sublayer removal, both at the constraint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autocompress.arch.importance import sublayer_order
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.baselines.interface import BASELINES
from autocompress.baselines.naive import greedy_removal
from autocompress.config.metrics import Constraint
from autocompress.config.schema import Hardware, Workload
from autocompress.cost import AnalyticCostModel
from autocompress.cost.base import meets
from autocompress.search.rival import best_homogeneous, homogeneous_full_kv

from .test_minitron import smollm2_setup


def test_homogeneous_full_kv_takes_the_fewest_drops_per_ffn_width() -> None:
    space, cm, cons = smollm2_setup(0.8, 0.8)
    order = [29, 3, 17, *[i for i in range(1, 30) if i not in (29, 3, 17)]]
    found = homogeneous_full_kv(space, order, cm, cons)
    widths = [max(b.ffn for b in a.blocks) for a in found]
    assert found and widths == sorted(set(widths), reverse=True)  # one per FFN width, widest first
    for arch in found:
        kept = {b for b in arch.blocks if b != Block(0, 0)}
        assert len(kept) == 1 and next(iter(kept)).kv_heads == 3 and arch.hidden_size == 576 and arch.num_attention_heads == 9
        costs = cm.predict(arch)
        assert all(c.satisfied(costs[c.metric]) for c in cons)
        n_drop = sum(b == Block(0, 0) for b in arch.blocks)
        assert {i for i, b in enumerate(arch.blocks) if b == Block(0, 0)} == set(order[:n_drop])
        if n_drop:  # one block fewer dropped would miss a constraint
            ffn = next(iter(kept)).ffn
            blocks = tuple(Block(0, 0) if i in order[: n_drop - 1] else Block(3, ffn) for i in range(30))
            fewer = cm.predict(Architecture(**{**arch.__dict__, "blocks": blocks}))
            assert not all(c.satisfied(fewer[c.metric]) for c in cons)


def test_best_homogeneous_measures_only_the_screened_best() -> None:
    """With a screen, only the `keep` best by it are measured; the pick is the lowest measured, even where the screen
    ranked it second."""
    space, cm, cons = smollm2_setup(0.8, 0.8)
    archs = homogeneous_full_kv(space, list(range(29, -1, -1)), cm, cons)
    assert len(archs) > 3
    true_kl = {a: float(i) for i, a in enumerate(archs)}  # the widest is best ...
    screen = {a: -float(i) for i, a in enumerate(archs)}  # ... the screen favours the narrowest, then archs[0] fourth
    screen[archs[0]] = -len(archs) + 1.5  # archs[0] now second by the screen
    measured: list[Architecture] = []

    def kl(a: Architecture) -> float:
        measured.append(a)
        return true_kl[a]

    assert best_homogeneous(archs, kl, screen.__getitem__, keep=3) == (archs[0], 0.0)
    assert len(measured) == 3 and archs[0] in measured and archs[1] not in measured
    assert best_homogeneous(archs, true_kl.__getitem__) == (archs[0], 0.0)  # no screen: every one measured
    assert best_homogeneous([], kl, screen.__getitem__) is None


def test_greedy_removal_stops_at_the_first_feasible_architecture() -> None:
    space, cm, cons = smollm2_setup(0.8, 0.8)
    order = [(kind, i) for i in range(29, -1, -1) for kind in ("ffn", "attention")]
    arch = greedy_removal(space, order, cm, cons)
    assert arch is not None and space.allows(arch) and arch.hidden_size == 576
    costs = cm.predict(arch)
    assert all(c.satisfied(costs[c.metric]) for c in cons)
    removed = [(k, i) for k, i in order if (arch.blocks[i].ffn if k == "ffn" else arch.blocks[i].kv_heads) == 0]
    assert removed == order[: len(removed)]  # a prefix of the order: it stopped as soon as the constraints held
    space, cm, out_of_reach = smollm2_setup(0.01, 0.01)
    assert greedy_removal(space, order, cm, out_of_reach) is None


def test_sublayer_order_covers_every_sublayer(tiny_model: Any, tokens: torch.Tensor) -> None:
    order = sublayer_order(tiny_model, tokens)
    assert sorted(order) == sorted([(k, i) for k in ("attention", "ffn") for i in range(3)])


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_registered_baseline_keeps_the_pick_contract(name: str, tiny_model: Any, tiny_space: SearchSpace) -> None:
    """What compare relies on from any baseline in BASELINES: a pick inside the space that meets every bound, its
    selection-split KL, a ranking the export can slice by, and a summary with the shape per layer."""
    from autocompress.baselines.comparison import CompareSpec

    check_pick_contract(name, CompareSpec().settings_of(name), tiny_model, tiny_space)


def documented_baseline() -> dict[str, Any]:
    """The module docs/baselines.md "Adding a baseline" prints (MineSpec, pick), executed as written."""
    import re
    import textwrap
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "baselines.md").read_text()
    section = doc.split("## Adding a baseline", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict[str, Any] = {}
    exec(textwrap.dedent(code), namespace)
    return namespace


def test_adding_a_baseline_as_documented(tiny_model: Any, tiny_space: SearchSpace, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/baselines.md's three steps: its module (MineSpec, pick: the doc's code, run as written), one BASELINES
    entry, its settings as compare.mine; compare.methods then names it, its settings reach its pick, and it keeps the
    contract."""
    from autocompress.baselines.comparison import job_from_dict, known_methods, title
    from autocompress.baselines.interface import Baseline
    from autocompress.config.compose import compose_dict
    from autocompress.errors import ConfigError

    module = documented_baseline()
    MineSpec = module["MineSpec"]
    monkeypatch.setitem(BASELINES, "mine", Baseline(module["pick"], "Mine", settings=MineSpec))
    common = ["+scenario=cpu_interactive", "model=tiny_llama", "compare.methods=[autocompress,mine]"]
    job = job_from_dict(compose_dict(*common, "+compare.mine.importance_sequences=4"))
    assert "mine" in known_methods() and title("mine") == "Mine" and job.compare.resolved_methods(False) == ("autocompress", "mine")
    assert job.compare.settings_of("mine") == MineSpec(4)
    assert job_from_dict(compose_dict(*common)).compare.settings_of("mine") == MineSpec()  # no compare.mine: its defaults
    with pytest.raises(ConfigError, match=r"unknown key\(s\) compare\.mine\.importance_sequencez"):
        job_from_dict(compose_dict(*common, "+compare.mine.importance_sequencez=4"))
    check_pick_contract("mine", job.compare.settings_of("mine"), tiny_model, tiny_space)


def check_pick_contract(name: str, settings: Any, tiny_model: Any, tiny_space: SearchSpace) -> None:
    from autocompress.arch.importance import teacher_hidden
    from autocompress.baselines.interface import PickContext

    hw = Hardware(name="cpu", peak_tflops=0.1, mem_bandwidth_gbs=20, memory_gib=16, step_overhead_ms=0, block_overhead_us=0)
    cm = AnalyticCostModel(tiny_space, hw, Workload(name="w", prompt_len=64, output_len=16, concurrency=2, context_len=128))
    cons = (Constraint("ttft_ms", 0.8 * cm.predict(tiny_space.largest())["ttft_ms"]),)
    calib = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    select = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    ctx = PickContext(tiny_model, tiny_space, cm, cons, calib, select, teacher_hidden(tiny_model, select, progress=False), progress=False)
    pick = BASELINES[name].pick(ctx, settings)
    assert tiny_space.allows(pick.arch) and meets(cm, cons, pick.arch)
    assert pick.kl_select > 0 and pick.label and sorted(pick.ranking.ffn[0].tolist()) == list(range(96))
    summary = pick.summary()
    assert summary["params"] == pick.arch.num_params() and summary["architecture"] == pick.arch.to_json()
    assert summary["table_label"] and summary["kl_select"] == pick.kl_select
    if pick.shape is None:  # the per-layer shape of a heterogeneous pick
        assert len(summary["attention"]) == len(summary["ffn"]) == 3
    else:  # a homogeneous pick names its one width per axis
        assert summary["ffn"] == next(b.ffn for b in pick.arch.blocks if b.ffn)
