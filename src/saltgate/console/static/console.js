// The console's one script: draws each [data-chart] element with uPlot from the page's
// .json twin (same origin; "#name" picks data.charts[name]). No inline script, no eval.
"use strict";

const COLORS = ["#1f4e79", "#d97706", "#2f855a", "#a4262c", "#6b46c1", "#0e7490", "#6b7280"];

function draw(el, chart) {
  const hasData = chart && chart.x.length > 0 && chart.series.length > 0;
  el.setAttribute("data-points", hasData ? String(chart.x.length) : "0");
  if (!hasData) {
    const p = document.createElement("p");
    p.className = "nodata";
    p.textContent = "No data in this range yet.";
    el.replaceChildren(p);
    el.setAttribute("data-drawn", "1");
    return;
  }
  const series = [{}].concat(chart.series.map((s, i) => ({
    label: s.label,
    stroke: COLORS[i % COLORS.length],
    width: 2,
    points: { show: chart.x.length < 3 },
  })));
  const data = [chart.x].concat(chart.series.map((s) => s.values));
  const width = Math.max(320, el.clientWidth || 800);
  // Small values (a cost in USD) keep their digits instead of rounding to 0.
  const values = (u, splits) => splits.map((v) => (v !== 0 && Math.abs(v) < 1 ? v.toPrecision(2) : String(v)));
  const axes = [{}, { label: chart.unit, values: values, size: 60 }];
  new uPlot({ width: width, height: 220, series: series, axes: axes }, data, el);
  el.setAttribute("data-drawn", "1");
}

const twins = new Map(); // one fetch per twin, however many charts it feeds

async function load(el) {
  const [src, name] = el.getAttribute("data-chart").split("#");
  if (!twins.has(src)) {
    twins.set(src, fetch(src, { credentials: "same-origin", headers: { accept: "application/json" } })
      .then((r) => (r.ok ? r.json() : Promise.reject(new Error(String(r.status))))));
  }
  try {
    const data = await twins.get(src);
    draw(el, (data.charts || {})[name]);
  } catch (err) {
    el.textContent = "Could not load the chart (" + err.message + ").";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-chart]").forEach((el) => { load(el); });
});
