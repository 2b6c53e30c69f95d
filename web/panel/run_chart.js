// Device Control panel: the last run's memory profile on a canvas. One line per device through each node's memory
// before and after it, with its peak as a short dashed bar over its span; the nodes' spans as bands, named on hover;
// model events (loaded, partially loaded, moved, streamed, offloaded, evicted) as markers along the top. Pure module, no ComfyUI imports: it draws on a
// canvas it is given, with the axes' text in margins of its own so no label sits on another, and keeps in `layout`
// what it drew where (CSS pixels), for hover and for the tests that check the geometry.

import { formatBytes, seconds } from "./format.js";
import { COLORS, drawLabel } from "./timeline.js";

const FONT = "10px sans-serif";
const MARGIN = { left: 60, right: 10, top: 14, bottom: 16 };
const LEGEND_ROW = 16; // below the time axis, in exported images (on screen the legend is text beside the chart)
const CPU_COLOR = "#9e9e9e";
const EVENT_COLORS = {
  loaded: "#4caf50",
  "partially loaded": "#aed581",
  moved: "#ab47bc",
  streamed: "#29b6f6",
  offloaded: "#90a4ae",
  evicted: "#ef5350",
};
const BAND_FILLS = ["rgba(128,128,128,0.10)", "rgba(128,128,128,0.20)"];
const HEAVIEST_FILL = "rgba(255,152,0,0.22)";

/** The nodes of a profile that ran (executed or failed), in the order they started. */
export function ranNodes(profile) {
  return (profile?.nodes ?? []).filter((n) => n.status === "executed" || n.status === "failed");
}

/** A node's peak on device `id` for people: "3.20 GiB", or "≥ 3.20 GiB" where the profile knows only that much
 * (no new high was set during the node, and the peak counters are kept: DEVICE_CONTROL_PEAKS). */
export function peakText(node, id, decimal) {
  const bounded = (node.peak_bounded ?? []).includes(id);
  return `${bounded ? "≥ " : ""}${formatBytes(node.peak?.[id], decimal)}`;
}

/** The devices a profile measured: accelerators in name order, then the CPU. */
export function profileDevices(profile) {
  const ids = new Set();
  for (const node of ranNodes(profile)) for (const id of Object.keys(node.before ?? {})) ids.add(id);
  return [...ids].sort((a, b) => (a === "cpu") - (b === "cpu") || a.localeCompare(b));
}

/** The color of a device's line (the live chart's colors for accelerators, grey for RAM). */
export function deviceColor(profile, id) {
  if (id === "cpu") return CPU_COLOR;
  const accelerators = profileDevices(profile).filter((d) => d !== "cpu");
  return COLORS[Math.max(0, accelerators.indexOf(id)) % COLORS.length];
}

const ROUND_STEPS = [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10];

/** The smallest round size at or above `bytes` in its own unit (3.4 GiB -> 4 GiB, 700 MiB -> 800 MiB), so the
 * axis reads "2.00 GiB", "4.00 GiB" rather than odd figures. `base` is 1024 or 1000, as the units shown. */
export function roundCeiling(bytes, base = 1024) {
  if (!(bytes > 0)) return 1;
  let unit = 1;
  while (bytes >= unit * base) unit *= base;
  const value = bytes / unit;
  const decade = 10 ** Math.floor(Math.log10(value));
  const round = ROUND_STEPS.find((step) => step * decade >= value) * decade * unit;
  return Math.min(round, unit * base); // 1023.9 MiB rounds to 1 GiB, not to 1500 MiB
}

/** The highest byte count the chart shows: a round size with a little headroom above the highest figure. */
function ceiling(profile, devices, decimal) {
  let top = 0;
  for (const node of ranNodes(profile)) {
    for (const figures of [node.before, node.after, node.peak]) {
      for (const id of devices) top = Math.max(top, figures?.[id] ?? 0);
    }
  }
  return roundCeiling(top * 1.04, decimal ? 1000 : 1024);
}

export class RunChart {
  constructor() {
    this.profile = null;
    this.layout = { labels: [], bands: [], events: [], plot: null };
  }

