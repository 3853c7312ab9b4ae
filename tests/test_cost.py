"""Cost-model contract (every implementation passes it) and the roofline formulas by hand."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from autocompress.arch.space import Architecture, Block, SearchSpace
from autocompress.config.schema import Hardware, SpaceSpec, Workload
from autocompress.cost import COST_KEYS, PREDICTED_KEYS, AnalyticCostModel, ArchDistribution, CostModel

from .test_arch import SMOLLM2

H100 = Hardware(name="h100", peak_tflops=989.4, mem_bandwidth_gbs=3350, memory_gib=74.5)
WORKLOADS = [
    Workload(name="batched", prompt_len=1024, output_len=256, concurrency=256, context_len=4096),
    Workload(name="single", prompt_len=16384, output_len=1024, concurrency=1, context_len=32768),
]


def smollm2_space() -> SearchSpace:
    return SearchSpace.from_base(Architecture.from_llama_config(SMOLLM2), SpaceSpec())


def cost_models() -> list[CostModel]:
    return [AnalyticCostModel(smollm2_space(), H100, wl) for wl in WORKLOADS]


def random_indices(space: SearchSpace, rng: random.Random) -> tuple[int, list[int], list[int]]:
    n = space.num_layers
    return (
        rng.randrange(len(space.hidden)),
        [rng.randrange(len(space.attention)) for _ in range(n)],
        [rng.randrange(len(space.ffn)) for _ in range(n)],
    )


@pytest.mark.parametrize("cm", cost_models(), ids=lambda cm: cm.id + "/" + cm.wl.name)
def test_contract_non_negative_and_monotone(cm: CostModel) -> None:
    space, rng = cm.space, random.Random(0)
    for _ in range(10):
        h, att, ffn = random_indices(space, rng)
        q = rng.randrange(len(space.heads))
        costs = cm.predict(space.architecture(h, att, ffn, q))
        assert set(costs) == set(PREDICTED_KEYS) and all(v >= 0 for v in costs.values())
        layer = rng.randrange(space.num_layers)
        grown = [(min(h + 1, len(space.hidden) - 1), att, ffn, q), (h, att, ffn, min(q + 1, len(space.heads) - 1))]
        grown.append((h, [*att[:layer], min(att[layer] + 1, len(space.attention) - 1), *att[layer + 1 :]], ffn, q))
        grown.append((h, att, [*ffn[:layer], min(ffn[layer] + 1, len(space.ffn) - 1), *ffn[layer + 1 :]], q))
        for g in grown:
            bigger = cm.predict(space.architecture(*g))
            for key in ("ttft_ms", "tpot_ms", "memory_gib"):
                assert bigger[key] >= costs[key] * (1 - 1e-12), key
            assert bigger["throughput_tok_s"] <= costs["throughput_tok_s"] * (1 + 1e-12)


@pytest.mark.parametrize("cm", cost_models(), ids=lambda cm: cm.wl.name)
def test_contract_differentiable(cm: CostModel) -> None:
    space = cm.space
    logits = [
        torch.zeros(len(space.hidden), requires_grad=True),
        torch.zeros(space.num_layers, len(space.attention), requires_grad=True),
        torch.zeros(space.num_layers, len(space.ffn), requires_grad=True),
        torch.zeros(len(space.heads), requires_grad=True),
    ]
    assert len(space.heads) > 1
    out = cm.expected(ArchDistribution(*(torch.softmax(t, -1) for t in logits)))
    for key in COST_KEYS:
        grads = torch.autograd.grad(out[key], logits, retain_graph=True)
        assert all(torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads), key
    assert torch.autograd.grad(out["ttft_ms"], logits[3])[0].abs().sum() > 0  # the query-head choice moves prefill time


@pytest.mark.parametrize("cm", cost_models(), ids=lambda cm: cm.wl.name)
def test_expectation_is_exact_for_one_decision(cm: CostModel) -> None:
    """With one layer's FFN uncertain, expected TPOT/TTFT/memory are the probability-weighted costs."""
    space = cm.space
    h, att, ffn, q = space.indices(space.largest())
    probs = torch.softmax(torch.arange(len(space.ffn), dtype=torch.float64), 0)
    dist = ArchDistribution.one_hot(space, space.largest())
    dist.ffn[7] = probs
    expected = cm.expected(dist)
    for key in ("tpot_ms", "ttft_ms", "memory_gib"):
        values = [cm.predict(space.architecture(h, att, [*ffn[:7], o, *ffn[8:]], q))[key] for o in range(len(space.ffn))]
        assert float(expected[key]) == pytest.approx(float(probs @ torch.tensor(values, dtype=torch.float64)), rel=1e-9)
    head_probs = torch.softmax(torch.arange(len(space.heads), dtype=torch.float64), 0)  # the global query-head choice
    dist = ArchDistribution.one_hot(space, space.largest())
    dist.heads = head_probs
    expected = cm.expected(dist)
    for key in ("tpot_ms", "ttft_ms", "memory_gib"):
        values = [cm.predict(space.architecture(h, att, ffn, o))[key] for o in range(len(space.heads))]
        assert float(expected[key]) == pytest.approx(float(head_probs @ torch.tensor(values, dtype=torch.float64)), rel=1e-9)


