"""Recovery distillation on the tiny model: it lowers the KL, and an interrupted run resumes from its checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from autocompress.arch.importance import rank_units
from autocompress.arch.space import Architecture, Block
from autocompress.checkpoints.slicing import write_weights
from autocompress.config.schema import DataSpec
from autocompress.distill import main
from autocompress.errors import ConfigError
from autocompress.model.base import ByteTokenizer
from autocompress.quality.distillation import (
    DistillSpec,
    check_not_evaluation_data,
    distill,
    fingerprint,
    kl_loss,
    lr_factor,
    work_dir,
)
from autocompress.quality.tasks import evaluation_paths

DATA = DataSpec(seq_len=32, calib_sequences=4, report_sequences=4)
SPEC = DistillSpec(tokens=12 * 4 * 32, seq_len=32, batch_size=4, lr=3e-3, warmup_steps=2, save_every=4, eval_sequences=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads


@pytest.fixture
def student(tiny_model: Any, tokens: torch.Tensor, tmp_path: Path) -> Path:
    """A heterogeneous pruned checkpoint (DeciLM) of the tiny model, written by the export's own code."""
    base = Architecture.from_llama_config(tiny_model.config)
    arch = Architecture(**{**base.__dict__, "hidden_size": 48, "blocks": (Block(2, 64), Block(0, 96), Block(1, 32))})
    write_weights(tiny_model, arch, rank_units(tiny_model, tokens, progress=False), tmp_path / "pruned")
    return tmp_path / "pruned"


