// Device Control panel: used memory per device over the last minutes, with markers where nodes started.
// Pure module: it keeps samples and draws them on a canvas it is given, with axes in margins of their own
// (share of each device on the left, seconds before now below) so no text sits on another. Each device is a
// line, the host's RAM a dashed one (a move to the GPU is a fall there and a rise here). Markers are named at the
// top of the chart where a name lies on no other, the newest first; every marker's node is named on hover
// (nearestMarker).

export const COLORS = ["#4caf50", "#2196f3", "#ff9800", "#e91e63", "#9c27b0", "#00bcd4"];
const FONT = "10px sans-serif";
const LABEL_HEIGHT = 10;
const MARGIN = { left: 34, right: 8, top: 6, bottom: 16 };
const HOST = "cpu"; // the host's RAM: its line is dashed and listed last
const MARKER_LABEL_CHARS = 18; // a marker's name on the chart is cut to this many characters (hover shows it whole)

/**
 * Write a label on a chart and add its box (CSS pixels) to `labels`, so that hover and the tests know where text
 * is. Shared by this chart and the run chart.
 */
export function drawLabel(ctx, labels, label, at, top, align) {
  ctx.textAlign = align;
  ctx.fillText(label, at, top);
  const width = ctx.measureText(label).width;
  const left = align === "right" ? at - width : align === "center" ? at - width / 2 : at;
  const y0 = ctx.textBaseline === "middle" ? top - LABEL_HEIGHT / 2 : top;
  labels.push({ text: label, x: left, y: y0, width, height: LABEL_HEIGHT });
}

