"""``fivefold dashboard``: the run registry as web pages (server-rendered HTML, no script, no CDN).

Pages:
  ``/``                 the runs, newest first, ``per_page`` at a time (``?page=N&per_page=M&name=W``):
                        workload, configuration digest, baseline flag, headline metrics;
  ``/runs/{id}``        one run: its configuration, metrics (and the profiler's verdicts when the
                        run holds them), where it ran; set it as its workload's baseline, or
                        download it as a recipe (what ``fivefold runs rollback`` writes);
  ``/compare?a=&b=``    two runs: the configuration diff (changed rows highlighted; more than one
                        changed variable: the warning ``fivefold runs compare`` prints), each
                        metric's values, delta and ratio.

Every page is plain HTML with its CSS inline: it works offline and holds no external URL; tables
scroll inside their box, so a 390-px-wide phone reads it. The two writes (baseline, recipe) are
POST forms guarded against cross-site requests: each carries this server's random token, and a
request whose ``Origin`` (or ``Referer``) names another host is refused (403).

The registry is opened per request (SQLite connections stay in their thread), so ``fivefold
bench`` runs recorded while the dashboard is up appear on the next page load.
"""

from __future__ import annotations

import hashlib
import html
import json
import secrets
import time
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from fivefold.bench.registry import Run, RunRegistry, _flatten
from fivefold.errors import FivefoldError

