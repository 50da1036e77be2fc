"""Building blocks of the Llama-family decoder, numerically matched to transformers."""

from __future__ import annotations

import copy
import functools
import weakref

import torch
from torch import nn

from fivefold.kernels import fused_ops, stream_ops
from fivefold.models.config import ModelConfig, rope_inv_freq


class FusableOp(nn.Module):
    """A module with an eager path and a fused C++ kernel (fivefold/kernels/fused_ops.cpp).

    ``use_fused`` is off until the model is told otherwise (``set_fused_ops``); the
    kernel runs only for float32 CPU tensors, everything else takes the eager path.
    """

    use_fused: bool = False

    def _fused(self, x: torch.Tensor):
        if self.use_fused and x.dtype == torch.float32 and x.device.type == "cpu":
            return fused_ops()
        return None


class RMSNorm(FusableOp):
    """RMSNorm computed in float32, with an optional fused residual add.

    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``. Fused, it is
    one pass that overwrites ``x`` and ``residual`` in place (both are the step's own
    activations), instead of add, cast, rms_norm, cast and mul.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32, cast back, then scale by the weight.
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        ops = self._fused(x)
        if ops is not None and x.dim() == 2:
            ops.fused_add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual
        return self._norm(x), x


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout of Hugging Face checkpoints).

    cos/sin are tabulated once for every position up to ``max_position_embeddings``
    and looked up by each token's absolute position, so prefill and decode tokens of
    different sequences are rotated in one call.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Computed, never loaded: on the CPU even inside a model built on the meta device (the
        # loaders build it there), where these ops would also cost torch's ~1 s lazy import of
        # its meta functions.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(config)  # [D/2]
            positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
            self.register_buffer("cos", freqs.cos(), persistent=False)
            self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for the batch's positions, [T, 1, D/2]; computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor, ops=None):
        """q: [T, H, D], k: [T, KVH, D], both rotated with the same table rows.

        ``ops`` (the fused kernels, from ``FusableOp._fused``): one C++ call rotating q and k
        in place (they are views of this step's qkv output), instead of chunk, 4 muls, 2 adds
        and a cat for each.
        """
        cos, sin = cos_sin
        if ops is not None:
            ops.rotary_qk_(q, k, cos, sin)
            return q, k
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SiluAndMul(FusableOp):
    """silu(gate) * up for a fused [gate | up] projection output."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = self._fused(gate_up)
        if ops is not None and gate_up.dim() == 2:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate).mul_(up)


MAX_GEMM_ROWS = 2048


def _row_step(rows: int) -> int:
    """The granularity of row buckets around ``rows`` (see row_pieces)."""
    return 1 if rows <= 8 else 4 if rows <= 64 else 64 if rows <= 512 else 128