/** A marker's name as the chart writes it: the node's title without its id, cut to a few words. */
function shortName(label) {
  const title = String(label ?? "").replace(/^#\S+\s*/, "");
  return title.length <= MARKER_LABEL_CHARS ? title : `${title.slice(0, MARKER_LABEL_CHARS - 1).trimEnd()}…`;
}

export class Timeline {
  constructor(seconds = 300) {
    this.seconds = seconds;
    this.samples = []; // {t, used: {deviceId: bytes}, total: {deviceId: bytes}}
    this.markers = []; // {t, label}
    this.layout = { labels: [], plot: null }; // what the last drawing put where (CSS pixels), for hover and tests
  }

  /** Record the devices of one snapshot at time t (seconds): each accelerator's used share, and the host's RAM
   * (all that is not available, as the panel's CPU row counts it). */
  add(snapshot, t) {
    const used = {};
    const total = {};
    for (const device of snapshot.report.devices) {
      if (device.kind === "cpu" || device.total === null || device.error) continue;
      used[device.id] = device.total - device.free;
      total[device.id] = device.total;
    }
    const host = snapshot.report.host;
    if (host?.total > 0 && typeof host.available === "number") {
      used[HOST] = host.total - host.available;
      total[HOST] = host.total;
    }
    this.samples.push({ t, used, total });
    this.trim(t);
  }

  /** A node started at time t (seconds). */
  mark(t, label) {
    this.markers.push({ t, label });
    this.trim(t);
  }

  trim(now) {
    const oldest = now - this.seconds;
    while (this.samples.length && this.samples[0].t < oldest) this.samples.shift();
    while (this.markers.length && this.markers[0].t < oldest) this.markers.shift();
  }

  devices() {
    const ids = new Set();
    for (const sample of this.samples) for (const id of Object.keys(sample.used)) ids.add(id);
    return [...ids].sort((a, b) => (a === HOST) - (b === HOST) || a.localeCompare(b));
  }

  /** The color each device's line is drawn in (the legend uses the same). */
  colorOf(id) {
    return COLORS[Math.max(0, this.devices().indexOf(id)) % COLORS.length];
  }

  /** Seconds the drawing spans: from the first sample (at least a minute) up to the kept window. */
  span(now) {
    const first = this.samples.length ? this.samples[0].t : now;
    return Math.min(this.seconds, Math.max(60, now - first));
  }

  /** Draw on a canvas of the given CSS size (sharp on high-density screens): axes, markers, one line per device. */
  draw(canvas, now, cssWidth, cssHeight) {
    const ratio = globalThis.devicePixelRatio || 1;
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, cssWidth, cssHeight);
    ctx.font = FONT;
    const plot = {
      left: MARGIN.left,
      top: MARGIN.top,
      width: Math.max(20, cssWidth - MARGIN.left - MARGIN.right),
      height: Math.max(20, cssHeight - MARGIN.top - MARGIN.bottom),
    };
    const span = this.span(now);
    const x = (t) => plot.left + plot.width - ((now - t) / span) * plot.width;
    const y = (share) => plot.top + plot.height - share * plot.height;
    this.layout = { labels: [], plot };
    this.drawAxes(ctx, plot, span, y);
    this.drawMarkers(ctx, plot, x);
    this.drawLines(ctx, x, y);
  }

  /** Grid lines at 0, 50 and 100 % with their labels on the left; seconds before now below. */
  drawAxes(ctx, plot, span, y) {
    ctx.strokeStyle = "rgba(128,128,128,0.35)";
    ctx.fillStyle = "rgba(170,170,170,0.95)";
    ctx.lineWidth = 1;
    ctx.textBaseline = "middle";
    for (const share of [0, 0.5, 1]) {
      const at = Math.round(y(share)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(plot.left, at);
      ctx.lineTo(plot.left + plot.width, at);
      ctx.stroke();
      this.text(ctx, `${share * 100}%`, plot.left - 4, at, "right");
    }
    ctx.textBaseline = "top";
    const below = plot.top + plot.height + 3;
    this.text(ctx, `-${Math.round(span)} s`, plot.left, below, "left");
    this.text(ctx, `-${Math.round(span / 2)} s`, plot.left + plot.width / 2, below, "center");
    this.text(ctx, "now", plot.left + plot.width, below, "right");
  }

  /** Write a label and remember its box (CSS pixels). */
  text(ctx, label, at, top, align) {
    drawLabel(ctx, this.layout.labels, label, at, top, align);
  }

  /** A vertical line where each node started, named at the top of the chart (its title cut to a few words; its
   * whole name shows on hover). The names go from the newest node back, each beside its marker (left of it where
   * the chart's edge is near) where it lies on no name already written: the node running now is always named. */
  drawMarkers(ctx, plot, x) {
    ctx.strokeStyle = "rgba(255,193,7,0.7)";
    this.layout.markers = [];
    const visible = this.markers
      .map((marker) => ({ ...marker, x: Math.round(x(marker.t)) + 0.5 }))
      .filter((marker) => marker.x >= plot.left);
    for (const marker of visible) {
      ctx.beginPath();
      ctx.moveTo(marker.x, plot.top);
      ctx.lineTo(marker.x, plot.top + plot.height);
      ctx.stroke();
      this.layout.markers.push({ x: marker.x, label: marker.label });
    }
    ctx.fillStyle = "rgba(255,213,79,0.95)";
    ctx.textBaseline = "top";
    const taken = [];
    for (const marker of [...visible].reverse()) {
      const label = shortName(marker.label);
      if (!label) continue;
      const width = ctx.measureText(label).width;
      const right = marker.x + 2 + width <= plot.left + plot.width;
      const from = right ? marker.x + 2 : marker.x - 2 - width;
      if (from < plot.left || taken.some(([a, b]) => from < b + 4 && a < from + width + 4)) continue;
      taken.push([from, from + width]);
      this.text(ctx, label, from, plot.top + 1, "left");
    }
  }

  drawLines(ctx, x, y) {
    ctx.lineWidth = 1.5;
    for (const id of this.devices()) {
      ctx.strokeStyle = this.colorOf(id);
      ctx.setLineDash(id === HOST ? [4, 3] : []);
      ctx.beginPath();
      let started = false;
      for (const sample of this.samples) {
        if (!(id in sample.used)) continue;
        const px = x(sample.t);
        const py = y(sample.used[id] / sample.total[id]);
        if (started) ctx.lineTo(px, py);
        else ctx.moveTo(px, py);
        started = true;
      }
      ctx.stroke();
    }
    ctx.setLineDash([]);
    ctx.lineWidth = 1;
  }

  /** The node whose marker is nearest to x (CSS pixels from the canvas's left), within a few pixels. */
  nearestMarker(x) {
    let best = null;
    for (const marker of this.layout.markers || []) {
      const distance = Math.abs(marker.x - x);
      if (distance <= 4 && (best === null || distance < best.distance)) best = { ...marker, distance };
    }
    return best;
  }

  /** The samples and markers, for the copied report. */
  toJSON() {
    return { seconds: this.seconds, samples: this.samples, markers: this.markers };
  }
}
