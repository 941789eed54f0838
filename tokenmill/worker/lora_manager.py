"""Where LoRA adapters live: the loaded ones (model/lora.py's weights), least
recently used first, and each step's segments of rows by adapter.

At most `max_cpu_loras` adapters are kept loaded; loading one more drops the
least recently used adapter that no unfinished request uses (the engine says
which are in use). Adapters in use are never dropped, so the count may pass
the cap while that many are wanted at once; it falls back as they go idle.
A step holds at most `max_loras` of them: the scheduler's limit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection, Sequence

import torch

from tokenmill.config import LoRAConfig, ModelSpec
from tokenmill.model.lora import LoRAAdapter, LoRABatch, load_adapter
from tokenmill.sampling_params import LoRARequest

logger = logging.getLogger("tokenmill")


class LoRAManager:
    def __init__(self, spec: ModelSpec, config: LoRAConfig, device: torch.device) -> None:
        self.spec = spec
        self.config = config
        self.device = device
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first

    def load(self, lora: LoRARequest, in_use: Collection[int] = ()) -> LoRAAdapter:
        """The adapter of `lora`, read from its path unless loaded (LoRAError if it
        cannot be served); marked most recently used. Idle adapters past the cap
        are dropped (`in_use`: the ids unfinished requests hold)."""
        adapter = self.adapters.get(lora.lora_int_id)
        if adapter is not None:
            if adapter.lora_name != lora.lora_name:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already loaded as "
                                 f"{adapter.lora_name!r}; give {lora.lora_name!r} its own id")
            self.adapters.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora.lora_int_id, lora.lora_name, lora.lora_path, self.spec,
                               self.config.max_lora_rank)
        if self.device.type != "cpu":
            adapter = _to_device(adapter, self.device)
        self.adapters[lora.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MiB) loaded from %s", lora.lora_name,
                    lora.lora_int_id, adapter.rank, adapter.num_bytes / 2**20, lora.lora_path)
        idle = [i for i in self.adapters if i not in in_use and i != lora.lora_int_id]
        for lora_int_id in idle[: max(0, len(self.adapters) - self.config.num_cpu_loras)]:
            self.remove(lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter; False if it was not loaded."""
        adapter = self.adapters.pop(lora_int_id, None)
        if adapter is not None:
            logger.info("LoRA adapter %r (id %d) unloaded", adapter.lora_name, lora_int_id)
        return adapter is not None

    def batch(self, lora_ids: Sequence[int], starts: Sequence[int]) -> LoRABatch | None:
        """The step's segments: request j (rows starts[j]:starts[j + 1]) runs
        adapter lora_ids[j] (0: none). None when no row has an adapter."""
        rows: dict[int, list[int]] = {}
        for j, lora_int_id in enumerate(lora_ids):
            if lora_int_id:
                rows.setdefault(lora_int_id, []).extend(range(starts[j], starts[j + 1]))
        if not rows:
            return None
        assert len(rows) <= self.config.max_loras, f"{len(rows)} adapters in a step: the scheduler's limit"
        segments: list[tuple[slice | torch.Tensor, LoRAAdapter]] = []
        for lora_int_id, ids in rows.items():
            adapter = self.adapters.get(lora_int_id)
            assert adapter is not None, f"LoRA adapter {lora_int_id} scheduled but not loaded"
            contiguous = ids[-1] - ids[0] + 1 == len(ids)
            segment = (slice(ids[0], ids[-1] + 1) if contiguous
                       else torch.tensor(ids, dtype=torch.int64, device=self.device))
            segments.append((segment, adapter))
        return LoRABatch(segments)


def _to_device(adapter: LoRAAdapter, device: torch.device) -> LoRAAdapter:
    from dataclasses import replace

    layers = tuple({name: replace(w, a=w.a.to(device), b=w.b.to(device), scale=w.scale.to(device))
                    for name, w in layer.items()} for layer in adapter.layers)
    return replace(adapter, layers=layers)
