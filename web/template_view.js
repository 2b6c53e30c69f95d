// Device Control: a template of the pack opens at its start, at a zoom where the frontend draws node text.
//
// The frontends from 1.45 fit a template to the window when it opens. A graph of a dozen nodes in a row then opens
// at about 30 %, where the frontend draws bare boxes (its text goes below 8 px, 0.57 of its size, on a screen of
// device pixel ratio 1): a new user sees nothing to read. Our templates carry the view they open at (extra.ds: the
// graph's top left at 75 %) and a mark (tools/templates/make_workflows.py); when the frontend's own view of a marked graph
// draws no text, the graph takes its stored view instead. A saved copy keeps the mark and stores the user's view,
// which is the view the frontend itself restores for a saved workflow: a view that draws text is never changed.
import { app } from "../../scripts/app.js";

const TEMPLATE_MARK = "device_control_template";
const NODE_TEXT_PX = 14; // LiteGraph's node text size
const LOD_SETTING = "LiteGraph.Canvas.MinFontSizeForLOD"; // the frontend's "font size threshold": 8 px unless set

/** Whether the canvas, at its scale now, draws node text: the frontend draws bare boxes where its text would be
 * smaller than the threshold on screen (none where the threshold is 0, or where the frontend has no such setting). */
function drawsText(canvas) {
  const least = app.extensionManager?.setting?.get?.(LOD_SETTING);
  if (typeof least !== "number" || least <= 0) return true;
  return canvas.ds.scale * NODE_TEXT_PX * Math.sqrt(window.devicePixelRatio || 1) >= least;
}

/** Open the graph shown at its stored view, where the frontend's view draws no text. */
function openReadable() {
  const canvas = app.canvas;
  const stored = app.graph?.extra?.ds;
  if (!canvas?.ds || !stored || !(stored.scale > canvas.ds.scale) || drawsText(canvas)) return;
  canvas.ds.scale = stored.scale;
  canvas.ds.offset[0] = stored.offset[0];
  canvas.ds.offset[1] = stored.offset[1];
  canvas.setDirty(true, true);
}

app.registerExtension({
  name: "DeviceControl.TemplateView",
  async afterConfigureGraph() {
    if (!app.graph?.extra?.[TEMPLATE_MARK]) return;
    // The frontend sets its view while it loads the graph, or at the next frame where the canvas had no size yet.
    requestAnimationFrame(() => requestAnimationFrame(openReadable));
  },
});
