"""``profile(module, inputs)``: where the time goes, how close each heavy op is to the
machine's limits, which chains of small ops to fuse, and which lever to pull first.

Runs the target under ``torch.profiler`` (CPU, shapes recorded) and reads the event
tree: every event's self time is attributed to one category (see ``ops.py``), the
time between ops to Python and framework overhead; heavy ops are placed on the
roofline (``roofline.py``); consecutive small ops between two matmuls or attentions
form chains, and a chain that recurs (once per layer) with a large total share is a
fusion candidate. The rules of ``verdict.py`` turn that into advice.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from fivefold.profile.ops import CATEGORIES, SAMPLING_REGION, categorize, op_cost, short_name
from fivefold.profile.roofline import MachinePeaks, OpCost, RooflinePoint, classify, measure_peaks

ITERATION_REGION = "fivefold::iteration"
HEAVY_MIN_SHARE = 0.01  # ops above this share of the wall time get a roofline row
FUSION_MIN_SHARE = 0.02  # chains above this share are named as fusion candidates
_CHAIN_BREAKERS = ("matmul", "attention", "sampling")
# Ops that do their own work even when they call helpers (an empty() for the output):
# costed on their self time.
_KERNELS = {"mm", "addmm", "bmm", "baddbmm", "_linear_pointwise", "_int_mm", "_weight_int8pack_mm",
            "paged_decode_attention", "_scaled_dot_product_flash_attention_for_cpu", "int8_weight_linear",
            "stream_linear"}


@dataclass(frozen=True)
class OpStat:
    name: str
    category: str
    num_calls: int
    self_s: float  # per iteration
    share: float  # of the wall time


@dataclass(frozen=True)
class HeavyOp:
    name: str
    shapes: str
    num_calls: int
    self_s: float  # per iteration
    share: float
    roofline: RooflinePoint


@dataclass(frozen=True)
class FusionCandidate:
    ops: tuple[str, ...]
    num_occurrences: int  # per iteration
    total_s: float  # per iteration, inclusive of the ops' children
    share: float

    @property
    def label(self) -> str:
        names = list(self.ops) if len(self.ops) <= 8 else [*self.ops[:7], f"... (+{len(self.ops) - 7})"]
        return " -> ".join(names)


@dataclass
class ProfileReport:
    """One profile: per-iteration times, the op table, the roofline rows, fusion candidates, verdicts."""

    label: str
    num_iterations: int
    wall_s: float  # per iteration, under the profiler
    unprofiled_wall_s: float  # per iteration, without it
    dtype: str
    peaks: MachinePeaks
    category_s: dict[str, float]  # per iteration
    ops: list[OpStat]
    heavy_ops: list[HeavyOp]
    fusion_candidates: list[FusionCandidate]
    memory_bound_s: float  # per iteration: time of costed ops below the ridge point
    compute_bound_s: float
    weighted_utilisation: float  # time-weighted share of the roofline over costed ops
    verdicts: list[Any] = field(default_factory=list)
    trace_path: str | None = None

    def category_share(self, category: str) -> float:
        return self.category_s.get(category, 0.0) / self.wall_s if self.wall_s else 0.0

    @property
    def outside_matmul_s(self) -> float:
        """Per iteration, the time outside the matmul kernels (the weight-streaming linears at
        decode): what a decode step spends on everything but streaming its weights."""
        return max(0.0, self.unprofiled_wall_s - self.category_s.get("matmul", 0.0))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["category_share"] = {c: self.category_share(c) for c in CATEGORIES}
        d["outside_matmul_s"] = self.outside_matmul_s
        return d

    def render(self, console=None, num_ops: int = 15, compact: bool = False) -> None:
        """Print the category, op, roofline and fusion tables and the verdicts (compact: categories,
        heavy ops and verdicts only)."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console(width=140)
        p = self.peaks
        console.print(f"[bold]{self.label}[/bold]: {self.wall_s * 1e3:.2f} ms per iteration under the profiler "
                      f"({self.unprofiled_wall_s * 1e3:.2f} ms without), {self.num_iterations} iterations; machine: "
                      f"{p.bandwidth / 1e9:.1f} GB/s, {p.peak_flops(self.dtype) / 1e9:.1f} GFLOP/s {self.dtype}, "
                      f"ridge {p.ridge(self.dtype):.1f} FLOP/B; outside the matmul kernels "
                      f"{self.outside_matmul_s * 1e3:.2f} ms per iteration")
        cats = Table(title="time by category")
        for col in ("category", "ms / iteration", "share"):
            cats.add_column(col, justify="right" if col != "category" else "left")
        for c in sorted(CATEGORIES, key=lambda c: -self.category_s.get(c, 0.0)):
            cats.add_row(c, f"{self.category_s.get(c, 0.0) * 1e3:.2f}", f"{self.category_share(c):.1%}")
        console.print(cats)
        if not compact:
            self._render_ops(console, num_ops)
        self._render_roofline(console)
        if self.fusion_candidates and not compact:
            self._render_fusion(console)
        for v in self.verdicts:
            console.print(f"[bold]verdict[/bold] ({v.stake:.0%} of the time): {v.finding} -> [bold]{v.lever}[/bold]. "
                          f"{v.evidence}")
        if self.trace_path:
            console.print(f"Chrome trace: {self.trace_path} (open in chrome://tracing or ui.perfetto.dev)")

    def _render_ops(self, console, num_ops: int) -> None:
        from rich.table import Table

        ops = Table(title=f"top {num_ops} ops by self time")
        for col in ("op", "category", "calls", "self ms", "share"):
            ops.add_column(col, justify="left" if col in ("op", "category") else "right")
        for o in self.ops[:num_ops]:
            ops.add_row(o.name, o.category, str(o.num_calls), f"{o.self_s * 1e3:.3f}", f"{o.share:.1%}")
        console.print(ops)

    def _render_roofline(self, console) -> None:
        from rich.table import Table

        roof = Table(title="heavy ops on the roofline")
        for col in ("op", "shapes", "calls", "share", "FLOP/B", "GFLOP/s", "GB/s", "bound", "of roofline"):
            roof.add_column(col, justify="left" if col in ("op", "shapes", "bound") else "right")
        for h in self.heavy_ops:
            r = h.roofline
            roof.add_row(h.name, h.shapes, str(h.num_calls), f"{h.share:.1%}", f"{r.intensity:.2f}",
                         f"{r.achieved_flops / 1e9:.1f}", f"{r.achieved_bandwidth / 1e9:.1f}", r.bound,
                         f"{r.utilisation:.0%}")
        console.print(roof)

    def _render_fusion(self, console) -> None:
        from rich.table import Table

        fus = Table(title="fusion candidates (chains of small ops between matmuls/attention)")
        for col in ("chain", "per iteration", "ms", "share"):
            fus.add_column(col, justify="left" if col == "chain" else "right")
        for f in self.fusion_candidates:
            fus.add_row(f.label, str(f.num_occurrences), f"{f.total_s * 1e3:.2f}", f"{f.share:.1%}")
        console.print(fus)


