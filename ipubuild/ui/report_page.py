"""The report page: one self-contained HTML file drawing ``report.report_data``.

Tables and figures are static HTML; the charts are drawn by the page's own script from the data
embedded in it (``<script type="application/json" id="report-data">``): inline SVG for the step
and convergence charts, canvases for the tile heatmap and the memory maps (thousands of cells).
Nothing is loaded from anywhere else. ``render`` is deterministic: same data, same bytes.
"""
from __future__ import annotations

import html
import re

from ..engine import canonical

TOP_STEPS = 10
FULLEST_TILES = 10


def _n(x) -> str:
    return f"{x:,}"


def _table(head: list[str], rows: list[list], numeric: set[int], ident: str) -> str:
    th = "".join(f'<th{" class=num" if j in numeric else ""}>{html.escape(h)}</th>' for j, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if j in numeric else ""}>{html.escape(str(c))}</td>'
                                    for j, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<table id="{ident}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _top_steps(d: dict) -> str:
    s = d["steps"]
    totals = [x + c + y for x, c, y in zip(s["exchange"], s["compute"], s["sync"])]
    whole = max(1, sum(totals))
    top = sorted(range(len(totals)), key=lambda i: (-totals[i], i))[:TOP_STEPS]
    rows = [[i, s["names"][i], _n(s["exchange"][i]), _n(s["compute"][i]), _n(s["sync"][i]), _n(totals[i]),
             f"{100 * totals[i] / whole:.1f} %"] for i in top]
    return _table(["#", "step", "exchange", "compute", "sync", "total", "share"], rows, {0, 2, 3, 4, 5, 6},
                  "top-steps")


def _fullest_tiles(d: dict) -> str:
    kinds = d["memory"]["kinds"]
    rows = []
    for t in d["memory"]["tiles"]:
        by = dict.fromkeys(kinds, 0)
        runs = t["runs"]
        for k, length in zip(runs[::2], runs[1::2]):
            by[kinds[k]] += length
        rows.append((by["free"], t["tile"], by))
    rows.sort()
    head = ["tile", *(k for k in kinds if k != "reserved")]
    return _table(head, [[tile, *(_n(by[k]) for k in head[1:])] for _, tile, by in rows[:FULLEST_TILES]],
                  set(range(len(head))), "fullest-tiles")


def _exchange_steps(d: dict) -> str:
    cycles = d["steps"]["exchange"]
    rows = [[f'{e["step"]} {e["name"]}', _n(e["bytes"]), _n(e["transfers"]),
             f'tile {e["sender"][0]}: {_n(e["sender"][1])}', f'tile {e["receiver"][0]}: {_n(e["receiver"][1])}',
             _n(cycles[e["step"]]) if e["step"] < len(cycles) else "–"] for e in d["exchanges"]["steps"]]
    return _table(["step", "bytes", "transfers", "busiest sender (bytes)", "busiest receiver (bytes)",
                   "exchange cycles"], rows, {1, 2, 3, 4, 5}, "exchange-steps")


def _exchanges(d: dict) -> str:
    x = d["exchanges"]
    rows = [[i + 1, f'{e["step"]} {e["name"]}', e["from"], e["to"], e["value"], _n(e["bytes"])]
            for i, e in enumerate(x["top"])]
    return _table(["rank", "step", "from tile", "to tile", "value", "bytes"], rows, {0, 2, 3, 5}, "exchange-table")


def _plans(d: dict) -> str:
    return _table(["operation", "type", "plan", "tiles", "first tile"], d.get("plans", []), {3, 4}, "plan-table")


def _plans_note(d: dict) -> str:
    grids = [r for r in d.get("plans", []) if re.match(r"\d+ × \d+ × \d+ grid", r[2])]
    if not d.get("plans"):
        return "This build recorded no plans."
    return (f"The plan the search left each of the {len(d['plans'])} operations on, in program order. "
            f"{len(grids)} run on a grid of tiles: rows × columns × K-slices of their output and of the "
            "sum over K (each K-slice's partial sums are added in a second step).")


