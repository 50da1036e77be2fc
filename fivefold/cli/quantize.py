"""``fivefold quantize``: the INT8 job (fivefold/jobs/quantize.py)."""

from __future__ import annotations

from fivefold.errors import FivefoldError
from fivefold.models.registry import DEFAULT_LLM


def add_parser(sub) -> None:
    """``fivefold quantize``'s arguments."""
    qz = sub.add_parser("quantize", help="INT8 or 4-bit: quantize an LLM, measure it against float, write a model directory")
    qz.add_argument("--model", default=DEFAULT_LLM)
    qz.add_argument("--scheme", default="w8a16", choices=["w8a16", "w8a8", "w4a16", "w4a8"])
    qz.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq"],
                    help="w4a16, w4a8: round to nearest, GPTQ or AWQ (GPTQ and AWQ calibrate on --num-calibration windows)")
    qz.add_argument("--group-size", type=int, default=128, help="w4a16, w4a8: weights per scale (32, 64, 128, 256)")
    qz.add_argument("--tune-steps", type=int, default=0,
                    help="w4a16, w4a8: then train the group scales (codes kept) for N calibration windows against "
                         "the float model's logits (0: off; e.g. 64 with --num-calibration 32)")
    qz.add_argument("--tune-lr", type=float, default=1e-4, help="Adam learning rate of --tune-steps (cosine to 0)")
    qz.add_argument("--symmetric-weights", action="store_true",
                    help="w4a16, w4a8: codes q - 8 with one scale per group (GGUF Q4_0), no minimum")
    qz.add_argument("--activation", default="dynamic", choices=["dynamic", "static"], help="w8a8 activations")
    qz.add_argument("--activation-granularity", default="per-token", choices=["per-token", "per-tensor"],
                    help="dynamic activations: one scale per token or per tensor")
    qz.add_argument("--asymmetric", action="store_true", help="static activations with a zero point")
    qz.add_argument("--calib", default="minmax", choices=["minmax", "percentile", "entropy", "mse"])
    qz.add_argument("--percentile", type=float, default=99.99)
    qz.add_argument("--granularity", default="per-channel", choices=["per-channel", "per-tensor"],
                    help="weight scales")
    qz.add_argument("--bias-correction", action="store_true")
    qz.add_argument("--smoothquant", type=float, default=None, metavar="ALPHA",
                    help="W8A8: migrate activation outliers into the weights first (SmoothQuant, e.g. 0.7)")
    qz.add_argument("--mixed-precision", action="store_true", help="keep the most sensitive layers float")
    qz.add_argument("--max-ppl-increase", default="0.5%", help="mixed-precision budget, e.g. 0.5%% (default)")
    qz.add_argument("--max-accuracy-drop", type=float, default=None,
                    help="mixed-precision budget in points of next-token accuracy (instead of perplexity)")
    qz.add_argument("--skip", nargs="*", default=[], help="module name patterns kept float, e.g. lm_head")
    qz.add_argument("--num-calibration", type=int, default=16, help="calibration windows of --window tokens")
    qz.add_argument("--num-eval", type=int, default=8, help="held-out windows for perplexity")
    qz.add_argument("--window", type=int, default=256)
    qz.add_argument("--no-baseline", action="store_true",
                    help="skip the float model's measurements (an 8B's float baseline takes longer than quantizing it)")
    qz.add_argument("--out", required=True, help="output model directory")
    qz.add_argument("--format", default="dir", choices=["dir", "gguf"],
                    help="gguf: also write <out>/model.gguf that llama.cpp loads (4-bit layers as their Q4_0/Q4_1 "
                         "blocks, 8-bit ones and the rest as Q8_0; a GGUF source only; not w8a8)")


def _fraction(text: str, flag: str) -> float:
    """'0.5%' or '0.5' (percent) -> 0.005."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise FivefoldError(f"{flag} takes a percentage such as 0.5%, got '{text}'") from None
    if value < 0:
        raise FivefoldError(f"{flag} must be >= 0, got '{text}'")
    return value / 100


def run(args) -> int:
    from fivefold.quant.config import Int8Config
    from fivefold.jobs.quantize import QuantizeJob, run_quantize

    if min(args.num_calibration, args.num_eval, args.window) < 1:
        raise FivefoldError("--num-calibration, --num-eval and --window must be >= 1")
    if args.scheme in ("w4a16", "w4a8"):  # the same 4-bit weights; w4a8 multiplies them by int8 activations
        from fivefold.quant.int4 import Int4Config

        config = Int4Config(group_size=args.group_size, symmetric=args.symmetric_weights, method=args.method,
                            skip=tuple(args.skip), activations="int8" if args.scheme == "w4a8" else "float",
                            tune_steps=args.tune_steps, tune_lr=args.tune_lr)
    elif args.tune_steps:
        raise FivefoldError(f"--tune-steps trains 4-bit group scales: use --scheme w4a16 or w4a8, not {args.scheme}")
    else:
        config = Int8Config(scheme=args.scheme, weight_granularity=args.granularity, activation=args.activation,
                            activation_granularity=args.activation_granularity,
                            activation_symmetric=not args.asymmetric, calibration=args.calib,
                            percentile=args.percentile, bias_correction=args.bias_correction,
                            smoothquant_alpha=args.smoothquant, skip=tuple(args.skip))
    job = QuantizeJob(args.model, config, args.out, args.mixed_precision,
                      _fraction(args.max_ppl_increase, "--max-ppl-increase"), args.max_accuracy_drop,
                      args.num_calibration, args.num_eval, args.window, baseline=not args.no_baseline,
                      format=args.format)
    run_quantize(job)
    return 0