  /**
   * Draw `profile` on `canvas` at the given CSS size (sharp on high-density screens). Options: `decimal` units,
   * `background` (a fill; none on screen), `legend` (draw the device names below the axis, for exported images).
   */
  draw(canvas, profile, cssWidth, cssHeight, options = {}) {
    const ratio = options.ratio ?? (globalThis.devicePixelRatio || 1);
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, cssWidth, cssHeight);
    if (options.background) {
      ctx.fillStyle = options.background;
      ctx.fillRect(0, 0, cssWidth, cssHeight);
    }
    ctx.font = FONT;
    const bottom = MARGIN.bottom + (options.legend ? LEGEND_ROW : 0);
    const plot = {
      left: MARGIN.left,
      top: MARGIN.top,
      width: Math.max(20, cssWidth - MARGIN.left - MARGIN.right),
      height: Math.max(20, cssHeight - MARGIN.top - bottom),
    };
    this.profile = profile;
    this.layout = { labels: [], bands: [], events: [], plot };
    if (!profile) return;
    const devices = profileDevices(profile);
    const span = Math.max(profile.wall || 0, ...ranNodes(profile).map((n) => n.start + n.wall), 0.001);
    const top = ceiling(profile, devices, options.decimal);
    const x = (t) => plot.left + (Math.max(0, t) / span) * plot.width;
    const y = (bytes) => plot.top + plot.height - (bytes / top) * plot.height;
    this.drawBands(ctx, plot, x);
    this.drawAxes(ctx, plot, span, top, y, options.decimal);
    for (const id of devices) this.drawDevice(ctx, id, x, y);
    this.drawEvents(ctx, plot, x);
    if (options.legend) this.drawLegend(ctx, plot, devices);
  }

  /** A band over each node's span (the heaviest node's in orange), remembered for hover. */
  drawBands(ctx, plot, x) {
    const heaviest = this.profile.heaviest?.node;
    ranNodes(this.profile).forEach((node, i) => {
      const x0 = x(node.start);
      const x1 = Math.max(x0 + 1, x(node.start + node.wall));
      ctx.fillStyle = node.node === heaviest ? HEAVIEST_FILL : BAND_FILLS[i % 2];
      ctx.fillRect(x0, plot.top, x1 - x0, plot.height);
      this.layout.bands.push({ x0, x1, node: node.node, title: node.title, heaviest: node.node === heaviest });
    });
  }

  /** Bytes on the left (0, half and the top), seconds of the run below (its start, middle and end). */
  drawAxes(ctx, plot, span, top, y, decimal) {
    ctx.strokeStyle = "rgba(128,128,128,0.35)";
    ctx.fillStyle = "rgba(170,170,170,0.95)";
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    for (const share of [0, 0.5, 1]) {
      const at = Math.round(y(share * top)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(plot.left, at);
      ctx.lineTo(plot.left + plot.width, at);
      ctx.stroke();
      this.text(ctx, share ? formatBytes(share * top, decimal) : "0", plot.left - 4, at, "right");
    }
    ctx.textBaseline = "top";
    const below = plot.top + plot.height + 3;
    this.text(ctx, "0 s", plot.left, below, "left");
    this.text(ctx, seconds(span / 2), plot.left + plot.width / 2, below, "center");
    this.text(ctx, seconds(span), plot.left + plot.width, below, "right");
  }

  /** One device: a line through each node's memory before and after it, and its peak as a dashed bar. */
  drawDevice(ctx, id, x, y) {
    const nodes = ranNodes(this.profile).filter((n) => id in (n.before ?? {}));
    ctx.strokeStyle = deviceColor(this.profile, id);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    nodes.forEach((node, i) => {
      const start = [x(node.start), y(node.before[id])];
      if (i) ctx.lineTo(...start);
      else ctx.moveTo(...start);
      if (id in (node.after ?? {})) ctx.lineTo(x(node.start + node.wall), y(node.after[id]));
    });
    ctx.stroke();
    ctx.lineWidth = 1;
    ctx.setLineDash([3, 2]);
    for (const node of nodes) {
      if (!(id in (node.peak ?? {}))) continue;
      const at = Math.round(y(node.peak[id])) + 0.5;
      ctx.beginPath();
      ctx.moveTo(x(node.start), at);
      ctx.lineTo(Math.max(x(node.start) + 2, x(node.start + node.wall)), at);
      ctx.stroke();
    }
    ctx.setLineDash([]);
  }

  /** A small triangle along the top for each model event, at the end of the node it happened in. */
  drawEvents(ctx, plot, x) {
    for (const node of ranNodes(this.profile)) {
      for (const event of node.events ?? []) {
        const at = Math.round(x(event.at)) + 0.5;
        ctx.fillStyle = EVENT_COLORS[event.kind] ?? "#ffc107";
        ctx.beginPath();
        ctx.moveTo(at - 4, plot.top - 11);
        ctx.lineTo(at + 4, plot.top - 11);
        ctx.lineTo(at, plot.top - 3);
        ctx.closePath();
        ctx.fill();
        this.layout.events.push({ x: at, kind: event.kind, model: event.model, bytes: event.bytes, node: node.title });
      }
    }
  }

  /** The device names below the time axis (exported images only), each after a swatch of its line's color. */
  drawLegend(ctx, plot, devices) {
    let at = plot.left;
    const row = plot.top + plot.height + MARGIN.bottom + 3;
    for (const id of devices) {
      ctx.fillStyle = deviceColor(this.profile, id);
      ctx.fillRect(at, row + 4, 12, 3);
      ctx.fillStyle = "rgba(170,170,170,0.95)";
      this.text(ctx, id, at + 16, row, "left");
      at += 16 + ctx.measureText(id).width + 14;
    }
  }

  /** Write a label and remember its box (CSS pixels). */
  text(ctx, label, at, top, align) {
    drawLabel(ctx, this.layout.labels, label, at, top, align);
  }

  /** What the pointer at (x, y) CSS pixels points at: a model event near the top, else the node whose band it is in. */
  hit(x, y, decimal) {
    const plot = this.layout.plot;
    if (!plot || !this.profile) return "";
    if (y < plot.top) {
      const near = this.layout.events.filter((e) => Math.abs(e.x - x) <= 5);
      if (near.length) {
        return near.map((e) => `${e.model} ${e.kind} (${formatBytes(e.bytes, decimal)}) during ${e.node}`).join("; ");
      }
    }
    const band = this.layout.bands.find((b) => x >= b.x0 && x <= b.x1);
    if (!band) return "";
    const node = ranNodes(this.profile).find((n) => n.node === band.node);
    const peaks = Object.keys(node.peak ?? {})
      .map((id) => `${peakText(node, id, decimal)} on ${id}`)
      .join(", ");
    const heaviest = band.heaviest ? ", the heaviest node" : "";
    return `${node.title} (#${node.node}, ${node.status}${heaviest}): ${seconds(node.wall)}; peak ${peaks || "n/a"}`;
  }
}
