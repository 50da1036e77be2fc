"""``fivefold demo``: the whole story on one model, in one command.

1. Profile the baseline (decode and prefill): where the time goes, and the verdict.
2. Turn on one lever at a time. Each row of the table is a pair of runs of the same
   workload whose configurations differ in exactly one variable (checked through the
   run registry), measured back to back in this process on one loaded model.
3. Print the five-lever table (lever, change, metric before -> after, ratio, accuracy
   cost as greedy-token agreement with the run before) and save a bar chart.

Levers that have not landed yet are listed as such, never simulated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.bench.offline_bench import (
    bench_name,
    make_config,
    prepared_model,
    run_offline,
    token_agreement,
)
from fivefold.bench.registry import RunRegistry, machine_description
from fivefold.models.fingerprint import model_fingerprint
from fivefold.quant.config import Int8Config
from fivefold.quant.int4 import Int4Config


@dataclass(frozen=True)
class DemoSizes:
    hardware_requests: int
    batching_requests: int
    prefix_requests: int
    prefix_len: int
    input_len: int
    output_len: int
    profile_seq: int
    eval_windows: int  # held-out 256-token windows for the perplexity of the quantization rows
    cnn_image_size: int = 224  # input of the CNN fusion rows (ResNet-18, MobileNet-V2 at batch 1)
    embedding_requests: int = 256  # per closed-loop run of the dynamic-batching row (32 clients)
    digits_epochs: int = 12  # training of the digits ResNet the structure rows prune and distill
    copy_requests: int = 2  # passages of the speculation rows' copy workload, one after another
    copy_output_len: int = 96
    draft_distill_steps: int = 40  # KD steps of the every-other-layer student the draft row uses
    long_context: int = 2048  # prompt tokens of the int8 KV cache's decode row


QUICK = DemoSizes(hardware_requests=8, batching_requests=16, prefix_requests=8, prefix_len=384, input_len=64,
                  output_len=32, profile_seq=128, eval_windows=4)
FULL = DemoSizes(hardware_requests=32, batching_requests=64, prefix_requests=32, prefix_len=512, input_len=128,
                 output_len=64, profile_seq=256, eval_windows=8, copy_requests=4, copy_output_len=128)
KV_CACHE_BYTES = float(512 << 20)


@dataclass
class LeverRow:
    lever: str
    change: str
    metric: str
    before: float | None = None
    after: float | None = None
    higher_is_better: bool = True
    accuracy: str = ""
    runs: tuple[int, int] | None = None
    status: str = "measured"

    @property
    def ratio(self) -> float | None:
        """Speed-up: > 1 means the lever helped, whichever direction the metric goes."""
        if self.before is None or self.after is None or not self.before or not self.after:
            return None
        return self.after / self.before if self.higher_is_better else self.before / self.after


class _Runner:
    """Runs configurations on one loaded model, stores them, keeps their metrics."""

    def __init__(self, loaded, fingerprint: str | None, registry: RunRegistry | None, console) -> None:
        self.loaded = loaded
        self.fingerprint = fingerprint
        self.registry = registry
        self.console = console
        self.metrics: dict[int, dict] = {}
        self._by_config: dict[str, int] = {}  # a configuration already measured is not run again
        self._local_ids = iter(range(-1, -10_000, -1))

    def run(self, config: dict, what: str) -> int:
        key = json.dumps(config, sort_keys=True)
        if key in self._by_config:
            return self._by_config[key]
        self.console.print(f"  running: {what} ...")
        self.loaded = prepared_model(config, self.loaded)  # quantized (or reloaded float) as the config says
        metrics = run_offline(config, self.loaded, show_progress=False)
        if config["num_requests"] == 1:
            # A single stream runs for a few seconds: timer noise and oneDNN's first-shape JIT
            # move it by 10-20% here, so it is measured twice and the faster run is kept.
            again = run_offline(config, self.loaded, show_progress=False)
            metrics = max(metrics, again, key=lambda m: m["decode_tok_s"])
        name = bench_name(config["workload"])
        if self.registry is not None:
            run_id = self.registry.record(name, config, metrics, self.fingerprint)
            if self.registry.baseline(name) is None:
                self.registry.set_baseline(run_id)
        else:
            run_id = next(self._local_ids)
        self.metrics[run_id] = metrics
        self._by_config[key] = run_id
        return run_id

    def row(self, lever: str, change: str, metric: str, key: tuple[str, ...], before_cfg: dict, after_cfg: dict,
            higher_is_better: bool, what: str) -> LeverRow:
        a = self.run(before_cfg, f"{what}, before")
        b = self.run(after_cfg, f"{what}, after")
        if self.registry is not None:
            num_changed = self.registry.compare(a, b).num_changed_variables
            assert num_changed == 1, f"demo row '{change}' changed {num_changed} variables"

        def pick(m):
            for k in key:
                m = m[k]
            return m

        ma, mb = self.metrics[a], self.metrics[b]
        agreement = token_agreement(ma, mb)
        accuracy = "none: greedy tokens identical" if agreement == 1.0 else f"{agreement:.1%} of greedy tokens agree"
        if "heldout_perplexity" in ma and "heldout_perplexity" in mb:
            # Perplexity is the measure here: greedy continuations that diverge once differ
            # from then on, so token agreement says little about the size of the change.
            pa, pb = ma["heldout_perplexity"], mb["heldout_perplexity"]
            accuracy = f"held-out ppl {pa:.2f} -> {pb:.2f} ({pb / pa - 1:+.2%})"
        return LeverRow(lever, change, metric, pick(ma), pick(mb), higher_is_better, accuracy, (a, b))


def _with_engine(config: dict, **changes) -> dict:
    return {**config, "engine": {**config["engine"], **changes}}


def _structure_rows(epochs: int, console) -> list[LeverRow]:
    """The digits ResNet (trained here): 50% of channels pruned + fine-tuning, and a half-width
    student distilled from it; batch-1 latency against the original (fivefold prune/distill)."""
    import torch

    from fivefold.jobs.digits_report import add_latencies, epoch_steps, measure, train_batches
    from fivefold.compress.distill import DistillConfig, distill
    from fivefold.compress.structured import prune_channels
    from fivefold.models.cnn import DigitsResNet
    from fivefold.eval.digits import load_digits_split, train

    console.print("  running: digits ResNet, pruning and distillation ...")
    torch.manual_seed(0)
    data = load_digits_split()
    teacher = train(DigitsResNet(96), data.train, epochs)
    x = data.calibration[0][:1]
    pruned = train(prune_channels(teacher, (x,), 0.5), data.train, max(1, epochs // 2), lr=1e-3)
    steps = epoch_steps(data, epochs)
    student = distill(DigitsResNet(48), teacher, train_batches(data), DistillConfig(steps=steps))
    rows = [measure(n, m, data) for n, m in (("original", teacher), ("pruned", pruned), ("student", student))]
    add_latencies(rows, data.test[0][:1])
    original = rows[0]

    def accuracy_cost(row) -> str:
        return (f"test accuracy {original['test_accuracy']:.2f} -> {row['test_accuracy']:.2f} "
                f"({row['test_accuracy'] - original['test_accuracy']:+.2f} points)")

    return [LeverRow("1 structure", f"digits ResNet: 50% of channels pruned (L1) + fine-tune, "
                     f"{original['mflops']:.0f} -> {rows[1]['mflops']:.0f} MFLOPs", "latency us, batch 1",
                     original["latency_us"], rows[1]["latency_us"], False, accuracy_cost(rows[1])),
            LeverRow("1 structure", f"digits ResNet: half-width student distilled (T 4 -> 1, {steps} steps)",
                     "latency us, batch 1", original["latency_us"], rows[2]["latency_us"], False,
                     accuracy_cost(rows[2]))]


def _dynamic_batching_row(num_requests: int, console) -> LeverRow:
    """Embeddings of all-MiniLM-L6-v2, 32 closed-loop clients, inputs of 5-250 tokens:
    batching off vs the dynamic batcher with length buckets (benchmarks/embeddings.py has all modes)."""
    import torch

    from fivefold.batching.config import BatcherConfig
    from fivefold.batching.encoder import EncoderModel, measure_auto_delay
    from fivefold.bench.embeddings_bench import closed_loop, mixed_inputs, mode_config
    from fivefold.models.registry import resolve_model_path
    from fivefold.serve.embeddings import sample_ids

    console.print("  running: dynamic batching of embeddings, off vs length buckets ...")
    encoder = EncoderModel(resolve_model_path("all-minilm-l6-v2"))
    inputs = mixed_inputs(encoder, 256, "loguniform")
    delay = measure_auto_delay(encoder.embed, sample_ids(encoder), BatcherConfig().auto_delay_factor)
    off, on = (closed_loop(encoder, mode_config(mode, delay), inputs, 32, num_requests) for mode in ("off", "buckets"))
    common = sorted(set(off["outputs"]) & set(on["outputs"]))
    cosine = min(float(torch.dot(off["outputs"][i], on["outputs"][i])) for i in common)
    return LeverRow("4 scheduling", "dynamic batching, length buckets: off -> on (MiniLM embeddings, 32 clients, "
                    "5-250 tokens)", "requests/s", off["throughput"], on["throughput"], True,
                    f"none: min cosine {cosine:.6f}; padding efficiency {on['padding_efficiency']:.0%}")


def distilled_student(model: str, out_dir: Path, steps: int, console) -> Path:
    """The every-other-layer student of ``model`` that ``fivefold distill`` writes (``steps`` KD
    steps), under ``out_dir``; made once, reused while its report names the same job."""
    from fivefold.jobs.compress import DistillJob, run_distill

    job = DistillJob(model, str(out_dir / f"student-{steps}"), steps=steps)
    report = Path(job.out_dir) / "report.json"
    if report.exists() and json.loads(report.read_text()).get("job", {}).get("steps") == steps:
        console.print(f"  draft: the distilled student in {job.out_dir} (made earlier)")
    else:
        console.print(f"  running: fivefold distill --teacher {model} --steps {steps} (the draft model) ...")
        run_distill(job, console)
    return Path(job.out_dir)


def _speculation_rows(runner: "_Runner", model: str, sizes: DemoSizes, out_dir: Path, console) -> list[LeverRow]:
    """Prompt lookup and the distilled student as draft, each against the same engine without
    speculation, on the copy workload, one request at a time (greedy: output identical)."""
    student = distilled_student(model, out_dir, sizes.draft_distill_steps, console)
    rows = []
    for method, k, extra in (("ngram", 4, {}), ("draft", 3, {"draft_model": str(student)})):
        plain = make_config(model, workload="copy", num_requests=sizes.copy_requests, output_len=sizes.copy_output_len,
                            kv_cache_memory_bytes=KV_CACHE_BYTES, num_speculative_tokens=k, **extra)
        fast = _with_engine(plain, speculative=method)
        row = runner.row("4 scheduling", "speculative decoding: off -> " + (
            "prompt lookup (ngram, k 4), copy workload" if method == "ngram" else
            f"draft = every-other-layer student ({sizes.draft_distill_steps} KD steps, k 3), copy workload"),
            "decode tok/s", ("decode_tok_s",), plain, fast, True, f"speculation, {method}")
        spec = runner.metrics[row.runs[1]]["speculative"]
        row.accuracy += (f"; acceptance {spec['spec_acceptance_rate']:.0%}, "
                         f"{spec['spec_mean_accepted_length']:.2f} tokens per verification")
        rows.append(row)
    return rows


def _kv_cache_int8_rows(runner: "_Runner", model: str, sizes: DemoSizes, console) -> list[LeverRow]:
    """The int8 KV cache against the float one: tokens that fit the same pool (with the held-out
    perplexity cost, teacher-forced through the paged cache), and decode at a long context."""
    from fivefold.engine.config import EngineConfig
    from fivefold.engine.model_runner import kv_pool_num_blocks
    from fivefold.eval.language import engine_teacher_forced, entries_perplexity, top1_agreement
    from fivefold.eval.text import text_windows

    console.print("  running: int8 KV cache, pool capacity and teacher-forced perplexity ...")
    loaded = runner.loaded
    capacity = {}
    for dtype in ("auto", "int8"):
        config = EngineConfig(kv_cache_dtype=dtype, kv_cache_memory_bytes=int(KV_CACHE_BYTES))
        capacity[dtype] = kv_pool_num_blocks(loaded.model, config) * config.block_size
    window = min(256, loaded.config.max_model_len - 1)  # a prompt must leave room for one new token
    windows = text_windows(loaded.tokenizer, "heldout", max(2, sizes.eval_windows), window, seed=1)
    ref, ours = (engine_teacher_forced(loaded, windows, kv_cache_dtype=d) for d in ("auto", "int8"))
    ppl_f, ppl_q = entries_perplexity(ref), entries_perplexity(ours)
    quality = (f"held-out ppl {ppl_f:.2f} -> {ppl_q:.2f} ({ppl_q / ppl_f - 1:+.2%}); top-1 agreement "
               f"{top1_agreement(ref, ours):.1%}")
    rows = [LeverRow("5 caching", f"int8 KV cache (per-row scales, rotated keys): tokens in "
                     f"{int(KV_CACHE_BYTES) >> 20} MiB", "KV tokens", capacity["auto"], capacity["int8"], True, quality)]
    plain = make_config(model, workload="throughput", num_requests=1, input_len=sizes.long_context,
                        output_len=sizes.output_len, kv_cache_memory_bytes=KV_CACHE_BYTES,
                        max_num_batched_tokens=max(2048, sizes.long_context), enable_prefix_caching=False)
    rows.append(runner.row("5 caching", f"int8 KV cache: decode at a {sizes.long_context}-token context (batch 1)",
                           "decode tok/s", ("decode_tok_s",), plain, _with_engine(plain, kv_cache_dtype="int8"), True,
                           "int8 KV cache"))
    return rows


def _cnn_fusion_rows(image_size: int, console) -> list[LeverRow]:
    """``fuse`` (BN folding, oneDNN post-ops, channels_last) on the reference CNNs at batch 1.

    Not engine runs, so not in the run registry: the before/after pair is eager vs fused
    latency of the same module on the same input, timed back to back."""
    import torch

    from fivefold.jobs.fuse import build_fusable
    from fivefold.fuse.graph_fuse import fuse
    from fivefold.fuse.layout import median_us

    rows = []
    for name in ("resnet18", "mobilenet_v2"):
        console.print(f"  running: fuse {name}, eager vs fused ...")
        model, inputs = build_fusable(name, image_size)
        x = inputs(1)
        fused, report = fuse(model, x)
        eager_ms, fused_ms = (median_us(lambda m=m: m(*x), 10) / 1e3 for m in (model, fused))
        with torch.inference_mode():
            diff = float((fused(*x) - model(*x)).abs().max())
        rows.append(LeverRow("2 hardware", f"{name}: fx fusion + channels_last ({report.kernels_before} -> "
                             f"{report.kernels_after} kernels)", "latency ms, batch 1", eager_ms, fused_ms, False,
                             f"none: max |diff| {diff:.0e}"))
    return rows


def run_demo(model: str, quick: bool = True, registry_path: str | None = ".fivefold/runs.db",
             out_dir: str | Path = ".fivefold", console=None, sizes: DemoSizes | None = None,
             html_path: str | Path | None = None) -> dict[str, Any]:
    """Profile, then one lever at a time; print the table, save the plot; return everything as a dict.

    ``sizes`` overrides the workload sizes of the quick/full mode (tests use tiny ones);
    ``html_path``: also the table, verdicts and plot as one self-contained HTML file."""
    from rich.console import Console

    from fivefold.models import load_model
    from fivefold.profile.llm_profile import profile_llm

    console = console or Console(width=160)
    sizes = sizes or (QUICK if quick else FULL)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.rule(f"fivefold demo ({'quick' if quick else 'full'}) on {model}")
    machine = machine_description()
    cpu = machine["cpu"]
    console.print(f"machine: {cpu['cpu']}, {cpu['isa_level']}{' (forced by ' + cpu['forced'] + ')' if cpu['forced'] else ''}, "
                  f"VNNI {'yes' if cpu['vnni'] else 'no'}, bf16 {'yes' if cpu['bf16_compute'] else 'no'}, "
                  f"{machine['threads']} threads (fivefold env for the kernel of each path)")
    loaded = load_model(model, "float32")
    registry = RunRegistry(registry_path) if registry_path else None
    runner = _Runner(loaded, model_fingerprint(model), registry, console)
    baseline_engine = dict(weight_layout="dense", decode_attention="torch", hot_path="eager",
                           kv_cache_memory_bytes=KV_CACHE_BYTES)

    # 1. Profile first: the baseline, before any lever (dense weights, gather + SDPA decode).
    console.rule("1. profile the baseline")
    profiles = {}
    for mode in ("decode", "prefill"):
        report = profile_llm(loaded, mode, batch=1, seq=sizes.profile_seq, num_iterations=4 if mode == "decode" else 2,
                             trace_path=out_dir / f"demo-trace-{mode}.json", **baseline_engine)
        report.render(console, num_ops=8, compact=True)
        profiles[mode] = report

    # 2. One lever at a time.
    console.rule("2. one lever at a time")
    rows: list[LeverRow] = []
    hw = make_config(model, workload="throughput", num_requests=sizes.hardware_requests, input_len=sizes.input_len,
                     output_len=sizes.output_len, **baseline_engine)
    kernel = _with_engine(hw, decode_attention="kernel")
    rows.append(runner.row("2 hardware", "decode attention: gather + SDPA -> paged C++ kernel", "output tok/s",
                           ("output_tok_s",), hw, kernel, True, "decode attention"))
    packed = _with_engine(kernel, weight_layout="packed")
    rows.append(runner.row("2 hardware", "weight layout: dense -> oneDNN-packed", "output tok/s", ("output_tok_s",),
                           kernel, packed, True, "weight layout"))
    single = make_config(model, workload="throughput", num_requests=1, input_len=sizes.input_len,
                         output_len=2 * sizes.output_len, **{**baseline_engine, "decode_attention": "kernel",
                                                             "weight_layout": "packed"})
    rows.append(runner.row("2 hardware", "hot path: add+RMSNorm, SiLU*up, RoPE as fused C++ kernels (batch 1)",
                           "decode tok/s", ("decode_tok_s",), single, _with_engine(single, hot_path="fused"), True,
                           "fused hot path"))
    rows += _cnn_fusion_rows(sizes.cnn_image_size, console)
    rows += _structure_rows(sizes.digits_epochs, console)
    one_at_a_time = make_config(model, workload="throughput", num_requests=sizes.batching_requests,
                                input_len=sizes.input_len, output_len=sizes.output_len, max_num_seqs=1,
                                kv_cache_memory_bytes=KV_CACHE_BYTES)
    batched = _with_engine(one_at_a_time, max_num_seqs=sizes.batching_requests)
    rows.append(runner.row("4 scheduling", f"continuous batching: 1 -> {sizes.batching_requests} sequences per step",
                           "output tok/s", ("output_tok_s",), one_at_a_time, batched, True, "continuous batching"))
    no_cache = make_config(model, workload="shared-prefix", num_requests=sizes.prefix_requests, input_len=32,
                           output_len=4, prefix_len=sizes.prefix_len, enable_prefix_caching=False,
                           kv_cache_memory_bytes=KV_CACHE_BYTES)
    rows.append(_dynamic_batching_row(sizes.embedding_requests, console))
    rows += _speculation_rows(runner, model, sizes, out_dir, console)
    rows += _kv_cache_int8_rows(runner, model, sizes, console)
    cached = _with_engine(no_cache, enable_prefix_caching=True)
    rows.append(runner.row("5 caching", f"prefix cache (radix tree), {sizes.prefix_len}-token shared prefix: off -> on",
                           "mean TTFT (ms)", ("ttft_s", "mean"), no_cache, cached, False, "prefix cache"))
    # Quantization last: int8 replaces the shared model's layers (a float run after it reloads).
    float_b1 = make_config(model, workload="throughput", num_requests=1, input_len=sizes.input_len,
                           output_len=2 * sizes.output_len, eval_windows=sizes.eval_windows,
                           kv_cache_memory_bytes=KV_CACHE_BYTES)
    float_bn = make_config(model, workload="throughput", num_requests=sizes.batching_requests,
                           input_len=sizes.input_len, output_len=sizes.output_len, eval_windows=sizes.eval_windows,
                           kv_cache_memory_bytes=KV_CACHE_BYTES)
    runner.run(float_b1, "float32, batch 1")
    runner.run(float_bn, f"float32, batch {sizes.batching_requests}")
    w8a16 = Int8Config("w8a16")
    rows.append(runner.row("3 quantization", f"{w8a16.label}: float32 -> int8 weights (batch 1)", "decode tok/s",
                           ("decode_tok_s",), float_b1, {**float_b1, "quantization": w8a16.to_dict()}, True,
                           "W8A16"))
    w4 = Int4Config(method="awq", group_size=64)
    rows.append(runner.row("3 quantization", f"{w4.label} vs {w8a16.label} (batch 1)", "decode tok/s",
                           ("decode_tok_s",), {**float_b1, "quantization": w8a16.to_dict()},
                           {**float_b1, "quantization": w4.to_dict()}, True, "W4A16"))
    w8a8 = Int8Config("w8a8", activation_granularity="per-tensor", smoothquant_alpha=0.7)
    rows.append(runner.row("3 quantization", f"{w8a8.label} (batch {sizes.batching_requests})", "decode tok/s",
                           ("decode_tok_s",), float_bn, {**float_bn, "quantization": w8a8.to_dict()}, True, "W8A8"))
    for r in rows:
        if r.metric.endswith("(ms)") and r.before is not None:
            r.before, r.after = r.before * 1e3, r.after * 1e3
    if registry is not None:
        registry.close()

    # 3. The table and the plot.
    console.rule("3. five levers")
    render_table(rows, console)
    plot = plot_levers(rows, out_dir / "demo.png")
    console.print(f"plot: {plot}; runs stored in {registry_path or '(not stored)'}; "
                  f"Chrome traces in {out_dir}/demo-trace-*.json")
    summary = {
        "model": model, "mode": "quick" if quick else "full", "machine": machine,
        "verdicts": {m: [{"lever": v.lever, "finding": v.finding, "stake": v.stake} for v in p.verdicts]
                     for m, p in profiles.items()},
        "rows": [{"lever": r.lever, "change": r.change, "metric": r.metric, "before": r.before, "after": r.after,
                  "ratio": r.ratio, "accuracy": r.accuracy, "runs": r.runs, "status": r.status} for r in rows],
    }
    if html_path is not None:
        from fivefold.bench.dashboard import demo_report_html

        Path(html_path).write_text(demo_report_html(summary, plot))
        console.print(f"report: {html_path}")
    print(json.dumps(summary))
    return summary


def render_table(rows: list[LeverRow], console) -> None:
    from rich.table import Table

    table = Table(title="one lever at a time, each against the configuration without it")
    for col in ("lever", "change", "metric", "before -> after", "ratio", "accuracy cost", "runs"):
        table.add_column(col, justify="right" if col == "ratio" else "left")
    for r in sorted(rows, key=lambda r: r.lever):
        if r.status != "measured":
            table.add_row(r.lever, r.change, "", r.status, "", "", "")
            continue
        table.add_row(r.lever, r.change, r.metric, f"{r.before:.1f} -> {r.after:.1f}", f"{r.ratio:.2f}x",
                      r.accuracy, f"{r.runs[0]} -> {r.runs[1]}" if r.runs else "-")
    console.print(table)


def plot_levers(rows: list[LeverRow], out: Path) -> Path:
    from fivefold.bench.plots import figure

    measured = [r for r in sorted(rows, key=lambda r: r.lever) if r.ratio is not None]
    plt, fig, axes = figure(1, width=9.0)
    ax = axes[0][0]
    labels = [f"{r.lever}: {r.change}" for r in measured]
    ax.barh(range(len(measured)), [r.ratio for r in measured], color="tab:blue")
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_yticks(range(len(measured)), [label if len(label) < 60 else label[:57] + "..." for label in labels],
                  fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(measured):
        ax.text(r.ratio, i, f" {r.ratio:.2f}x", va="center", fontsize=8)
    ax.set(xlabel="speed-up over the configuration without the lever (x)", title="fivefold demo: one lever at a time")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

