// Device Control: shows the text our nodes report (VRAM Report, Load Checkpoint With Device, Move To GPU,
// Offload To CPU) on the canvas, and the live panel (a sidebar tab) with memory per device and model.
// Documented extension APIs only (registerExtension with settings, onExecuted, addDOMWidget, the sidebar tab,
// api events and fetchApi); no ComfyUI DOM is touched, so removing the pack leaves the frontend as it was.
import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";
import "./panel/device_warnings.js";
import "./template_view.js";
import { formatBytes } from "./panel/format.js";
import { memoryReport } from "./panel/report.js";
import { Timeline } from "./panel/timeline.js";
import { PanelView } from "./panel/view.js";
import { vueNodesOn } from "./panel/vue_badges.js";
import { mountRunView, setDecimal } from "./run_profile.js";

const TEXT_NODES = new Set([
  "DeviceControl_VRAMReport",
  "DeviceControl_LoadCheckpoint",
  "DeviceControl_MoveToGPU",
  "DeviceControl_OffloadToCPU",
]);
const WIDGET_NAME = "report_text";
// The frontend's own widget for a node's progress text (ComfyUI's PromptServer.send_progress_text), which it keeps
// until the next run: our loaders say there what they are doing; once the node ended its report says what it did.
const PROGRESS_WIDGET = "$$node-text-preview";
const REPORT_ROWS = { least: 3, most: 24 }; // the report box under Nodes 2.0, in lines of its text

function reportWidget(node) {
  const existing = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (existing) return existing;
  const area = document.createElement("textarea");
  area.readOnly = true;
  area.spellcheck = false;
  area.className = "device-control-report";
  area.placeholder = "The node's report appears here when it runs.";
  Object.assign(area.style, {
    fontFamily: "monospace",
    fontSize: "11px",
    // A report's table keeps its columns (it scrolls); a loader's or a move's sentences wrap at the node's edge.
    whiteSpace: (node.comfyClass ?? node.type) === "DeviceControl_VRAMReport" ? "pre" : "pre-wrap",
    overflowWrap: "anywhere",
    overflow: "auto",
    width: "100%",
    height: "100%",
    resize: "none",
    boxSizing: "border-box",
    background: "var(--comfy-input-bg)",
    color: "var(--input-text)",
  });
  const widget = node.addDOMWidget(WIDGET_NAME, "device_control_text", area, {
    serialize: false, // not sent to the server with the prompt
    getValue: () => area.value,
    setValue: (value) => {
      area.value = value ?? "";
    },
    getMinHeight: () => 180,
  });
  widget.serialize = false; // not saved in the workflow: the report belongs to a run, not to the graph
  return widget;
}

/** Under Nodes 2.0 a node is laid out by the DOM, where the box takes the height of its rows: as many as the report
 * has lines (a few at least, a screenful at most; the rest scrolls). On the canvas the widget's own height holds. */
function fitToText(area, text) {
  if (!vueNodesOn(app)) return;
  const lines = text.split("\n").length;
  area.rows = Math.max(REPORT_ROWS.least, Math.min(REPORT_ROWS.most, lines));
  area.style.height = "auto";
  area.style.minHeight = `${area.rows * 14 + 8}px`;
}

/** The node ended: its progress text ("Loading ...: the fit plan") is over, and its report takes its place. */
function endProgressText(node) {
  const index = node.widgets?.findIndex((w) => w.name === PROGRESS_WIDGET) ?? -1;
  if (index < 0) return;
  node.widgets[index].value = "";
}

app.registerExtension({
  name: "DeviceControl.NodeText",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODES.has(nodeData?.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      reportWidget(this);
      return result;
    };
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      const text = Array.isArray(output?.text) ? output.text.join("\n") : "";
      // A textarea's value is never parsed as HTML, so model names from files cannot inject markup.
      const area = reportWidget(this).element;
      area.value = text;
      fitToText(area, text);
      endProgressText(this);
      this.setDirtyCanvas?.(true, true);
    };
  },
});

// ---- The live panel: a sidebar tab fed by the server's "device_control.vram" push ----------------------------

const SETTINGS = {
  refresh: "DeviceControl.Panel.RefreshSeconds",
  devices: "DeviceControl.Panel.Devices",
  units: "DeviceControl.Panel.Units",
  meter: "DeviceControl.Panel.Meter",
};
const PUSH_EVENT = "device_control.vram";
const TAB_ID = "device-control";
// The sidebar shows a label under each icon (newer frontends; the tab's title where it has none), in the sidebar's
// narrow width: a short one. The tooltip names the pack, and the meter's device and share.
const TAB_LABEL = "Devices";
const TAB_TOOLTIP = "Device Control: memory per device and model, live";
const RENEW_MS = 4000; // the server's lease lasts at least 10 s: renew well before it ends
const METER_MIN_SECONDS = 5; // with the panel closed, the icon's meter updates at most this often