def _row_bucket(rows: int) -> int:
    step = _row_step(rows)
    return -(-rows // step) * step


_ROW_BUCKETS = frozenset(_row_bucket(r) for r in range(1, MAX_GEMM_ROWS + 1))


def row_pieces(rows: int) -> list[tuple[int, int]]:
    """How PackedLinear runs ``rows`` rows: (rows, rows after zero padding) per oneDNN call.

    oneDNN caches one primitive per input shape (up to 1024 of them), and each keeps a
    buffer of rows x out_features floats: a server that sees every prefill length from 1
    to 2048 grew by ~0.7 GB in 10 minutes (benchmarks/soak.py) and would reach GBs. So the
    row counts a primitive ever sees are a fixed set of 41 buckets: 1-8, multiples of 4 to
    64, of 64 to 512, of 128 to 2048 (max_num_batched_tokens' default); rows are
    zero-padded up to their bucket (at most 127 rows, <= 6% above 2048/25% at 512
    rows), and longer inputs run in pieces of 2048. The bound for SmolLM2 is ~330 MB of
    buffers. Padding rather than splitting into buckets because splitting measured slower
    (more, smaller calls). Measured on SmolLM2 (Sapphire Rapids, 2 cores): decode tok/s
    unchanged at batch 1-12 (a decode batch of 9 computes 12 rows, but decode is bound by
    streaming the weights), prefill of 8 x 2000-character prompts 2-4% slower, and RSS
    flat under varied traffic (1271 MiB over 100 s) instead of +160 MB."""
    pieces = []
    while rows > 0:
        n = min(rows, MAX_GEMM_ROWS)
        pieces.append((n, _row_bucket(n)))
        rows -= n
    return pieces


# Rows up to which a linear streams its weight (in stream_pack's layout) through
# fivefold::stream_linear (fivefold/kernels/linear_stream.cpp) instead of oneDNN's packed GEMM: where
# the streaming kernel measured faster with the weights coming from DRAM (benchmarks/linear_stream.py,
# backends timed in turn; Zen 4: float32 1/2/4 rows 88/84/81% of the copy bandwidth vs oneDNN
# 68/64/77%, 8 rows 58% vs 72%; bf16 1/2/4 rows 83/82/78% vs 55/59/68%, 8 rows 48% vs 58%).
STREAM_MAX_ROWS = {torch.float32: 4, torch.bfloat16: 4}


def stream_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which weights of ``dtype`` take the streaming kernel (0: it is not built here)."""
    return STREAM_MAX_ROWS.get(dtype, 0) if stream_ops() is not None else 0


# Rows up to which W8A16 and W4A16 layers run our kernels instead of dequantizing tiles of their
# weights for oneDNN's packed GEMM (packed_matmul). From 16 rows the kernels dequantize a panel of
# 32 channels (16 with AVX2) x 128 columns into L1 once and multiply it by every row of a block
# whose activations stay in L2 (fivefold/kernels/panels.h): no float copy of the weight, no reorder.
# On a 2-core Zen 4, SmolLM2's projections, GFLOP/s of the kernel vs the dequantized tiles, W8A16:
# 128 rows 188-201 vs 43-103, 512 rows 188-201 vs 93-149, 1024 rows 192-204 vs 164-179, 2048 rows
# 193-207 vs 180-197 (float32 oneDNN 200-220); W4A16 alike (2048 rows 184-198 vs 183-198). With
# AVX2 forced, W8A16 at 1024-2048 rows 174-201 vs 148-189; W4A16's AVX2 panels (int4_linear.cpp's
# FloatPanel, channel x block lanes) lead up to 512 rows and trail from 1024 (105-171 vs 133-184).
# Builds without the panels (AVX-512 without VBMI) stay at 64 rows: their row tiles widen each
# weight once per 4 rows. The ISA test below mirrors panels.h's FIVEFOLD_FLOAT_PANELS (the
# extension is compiled for this platform's flags, forcing included).
NO_ROW_LIMIT = 1 << 62
ROW_TILES_MAX_ROWS = 64
AVX2_INT4_MAX_ROWS = 512


@functools.lru_cache(maxsize=None)
def quantized_kernel_max_rows(bits: int) -> int:
    """Rows up to which W8A16 (``bits`` 8) and W4A16 (4) layers run fivefold's kernels; above,
    dequantized weight tiles through oneDNN (see the measurements above)."""
    from fivefold.platform import current_platform

    p = current_platform()
    if p.has("avx512f", "avx512bw", "avx512vbmi"):
        return NO_ROW_LIMIT
    if p.has("avx2") and not p.has("avx512f"):
        return NO_ROW_LIMIT if bits == 8 else AVX2_INT4_MAX_ROWS
    return ROW_TILES_MAX_ROWS


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight oneDNN has re-laid-out ("packed") for its GEMM kernels,
    replacing the dense weight: one copy.

    With ``stream_copy``, decode-sized inputs (up to :data:`STREAM_MAX_ROWS` rows) run the streaming
    kernel on ``stream_weight`` (the same weights in fivefold::stream_pack's tile-major layout)
    instead, which reads the weights at a higher share of the memory bandwidth than oneDNN does for
    so few rows: the layer then holds its weight twice, in the two kernels' layouts, the price of
    the fastest kernel at every batch size. The engine keeps that second copy for small models only
    (``EngineConfig.stream_copy``); from 1B parameters on, memory decides.

    Measured on a 2-core Zen 4 (16384 x 2048, weights from DRAM; ms per call, oneDNN packed vs
    the streaming kernel): float32 1 row 5.5 vs 4.5, 4 rows 5.0 vs 5.5, 64 rows 21 vs 35;
    bfloat16 1 row 2.3 vs 1.6, 4 rows 1.9 vs 3.3, 64 rows 12 vs 29. Earlier, on SmolLM2's
    3072x576 against F.linear on the plain row-major weight: 1 row 73 us vs 140 us, 64 rows 1.07
    ms vs 1.45 ms. Results equal F.linear up to float32 summation order.

    ``state_dict`` holds the plain ``weight`` (unpacked), so exporting and comparing checkpoints
    work unchanged.
    """

    BATCH_HINT = 64  # the row count oneDNN tunes the packing for; others run nearly as fast

    def __init__(self, linear: nn.Linear, stream_copy: bool = True) -> None:
        super().__init__()
        self._init(linear.weight.detach(), linear.bias, stream_copy)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    stream_copy: bool = False) -> "PackedLinear":
        """The packed layer of ``weight`` [out, in] (and ``bias``), without an nn.Linear around them:
        the loader's path, where the dense weight is dropped once packed."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._init(weight.detach(), bias, stream_copy)
        return module

    def _init(self, weight: torch.Tensor, bias: torch.Tensor | None, stream_copy: bool) -> None:
        self.out_features, self.in_features = weight.shape
        weight = weight.contiguous()  # [out, in]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.BATCH_HINT)
        self.stream_max_rows = stream_max_rows(weight.dtype) if stream_copy else 0
        # The streaming kernel's layout, when asked for and built here.
        self.stream_weight = stream_ops().stream_pack(weight) if self.stream_max_rows else None
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def unpacked_weight(self) -> torch.Tensor:
        """The weight [out, in], row-major: unpacked from ``stream_weight`` (or oneDNN's layout) into a
        new tensor on each call (for state dicts and tests; the forward never needs it). A method, not
        a ``weight`` attribute, so that nobody pays for a 100 MB copy by reading what looks like a field."""
        if self.stream_weight is None:
            return self.packed_weight.to_dense()
        return stream_ops().stream_unpack(self.stream_weight)[:, :self.in_features].contiguous()

    @staticmethod
    def is_available() -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

    @staticmethod
    def can_pack(dtype: torch.dtype) -> bool:
        """Whether oneDNN packs weights of ``dtype`` on this CPU: float32 everywhere it exists,
        bfloat16 only where PyTorch lets oneDNN run it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an
        AVX2-only CPU the reorder raises a RuntimeError). Elsewhere the layer stays a dense nn.Linear."""
        from fivefold.platform import current_platform

        if not PackedLinear.is_available():
            return False
        if dtype == torch.float32:
            return True
        return dtype == torch.bfloat16 and current_platform().can_pack_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.stream_max_rows:
            out = stream_ops().stream_linear(x.reshape(rows, self.in_features), self.stream_weight, None, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows in _ROW_BUCKETS:
            return self._gemm(x)
        flat = x.reshape(rows, self.in_features)
        pieces, start = [], 0
        for n, padded in row_pieces(rows):
            piece = flat[start:start + n]
            if padded != n:
                piece = torch.cat([piece, piece.new_zeros(padded - n, self.in_features)])
            pieces.append(self._gemm(piece)[:n])
            start += n
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.unpacked_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.t() for a weight tile [N, K] dequantized for this call (a quantized layer's
    prompt rows): oneDNN packs the tile and runs its packed GEMM where it packs w's dtype, else a
    plain matmul. The reorder is paid per call and still wins: on a 2-core Zen 4 a W8A16 prompt
    step of 16 x 128 tokens spent 2.46 s in ``x @ w.t()`` against float32's 2.08 s in the packed
    GEMM (SmolLM2 projections at 128 / 512 / 2048 rows: 1.0-1.26x / 1.09-1.38x / 1.12-1.17x faster
    packed, dequantization included)."""
    if x.dtype == w.dtype and PackedLinear.can_pack(w.dtype):
        return PackedLinear.from_weight(w)(x)
    return x @ w.t()