def _as_callable(target, inputs) -> Callable[[], Any]:
    if isinstance(target, torch.nn.Module):
        args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)

        def run():
            with torch.inference_mode():
                return target(*args)

        return run
    return target


def _default_dtype(target) -> str:
    if isinstance(target, torch.nn.Module):
        for p in target.parameters():
            if p.is_floating_point():
                return str(p.dtype).removeprefix("torch.")
    return "float32"


def profile(
    target: torch.nn.Module | Callable[[], Any],
    inputs: Any = (),
    *,
    num_iterations: int = 3,
    num_warmup: int = 1,
    dtype: str | None = None,
    label: str = "profile",
    trace_path: str | Path | None = None,
    peaks: MachinePeaks | None = None,
) -> ProfileReport:
    """Profile ``target(*inputs)`` (a module) or ``target()`` (any callable).

    ``dtype`` selects the compute peak the roofline uses (default: the module's
    parameter dtype). The Chrome trace is written to ``trace_path`` when given.
    """
    from fivefold.profile.verdict import verdicts

    fn = _as_callable(target, inputs)
    dtype = dtype or _default_dtype(target)
    peaks = peaks or measure_peaks(dtypes=("float32", dtype) if dtype != "float32" else ("float32",))
    for _ in range(num_warmup):
        fn()
    start = time.perf_counter()
    for _ in range(num_iterations):
        fn()
    unprofiled = (time.perf_counter() - start) / num_iterations

    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    prof = torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with _without_kineto_markers():
        prof.__enter__()
    try:
        start = time.perf_counter()
        for _ in range(num_iterations):
            with record_function(ITERATION_REGION):
                fn()
        wall = (time.perf_counter() - start) / num_iterations
    finally:
        with _without_kineto_markers():
            prof.__exit__(None, None, None)
    if trace_path:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    report = analyse(list(prof.events()), num_iterations, wall, unprofiled, dtype, peaks, label)
    report.trace_path = str(trace_path) if trace_path else None
    report.verdicts = verdicts(report)
    return report