const panel = {
  latest: null,
  timeline: new Timeline(300),
  open: false,
  view: null,
  renewTimer: null,
  sentInterval: 0,
  sentClient: null,
  running: false, // a prompt runs (from the run's events; the snapshot's "executing" says so too)
};

// The settings' values as their onChange handlers last saw them (the store may not hold the new value yet
// while onChange runs).
const chosen = {};

function setting(id, fallback) {
  const value = id in chosen ? chosen[id] : app.extensionManager?.setting?.get?.(id);
  return value === undefined || value === null ? fallback : value;
}

function changed(id, then) {
  return (value) => {
    chosen[id] = value;
    then();
  };
}

function wantedInterval() {
  const refresh = Number(setting(SETTINGS.refresh, 1));
  if (!(refresh > 0)) return 0;
  if (panel.open) return refresh;
  return setting(SETTINGS.meter, true) ? Math.max(refresh, METER_MIN_SECONDS) : 0;
}

async function postJson(path, body) {
  const response = await api.fetchApi(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error || `${response.status} ${response.statusText}`);
  return data;
}

async function subscribe() {
  const interval = wantedInterval();
  if (interval === 0 && panel.sentInterval === 0) return;
  if (!api.clientId) return; // the socket has no id yet: its "status" message subscribes (see onStatus)
  try {
    await postJson("/device_control/subscribe", { interval, client: api.clientId });
    panel.sentInterval = interval;
    panel.sentClient = api.clientId;
  } catch {
    // The server is restarting or gone: the next renewal tries again.
  }
}

function resubscribe() {
  clearInterval(panel.renewTimer);
  panel.renewTimer = null;
  subscribe();
  if (wantedInterval() > 0) panel.renewTimer = setInterval(subscribe, RENEW_MS);
}

// The server pushes to one websocket client id. The socket gets its id with its first "status" message, and
// may get a new one when it reconnects: subscribe as soon as the id is known or changes, not at the next renewal.
function onStatus() {
  if (api.clientId && api.clientId !== panel.sentClient && wantedInterval() > 0) subscribe();
}

/** The icon's meter: the most used accelerator's share, and which device that is ({text, device}). */
function meterFor(snapshot) {
  let best = null;
  for (const d of snapshot.report.devices) {
    if (d.kind === "cpu" || !d.total || d.error) continue;
    const share = (d.total - d.free) / d.total;
    if (best === null || share > best.share) best = { share, device: d.id };
  }
  return best ? { text: `${Math.round(100 * best.share)}%`, device: best.device } : { text: "", device: null };
}

// The tab's icon badge is read once by the sidebar unless the tab record changes through the workspace store
// (a function badge is not re-evaluated). So the badge, and the tooltip that says which device it measures, are
// set on our own tab's record there; where a frontend does not expose the store, the meter is simply not shown.
function showBadge(meter) {
  const tabs = app.extensionManager?.sidebarTab?.sidebarTabs;
  const ours = Array.isArray(tabs) ? tabs.find((tab) => tab.id === TAB_ID) : null;
  if (!ours) return;
  const tooltip = meter.text ? `${TAB_TOOLTIP} · ${meter.device} ${meter.text} used` : TAB_TOOLTIP;
  if (ours.iconBadge !== meter.text) ours.iconBadge = meter.text;
  if (ours.tooltip !== tooltip) ours.tooltip = tooltip;
}

/** "KSampler (#8)": the node running now, by its title in the graph shown (its id where the graph lacks it). */
function nodeName(id) {
  const graph = app.rootGraph ?? app.graph;
  const node = graph?.getNodeById?.(id) ?? graph?.getNodeById?.(Number(id));
  return node?.title ? `${node.title} (#${id})` : `node #${id}`;
}

function render() {
  const decimal = String(setting(SETTINGS.units, "binary (GiB)")).startsWith("decimal");
  setDecimal(decimal); // the last run's chart and badges use the same units
  if (!panel.latest) return;
  showBadge(setting(SETTINGS.meter, true) ? meterFor(panel.latest) : { text: "", device: null });
  if (!panel.open || !panel.view) return;
  const devices = String(setting(SETTINGS.devices, "all")).trim();
  const wanted = devices && devices.toLowerCase() !== "all" ? new Set(devices.split(",").map((d) => d.trim())) : null;
  const running = panel.running || Boolean(panel.latest.executing);
  panel.view.update(panel.latest, panel.timeline, { decimal, wanted, interval: wantedInterval(), running, nodeName });
}

function runState(running) {
  panel.running = running;
  render();
}

function onSnapshot(snapshot) {
  panel.latest = snapshot;
  panel.timeline.add(snapshot, Date.now() / 1000);
  render();
}

