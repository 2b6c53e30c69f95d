// Device Control: shows the text our nodes report (VRAM Report, Load Checkpoint With Device, Move To GPU,
// Offload To CPU) on the canvas.
// Documented extension APIs only (registerExtension, onExecuted, addDOMWidget); no ComfyUI DOM is touched.
import { app } from "../../scripts/app.js";

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
