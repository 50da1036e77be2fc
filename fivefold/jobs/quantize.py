"""``fivefold quantize``: quantize an LLM, measure it against float, write it; and the one
quantization recipe (:func:`quantize_loaded`) that the CLI, the demo's and the benchmarks'
quantized rows run.

Held-out perplexity (pydoc_data's held-out part, ``num_eval`` windows of ``window``
tokens), next-token accuracy on the same windows, and decode tokens/s at batch 1 and
32 on the serving engine, float and int8 in the same run. With ``mixed_precision``
the sensitivity scan ranks layers on a small held-out sample, the number of layers
kept float is decided on other held-out windows, and the report uses a third set.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError
from fivefold.eval.language import decode_speed, language_metrics, next_token_accuracy, perplexity, served_model
from fivefold.eval.text import text_windows
from fivefold.models.forward import llm_forward
from fivefold.models.int8_linear import Int8Linear, kernels_used
from fivefold.platform import current_platform
from fivefold.quant.config import Int8Config
from fivefold.quant.int4 import Int4Config
from fivefold.quant.quantize import QuantizationResult, quantize_

NUM_CALIBRATION = 16  # calibration windows of the recipe (pydoc_data's calibration part)
CALIBRATION_WINDOW = 256  # tokens each


def calibration_windows(tokenizer, config: Int8Config, num_windows: int = NUM_CALIBRATION,
                        window: int = CALIBRATION_WINDOW) -> list[list[int]] | None:
    """The recipe's calibration data for ``config``: None when the config needs none (W8A16)."""
    return text_windows(tokenizer, "calibration", num_windows, window) if config.uses_calibration else None


def quantize_loaded(loaded, config: Int8Config | Int4Config, num_windows: int = NUM_CALIBRATION,
                    window: int = CALIBRATION_WINDOW, show_progress: bool = True):
    """The recipe: quantize ``loaded``'s model in place with ``config`` (calibrated on ``num_windows``
    windows of ``window`` tokens of the calibration text when the config needs data), recording
    the config on ``loaded.quantization``. An :class:`Int4Config` runs :func:`quantize_int4_`."""
    data = calibration_windows(loaded.tokenizer, config, num_windows, window)
    if isinstance(config, Int4Config):
        from fivefold.quant.int4 import quantize_int4_

        result = quantize_int4_(loaded.model, config, data, llm_forward, show_progress=show_progress)
        loaded.quantization = config.to_dict()
        return result
    result = quantize_(loaded.model, config, data, llm_forward, show_progress=show_progress)
    loaded.quantization = config.to_dict()
    return result


@dataclass(frozen=True)
class QuantizeJob:
    model: str
    config: Int8Config | Int4Config
    out: str
    mixed_precision: bool = False
    max_ppl_increase: float | None = None  # fraction, 0.005 = +0.5%
    max_accuracy_drop: float | None = None  # percentage points of next-token accuracy
    num_calibration: int = NUM_CALIBRATION
    num_eval: int = 8
    window: int = CALIBRATION_WINDOW
    speed_batches: tuple[int, ...] = (1, 32)
    speed_tokens: int = 48
    baseline: bool = True  # measure the float model too (False: the quantized one only)
    format: str = "dir"  # "gguf": also write <out>/model.gguf for llama.cpp (see check_gguf_export)

    def __post_init__(self) -> None:
        if self.format not in OUTPUT_FORMATS:
            raise FivefoldError(f"--format must be one of {', '.join(OUTPUT_FORMATS)}, got '{self.format}'")
        if self.format == "gguf":
            check_gguf_export(self.model, self.config)


OUTPUT_FORMATS = ("dir", "gguf")


def check_gguf_export(model: str, config) -> None:
    """Refuse before any work what a GGUF file cannot hold: W8A8 (llama.cpp has no activation
    scales to read) and a source that is not a GGUF file (its tokenizer would need llama.cpp's
    converter). 4-bit layers are written as the Q4_0 (symmetric) or Q4_1 blocks they are, W8A16
    layers and everything else quantized as Q8_0 (fivefold.models.gguf_export)."""
    from fivefold.models.loader import find_checkpoint
    from fivefold.models.registry import resolve_model_path

    scheme = config.to_dict().get("scheme")
    if scheme == "w8a8":
        raise FivefoldError("--format gguf writes weights only (Q4_0/Q4_1/Q8_0): use --scheme w8a16, w4a16 or w4a8")
    fmt, _ = find_checkpoint(resolve_model_path(model))
    if fmt != "gguf":
        raise FivefoldError(f"--format gguf copies the tokenizer of a GGUF source; {model} is a {fmt} checkpoint "
                            f"(convert it with llama.cpp's convert_hf_to_gguf.py)")


