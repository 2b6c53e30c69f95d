// Device Control: two things the editor must show without the server log.
// 1. Warnings the server pushes as `device_control.warning` when a prompt is queued ({node, title, text, severity}):
//    a device this machine does not have (a workflow from another machine; the node falls back to auto), an Offload
//    To CPU wired after nothing; and, as errors, the values our nodes refused (the prompt was not queued). Each is a
//    toast naming the node.
// 2. Typed passthroughs: Move To GPU's (and Split Model's) model output is declared with every type its input takes
//    ("MODEL,CLIP,VAE"), so that what ComfyUI lists and the node's Info show reads the same on every ComfyUI; in the
//    editor the output takes the type of what is connected to the input (a CLIP in, a CLIP out), so a moved CLIP
//    cannot be wired into a KSampler's model input. Links that no longer fit are dropped when the input changes.
//    Our passthroughs of any type (trigger, a VRAM Report's value) follow their input the same way.
// Documented extension APIs only: registerExtension (beforeRegisterNodeDef, loadedGraphNode), api events, toasts.
import { api } from "../../../scripts/api.js";
import { app } from "../../../scripts/app.js";

export const WARNING_EVENT = "device_control.warning";
const TOAST_LIFE_MS = 15000;
/** Our nodes' outputs that follow an input: node id -> [[input name, output index], ...]. The passthroughs
 * (trigger, a report's value) follow too, so a type is known through them (loader -> VRAM Report -> Move To GPU). */
const FOLLOWERS = {
  DeviceControl_MoveToGPU: [
    ["model", 0],
    ["trigger", 1],
  ],
  DeviceControl_SplitModel: [
    ["model", 0],
    ["trigger", 1],
  ],
  DeviceControl_OffloadToCPU: [["trigger", 0]],
  DeviceControl_VRAMReport: [["value", 0]],
};
const ANY = "*";
/** The type each following output declares (what it is with nothing, or anything, connected): "node id/index". */
const declared = new Map();

function linkById(graph, id) {
  if (!graph || id == null) return null;
  return graph.getLink?.(id) ?? graph.links?.get?.(id) ?? graph.links?.[id] ?? null;
}

function nodeById(graph, id) {
  return graph?.getNodeById?.(id) ?? graph?.getNodeById?.(Number(id)) ?? null;
}

/** The type of what is connected to `node`'s input `name`, or null when nothing (or anything) is. */
function connectedType(node, name) {
  const input = node.inputs?.find((slot) => slot.name === name);
  const link = linkById(node.graph, input?.link);
  if (!link) return null;
  const origin = nodeById(node.graph, link.origin_id);
  const type = origin?.outputs?.[link.origin_slot]?.type ?? link.type ?? null;
  return type === ANY ? null : type;
}

/** Give each following output of `node` the type connected to its input (its declared type with none), drop the
 * links that no longer fit, and pass the new type on along those that do (to a follower downstream). */
function follow(node, seen = new Set()) {
  const kind = node.comfyClass ?? node.type;
  const rules = FOLLOWERS[kind];
  if (!rules || !node.graph || seen.has(node)) return;
  seen.add(node);
  for (const [inputName, index] of rules) {
    const output = node.outputs?.[index];
    if (!output) continue;
    const type = connectedType(node, inputName) ?? declared.get(`${kind}/${index}`) ?? output.type;
    output.type = type;
    for (const id of [...(output.links ?? [])]) {
      const link = linkById(node.graph, id);
      const target = link && nodeById(node.graph, link.target_id);
      // By the link's id, not its slot number: a frontend may reorder a loaded node's inputs before its links.
      const slot = target?.inputs?.findIndex((input) => input.link === id) ?? -1;
      if (slot < 0) continue;
      if (!window.LiteGraph.isValidConnection(type, target.inputs[slot].type)) {
        target.disconnectInput(slot);
      } else {
        link.type = type;
        follow(target, seen);
      }
    }
  }
  node.setDirtyCanvas?.(true, true);
}

function toast(detail) {
  const node = detail.node != null ? nodeById(app.graph, detail.node) : null;
  const name = node?.title || detail.title || "Device Control";
  const where = detail.node != null ? ` #${detail.node}` : "";
  app.extensionManager?.toast?.add?.({
    severity: detail.severity === "error" ? "error" : "warn",
    summary: `${name}${where}`,
    detail: detail.text,
    life: TOAST_LIFE_MS,
  });
}

app.registerExtension({
  name: "DeviceControl.DeviceWarnings",
  setup() {
    api.addEventListener(WARNING_EVENT, ({ detail }) => toast(detail ?? {}));
  },
  beforeRegisterNodeDef(nodeType, nodeData) {
    const rules = FOLLOWERS[nodeData.name];
    if (!rules) return;
    for (const [, index] of rules) declared.set(`${nodeData.name}/${index}`, nodeData.output?.[index]);
    const followed = new Set(rules.map(([name]) => name));
    const previous = nodeType.prototype.onConnectionsChange;
    nodeType.prototype.onConnectionsChange = function (side, slot, connected, linkInfo, inputInfo) {
      const answer = previous?.apply(this, arguments);
      // While a workflow loads, links are half made (loadedGraphNode types the outputs once it is whole).
      if (app.configuringGraph) return answer;
      if (side === window.LiteGraph.INPUT && followed.has(this.inputs?.[slot]?.name)) follow(this);
      return answer;
    };
  },
  loadedGraphNode(node) {
    follow(node); // a saved workflow: its outputs' types as saved (by any version), its links as they were
  },
});