function onExecuting(event) {
  const detail = event.detail;
  const id = detail && typeof detail === "object" ? detail.node ?? detail.display_node : detail;
  if (id === null || id === undefined) return;
  const title = app.graph?.getNodeById?.(Number(id))?.title ?? "";
  panel.timeline.mark(Date.now() / 1000, `#${id} ${title}`.trim());
  render();
}

function toast(severity, summary, detail) {
  app.extensionManager?.toast?.add?.({ severity, summary, detail, life: 6000 });
}

async function confirmed(message) {
  const dialog = app.extensionManager?.dialog;
  if (dialog?.confirm) return (await dialog.confirm({ title: "Device Control", message })) === true;
  return window.confirm(message);
}

async function refresh() {
  try {
    const response = await api.fetchApi("/device_control/snapshot");
    if (response.ok) onSnapshot(await response.json());
  } catch {
    // The panel keeps the last snapshot; the next push or refresh updates it.
  }
}

function freedText(result) {
  const parts = Object.entries(result.freed ?? {}).map(([device, bytes]) => `${formatBytes(bytes)} on ${device}`);
  return parts.length ? `freed ${parts.join(", ")}` : "nothing was on a device";
}

async function act(question, path, body, done) {
  if (!(await confirmed(question))) return;
  try {
    const result = await postJson(path, body);
    toast("success", "Device Control", done(result));
  } catch (error) {
    toast("error", "Device Control", error.message);
  }
  await refresh();
}

async function copyReport() {
  if (!panel.latest) await refresh();
  if (!panel.latest) return;
  const text = memoryReport(panel.latest, panel.timeline.toJSON(), window.__COMFYUI_FRONTEND_VERSION__);
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement("textarea"); // no clipboard API (a page served over plain http)
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  toast("success", "Device Control", "Memory report copied to the clipboard");
}

const actions = {
  offload: (key, name) =>
    act(`Move ${name} back to RAM now?`, "/device_control/offload", { model: key }, (r) => `${name}: ${freedText(r)}`),
  offloadAll: () =>
    act("Move every loaded model back to RAM now?", "/device_control/offload", { all: true }, freedText),
  freeCaches: () =>
    act("Give the memory the allocators keep cached back to the devices?", "/device_control/free_caches", {}, () =>
      "caches freed",
    ),
  copy: copyReport,
  refresh,
};

app.registerExtension({
  name: "DeviceControl.Panel",
  settings: [
    {
      id: SETTINGS.refresh,
      category: ["Device Control", "Panel", "Refresh"],
      name: "Panel refresh, in seconds (0 turns the updates off)",
      type: "number",
      defaultValue: 1,
      attrs: { min: 0, max: 60, step: 0.5 },
      onChange: changed(SETTINGS.refresh, resubscribe),
    },
    {
      id: SETTINGS.devices,
      category: ["Device Control", "Panel", "Devices"],
      name: "Devices shown: all, or a list such as gpu:0,cpu",
      type: "text",
      defaultValue: "all",
      onChange: changed(SETTINGS.devices, render),
    },
    {
      id: SETTINGS.units,
      category: ["Device Control", "Panel", "Units"],
      name: "Units: binary GiB (2^30 bytes; what budgets mean by GB too) or decimal GB (10^9 bytes)",
      tooltip: "Budgets and sizes typed into nodes read 8GB as 8 GiB (8 x 2^30 bytes); decimal shows 10^9-byte GB.",
      type: "combo",
      options: ["binary (GiB)", "decimal (GB)"],
      defaultValue: "binary (GiB)",
      onChange: changed(SETTINGS.units, render),
    },
    {
      id: SETTINGS.meter,
      category: ["Device Control", "Panel", "Meter"],
      name: "Show used VRAM on the panel's icon while the panel is closed (updates every 5 s)",
      type: "boolean",
      defaultValue: true,
      onChange: changed(SETTINGS.meter, () => {
        resubscribe();
        render();
      }),
    },
  ],
  async setup() {
    api.addEventListener(PUSH_EVENT, (event) => onSnapshot(event.detail));
    api.addEventListener("executing", onExecuting);
    api.addEventListener("execution_start", () => runState(true));
    for (const end of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(end, () => runState(false));
    }
    api.addEventListener("status", onStatus);
    api.addEventListener("reconnected", onStatus);
    app.extensionManager.registerSidebarTab({
      id: TAB_ID,
      icon: "pi pi-microchip",
      title: "Device Control",
      label: TAB_LABEL,
      tooltip: TAB_TOOLTIP,
      type: "custom",
      iconBadge: "",
      render: (container) => {
        panel.view = panel.view ?? new PanelView(actions);
        panel.view.mount(container);
        mountRunView(panel.view.runSlot);
        if (!panel.open) {
          panel.open = true;
          resubscribe();
          refresh();
        }
        render();
      },
      destroy: () => {
        panel.open = false;
        panel.view?.unmount();
        resubscribe();
      },
    });
    resubscribe();
  },
});
