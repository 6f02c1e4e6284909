// A small line chart on a <canvas>: a rolling window of samples per series, the y axis from 0 to a
// rounded maximum, a dot on every sample (so a lone TTFT reading shows), a gap where a value is null.
"use strict";

class LineChart {
  constructor(canvas, series, { points = 120, unit = "", minMax = 1 } = {}) {
    this.canvas = canvas;
    this.series = series.map((s) => ({ ...s, values: [] }));  // {label, color, values}
    this.window = points;  // samples kept (the x axis)
    this.unit = unit;
    this.minMax = minMax;  // the y axis reaches at least this, so an idle server draws a flat line at 0
    this.draw();  // the axes and the empty-state note at once, not an empty box until the first sample
  }

  push(values) {  // one value (or null) per series, in the order given to the constructor
    this.series.forEach((s, i) => {
      s.values.push(values[i]);
      if (s.values.length > this.window) s.values.shift();
    });
    this.draw();
  }

  draw() {
    const c = this.canvas, ctx = c.getContext("2d");
    const ratio = window.devicePixelRatio || 1;
    const w = c.clientWidth || c.width, h = c.clientHeight || c.height;
    if (c.width !== Math.round(w * ratio)) { c.width = Math.round(w * ratio); c.height = Math.round(h * ratio); }
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const pad = { l: 44, r: 8, t: 18, b: 16 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    const seen = this.series.flatMap((s) => s.values.filter((v) => v !== null && Number.isFinite(v)));
    const top = niceCeil(Math.max(this.minMax, ...seen));
    ctx.font = "11px sans-serif";
    ctx.strokeStyle = "#d8dce3";
    ctx.fillStyle = "#667";
    ctx.lineWidth = 1;
    for (let k = 0; k <= 4; k++) {  // grid and y labels
      const y = pad.t + ph - (ph * k) / 4;
      ctx.beginPath(); ctx.moveTo(pad.l, y + 0.5); ctx.lineTo(pad.l + pw, y + 0.5); ctx.stroke();
      ctx.fillText(fmt((top * k) / 4), 4, y + 4);
    }
    if (seen.length === 0) {  // nothing measured yet (no request has finished: no TTFT, for one)
      ctx.textAlign = "center";
      ctx.fillText("no data yet: waiting for traffic", pad.l + pw / 2, pad.t + ph / 2);
      ctx.textAlign = "start";
    }
    const x = (i) => pad.l + (pw * i) / Math.max(1, this.window - 1);
    const y = (v) => pad.t + ph - (ph * v) / top;
    let legendX = pad.l;
    for (const s of this.series) {
      const off = this.window - s.values.length;  // newest sample at the right edge
      ctx.strokeStyle = ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || !Number.isFinite(v)) { pen = false; return; }
        if (pen) ctx.lineTo(x(off + i), y(v)); else ctx.moveTo(x(off + i), y(v));
        pen = true;
      });
      ctx.stroke();
      s.values.forEach((v, i) => {
        if (v === null || !Number.isFinite(v)) return;
        ctx.beginPath(); ctx.arc(x(off + i), y(v), 2.5, 0, 2 * Math.PI); ctx.fill();
      });
      const last = [...s.values].reverse().find((v) => v !== null && Number.isFinite(v));
      const text = `${s.label} ${last === undefined ? "-" : fmt(last)}${this.unit}`;
      ctx.fillText(text, legendX, 12);
      legendX += ctx.measureText(text).width + 16;
    }
  }
}

function niceCeil(v) {  // 1, 2 or 5 times a power of ten, at least v
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= v);
}

function fmt(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toPrecision(2);
}
