// Device Control: the profile's badges under Nodes 2.0 (the frontend's Vue nodes, setting Comfy.VueNodes.Enabled).
// There nodes are DOM elements over the canvas, so a badge drawn on the canvas is hidden under any node that lies
// above its own (nodes closer than a badge's height). The badges are then also DOM elements, in the frontend's
// transform pane (which moves and scales with the graph, in graph coordinates), above the nodes.

import { badgeFill } from "./badges.js";

const VUE_NODES_SETTING = "Comfy.VueNodes.Enabled";
const PANE = '[data-testid="transform-pane"]';
const FONT = "11px sans-serif";

let layer = null;

/** Whether the frontend draws its nodes as Vue nodes (false on frontends without the setting). */
export function vueNodesOn(app) {
  try {
    return app.extensionManager?.setting?.get?.(VUE_NODES_SETTING) === true;
  } catch {
    return false; // a frontend that does not know the setting
  }
}

function badgeElement(item) {
  const element = document.createElement("div");
  element.className = "dc-badge";
  element.textContent = item.text;
  Object.assign(element.style, {
    position: "absolute",
    left: `${item.x}px`,
    top: `${item.y}px`,
    width: `${item.width}px`,
    height: `${item.height}px`,
    lineHeight: `${item.height}px`,
    font: FONT,
    color: "#ffffff",
    background: item.fill,
    borderRadius: "4px",
    paddingLeft: "5px",
    boxSizing: "border-box",
    whiteSpace: "nowrap",
    overflow: "hidden",
  });
  return element;
}

/** Show `items` ({text, fill, x, y, width, height} in graph coordinates) above the Vue nodes; none clears them. */
export function showDomBadges(items) {
  const pane = document.querySelector(PANE);
  if (!pane || !items.length) {
    layer?.replaceChildren();
    return;
  }
  if (!layer || layer.parentElement !== pane) {
    layer?.remove();
    layer = document.createElement("div");
    layer.className = "dc-badges";
    Object.assign(layer.style, { position: "absolute", left: "0", top: "0", zIndex: "9999", pointerEvents: "none" });
    pane.appendChild(layer);
  }
  layer.replaceChildren(...items.map(badgeElement));
}
