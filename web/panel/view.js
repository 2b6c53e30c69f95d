// Device Control panel: the DOM of the sidebar tab. Text goes in with textContent only (never parsed as HTML),
// so model names from files cannot inject markup. No ComfyUI imports: the entry file passes callbacks in.

import { button, element, legendEntry } from "./dom.js";
import { clock, formatBytes, percent } from "./format.js";

const ROOT_CLASS = "device-control-panel";
const TIMELINE_HEIGHT = 120;
const BUSY_REASON = "Not while a prompt runs: models are not moved under it. Wait for it to finish, or cancel it.";
const UNITS_NOTE = {
  binary: "Sizes in GiB (2^30 bytes), as budgets count: a budget of 8GB is 8 GiB.",
  decimal: "Sizes in GB (10^9 bytes); budgets count 8GB as 8 GiB (8.59 GB).",
};

/** "busy 40% · 65 °C", or why there is no such figure (the backend cannot tell: CPU, the simulated GPU, ...). */
export function gaugesText(device) {
  const parts = [];
  if (device.utilization !== null && device.utilization !== undefined) parts.push(`busy ${device.utilization}%`);
  if (device.temperature !== null && device.temperature !== undefined) parts.push(`${device.temperature} °C`);
  return parts.length ? parts.join(" · ") : "utilisation and temperature: not reported";
}

/** The colours of a split model's parts in its bar, one per device in the order the split fills them. */
const PART_COLORS = ["#2196f3", "#9c27b0", "#00bcd4", "#795548"];

/** The devices other than the CPU that hold some of ``model``, in the order the report lists them. */
function devicesHolding(model) {
  return Object.entries(model.resident).filter(([id, size]) => id !== "cpu" && size > 0);
}

function bar(segments) {
  const outer = element("div", "dc-bar");
  Object.assign(outer.style, {
    display: "flex",
    height: "10px",
    borderRadius: "3px",
    overflow: "hidden",
    background: "rgba(128,128,128,0.25)",
    margin: "2px 0",
  });
  for (const [className, share, color] of segments) {
    const part = element("div", className);
    Object.assign(part.style, { width: `${Math.max(0, Math.min(100, share * 100))}%`, background: color });
    part.dataset.share = share.toFixed(4);
    outer.append(part);
  }
  return outer;
}

function section(title) {
  const wrapper = element("div", "dc-section");
  const head = element("div", "dc-section-title", title);
  Object.assign(head.style, { fontWeight: "600", margin: "10px 0 4px" });
  wrapper.append(head);
  return wrapper;
}

/** The figures of one device row: what this process holds, what others hold, what is free. */
export function deviceFigures(device, host) {
  if (device.kind === "cpu") {
    const total = host.total;
    const own = host.process_rss;
    const free = host.available;
    return { total, own, others: Math.max(0, total - free - own), free };
  }
  const own = device.torch_reserved ?? device.torch_allocated ?? 0;
  return { total: device.total, own, others: device.used_by_others ?? 0, free: device.free };
}

function pinnedBytes(pinned) {
  return (pinned?.comfyui ?? 0) + (pinned?.device_control ?? 0);
}

export class PanelView {
  constructor(actions) {
    this.actions = actions; // {offload(key, name), offloadAll(), freeCaches(), copy(), refresh()}
    this.root = null;
  }

