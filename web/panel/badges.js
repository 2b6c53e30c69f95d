// Device Control: after a run, a badge above each node that ran, with what it did: its own peak above the level
// its device was at when it started ("+3.20 GiB"), the device it computed on ("gpu:0", or "CPU" where it changed no
// accelerator's books), and its time. The node that raised memory most, alone, is orange and marked (none on a tie).
// A figure the profile knows only as a lower bound (listed in the node's `peak_bounded`) reads "≥"; a node that
// raised nothing and freed memory reads what it freed ("−3.20 GiB"). A node of ours
// that decides placement and came from ComfyUI's cache has a badge that says so.
// Pure module: it computes the badges from a profile and draws one on a canvas context it is given, in the node's
// own coordinates; `drawn` keeps what was last drawn per node (graph coordinates), for the tests' geometry checks.

import { formatBytes, seconds } from "./format.js";
import { ranNodes } from "./run_chart.js";

const FONT = "11px sans-serif";
const HEIGHT = 16;
const GAP = 4;
const FILLS = { normal: "rgba(40,40,40,0.88)", heaviest: "rgba(230,120,0,0.95)", failed: "rgba(170,30,30,0.92)" };

/** What was last drawn, by node id: {text, x, y, width, height} in graph coordinates. */
export const drawn = new Map();

/** How a badge names a device: "CPU" for the host, the device's id otherwise. */
export function deviceName(id) {
  return id === "cpu" ? "CPU" : id;
}

/** Less than this freed reads as no change (allocator rounding, a small temporary). On the CPU (the process's
 * resident set, which falls and rises with the host's own housekeeping) a node's badge reads its rise only. */
const FREED_AT_LEAST = 1024 * 1024;

/** What a node did to memory on `device`: what it raised it by ("+3.20 GiB", "≥ +1.20 GiB" where its peak is only a
 * lower bound, "+0 B"), or, where it raised nothing and ended lower than it started, what it freed ("−3.20 GiB": an
 * Offload To CPU, which used to read "≥ +0 B"). A bound of nothing says nothing, so "+0 B" has no "≥". */
export function riseText(node, device, decimal) {
  const rise = node.rise?.[device] ?? 0;
  const change = (node.after?.[device] ?? 0) - (node.before?.[device] ?? 0);
  if (device !== "cpu" && rise <= 0 && -change >= FREED_AT_LEAST) return `\u2212${formatBytes(-change, decimal)}`;
  const bounded = rise > 0 && (node.peak_bounded ?? []).includes(device);
  return `${bounded ? "≥ " : ""}+${formatBytes(rise, decimal)}`;
}

/** Our nodes that decide where models are: answered from ComfyUI's cache, their badge says so (their text says
 * where the models are now). */
const PLACING = new Set([
  "DeviceControl_LoadCheckpoint",
  "DeviceControl_LoadDiffusionModel",
  "DeviceControl_LoadTextEncoders",
  "DeviceControl_LoadVAE",
  "DeviceControl_LoadControlNet",
  "DeviceControl_LoadCLIPVision",
  "DeviceControl_LoadModelPatch",
  "DeviceControl_MoveToGPU",
  "DeviceControl_SplitModel",
]);
const CACHED_TEXT = "cached: did not run";

/** The badges of a profile, by node id: {text, node, classType, device, rise, bounded, wall, status, heaviest}. */
export function nodeBadges(profile, decimal) {
  const badges = new Map();
  if (!profile) return badges;
  for (const node of profile.nodes ?? []) {
    if (node.status !== "cached" || !PLACING.has(node.class_type)) continue;
    badges.set(String(node.node), {
      text: CACHED_TEXT,
      node: String(node.node),
      classType: node.class_type,
      device: null,
      rise: null,
      bounded: false,
      wall: 0,
      status: "cached",
      heaviest: false,
    });
  }
  for (const node of ranNodes(profile)) {
    const device = node.device || null;
    const heaviest = profile.heaviest?.node === node.node;
    const memory = device === null ? "" : `${riseText(node, device, decimal)} ${deviceName(device)} · `;
    const status = node.status === "failed" ? "failed · " : "";
    const text = `${heaviest ? "▲ " : ""}${status}${memory}${seconds(node.wall)}`;
    badges.set(String(node.node), {
      text,
      node: String(node.node),
      classType: node.class_type,
      device,
      rise: device === null ? null : node.rise?.[device] ?? 0,
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
