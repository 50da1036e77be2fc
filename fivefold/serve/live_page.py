"""The live page of ``fivefold serve --dashboard``: ``GET /dashboard`` (HTML) and
``GET /dashboard/data`` (the same numbers as JSON), from the server's own metrics
(:meth:`fivefold.serve.metrics.ServerMetrics.live_snapshot`).

The page shows requests running and waiting, generated tokens/s (the last 10 s, and a curve of
the last five minutes drawn here as inline SVG), TTFT and inter-token latency percentiles and batch
sizes over the last minute, the KV pool's use, the prefix cache's and the result cache's hit
rates. It reloads itself every 2 s (a meta refresh: no script, no external URL, works offline).
Off unless ``--dashboard``; with ``--api-key`` it needs the key like every other route: a
browser sends it as the password of HTTP Basic authentication (any user name), which the 401 of
these two routes asks for.
"""

from __future__ import annotations

import html

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

REFRESH_S = 2

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;padding:12px;background:#fafbfc;color:#1b1f24}
h1{font-size:1.25em;margin:.2em 0 .6em} .grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(160px,1fr));gap:8px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:8px}
.label{font-size:.8em;color:#57606a} .value{font-size:1.4em;font-variant-numeric:tabular-nums}
svg{width:100%;height:120px;background:#fff;border:1px solid #d0d7de;border-radius:6px;margin-top:4px}
@media (max-width:480px){body{padding:6px}.value{font-size:1.15em}}
"""


def _num(value, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _curve(values: list[float], width: int = 600, height: int = 120) -> str:
    """Tokens/s per bin as an SVG polyline (oldest left), scaled to its own maximum."""
    top = max(values, default=0.0) or 1.0
    step = width / max(len(values) - 1, 1)
    points = " ".join(f"{i * step:.1f},{height - 6 - (height - 12) * v / top:.1f}" for i, v in enumerate(values))
    # the caption is HTML: the curve stretches to the page's width, which would stretch SVG text
    return (f"<div class=label style='margin-top:10px'>generated tokens/s, last {len(values) * 5} s "
            f"(5-s bins, max {top:.0f})</div>"
            f"<svg viewBox='0 0 {width} {height}' preserveAspectRatio='none' role=img "
            f"aria-label='generated tokens per second, last five minutes'>"
            f"<polyline fill='none' stroke='#0969da' stroke-width='2' vector-effect='non-scaling-stroke' "
            f"points='{points}'/></svg>")


def render(model_name: str, snap: dict) -> str:
    """The page of one snapshot."""
    ttft, itl = snap["ttft_ms"] or {}, snap["itl_ms"] or {}
    cards = [
        ("requests running", str(snap["running"])), ("requests waiting", str(snap["waiting"])),
        ("tokens/s (10 s)", _num(snap["tokens_per_s"])),
        ("TTFT p50 / p90 / p99 ms", " / ".join(_num(ttft.get(q), 0) for q in ("p50", "p90", "p99"))),
        ("ITL p50 / p90 / p99 ms", " / ".join(_num(itl.get(q), 0) for q in ("p50", "p90", "p99"))),
        ("batch size mean / max", f"{snap['batch_size_mean']:.1f} / {snap['batch_size_max']}"),
        ("KV pool in use", _num(snap["kv_cache_usage"], 1, 100, " %")),
        ("prefix cache hit rate", _num(snap["prefix_cache_hit_rate"], 1, 100, " %")),
        ("result cache hits / misses", f"{snap['result_cache_hits']} / {snap['result_cache_misses']}"),
        ("requests finished", str(snap["requests_finished"])), ("preemptions", str(snap["num_preemptions"])),
    ]
    body = "".join(f"<div class=card><div class=label>{html.escape(k)}</div><div class=value id='{html.escape(k)}'>"
                   f"{html.escape(v)}</div></div>" for k, v in cards)
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<meta http-equiv=refresh content={REFRESH_S}>"
            "<meta name=viewport content='width=device-width,initial-scale=1'>"
            f"<title>{html.escape(model_name)} · fivefold live</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(model_name)}: live (latencies over the last {snap['window_s']:.0f} s)</h1>"
            f"<div class=grid>{body}</div>{_curve(snap['tokens_per_s_bins'])}</body></html>")


class LiveDashboard:
    """Registers the live page's two routes on a server's app."""

    def __init__(self, metrics, model_name: str) -> None:
        self.metrics, self.model_name = metrics, model_name

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/dashboard", self.page, methods=["GET"], response_class=HTMLResponse)
        app.add_api_route("/dashboard/data", self.data, methods=["GET"])

    async def page(self) -> HTMLResponse:
        return HTMLResponse(render(self.model_name, self.metrics.live_snapshot()),
                            headers={"Cache-Control": "no-store"})

    async def data(self) -> JSONResponse:
        return JSONResponse(self.metrics.live_snapshot(), headers={"Cache-Control": "no-store"})