def _kernels(d: dict) -> str:
    kinds = d["kernels"]["kernels"]
    rows = []
    for name, k in sorted(kinds.items(), key=lambda kv: (-kv[1]["estimated_cycles"], kv[0])):
        per = k["blocks_per_call"]
        measured = k["blocks"] is not None
        rows.append([name, _n(k["calls"]), _n(k["estimated_cycles"]), _n(k["estimated_cycles"] // max(1, k["calls"])),
                     _n(k["blocks"]) if measured else "–",
                     (_n(per[0]) if per[0] == per[1] else f"{_n(per[0])}–{_n(per[1])}") if measured else "–",
                     f'{k["blocks"] / max(1, k["estimated_cycles"]):.2f}' if measured else "–"])
    return _table(["kernel variant", "calls", "estimated cycles", "estimated per call", "basic blocks executed",
                   "blocks per call", "blocks per estimated cycle"], rows, {1, 2, 3, 4, 5, 6}, "kernel-table")


def _kernels_note(d: dict) -> str:
    k = d["kernels"]
    if not k["kernels"]:
        return " ".join(["No kernel figures: the build measured none.", *(f"Note: {html.escape(n)}." for n in k["notes"])])
    parts = ["Per kernel variant: the cycles its estimator gives the cost model (which does not read the code), "
             f"and what the compiled code did: {html.escape(k['measure'])}. The count is the same on every run, so a kernel "
             "edit shows here after a rebuild that plans nothing again. Host time varies from run to run and is "
             f'not on this page: <code>doit profile:{html.escape(d["target"])}</code> measures it.']
    parts += [f"Note: {html.escape(n)}." for n in k["notes"]]
    return " ".join(parts)


def _heatmap_note(d: dict) -> str:
    h = d["heatmap"]
    if not h["tiles"]:
        return "The device reported no compute cycles per tile."
    parts = [f'{h["tiles"]} tiles compute in {len(d["steps"]["names"])} steps.']
    if h["tiles_per_row"] > 1:
        parts.append(f'There are too many tiles for one row each: every row is a group of {h["tiles_per_row"]} '
                     "consecutive computing tiles, and a cell shows the slowest tile of its group.")
    if h["steps_per_column"] > 1:
        parts.append(f'Every column is a group of {h["steps_per_column"]} consecutive steps (the slowest cell).')
    parts.append("Grey: the tile does not compute in that step.")
    return " ".join(parts)


def _steps_note(d: dict) -> str:
    if d["steps_from"] == "device":
        return ""
    return (f' The device ({html.escape(str(d["device"]))}) reported only totals: these are the cost model\'s '
            "figures.")


def _search_note(d: dict) -> str:
    s = d["search"]
    if not s["history"]:
        return (f'The search accepted no improvement: the initial layout ({_n(s["initial_cycles"])} cycles) '
                "was kept (no cheaper candidate, or search.rounds = 0).")
    last = s["history"][-1]["after"]
    gain = 100 * (s["initial_cycles"] - last) / max(1, s["initial_cycles"])
    mapped = " (round 0: the whole-program tile mapping)" if s["history"][0]["round"] == 0 else ""
    return (f'{_n(s["initial_cycles"])} → {_n(last)} cycles (−{gain:.1f} %) in {len(s["history"])} accepted '
            f"step(s){mapped}. The dashed line is the lower bound of the final program.")


def render(d: dict) -> str:
    """The page for ``report_data`` ``d``."""
    t = html.escape(d["target"])
    final, lb = d["final_cycles"], d["lower_bound"]
    figures = [
        ("final cycles", _n(final)),
        ("lower bound", f"{_n(lb)} (final / bound = {final / max(1, lb):.3f})"),
        ("time at clock", f'{final / d["clock_hz"] * 1e6:.1f} µs at {d["clock_hz"] / 1e9:g} GHz'),
        ("tiles", f'{d["tiles_used"]} used of {d["tile_count"]} planned; the package has {d["tiles"]}'),
        ("steps", _n(len(d["steps"]["names"]))),
        ("exchange", f'{_n(d["final_exchange"])} cycles ({100 * d["final_exchange"] / max(1, final):.1f} %)'),
        ("device", f'{d["device"]}: ' + (f'{_n(d["device_cycles"])} cycles' if d["device_cycles"] is not None
                                          else "no cycle count")),
    ]
    dl = "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd></div>" for k, v in figures)
    x = d["exchanges"]
    data = canonical.dumps(d).decode().replace("<", "\\u003c")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{t} — device profile</title>
