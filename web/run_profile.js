// Device Control: the memory profile of the last run in the frontend — a badge above each node that ran (what it
// raised memory by, on which device, and its time; the heaviest marked; a setting hides them; only on the workflow
// the run was recorded on), and a chart of the run with exports, in the sidebar
// tab (mounted by device_control.js) and in a bottom panel tab. Fed by the server's "device_control.profile" push
// and, when the page opens, by GET /device_control/profile. Documented extension APIs only.
import { api } from "../../scripts/api.js";
import { app } from "../../scripts/app.js";
import { badgeFill, drawBadge, drawn, nodeBadges } from "./panel/badges.js";
import { profileExports } from "./panel/exports.js";
import { RunView } from "./panel/run_view.js";
import { showDomBadges, vueNodesOn } from "./panel/vue_badges.js";

const BADGES_SETTING = "DeviceControl.Profile.Badges";
const PUSH_EVENT = "device_control.profile";
const BOTTOM_TAB_ID = "device-control-run";
const SIDEBAR_HEIGHT = 150;
const BOTTOM_HEIGHT = 220;

const state = {
  profile: null,
  message: "no run recorded yet: queue a prompt",
  badges: new Map(),
  decimal: false,
  showBadges: null, // the setting as its onChange last saw it (null: ask the store)
  views: [],
  runs: 0, // runs started or ended since the page opened
};

function badgesShown() {
  const value = state.showBadges ?? app.extensionManager?.setting?.get?.(BADGES_SETTING);
  return value !== false;
}

function toast(detail) {
  app.extensionManager?.toast?.add?.({ severity: "error", summary: "Device Control", detail, life: 6000 });
}

async function fetchText(path) {
  const response = await api.fetchApi(path);
  const text = await response.text();
  if (!response.ok) throw new Error(JSON.parse(text || "{}").error || `${response.status} ${response.statusText}`);
  return text;
}

const exports = profileExports(fetchText, () => state.decimal, (error) => toast(`Export failed: ${error.message}`));

function redraw() {
  for (const view of state.views) view.show(state.profile, state.message, state.decimal);
  app.graph?.setDirtyCanvas?.(true, true);
}

function showProfile(profile) {
  state.profile = profile;
  state.badges = nodeBadges(profile, state.decimal);
  redraw();
}

/** The units the panel's setting asks for (device_control.js calls this at every render). */
export function setDecimal(decimal) {
  if (decimal === state.decimal) return;
  state.decimal = decimal;
  state.badges = nodeBadges(state.profile, decimal);
  redraw();
}

/** A run chart with exports in `container` (the sidebar tab's slot, or the bottom panel tab). */
export function mountRunView(container, height = SIDEBAR_HEIGHT) {
  let view = state.views.find((v) => v.root && container.contains(v.root));
  if (!view) {
    view = new RunView(exports, height);
    state.views.push(view);
  }
  view.mount(container);
  view.show(state.profile, state.message, state.decimal);
  return view;
}

export function unmountRunView(view) {
  view.unmount();
  state.views = state.views.filter((v) => v !== view);
}

async function loadLatest() {
  const asked = state.runs; // a run that starts or ends while this request is out is newer than its answer
  try {
    const response = await api.fetchApi("/device_control/profile");
    const data = await response.json();
    if (state.runs !== asked) return;
    if (response.ok) showProfile(data);
    else {
      state.message = data.error ?? state.message;
      redraw();
    }
  } catch {
    // The server is restarting: the next run's push brings a profile.
  }
}

/** Whether the graph shown is the workflow the profile was recorded on: the prompt carries the id of the workflow
 * it was queued from (the graph's id); a profile or a graph without one falls back to the node ids and classes. */
function profileOfThisGraph() {
  const shown = (app.rootGraph ?? app.graph)?.id;
  const recorded = state.profile?.workflow;
  return !recorded || !shown || String(shown) === String(recorded);
}

/** Draw the badges of the nodes in view, after every node and link, so none is hidden under another node (the
 * canvas's foreground hook, in graph coordinates). A node whose id now holds another class gets none, nor does any
 * node of another workflow than the one the profile was recorded on. */
function drawNodeBadges(ctx, canvas) {
  const onTop = [];
  if (state.badges.size && badgesShown() && profileOfThisGraph()) {
    const titleHeight = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
    for (const node of canvas.visible_nodes ?? []) {
      const badge = state.badges.get(String(node.id));
      if (!badge || (badge.classType && badge.classType !== (node.comfyClass ?? node.type))) continue;
      ctx.save();
      ctx.translate(node.pos[0], node.pos[1]);
      drawBadge(ctx, node, badge, titleHeight);
      ctx.restore();
      onTop.push({ ...drawn.get(badge.node), fill: badgeFill(badge) });
    }
  }
  // Under Nodes 2.0 the nodes are DOM elements over the canvas: the same badges, as DOM elements above them.
  showDomBadges(vueNodesOn(app) ? onTop : []);
}

let bottomView = null;

app.registerExtension({
  name: "DeviceControl.RunProfile",
  settings: [
    {
      id: BADGES_SETTING,
      category: ["Device Control", "Profile", "Badges"],
      name: "After a run, show above each node what it raised memory by, on which device, and its time",
      type: "boolean",
      defaultValue: true,
      onChange: (value) => {
        state.showBadges = value !== false;
        if (!state.showBadges) drawn.clear();
        app.graph?.setDirtyCanvas?.(true, true);
      },
    },
  ],
  bottomPanelTabs: [
    {
      id: BOTTOM_TAB_ID,
      title: "Device Control: last run",
      type: "custom",
      render: (container) => {
        bottomView = mountRunView(container, BOTTOM_HEIGHT);
        bottomView.root.classList.add("dc-run-wide");
        bottomView.root.style.padding = "0 12px";
      },
      destroy: () => bottomView && unmountRunView(bottomView),
    },
  ],
  async setup() {
    const onDrawForeground = app.canvas.onDrawForeground;
    app.canvas.onDrawForeground = function (ctx) {
      onDrawForeground?.apply(this, arguments);
      drawNodeBadges(ctx, this);
    };
    api.addEventListener(PUSH_EVENT, (event) => {
      state.runs += 1;
      showProfile(event.detail);
    });
    api.addEventListener("execution_start", () => {
      state.runs += 1;
      state.badges = new Map(); // a new run: the last one's figures would be read as this one's
      drawn.clear();
      app.graph?.setDirtyCanvas?.(true, true);
    });
    void loadLatest(); // the frontend's setup does not wait on a slow server
  },
});