def tiled_matmul(x: torch.Tensor, out_features: int, tile: int, weight_rows) -> torch.Tensor:
    """x [M, K] @ W.t() for a quantized W of ``out_features`` rows, dequantized ``tile`` rows at a
    time by ``weight_rows(n0, n1)`` (float rows [n0, n1) in x's dtype), each tile through
    :func:`packed_matmul`; a single tile's product is the output (no copy)."""
    if tile >= out_features:
        return packed_matmul(x, weight_rows(0, out_features))
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for n0 in range(0, out_features, tile):
        n1 = min(n0 + tile, out_features)
        out[:, n0:n1] = packed_matmul(x, weight_rows(n0, n1))
    return out


def gather_tile_rows(packed: torch.Tensor, ids: torch.Tensor, tile: int, unpack) -> torch.Tensor:
    """Rows ``ids`` of a weight held in a tile-major kernel layout (tiles of ``tile`` channels, a
    slice of whole tiles still in the layout), each tile that holds one unpacked once by ``unpack``."""
    n = packed.shape[0]
    tiles = torch.div(ids, tile, rounding_mode="floor")
    out = None
    for t in torch.unique(tiles).tolist():
        lo = t * tile
        block = unpack(packed[lo:min(lo + tile, n)])
        if out is None:
            out = torch.empty(len(ids), *block.shape[1:], dtype=block.dtype)
        where = (tiles == t).nonzero().flatten()
        out[where] = block[ids[where] - lo]
    return out if out is not None else torch.empty(0, 0)


