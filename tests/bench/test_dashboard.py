"""``fivefold dashboard`` (fivefold/bench/dashboard.py) over HTTP: the runs list and its pages on a
10,000-run registry, a run's page, the comparison with its changed variable highlighted and the
one-variable warning, the baseline and recipe forms and their cross-site guard, bad parameters.
(The browser tests of issue 39 are still to come.)"""

from __future__ import annotations

import html
import json
import re
import sqlite3
import time

import pytest

from fivefold.bench.dashboard import config_digest, create_app, headline_metrics
from fivefold.bench.registry import RunRegistry


@pytest.fixture
def client(tmp_path):
    from fastapi.testclient import TestClient

    registry = RunRegistry(tmp_path / "runs.db")
    a = registry.record("bench serve", {"engine": {"block_size": 16, "prefix": True}, "rate": 4.0},
                        {"output_tok_s": 100.0, "ttft_s": {"p50": 0.5}, "note": "first", "heldout_perplexity": 10.0,
                         "samples": {"output_token_ids": [[1, 2, 3, 4], [5, 6]]}})
    b = registry.record("bench serve", {"engine": {"block_size": 32, "prefix": True}, "rate": 4.0},
                        {"output_tok_s": 150.0, "ttft_s": {"p50": 0.4}, "heldout_perplexity": 10.5,
                         "samples": {"output_token_ids": [[1, 2, 9, 4], [5, 6]]}})
    c = registry.record("bench serve", {"engine": {"block_size": 32, "prefix": False}, "rate": 8.0},
                        {"output_tok_s": 90.0, "ttft_s": {"p50": 0.9}, "samples": {"e2e_s": [0.5, 0.7, 1.1]},
                         "verdicts": {"decode": [{"lever": "quantization", "finding": "weights stream", "stake": 0.8}]}})
    registry.close()
    with TestClient(create_app(tmp_path / "runs.db"), base_url="http://dash.local") as c_:
        c_.ids = (a, b, c)
        c_.path = tmp_path / "runs.db"
        yield c_


def _token(page: str) -> str:
    return re.search(r"name=token value='([^']+)'", page).group(1)


def _no_external_urls(page: str) -> None:
    inline = re.sub(r"data:[^']*", "", page)  # inlined images are the page's own bytes
    assert not re.search(r"(https?:)?//[a-z0-9]", inline, re.I), "a page must work offline: no external URL"


def test_runs_list_run_page_and_compare(client):
    a, b, c = client.ids
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    _no_external_urls(page.text)
    assert "width=device-width" in page.text  # readable on a phone
    for run_id in (a, b, c):
        assert f"href='/runs/{run_id}'" in page.text
    assert config_digest({"engine": {"block_size": 16, "prefix": True}, "rate": 4.0}) in page.text
    assert "output_tok_s 150" in page.text  # headline metrics
    run = client.get(f"/runs/{c}")
    assert run.status_code == 200 and "engine.prefix" in run.text and "weights stream" in run.text
    assert "<h2>plots</h2>" in run.text and "src='data:image/png;base64," in run.text  # its latency CDF, inlined
    assert "<h2>plots</h2>" not in client.get(f"/runs/{a}").text  # nothing to draw
    _no_external_urls(run.text)
    one = client.get(f"/compare?a={a}&b={b}")
    assert one.status_code == 200 and "one variable changed: engine.block_size" in one.text
    assert re.search(r"<tr class=changed><td>engine.block_size</td><td>16</td><td>32</td>", one.text)
    assert re.search(r"<tr class=same><td>rate</td>", one.text)
    assert re.search(r"<td>output_tok_s</td><td class=num>100</td><td class=num>150</td><td class=num>\+50</td>"
                     r"<td class=num>1.500x</td>", one.text)
    assert "<td>greedy-token agreement</td><td class=num>83.3%</td>" in one.text  # 5 of 6 tokens
    assert "<td>held-out perplexity</td><td class=num>10.000 → 10.500 (+5.00%)</td>" in one.text
    many = client.get(f"/compare?a={a}&b={c}")
    assert "greedy-token agreement" not in many.text  # run c kept no tokens
    assert "class=warn>3 variables changed (engine.block_size, engine.prefix, rate)" in many.text
    assert len(re.findall(r"<tr class=changed>", many.text)) == 3
    _no_external_urls(many.text)