KINETO_MARKERS = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _without_kineto_markers():
    """Run the profiler's start or stop with file descriptor 2 captured, then pass on what is
    not kineto's own marker lines: it writes ``USDT:... profiler_start/stop`` to stderr from C++
    (no environment variable silences them in torch 2.13), and they are noise in a user's terminal.
    Only start and stop are captured, never the profiled code."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(KINETO_MARKERS)]
            if kept:
                sys.stderr.write("".join(kept))


def _shapes_label(shapes) -> str:
    """Tensor input shapes only: ``1x576, 3072x576``."""
    return ", ".join("x".join(map(str, s)) for s in shapes or [] if s)


def _is_annotation(event) -> bool:
    return bool(getattr(event, "is_user_annotation", False)) or event.name == ITERATION_REGION


def _chain(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names[::-1]


def analyse(events: list, num_iterations: int, wall_s: float, unprofiled_s: float, dtype: str,
            peaks: MachinePeaks, label: str = "profile") -> ProfileReport:
    """Build the report from ``torch.profiler`` events (times per iteration)."""
    elem_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    n = num_iterations
    category_s: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [None, 0, 0.0])  # name -> [category, calls, self s]
    by_shape: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, s, flops, bytes
    memory_s = compute_s = weighted = 0.0
    op_self_total = 0.0
    for e in events:
        if _is_annotation(e):
            # A region's own time (outside the ops it calls) is Python or foreign code: overhead, except
            # in the sampler, where it is sampling (its glue, and the grammar engine's mask, which is
            # not a torch op).
            if e.name != ITERATION_REGION and SAMPLING_REGION in _chain(e):
                self_s = e.self_cpu_time_total / 1e6
                op_self_total += self_s
                category_s["sampling"] += self_s / n
                entry = by_name[e.name]
                entry[0], entry[1], entry[2] = "sampling", entry[1] + 1, entry[2] + self_s
            continue
        self_s = e.self_cpu_time_total / 1e6
        op_self_total += self_s
        category = categorize(_chain(e))
        category_s[category] += self_s / n
        entry = by_name[e.name]
        entry[0] = entry[0] or category
        entry[1] += 1
        entry[2] += self_s
        if short_name(e.name) not in _KERNELS and any(not _is_annotation(c) for c in e.cpu_children):
            continue  # a composite op: its children carry the work and are costed themselves
        cost = op_cost(e.name, e.input_shapes or [], elem_bytes)
        if cost is None or self_s <= 0:
            continue
        point = classify(cost, self_s, peaks, dtype)
        if point.is_memory_bound:
            memory_s += self_s
        else:
            compute_s += self_s
        weighted += self_s * point.utilisation
        key = by_shape[(e.name, _shapes_label(e.input_shapes))]
        key[0] += 1
        key[1] += self_s
        key[2] += cost.flops
        key[3] += cost.bytes
    # Time between ops (Python, dispatch, the profiler's own bookkeeping) is overhead too.
    category_s["overhead"] += max(0.0, wall_s - op_self_total / n)
    ops = sorted((OpStat(name, cat, calls // n, s / n, s / n / wall_s) for name, (cat, calls, s) in by_name.items()),
                 key=lambda o: -o.self_s)
    heavy = []
    for (name, shapes), (calls, s, flops, num_bytes) in by_shape.items():
        if s / n / wall_s >= HEAVY_MIN_SHARE:
            heavy.append(HeavyOp(name, shapes, calls // n, s / n, s / n / wall_s,
                                 classify(OpCost(flops, num_bytes), s, peaks, dtype)))
    heavy.sort(key=lambda h: -h.self_s)
    costed = memory_s + compute_s
    return ProfileReport(
        label=label, num_iterations=n, wall_s=wall_s, unprofiled_wall_s=unprofiled_s, dtype=dtype, peaks=peaks,
        category_s=dict(category_s), ops=ops, heavy_ops=heavy, fusion_candidates=fusion_candidates(events, n, wall_s),
        memory_bound_s=memory_s / n, compute_bound_s=compute_s / n,
        weighted_utilisation=weighted / costed if costed else 0.0,
    )


def fusion_candidates(events: list, num_iterations: int, wall_s: float) -> list[FusionCandidate]:
    """Recurring chains of small top-level ops between two matmuls/attentions/sampling steps."""
    def unwrap(e) -> list:
        # An op with no category of its own that calls others (the C++ decode loop,
        # fivefold::decode_layers, runs a whole step's kernels) is not a small op of a chain: its
        # calls are. (Composite ops that have a category, layer_norm say, stay one link.)
        if e.cpu_children and categorize(_chain(e)) == "overhead":
            return [x for c in e.cpu_children for x in unwrap(c)]
        return [e]

    top = [x for e in events if not _is_annotation(e) and (e.cpu_parent is None or _is_annotation(e.cpu_parent))
           for x in unwrap(e)]
    top.sort(key=lambda e: e.time_range.start)
    chains: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0, 0.0])
    current: list = []

    def close():
        names = tuple(short_name(e.name) for e in current if categorize(_chain(e)) != "overhead")
        if len(names) >= 2:
            chains[names][0] += 1
            chains[names][1] += sum(e.cpu_time_total for e in current) / 1e6
        current.clear()

    parent = None
    for e in top:
        if e.cpu_parent is not parent:  # a new iteration
            close()
            parent = e.cpu_parent
        if categorize(_chain(e)) in _CHAIN_BREAKERS:
            close()
        else:
            current.append(e)
    close()
    out = [FusionCandidate(ops, count // num_iterations, s / num_iterations, s / num_iterations / wall_s)
           for ops, (count, s) in chains.items()]
    return sorted((c for c in out if c.share >= FUSION_MIN_SHARE), key=lambda c: -c.share)