  mount(container) {
    const existing = container.querySelector(`.${ROOT_CLASS}`);
    if (existing) {
      this.root = existing;
      this.runSlot = existing.querySelector(".dc-run-slot");
      return;
    }
    const root = element("div", ROOT_CLASS);
    Object.assign(root.style, { padding: "8px 10px", fontSize: "12px", overflowY: "auto", height: "100%" });
    root.append(element("div", "dc-title", "Device Control"));
    root.firstChild.style.fontWeight = "700";
    root.firstChild.style.fontSize = "14px";
    this.status = element("div", "dc-status", "waiting for the first update...");
    this.status.style.opacity = "0.8";
    this.devices = section("Devices");
    this.units = element("div", "dc-units");
    this.units.style.opacity = "0.7";
    this.models = section("Models");
    const timelineSection = section("Used memory per device (share of its total), with node starts");
    this.legend = element("div", "dc-legend");
    Object.assign(this.legend.style, { display: "flex", flexWrap: "wrap", gap: "2px 10px", margin: "0 0 2px" });
    this.canvas = element("canvas", "dc-timeline");
    Object.assign(this.canvas.style, { display: "block", width: "100%", height: `${TIMELINE_HEIGHT}px` });
    this.canvas.addEventListener("mousemove", (event) => this.hover(event));
    this.hovered = element("div", "dc-timeline-node", "");
    Object.assign(this.hovered.style, { minHeight: "14px", opacity: "0.85" });
    timelineSection.append(this.legend, this.canvas, this.hovered);
    const actions = section("Actions");
    this.moves = [
      button("Offload all", "dc-offload-all", () => this.actions.offloadAll(), "Move every model back to RAM"),
      button("Free caches", "dc-free-caches", () => this.actions.freeCaches(), "Give cached allocator memory back"),
    ];
    actions.append(
      ...this.moves,
      button("Copy memory report", "dc-copy", () => this.actions.copy(), "Copy a report for bug reports"),
      button("Refresh", "dc-refresh", () => this.actions.refresh(), "Update now"),
    );
    this.notes = element("div", "dc-notes");
    this.notes.style.opacity = "0.8";
    this.runSlot = element("div", "dc-run-slot"); // the last run's chart (run_profile.js mounts it)
    root.append(this.status, this.devices, this.units, this.models, timelineSection, this.runSlot, actions, this.notes);
    container.append(root);
    this.root = root;
  }

  unmount() {
    this.root = null;
  }