def test_baseline_and_recipe_forms_and_the_cross_site_guard(client):
    a, b, _ = client.ids
    token = _token(client.get(f"/runs/{b}").text)
    foreign = client.post(f"/runs/{b}/baseline", data={"token": token}, headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403 and "cross-site request refused" in foreign.text
    forged = client.post(f"/runs/{b}/baseline", data={"token": "guess"}, headers={"Origin": "http://dash.local"})
    assert forged.status_code == 403 and "form token" in forged.text
    registry = RunRegistry(client.path)
    assert registry.baselines() == {}
    ok = client.post(f"/runs/{b}/baseline", data={"token": token}, headers={"Origin": "http://dash.local"},
                     follow_redirects=False)
    assert ok.status_code == 303
    assert registry.baselines() == {"bench serve": b}
    shown = client.get(ok.headers["location"])
    assert "is the baseline of &#x27;bench serve&#x27;" in shown.text and "class=badge>baseline" in shown.text
    assert f"<a href='/runs/{b}'>{b}</a></td>" in client.get("/").text
    recipe = client.post(f"/runs/{a}/rollback", data={"token": token}, headers={"Referer": f"http://dash.local/runs/{a}"})
    assert recipe.status_code == 200 and "recipe-1.json" in recipe.headers["content-disposition"]
    assert json.loads(recipe.text) == registry.recipe(a)
    assert client.post(f"/runs/{a}/rollback", data={}).status_code == 403
    registry.close()


def test_bad_parameters_get_a_page_naming_the_problem(client):
    assert client.get("/runs/999").status_code == 404 and "no run 999" in client.get("/runs/999").text
    for url, words in (("/?page=0", "'page' must be 1 or more"), ("/?per_page=100000", "between 1 and 500"),
                       ("/?page=abc", "'page' must be a whole number"), ("/compare?a=1", "'b' is required"),
                       ("/?page=9", "page 9 is past the last one (1)")):
        r = client.get(url)
        assert r.status_code == 422 and html.escape(words) in r.text, url
    assert client.get("/compare?a=1&b=999").status_code == 404


def test_ten_thousand_runs_are_paged(tmp_path):
    from fastapi.testclient import TestClient

    path = tmp_path / "runs.db"
    RunRegistry(path).close()
    db = sqlite3.connect(path)
    rows = [(time.time(), f"w{i % 7}", json.dumps({"i": i}), json.dumps({"tok_s": float(i)}), None, "0", None, "{}")
            for i in range(10_000)]
    db.executemany("INSERT INTO runs (created, name, config, metrics, model_fingerprint, package_version, git_commit, "
                   "machine) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()
    client = TestClient(create_app(path))
    first = client.get("/")
    assert "page 1 of 200 (10000 runs)" in first.text
    assert len(re.findall(r"<tr><td><a href='/runs/", first.text)) == 50
    assert "href='/runs/10000'" in first.text and "href='/runs/9950'" not in first.text  # newest first
    last = client.get("/?page=100&per_page=100")
    ids = [int(i) for i in re.findall(r"<tr><td><a href='/runs/(\d+)'>", last.text)]
    assert ids == list(range(100, 0, -1))
    only = client.get("/?name=w3&per_page=500")
    ids = [int(i) for i in re.findall(r"<tr><td><a href='/runs/(\d+)'>", only.text)]
    assert len(ids) == 500 and all((i - 1) % 7 == 3 for i in ids) and "(1429 runs)" in only.text


def test_headline_metrics_prefer_throughput_latency_and_quality():
    metrics = {"a_count": 3, "output_tok_s": 10.0, "ttft_s": {"p50": 0.1}, "flag": True, "zeta": 1.0}
    assert headline_metrics(metrics) == [("output_tok_s", 10.0), ("ttft_s.p50", 0.1), ("a_count", 3)]
