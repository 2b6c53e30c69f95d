// Device Control panel: the "Copy memory report" text, for bug reports. Pure function.

import { formatBytes } from "./format.js";

/** A markdown report with the snapshot's facts and, at the end, the raw JSON (snapshot and timeline). */
export function memoryReport(snapshot, timeline, frontendVersion) {
  const report = snapshot.report;
  const lines = ["# Device Control memory report", "", `Taken ${new Date(snapshot.time * 1000).toISOString()}`, ""];
  const versions = { ...report.versions, frontend: frontendVersion ?? "unknown" };
  lines.push("## Versions", "", ...Object.entries(versions).map(([name, value]) => `- ${name}: ${value}`), "");
  lines.push("## Launch flags", "", (snapshot.flags ?? []).join(" ") || "(none)", "");
  if (report.mode) {
    const mode = report.mode;
    lines.push(
      "## ComfyUI memory mode",
      "",
      `- ${mode.vram_state}: ${mode.description}`,
      `- compute device ${mode.compute_device}; smart memory ${mode.smart_memory ? "on" : "off"}`,
      `- dynamic VRAM: ${mode.dynamic_vram}`,
      "",
    );
  }
  lines.push("## Devices", "", "| device | name | total | free | this process | others |", "| --- | --- | --- | --- | --- | --- |");
  for (const d of report.devices) {
    if (d.error) {
      lines.push(`| ${d.id || d.native} | ${d.name} | error: ${d.error} | | | |`);
      continue;
    }
    const own = d.kind === "cpu" ? report.host.process_rss : d.torch_reserved;
    lines.push(
      `| ${d.id} | ${d.name} | ${formatBytes(d.total)} | ${formatBytes(d.free)} | ${formatBytes(own)} | ${formatBytes(d.used_by_others)} |`,
    );
  }
  lines.push("", "## Models", "", "| model | size | resident | computes on | state | placement |", "| --- | --- | --- | --- | --- | --- |");
  for (const m of report.models) {
    const where = Object.entries(m.resident)
      .map(([id, size]) => `${formatBytes(size)} on ${id}`)
      .join(", ");
    const placement = [m.managed_by, m.budget ? `budget ${m.budget}` : "", m.kept ? "kept resident" : "", m.note ?? ""]
      .filter(Boolean)
      .join(", ");
    lines.push(
      `| ${m.component} ${m.name} | ${formatBytes(m.total_bytes)} | ${where} | ${m.compute_device} | ${m.partial ? "partial" : "full"}, ${m.dtype ?? "?"} | ${placement} |`,
    );
  }
  lines.push("", "## Raw data", "", "```json", JSON.stringify({ snapshot, timeline }, null, 1), "```", "");
  return lines.join("\n");
}