def test_distillation_lowers_the_kl(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    res = distill(student, tmp_path / "out", tiny_model, ByteTokenizer(), DATA, SPEC, progress=False)
    assert res.steps == 12 and res.tokens == 12 * 4 * 32 and res.resumed_from == 0
    assert res.kl_after < 0.8 * res.kl_before, (res.kl_before, res.kl_after)
    summary = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert summary["kl_after"] == pytest.approx(res.kl_after) and summary["data"]["source"] == "stdlib"
    log = (tmp_path / "out" / "distill_log.csv").read_text().splitlines()
    assert log[0].startswith("step,tokens,loss,kl") and len(log) == 13
    assert {"configuration_decilm.py", "modeling_decilm.py", "model.safetensors"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert not work_dir(tmp_path / "out").exists()  # the resumable state goes once the model is written


def test_seeds_train_on_other_windows_and_give_other_models(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    """Each distillation seed is its own run (compare's interval covers seeds): other training windows, same held-out KL text."""
    a = distill(student, tmp_path / "s0", tiny_model, ByteTokenizer(), DATA, SPEC, progress=False)
    b = distill(student, tmp_path / "s1", tiny_model, ByteTokenizer(), DATA, dataclasses.replace(SPEC, seed=1), progress=False)
    assert a.kl_before == pytest.approx(b.kl_before)  # the same report windows measure both
    wa, wb = load_file(str(tmp_path / "s0" / "model.safetensors")), load_file(str(tmp_path / "s1" / "model.safetensors"))
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)
    first = [(tmp_path / d / "distill_log.csv").read_text().splitlines()[1].split(",")[2] for d in ("s0", "s1")]
    assert first[0] != first[1]  # the first step's loss: another batch
    # a seeded run's identity names its windows (a pre-fix seed-1 state or stage is not taken for one); seed 0's does not change
    assert "windows" not in fingerprint(student, SPEC, DATA) and "windows" in fingerprint(student, dataclasses.replace(SPEC, seed=1), DATA)


def test_a_state_belongs_to_its_student_and_teacher(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    """Another checkpoint in the same folder, or another teacher, is another distillation: never resumed."""
    before = fingerprint(student, SPEC, DATA, tiny_model)
    assert fingerprint(student, SPEC, DATA, tiny_model) == before  # stable
    other = tmp_path / "other"
    other.mkdir()
    for f in student.iterdir():
        other.joinpath(f.name).write_bytes(f.read_bytes())
    weights = load_file(str(other / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1.0
    save_file(weights, str(other / "model.safetensors"))
    assert fingerprint(other, SPEC, DATA, tiny_model)["student_digest"] != before["student_digest"]
    param = next(iter(tiny_model.parameters()))
    saved = param.detach().clone()
    with torch.no_grad():
        param.add_(1.0)
    try:
        assert fingerprint(student, SPEC, DATA, tiny_model)["teacher"] != before["teacher"]
    finally:
        with torch.no_grad():
            param.copy_(saved)  # the fixture is shared: restored bit for bit


def test_too_little_text_names_the_distillation_settings(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    too_many = dataclasses.replace(SPEC, tokens=10**7, seed=1)
    with pytest.raises(ConfigError, match=r"for distillation seed 1 .*\(distill\.tokens / distill\.seq_len windows"):
        distill(student, tmp_path / "out", tiny_model, ByteTokenizer(), DATA, too_many, progress=False)


def test_windows_longer_than_the_teachers_positions_are_refused_first(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    long = dataclasses.replace(SPEC, seq_len=tiny_model.config.max_position_embeddings + 1)
    with pytest.raises(ConfigError, match=r"distill\.seq_len=2049 is longer than the teacher's 2048 positions"):
        distill(student, tmp_path / "out", tiny_model, ByteTokenizer(), DATA, long, progress=False)
    assert not (tmp_path / "out").exists()


class Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_from_its_checkpoint(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    whole = distill(student, tmp_path / "whole", tiny_model, ByteTokenizer(), DATA, SPEC, progress=False)

    def stop_at_6(record: dict[str, float]) -> None:
        if record["step"] == 6:
            raise Interrupt

    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        distill(student, out, tiny_model, ByteTokenizer(), DATA, SPEC, progress=False, on_step=stop_at_6)
    assert not out.exists() and (work_dir(out) / "state.pt").exists()  # nothing half-written; state at step 4
    steps: list[float] = []
    res = distill(student, out, tiny_model, ByteTokenizer(), DATA, SPEC, progress=False, on_step=lambda r: steps.append(r["step"]))
    assert res.resumed_from == 4 and steps == list(range(5, 13))  # continues, not from scratch
    assert [r["step"] for r in res.log] == list(range(1, 13)) and res.kl_before == pytest.approx(whole.kl_before)
    got, expected = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "whole" / "model.safetensors"))
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4)


def test_resume_refuses_other_settings(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def stop(record: dict[str, float]) -> None:
        if record["step"] == 5:
            raise Interrupt

    with pytest.raises(Interrupt):
        distill(student, out, tiny_model, ByteTokenizer(), DATA, SPEC, progress=False, on_step=stop)
    other = DistillSpec(**{**SPEC.__dict__, "lr": 1e-3})
    with pytest.raises(ConfigError, match=r"other settings \(distill differ\).*resume=false"):
        distill(student, out, tiny_model, ByteTokenizer(), DATA, other, progress=False)
    res = distill(student, out, tiny_model, ByteTokenizer(), DATA, other, resume=False, progress=False)
    assert res.resumed_from == 0
    with pytest.raises(ConfigError, match="already exists"):
        distill(student, out, tiny_model, ByteTokenizer(), DATA, other, progress=False)


def test_a_stale_state_is_started_over_when_the_caller_owns_the_folder(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    """compare's discard_stale: another seed's (or settings') interrupted state is redone from step 0, never resumed."""
    out = tmp_path / "out"

    def stop(record: dict[str, float]) -> None:
        if record["step"] == 5:
            raise Interrupt

    with pytest.raises(Interrupt):  # an interrupted seed-0 run leaves its state at step 4
        distill(student, out, tiny_model, ByteTokenizer(), DATA, SPEC, progress=False, on_step=stop)
    with pytest.raises(Interrupt):  # the same settings still resume (to step 4, stopped again at 5)
        distill(student, out, tiny_model, ByteTokenizer(), DATA, SPEC, discard_stale=True, progress=False, on_step=stop)
    assert torch.load(work_dir(out) / "state.pt", weights_only=False)["step"] == 4
    seeded = dataclasses.replace(SPEC, seed=1)
    seen: list[float] = []
    res = distill(
        student,
        out,
        tiny_model,
        ByteTokenizer(),
        DATA,
        seeded,
        overwrite=True,
        discard_stale=True,
        progress=False,
        on_step=lambda r: seen.append(r["step"]),
    )
    assert res.resumed_from == 0 and seen[0] == 1
    distill(student, tmp_path / "fresh", tiny_model, ByteTokenizer(), DATA, seeded, progress=False)
    got, expected = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "fresh" / "model.safetensors"))
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # the same model as a run that never saw the stale state


def test_evaluation_data_is_never_distillation_text(tiny_model: Any, student: Path, tmp_path: Path) -> None:
    bench = tmp_path / "shared" / "data"
    (bench / "benchmarks").mkdir(parents=True)
    (bench / "benchmarks" / "piqa.txt").write_text("x " * 1000)
    (bench / "corpora").mkdir()
    (bench / "corpora" / "tinyshakespeare.txt").write_text("y " * 1000)
    forbid = evaluation_paths(bench)
    for path in (bench / "benchmarks", bench, bench / "corpora" / "tinyshakespeare.txt"):  # in it, holding it, the corpus
        text = DataSpec(source="text", path=str(path), seq_len=32)
        with pytest.raises(ConfigError, match="lies in or holds the evaluation data"):
            distill(student, tmp_path / "out", tiny_model, ByteTokenizer(), text, SPEC, progress=False, evaluation_dirs=forbid)
    assert not (tmp_path / "out").exists()
    c4 = bench / "corpora" / "c4_sample"  # the calibration corpus beside them is allowed
    c4.mkdir()
    check_not_evaluation_data(DataSpec(source="jsonl", path=str(c4)), forbid)


def test_loss_and_schedule() -> None:
    logits = torch.randn(2, 3, 11)
    assert float(kl_loss(logits, logits)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(logits, torch.randn(2, 3, 11))) > 0
    spec = DistillSpec(tokens=100 * 32, seq_len=32, batch_size=1, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(s, spec) for s in range(spec.steps)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0 and factors[-1] == pytest.approx(0.1, abs=1e-3)
    with pytest.raises(ConfigError, match=r"distill\.lr"):
        DistillSpec(lr=0)


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nothing"), f"out={tmp_path / 'o'}", "model=tiny_llama"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "give the STUDENT checkpoint folder and out=DIR" in capsys.readouterr().err


def test_ctrl_c_is_one_line_that_says_how_to_resume(
    student: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C during distill: exit 130 and one `interrupted:` line naming the saved state and the rerun, no traceback."""
    import autocompress.distill as distill_mod

    out = tmp_path / "o"

    def ctrl_c(*args: Any, **kwargs: Any) -> None:
        work_dir(out).mkdir()  # as if a save had happened before the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_mod, "distill", ctrl_c)
    monkeypatch.setattr("signal.signal", lambda sig, handler: None)  # the test process keeps its own Ctrl-C
    assert main([str(student), f"out={out}", "model=tiny_llama"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: distillation into") and str(work_dir(out)) in err[0]
    assert "rerun the same command to resume" in err[0]


def test_corrupt_student_is_one_clear_line(student: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose weights or config are damaged: exit 2, one error line naming the folder, nothing written."""
    weights = next(student.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    assert main([str(student), f"out={tmp_path / 'o'}", "model=tiny_llama", "tokens=128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {weights} is damaged or truncated (100 bytes)"), err
    (student / "config.json").write_text("{not json")
    assert main([str(student), f"out={tmp_path / 'o'}", "model=tiny_llama", "tokens=128"]) == 2
    assert f"error: {student / 'config.json'} is not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not work_dir(tmp_path / "o").exists()


def test_next_token_nll_is_torchs_summed_cross_entropy() -> None:
    """The one NLL the search, the hybrid search and the held-out scores share: position t scores token t + 1."""
    from autocompress.model.scores import next_token_nll

    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1), reduction="sum")
    assert next_token_nll(torch.log_softmax(logits, dim=-1), ids) == pytest.approx(float(expected), rel=1e-6)
    shifted = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1), reduction="sum")  # no shift: wrong
    assert next_token_nll(torch.log_softmax(logits, dim=-1), ids) != pytest.approx(float(shifted), rel=1e-3)


def test_heldout_scores_are_the_kl_and_perplexity_by_their_definitions(tiny_model: Any, student: Path) -> None:
    """The test split's two numbers (one log-softmax shared) equal heldout_kl and exp of torch's mean cross-entropy."""
    from transformers import AutoModelForCausalLM

    from autocompress.quality.distillation import heldout_kl, heldout_scores

    pruned = AutoModelForCausalLM.from_pretrained(student, trust_remote_code=True).eval()
    ids = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(2))
    got = heldout_scores(pruned, tiny_model, ids, batch_size=4)  # 4 + 2: a short last batch counts by its tokens
    assert got["kl"] == pytest.approx(heldout_kl(pruned, tiny_model, ids, batch_size=4), rel=1e-6) and got["kl"] > 0
    with torch.no_grad():
        logits = pruned(input_ids=ids).logits.float()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert got["perplexity"] == pytest.approx(float(ce.exp()), rel=1e-5) and got["tokens"] == ids.numel()