<style>{CSS}</style></head>
<body>
<header><h1>{t} <small>device profile</small></h1><dl class="figures">{dl}</dl></header>
<noscript><p class="warn">The charts are drawn by this page's script; the tables below work without it.</p></noscript>
<main>
<section id="changes" hidden><h2>Changes since the previous build</h2>
<p class="note">What moved against the previous build of {t} (kept as {t}.profile.previous.json): marked
<span class="moved">so</span> in the tables below.</p><ul id="changes-list"></ul></section>
<section id="steps"><h2>Cycles per step</h2>
<p class="note">Each bar is one BSP step: its exchange phase, the slowest tile's compute, and the sync.
Hover for figures.{_steps_note(d)}</p>
<div class="legend"><span class="k x"></span>exchange <span class="k c"></span>compute <span class="k s"></span>sync</div>
<div id="step-chart" class="chart"></div>
<h3>Top {TOP_STEPS} steps</h3>{_top_steps(d)}</section>
<section id="heatmap"><h2>Compute cycles per tile and step</h2>
<p class="note">{html.escape(_heatmap_note(d))}</p>
<div class="scroll"><canvas id="heatmap-canvas" width="10" height="10"></canvas></div>
<div id="heatmap-scale" class="legend"></div></section>
<section id="memory"><h2>Tile memory</h2>
<p class="note">{len(d["memory"]["tiles"])} used tiles, addresses {d["memory"]["base"]:#x}–{d["memory"]["end"]:#x}
(one row per tile). Data: operations' inputs and outputs; exchange: buffers the exchange gathers into; shared:
bytes that data and exchange buffers use at different times. Free: bytes no buffer ever uses.</p>
<div id="memory-legend" class="legend"></div>
<div class="scroll tall"><canvas id="memory-canvas" width="10" height="10"></canvas></div>
<h3>The {FULLEST_TILES} fullest tiles (bytes)</h3>{_fullest_tiles(d)}</section>
<section id="kernels"><h2>Kernels: estimated and measured</h2>
<p class="note">{_kernels_note(d)}</p>{_kernels(d)}</section>
<section id="plans"><h2>Plans</h2>
<p class="note">{_plans_note(d)}</p>{_plans(d)}</section>
<section id="search"><h2>Search convergence</h2>
<p class="note">{html.escape(_search_note(d))}</p>
<div id="search-chart" class="chart"></div></section>
<section id="exchanges"><h2>Largest exchanges</h2>
<p class="note">{_n(x["count"])} exchanges (bytes per step, source tile, destination tile and value) move
{_n(x["total_bytes"])} bytes in all (on-tile copies included); the largest listed move data between tiles.</p>
<h3>The steps that move the most bytes</h3>{_exchange_steps(d)}
<h3>The {len(x["top"])} largest exchanges</h3>{_exchanges(d)}</section>
</main>
<div id="tip" hidden></div>
<script type="application/json" id="report-data">{data}</script>
<script src="{t}.changes.js"></script>
<script>{SCRIPT}</script>
<script>{CHANGES_SCRIPT}</script>
</body></html>
"""


# the marks of what moved since the previous build: `<target>.changes.js`, beside the page, written
# when a build finishes (ipubuild.ui.profile_diff), sets window.IPUBUILD_CHANGES; the page itself
# stays a pure function of its build's inputs
CHANGES_SCRIPT = """
(function () {
  const c = window.IPUBUILD_CHANGES;
  if (!c || !c.lines || !c.lines.length) return;
  document.getElementById("changes").hidden = false;
  const ul = document.getElementById("changes-list");
  for (const line of c.lines) { const li = document.createElement("li"); li.textContent = line; ul.appendChild(li); }
  const mark = (id, key, why) => {
    for (const tr of document.querySelectorAll(`#${id} tbody tr`)) {
      if (tr.cells[0] && tr.cells[0].textContent.trim() === String(key)) { tr.classList.add("moved"); tr.title = why; }
    }
  };
  for (const [name, figs] of Object.entries(c.marks.kernels || {}))
    mark("kernel-table", name, Object.entries(figs).map(([f, [a, b]]) => `${f}: ${a} → ${b} (${b - a >= 0 ? "+" : ""}${b - a})`).join("; "));
  for (const [i, delta] of Object.entries(c.marks.steps || {}))
    mark("top-steps", i, `${delta >= 0 ? "+" : ""}${delta} cycles since the previous build`);
})();
"""

CSS = """.moved{background:#fff3c4}svg .moved-bar rect{stroke:#d08000;stroke-width:1.5}

body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;background:#fafbfc}
header{padding:16px 24px;background:#1d2330;color:#fff}h1{margin:0 0 8px;font-size:22px}
h1 small{font-weight:400;opacity:.7}.figures{display:flex;flex-wrap:wrap;gap:8px 28px;margin:0}
.figures dt{font-size:11px;text-transform:uppercase;opacity:.65}.figures dd{margin:0;font-weight:600}
main{padding:0 24px 24px;max-width:1180px}section{margin-top:24px}h2{font-size:17px;margin:0 0 4px}
h3{font-size:14px;margin:14px 0 4px}.note{margin:0 0 8px;color:#556;max-width:900px}.warn{color:#a00;padding:0 24px}
.chart svg{display:block;max-width:100%;height:auto;background:#fff;border:1px solid #dde}
.scroll{overflow:auto;max-width:100%;border:1px solid #dde;background:#fff}.tall{max-height:720px}
canvas{display:block}table{border-collapse:collapse;font-size:13px;background:#fff}
th,td{padding:2px 10px;border-bottom:1px solid #e6e8ee;text-align:left}th{background:#eef0f5}
.num{text-align:right;font-variant-numeric:tabular-nums}
.legend{margin:6px 0;font-size:12px;color:#334}.k{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;
vertical-align:-2px}.legend .k:first-child{margin-left:0}
.x{fill:#e8833a;background:#e8833a}.c{fill:#3b75af;background:#3b75af}.s{fill:#b9bec9;background:#b9bec9}
svg text{font-size:11px;fill:#445}svg .axis{stroke:#99a;stroke-width:1}svg .grid{stroke:#eceef3}
svg .line{fill:none;stroke:#3b75af;stroke-width:2}svg .bound{stroke:#c33;stroke-dasharray:5 4}
svg circle{fill:#3b75af}svg .bar:hover rect{opacity:.75}
#tip{position:fixed;pointer-events:none;background:#1d2330;color:#fff;padding:6px 8px;border-radius:4px;
font-size:12px;white-space:pre;z-index:9}
"""

# The page's script: reads the embedded data, draws the charts, marks <body data-rendered="true">.
SCRIPT = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("report-data").textContent);
  const NS = (function () {    // the SVG namespace, without spelling out its URI
    const d = document.createElement("div");
    d.innerHTML = "<svg></svg>";
    return d.firstChild.namespaceURI;
  })();
  const fmt = (n) => String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  const tip = document.getElementById("tip");

  function el(tag, attrs, parent, text) {
    const e = document.createElementNS(NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function niceMax(v) {
    const p = Math.pow(10, Math.floor(Math.log10(Math.max(v, 1))));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function showTip(ev, text) {
    tip.textContent = text; tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 4) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  }
  function hideTip() { tip.hidden = true; }
  function yAxis(svg, W, H, L, B, T, lo, hi, title) {
    const step = niceMax((hi - lo) / 5), Y = (v) => H - B - (H - B - T) * (v - lo) / (hi - lo);
    el("line", {x1: L, x2: W - 10, y1: H - B, y2: H - B, class: "axis"}, svg);
    if (title) el("text", {x: 12, y: T + (H - B - T) / 2, "text-anchor": "middle",
                           transform: `rotate(-90 12 ${T + (H - B - T) / 2})`}, svg, title);
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) {
      if (v > lo) el("line", {x1: L, x2: W - 10, y1: Y(v), y2: Y(v), class: "grid"}, svg);
      el("text", {x: L - 6, y: Y(v) + 4, "text-anchor": "end"}, svg, fmt(Math.round(v)));
    }
  }
  function ramp(t) {
    const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    const x = Math.max(0, Math.min(1, t)) * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
    const c = stops[i].map((a, j) => Math.round(a + (stops[i + 1][j] - a) * f));
    return "rgb(" + c.join(",") + ")";
  }

  function stepChart() {
    const s = D.steps, n = s.names.length, W = 1120, H = 300, L = 70, B = 34, T = 10;
    const totals = s.names.map((_, i) => s.exchange[i] + s.compute[i] + s.sync[i]);
    const top = niceMax(totals.reduce((a, b) => Math.max(a, b), 1));
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "cycles per step"});
    yAxis(svg, W, H, L, B, T, 0, top, "cycles");
    const bw = (W - 10 - L) / Math.max(n, 1), scale = (H - B - T) / top;
    const every = Math.max(1, Math.ceil(n / 40));
    const moved = ((window.IPUBUILD_CHANGES || {}).marks || {}).steps || {};
    for (let i = 0; i < n; i++) {
      const g = el("g", {class: "bar" + (String(i) in moved ? " moved-bar" : "")}, svg), x = L + i * bw;
      let y = H - B;
      for (const [key, cls] of [["exchange", "x"], ["compute", "c"], ["sync", "s"]]) {
        const h = s[key][i] * scale;
        el("rect", {x: x.toFixed(2), y: (y - h).toFixed(2), width: Math.max(bw - (bw > 4 ? 1 : 0), 0.5).toFixed(2),
                    height: h.toFixed(2), class: cls}, g);
        y -= h;
      }
      el("title", {}, g, `step ${i}: ${s.names[i]}\nexchange ${fmt(s.exchange[i])}\ncompute ${fmt(s.compute[i])}` +
         `\nsync ${fmt(s.sync[i])}\ntotal ${fmt(totals[i])} cycles` +
         `\nexchanged ${fmt(D.exchanges.bytes_per_step[i] || 0)} bytes`);
      // few steps: each named under its bar; many: every few numbered (the name on hover)
      if (n <= 16) el("text", {x: (x + bw / 2).toFixed(2), y: H - B + 14, "text-anchor": "middle"}, svg,
                      `${i} ${s.names[i]}`.slice(0, Math.max(3, Math.floor(bw / 6))));
      else if (i % every === 0) el("text", {x: (x + bw / 2).toFixed(2), y: H - B + 14, "text-anchor": "middle"}, svg, String(i));
    }
    el("text", {x: L + (W - L) / 2, y: H - 4, "text-anchor": "middle"}, svg,
       n <= 16 ? "step" : "step (its name on hover; the top steps table names them)");
    document.getElementById("step-chart").appendChild(svg);
  }

  function heatmap() {
    const h = D.heatmap, nr = h.rows.length, nc = h.columns.length, L = 90, A = 20, T = 6;
    const cw = Math.max(2, Math.min(24, Math.floor(1000 / Math.max(nc, 1))));
    const ch = Math.max(3, Math.min(12, Math.floor(640 / Math.max(nr, 1))));
    const cv = document.getElementById("heatmap-canvas");
    cv.width = L + nc * cw + 4; cv.height = T + nr * ch + A;
    const g = cv.getContext("2d");
    g.font = "10px sans-serif"; g.fillStyle = "#445"; g.textBaseline = "middle";
    const label = (r) => h.rows[r][0] === h.rows[r][1] ? "tile " + h.rows[r][0]
                                                       : "tiles " + h.rows[r][0] + "–" + h.rows[r][1];
    const rowEvery = Math.max(1, Math.ceil(12 / ch));
    for (let r = 0; r < nr; r++) {
      if (r % rowEvery === 0) { g.fillStyle = "#445"; g.fillText(label(r), 2, T + r * ch + ch / 2); }
      for (let c = 0; c < nc; c++) {
        const v = h.values[r * nc + c];
        g.fillStyle = v ? ramp(Math.sqrt(v / Math.max(h.max, 1))) : "#eceef2";
        g.fillRect(L + c * cw, T + r * ch, cw - (cw > 3 ? 1 : 0), ch - (ch > 3 ? 1 : 0));
      }
    }
    g.fillStyle = "#445"; g.textBaseline = "top";
    const colEvery = Math.max(1, Math.ceil(30 / cw));
    for (let c = 0; c < nc; c += colEvery) g.fillText(String(h.columns[c][0]), L + c * cw, T + nr * ch + 4);
    cv.addEventListener("mousemove", (ev) => {
      const b = cv.getBoundingClientRect();
      const c = Math.floor((ev.clientX - b.left - L) / cw), r = Math.floor((ev.clientY - b.top - T) / ch);
      if (c < 0 || c >= nc || r < 0 || r >= nr) return hideTip();
      const [s0, s1] = h.columns[c];
      const steps = s0 === s1 ? `step ${s0}: ${D.steps.names[s0]}` : `steps ${s0}–${s1}`;
      showTip(ev, `${label(r)}\n${steps}\ncompute ${fmt(h.values[r * nc + c])} cycles`);
    });
    cv.addEventListener("mouseleave", hideTip);
    const scale = document.getElementById("heatmap-scale");
    scale.textContent = "0 ";
    for (let i = 0; i <= 10; i++) {
      const k = document.createElement("span");
      k.className = "k"; k.style.margin = "0"; k.style.background = ramp(i / 10);
      scale.appendChild(k);
    }
    scale.appendChild(document.createTextNode(" " + fmt(h.max) + " cycles (square-root scale)"));
  }

  function memory() {
    const m = D.memory, n = m.tiles.length, L = 70, A = 20, Wd = 1000, span = m.end - m.base;
    const colors = {reserved: "#9aa0ab", code: "#8e5ea2", constants: "#2f8f5b", data: "#3b75af", exchange: "#e8833a",
                    shared: "#d4b13c", free: "#f4f5f8"};
    const legend = document.getElementById("memory-legend");
    for (const k of m.kinds) {
      const s = document.createElement("span");
      s.className = "k"; s.style.background = colors[k]; s.style.border = "1px solid #ccd";
      legend.appendChild(s); legend.appendChild(document.createTextNode(k));
    }
    const rh = n <= 64 ? 10 : n <= 128 ? 5 : n <= 400 ? 3 : 2, sx = Wd / span;
    const cv = document.getElementById("memory-canvas");
    cv.width = L + Wd + 8; cv.height = n * rh + A;
    const g = cv.getContext("2d");
    g.font = "10px sans-serif"; g.fillStyle = "#445"; g.textBaseline = "top";
    for (let a = Math.ceil(m.base / 65536) * 65536; a <= m.end; a += 65536) {
      const x = L + (a - m.base) * sx;
      g.fillRect(x, A - 5, 1, 5); g.fillText("0x" + a.toString(16), x - 14, 2);
    }
    g.textBaseline = "middle";
    const every = Math.max(1, Math.ceil(12 / rh));
    const totals = [];
    m.tiles.forEach((t, r) => {
      const y = A + r * rh, by = {};
      let x = 0;
      for (let i = 0; i < t.runs.length; i += 2) {
        const kind = m.kinds[t.runs[i]], len = t.runs[i + 1];
        g.fillStyle = colors[kind];
        g.fillRect(L + x * sx, y, Math.max(len * sx, 0.5), rh - (rh > 3 ? 1 : 0));
        by[kind] = (by[kind] || 0) + len; x += len;
      }
      totals.push(by);
      if (r % every === 0) { g.fillStyle = "#445"; g.fillText("tile " + t.tile, 2, y + rh / 2); }
    });
    cv.addEventListener("mousemove", (ev) => {
      const b = cv.getBoundingClientRect(), r = Math.floor((ev.clientY - b.top - A) / rh), px = ev.clientX - b.left - L;
      if (r < 0 || r >= n || px < 0 || px > Wd) return hideTip();
      const t = m.tiles[r], by = totals[r], addr = Math.floor(m.base + px / sx);
      const lines = ["tile " + t.tile + "   address 0x" + addr.toString(16)];
      for (const k of m.kinds) lines.push(k.padEnd(10) + fmt(by[k] || 0).padStart(9) + " bytes");
      lines.push("code: kernels " + fmt(t.code[0]) + ", program " + fmt(t.code[1]) + ", exchange tables " + fmt(t.code[2]));
      showTip(ev, lines.join("\n"));
    });
    cv.addEventListener("mouseleave", hideTip);
  }

  function search() {
    const s = D.search, W = 1120, H = 240, L = 70, B = 34, T = 12;
    const pts = [{label: "initial", cycles: s.initial_cycles}].concat(
      s.history.map((h) => ({label: h.round === 0 ? "tile mapping" : "round " + h.round, cycles: h.after})));
    const vals = pts.map((p) => p.cycles).concat([D.lower_bound]);
    const hi = Math.max.apply(null, vals) * 1.03, lo = Math.min.apply(null, vals) * 0.9;
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "search convergence"});
    yAxis(svg, W, H, L, B, T, lo, hi, "cycles");
    const X = (i) => L + 40 + (W - L - 120) * (pts.length > 1 ? i / (pts.length - 1) : 0.5);
    const Y = (v) => H - B - (H - B - T) * (v - lo) / (hi - lo);
    el("line", {x1: L, x2: W - 10, y1: Y(D.lower_bound), y2: Y(D.lower_bound), class: "bound"}, svg);
    el("text", {x: W - 14, y: Y(D.lower_bound) - 5, "text-anchor": "end"}, svg, "lower bound " + fmt(D.lower_bound));
    let d = "";
    pts.forEach((p, i) => { d += (i ? ` H${X(i)} V${Y(p.cycles)}` : `M${X(i)} ${Y(p.cycles)}`); });
    el("path", {d: d, class: "line"}, svg);
    pts.forEach((p, i) => {
      const g = el("g", {class: "point"}, svg);
      el("circle", {cx: X(i), cy: Y(p.cycles), r: 5}, g);
      el("title", {}, g, `${p.label}: ${fmt(p.cycles)} cycles`);
      el("text", {x: X(i), y: Y(p.cycles) - 10, "text-anchor": "middle"}, svg, fmt(p.cycles));
      el("text", {x: X(i), y: H - B + 16, "text-anchor": "middle"}, svg, p.label);
    });
    document.getElementById("search-chart").appendChild(svg);
  }

  stepChart(); heatmap(); memory(); search();
  document.body.dataset.rendered = "true";
})();
"""