# one layer (d=64, q=64, kv=2, hd=16, i=96, V=256) priced by hand; 1e9 B/s, no overheads, all memory for the KV cache
HAND = Architecture(hidden_size=64, num_attention_heads=4, head_dim=16, vocab_size=256, tie_word_embeddings=True, blocks=(Block(2, 96),))
HAND_HW = Hardware(
    name="hand",
    peak_tflops=1.0,
    mem_bandwidth_gbs=1.0,
    memory_gib=1.0,
    eta_compute=1.0,
    eta_memory=1.0,
    step_overhead_ms=0.0,
    block_overhead_us=0.0,
    memory_overhead_gib=0.0,
    memory_utilization=1.0,
    max_num_batched_tokens=64,
)


def hand_space() -> SearchSpace:
    return SearchSpace.from_base(HAND, SpaceSpec(hidden_divisor=16, ffn_divisor=32))


def test_roofline_by_hand() -> None:
    """One layer (d=64, q=64, kv=2, hd=16, i=96, V=256), bandwidth-bound decode of one sequence."""
    base, space, hw = HAND, hand_space(), HAND_HW
    wl = Workload(name="hand", prompt_len=8, output_len=4, concurrency=1, context_len=16)
    costs = AnalyticCostModel(space, hw, wl).predict(base)
    # decode at context 8 + 4/2 = 10, bf16 (2 bytes), 1e9 B/s:
    #   attention projections 2*(2*64*64 + 2*64*2*16) = 24576 B; attention core 10*2*2*16*2 = 1280 B;
    #   FFN 2*3*64*96 = 36864 B; LM head 2*64*256 = 32768 B  -> 95488 B = 95.488 us
    assert costs["tpot_ms"] == pytest.approx(95488e-9 * 1e3)
    # prefill of 8 tokens: projections 24576 + KV writes 8*2*2*16*2 = 1024 B (memory-bound: 25.6 us);
    #   core: 2*1*64*8*8 = 8192 FLOP vs 1024 B -> 1.024 us; FFN 36864 B; head 32768 B
    assert costs["ttft_ms"] == pytest.approx((25600 + 1024 + 36864 + 32768) * 1e-9 * 1e3)
    # memory: weights 2 * num_params + KV 16 tokens (context_len) * 2*2*16*2 + workspace 4*(4*64*64 + 1*256)
    weights = 2 * base.num_params()
    assert costs["memory_gib"] == pytest.approx((weights + 16 * 128 + 4 * (4 * 64 * 64 + 256)) / 1024**3)
    assert costs["throughput_tok_s"] == pytest.approx(4 / (costs["ttft_ms"] / 1e3 + 4 * costs["tpot_ms"] / 1e3))


