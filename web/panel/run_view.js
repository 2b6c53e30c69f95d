// Device Control panel: the last run's profile as a section of DOM (a summary line, a legend, the chart, the line
// that names what the pointer is on, and the export buttons). The sidebar tab and the bottom panel tab each mount
// one. Text goes in with textContent only. No ComfyUI imports: the entry file passes the exports in.

import { button, element, legendEntry } from "./dom.js";
import { seconds } from "./format.js";
import { riseText } from "./badges.js";
import { RunChart, deviceColor, profileDevices, ranNodes } from "./run_chart.js";

/** "prompt 1a2b3c4d · success · 12.3 s · 9 nodes ran, 2 cached · heaviest: KSampler (8), +3.40 GiB on gpu:0" (what
 * the node raised memory by; a figure known only as a lower bound reads "≥ +3.40 GiB"). */
export function runSummary(profile, decimal) {
  const ran = ranNodes(profile).length;
  const cached = (profile.nodes ?? []).filter((n) => n.status === "cached").length;
  const parts = [
    `prompt ${String(profile.prompt_id).slice(0, 8)}`,
    profile.status,
    seconds(profile.wall),
    `${ran} node${ran === 1 ? "" : "s"} ran, ${cached} cached`,
  ];
  const heaviest = profile.heaviest && profile.nodes.find((n) => n.node === profile.heaviest.node);
  if (heaviest) {
    const device = profile.heaviest.device;
    parts.push(`heaviest: ${heaviest.title} (${heaviest.node}), ${riseText(heaviest, device, decimal)} on ${device}`);
  } else if (ran) {
    parts.push("no node raised memory more than every other");
  }
  return parts.join(" · ");
}

export class RunView {
  /** `exports`: {json(profile), markdown(profile), png(profile)}; `height`: the chart's CSS height. */
  constructor(exports, height) {
    this.exports = exports;
    this.height = height;
    this.chart = new RunChart();
    this.profile = null;
    this.message = "no run recorded yet: queue a prompt";
    this.decimal = false;
    this.root = null;
  }

  /** Build the section in `container` (once; a container that has it keeps it). */
  mount(container) {
    this.root = container.querySelector(".dc-run") ?? this.build(container);
    this.canvas = this.root.querySelector("canvas.dc-run-chart");
    this.resize?.disconnect();
    this.resize = new ResizeObserver(() => this.draw());
    this.resize.observe(this.root);
    this.draw();
  }

  build(container) {
    const root = element("div", "dc-run");
    const head = element("div", "dc-section-title", "Last run: memory per device and node");
    Object.assign(head.style, { fontWeight: "600", margin: "10px 0 4px" });
    this.summary = element("div", "dc-run-summary");
    this.legend = element("div", "dc-run-legend");
    Object.assign(this.legend.style, { display: "flex", flexWrap: "wrap", gap: "2px 10px", margin: "2px 0" });
    const canvas = element("canvas", "dc-run-chart");
    Object.assign(canvas.style, { display: "block", width: "100%", height: `${this.height}px` });
    canvas.addEventListener("mousemove", (event) => {
      this.hovered.textContent = this.chart.hit(event.offsetX, event.offsetY, this.decimal);
    });
    this.hovered = element("div", "dc-run-hover", "");
    Object.assign(this.hovered.style, { minHeight: "14px", opacity: "0.85" });
    const exports = element("div", "dc-run-exports");
    const ready = (then) => () => this.profile && then();
    exports.append(
      button("Export JSON", "dc-export-json", ready(() => this.exports.json(this.profile)), "Download the profile"),
      button("Export markdown", "dc-export-markdown", ready(() => this.exports.markdown(this.profile)), "A table for bug reports"),
      button("Export PNG", "dc-export-png", ready(() => this.exports.png(this.profile)), "Download the chart"),
    );
    root.append(head, this.summary, this.legend, canvas, this.hovered, exports);
    container.append(root);
    return root;
  }

  unmount() {
    this.resize?.disconnect();
    this.root = null;
  }

  /** Show `profile` (or, with none, `message`: why there is none). */
  show(profile, message, decimal) {
    this.profile = profile;
    this.message = message ?? this.message;
    this.decimal = decimal;
    this.draw();
  }

  draw() {
    if (!this.root || !this.root.isConnected) return;
    const summary = this.root.querySelector(".dc-run-summary");
    summary.textContent = this.profile ? runSummary(this.profile, this.decimal) : this.message;
    const width = Math.max(160, this.canvas.clientWidth || 300);
    this.chart.draw(this.canvas, this.profile, width, this.height, { decimal: this.decimal });
    const layout = this.chart.layout;
    this.canvas.dataset.prompt = this.profile?.prompt_id ?? "";
    this.canvas.dataset.layout = JSON.stringify(layout.labels);
    this.canvas.dataset.bands = JSON.stringify(layout.bands.map((b) => [b.node, b.x0, b.x1]));
    this.canvas.dataset.events = JSON.stringify(layout.events.map((e) => e.x));
    this.root.querySelectorAll(".dc-export-json, .dc-export-markdown, .dc-export-png").forEach((b) => {
      b.disabled = !this.profile;
    });
    const legend = this.root.querySelector(".dc-run-legend");
    legend.replaceChildren();
    for (const id of this.profile ? profileDevices(this.profile) : []) {
      const name = id === "cpu" ? "cpu (RAM of this process)" : id;
      legend.append(legendEntry("dc-run-legend", deviceColor(this.profile, id), name));
    }
  }
}
