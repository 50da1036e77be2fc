"""Memory planning before the weights are read: will the model, its KV pool and the runtime fit in
the RAM available now? A model that cannot fit is refused in one line naming the sizes and the
options that would make it fit, instead of being killed by the OS half-way through loading.

The estimate is what the serving engine holds today, measured (``benchmarks/scale.py``, the 1B
shape: 12.9 GB of resident weights for 4.3 GB of float32 parameters, peak RSS 14.0 GB with a
512 MiB KV pool): the packed layout keeps every weight three times (the loaded dense tensor,
oneDNN's packed copy and the streaming kernel's layout), the dense layout is counted twice (the
dense tensor and the transients of loading), an int8 checkpoint one byte per parameter twice
(int8 weights and the streaming kernel's copy). Loading adds transients on top (converting and
packing a tensor at a time): 20% of the weight bytes is planned for them, measured in bfloat16
(1B shape: peak RSS 8.76 GB for 6.44 GB of resident weights and a 0.54 GB pool; 3B shape: 22.61 GB
for 17.82 GB and 0.54 GB). Set ``FIVEFOLD_NO_MEMORY_CHECK=1`` to load anyway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from fivefold.engine.config import EngineConfig, available_memory_bytes
from fivefold.errors import FivefoldError

RUNTIME_BYTES = 1 << 30  # torch, oneDNN's scratch, the tokenizer, activations of a step
LOAD_MARGIN = 0.20  # loading's transients, as a share of the weight bytes
LAYOUT_COPIES = {"packed": 3, "dense": 2}
INT8_COPIES = 2


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the engine will hold for one model, against what is available."""

    num_parameters: int
    bytes_per_parameter: float
    copies: int
    kv_cache_bytes: int
    available_bytes: int
    runtime_bytes: int = RUNTIME_BYTES

    @property
    def weight_bytes(self) -> int:
        return int(self.num_parameters * self.bytes_per_parameter * self.copies)

    @property
    def load_bytes(self) -> int:
        """Transients while loading (a tensor converted and packed at a time)."""
        return int(self.weight_bytes * LOAD_MARGIN)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.load_bytes + self.kv_cache_bytes + self.runtime_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes


def plan_memory(num_parameters: int, dtype: torch.dtype, config: EngineConfig, is_int8: bool = False,
                available_bytes: int | None = None) -> MemoryPlan:
    """The plan of a model of ``num_parameters`` served in ``dtype`` with ``config`` (``is_int8``: a
    quantized checkpoint, its projections int8)."""
    if is_int8:
        per_parameter, copies = 1.0, INT8_COPIES
    else:
        per_parameter, copies = torch.empty(0, dtype=dtype).element_size(), LAYOUT_COPIES[config.weight_layout]
    available = available_memory_bytes() if available_bytes is None else available_bytes
    kv = config.kv_cache_bytes()
    if config.kv_cache_memory_fraction is not None:  # a share of what is left once the weights are in
        weights = num_parameters * per_parameter * copies
        kv = int(config.kv_cache_memory_fraction * max(0, available - weights * (1 + LOAD_MARGIN) - RUNTIME_BYTES))
    return MemoryPlan(num_parameters, per_parameter, copies, kv, available)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(name: str, num_parameters: int, dtype: torch.dtype, config: EngineConfig, is_int8: bool = False,
               available_bytes: int | None = None) -> MemoryPlan:
    """The plan, or a FivefoldError naming the sizes and what would fit (a smaller dtype, the
    dense layout, a smaller KV pool, int8 weights)."""
    plan = plan_memory(num_parameters, dtype, config, is_int8, available_bytes)
    if plan.fits or os.environ.get("FIVEFOLD_NO_MEMORY_CHECK") == "1":
        return plan
    options = []
    candidates = []
    if not is_int8 and dtype == torch.float32:
        candidates.append(("--dtype bfloat16", torch.bfloat16, config))
    if not is_int8 and config.weight_layout == "packed":
        candidates.append(("--weight-layout dense", dtype, replace(config, weight_layout="dense")))
        if dtype == torch.float32:
            candidates.append(("--dtype bfloat16 --weight-layout dense", torch.bfloat16,
                               replace(config, weight_layout="dense")))
    for label, d, c in candidates:
        alt = plan_memory(num_parameters, d, c, is_int8, plan.available_bytes)
        if alt.fits:
            options.append(f"{label} ({_gb(alt.total_bytes)})")
    room = plan.available_bytes - plan.weight_bytes - plan.runtime_bytes
    if plan.kv_cache_bytes > (256 << 20) and room >= (256 << 20):
        options.append(f"a KV pool under {_gb(room)} (--kv-cache-memory-bytes)")
    if not is_int8 and plan_memory(num_parameters, dtype, config, True, plan.available_bytes).fits:
        options.append("int8 weights (a directory from fivefold quantize --scheme w8a16, which today loads the "
                       "float model whole: run it where that fits)")
    raise FivefoldError(
        f"{name} does not fit: {num_parameters / 1e9:.2f}B parameters need about {_gb(plan.total_bytes)} "
        f"(weights {_gb(plan.weight_bytes)} = {plan.bytes_per_parameter:g} bytes x {plan.copies} copies, loading "
        f"{_gb(plan.load_bytes)}, KV pool "
        f"{_gb(plan.kv_cache_bytes)}, runtime {_gb(plan.runtime_bytes)}) but {_gb(plan.available_bytes)} are "
        f"available; would fit: {'; '.join(options) or 'none of the options here'} "
        f"(FIVEFOLD_NO_MEMORY_CHECK=1 loads anyway)")