def test_chunked_prefill_rereads_the_kv_of_earlier_chunks() -> None:
    """A 24-token prompt in chunks of 8, compute free (bandwidth-bound by hand): chunk j re-reads the KV of the j*8
    tokens before it, 0 + 8 + 16 = 24 tokens' KV beyond the writes (in every scenario shipped, prefill attention is
    compute-bound by two orders of magnitude, so this term moves no prediction there)."""
    hw = dataclasses.replace(HAND_HW, peak_tflops=1e6, prefill_overhead_ms=0.0, prefill_block_overhead_us=0.0, max_num_batched_tokens=8)
    wl = Workload(name="hand", prompt_len=24, output_len=4, concurrency=1, context_len=32)
    ttft = AnalyticCostModel(hand_space(), hw, wl).predict(HAND)["ttft_ms"]
    kv_token = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, bf16
    # projections: 3 chunks read the weights 3 x 2*12288 B + KV writes 24 tokens; core: KV writes + re-read of 24 tokens;
    # FFN: 3 x 2*3*64*96 B; LM head once: 2*64*256 B
    expected = 3 * 2 * 12288 + 24 * kv_token + (24 + 24) * kv_token + 3 * 36864 + 32768
    assert ttft == pytest.approx(expected * 1e-9 * 1e3)


def test_kv_cache_caps_throughput() -> None:
    """When memory holds fewer sequences than the concurrency, throughput follows what fits."""
    space = smollm2_space()
    big = Workload(name="huge", prompt_len=32000, output_len=768, concurrency=4096, context_len=32768)
    tiny_gpu = Hardware(name="small", peak_tflops=989.4, mem_bandwidth_gbs=3350, memory_gib=16)
    full = AnalyticCostModel(space, tiny_gpu, big).predict(space.largest())
    roomy = AnalyticCostModel(space, Hardware(name="big", peak_tflops=989.4, mem_bandwidth_gbs=3350, memory_gib=16000), big).predict(
        space.largest()
    )
    assert full["throughput_tok_s"] < roomy["throughput_tok_s"]
    assert full["memory_gib"] == pytest.approx(roomy["memory_gib"])  # demand does not depend on capacity


def test_a_gpu_engine_is_given_the_kv_cache_the_cost_model_counts() -> None:
    """On a GPU the engine's KV cache is pinned to the workloads' demand (not gpu_memory_utilization of the device):
    the cost model's KV bytes for the largest workload, plus at most two blocks, so its memory is the architecture's."""
    from autocompress.cost.engine import EngineSettings, kv_pin_bytes, memory_split

    arch = smollm2_space().largest()
    pin = kv_pin_bytes(arch, WORKLOADS, 2, block=64)
    demand = max(w.kv_tokens for w in WORKLOADS) * arch.kv_bytes_per_token(2)
    assert demand + 64 * arch.kv_bytes_per_token(2) <= pin <= demand + 128 * arch.kv_bytes_per_token(2)
    assert kv_pin_bytes(arch, WORKLOADS[1:], 2) < pin  # one 32K-context sequence needs fewer tokens than 256 x 1,280
    gpu = EngineSettings(engine="vllm", dtype="bf16", max_model_len=17408, max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_gib=0)
    kv_tokens = pin // arch.kv_bytes_per_token(2)
    # RSS on a GPU node splits nothing; the device footprint splits into weights, the KV cache, and the rest
    assert memory_split(arch, gpu, kv_tokens, peak_bytes=3 * 2**30) == {}
    split = memory_split(arch, gpu, kv_tokens, peak_bytes=3 * 2**30, device_gib=2.0)
    assert split["weights_gib"] == pytest.approx(arch.num_params() * 2 / 2**30)
    assert split["kv_alloc_gib"] == pytest.approx(pin / 2**30, rel=1e-6)
    # the rest is the device footprint's (2 GiB), not the 3 GiB of host RSS
    assert split["runtime_gib"] == pytest.approx(2.0 - (arch.num_params() * 2 + pin) / 2**30, rel=1e-9)
    assert kv_pin_bytes(arch, WORKLOADS, 2) == kv_pin_bytes(arch, WORKLOADS, 2, block=256)  # the default: any block size divides it