  /** Show a snapshot (and the timeline so far). */
  update(snapshot, timeline, options) {
    if (!this.root || !snapshot) return;
    const { decimal, wanted, interval, running, nodeName } = options;
    this.running = running;
    const bytes = (value) => formatBytes(value, decimal);
    const report = snapshot.report;
    const node = snapshot.executing?.node;
    const doing = running ? ` · running ${node === null || node === undefined ? "a prompt" : nodeName(node)}` : "";
    const every = interval > 0 ? `every ${interval} s` : "updates off";
    this.status.textContent = `updated ${clock(snapshot.time)} · ${every}${doing}`;
    this.units.textContent = UNITS_NOTE[decimal ? "decimal" : "binary"];

    this.devices.replaceChildren(this.devices.firstChild);
    for (const device of report.devices) {
      if (!device.id || (wanted && !wanted.has(device.id))) continue;
      const row = element("div", "dc-device");
      row.dataset.device = device.id;
      const label = element("div", "dc-device-name", `${device.id} · ${device.name}`);
      if (device.error || device.total === null) {
        row.append(label, element("div", "dc-device-text", device.error ?? "memory not reported by this backend"));
      } else {
        const f = deviceFigures(device, report.host);
        row.dataset.own = String(f.own);
        row.dataset.total = String(f.total);
        const pinned = device.kind === "cpu" ? pinnedBytes(snapshot.pinned) : 0;
        const text =
          `${bytes(f.own)} ComfyUI · ${bytes(f.others)} others · ${bytes(f.free)} free of ${bytes(f.total)}` +
          (pinned ? ` · ${bytes(pinned)} pinned` : "") +
          (pinned && snapshot.pinned?.cap ? ` (one cap for ComfyUI's and ours: ${bytes(snapshot.pinned.cap)})` : "");
        row.append(
          label,
          bar([
            ["dc-own", f.own / f.total, "#4caf50"],
            ["dc-others", f.others / f.total, "#ff9800"],
          ]),
          element("div", "dc-device-text", text),
        );
      }
      const gauges = element("div", "dc-gauges", gaugesText(device));
      gauges.dataset.utilization = String(device.utilization ?? "");
      gauges.dataset.temperature = String(device.temperature ?? "");
      gauges.style.opacity = "0.8";
      row.append(gauges);
      row.style.marginBottom = "6px";
      this.devices.append(row);
    }

    this.models.replaceChildren(this.models.firstChild);
    if (!report.models.length) this.models.append(element("div", "dc-empty", "no model is loaded"));
    for (const model of report.models) {
      const row = element("div", "dc-model");
      row.dataset.key = model.key;
      const onDevice = model.resident[model.compute_device] ?? 0;
      row.dataset.resident = String(onDevice);
      const where = Object.entries(model.resident)
        .filter(([, size]) => size > 0)
        .map(([id, size]) => `${bytes(size)} on ${id}`)
        .join(", ");
      const flags = [model.partial ? "partial" : "full", model.dtype, model.kept ? "kept resident" : null]
        .concat(model.budget ? [`budget ${model.budget}`] : [])
        .filter(Boolean)
        .join(", ");
      const head = element("div", "dc-model-name", `${model.component} ${model.name}, ${bytes(model.total_bytes)}`);
      head.style.fontWeight = "600";
      const parts = devicesHolding(model);
      row.dataset.parts = JSON.stringify(Object.fromEntries(parts));
      const line = element("div", "dc-model-text", `${where || "nothing resident"} [${flags}]`);
      const controls = element("div", "dc-model-actions");
      const shares = parts.length > 1 ? parts : [[model.compute_device, onDevice]];
      const shareText = shares.map(([id, size]) => `${percent(size, model.total_bytes)} on ${id}`).join(", ");
      controls.append(
        element("span", "dc-model-share", `${parts.length > 1 ? "split: " : ""}${shareText} `),
        this.move(button("Offload", "dc-offload", () => this.actions.offload(model.key, model.name), "Move it back to RAM")),
      );
      const segments = shares.map(([id, size], i) => [
        i ? "dc-resident-part" : "dc-resident",
        model.total_bytes ? size / model.total_bytes : 0,
        PART_COLORS[i % PART_COLORS.length],
      ]);
      segments.forEach((segment, i) => (segment[0] += ` dc-on-${shares[i][0].replace(":", "-")}`));
      row.append(head, bar(segments), line);
      if (model.note) row.append(element("div", "dc-model-note", model.note));
      row.append(controls);
      row.style.marginBottom = "8px";
      this.models.append(row);
    }

    for (const action of this.moves) this.allow(action, !running);

    const mode = report.mode;
    const modeText = mode ? [`ComfyUI memory mode ${mode.vram_state}: ${mode.description}`, `dynamic VRAM ${mode.dynamic_vram}`] : [];
    this.notes.textContent = modeText.concat(report.notes || []).join(" · ");
    this.timeline = timeline;
    this.canvas.dataset.markers = String(timeline.markers.length);
    this.canvas.dataset.samples = String(timeline.samples.length);
    timeline.draw(this.canvas, snapshot.time, Math.max(160, this.canvas.clientWidth || 300), TIMELINE_HEIGHT);
    this.canvas.dataset.layout = JSON.stringify(timeline.layout.labels);
    this.canvas.dataset.markerPositions = JSON.stringify(timeline.layout.markers.map((m) => m.x));
    this.renderLegend(timeline);
  }

  /** A button that moves models, disabled (with the reason as its tooltip) while a prompt runs. */
  move(action) {
    action.dataset.title = action.title;
    this.allow(action, !this.running);
    return action;
  }

  allow(action, allowed) {
    action.dataset.title ??= action.title;
    action.disabled = !allowed;
    action.title = allowed ? action.dataset.title : BUSY_REASON;
    action.style.cursor = allowed ? "pointer" : "not-allowed";
    action.style.opacity = allowed ? "1" : "0.5";
  }

  /** One entry per device line: a swatch in its color and its name (text, so it never overlaps the chart); the
   * host's line is its RAM. */
  renderLegend(timeline) {
    this.legend.replaceChildren();
    for (const id of timeline.devices()) {
      this.legend.append(legendEntry("dc-legend", timeline.colorOf(id), id === "cpu" ? "RAM" : id));
    }
  }

  /** The node a marker stands for, under the chart, when the pointer is on it. */
  hover(event) {
    const found = this.timeline?.nearestMarker(event.offsetX);
    this.hovered.textContent = found ? `node started: ${found.label}` : "";
  }
}
