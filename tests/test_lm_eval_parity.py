"""Parity with lm-evaluation-harness itself: the same local items through lm-eval's own request building and scoring
(task YAMLs over local data files, its HFLM wrapper) and through this project's scorer, item by item.

The YAMLs below are lm-eval 0.4.13's task definitions (lm_eval/tasks/<task>/*.yaml) with the hub dataset replaced by
the local file and the field names mapped to the local files' (../shared/data/PROVENANCE.md); where a local file
lacks what lm-eval's `process_docs` needs (HellaSwag's split ctx_a / ctx_b, PIQA's labels in a second file), the test
writes the first N items as JSON lines with lm-eval's own preprocessing applied. sciq_closedbook is lm-eval's sciq
template without `{{support}}` (the local file has none). Both sides score the same SmolLM2-135M in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autocompress.quality.evaluation import EvalSpec
from autocompress.quality.loglik import encode_item, loglikelihoods
from autocompress.quality.tasks import TASKS, default_tasks, load_items

from .conftest import SHARED_DATA

N = 100  # the first N items of each benchmark
TOL = 2e-3  # nats: both sides run the same fp32 forward, in different batches and paddings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SHARED_DATA / "benchmarks").is_dir(), reason=f"evaluation data not found at {SHARED_DATA}"),
]

MC = "output_type: multiple_choice\ntest_split: test\n"
TEMPLATES = {  # task -> (data file written for lm-eval or None = the local file as it is, YAML body)
    "arc_easy": (None, MC + 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: gold\ndoc_to_choice: "{{choices}}"\n'),
    "arc_challenge": (None, MC + 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: gold\ndoc_to_choice: "{{choices}}"\n'),
    "piqa": ("piqa", MC + 'doc_to_text: "Question: {{goal}}\\nAnswer:"\ndoc_to_target: label\ndoc_to_choice: "{{[sol1, sol2]}}"\n'),
    "hellaswag": ("hellaswag", MC + 'doc_to_text: "{{query}}"\ndoc_to_target: "{{gold}}"\ndoc_to_choice: "choices"\n'),
    "winogrande": (
        None,
        MC + "doc_to_text: !function utils.wg_text\ndoc_to_target: !function utils.wg_target\ndoc_to_choice: !function utils.wg_choice\n",
    ),
    "openbookqa": (None, MC + 'doc_to_text: query\ndoc_to_target: gold\ndoc_to_choice: "{{choices}}"\n'),
    "sciq_closedbook": (None, MC + 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: gold\ndoc_to_choice: "{{choices}}"\n'),
    "lambada_openai": (
        None,
        'output_type: loglikelihood\ntest_split: test\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{\' \' + continuation.strip()}}"\n'
        'target_delimiter: ""\n',
    ),
}
UTILS = """
def wg_text(doc):  # lm-eval's winogrande: the gold index stands for the text (one context per choice)
    return doc["gold"]


def wg_choice(doc):
    return doc["context_options"]


def wg_target(doc):
    return doc["continuation"].strip()