def evaluate(loaded, eval_windows, job: QuantizeJob) -> dict[str, Any]:
    ppl, acc = language_metrics(served_model(loaded), eval_windows)
    return {"perplexity": ppl, "next_token_accuracy": acc,
            **{f"decode_tok_s_batch{b}": decode_speed(loaded, b, job.speed_tokens) for b in job.speed_batches}}


def build_quantized(job: QuantizeJob, console=None):
    """Load ``job.model`` and quantize it (with the sensitivity scan and mixed precision if asked).

    Returns (loaded model, int8 module names, names kept float, sensitivity scan or None)."""
    import torch

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.memory_plan import check_fits
    from fivefold.models import load_model
    from fivefold.quant.quantize import calibrate, target_linears
    from fivefold.quant.quantization_sensitivity import (
        mixed_precision,
        quantization_sensitivity_scan,
        save_quantization_scan,
    )

    config = job.config
    if isinstance(config, Int4Config):
        return build_int4(job, console)
    if not job.mixed_precision and config == Int8Config(scheme="w8a16", skip=config.skip) and not config.skip:
        # Per-channel W8A16 needs no data: quantized tensor by tensor while loading, so that the float
        # model is never whole in memory (an 8B model quantizes in 24 GiB); the same int8 values.
        loaded = load_model(job.model, before_weights=lambda c, is_int8, bits, *_: check_fits(
            job.model, c, torch.float32, EngineConfig(), True, bits=bits), quantization="w8a16")
        loaded.quantization = config.to_dict()
        return loaded, int8_module_names(loaded.model), [], None
    loaded = load_model(job.model)
    tok = loaded.tokenizer
    if not job.mixed_precision:
        quantize_loaded(loaded, config, job.num_calibration, job.window)
        return loaded, int8_module_names(loaded.model), [], None
    data = calibration_windows(tok, config, job.num_calibration, job.window)
    # Rank layers on a small held-out sample (one evaluation per layer), decide how many
    # to keep float on a large one (a few evaluations), report on yet other windows.
    float_model = load_model(job.model).model
    if config.smoothquant_alpha:  # the scan measures the layers as they will be quantized: smoothed
        from fivefold.quant.smoothquant import smooth_

        smooth_(float_model, data, llm_forward, config.smoothquant_alpha)
    scan_metric, decide, acceptable = _budget(job, tok, float_model)
    ranges = (calibrate(float_model, target_linears(float_model, config.skip), config, data, llm_forward)
              if data else None)
    base, scan = quantization_sensitivity_scan(float_model, config, scan_metric, ranges=ranges)
    save_quantization_scan(Path(job.out) / "sensitivity.json", config, base, scan)
    model, kept, _ = mixed_precision(lambda: load_model(job.model).model, config, scan, acceptable, decide,
                                     data, llm_forward, ranges=ranges)
    loaded.model = model
    loaded.quantization = config.to_dict()
    return loaded, int8_module_names(model), kept, scan


def _budget(job: QuantizeJob, tok, float_model):
    """(metric of the sensitivity scan, metric of the decision, acceptable(value)) of a mixed
    precision search: layers ranked on a small held-out sample (one evaluation per layer), the
    decision on a larger one (a few evaluations), the report on yet other windows."""
    scan_windows = text_windows(tok, "heldout", 2, 128, seed=1)
    decide_windows = text_windows(tok, "heldout", job.num_eval, job.window, seed=2)
    use_accuracy = job.max_accuracy_drop is not None

    def metric_on(windows):
        if use_accuracy:
            return lambda m: 100.0 - next_token_accuracy(m, windows)  # error rate, lower is better
        return lambda m: perplexity(m, windows)

    decide = metric_on(decide_windows)
    decide_base = decide(float_model)
    if use_accuracy:
        return metric_on(scan_windows), decide, lambda v: v <= decide_base + job.max_accuracy_drop
    budget = job.max_ppl_increase if job.max_ppl_increase is not None else 0.005
    return metric_on(scan_windows), decide, lambda v: v <= decide_base * (1 + budget)


