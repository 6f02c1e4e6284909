"""The web pages in a real browser: Debian's chromium, headless, driven by playwright, against a real
`turnout serve` (the embedded SmolLM2) started with --api-key.

The playground must stream the same answer the openai client gets without streaming (same seed,
temperature 0), Stop must abort the generation on the server, and the dashboard must list the op table
this server resolved and draw its charts from /metrics (pixels of each series' colour on the canvas, and
in a PNG screenshot of it). Without the key, the data endpoints are 401 and the pages say a key is needed.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import time

import httpx
import pytest

from conftest import ServerProcess

openai = pytest.importorskip("openai")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no chromium at {CHROMIUM} (.ci/run installs Debian's: apt-get install chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: pip install -e '.[test]'")

KEY = "web-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The colours dashboard.js gives the series these tests look for on the canvas.
GENERATED_BLUE = (0x1F, 0x6F, 0xEB)
TTFT_MEAN_BLUE = (0x09, 0x69, 0xDA)


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("--max-model-len", "512", "--max-num-seqs", "4", "--api-key", KEY, "--seed", "0")
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    """One chromium with a fresh profile; bypass_csp lets playwright evaluate its own expressions on pages
    whose CSP forbids eval (the pages' own scripts still load only from the server)."""
    with tempfile.TemporaryDirectory(prefix="turnout-chromium-") as profile, sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                   args=LAUNCH_ARGS, bypass_csp=True,
                                                   viewport={"width": 1280, "height": 800})
        ctx.set_default_timeout(60_000)
        try:
            yield ctx
        finally:
            ctx.close()


def open_page(browser, url, errors):
    page = browser.new_page()
    page.on("pageerror", lambda e: errors.append(str(e)))  # an uncaught exception in the page's scripts
    page.goto(url)
    return page


def set_key(page, key):
    page.fill("#key", key)
    page.dispatch_event("#key", "change")


