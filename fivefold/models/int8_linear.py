"""``Int8Linear``: the module that replaces ``nn.Linear`` and multiplies in int8.

Kernel per scheme, chosen by ``benchmarks/int8_kernels.py`` on a 2-core AVX-512 VNNI
machine (sums over SmolLM2's projection shapes, speed-up against the float32
oneDNN-packed linear). The W8A8 library kernels run only where they are exact on this
CPU (VNNI); elsewhere W8A8 runs our exact ``fivefold::int8_int8_matmul``
(``fivefold.models.int8_backends.w8a8_kernel``). The kernel a module runs shows in its repr
(``kernel=...``) and in the quantize report.

| scheme, activations | kernel | 1 row | 8 rows | 32 rows |
|---|---|---|---|---|
| W8A16 | ours (``fivefold::int8_weight_linear``), see below | 3.8x | 1.2x | 0.5x |
| W8A16 | ``aten._weight_int8pack_mm`` (not used) | 0.31x | 0.05x | 0.03x |
| W8A8 dynamic per-tensor | fbgemm ``quantized.linear_dynamic`` | 8.7x | 4.8x | 2.9x |
| W8A8 dynamic per-token | ``torch._int_mm`` + rescale | 2.4x | 1.8x | 1.9x |
| W8A8 static per-tensor | oneDNN ``qlinear_pointwise`` (u8 x s8) | 4.5x | 3.3x | 3.1x |

In the engine W8A16 decode at batch 8/32 runs 225/267 tok/s with our kernel against
67/179 with dequantized tiles (the kernel reads each int8 weight row from memory once
and reuses it from L1 for every activation row; from 16 rows it dequantizes panels of
32 channels x 128 columns into L1 once for all rows, prompts included). Builds without those
panels (``fivefold.models.layers.quantized_kernel_max_rows``: AVX-512 without VBMI) multiply
more than 64 rows by weights dequantized a tile of 4096 output channels at a time: the weights
stay int8 in memory, and the GEMM stays a float GEMM. Every int8 product accumulates in int32 inside the kernel.
Activations are clipped to the calibrated range before they are quantized (static
scales saturate by construction; dynamic ones clip when a range was calibrated).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields

import torch
from torch import nn

from fivefold.kernels import int8_ops
from fivefold.errors import FivefoldError
from fivefold.models.layers import quantized_kernel_max_rows, tiled_matmul
from fivefold.models.int8_backends import (
    EXACT_FALLBACK,
    EXACT_KERNEL,
    onednn_prepack,
    per_token_quantize,
    w8a8_exact,
    w8a8_exact_per_token,
    w8a8_int_mm,
    w8a8_kernel,
    w8a8_onednn,
)
from fivefold.models.int8_primitives import (
    activation_qparams,
    dequantize_activations,
    dequantize_weight,
    quantize_activation,
    quantize_activations,
    quantize_weight,
)

SCHEMES = ("w8a16", "w8a8")
WEIGHT_GRANULARITIES = ("per-channel", "per-tensor", "per-group")
ACTIVATION_MODES = ("dynamic", "static")
ACTIVATION_GRANULARITIES = ("per-token", "per-tensor")

DEQUANT_TILE = 4096  # output channels dequantized at a time for larger W8A16 batches
STREAM_TILE = 4  # output channels per tile of fivefold::stream_pack's layout (linear_stream.cpp's kChannels)


@dataclass(frozen=True)
class Int8Format:
    """What an int8 layer stores and computes (the served form, as a checkpoint names it).

    scheme: "w8a16" (int8 weights, float activations) or "w8a8" (both int8, int32 accumulation).
    weight_granularity: one symmetric scale per output channel, one per tensor, or (W8A16 only)
        one per group of ``group_size`` consecutive weights of a row (GGUF's Q8_0: 32).
    activation (w8a8): "dynamic" (scales computed per call) or "static" (a scale and zero
        point fixed by calibration; per-tensor).
    activation_granularity (dynamic): "per-token" (one scale per row) or "per-tensor".
    activation_symmetric (static): False gives an asymmetric range with a zero point.

    :class:`fivefold.quant.config.Int8Config` extends it with how the values are chosen
    (calibration, bias correction, SmoothQuant, skipped layers).
    """

    scheme: str = "w8a16"
    weight_granularity: str = "per-channel"
    activation: str = "dynamic"
    activation_granularity: str = "per-token"
    activation_symmetric: bool = True
    group_size: int = 32

    def __post_init__(self) -> None:
        for name, value, choices in (("scheme", self.scheme, SCHEMES),
                                     ("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES),
                                     ("activation", self.activation, ACTIVATION_MODES),
                                     ("activation_granularity", self.activation_granularity, ACTIVATION_GRANULARITIES)):
            if value not in choices:
                raise FivefoldError(f"{name} must be one of {', '.join(choices)}, got '{value}'")
        if self.weight_granularity == "per-group" and self.scheme != "w8a16":
            raise FivefoldError("per-group weight scales are served by the W8A16 kernel only (scheme='w8a16')")
        if self.group_size < 1:
            raise FivefoldError(f"group_size must be positive, got {self.group_size}")
        if self.activation == "static" and self.activation_granularity == "per-token":
            object.__setattr__(self, "activation_granularity", "per-tensor")  # static scales are per tensor

    @property
    def is_static(self) -> bool:
        return self.scheme == "w8a8" and self.activation == "static"

    @classmethod
    def of(cls, config: dict) -> "Int8Format":
        """The format fields of a config dict (an ``Int8Config.to_dict()``); other keys are ignored."""
        return cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})


@dataclass
class GroupQuantized:
    """An int8 weight with one scale per group of ``group_size`` columns, as a checkpoint stores it
    (GGUF's Q8_0: groups of 32 with a float16 scale): ``q`` int8 [N, K], ``scale`` float32
    [N, K / group_size]. Loaded as a W8A16 :class:`Int8Linear` without passing through float."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.q, self.scale).to(dtype)


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The float weight of an nn.Linear or a PackedLinear."""
    unpacked = getattr(linear, "unpacked_weight", None)
    return (unpacked() if unpacked is not None else linear.weight).detach().float()


class Int8Linear(nn.Module):
    """A linear layer with int8 weights [N, K] and float32 scales: one per output channel ([N]), or
    per group of ``group_size`` columns ([N, K / group_size], W8A16 only).

    Buffers (the state dict): ``weight`` int8, ``weight_scale``, ``bias`` (float32 or
    absent), ``input_scale`` and ``input_zero_point`` (static activations), ``input_clip``
    (lo, hi; infinite when no range was calibrated). Kernel-specific packed forms are
    derived on first use and never saved.

    One copy of the weights: where W8A16 runs our streaming kernel, the weight is held in the
    kernel's layout only (the ``weight`` buffer is dropped once packed; :meth:`int8_weight` and the
    state dict unpack it); the larger-batch path dequantizes tiles from that layout. Group scales
    that float16 holds exactly (a GGUF's Q8_0 blocks: 34 bytes per 32 weights, as in the file) are
    held the same way, as float16 in the kernel's tile-major order, and the float32 ``weight_scale``
    buffer is dropped (:meth:`weight_scales` and the state dict unpack them): the row-major float32
    table was 6% more bytes per step, read as four more streams, and 1.2x the kernel's time at one row.
    """

    def __init__(self, in_features: int, out_features: int, has_bias: bool, config: Int8Format,
                 device: torch.device | str | None = None) -> None:
        """Zero weights (``device="meta"``: the weight, its scales and the bias as placeholders of
        the right shapes, for a caller that assigns them, as the loader does with a GGUF's blocks)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.activation = config.scheme, config.activation
        self.activation_granularity = config.activation_granularity
        self.group_size = config.group_size if config.weight_granularity == "per-group" else None
        if self.group_size is not None and in_features % self.group_size:
            raise FivefoldError(f"in_features {in_features} is not a multiple of group_size {self.group_size}")
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        scale_shape = (out_features,) if self.group_size is None else (out_features, in_features // self.group_size)
        self.register_buffer("weight_scale", torch.ones(scale_shape, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if has_bias else None)
        self.register_buffer("input_scale", torch.tensor(1.0))
        self.register_buffer("input_zero_point", torch.tensor(0, dtype=torch.int32))
        self.register_buffer("input_clip", torch.tensor([-math.inf, math.inf]))
        self._prepared: dict | None = None
        # W8A16 weights times int8 activations per row and block of 32 (a GGUF's Q8_0 served as
        # stored, as llama.cpp runs it: fivefold::int8_weight_linear_a8); a serving choice, not saved
        self.int8_activations = False

    @classmethod
    def from_float(cls, linear: nn.Module, config: Int8Format, clip_range: tuple[float, float] | None = None,
                   bias_shift: torch.Tensor | None = None) -> "Int8Linear":
        w = dense_weight(linear)
        bias = getattr(linear, "bias", None)
        has_bias = bias is not None or bias_shift is not None
        module = cls(w.shape[1], w.shape[0], has_bias, config)
        q, scales = quantize_weight(w, per_channel=config.weight_granularity == "per-channel",
                                    group_size=module.group_size)
        module.weight.copy_(q)
        module.weight_scale.copy_(scales)
        if has_bias:
            b = bias.detach().float() if bias is not None else torch.zeros(w.shape[0])
            module.bias.copy_(b + (bias_shift if bias_shift is not None else 0.0))
        if clip_range is not None:
            module.input_clip.copy_(torch.tensor(clip_range, dtype=torch.float32))
            if config.is_static:
                scale, zero_point = activation_qparams(*clip_range, config.activation_symmetric)
                module.input_scale.fill_(scale)
                module.input_zero_point.fill_(zero_point)
        elif config.is_static:
            raise ValueError("static activations need a calibrated range")
        return module

    @property
    def is_clipped(self) -> bool:
        return bool(torch.isfinite(self.input_clip).all())

    @property
    def activation_mode(self) -> str | None:
        """"static", "per-token" or "per-tensor" (dynamic) for W8A8; None for W8A16."""
        if self.scheme == "w8a16":
            return None
        return "static" if self.activation == "static" else self.activation_granularity

    @property
    def kernel(self) -> str:
        """The kernel this layer runs on this CPU (see :func:`fivefold.models.int8_backends.w8a8_kernel`)."""
        if self.scheme == "w8a16":
            return "fivefold-w8a16" if int8_ops() is not None else "dequant-tiles"
        return w8a8_kernel(self.activation_mode)

    def _prepare(self) -> dict:
        """Derived once per weight load: packed kernel operands and Python-side constants (reading a
        tensor's value on every call, e.g. ``isfinite(clip).all()``, costs more than the int8 GEMM)."""
        if self._prepared is None:
            kernel = self.kernel
            p: dict = {"clip": tuple(self.input_clip.tolist()) if self.is_clipped else None, "kernel": kernel,
                       "scale": float(self.input_scale), "zp": int(self.input_zero_point)}
            if kernel == "onednn":
                p["onednn"] = onednn_prepack(self.weight)
                p["w_zp"] = torch.zeros(self.out_features, dtype=torch.int64)
            elif kernel == "fbgemm":
                with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's linear is not replaced yet
                    warnings.simplefilter("ignore")
                    qw = torch._make_per_channel_quantized_tensor(self.weight, self.weight_scale.double(),
                                                                  torch.zeros(self.out_features, dtype=torch.int64), 0)
                    p["fbgemm"] = torch.ops.quantized.linear_prepack(qw, self.bias)
            elif kernel == "int_mm":
                p["w_t"] = self.weight.t().contiguous()  # [K, N] for torch._int_mm
            elif kernel == "fivefold-w8a16":  # fivefold::stream_linear's tile-major layout, the one copy
                six = self._six_bit_fits(self.weight)
                p["stream"], p["six"] = int8_ops().stream_pack(self.weight), False
                self._buffers["weight"] = None
                p["stream_scale"] = self._pack_scales()
                self._hold_six_bits(p, six)
            elif kernel in (EXACT_KERNEL, EXACT_FALLBACK):
                p["w_sum"] = self.weight.sum(dim=1, dtype=torch.int32)  # folds the activation zero point
            self._prepared = p
        return self._prepared

    def _six_bit_fits(self, q: torch.Tensor) -> bool:
        """Whether this layer's weight is held at 6 bits (fivefold::q6_pack): int8 activations, groups
        of 16 (a GGUF's Q6_K), codes in [-32, 31], whole 4-channel tiles. The file's 6.56 bits per
        weight were held in 9 (int8 and a float16 scale per 16); in 6 bits it is 7, and single-stream
        decode reads 22% fewer bytes for these matrices."""
        from fivefold.kernels import int4_ops

        return (self.int8_activations and self.group_size == 16 and self.out_features % STREAM_TILE == 0
                and self.in_features % 32 == 0 and int4_ops() is not None
                and (q.numel() == 0 or (int(q.min()) >= -32 and int(q.max()) <= 31)))

    def _hold_six_bits(self, p: dict, six: bool) -> None:
        """Hold the packed weight at 6 bits (``six``) or as int8 in stream_pack's layout."""
        from fivefold.kernels import int4_ops

        if six != p["six"]:
            p["stream"] = int4_ops().q6_pack(p["stream"]) if six else int4_ops().q6_unpack(p["stream"])
            p["six"] = six

    def _int8_stream(self, stream: torch.Tensor) -> torch.Tensor:
        """Tiles of the held packed weight in stream_pack's int8 layout (unpacked from 6 bits)."""
        if self._prepared is not None and self._prepared.get("six"):
            from fivefold.kernels import int4_ops

            return int4_ops().q6_unpack(stream)
        return stream

    def _pack_scales(self) -> torch.Tensor:
        """The scales the stream kernels take: group scales that float16 holds exactly in its
        tile-major order (replacing the float32 buffer), else the float32 buffer itself."""
        from fivefold.kernels import int4_ops

        s = self.weight_scale
        if self.group_size is None or int4_ops() is None or not torch.equal(s.half().float(), s):
            return s
        self._buffers["weight_scale"] = None
        return int4_ops().int4_pack_groups(s, True)

    def weight_scales(self) -> torch.Tensor:
        """The float32 weight scales, [N] or [N, groups] row-major (unpacked into a new tensor when
        only the kernel's float16 tile-major copy is held)."""
        if self._buffers["weight_scale"] is not None:
            return self.weight_scale
        from fivefold.kernels import int4_ops

        return int4_ops().int4_pack_groups(self._prepared["stream_scale"], False).float()

    def _scale_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Float32 scales of channels [lo, hi) (lo a multiple of the kernel's 4-channel tiles)."""
        if self._buffers["weight_scale"] is not None:
            return self.weight_scale[lo:hi]
        from fivefold.kernels import int4_ops

        return int4_ops().int4_pack_groups(self._prepared["stream_scale"][lo:hi], False).float()

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight [N, K], row-major (unpacked into a new tensor when only the kernel's
        layout is held)."""
        if self._buffers["weight"] is not None:
            return self.weight
        return int8_ops().stream_unpack(self._int8_stream(self._prepared["stream"]))[:, :self.in_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, float32 [len(ids), K] (a tied embedding's lookups:
        HeadRowsEmbedding), read from the one copy held."""
        from fivefold.models.layers import gather_tile_rows

        if self._buffers["weight"] is not None:
            q = self.weight[ids]
        else:
            stream = self._prepared["stream"]
            q = gather_tile_rows(stream, ids, STREAM_TILE,
                                 lambda t: int8_ops().stream_unpack(self._int8_stream(t)))[:, :self.in_features]
        if self._buffers["weight_scale"] is not None:
            scale = self.weight_scale[ids]
        else:
            from fivefold.kernels import int4_ops

            scale = gather_tile_rows(self._prepared["stream_scale"], ids, STREAM_TILE,
                                     lambda t: int4_ops().int4_pack_groups(t, False)).float()
        scale = scale[:, None] if self.group_size is None else scale.repeat_interleave(self.group_size, dim=1)
        return q.float() * scale

    def pack_(self) -> "Int8Linear":
        """Derive the kernel's operands now (the loader calls it so that a tensor's row-major copy is
        dropped as soon as it is packed, not at the first request)."""
        self._prepare()
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._buffers["weight"] is None:
            destination[prefix + "weight"] = self.int8_weight()
        if self._buffers["weight_scale"] is None:
            destination[prefix + "weight_scale"] = self.weight_scales()

    def _load_from_state_dict(self, *args, **kwargs):
        if self._buffers["weight"] is None:  # held packed: take a row-major weight again
            self._buffers["weight"] = torch.empty(self.out_features, self.in_features, dtype=torch.int8)
        if self._buffers["weight_scale"] is None:
            self._buffers["weight_scale"] = torch.empty(self.out_features, self.in_features // self.group_size)
        self._prepared = None  # new weights: re-derive the packed forms
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self._prepare()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if p["clip"] is not None and not (self.scheme == "w8a8" and self.activation == "static"):
            x2 = torch.clamp(x2, *p["clip"])  # dynamic clipping
        y = self._matmul(x2, p)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _matmul(self, x: torch.Tensor, p: dict) -> torch.Tensor:
        kernel = p["kernel"]
        if self.scheme == "w8a16":
            return self._w8a16(x)
        if kernel == "onednn":  # u8 codes: the int8 grid shifted by 128
            scale, zp = p["scale"], p["zp"] + 128
            xq = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
            return w8a8_onednn(xq, scale, zp, p["onednn"], self.weight_scale, p["w_zp"], self.bias)
        if kernel == "fbgemm":
            return torch.ops.quantized.linear_dynamic(x, p["fbgemm"])
        if kernel == "int_mm":
            xq, xs = per_token_quantize(x)
            y = w8a8_int_mm(xq, xs, p["w_t"], self.weight_scale)
            return y + self.bias if self.bias is not None else y
        # Exact kernel: the same grids as the library kernels it stands in for.
        if self.activation == "static":
            scale, zp = p["scale"], p["zp"]
        elif self.activation_granularity == "per-tensor":  # as fbgemm: asymmetric over [min, max] with 0 inside
            lo, hi = (float(v) for v in torch.aminmax(x)) if x.numel() else (0.0, 0.0)
            scale, zp = activation_qparams(lo, hi, symmetric=False)
        else:
            return w8a8_exact_per_token(x, self.weight, self.weight_scale, self.bias)
        return w8a8_exact(quantize_activation(x, scale, zp), scale, zp, self.weight, p["w_sum"],
                          self.weight_scale, self.bias)

    def set_activations_(self, activations: str) -> "Int8Linear":
        """W8A16 only: multiply "float" or "int8" activations (per row and block of 32) by the weights."""
        if activations not in ("float", "int8"):
            raise FivefoldError(f"activations must be float or int8, got '{activations}'")
        groups_fit = self.group_size is None or self.group_size == 16 or self.group_size % 32 == 0
        if activations == "int8" and (self.scheme != "w8a16" or self.in_features % 32 or not groups_fit):
            raise FivefoldError(f"int8 activations need a W8A16 layer with in_features a multiple of 32 and groups "
                                f"of 16 or a multiple of 32, got {self.scheme} with {self.in_features} "
                                f"(groups of {self.group_size})")
        self.int8_activations = activations == "int8"
        if self._prepared is not None and self._prepared.get("stream") is not None:  # 6 bits only with int8 activations
            self._hold_six_bits(self._prepared, self.int8_activations and self._six_bit_fits(self.int8_weight()))
        return self

    def _w8a16(self, x: torch.Tensor) -> torch.Tensor:
        p = self._prepare()
        stream = p.get("stream")
        if self.int8_activations:
            from fivefold.kernels import int4_ops

            if stream is not None and int4_ops() is not None:  # every batch size: integer dot products
                return int4_ops().int8_weight_linear_a8(x, stream, p["stream_scale"], self.bias)
            x = dequantize_activations(*quantize_activations(x))  # the kernel's numbers, through float
        if stream is not None and not p["six"] and x.shape[0] <= quantized_kernel_max_rows(8):
            return int8_ops().int8_weight_linear(x, stream, p["stream_scale"], self.bias)

        def weight_rows(n0: int, n1: int) -> torch.Tensor:  # DEQUANT_TILE: whole 4-channel tiles of the layout
            if stream is None:
                return dequantize_weight(self.weight[n0:n1], self._scale_rows(n0, n1))
            q = int8_ops().stream_unpack(self._int8_stream(stream[n0:n1]))[:, :self.in_features]
            return dequantize_weight(q, self._scale_rows(n0, n1))

        out = tiled_matmul(x, self.out_features, DEQUANT_TILE, weight_rows)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        act = "" if self.scheme == "w8a16" else f", activation={self.activation} {self.activation_granularity}"
        if self.group_size is not None:
            act += f", group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}{act}, "
                f"bias={self.bias is not None}, clipped={self.is_clipped}, kernel={self.kernel}")


def kernels_used(model: nn.Module) -> dict[str, int]:
    """How many :class:`Int8Linear` layers of ``model`` run each kernel on this CPU."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            counts[m.kernel] = counts.get(m.kernel, 0) + 1
    return counts


class _ConvAsLinear:
    """A Conv2d seen as the linear layer it is over unfolded patches: weight [O, C*kh*kw]."""

    def __init__(self, conv: nn.Conv2d) -> None:
        self.weight = conv.weight.detach().reshape(conv.out_channels, -1)
        self.bias = conv.bias


class Int8Conv2d(nn.Module):
    """Conv2d (groups=1) as im2col + :class:`Int8Linear`: the same int8 kernels, over patches."""

    def __init__(self, conv: nn.Conv2d, linear: Int8Linear) -> None:
        super().__init__()
        self.kernel_size, self.stride = conv.kernel_size, conv.stride
        self.padding, self.dilation = conv.padding, conv.dilation
        self.out_channels = conv.out_channels
        self.linear = linear

    @classmethod
    def from_float(cls, conv: nn.Conv2d, config: Int8Format, clip_range=None, bias_shift=None) -> "Int8Conv2d":
        if conv.groups != 1 or conv.padding_mode != "zeros":
            raise ValueError("Int8Conv2d supports groups=1 and zero padding only")
        return cls(conv, Int8Linear.from_float(_ConvAsLinear(conv), config, clip_range, bias_shift))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        cols = torch.nn.functional.unfold(x, self.kernel_size, self.dilation, self.padding, self.stride)  # [B, CK, L]
        out = self.linear(cols.transpose(1, 2))  # [B, L, O]
        oh = (h + 2 * self.padding[0] - self.dilation[0] * (self.kernel_size[0] - 1) - 1) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - self.dilation[1] * (self.kernel_size[1] - 1) - 1) // self.stride[1] + 1
        return out.transpose(1, 2).reshape(b, self.out_channels, oh, ow)
