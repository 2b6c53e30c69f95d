// Device Control: shows the text our nodes report (VRAM Report, Load Checkpoint With Device, Move To GPU,
// Offload To CPU) on the canvas, and the live panel (a sidebar tab) with memory per device and model.
// Documented extension APIs only (registerExtension with settings, onExecuted, addDOMWidget, the sidebar tab,
// api events and fetchApi); no ComfyUI DOM is touched, so removing the pack leaves the frontend as it was.
import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";
import { formatBytes } from "./panel/format.js";
import { memoryReport } from "./panel/report.js";
import { Timeline } from "./panel/timeline.js";
import { PanelView } from "./panel/view.js";
import { mountRunView, setDecimal } from "./run_profile.js";

const TEXT_NODES = new Set([
  "DeviceControl_VRAMReport",
  "DeviceControl_LoadCheckpoint",
  "DeviceControl_MoveToGPU",
  "DeviceControl_OffloadToCPU",
]);
const WIDGET_NAME = "report_text";

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
    whiteSpace: "pre",
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
      reportWidget(this).element.value = text;
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

function badgeFor(snapshot) {
  const shares = snapshot.report.devices
    .filter((d) => d.kind !== "cpu" && d.total && !d.error)
    .map((d) => (d.total - d.free) / d.total);
  return shares.length ? `${Math.round(100 * Math.max(...shares))}%` : "";
}

// The tab's icon badge is read once by the sidebar unless the tab record changes through the workspace store
// (a function badge is not re-evaluated). So the badge is set on our own tab's record there; where a frontend
// does not expose the store, the meter is simply not shown.
function showBadge(text) {
  const tabs = app.extensionManager?.sidebarTab?.sidebarTabs;
  const ours = Array.isArray(tabs) ? tabs.find((tab) => tab.id === TAB_ID) : null;
  if (ours && ours.iconBadge !== text) ours.iconBadge = text;
}

function render() {
  const decimal = String(setting(SETTINGS.units, "binary (GiB)")).startsWith("decimal");
  setDecimal(decimal); // the last run's chart and badges use the same units
  if (!panel.latest) return;
  showBadge(setting(SETTINGS.meter, true) ? badgeFor(panel.latest) : "");
  if (!panel.open || !panel.view) return;
  const devices = String(setting(SETTINGS.devices, "all")).trim();
  const wanted = devices && devices.toLowerCase() !== "all" ? new Set(devices.split(",").map((d) => d.trim())) : null;
  panel.view.update(panel.latest, panel.timeline, { decimal, wanted, interval: wantedInterval() });
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
      name: "Units",
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
    api.addEventListener("status", onStatus);
    api.addEventListener("reconnected", onStatus);
    app.extensionManager.registerSidebarTab({
      id: TAB_ID,
      icon: "pi pi-microchip",
      title: "Device Control",
      tooltip: "Device Control: memory per device and model, live",
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
