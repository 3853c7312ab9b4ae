"""Zero-shot scoring: hand-made items with known log-likelihoods, packed scoring against plain forwards, every benchmark file."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest
import torch

from autocompress.config.build import build
from autocompress.errors import ConfigError
from autocompress.evaluate import main
from autocompress.model.base import ByteTokenizer
from autocompress.quality.evaluation import EvalSpec, choice_metrics, evaluate_model, score_task, task_scores
from autocompress.quality.loglik import encode_item, encode_pair, loglikelihoods
from autocompress.quality.tasks import TASKS, Item, hellaswag_preprocess, load_items, parse_exclude, subset

from .conftest import CONF, SHARED_DATA

needs_data = pytest.mark.skipif(not (SHARED_DATA / "benchmarks").is_dir(), reason=f"evaluation data not found at {SHARED_DATA}")
# examples per file, as ../shared/data/PROVENANCE.md lists them
SIZES = {
    "hellaswag": 10042,
    "piqa": 1838,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "winogrande": 1267,
    "openbookqa": 500,
    "sciq_closedbook": 1000,
    "lambada_openai": 5153,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads


class FixedLM(torch.nn.Module):
    """A language model whose next-byte distribution ignores the context: log p(byte) = LOGP[byte]."""

    def __init__(self, logp: torch.Tensor) -> None:
        super().__init__()
        self.logp = logp

    def get_output_embeddings(self) -> None:
        return None  # no (decoder, head) split: the scorer takes the full logits

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return SimpleNamespace(logits=self.logp.expand(*input_ids.shape, -1))


def fixed_lm(**byte_probs: float) -> FixedLM:
    """Named bytes get the given probabilities, the rest share what is left."""
    p = torch.zeros(256)
    for ch, prob in byte_probs.items():
        p[ord(ch)] = prob
    rest = 1 - sum(byte_probs.values())
    p[p == 0] = rest / int((p == 0).sum())
    return FixedLM(p.log())


def test_acc_and_acc_norm_differ_where_they_should() -> None:
    item = Item("arc_easy", 0, ("Q",) * 2, (" a", " bbbbbbbbbb"), ("a", "bbbbbbbbbb"), gold=1)
    # raw sums prefer the short answer; per character the long one is better
    assert choice_metrics(item, [-2.0, -5.0]) == {"acc": 0.0, "acc_norm": 1.0, "loglik": -5.0}
    assert choice_metrics(item, [-6.0, -5.0])["acc"] == 1.0


def test_acc_norm_divides_by_characters_of_the_answer_without_its_space() -> None:
    # lm-eval: lls / len(choice) over doc_to_choice's texts (characters, no target delimiter)
    accented = Item("piqa", 0, ("Q",) * 2, (" éé", " abc"), ("éé", "abc"), gold=1)
    # per character -3.9/2 < -3.0/3, so "abc"; per UTF-8 byte ("é" is 2) -3.9/4 > -3.0/3 would pick "éé"
    assert choice_metrics(accented, [-3.9, -3.0])["acc_norm"] == 1.0
    assert choice_metrics(accented, [-1.9, -3.0])["acc_norm"] == 0.0  # -0.95 > -1.0: the per-character rule both ways
    # built as a task builds it: the leading space is in the continuation, not in what acc_norm divides by
    arc = TASKS["arc_easy"].from_local(0, {"question": "Q?", "choices": ["a", "bb"], "gold": 1})
    assert arc.continuations == (" a", " bb") and arc.choices == ("a", "bb")
    assert choice_metrics(arc, [-2.0, -3.5])["acc_norm"] == 1.0  # -2/1 < -3.5/2; with the space: -2/2 > -3.5/3


def test_known_log_likelihoods_score_as_lm_eval_defines() -> None:
    model = fixed_lm(**{" ": 0.25, "a": 0.5, "b": 0.125})
    tok, spec = ByteTokenizer(), EvalSpec(batch_tokens=64)
    pairs = [encode_pair(tok, "Q:", " a"), encode_pair(tok, "Q:", " bb")]
    lls = loglikelihoods(model, [(pairs[0][0], [pairs[0][1], pairs[1][1]])], progress=False)[0]
    assert lls[0][0] == pytest.approx(math.log(0.25) + math.log(0.5))
    assert lls[1][0] == pytest.approx(math.log(0.25) + 2 * math.log(0.125))
    assert not lls[0][1] and not lls[1][1]  # greedy needs every token to be the argmax, and the space is not
    items = [
        Item("hellaswag", 0, ("Q:",) * 2, (" a", " bb"), ("a", "bb"), gold=0),  # acc 1, acc_norm 1
        Item("hellaswag", 1, ("Q:",) * 2, (" a", " bbbbbbbbbbbbbbbbbbbb"), ("a", "b" * 20), gold=1),
    ]
    df = score_task(model, tok, items, spec, progress=False)
    assert df["acc"].tolist() == [1.0, 0.0] and df["acc_norm"].tolist() == [1.0, 0.0]
    # LAMBADA: greedy only if every target byte is the argmax ('a'); perplexity = exp(-mean loglik)
    lam = [Item("lambada_openai", i, ("ctx",), (w,), (w.strip(),), 0) for i, w in enumerate(["a", "aa", "ab"])]
    df = score_task(model, tok, lam, spec, progress=False)
    assert df["acc"].tolist() == [1.0, 1.0, 0.0]
    scores = task_scores(df).set_index("metric")
    expected = math.exp(-(math.log(0.5) + 2 * math.log(0.5) + math.log(0.5) + math.log(0.125)) / 3)
    assert scores.loc["perplexity", "value"] == pytest.approx(expected)


def test_encode_pair_moves_trailing_spaces_and_stands_in_for_an_empty_context() -> None:
    tok = ByteTokenizer()
    assert encode_pair(tok, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(tok, "", "xy") == ([0], [120, 121])


def decilm_export(model: Any, tmp_path: Path) -> Any:
    """A heterogeneous pruned checkpoint of `model` (no-op attention in layer 1), loaded back with its own code."""
    from transformers import AutoModelForCausalLM

    from autocompress.arch.importance import rank_units
    from autocompress.arch.space import Architecture, Block
    from autocompress.checkpoints.slicing import write_weights

    base = Architecture.from_llama_config(model.config)
    arch = Architecture(**{**base.__dict__, "hidden_size": 48, "blocks": (Block(2, 64), Block(0, 96), Block(1, 32))})
    write_weights(model, arch, rank_units(model, torch.randint(0, 256, (2, 16)), progress=False), tmp_path / "ck")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "ck", trust_remote_code=True, dtype=torch.float32).eval()


@pytest.mark.parametrize("fmt", ["llama", "decilm"])
def test_packed_choices_score_like_separate_forwards(tiny_model: Any, tmp_path: Path, fmt: str) -> None:
    model = tiny_model if fmt == "llama" else decilm_export(tiny_model, tmp_path)
    tok = ByteTokenizer()
    items = [
        Item("arc_easy", 0, ("Question: why?\nAnswer:",) * 3, (" because", " no", " it is so"), ("because", "no", "it is so"), 0),
        Item("winogrande", 1, ("Anna", "Bob"), (" left.", " left."), ("left.", "left."), 1),
        Item("lambada_openai", 2, ("a long context",), (" word",), ("word",), 0),
    ]
    groups = [g for it in items for g in encode_item(tok, it)]
    assert [len(g[1]) for g in groups] == [3, 1, 1, 1]  # shared context packed; different contexts apart
    for max_length in (2048, 12):  # 12: contexts truncated from the left
        packed = loglikelihoods(model, groups, batch_tokens=40, max_length=max_length, progress=False)
        for (ctx, conts), res in zip(groups, packed, strict=True):
            for cont, (ll, greedy) in zip(conts, res, strict=True):
                ids = torch.tensor([(ctx + cont)[-(max_length + 1) :][:-1]])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids).logits.float(), -1)[0, -len(cont) :]
                target = torch.tensor(cont)
                assert ll == pytest.approx(float(logp.gather(1, target[:, None]).sum()), abs=1e-4)
                assert greedy == bool((logp.argmax(-1) == target).all())


def test_subsets_are_fixed_by_seed() -> None:
    assert subset(100, 10, 0, "piqa") == subset(100, 10, 0, "piqa") != subset(100, 10, 1, "piqa")
    assert subset(100, 10, 0, "piqa") != subset(100, 10, 0, "sciq_closedbook") and subset(5, 10, 0, "x") == list(range(5))


def test_excluded_subsets_leave_only_unseen_items() -> None:
    """A headline's items: drawn from what the subsets used while choosing defaults never held."""
    seen = set(subset(100, 20, 0, "piqa")) | set(subset(100, 50, 0, "piqa"))
    fresh = subset(100, 10, 0, "piqa", exclude=((20, 0), (50, 0)))
    assert len(fresh) == 10 and not set(fresh) & seen
    assert subset(100, 0, 0, "piqa", exclude=((50, 0),)) == sorted(set(range(100)) - set(subset(100, 50, 0, "piqa")))
    with pytest.raises(ConfigError, match="every one of its 50 items"):
        subset(50, 10, 0, "openbookqa", exclude=((500, 0),))
    assert parse_exclude(("200:0", "500:1")) == ((200, 0), (500, 1))
    with pytest.raises(ConfigError, match="not LIMIT:SEED"):
        parse_exclude(("200",))