def build_int4(job: QuantizeJob, console=None):
    """4-bit weights (:func:`fivefold.quant.int4.quantize_int4_`): RTN in groups of 128 with a
    minimum streams (quantized tensor by tensor while loading, as ``--quantization w4a16``); other
    group sizes and GPTQ/AWQ load the float model, calibrate and quantize it."""
    import torch

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.memory_plan import check_fits
    from fivefold.models import load_model
    from fivefold.models.assemble import W4A16
    from fivefold.quant.int4 import quantize_int4_

    config = job.config
    if job.mixed_precision:  # bit widths per layer: 4, 8 (the most sensitive), float if 8 is not enough
        from fivefold.quant.quantization_sensitivity import int4_sensitivity_scan, mixed_bits, save_quantization_scan

        loaded = load_model(job.model)
        data = (text_windows(loaded.tokenizer, "calibration", job.num_calibration, job.window)
                if config.uses_calibration else None)
        scan_metric, decide, acceptable = _budget(job, loaded.tokenizer, loaded.model)
        base, scan = int4_sensitivity_scan(loaded.model, config, scan_metric, show_progress=console is not None)
        save_quantization_scan(Path(job.out) / "sensitivity.json", config, base, scan)
        loaded.model, eight, _ = mixed_bits(lambda: load_model(job.model).model, config, scan, acceptable, decide,
                                            data, llm_forward, show_progress=console is not None)
        loaded.quantization = config.to_dict()
        return loaded, int8_module_names(loaded.model), eight, scan
    if config.method == "rtn" and (config.group_size, config.symmetric) == (W4A16.group_size, W4A16.symmetric) \
            and not config.skip and config.head_bits == 8:
        loaded = load_model(job.model, before_weights=lambda c, is_int8, bits, *_: check_fits(
            job.model, c, torch.float32, EngineConfig(), True, bits=bits), quantization=config.scheme)
    else:
        loaded = load_model(job.model)
        data = (text_windows(loaded.tokenizer, "calibration", job.num_calibration, job.window)
                if config.uses_calibration else None)
        quantize_int4_(loaded.model, config, data, llm_forward, show_progress=console is not None)
    loaded.quantization = config.to_dict()
    return loaded, int8_module_names(loaded.model), [], None


def int8_module_names(model) -> list[str]:
    """Every quantized layer of ``model`` (int8 and 4-bit): those quantized here and those the
    checkpoint held (Q8_0, Q4_0, Q4_1)."""
    from fivefold.models.int4_linear import Int4Linear

    return [n for n, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))]