def metric(srv, name, labels=""):
    text = httpx.get(f"{srv.base_url}/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def colour_pixels(page, canvas_id, rgb, tol=40):
    """Pixels of the canvas within `tol` (sum of channel differences) of `rgb`."""
    return page.evaluate("""([id, rgb, tol]) => {
        const c = document.getElementById(id);
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4)
            if (d[i + 3] > 200 && Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]) <= tol) n++;
        return n;
    }""", [canvas_id, list(rgb), tol])


# ---------------------------------------------------------------------------------------------- the key
def test_data_endpoints_need_the_key_pages_do_not(srv, browser):
    u = srv.base_url
    for path in ("/", "/dashboard", "/static/chat.js", "/static/dashboard.js", "/static/style.css"):
        r = httpx.get(u + path)
        assert r.status_code == 200, path
        assert "default-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(f"{u}/static/../api_server.py").status_code == 404
    for path in ("/ops", "/v1/models"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.get(u + path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(u + path, headers=AUTH).status_code == 200
    errors = []
    chat = open_page(browser, f"{u}/", errors)
    chat.evaluate("localStorage.clear()")
    chat.reload()
    chat.wait_for_function("document.getElementById('status').textContent.includes('API key')")
    assert chat.locator("#model option").count() == 0
    dash = open_page(browser, f"{u}/dashboard", errors)
    dash.wait_for_function("document.getElementById('ops-status').textContent.includes('API key')")
    assert dash.locator("#ops tbody tr").count() == 0
    chat.close()
    dash.close()
    assert not errors


def test_ops_is_this_servers_table(srv):
    """GET /ops = what `turnout ops --json` resolves on this machine (same default policy and platform)."""
    from turnout.ops import doctor
    from turnout.platforms import detect_platform

    body = httpx.get(f"{srv.base_url}/ops", headers=AUTH).json()
    assert body["phase"] == "ready" and body["platform"]["name"] == detect_platform("auto").name
    served = {r["op"]: (r["chosen"], [c["impl"] for c in r["candidates"]]) for r in body["data"]}
    local = {r["op"]: (r["chosen"], [c["impl"] for c in r["candidates"]]) for r in doctor.collect(detect_platform("auto"))}
    assert served == local


# ---------------------------------------------------------------------------------------------- the pages
def test_chat_streams_and_dashboard_draws(srv, browser, tmp_path):
    from PIL import Image

    errors = []
    dash = open_page(browser, f"{srv.base_url}/dashboard?every=0.5", errors)
    set_key(dash, KEY)  # stored in localStorage: the chat page (same origin) picks it up
    dash.wait_for_selector("#ops tbody tr")
    ops = httpx.get(f"{srv.base_url}/ops", headers=AUTH).json()["data"]
    assert dash.locator("#ops tbody tr").count() == len(ops) > 0
    assert dash.locator("#ops tbody tr td.op").all_inner_texts() == [r["op"] for r in ops]

    chat = open_page(browser, f"{srv.base_url}/", errors)
    chat.wait_for_selector("#model option", state="attached")
    model = chat.input_value("#model")
    prompt, system = "Name three rivers in Europe.", "You answer briefly."
    chat.fill("#system", system)
    chat.fill("#temperature", "0")
    chat.fill("#max_tokens", "24")
    chat.fill("#seed", "7")
    chat.fill("#prompt", prompt)
    chat.click("#send")
    chat.wait_for_function("document.body.dataset.state === 'streaming'", polling=10)
    chat.wait_for_function("document.body.dataset.state === 'idle'")
    answer = chat.locator(".msg.assistant .text").text_content()
    assert answer.strip(), chat.inner_text("#status")
    assert chat.inner_text("#status").startswith("done ("), chat.inner_text("#status")

    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    ref = client.chat.completions.create(model=model, messages=[{"role": "system", "content": system},
                                                                {"role": "user", "content": prompt}],
                                         temperature=0, max_tokens=24, seed=7)
    assert answer == ref.choices[0].message.content  # the page assembled the stream's deltas in full

    # the scrape after the answer has the tokens; the TTFT chart has the request's first token
    dash.wait_for_function("charts.throughput.series[0].values.some(v => v > 0) && "
                           "charts.ttft.series[0].values.some(v => v !== null && v > 0)")
    assert colour_pixels(dash, "chart-throughput", GENERATED_BLUE) > 20
    assert colour_pixels(dash, "chart-ttft", TTFT_MEAN_BLUE) > 5
    shot = tmp_path / "dashboard.png"
    dash.screenshot(path=str(shot), full_page=True)
    png = dash.locator("#chart-throughput").screenshot()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.width > 200 and img.height > 100
    colours = img.getcolors(maxcolors=1 << 16)
    assert len(colours) > 8  # grid, labels, two series: not a blank or one-colour image
    near = sum(n for n, c in colours if sum(abs(a - b) for a, b in zip(c, GENERATED_BLUE)) <= 40)
    assert near > 20
    assert Image.open(shot).size[1] > 600
    chat.close()
    dash.close()
    assert not errors


def test_dashboard_reads_metrics_as_prometheus_client_does(srv, browser):
    """The page's /metrics parser against prometheus_client's own, on the same scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.base_url}/metrics").text
    want = sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for fam in text_string_to_metric_families(text) for s in fam.samples)
    errors = []
    dash = open_page(browser, f"{srv.base_url}/dashboard", errors)
    got = dash.evaluate("""t => [...parsePrometheus(t)].flatMap(([name, rows]) =>
        rows.map(r => [name, Object.entries(r.labels).sort(), r.value]))""", text)
    got = sorted((n, tuple(tuple(kv) for kv in labels), v) for n, labels, v in got)
    assert len(want) > 30 and got == want
    assert any(n == "turnout_time_to_first_token_seconds_bucket" for n, _, _ in got)
    dash.close()
    assert not errors


def test_stop_aborts_the_generation(srv, browser):
    errors = []
    chat = open_page(browser, f"{srv.base_url}/", errors)
    set_key(chat, KEY)
    chat.wait_for_selector("#model option", state="attached")
    aborted = metric(srv, "turnout_request_finished_total", '{finished_reason="abort"}')
    chat.fill("#temperature", "0")
    chat.fill("#max_tokens", "400")
    chat.fill("#prompt", "Count from 1 to 500, separated by commas.")
    chat.press("#prompt", "Enter")
    chat.wait_for_function("document.querySelector('.msg.assistant .text')?.textContent.length > 0", polling=20)
    chat.click("#stop")
    chat.wait_for_function("document.body.dataset.state === 'idle'")
    assert chat.inner_text("#status") == "stopped"
    deadline = time.monotonic() + 20
    while (metric(srv, "turnout_request_finished_total", '{finished_reason="abort"}') <= aborted
           or metric(srv, "turnout_num_requests_running") != 0):
        assert time.monotonic() < deadline, "the server never aborted the request"
        time.sleep(0.1)
    chat.close()
    assert not errors