class HeadRowsEmbedding(nn.Module):
    """The token embedding of a tied model served from a GGUF's quantized blocks: each token's row is
    read from the LM head's weight (the same table) and dequantized, so the table is held once, in
    its blocks, instead of once more in float (8B with a Q8_0 table: 0.8 GB of float32 saved). The
    head owns the weight (it is not a submodule here); ``head.rows(ids)`` returns the float rows.
    The values are exactly those of the dequantized table."""

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # a reference, not a submodule: one owner (lm_head), one state-dict entry
        self.num_embeddings, self.embedding_dim, self.dtype = head.out_features, head.in_features, dtype

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (a new tensor: for export and inspection, not for serving)."""
        return self._head[0].rows(torch.arange(self.num_embeddings)).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        rows = self._head[0].rows(flat).to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight  # a checkpoint holds the table itself

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the LM head's quantized weight"


class SplitLinear(nn.Module):
    """One fused projection held as blocks of output rows in different served forms, each at its
    own bits: a Q4_K_M GGUF's q and k (Q4_K: the 4-bit kernel, 5 bits per weight) beside its v
    (Q6_K: int8 and a float16 scale per 16, 9 bits), where one fused form would widen q and k to
    int8 too. The output is the blocks' outputs side by side, in row order (the C++ decode loop
    takes the q/k block and the v block of a ``qkv_proj`` as two linears)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
            raise ValueError("SplitLinear needs two or more parts with the same in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """The whole bias (a new tensor; each block holds its rows'), or None."""
        biases = [getattr(p, "bias", None) for p in self.parts]
        if all(b is None for b in biases):
            return None
        return torch.cat([b.detach().float() if b is not None else torch.zeros(p.out_features)
                          for b, p in zip(biases, self.parts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={[p.out_features for p in self.parts]}"


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear holding copies of ``weight`` [out, in] and ``bias`` [out] (same dtype): the
    rebuilt layer of a pass that merges, slices or pads weights."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


# One packed copy per weight tensor, shared by every serving view of it (ModelRunner builds one
# per engine): id(weight) -> (a weak reference to the weight, its content key, the packed layer).
# By id, since tensors compare element-wise; an entry goes when its weight is freed.
_PACKED: dict[int, tuple[weakref.ref, tuple, "PackedLinear"]] = {}


def packed_linear(linear: nn.Linear, stream_copy: bool = True) -> PackedLinear:
    """``linear``'s :class:`PackedLinear`, packed once per weight tensor (oneDNN's reorder of SmolLM2's
    projections takes 1.5 s) and made again only if the weight or bias changed since (or the
    streaming copy is asked for and the cached one lacks it)."""
    weight, key = linear.weight, _content_key(linear)
    cached = _PACKED.get(id(weight))
    if (cached is not None and cached[0]() is weight and cached[1] == key
            and (cached[2].stream_weight is not None or not stream_copy or not stream_max_rows(weight.dtype))):
        return cached[2]
    packed = PackedLinear(linear, stream_copy)
    ident = id(weight)
    _PACKED[ident] = (weakref.ref(weight, lambda _, ident=ident: _PACKED.pop(ident, None)), key, packed)
    return packed


def _content_key(linear: nn.Linear) -> tuple:
    """What tells a weight (and bias) written in place since it was packed: the version counter, or,
    for inference tensors (loaded under inference mode: they have none), a float64 sum of the values."""
    def key(t: torch.Tensor | None):
        if t is None:
            return None
        return float(t.detach().sum(dtype=torch.float64)) if t.is_inference() else t._version
    return key(linear.weight), key(linear.bias)


def module_tree_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree of submodules that shares every parameter, buffer and attribute:
    replacing a submodule of the copy (or flipping a flag on it) leaves ``module`` as it was."""
    clone = copy.copy(module)
    clone._modules = {name: None if child is None else module_tree_copy(child) for name, child in module._modules.items()}
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def pack_linears_(model: nn.Module, stream_copy: bool = True) -> nn.Module:
    """Swap every plain nn.Linear of ``model`` for a :class:`PackedLinear` (in place) where oneDNN can
    pack its dtype on this CPU (:meth:`PackedLinear.can_pack`); the others stay dense."""
    for module in [*model.modules()]:
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and PackedLinear.can_pack(child.weight.dtype):
                setattr(module, name, packed_linear(child, stream_copy))
    return model


def resident_weight_bytes(*models: nn.Module) -> int:
    """Bytes of every weight the ``models`` hold, each tensor counted once: parameters and buffers, and
    the kernels' own layouts (oneDNN's packed weights, the streaming kernel's copies, an int8
    layer's packed operands). What the engine reports as its model's resident weights."""
    seen: set = set()
    total = 0

    def count(t) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = ("mkldnn", id(t)) if t.is_mkldnn else ("ptr", t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()

    for module in (m for model in models for m in model.modules()):
        for t in [*module._parameters.values(), *module._buffers.values()]:
            count(t)
        if isinstance(module, PackedLinear):
            count(module.packed_weight)
            count(module.stream_weight)
        for value in (getattr(module, "_prepared", None) or {}).values():
            count(value)
    return total
