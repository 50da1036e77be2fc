"""``Int8Config``: what ``quantize_`` does to each linear layer (frozen, validated)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fivefold.errors import FivefoldError

SCHEMES = ("w8a16", "w8a8")
WEIGHT_GRANULARITIES = ("per-channel", "per-tensor")
ACTIVATION_MODES = ("dynamic", "static")
ACTIVATION_GRANULARITIES = ("per-token", "per-tensor")
CALIBRATIONS = ("minmax", "percentile", "entropy", "mse")


@dataclass(frozen=True)
class Int8Config:
    """INT8 quantization of linear layers.

    scheme: "w8a16" (int8 weights, float activations) or "w8a8" (both int8, int32 accumulation).
    weight_granularity: one symmetric scale per output channel, or one per tensor.
    activation (w8a8): "dynamic" (scales computed per call) or "static" (a scale and zero
        point fixed by calibration; per-tensor).
    activation_granularity (dynamic): "per-token" (one scale per row) or "per-tensor".
    activation_symmetric (static): False gives an asymmetric range with a zero point.
    calibration: how an observer picks each activation's clipping range. Required for
        static activations; for dynamic ones, when calibration data is given, inputs are
        clipped to the calibrated range before quantizing (dynamic clipping), so a rare
        outlier cannot stretch the scale of a whole token.
    bias_correction: shift each layer's bias by the mean output error on calibration data.
    smoothquant_alpha: when set (0 < a < 1, 0.5 typical), first migrate activation outliers
        into the weights (SmoothQuant, Fivefold Llama-family models; needs calibration data).
    skip: module names (fnmatch patterns) left in float.
    """

    scheme: str = "w8a16"
    weight_granularity: str = "per-channel"
    activation: str = "dynamic"
    activation_granularity: str = "per-token"
    activation_symmetric: bool = True
    calibration: str = "minmax"
    percentile: float = 99.99
    bias_correction: bool = False
    smoothquant_alpha: float | None = None
    skip: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name, value, choices in (("scheme", self.scheme, SCHEMES),
                                     ("weight_granularity", self.weight_granularity, WEIGHT_GRANULARITIES),
                                     ("activation", self.activation, ACTIVATION_MODES),
                                     ("activation_granularity", self.activation_granularity, ACTIVATION_GRANULARITIES),
                                     ("calibration", self.calibration, CALIBRATIONS)):
            if value not in choices:
                raise FivefoldError(f"{name} must be one of {', '.join(choices)}, got '{value}'")
        if not 0 < self.percentile <= 100:
            raise FivefoldError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.smoothquant_alpha is not None and not 0 < self.smoothquant_alpha < 1:
            raise FivefoldError(f"smoothquant_alpha must be in (0, 1), got {self.smoothquant_alpha}")
        if self.activation == "static" and self.activation_granularity == "per-token":
            object.__setattr__(self, "activation_granularity", "per-tensor")  # static scales are per tensor
        object.__setattr__(self, "skip", tuple(self.skip))

    @property
    def is_static(self) -> bool:
        return self.scheme == "w8a8" and self.activation == "static"

    @property
    def uses_calibration(self) -> bool:
        """Whether a calibration pass changes the result: static scales, bias correction,
        SmoothQuant, or the clip ranges of dynamic W8A8 (W8A16 needs no data)."""
        return self.scheme == "w8a8" or self.bias_correction or bool(self.smoothquant_alpha)

    @property
    def label(self) -> str:
        if self.scheme == "w8a16":
            return f"W8A16 {self.weight_granularity}"
        act = (f"static {'sym' if self.activation_symmetric else 'asym'} {self.calibration}" if self.is_static
               else f"dynamic {self.activation_granularity}")
        smooth = f", SmoothQuant a={self.smoothquant_alpha}" if self.smoothquant_alpha else ""
        return f"W8A8 {self.weight_granularity} weights, {act}{smooth}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Int8Config":
        return cls(**{**d, "skip": tuple(d.get("skip", ()))})
