// Device Control: after a run, a badge above each node that ran, with its peak memory and its time; the heaviest
// node's badge is orange and marked. The peak is the highest on an accelerator (RAM where the run used none); a peak
// the profile knows only as a lower bound (listed in the node's `peak_bounded`) reads "≥".
// Pure module: it computes the badges from a profile and draws one on a canvas context it is given, in the node's
// own coordinates; `drawn` keeps what was last drawn per node (graph coordinates), for the tests' geometry checks.

import { seconds } from "./format.js";
import { peakText, profileDevices, ranNodes } from "./run_chart.js";

const FONT = "11px sans-serif";
const HEIGHT = 16;
const GAP = 4;
const FILLS = { normal: "rgba(40,40,40,0.88)", heaviest: "rgba(230,120,0,0.95)", failed: "rgba(170,30,30,0.92)" };

/** What was last drawn, by node id: {text, x, y, width, height} in graph coordinates. */
export const drawn = new Map();

/** The device a node's badge names: its highest peak on an accelerator, or RAM when the run used none. */
function peakOf(node, accelerators) {
  const candidates = Object.entries(node.peak ?? {}).filter(([id]) => (accelerators ? id !== "cpu" : id === "cpu"));
  return candidates.reduce((best, entry) => (best === null || entry[1] > best[1] ? entry : best), null);
}

/** The badges of a profile, by node id: {text, node, classType, device, peak, bounded, wall, status, heaviest}. */
export function nodeBadges(profile, decimal) {
  const badges = new Map();
  if (!profile) return badges;
  const accelerators = profileDevices(profile).some((id) => id !== "cpu");
  for (const node of ranNodes(profile)) {
    const [device, peak] = peakOf(node, accelerators) ?? peakOf(node, false) ?? [null, null];
    const heaviest = profile.heaviest?.node === node.node;
    const memory = device === null ? "" : `${peakText(node, device, decimal)} ${device === "cpu" ? "RAM" : device} · `;
    const status = node.status === "failed" ? "failed · " : "";
    const text = `${heaviest ? "▲ " : ""}${status}${memory}${seconds(node.wall)}`;
    badges.set(String(node.node), {
      text,
      node: String(node.node),
      classType: node.class_type,
      device,
      peak,
      bounded: (node.peak_bounded ?? []).includes(device),
      wall: node.wall,
      status: node.status,
      heaviest,
    });
  }
  return badges;
}

/** The colour of a badge: orange for the heaviest node, red for a failed one. */
export function badgeFill(badge) {
  return badge.heaviest ? FILLS.heaviest : badge.status === "failed" ? FILLS.failed : FILLS.normal;
}

/** Draw `badge` above the title bar of `node` (the context is at the node's top left, below its title). */
export function drawBadge(ctx, node, badge, titleHeight) {
  ctx.save();
  ctx.font = FONT;
  const width = Math.ceil(ctx.measureText(badge.text).width) + 10;
  const y = -titleHeight - HEIGHT - GAP;
  ctx.fillStyle = badgeFill(badge);
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(0, y, width, HEIGHT, 4);
  else ctx.rect(0, y, width, HEIGHT);
  ctx.fill();
  ctx.fillStyle = "#ffffff";
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  ctx.fillText(badge.text, 5, y + HEIGHT / 2 + 0.5);
  ctx.restore();
  drawn.set(badge.node, { text: badge.text, x: node.pos[0], y: node.pos[1] + y, width, height: HEIGHT });
}
