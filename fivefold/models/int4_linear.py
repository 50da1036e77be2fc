"""``Int4Linear``: 4-bit weights with one scale (and offset) per group of a row's columns (W4A16).

A weight w [N, K] is stored as codes q in 0..15, two per byte, with float16 scale and offset per
group of ``group_size`` consecutive columns of a row:

    w = scale * q + offset              (asymmetric: GGUF Q4_1's "minimum" form, offset = min)
    w = scale * (q - 8)                 (symmetric: GGUF Q4_0; no offset is stored)

A zero-point checkpoint (GPTQ, AWQ: ``w = s (q - z)``) is the same form with ``offset = -s z``, and
GGUF's Q4_0/Q4_1 blocks are groups of 32 in exactly these forms, so one kernel serves them all
(``fivefold::int4_linear``, fivefold/kernels/int4_linear.cpp). Group sizes are powers of two from
32 to 256; K must be a multiple of 32; the last group of a row may be shorter (SmolLM2's K = 576 in
groups of 128 is four groups of 128 and one of 64, as GPTQ's checkpoints do it).

Checkpoint form (the state dict): ``qweight`` uint8 [N, K / 2] (column 2i in the low nibble of
byte i, column 2i + 1 in the high one), ``scale`` float16 [N, groups], ``offset`` float16 [N,
groups] (asymmetric only), ``bias`` float32 (or absent). In memory the layer holds the kernel's
tile-major layout only (one copy); the state dict unpacks it.

Activations: ``Int4Format.activations="float"`` (W4A16) multiplies float activations by the
dequantized weights; ``"int8"`` (W4A8, as llama.cpp runs Q4_0 and Q4_1 against Q8 activations)
quantizes each row per block of ``ACT_BLOCK`` = 32 columns (scale = amax / 127, round to nearest
even: :func:`quantize_activations`) and sums codes times activations exactly in integers (VNNI
``vpdpbusd``, or ``vpmaddubsw`` on AVX2), scaling each block's sum once. W4A8 is faster (an
integer dot product does 4 products per lane per instruction, and the codes need no conversion to
float) and costs a little accuracy (int8 activations per block of 32: benchmarks/int4_quality.py
measures both).

GGUF Q4_K's two scale levels (group j of 32: ``w = d sc_j q - dmin m_j``, 6-bit ``sc_j`` and
``m_j``, float16 ``d`` and ``dmin`` per 256 columns: :class:`Int4Levels`) ride along with the
one-level float16 form; with int8 activations the layer holds them instead, in the kernel's tile
order (:func:`pack_levels`: 4.625 bits per weight with the codes, against 5.0, and ``d sc_j``
exact), and goes back to the float16 form while it takes float activations.

With float activations, batches up to ``fivefold.models.layers.quantized_kernel_max_rows(4)``
rows (every batch with AVX-512 VBMI, 512 with AVX2, else 64) run the kernel, which reads each
weight byte once per call (from 8-16 rows through panels dequantized into L1 once for all rows);
larger batches (long prompts) dequantize a tile of output channels at a time (at most
``DEQUANT_TILE`` channels and ``DEQUANT_TILE_BYTES`` of floats: an 8B's 14336-column rows would
otherwise take 0.2 GB per tile) and run a float GEMM. With int8 activations
every batch runs the integer kernel: at prefill sizes it computes 230-360 GFLOP/s (4096 x 4096 to
14336 x 4096, 65-512 rows, Zen 4), 2-10x the dequantize-then-GEMM path. Without the compiled
kernels every call dequantizes (the PyTorch path, activations quantized and dequantized first for
int8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.kernels import int4_ops
from fivefold.models.layers import quantized_kernel_max_rows, tiled_matmul
from fivefold.models.int8_primitives import ACT_BLOCK, dequantize_activations, quantize_activations  # noqa: F401 (re-exported)

GROUP_SIZES = (32, 64, 128, 256)
ACTIVATIONS = ("float", "int8")
COLUMN_MULTIPLE = 32  # K must be a multiple of it: one byte vector of the kernel on AVX-512
DEQUANT_TILE = 4096  # output channels dequantized at a time for larger batches (a multiple of 4)
DEQUANT_TILE_BYTES = 16 << 20  # and at most this many bytes of float32 weights per tile
KERNEL_TILE = 4  # output channels per tile of the kernel's layout (int4_linear.cpp's kChannels)


@dataclass(frozen=True)
class Int4Format:
    """How a layer's weights are held in 4 bits.

    group_size: columns per scale (32, 64, 128 or 256; 128 is GPTQ's and AWQ's default).
    symmetric: codes q - 8 times one scale per group (GGUF Q4_0); False (default) adds a per-group
        offset (GGUF Q4_1's minimum, GPTQ's and AWQ's zero point), which fits skewed groups better
        for 16 more bits per group.
    activations: "float" (W4A16) or "int8" (W4A8: each row quantized per block of 32 columns,
        integer dot products; see the module docstring). The stored weights are the same.
    """

    group_size: int = 128
    symmetric: bool = False
    activations: str = "float"

    def __post_init__(self) -> None:
        if self.group_size not in GROUP_SIZES:
            raise FivefoldError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))} for 4-bit weights, "
                                f"got {self.group_size}")
        if self.activations not in ACTIVATIONS:
            raise FivefoldError(f"activations must be one of {', '.join(ACTIVATIONS)} for 4-bit weights, "
                                f"got '{self.activations}'")

    @property
    def scheme(self) -> str:
        return "w4a8" if self.activations == "int8" else "w4a16"

    def bits_per_weight(self, in_features: int | None = None) -> float:
        """4 bits + a float16 scale (and offset) per group (per weight of a row of ``in_features``)."""
        groups = 1 / self.group_size if in_features is None else -(-in_features // self.group_size) / in_features
        return 4 + 16 * groups * (1 if self.symmetric else 2)


def check_shape(in_features: int, what: str = "in_features") -> None:
    if in_features % COLUMN_MULTIPLE:
        raise FivefoldError(f"4-bit weights need {what} to be a multiple of {COLUMN_MULTIPLE}, got {in_features}")


LEVEL_GROUPS = 8  # groups of 32 per GGUF Q4_K super-block (int4_linear.cpp's kLevelGroups)
LEVEL_ROW_BYTES = 20  # bytes per channel and super-block in the kernel's layout (kLevelBytes / 4)


@dataclass(frozen=True)
class Int4Levels:
    """GGUF Q4_K's two scale levels of a weight [N, K]: group j (32 columns) of a row is
    ``w = d sc_j q - dmin m_j``, with ``sc``, ``m`` uint8 [N, K / 32] (6 bits) and ``d``, ``dmin``
    float16 [N, K / 256] (one per super-block of 8 groups)."""

    sc: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def scale(self) -> torch.Tensor:
        """The float16 scale per group, d sc_j rounded once (the one-level form)."""
        return (self.d.float().repeat_interleave(LEVEL_GROUPS, 1) * self.sc.float()).half()

    def offset(self) -> torch.Tensor:
        return (-(self.dmin.float().repeat_interleave(LEVEL_GROUPS, 1) * self.m.float())).half()

    def map_rows(self, fn) -> "Int4Levels":
        return Int4Levels(*(fn(t).contiguous() for t in (self.sc, self.m, self.d, self.dmin)))


def pack_levels(levels: Int4Levels) -> torch.Tensor:
    """The kernel's layout of Q4_K's levels, uint8 [N, K / 256 x 20]: per tile of 4 channels and
    super-block, d [4] and dmin [4] float16, then for each group j sc_j [4] and m_j [4]
    (int4_linear.cpp, kLevelBytes)."""
    n, groups = levels.sc.shape
    t, s = n // KERNEL_TILE, groups // LEVEL_GROUPS
    halves = [h.contiguous().view(torch.uint8).reshape(t, KERNEL_TILE, s, 2).permute(0, 2, 1, 3).reshape(t, s, -1)
              for h in (levels.d, levels.dmin)]
    codes = torch.stack([c.reshape(t, KERNEL_TILE, s, LEVEL_GROUPS) for c in (levels.sc, levels.m)])  # [2, t, 4, s, 8]
    codes = codes.permute(1, 3, 4, 0, 2).reshape(t, s, -1)  # [t, s, 8, 2, 4]
    return torch.cat(halves + [codes], dim=2).reshape(n, s * LEVEL_ROW_BYTES).contiguous()


def unpack_levels(packed: torch.Tensor) -> Int4Levels:
    """The inverse of :func:`pack_levels` (whole tiles of it)."""
    n, s = packed.shape[0], packed.shape[1] // LEVEL_ROW_BYTES
    t = n // KERNEL_TILE
    b = packed.reshape(t, s, KERNEL_TILE * LEVEL_ROW_BYTES)
    step = 2 * KERNEL_TILE
    halves = [b[:, :, i * step:(i + 1) * step].reshape(t, s, KERNEL_TILE, 2).permute(0, 2, 1, 3)
              .reshape(n, 2 * s).contiguous().view(torch.float16) for i in (0, 1)]
    codes = b[:, :, 2 * step:].reshape(t, s, LEVEL_GROUPS, 2, KERNEL_TILE).permute(3, 0, 4, 1, 2)  # [2, t, 4, s, 8]
    sc, m = (c.reshape(n, s * LEVEL_GROUPS).contiguous() for c in codes)
    return Int4Levels(sc, m, halves[0], halves[1])


@dataclass
class Int4Quantized:
    """A 4-bit weight as computed or read: codes ``q`` uint8 [N, K] (0..15, one per byte), ``scale``
    float16 [N, groups], ``offset`` float16 [N, groups] or None (symmetric: q - 8); ``levels``: a
    GGUF Q4_K's two scale levels, of which scale and offset are the one-level rounding (None
    otherwise)."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group_size: int
    levels: Int4Levels | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def map_rows(self, fn) -> "Int4Quantized":
        """The weight with ``fn`` (a row permutation or slice) applied to every per-row tensor."""
        return Int4Quantized(fn(self.q).contiguous(), fn(self.scale).contiguous(),
                             None if self.offset is None else fn(self.offset).contiguous(), self.group_size,
                             None if self.levels is None else self.levels.map_rows(fn))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.q, self.scale, self.offset, self.group_size).to(dtype)


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, groups, group_size], the last group padded with zeros."""
    n, k = t.shape
    groups = -(-k // group_size)
    if groups * group_size != k:
        t = torch.nn.functional.pad(t, (0, groups * group_size - k))
    return t.reshape(n, groups, group_size)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """float32 [N, K] of codes ``q`` (uint8 [N, K]) with per-group float16 ``scale`` and ``offset``."""
    n, k = q.shape
    s = scale.float()[:, :, None]
    o = (-8 * s) if offset is None else offset.float()[:, :, None]
    return (_grouped(q.float(), group_size) * s + o).reshape(n, -1)[:, :k]


def quantize_int4(w: torch.Tensor, fmt: Int4Format) -> Int4Quantized:
    """Round to nearest, per group (the RTN baseline; GPTQ and AWQ choose the same form better).

    Asymmetric: scale = (max - min) / 15, offset = min, both rounded to float16 first and the codes
    computed against the rounded values (what the kernel will multiply by). Symmetric: scale =
    amax / 8 with the sign of the largest-magnitude weight, so that weight is exactly -8 (GGUF's
    Q4_0 choice: one more level on the side of the extreme than amax / 7)."""
    w = w.detach().float()
    n, k = w.shape
    check_shape(k)
    g = _grouped(w, fmt.group_size)
    if fmt.symmetric:
        idx = g.abs().argmax(dim=2, keepdim=True)
        extreme = g.gather(2, idx)
        scale = (extreme / -8).to(torch.float16)
        s = scale.float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.clamp(torch.round(g / s) + 8, 0, 15)
        offset = None
    else:
        lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
        if k % fmt.group_size:  # the padded zeros of a short last group are not weights
            real = torch.arange(g.shape[1] * fmt.group_size).reshape(1, g.shape[1], fmt.group_size) < k
            lo = torch.where(real, g, torch.full_like(g, float("inf"))).amin(dim=2, keepdim=True)
            hi = torch.where(real, g, torch.full_like(g, -float("inf"))).amax(dim=2, keepdim=True)
        scale = ((hi - lo) / 15).to(torch.float16)
        offset = lo.to(torch.float16)
        s = scale.float()
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.clamp(torch.round((g - offset.float()) / s), 0, 15)
        offset = offset[:, :, 0].contiguous()
    q = q.to(torch.uint8).reshape(n, -1)[:, :k].contiguous()
    return Int4Quantized(q, scale[:, :, 0].contiguous(), offset, fmt.group_size)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] -> [N, K / 2], column 2i in the low nibble of byte i."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`."""
    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights (see the module docstring for the format and the kernels)."""

    def __init__(self, in_features: int, out_features: int, has_bias: bool, fmt: Int4Format,
                 device: torch.device | str | None = None) -> None:
        """Zero weights (``device="meta"``: placeholders of the right shapes, for a caller that
        assigns every buffer, as :meth:`from_quantized` does: an 8B model's zero-filled codes were
        3.3 GB written and dropped while loading)."""
        super().__init__()
        check_shape(in_features)
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        groups = -(-in_features // fmt.group_size)
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scale", torch.ones(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("offset", None if fmt.symmetric else
                             torch.zeros(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if has_bias else None)
        self._prepared: dict | None = None  # the kernel's operands, when it is built and the layer packed
        self._levels: Int4Levels | None = None  # a Q4_K's two scale levels, until pack_ lays them out

    @classmethod
    def from_quantized(cls, quantized: Int4Quantized, bias: torch.Tensor | None = None,
                       activations: str = "float") -> "Int4Linear":
        """The layer holding ``quantized`` (packed for the kernel at once: one copy), multiplying
        ``activations`` ("float" or "int8") by it."""
        n, k = quantized.q.shape
        fmt = Int4Format(group_size=quantized.group_size, symmetric=quantized.offset is None, activations=activations)
        module = cls(k, n, bias is not None, fmt, device="meta")  # every buffer is assigned below
        if module.scale.shape != quantized.scale.shape:
            raise FivefoldError(f"4-bit scales of shape {tuple(quantized.scale.shape)} do not fit a [{n}, {k}] weight "
                                f"in groups of {fmt.group_size}")
        module.scale = quantized.scale.to(torch.float16).contiguous()
        if quantized.offset is not None:
            module.offset = quantized.offset.to(torch.float16).contiguous()
        if bias is not None:
            module.bias = bias.detach().float().contiguous()
        if quantized.levels is not None and module._levels_fit():
            module._levels = quantized.levels
        if int4_ops() is not None:  # the codes straight into the kernel's layout (no row-major nibbles between)
            module._buffers["qweight"] = None
            return module.pack_(codes=quantized.q)
        module.qweight = pack_nibbles(quantized.q)
        return module.pack_()

    @classmethod
    def from_float(cls, linear: nn.Module, fmt: Int4Format) -> "Int4Linear":
        """Round-to-nearest of an ``nn.Linear`` (or anything with ``weight`` and ``bias``)."""
        from fivefold.models.int8_linear import dense_weight

        return cls.from_quantized(quantize_int4(dense_weight(linear), fmt), getattr(linear, "bias", None),
                                  fmt.activations)

    @property
    def int8_activations(self) -> bool:
        return self.format.activations == "int8"

    def set_activations_(self, activations: str) -> "Int4Linear":
        """Multiply ``activations`` ("float" or "int8") by the same weights from now on."""
        from dataclasses import replace

        self.format = replace(self.format, activations=activations)
        self._hold_levels()
        return self

    def _levels_fit(self) -> bool:
        """Whether the kernel takes this layer's Q4_K levels as they are: groups of 32 with a
        minimum, whole super-blocks of 256 columns and tiles of 4 channels, a CPU with AVX2."""
        from fivefold.platform import current_platform

        return (self.format.group_size == 32 and not self.format.symmetric and self.in_features % 256 == 0
                and self.out_features % KERNEL_TILE == 0 and current_platform().has("avx2"))

    def _hold_levels(self) -> None:
        """With int8 activations the kernel reads a Q4_K's two levels (4.625 bits per weight with the
        codes, d sc_j exact); the float-activation kernels read a float16 scale and minimum per group
        (5.0 bits), made from the levels while they are needed."""
        p = self._prepared
        levels = None if p is None else p.get("levels")
        if levels is None:
            return
        if self.int8_activations:
            p["scale"], p["offset"] = levels, None
        elif p["scale"] is None or self._levels_held():
            ops, lv = int4_ops(), unpack_levels(levels)
            p["scale"], p["offset"] = ops.int4_pack_groups(lv.scale(), True), ops.int4_pack_groups(lv.offset(), True)

    @property
    def kernel(self) -> str:
        return f"fivefold-{self.format.scheme}" if int4_ops() is not None else "dequant"

    def pack_(self, codes: torch.Tensor | None = None) -> "Int4Linear":
        """Hold the weight (and its scales) in the kernel's layout only, once the kernel is built;
        ``codes`` (uint8 [N, K]): the codes themselves, when ``qweight`` does not hold them."""
        ops = int4_ops()
        if ops is None:
            self._levels = None  # the PyTorch path reads the float16 form only
        if self._prepared is None and ops is not None:
            q = unpack_nibbles(self.qweight) if codes is None else codes
            self._prepared = {"w": ops.int4_pack(q)}
            del q
            if self._levels is not None:  # the scales the activations need follow from the levels
                self._prepared.update(levels=pack_levels(self._levels), scale=None, offset=None)
                self._levels = None
                self._hold_levels()
            else:
                self._prepared.update(scale=ops.int4_pack_groups(self.scale, True),
                                      offset=None if self.offset is None else ops.int4_pack_groups(self.offset, True))
            for name in ("qweight", "scale", "offset"):
                self._buffers[name] = None
        return self

    def _levels_held(self) -> bool:
        """Whether the kernel's scale operand is a Q4_K's two levels (int8 activations)."""
        p = self._prepared
        return p is not None and p.get("levels") is not None and p["scale"] is p["levels"]

    def _groups(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, offset) float16 [N, groups] row-major, from the kernel's layout."""
        p, ops = self._prepared, int4_ops()
        if self._levels_held():
            lv = unpack_levels(p["levels"])
            return lv.scale(), lv.offset()
        offset = None if p["offset"] is None else ops.int4_pack_groups(p["offset"], False)
        return ops.int4_pack_groups(p["scale"], False), offset

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q uint8 [N, K], scale, offset) row-major, unpacked from the kernel's layout if need be."""
        p = self._prepared
        if p is None:
            return unpack_nibbles(self.qweight), self.scale, self.offset
        return (int4_ops().int4_unpack(p["w"]), *self._groups())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, float32 [len(ids), K] (a tied embedding's lookups:
        HeadRowsEmbedding), read from the one copy held."""
        from fivefold.models.layers import gather_tile_rows

        p = self._prepared
        if p is None:
            q, scale, offset = unpack_nibbles(self.qweight[ids]), self.scale[ids], None if self.offset is None else self.offset[ids]
        else:
            ops = int4_ops()
            q = gather_tile_rows(p["w"], ids, KERNEL_TILE, ops.int4_unpack)
            if self._levels_held():
                scale = gather_tile_rows(p["levels"], ids, KERNEL_TILE, lambda t: unpack_levels(t).scale())
                offset = gather_tile_rows(p["levels"], ids, KERNEL_TILE, lambda t: unpack_levels(t).offset())
            else:
                scale = gather_tile_rows(p["scale"], ids, KERNEL_TILE, lambda t: ops.int4_pack_groups(t, False))
                offset = None if p["offset"] is None else gather_tile_rows(
                    p["offset"], ids, KERNEL_TILE, lambda t: ops.int4_pack_groups(t, False))
        return dequantize_int4(q, scale, offset, self.format.group_size)

    def dequantized_weight(self) -> torch.Tensor:
        q, scale, offset = self.codes()
        return dequantize_int4(q, scale, offset, self.format.group_size)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._prepared is not None:
            q, scale, offset = self.codes()
            destination[prefix + "qweight"] = pack_nibbles(q)
            destination[prefix + "scale"] = scale
            if offset is not None:
                destination[prefix + "offset"] = offset

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self._prepared is not None:  # held packed: take row-major buffers again, then pack them
            groups = -(-self.in_features // self.format.group_size)
            self._buffers["qweight"] = torch.empty(self.out_features, self.in_features // 2, dtype=torch.uint8)
            self._buffers["scale"] = torch.empty(self.out_features, groups, dtype=torch.float16)
            if not self.format.symmetric:
                self._buffers["offset"] = torch.empty(self.out_features, groups, dtype=torch.float16)
            self._prepared = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.pack_()

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(weight, scale, offset) in the kernel's layout, or None on the PyTorch path."""
        p = self._prepared
        return None if p is None else (p["w"], p["scale"], p["offset"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        p = self._prepared
        if p is not None and (x2.shape[0] <= quantized_kernel_max_rows(4) or self.int8_activations):
            y = int4_ops().int4_linear(x2.contiguous(), p["w"], p["scale"], p["offset"], self.bias,
                                       self.int8_activations)
        else:
            if self.int8_activations:  # the numbers the kernel computes, through a float GEMM
                x2 = dequantize_activations(*quantize_activations(x2)).to(x2.dtype)
            y = self._dequantized_matmul(x2)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill: dequantize a tile of output channels at a time (the weights stay 4-bit)."""
        p, g = self._prepared, self.format.group_size
        tile = max(KERNEL_TILE, min(DEQUANT_TILE, DEQUANT_TILE_BYTES // (4 * self.in_features)) // KERNEL_TILE * KERNEL_TILE)
        def weight_rows(n0: int, n1: int) -> torch.Tensor:  # whole tiles of the layout: a slice stays in it
            if p is None:
                q = unpack_nibbles(self.qweight[n0:n1])
                scale, offset = self.scale[n0:n1], None if self.offset is None else self.offset[n0:n1]
                return dequantize_int4(q, scale, offset, g).to(x.dtype)
            return int4_ops().int4_dequantize(p["w"][n0:n1], p["scale"][n0:n1],
                                              None if p["offset"] is None else p["offset"][n0:n1]).to(x.dtype)

        out = tiled_matmul(x, self.out_features, tile, weight_rows)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        kind = "symmetric" if self.format.symmetric else "asymmetric"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.format.group_size}, "
                f"{kind}, activations={self.format.activations}, bias={self.bias is not None}, kernel={self.kernel}")
