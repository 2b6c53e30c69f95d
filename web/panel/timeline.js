// Device Control panel: used memory per device over the last minutes, with markers where nodes started.
// Pure module: it keeps samples and draws them on a canvas it is given.

const COLORS = ["#4caf50", "#2196f3", "#ff9800", "#e91e63", "#9c27b0", "#00bcd4"];

export class Timeline {
  constructor(seconds = 300) {
    this.seconds = seconds;
    this.samples = []; // {t, used: {deviceId: bytes}, total: {deviceId: bytes}}
    this.markers = []; // {t, label}
  }

  /** Record the devices of one snapshot at time t (seconds; accelerators only: RAM is shown in the bars). */
  add(snapshot, t) {
    const used = {};
    const total = {};
    for (const device of snapshot.report.devices) {
      if (device.kind === "cpu" || device.total === null || device.error) continue;
      used[device.id] = device.total - device.free;
      total[device.id] = device.total;
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
    return [...ids].sort();
  }

  /** Seconds the drawing spans: from the first sample (at least a minute) up to the kept window. */
  span(now) {
    const first = this.samples.length ? this.samples[0].t : now;
    return Math.min(this.seconds, Math.max(60, now - first));
  }

  /** Draw on a canvas: one line per device (share of its total), markers as vertical lines. */
  draw(canvas, now) {
    const ctx = canvas.getContext("2d");
    const width = canvas.width;
    const height = canvas.height;
    const span = this.span(now);
    ctx.clearRect(0, 0, width, height);
    ctx.strokeStyle = "rgba(128,128,128,0.4)";
    ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
    const x = (t) => width - ((now - t) / span) * width;
    const y = (share) => height - 4 - share * (height - 8);
    ctx.font = "10px sans-serif";
    ctx.fillStyle = "rgba(160,160,160,0.9)";
    ctx.strokeStyle = "rgba(255,193,7,0.7)";
    let labelledUpTo = -Infinity; // labels that would overlap the previous one are left out (the line stays)
    for (const marker of this.markers) {
      const at = Math.round(x(marker.t)) + 0.5;
      if (at < 0) continue;
      ctx.beginPath();
      ctx.moveTo(at, 0);
      ctx.lineTo(at, height);
      ctx.stroke();
      const textWidth = ctx.measureText(marker.label).width;
      const left = Math.min(at + 2, width - textWidth - 2);
      if (left > labelledUpTo) {
        ctx.fillText(marker.label, left, 10);
        labelledUpTo = left + textWidth + 4;
      }
    }
    ctx.fillText(`${Math.round(span)} s`, width - 30, height - 6);
    this.devices().forEach((id, index) => {
      ctx.strokeStyle = COLORS[index % COLORS.length];
      ctx.lineWidth = 1.5;
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
      ctx.fillStyle = COLORS[index % COLORS.length];
      ctx.fillText(id, 4, height - 6 - index * 12);
    });
    ctx.lineWidth = 1;
  }

  /** The samples and markers, for the copied report. */
  toJSON() {
    return { seconds: this.seconds, samples: this.samples, markers: this.markers };
  }
}
