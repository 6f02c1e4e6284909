"""The dashboard's charts (static/charts.js, run in node with a canvas that records its calls): a chart draws
its axes and says "no data yet" as soon as it is made, before any sample; the note goes once data arrives."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHARTS = Path(__file__).resolve().parents[2] / "turnout" / "entrypoints" / "openai" / "static" / "charts.js"
NODE = shutil.which("node")

SCRIPT = """
const texts = [];
const ctx = new Proxy({}, { get: (t, k) => k === "fillText" ? (s) => texts.push(String(s))
                                   : k === "measureText" ? (s) => ({ width: String(s).length * 6 })
                                   : k in t ? t[k] : () => {}, set: (t, k, v) => { t[k] = v; return true; } });
const canvas = { width: 480, height: 180, clientWidth: 480, clientHeight: 180, getContext: () => ctx };
globalThis.window = { devicePixelRatio: 1 };
eval(require("fs").readFileSync(process.argv[1], "utf8") + "\\nglobalThis.LineChart = LineChart;");
const chart = new LineChart(canvas, [{ label: "TTFT", color: "#1f6feb" }]);
const empty = texts.splice(0);
chart.push([null]);
const stillEmpty = texts.splice(0);
chart.push([0.25]);
console.log(JSON.stringify({ empty, stillEmpty, data: texts.splice(0) }));
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_a_chart_says_it_waits_for_traffic_until_data_arrives():
    r = subprocess.run([NODE, "-e", SCRIPT, str(CHARTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    note = "no data yet: waiting for traffic"
    assert note in got["empty"] and "0" in got["empty"] and "TTFT -" in got["empty"]  # axes, legend, the note
    assert note in got["stillEmpty"]
    assert note not in got["data"] and "TTFT 0.25" in got["data"]
