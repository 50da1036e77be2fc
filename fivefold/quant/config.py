"""``Int8Config``: what ``quantize_`` does to each linear layer (frozen, validated)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fivefold.errors import FivefoldError
from fivefold.models.int8_linear import Int8Format

CALIBRATIONS = ("minmax", "percentile", "entropy", "mse")


@dataclass(frozen=True)
class Int8Config(Int8Format):
    """INT8 quantization of linear layers: the served format (:class:`Int8Format`: scheme,
    weight_granularity, activation, activation_granularity, activation_symmetric) and how its
    values are chosen.

    calibration: how an observer picks each activation's clipping range. Required for
        static activations; for dynamic ones, when calibration data is given, inputs are
        clipped to the calibrated range before quantizing (dynamic clipping), so a rare
        outlier cannot stretch the scale of a whole token.
    bias_correction: shift each layer's bias by the mean output error on calibration data.
    smoothquant_alpha: when set (0 < a < 1, 0.5 typical), first migrate activation outliers
        into the weights (SmoothQuant, Fivefold Llama-family models; needs calibration data).
    skip: module names (fnmatch patterns) left in float.
    """

    calibration: str = "minmax"
    percentile: float = 99.99
    bias_correction: bool = False
    smoothquant_alpha: float | None = None
    skip: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.calibration not in CALIBRATIONS:
            raise FivefoldError(f"calibration must be one of {', '.join(CALIBRATIONS)}, got '{self.calibration}'")
        if not 0 < self.percentile <= 100:
            raise FivefoldError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.smoothquant_alpha is not None and not 0 < self.smoothquant_alpha < 1:
            raise FivefoldError(f"smoothquant_alpha must be in (0, 1), got {self.smoothquant_alpha}")
        object.__setattr__(self, "skip", tuple(self.skip))

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