def test_the_engine_accounting_reads_the_workers_tensors_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker mix-in on a GPU (faked: torch.cuda and a runner with vLLM's attribute names): weights from vLLM's load
    figure, KV tensors counted once per storage, the footprint = allocator peak + what lies outside the allocator now."""
    from autocompress.cost.engine import engine_accounting
    from autocompress.cost.vllm_worker import METHOD, MemoryAccounting

    gib = 2**30
    shared = torch.zeros(1024, dtype=torch.bfloat16)  # two layers' views of one storage: 2 KiB once

    class Runner:
        def __init__(self) -> None:
            self.kv_caches = [shared[:512], shared[512:], torch.zeros(256, dtype=torch.float32)]
            self.model_memory_usage = 3 * gib

        def get_model(self) -> torch.nn.Module:
            return torch.nn.Linear(4, 4)

    worker = MemoryAccounting()
    worker.model_runner = Runner()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (70 * gib, 80 * gib))  # 10 GiB used on the device
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 9 * gib)  # 1 GiB outside the allocator
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 12 * gib)

    class LLM:
        def collective_rpc(self, method: str) -> list[dict[str, object]]:
            assert method == METHOD
            return [worker.autocompress_memory()]

    acct = engine_accounting(LLM())
    assert acct["engine_kv_gib"] == pytest.approx((2048 + 1024) / gib) and acct["engine_weights_gib"] == 3.0
    assert acct["device_gib"] == 13.0 and acct["device_total_gib"] == 80.0


def test_the_engine_caches_in_the_workloads_kv_dtype() -> None:
    """A KV dtype other than the model's reaches vLLM as kv_cache_dtype and sizes the pin and the memory split;
    one the engine cannot cache in is refused before anything runs, with the fix."""
    from autocompress.config.schema import vllm_kv_cache_dtype
    from autocompress.cost.engine import cache_kwargs, engine_kv_pin, engine_settings, kv_pin_bytes, memory_split
    from autocompress.errors import ConfigError

    assert vllm_kv_cache_dtype("bf16", None) == vllm_kv_cache_dtype("bf16", "bf16") == "auto"
    assert vllm_kv_cache_dtype("bf16", "fp8") == "fp8" and vllm_kv_cache_dtype("fp32", "bf16") == "bfloat16"
    assert vllm_kv_cache_dtype("fp32", "fp8", "vllm-cpu") == "fp8"
    with pytest.raises(ConfigError, match=r"workload\.kv_dtype='fp32' cannot be served by vllm with dtype='bf16'.*set workload\.kv_dtype"):
        vllm_kv_cache_dtype("bf16", "fp32")
    with pytest.raises(ConfigError, match=r"kv_dtype='bf16' cannot be served by vllm-cpu.*\['fp8'\]"):  # CPU attention: model dtype or fp8
        vllm_kv_cache_dtype("fp32", "bf16", "vllm-cpu")
    fp8 = [dataclasses.replace(w, kv_dtype="fp8") for w in WORKLOADS]
    settings = engine_settings(H100, fp8, kv_cache_gib=0, repeats=1, warmup=0)
    assert settings.kv_dtype == "fp8" and settings.kv_value_bytes == 1
    with pytest.raises(ConfigError, match="must share one kv_dtype"):
        engine_settings(H100, [fp8[0], WORKLOADS[1]], kv_cache_gib=0, repeats=1, warmup=0)
    with pytest.raises(ConfigError, match="kv_dtype='fp32' cannot be served"):
        engine_settings(H100, [dataclasses.replace(w, kv_dtype="fp32") for w in WORKLOADS], kv_cache_gib=0, repeats=1, warmup=0)
    arch = smollm2_space().largest()
    bf16 = engine_settings(H100, WORKLOADS, kv_cache_gib=0, repeats=1, warmup=0)
    # what LLM(...) is given: fp8 cache and a pin of half the bytes; with the model's dtype no kv_cache_dtype at all
    pin8, pin16 = engine_kv_pin(arch, fp8, settings), engine_kv_pin(arch, WORKLOADS, bf16)
    assert pin8 is not None and pin16 is not None and abs(2 * pin8 - pin16) <= 2
    assert pin16 == kv_pin_bytes(arch, WORKLOADS, 2)
    assert cache_kwargs(settings, pin8) == {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "kv_cache_memory_bytes": pin8}
    assert cache_kwargs(bf16, pin16) == {"dtype": "bfloat16", "kv_cache_memory_bytes": pin16}
    cpu = dataclasses.replace(settings, engine="vllm-cpu")
    assert engine_kv_pin(arch, fp8, cpu) is None and cache_kwargs(cpu, None) == {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    tokens = 10_000
    half = memory_split(arch, settings, tokens, peak_bytes=0, device_gib=2.0)["kv_alloc_gib"]
    assert half * 2 == pytest.approx(memory_split(arch, bf16, tokens, peak_bytes=0, device_gib=2.0)["kv_alloc_gib"])