PER_PAGE = 50
MAX_PER_PAGE = 500
HEADLINE_HINTS = ("tok_s", "throughput", "req_s", "perplexity", "accuracy", "ttft", "tpot", "latency", "speedup")
HEADLINE_COUNT = 3

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;padding:12px;color:#1b1f24;background:#fafbfc}
h1{font-size:1.3em;margin:.2em 0 .6em} h2{font-size:1.1em;margin:1.2em 0 .4em}
a{color:#0550ae} nav{margin-bottom:10px} nav a{margin-right:12px}
.box{overflow-x:auto;max-width:100%;border:1px solid #d0d7de;border-radius:6px;background:#fff}
table{border-collapse:collapse;width:100%;font-size:.92em}
th,td{padding:5px 8px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:top;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td{background:#fff8c5;font-weight:600}
.warn{background:#ffebe9;border:1px solid #ff8182;border-radius:6px;padding:8px;margin:8px 0}
.ok{background:#dafbe1;border:1px solid #4ac26b;border-radius:6px;padding:8px;margin:8px 0}
.badge{background:#0969da;color:#fff;border-radius:10px;padding:1px 7px;font-size:.8em}
form{display:inline-block;margin:4px 8px 4px 0} button{padding:5px 10px}
.pager{margin:10px 0} code{font-size:.9em}
@media (max-width:480px){body{padding:6px} th,td{padding:4px 5px}}
"""


def config_digest(config: dict[str, Any]) -> str:
    """A short, stable fingerprint of a configuration (equal configurations, equal digests)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]


def headline_metrics(metrics: dict[str, Any], count: int = HEADLINE_COUNT) -> list[tuple[str, Any]]:
    """The numbers a runs list shows: throughput, latency and quality metrics first, then the rest."""
    flat = [(k, v) for k, v in sorted(_flatten(metrics).items())
            if isinstance(v, (int, float)) and not isinstance(v, bool)]
    preferred = [kv for kv in flat if any(h in kv[0] for h in HEADLINE_HINTS)]
    return (preferred + [kv for kv in flat if kv not in preferred])[:count]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _e(value: Any) -> str:
    return html.escape(_fmt(value))


def _page(title: str, body: str, nav: bool = True) -> str:
    return ("<!doctype html><html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content='width=device-width,initial-scale=1'>"
            f"<title>{html.escape(title)} · fivefold</title><style>{_CSS}</style></head><body>"
            + ("<nav><a href='/'>runs</a></nav>" if nav else "")
            + f"<h1>{html.escape(title)}</h1>{body}</body></html>")


def _table(header: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    return f"<div class=box><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"


def _when(run: Run) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(run.created))


def runs_page(registry: RunRegistry, page: int, per_page: int, name: str | None) -> str:
    runs, total = registry.page((page - 1) * per_page, per_page, name)
    pages = max(1, -(-total // per_page))
    if page > pages:
        raise FivefoldError(f"page {page} is past the last one ({pages})")
    baselines = set(registry.baselines().values())
    rows = []
    for run in runs:
        heads = " · ".join(f"{html.escape(k)} {_e(v)}" for k, v in headline_metrics(run.metrics))
        flag = "<span class=badge>baseline</span>" if run.id in baselines else ""
        rows.append(f"<tr><td><a href='/runs/{run.id}'>{run.id}</a></td><td>{_e(_when(run))}</td>"
                    f"<td><a href='/?name={html.escape(run.name)}'>{html.escape(run.name)}</a></td>"
                    f"<td><code>{config_digest(run.config)}</code></td><td>{flag}</td><td>{heads}</td></tr>")
    query = f"&per_page={per_page}" + (f"&name={html.escape(name)}" if name else "")
    pager = (f"<div class=pager>page {page} of {pages} ({total} runs) "
             + (f"<a href='/?page={page - 1}{query}'>newer</a> " if page > 1 else "")
             + (f"<a href='/?page={page + 1}{query}'>older</a>" if page < pages else "") + "</div>")
    compare = ("<form method=get action='/compare'>compare run <input name=a size=5 inputmode=numeric> "
               "with <input name=b size=5 inputmode=numeric> <button>compare</button></form>")
    title = f"runs of '{name}'" if name else "runs"
    return _page(title, compare + pager + _table(["id", "when", "workload", "config", "", "headline metrics"], rows)
                 + pager)


def _png_img(path: Path, alt: str) -> str:
    """A PNG file inlined as a data: URI (the page stays one self-contained file)."""
    import base64

    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f"<div class=box><img alt='{html.escape(alt)}' style='max-width:100%' src='data:image/png;base64,{data}'></div>"


def _runs_plot(runs: list[Run]) -> str:
    """``fivefold runs plot`` of these runs (throughput vs request rate, latency CDF), drawn here
    and inlined; nothing when none of them has such data."""
    import tempfile

    from fivefold.bench.plots import plot_runs

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = plot_runs(runs, Path(tmp) / "runs.png")
        except FivefoldError:
            return ""
        return "<h2>plots</h2>" + _png_img(path, "throughput against request rate, and the latency CDF")


def _kv_rows(values: dict[str, Any]) -> list[str]:
    return [f"<tr><td>{html.escape(k)}</td><td class=num>{_e(v)}</td></tr>" for k, v in sorted(_flatten(values).items())]


def run_page(registry: RunRegistry, run_id: int, token: str, message: str = "") -> str:
    run = registry.get(run_id)
    base = registry.baselines().get(run.name)
    flag = (" <span class=badge>baseline</span>" if base == run.id else
            f" (baseline of '{html.escape(run.name)}': <a href='/runs/{base}'>run {base}</a>, "
            f"<a href='/compare?a={base}&b={run.id}'>compare</a>)" if base is not None else "")
    forms = (f"<form method=post action='/runs/{run.id}/baseline'><input type=hidden name=token value='{token}'>"
             f"<button>set as the baseline of '{html.escape(run.name)}'</button></form>"
             f"<form method=post action='/runs/{run.id}/rollback'><input type=hidden name=token value='{token}'>"
             f"<button>download the recipe (roll back)</button></form>")
    info = {"workload": run.name, "created": _when(run), "config digest": config_digest(run.config),
            "git commit": run.git_commit or "-", "package version": run.package_version or "-",
            "model fingerprint": run.model_fingerprint or "-"}
    body = (f"<div class=ok>{html.escape(message)}</div>" if message else "") + f"<p>{flag}</p>" + forms
    body += "<h2>configuration</h2>" + _table(["key", "value"], _kv_rows(run.config))
    metrics = {k: v for k, v in run.metrics.items() if k not in ("samples", "verdicts")}
    body += "<h2>metrics</h2>" + _table(["metric", "value"], _kv_rows(metrics))
    verdicts = run.metrics.get("verdicts")  # the profiler's: a list, or one per mode (the demo's summary form)
    if verdicts:
        by_mode = verdicts if isinstance(verdicts, dict) else {"": verdicts}
        rows = [f"<tr><td>{_e(mode)}</td><td>{_e(v.get('lever', ''))}</td><td>{_e(v.get('finding', ''))}</td>"
                f"<td class=num>{_e(v.get('stake', ''))}</td></tr>"
                for mode, items in by_mode.items() for v in items if isinstance(v, dict)]
        body += "<h2>profile verdicts</h2>" + _table(["mode", "lever", "finding", "share of time"], rows)
    body += _runs_plot([run])
    body += "<h2>run</h2>" + _table(["", ""], _kv_rows(info))
    body += "<h2>machine</h2>" + _table(["", ""], _kv_rows(run.machine))
    return _page(f"run {run.id}: {run.name}", body)


def _quality(ra: Run, rb: Run) -> str:
    """What changed in the answers, where the runs can tell: the share of greedy output tokens the
    two agree on (runs that kept their tokens, as the demo's rows compare them) and the held-out
    perplexity."""
    from fivefold.bench.offline_bench import token_agreement

    rows = []
    if all(r.metrics.get("samples", {}).get("output_token_ids") for r in (ra, rb)):
        rows.append(f"<tr><td>greedy-token agreement</td><td class=num>{token_agreement(ra.metrics, rb.metrics):.1%}"
                    "</td></tr>")
    pa, pb = ra.metrics.get("heldout_perplexity"), rb.metrics.get("heldout_perplexity")
    if isinstance(pa, (int, float)) and isinstance(pb, (int, float)) and pa:
        rows.append(f"<tr><td>held-out perplexity</td><td class=num>{pa:.3f} → {pb:.3f} ({pb / pa - 1:+.2%})</td></tr>")
    return "<h2>quality</h2>" + _table(["", ""], rows) if rows else ""


def compare_page(registry: RunRegistry, a: int, b: int) -> str:
    ra, rb = registry.get(a), registry.get(b)
    comparison = registry.compare(a, b)
    changed = comparison.config_diff
    keys = sorted(set(_flatten(ra.config)) | set(_flatten(rb.config)))
    fa, fb = _flatten(ra.config), _flatten(rb.config)
    rows = [f"<tr class={'changed' if k in changed else 'same'}><td>{html.escape(k)}</td>"
            f"<td>{_e(fa.get(k, '-'))}</td><td>{_e(fb.get(k, '-'))}</td></tr>" for k in keys]
    warning = comparison.warning
    if warning:
        note = f"<div class=warn>{html.escape(warning)}</div>"
    elif changed:
        note = f"<div class=ok>one variable changed: {html.escape(next(iter(changed)))}</div>"
    else:
        note = "<div class=ok>the configurations are the same</div>"
    if ra.name != rb.name:
        note += f"<div class=warn>different workloads: '{html.escape(ra.name)}' and '{html.escape(rb.name)}'</div>"
    note += _quality(ra, rb)
    metric_rows = []
    for k, (va, vb, ratio) in comparison.metric_ratios.items():
        delta = vb - va
        metric_rows.append(f"<tr><td>{html.escape(k)}</td><td class=num>{_e(va)}</td><td class=num>{_e(vb)}</td>"
                           f"<td class=num>{'+' if delta > 0 else ''}{_e(delta)}</td>"
                           f"<td class=num>{'-' if ratio is None else f'{ratio:.3f}x'}</td></tr>")
    body = (note + f"<h2>configuration (<a href='/runs/{a}'>run {a}</a> → <a href='/runs/{b}'>run {b}</a>)</h2>"
            + _table(["key", f"run {a}", f"run {b}"], rows)
            + "<h2>metrics</h2>" + _table(["metric", f"run {a}", f"run {b}", "delta", "ratio b / a"], metric_rows)
            + _runs_plot([ra, rb]))
    return _page(f"compare run {a} with run {b}", body)


def demo_report_html(summary: dict[str, Any], plot_png: Path | None = None) -> str:
    """``fivefold demo --html``: the demo's table, verdicts and plot as one self-contained page
    (the PNG inlined as a data: URI; no external URL, opens offline from the file)."""
    rows = []
    for r in sorted(summary["rows"], key=lambda r: r["lever"]):
        measured = r["status"] == "measured"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        runs = f"{r['runs'][0]} → {r['runs'][1]}" if r.get("runs") else "-"
        cells = [r["lever"], r["change"], r["metric"] if measured else "", r["before"] if measured else r["status"],
                 r["after"] if measured else "", ratio, r["accuracy"], runs]
        rows.append("<tr>" + "".join(f"<td{' class=num' if i in (3, 4, 5) else ''}>{_e(c)}</td>"
                                     for i, c in enumerate(cells)) + "</tr>")
    body = (f"<p>model {html.escape(str(summary['model']))}, {html.escape(str(summary['mode']))} mode</p>"
            "<h2>one lever at a time, each against the configuration without it</h2>"
            + _table(["lever", "change", "metric", "before", "after", "ratio", "accuracy cost", "runs"], rows))
    verdicts = [f"<tr><td>{_e(mode)}</td><td>{_e(v['lever'])}</td><td>{_e(v['finding'])}</td>"
                f"<td class=num>{_e(v['stake'])}</td></tr>"
                for mode, items in summary.get("verdicts", {}).items() for v in items]
    if verdicts:
        body += "<h2>profile verdicts</h2>" + _table(["mode", "lever", "finding", "share of time"], verdicts)
    if plot_png is not None and Path(plot_png).exists():
        body += "<h2>speed-ups</h2>" + _png_img(plot_png, "speed-up of each lever")
    body += "<h2>machine</h2>" + _table(["", ""], _kv_rows(summary.get("machine") or {}))
    return _page("fivefold demo: five levers", body, nav=False)


class _Forbidden(Exception):
    """A form POST that did not come from the dashboard's own pages."""


def create_app(registry_path: str | Path) -> FastAPI:
    """The dashboard's FastAPI app over the registry at ``registry_path`` (created if missing)."""
    path = Path(registry_path)
    token = secrets.token_urlsafe(24)  # this server's: a form from elsewhere cannot know it
    app = FastAPI(title="fivefold dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    def open_registry() -> RunRegistry:
        return RunRegistry(path)

    def error(status: int, message: str) -> HTMLResponse:
        return HTMLResponse(_page(f"error {status}", f"<div class=warn>{html.escape(message)}</div>"), status)

    def same_origin(request: Request) -> bool:
        source = request.headers.get("origin") or request.headers.get("referer")
        if not source or source == "null":
            return source is None  # no header (a command-line client): the token decides
        return urlsplit(source).netloc == request.headers.get("host")

    async def guard(request: Request) -> None:
        """A form's POST: from this dashboard's own pages, with this server's token; else 403."""
        if not same_origin(request):
            raise _Forbidden("cross-site request refused: this form posts only from the dashboard's own pages")
        body = (await request.body())[:4096].decode("utf-8", "replace")  # a form of one field: no multipart
        form_token = parse_qs(body).get("token", [""])[0]
        if not secrets.compare_digest(form_token.encode(), token.encode()):
            raise _Forbidden("missing or stale form token: reload the page and try again")

    def int_param(request: Request, name: str, default: int | None, low: int, high: int | None = None) -> int:
        raw = request.query_params.get(name)
        if raw is None or raw == "":
            if default is None:
                raise FivefoldError(f"'{name}' is required")
            return default
        try:
            value = int(raw)
        except ValueError:
            raise FivefoldError(f"'{name}' must be a whole number, got '{raw[:40]}'") from None
        if value < low or (high is not None and value > high):
            raise FivefoldError(f"'{name}' must be between {low} and {high}, got {value}" if high is not None
                                else f"'{name}' must be {low} or more, got {value}")
        return value

    @app.exception_handler(_Forbidden)
    async def _forbidden(_request: Request, exc: _Forbidden):
        return error(403, str(exc))

    @app.exception_handler(FivefoldError)
    async def _refused(_request: Request, exc: FivefoldError):
        message = str(exc)
        return error(404 if message.startswith("no run ") else 422, message)

    @app.get("/", response_class=HTMLResponse)
    def runs(request: Request):
        page = int_param(request, "page", 1, 1)
        per_page = int_param(request, "per_page", PER_PAGE, 1, MAX_PER_PAGE)
        with closing(open_registry()) as registry:
            return runs_page(registry, page, per_page, request.query_params.get("name") or None)

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def run(run_id: int, request: Request):
        with closing(open_registry()) as registry:
            return run_page(registry, run_id, token, request.query_params.get("message", "")[:200])

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request):
        a, b = int_param(request, "a", None, 1), int_param(request, "b", None, 1)
        with closing(open_registry()) as registry:
            return compare_page(registry, a, b)

    @app.post("/runs/{run_id}/baseline")
    async def set_baseline(run_id: int, request: Request):
        await guard(request)
        with closing(open_registry()) as registry:
            registry.set_baseline(run_id)
            name = registry.get(run_id).name
        message = quote(f"run {run_id} is the baseline of '{name}'")
        return RedirectResponse(f"/runs/{run_id}?message={message}", status_code=303)

    @app.post("/runs/{run_id}/rollback")
    async def rollback(run_id: int, request: Request):
        await guard(request)
        with closing(open_registry()) as registry:
            recipe = json.dumps(registry.recipe(run_id), indent=2, sort_keys=True)
        return Response(recipe, media_type="application/json",
                        headers={"Content-Disposition": f"attachment; filename=recipe-{run_id}.json"})

    return app
