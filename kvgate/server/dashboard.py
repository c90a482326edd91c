"""A built-in status page at /dashboard, for an operator without Grafana.

One self-contained HTML page (no external assets: it works on an air-gapped host) that polls
``/dashboard/data`` every second (``?refresh=MS`` to change): running and waiting requests,
the KV pool by state and by tenant, recent latencies, the SLO autopilot's knobs and targets,
and a KV-usage sparkline kept in the browser. Like /metrics it exposes only aggregates, no
request content.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from kvgate.engine.autopilot import AutopilotState
from kvgate.engine.stats import IterationStats


class RecentLatencies:
    """The last ``size`` TTFT, inter-token and end-to-end samples, and recent token rates.
    A ``StatsListener``: fed on the engine thread, read on the server's."""

    def __init__(self, size: int = 256) -> None:
        self.ttft: deque[float] = deque(maxlen=size)
        self.itl: deque[float] = deque(maxlen=size * 8)
        self.e2e: deque[float] = deque(maxlen=size)
        self.tokens: deque[tuple[float, int]] = deque(maxlen=600)  # (time, generated tokens)
        self._lock = threading.Lock()

    def on_step(self, stats: IterationStats) -> None:
        with self._lock:
            self.ttft.extend(stats.time_to_first_tokens)
            self.itl.extend(stats.inter_token_latencies)
            self.e2e.extend(
                f.metrics.e2e_seconds
                for f in stats.finished
                if f.finish_reason in ("stop", "length")
            )
            if stats.num_generation_tokens:
                self.tokens.append((time.monotonic(), stats.num_generation_tokens))

    def summary(self, window: float = 10.0) -> dict[str, Any]:
        with self._lock:
            ttft, itl, e2e = sorted(self.ttft), sorted(self.itl), sorted(self.e2e)
            now = time.monotonic()
            recent = sum(n for t, n in self.tokens if now - t <= window)
        return {
            "ttft_p50": _pct(ttft, 50),
            "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(itl, 50),
            "itl_p99": _pct(itl, 99),
            "e2e_p50": _pct(e2e, 50),
            "samples": len(ttft),
            "generation_tok_s": recent / window,
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))], 4)


def install_dashboard(app: FastAPI, recent: RecentLatencies) -> None:
    @app.get("/dashboard", response_class=HTMLResponse)
    def page() -> str:
        return PAGE

    @app.get("/dashboard/data")
    def data(request: Request) -> dict[str, Any]:
        state = request.app.state.kvgate
        snaps = state.snapshots()  # each model's latest published state, one moment each
        # Tenants' names and use only for a metrics or admin key (or an open server).
        observer = state.governance.tenants.may_observe(request.headers.get("authorization"))
        out: dict[str, Any] = {
            "model": ", ".join(state.models.names),
            "ready": bool(snaps),
            "tenants_hidden": not observer,
        }
        if not snaps:
            return out
        blocks = sum(s.kv_blocks for s in snaps.values())
        used = sum(s.kv_used for s in snaps.values())
        out.update(
            running=sum(s.running for s in snaps.values()),
            waiting=sum(s.waiting for s in snaps.values()),
            kv={
                "blocks": blocks,
                "used": used,
                "cached": sum(s.kv_cached for s in snaps.values()),
                "free": sum(s.kv_free for s in snaps.values()),
                "usage": round(used / max(blocks, 1), 4),
            },
            models={
                name: {"running": s.running, "waiting": s.waiting, "kv_usage": round(s.kv_usage, 4)}
                for name, s in snaps.items()
            },
            tenants=[]
            if not observer
            else [
                {
                    "name": name,
                    "blocks": row["kv_blocks_held"],
                    "ceiling": row["kv_ceiling_blocks"],
                    "running": row["running"],
                    "waiting": row["waiting"],
                    "priority": row["priority"],
                }
                for name, row in state.governance.report(snaps).items()
            ],
            latency=recent.summary(),
            slo={
                name: _slo_view(s.autopilot, observer, time.monotonic())
                for name, s in snaps.items()
                if s.autopilot is not None
            },
        )
        return out


