"""The dashboards in a real browser (headless Chromium driven by Selenium): the runs list, a run,
comparing two runs with the changed variable highlighted, setting a baseline from the page, the
pages at a 390-px-wide phone viewport, and ``fivefold serve --dashboard``'s live page while
requests run. Screenshots go to ``.fivefold/screenshots/`` (see the README's "Dashboard").

The browser is Debian's ``chromium`` and ``chromium-driver``, which ``make test`` installs with
apt when it runs as root (scripts/install_browser.sh); elsewhere these tests say in one line
that no browser is installed."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from fivefold.bench.dashboard import create_app
from fivefold.bench.registry import RunRegistry
from tests.serve.conftest import running_server

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
SCREENSHOTS = Path(".fivefold/screenshots")
PHONE = (390, 844)

pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no browser: chromium and chromium-driver are not installed "
                                       "(make test installs them with apt as root: scripts/install_browser.sh)")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
                "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)  # paths given: nothing is downloaded
    driver.set_page_load_timeout(30)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _shot(driver, name: str) -> None:
    assert driver.save_screenshot(str(SCREENSHOTS / f"{name}.png"))


def _click_and_wait(driver, element, url_part: str) -> None:
    """Click (a link or a form's button) and wait for the page it leads to."""
    from selenium.webdriver.support.ui import WebDriverWait

    element.click()
    WebDriverWait(driver, 30).until(lambda d: url_part in d.current_url and
                                    d.execute_script("return document.readyState") == "complete")


def _fits_the_phone(driver) -> bool:
    """No horizontal scrolling of the page itself at 390 px (wide tables scroll inside their box)."""
    return driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")


@pytest.fixture
def registry_url(tmp_path):
    registry = RunRegistry(tmp_path / "runs.db")
    for block, prefix, rate, tok_s in ((16, True, 4.0, 100.0), (32, True, 4.0, 150.0), (32, False, 8.0, 90.0)):
        registry.record("bench serve", {"engine": {"block_size": block, "prefix_caching": prefix}, "request_rate": rate},
                        {"output_token_throughput": tok_s, "ttft_s": {"p50": 0.5, "p99": 1.2}})
    registry.close()
    with running_server(create_app(tmp_path / "runs.db")) as url:
        yield url, tmp_path / "runs.db"


def test_runs_list_run_compare_and_baseline(browser, registry_url):
    from selenium.webdriver.common.by import By

    url, path = registry_url
    browser.set_window_size(1280, 900)
    browser.get(url + "/")
    rows = browser.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) == 3 and "output_token_throughput 150" in rows[1].text
    _shot(browser, "runs-list")
    _click_and_wait(browser, browser.find_element(By.LINK_TEXT, "2"), "/runs/2")  # open run 2
    assert browser.find_element(By.TAG_NAME, "h1").text == "run 2: bench serve"
    assert "engine.block_size" in browser.page_source
    _shot(browser, "run")
    browser.get(url + "/")  # compare runs 1 and 2 with the list's form
    browser.find_element(By.NAME, "a").send_keys("1")
    browser.find_element(By.NAME, "b").send_keys("2")
    _click_and_wait(browser, browser.find_element(By.XPATH, "//button[text()='compare']"), "/compare?a=1&b=2")
    changed = browser.find_elements(By.CSS_SELECTOR, "tr.changed")
    assert [r.find_element(By.TAG_NAME, "td").text for r in changed] == ["engine.block_size"]
    color = changed[0].find_element(By.TAG_NAME, "td").value_of_css_property("background-color")
    assert color in ("rgba(255, 248, 197, 1)", "rgb(255, 248, 197)")  # highlighted
    assert "one variable changed: engine.block_size" in browser.page_source
    _shot(browser, "compare-one-variable")
    browser.get(url + "/compare?a=1&b=3")
    assert len(browser.find_elements(By.CSS_SELECTOR, "tr.changed")) == 3
    assert "3 variables changed" in browser.find_element(By.CLASS_NAME, "warn").text
    _shot(browser, "compare-three-variables")
    browser.get(url + "/runs/2")
    _click_and_wait(browser, browser.find_element(By.XPATH, "//button[starts-with(text(), 'set as the baseline')]"),
                    "message=")
    assert "run 2 is the baseline of 'bench serve'" in browser.find_element(By.CLASS_NAME, "ok").text
    registry = RunRegistry(path)
    assert registry.baselines() == {"bench serve": 2}
    registry.close()
    browser.get(url + "/")
    assert "baseline" in browser.find_elements(By.CSS_SELECTOR, "tbody tr")[1].text
    _shot(browser, "baseline-set")
    browser.set_window_size(*PHONE)
    for page, name in (("/", "phone-runs-list"), ("/runs/2", "phone-run"), ("/compare?a=1&b=3", "phone-compare")):
        browser.get(url + page)
        assert _fits_the_phone(browser), page
        _shot(browser, name)
    browser.set_window_size(1280, 900)


def test_live_page_counters_move_while_requests_run(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from fivefold.engine.config import EngineConfig
    from fivefold.engine.llm_engine import LLMEngine
    from fivefold.models import load_model
    from fivefold.serve.app import build_app
    from fivefold.serve.async_engine import AsyncEngine
    from fivefold.serve.metrics import ServerMetrics
    from tests.conftest import save_random_hf_model

    save_random_hf_model("llama", tmp_path)
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory_bytes=8 << 20, block_size=4)),
                         ServerMetrics("tiny"))

    def finished() -> int:
        return int(browser.find_element(By.ID, "requests finished").text)

    with running_server(build_app(engine, "tiny", dashboard=True)) as url:
        browser.set_window_size(1280, 900)
        browser.get(url + "/dashboard")
        assert finished() == 0
        body = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        stop, sent = threading.Event(), []

        def load(i: int) -> None:  # requests back to back until the page has been seen moving
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    r = client.post(url + "/v1/completions", json=body | {"prompt": [5 + i, 7, 9 + len(sent)]})
                    assert r.status_code == 200, r.text
                    sent.append(i)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            running, deadline = 0, time.time() + 60
            while running == 0 and time.time() < deadline:  # the page reloads itself every 2 s
                time.sleep(0.3)
                running = int(browser.find_element(By.ID, "requests running").text)
            assert running >= 1, "the live page never showed a running request"
            _shot(browser, "live-running")
        finally:
            stop.set()
            for t in threads:
                t.join()
        deadline = time.time() + 30
        while finished() < len(sent) and time.time() < deadline:
            time.sleep(0.5)
        assert finished() == len(sent) >= 4
        assert browser.find_element(By.ID, "TTFT p50 / p90 / p99 ms").text != "- / - / -"
        _shot(browser, "live-finished")
        browser.set_window_size(*PHONE)
        browser.get(url + "/dashboard")
        assert _fits_the_phone(browser)
        _shot(browser, "phone-live")
        browser.set_window_size(1280, 900)
    engine.shutdown()
