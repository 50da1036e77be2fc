"""PNG plots of stored runs (matplotlib, headless)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from fivefold.errors import FivefoldError


def figure(ncols: int, width: float = 6.0):
    import matplotlib

    matplotlib.use("Agg")  # no display here, ever
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(1, ncols, figsize=(width * ncols, 4.5), squeeze=False)


def plot_runs(runs: list, out: str | Path) -> Path:
    """Left: output throughput against request rate (``bench serve`` runs, one line per
    workload). Right: the end-to-end latency CDF of every run that kept its samples."""
    rated = [r for r in runs if r.config.get("request_rate") and "output_token_throughput" in r.metrics]
    sampled = [r for r in runs if r.metrics.get("samples", {}).get("e2e_s")]
    if not rated and not sampled:
        raise FivefoldError("none of these runs has request-rate throughput or latency samples to plot")
    plt, fig, axes = figure(2)
    left, right = axes[0]
    series = defaultdict(list)
    for r in rated:
        c = r.config
        series[f"{c.get('dataset')} {c.get('input_len')}/{c.get('output_len')}"].append(
            (c["request_rate"], r.metrics["output_token_throughput"]))
    for label, points in sorted(series.items()):
        xs, ys = zip(*sorted(points))
        left.plot(xs, ys, marker="o", label=label)
    left.set(title="throughput vs request rate", xlabel="request rate (req/s)", ylabel="output tokens/s")
    if series:
        left.legend()
    else:
        left.text(0.5, 0.5, "no bench serve runs with --request-rate", ha="center", transform=left.transAxes)
    for r in sampled:
        values = sorted(r.metrics["samples"]["e2e_s"])
        right.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                   label=f"run {r.id} ({r.name})")
    right.set(title="end-to-end latency CDF", xlabel="seconds", ylabel="share of requests", ylim=(0, 1.02))
    if sampled:
        right.legend(fontsize=7)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