"""


def _data_file(task: str, kind: str | None, root: Path, tmp: Path) -> Path:
    """The local file lm-eval reads: the shared one, or its first N items as JSON lines where lm-eval needs other fields."""
    if kind is None:
        return root / TASKS[task].files[0]
    path = tmp / f"{task}.jsonl"
    if kind == "piqa":
        rows = [json.loads(line) for line in (root / TASKS[task].files[0]).read_text().splitlines()[:N]]
        labels = (root / TASKS[task].files[1]).read_text().split()[:N]
        lines = [json.dumps({**r, "label": int(lab)}) for r, lab in zip(rows, labels, strict=True)]
    else:  # hellaswag: 6 lines per item; lm-eval's own `preprocess` on the query and every ending (its process_docs)
        from lm_eval.tasks.hellaswag.utils import preprocess

        text = (root / TASKS[task].files[0]).read_text().splitlines()[: 6 * N]
        lines = [
            json.dumps({"query": preprocess(text[i]), "choices": [preprocess(e) for e in text[i + 2 : i + 6]], "gold": int(text[i + 1])})
            for i in range(0, len(text), 6)
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from autocompress.config.schema import ModelSpec
    from autocompress.model.base import load_base_model

    return load_base_model(ModelSpec(name="smollm2_135m", source="smollm2_gguf"))


@pytest.fixture(scope="module")
def lm_eval_samples(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """lm-eval's per-document samples (log_samples) of every benchmark, first N items, through task YAMLs on local files."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'autocompress[lm-eval]')")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tmp = tmp_path_factory.mktemp("lm_eval_tasks")
    (tmp / "utils.py").write_text(UTILS)
    for task, (kind, body) in TEMPLATES.items():
        data = _data_file(task, kind, SHARED_DATA, tmp)
        head = f"task: parity_{task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        norm = TASKS[task].headline == "acc_norm"  # as lm-eval's YAMLs: winogrande and lambada have acc only
        metrics = "metric_list:\n  - metric: acc\n" + ("  - metric: acc_norm\n" if norm else "")
        (tmp / f"parity_{task}.yaml").write_text(head + body + metrics)
    lm = HFLM(pretrained=smollm2.model, tokenizer=smollm2.tokenizer, batch_size=64, max_length=2048)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[f"parity_{t}" for t in TEMPLATES],
        task_manager=TaskManager(include_path=str(tmp), include_defaults=False),
        limit=N,
        log_samples=True,
        num_fewshot=0,
        bootstrap_iters=0,
    )
    return {t: sorted(out["samples"][f"parity_{t}"], key=lambda s: s["doc_id"]) for t in TEMPLATES}


def _ours(smollm2: Any, items: list[Any]) -> list[list[tuple[float, bool]]]:
    """This project's (log-likelihood, greedy) of every request of `items`, through its own encoding and batching."""
    spec = EvalSpec(tasks=(items[0].task,))
    groups = [encode_item(smollm2.tokenizer, it) for it in items]
    results = loglikelihoods(smollm2.model, [g for gs in groups for g in gs], spec.batch_tokens, spec.max_length, progress=False)
    out, start = [], 0
    for gs in groups:
        out.append([r for group in results[start : start + len(gs)] for r in group])
        start += len(gs)
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


@pytest.mark.parametrize("task", default_tasks("local"))
def test_the_scorer_picks_what_lm_eval_picks_on_every_item(task: str, smollm2: Any, lm_eval_samples: dict[str, Any]) -> None:
    """Equal per-item choices (acc's argmax; acc_norm's, by characters of the answer, where the task reports it; LAMBADA:
    whether the target is the greedy continuation), and log-likelihoods equal to within TOL."""
    samples = lm_eval_samples[task]
    items = sorted(load_items(task, "local", SHARED_DATA), key=lambda it: it.index)[:N]
    ours = _ours(smollm2, items)
    assert len(samples) == len(ours) == N
    worst, differ = 0.0, []
    for item, mine, sample in zip(items, ours, samples, strict=True):
        theirs = [(float(r[0]), bool(r[1])) for r in sample["filtered_resps"]]
        assert len(theirs) == len(mine), f"{task} item {item.index}: {len(theirs)} requests in lm-eval, {len(mine)} here"
        worst = max(worst, *(abs(a[0] - b[0]) for a, b in zip(mine, theirs, strict=True)))
        if TASKS[task].kind == "last_word":
            if mine[0][1] != theirs[0][1] or float(sample["acc"]) != float(mine[0][1]):
                differ.append((item.index, mine[0][1], theirs[0][1]))
            continue
        lls, lm_lls = [ll for ll, _ in mine], [ll for ll, _ in theirs]
        picks, lm_picks = [_argmax(lls)], [_argmax(lm_lls)]
        scored = [float(sample["acc"])]
        if "acc_norm" in sample:
            chars = [len(c) for c in item.choices]
            picks.append(_argmax([ll / n for ll, n in zip(lls, chars, strict=True)]))
            lm_picks.append(_argmax([ll / n for ll, n in zip(lm_lls, chars, strict=True)]))
            scored.append(float(sample["acc_norm"]))
        if picks != lm_picks or scored != [float(p == item.gold) for p in picks]:
            differ.append((item.index, picks, lm_picks, scored))
    assert worst < TOL, f"{task}: log-likelihoods differ by up to {worst:.2g} nats"
    assert not differ, f"{task}: items scored differently (index, ours, lm-eval's): {differ}"