def _slo_view(state: AutopilotState, observer: bool, now: float) -> dict[str, Any]:
    """One model's autopilot for the page; tenants' names (their own SLO groups, those held)
    only for an observer, as everywhere on it."""
    knobs, configured = state.knobs, state.configured
    groups = {
        group: {metric: {"target": t, "observed": o} for metric, (t, o) in row.items()}
        for group, row in state.groups.items()
        if observer or not group.startswith("tenant:")
    }
    return {
        "knobs": {
            k: [getattr(knobs, k), getattr(configured, k)]
            for k in ("token_budget", "chunk_size", "max_running")
        },
        "held": sorted(knobs.held) if observer else len(knobs.held),
        "groups": groups,
        "windows": state.windows,
        "recent": [
            {
                "ago_s": round(now - a.at, 1),
                "direction": a.direction,
                "reason": a.reason if observer or "tenant:" not in a.reason else "(a tenant's SLO)",
            }
            for a in state.history[-5:]
        ],
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvgate status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px system-ui,sans-serif;margin:24px;color:#1d2430;background:#f6f7f9}
 h1{font-size:20px;margin:0 0 16px} h2{font-size:15px;margin:0 0 8px;color:#4a5566}
 .grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(260px,1fr));gap:14px}
 .card{background:#fff;border-radius:8px;padding:14px;box-shadow:0 1px 3px #0002}
 .big{font-size:30px;font-weight:600} .muted{color:#7a8494}
 table{width:100%;border-collapse:collapse} td,th{text-align:left;padding:3px 4px}
 .bar{height:10px;background:#e4e8ee;border-radius:5px;overflow:hidden}
 .bar>div{height:100%;background:#3b7be0} #status.down{color:#c0392b}
</style></head><body>
<h1>kvgate <span class="muted" id="model"></span> <span id="status" class="muted"></span></h1>
<div class="grid">
 <div class="card"><h2>Requests</h2>
  <div><span class="big" id="running">-</span> running</div>
  <div><span class="big" id="waiting">-</span> waiting</div></div>
 <div class="card"><h2>KV cache</h2>
  <div class="big" id="kv-usage">-</div>
  <div class="bar"><div id="kv-bar" style="width:0"></div></div>
  <div class="muted" id="kv-blocks"></div>
  <svg id="spark" width="240" height="40" viewBox="0 0 240 40"><polyline id="spark-line"
   fill="none" stroke="#3b7be0" stroke-width="2" points=""/></svg></div>
 <div class="card"><h2>Recent latencies</h2><table>
  <tr><td>TTFT p50 / p99</td><td id="ttft">-</td></tr>
  <tr><td>Inter-token p50 / p99</td><td id="itl">-</td></tr>
  <tr><td>End-to-end p50</td><td id="e2e">-</td></tr>
  <tr><td>Generated tokens/s</td><td id="toks">-</td></tr></table></div>
 <div class="card" style="grid-column:1/-1" id="slo-card" hidden><h2>SLO autopilot</h2>
  <div id="slo"></div></div>
 <div class="card" style="grid-column:1/-1"><h2>KV pool by tenant</h2>
  <table><thead><tr><th>tenant</th><th>priority</th><th>blocks held / ceiling</th><th></th>
  <th>running</th><th>waiting</th></tr></thead><tbody id="tenants"></tbody></table></div>
</div>
<script>
const history = [];
const ms = v => v == null ? "-" : (v * 1000).toFixed(v < 0.1 ? 1 : 0) + " ms";
function setText(id, text) { document.getElementById(id).textContent = text; }
function row(t) {
  const tr = document.createElement("tr");
  const pct = t.ceiling ? Math.min(100, 100 * t.blocks / t.ceiling) : 0;
  for (const v of [t.name, t.priority, t.blocks + " / " + t.ceiling]) {
    const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
  }
  const td = document.createElement("td"); td.style.width = "30%";
  td.innerHTML = '<div class="bar"><div style="width:' + pct.toFixed(1) + '%"></div></div>';
  tr.appendChild(td);
  for (const v of [t.running, t.waiting]) {
    const c = document.createElement("td"); c.textContent = v; tr.appendChild(c);
  }
  tr.dataset.tenant = t.name;
  return tr;
}
function cell(tr, text, tag) {
  const c = document.createElement(tag || "td"); c.textContent = text; tr.appendChild(c);
}
function sloBlock(name, s) {
  // One model: its knobs (now / configured), each group's targets against the last window,
  // and the latest moves.
  const div = document.createElement("div");
  const knobs = Object.entries(s.knobs).map(([k, v]) => k + " " + v[0] + " / " + v[1]);
  const held = Array.isArray(s.held) ? s.held.join(", ") || "none" : s.held;
  const head = document.createElement("div"); head.className = "muted";
  head.textContent = name + ": " + knobs.join(", ") + "; held: " + held;
  const table = document.createElement("table");
  const top = document.createElement("tr");
  for (const h of ["group", "metric", "target", "last window"]) cell(top, h, "th");
  table.appendChild(top);
  for (const [group, metrics] of Object.entries(s.groups)) {
    for (const [metric, v] of Object.entries(metrics)) {
      const tr = document.createElement("tr");
      cell(tr, group); cell(tr, metric); cell(tr, ms(v.target)); cell(tr, ms(v.observed));
      if (v.observed != null && v.observed > v.target) tr.style.color = "#c0392b";
      tr.dataset.group = group; table.appendChild(tr);
    }
  }
  const moves = document.createElement("div"); moves.className = "muted";
  moves.textContent = s.recent.map(a => a.direction + " " + a.ago_s + " s ago: " + a.reason)
    .join(" | ") || "no adjustment yet";
  div.append(head, table, moves);
  return div;
}
async function refresh() {
  try {
    // A metrics or admin key in the page's fragment (/dashboard#key=...; never sent to the
    // server, so never in a log) shows the tenants' rows.
    const key = new URLSearchParams(location.hash.slice(1)).get("key");
    const headers = key ? {authorization: "Bearer " + key} : {};
    const d = await (await fetch("dashboard/data", {cache: "no-store", headers})).json();
    setText("model", d.model);
    setText("status", d.ready ? "ready" : "loading");
    document.getElementById("status").className = d.ready ? "muted" : "down";
    if (!d.ready) return;
    setText("running", d.running); setText("waiting", d.waiting);
    setText("kv-usage", (100 * d.kv.usage).toFixed(1) + "%");
    document.getElementById("kv-bar").style.width = (100 * d.kv.usage) + "%";
    setText("kv-blocks", d.kv.used + " used, " + d.kv.cached + " cached, " + d.kv.free +
      " free of " + d.kv.blocks + " blocks");
    history.push(d.kv.usage); if (history.length > 120) history.shift();
    document.getElementById("spark-line").setAttribute("points",
      history.map((u, i) => (i * 2) + "," + (38 - 36 * u).toFixed(1)).join(" "));
    const l = d.latency;
    setText("ttft", ms(l.ttft_p50) + " / " + ms(l.ttft_p99));
    setText("itl", ms(l.itl_p50) + " / " + ms(l.itl_p99));
    setText("e2e", ms(l.e2e_p50));
    setText("toks", l.generation_tok_s.toFixed(1));
    const body = document.getElementById("tenants");
    body.replaceChildren(...d.tenants.map(row));
    const slo = Object.entries(d.slo || {});
    document.getElementById("slo-card").hidden = !slo.length;
    document.getElementById("slo").replaceChildren(...slo.map(([name, s]) => sloBlock(name, s)));
    document.body.dataset.updated = String(Date.now());
  } catch (e) {
    setText("status", "unreachable"); document.getElementById("status").className = "down";
  }
}
// ?refresh=MS sets the polling period (default one second).
const period = Math.max(100, Number(new URLSearchParams(location.search).get("refresh")) || 1000);
refresh(); setInterval(refresh, period);
</script></body></html>
"""