@needs_data
@pytest.mark.parametrize("task", [t for t in TASKS if TASKS[t].files])
def test_each_benchmark_file_parses(task: str) -> None:
    items = load_items(task, "local", SHARED_DATA)
    assert len(items) == SIZES[task]
    for it in items[:50]:
        assert len(it.contexts) == len(it.continuations) == len(it.choices) >= (2 if TASKS[task].kind == "choice" else 1)
        assert 0 <= it.gold < len(it.choices) and all(c.startswith(" ") and c.strip() for c in it.continuations)
    few = load_items(task, "local", SHARED_DATA, limit=7, seed=3)
    assert [it.index for it in few] == subset(SIZES[task], 7, 3, task)


def test_hub_rows_become_the_same_items_as_local_rows() -> None:
    arc = TASKS["arc_easy"].from_hub(0, {"question": "Q?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "B"})
    assert arc == TASKS["arc_easy"].from_local(0, {"question": "Q?", "choices": ["x", "y"], "gold": 1})
    wino = TASKS["winogrande"].from_hub(0, {"sentence": "Ann beat Bob so _ won.", "option1": "Ann", "option2": "Bob", "answer": "1"})
    assert wino.contexts == ("Ann beat Bob so Ann", "Ann beat Bob so Bob") and wino.continuations == (" won.", " won.") and wino.gold == 0
    lam = TASKS["lambada_openai"].from_hub(0, {"text": "he said hello"})
    assert lam.contexts == ("he said",) and lam.continuations == (" hello",)


SCIQ_ROW = {"question": "Q?", "distractor1": "a", "distractor2": "b", "distractor3": "c", "correct_answer": "d", "support": " Cells."}


def test_sciq_is_lm_evals_with_the_support_passage_and_sciq_closedbook_has_none() -> None:
    sciq = TASKS["sciq"].from_hub(3, SCIQ_ROW)
    # lm-eval's doc_to_text: "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:", choices d1 d2 d3 correct, gold 3
    assert sciq.contexts == ("Cells.\nQuestion: Q?\nAnswer:",) * 4 and sciq.choices == ("a", "b", "c", "d") and sciq.gold == 3
    assert TASKS["sciq"].from_hub(0, {**SCIQ_ROW, "support": ""}).contexts[0] == "\nQuestion: Q?\nAnswer:"
    closed = TASKS["sciq_closedbook"].from_hub(3, SCIQ_ROW)
    assert closed.task == "sciq_closedbook" and closed.contexts[0] == "Question: Q?\nAnswer:"
    assert closed == TASKS["sciq_closedbook"].from_local(3, {"question": "Q?", "choices": ["a", "b", "c", "d"], "gold": 3})
    assert TASKS["sciq"].lm_eval == "sciq" and TASKS["sciq_closedbook"].lm_eval is None


def test_sciq_from_local_files_fails_in_one_line_naming_the_ways_out(tmp_path: Path) -> None:
    for call in (lambda: load_items("sciq", "local", tmp_path), lambda: EvalSpec(tasks=("piqa", "sciq"))):
        with pytest.raises(ConfigError, match=r"no support passage.*use sciq_closedbook.*evaluate\.source=hub") as err:
            call()
        assert "\n" not in str(err.value)
    assert EvalSpec(tasks=("sciq",), source="hub").tasks == ("sciq",)
    with pytest.raises(ConfigError, match="sciq_closedbook has no lm-evaluation-harness task"):
        EvalSpec(tasks=("sciq_closedbook",), source="lm-eval")


def test_cli_refuses_sciq_from_local_files_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("hydra")
    assert main(["no/such/checkpoint", "tasks=piqa,sciq"]) == 2  # the missing checkpoint would fail later, differently
    err = capsys.readouterr().err
    assert err.startswith("error: sciq: the local SciQ file") and err.count("\n") == 1 and "sciq_closedbook" in err


def test_default_tasks_follow_the_source_sciq_closedbook_only_for_local_files() -> None:
    yaml = pytest.importorskip("yaml")
    conf = yaml.safe_load((CONF / "evaluate" / "default.yaml").read_text(encoding="utf-8"))
    local, hub, harness = (build(EvalSpec, {**conf, "source": s}, "evaluate") for s in ("local", "hub", "lm-eval"))
    assert local.tasks == EvalSpec().tasks and len(local.tasks) == 8 and "sciq_closedbook" in local.tasks and "sciq" not in local.tasks
    assert all(TASKS[t].files for t in local.tasks)
    assert hub.tasks == harness.tasks == tuple("sciq" if t == "sciq_closedbook" else t for t in local.tasks)
    assert build(EvalSpec, {**conf, "tasks": ["piqa"]}, "evaluate").tasks == ("piqa",)
    assert build(EvalSpec, {**conf, "tasks": "piqa"}, "evaluate").tasks == ("piqa",)  # evaluate.tasks=piqa, no brackets needed
    assert build(EvalSpec, {**conf, "tasks": "piqa, arc_easy"}, "evaluate").tasks == ("piqa", "arc_easy")


HELLASWAG_LINES = [
    "Roof shingle removal: A man is sitting on a roof. he",
    "3",
    "is using wrap to wrap a pair of skis.",
    "  is ripping [substeps] level tiles off. ",
    "is holding a rubik's cube.",
    "starts pulling up roofing on a roof.",
    "Family Life: How to entertain a toddler. Visit a site like [www.kiddio.org] to find activities. [title] Play.",
    "0",
    *["ends.", "stops.", "waits.", "goes."],
]


def test_hellaswag_local_file_gets_lm_evals_preprocess_and_keeps_ctx_b_as_written(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks" / "hellaswag" / "hellaswag_val_full.txt"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(HELLASWAG_LINES) + "\n", encoding="utf-8")
    first, second = load_items("hellaswag", "local", tmp_path)
    assert first.continuations[1] == " is ripping level tiles off."  # strip, [tag] dropped, double space squeezed
    assert second.contexts[0] == "Family Life: How to entertain a toddler. Visit a site like to find activities.. Play."
    assert hellaswag_preprocess(" a [title]b  [x]c ") == "a. b c"
    # the known difference: lm-eval capitalises ctx_b, which the joined ctx of the local file cannot separate
    hub = TASKS["hellaswag"].from_hub(
        0,
        {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he"}
        | {"endings": HELLASWAG_LINES[2:6], "label": "3"},
    )
    assert hub.contexts[0] == "Roof shingle removal: A man is sitting on a roof. He"
    assert first.contexts[0] == "Roof shingle removal: A man is sitting on a roof. he"
    assert first.continuations == hub.continuations and first.choices == hub.choices and first.gold == hub.gold == 3


@needs_data
def test_the_shared_hellaswag_file_is_cleaned_as_lm_eval_but_keeps_ctx_b_as_written() -> None:
    items = load_items("hellaswag", "local", SHARED_DATA)
    assert items[0].contexts[0] == "Roof shingle removal: A man is sitting on a roof. he"  # lm-eval: "... roof. He"
    toddler = [it for it in items if "How to entertain a toddler." in it.contexts[0]]
    assert toddler and all("[www." not in it.contexts[0] for it in toddler)  # the file keeps "[www.kiddio.org]"; lm-eval drops it


def test_a_missing_file_names_it_and_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"piqa/valid\.jsonl is missing.*evaluate\.data_dir"):
        load_items("piqa", "local", tmp_path)
    with pytest.raises(ConfigError, match="unknown task"):
        EvalSpec(tasks=("piqa", "mmlu"))


def test_lm_eval_route_says_what_to_install(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("hydra")
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)  # as where it is not installed (make test installs it)
    assert main(["some/model", "source=lm-eval", "model=tiny_llama"]) == 2
    assert "pip install 'autocompress[lm-eval]'" in capsys.readouterr().err


@needs_data
def test_cli_writes_parquet_for_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eval"
    assert (
        main(["base", "model=tiny_llama", "limit=3", "tasks=piqa,lambada_openai", "corpus_windows=2", "corpus_seq_len=64", f"out={out}"])
        == 0
    )
    scores = pd.read_parquet(out / "scores.parquet")
    assert set(scores["task"]) == {"piqa", "lambada_openai", "average", "corpus"}
    assert len(pd.read_parquet(out / "items.parquet")) == 6 and "average" in capsys.readouterr().out
    assert main(["base", "model=tiny_llama", "tasks=nope"]) == 2


@needs_data
def test_evaluation_of_a_model_is_deterministic(tiny_model: Any) -> None:
    spec = EvalSpec(tasks=("winogrande", "openbookqa"), limit=4, corpus=None)
    a = evaluate_model(tiny_model, ByteTokenizer(), spec, progress=False)
    b = evaluate_model(tiny_model, ByteTokenizer(), spec, progress=False)
    pd.testing.assert_frame_equal(a.items, b.items)
    assert a.score("average") == pytest.approx((a.score("winogrande") + a.score("openbookqa")) / 2)