def run_quantize(job: QuantizeJob, console=None) -> dict[str, Any]:
    """Float baseline, quantize (optionally mixed precision), int8 measurements, save; return the report."""
    import torch
    from rich.console import Console

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.memory_plan import check_fits
    from fivefold.errors import FivefoldError
    from fivefold.models import load_model
    from fivefold.models.loader import load_tokenizer, save_quantized

    console = console or Console(width=130)
    out = Path(job.out)
    tokenizer, model_config = load_tokenizer(job.model)
    if job.window > model_config.max_model_len:
        raise FivefoldError(f"--window {job.window} is longer than the model's context "
                            f"({model_config.max_model_len} tokens)")
    eval_windows = text_windows(tokenizer, "heldout", job.num_eval, job.window, seed=0)
    # The float baseline is served whole: in float32 where that fits, else in bfloat16, else skipped
    # (the quantization itself streams, see build_quantized).
    baseline, baseline_dtype = None, None
    for dtype in (torch.float32, torch.bfloat16) if job.baseline else ():
        try:
            check_fits(job.model, model_config, dtype, EngineConfig())
        except FivefoldError:
            continue
        baseline_dtype = str(dtype).removeprefix("torch.")
        console.print(f"float baseline ({baseline_dtype}): {job.num_eval} held-out windows of {job.window} tokens ...")
        baseline = evaluate(load_model(job.model, dtype, weight_layout="packed"), eval_windows, job)  # one copy
        break
    if baseline is None:
        console.print("float baseline skipped: " + ("the float model does not fit in memory" if job.baseline else
                                                    "--no-baseline") + " (the quantized one is measured)")
    start = time.perf_counter()
    loaded, modules, kept, scan = build_quantized(job, console)
    quantize_s = time.perf_counter() - start
    config = job.config
    from fivefold.quant.int4 import bits_per_weight

    bits = bits_per_weight(loaded.model)
    # with 4-bit weights, mixed precision keeps the most sensitive layers at 8 bits (not float)
    kept_key = "kept_8bit" if isinstance(config, Int4Config) else "kept_float"
    save_quantized(loaded, config.to_dict(), modules, out, extra={kept_key: kept})
    gguf_path = None
    if job.format == "gguf":
        from fivefold.models.gguf_export import export_gguf

        gguf_path = str(export_gguf(loaded, out / "model.gguf", qtype="Q8_0"))
        console.print(f"GGUF for llama.cpp: {gguf_path}")
    del loaded  # written: the reloaded model is the one measured (an 8B held twice would double the peak)
    reloaded = load_model(str(out))  # measure what was written, as `generate` and `serve` will run it
    quantized = evaluate(reloaded, eval_windows, job)
    report = {"model": job.model, "config": config.to_dict(), "label": config.label, "out": str(out),
              "num_int8_modules": len(modules), "kernels": kernels_used(reloaded.model),
              "platform": current_platform().describe(), kept_key: kept, "bits_per_weight": bits,
              "quantize_s": quantize_s, **({"gguf": gguf_path} if gguf_path else {}),
              "float": baseline, "float_dtype": baseline_dtype, "int8": quantized}
    if baseline is not None:
        report["perplexity_increase"] = quantized["perplexity"] / baseline["perplexity"] - 1
        report.update({f"speedup_batch{b}": quantized[f"decode_tok_s_batch{b}"] / baseline[f"decode_tok_s_batch{b}"]
                       for b in job.speed_batches})
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    render(report, scan, console)
    print(json.dumps({"benchmark": "quantize", **report}))
    return report


def render(report: dict, scan, console) -> None:
    from rich.table import Table

    if scan:
        t = Table(title="sensitivity: one layer quantized at a time (most sensitive first)")
        for col in ("layer", "metric", "increase"):
            t.add_column(col, justify="left" if col == "layer" else "right")
        for s in scan[:15]:
            t.add_row(s.name, f"{s.metric:.4f}", f"{s.increase:+.2%}")
        console.print(t)
        kept_key, where = ("kept_8bit", "at 8 bits") if "kept_8bit" in report else ("kept_float", "in float")
        kept = report[kept_key]
        if kept:
            console.print(f"mixed precision keeps {len(kept)} layers {where}: "
                          f"{', '.join(kept[:12])}{' ...' if len(kept) > 12 else ''}")
    console.print(f"{report['bits_per_weight']:.2f} bits per weight over the decoder's projections")
    float_dtype = report.get("float_dtype") or "float"
    t = Table(title=f"{report['model']}: {float_dtype} vs {report['label']} ({report['num_int8_modules']} quantized layers)")
    for col in ("metric", float_dtype, "quantized", "change"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    q = report["int8"]
    if report["float"] is None:  # the float model did not fit: int8 figures only
        f = {k: float("nan") for k in q}
        report = {**report, "perplexity_increase": float("nan"),
                  **{k: float("nan") for k in report if k.startswith("speedup")}}
    else:
        f = report["float"]
    t.add_row("held-out perplexity", f"{f['perplexity']:.3f}", f"{q['perplexity']:.3f}",
              f"{report['perplexity_increase']:+.2%}")
    t.add_row("next-token accuracy (%)", f"{f['next_token_accuracy']:.2f}", f"{q['next_token_accuracy']:.2f}",
              f"{q['next_token_accuracy'] - f['next_token_accuracy']:+.2f} pt")
    for key in f:
        if key.startswith("decode_tok_s_batch"):
            b = key.removeprefix("decode_tok_s_batch")
            t.add_row(f"decode tok/s, batch {b}", f"{f[key]:.1f}", f"{q[key]:.1f}", f"{q[key] / f[key]:.2f}x")
    console.print(t)
    kernels = ", ".join(f"{k} ({n} layers)" for k, n in report["kernels"].items())
    console.print(f"int8 kernels on this CPU ({report['platform']['isa_level']}): {kernels}")
    console.print(f"written to {report['out']} (model.safetensors, config.json, report.json)")
