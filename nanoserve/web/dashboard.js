// The dashboard view: polls the server's dashboard data once a second while it is shown.

import { apiFetch } from "./api.js";

const STATS_URL = "dashboard/stats";
const POLL_MS = 1000;

const $ = (id) => document.getElementById(id);

export class Dashboard {
  /** notify: { error(error), clearError(), unauthorized(), model(name) } from the page. */
  constructor(notify) {
    this.notify = notify;
    this.timer = null;
    this.inFlight = false;
    this.active = false;
  }

  start() {
    this.active = true;
    if (this.timer === null && !this.inFlight) this.poll();
  }

  stop() {
    this.active = false;
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** One fetch of the stats (also used once at start-up, for the model name and the key check). */
  async fetch() {
    const stats = await (await apiFetch(STATS_URL, { cache: "no-store" })).json();
    this.notify.model(stats.model);
    return stats;
  }

  async poll() {
    this.timer = null;
    this.inFlight = true;
    try {
      this.render(await this.fetch());
      $("dash-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      if (error.status === 401) {
        this.notify.unauthorized(error);
        return; // polled again by start() once a key is given
      }
      $("dash-updated").textContent = `Not updated since the last answer: ${error.message}`;
    } finally {
      this.inFlight = false;
    }
    if (this.active) this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  render(stats) {
    const status = $("m-status");
    status.textContent = stats.status;
    status.dataset.state = stats.status;
    $("m-error").textContent = stats.error || "";
    $("m-running").textContent = stats.num_running;
    $("m-waiting").textContent = stats.num_waiting;
    $("m-kv").textContent = percent(stats.kv_cache_usage);
    $("m-prefix").textContent = percent(stats.prefix_cache_hit_rate);
    const tokens = stats.tokens;
    $("m-prompt-rate").textContent = rate(tokens.prompt_per_s);
    $("m-gen-rate").textContent = rate(tokens.generation_per_s);
    sparkline($("chart-prompt"), tokens.prompt, tokens.interval_s, "Prompt tokens per second");
    sparkline($("chart-generation"), tokens.generation, tokens.interval_s, "Generated tokens per second");
    fillTable(
      $("ranks-body"),
      stats.ranks.map((r) => [
        [String(r.rank)],
        [r.state, `state state-${r.state}`],
        [dash(r.num_running)],
        [dash(r.num_waiting)],
        [percent(r.kv_cache_usage)],
        [r.error || ""],
      ]),
    );
    fillTable(
      $("recent-body"),
      stats.recent_requests.map((r) => [
        [new Date(r.finished_at * 1000).toLocaleTimeString()],
        [r.request_id, "request-id"],
        [r.finish_reason],
        [String(r.num_prompt_tokens)],
        [String(r.num_generation_tokens)],
        [seconds(r.time_to_first_token)],
        [seconds(r.e2e_latency)],
      ]),
    );
    $("recent-empty").hidden = stats.recent_requests.length > 0;
  }
}

const dash = (value) => (value === null || value === undefined ? "–" : String(value));
const percent = (f) =>
  f === null || f === undefined ? "–" : f > 0 && f < 0.001 ? "<0.1%" : `${(100 * f).toFixed(1)}%`;
const rate = (r) => (r >= 100 ? r.toFixed(0) : r.toFixed(1));
const seconds = (s) => (s === null || s === undefined ? "–" : s < 1 ? `${(1000 * s).toFixed(0)} ms` : `${s.toFixed(2)} s`);

/** rows: [[text, className?], ...] per row. */
function fillTable(tbody, rows) {
  tbody.replaceChildren(
    ...rows.map((cells) => {
      const tr = document.createElement("tr");
      for (const [text, className] of cells) {
        const td = document.createElement("td");
        td.textContent = text;
        if (className) td.className = className;
        tr.append(td);
      }
      return tr;
    }),
  );
}

const SVG = "http://www.w3.org/2000/svg";

/** A line chart of per-interval counts, drawn as tokens per second, newest at the right. */
function sparkline(svg, counts, intervalS, what) {
  const width = 300;
  const height = 60;
  const values = counts.map((c) => c / intervalS);
  const peak = Math.max(1, ...values);
  const step = width / Math.max(1, values.length - 1);
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - (v / peak) * (height - 4)).toFixed(1)}`);
  const area = document.createElementNS(SVG, "polygon");
  area.setAttribute("points", `0,${height} ${points.join(" ")} ${width},${height}`);
  area.setAttribute("class", "area");
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.join(" "));
  line.setAttribute("class", "line");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren(area, line);
  const span = values.length * intervalS;
  const spanText = span >= 120 ? `last ${Math.round(span / 60)} minutes` : `last ${span} s`;
  const now = rate(values.at(-1) || 0);
  const peakText = rate(Math.max(0, ...values));
  svg.setAttribute("aria-label", `${what}, ${spanText}: now ${now}, peak ${peakText}`);
  const figure = svg.parentElement;
  figure.querySelector(".span").textContent = spanText;
  figure.querySelector(".peak").textContent = `now ${now}/s, peak ${peakText}/s`;
}
