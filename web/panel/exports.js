// Device Control panel: the last run's profile as files — JSON (the route's data as the page received it), the
// server's markdown table for bug reports, and the chart as a PNG drawn apart from the screen (a fixed size, an
// opaque background and the legend inside, so it reads the same wherever it is pasted). No ComfyUI imports: the
// entry file passes its fetch in.

import { RunChart } from "./run_chart.js";

const PNG_SIZE = { width: 1200, height: 300 };
const PNG_BACKGROUND = "#202020";

/** Save `blob` as a download named `name` (the browser's own download, as a link with `download` gives). */
export function download(name, blob) {
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  link.style.display = "none";
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 30_000);
}

/** `device_control_profile_<prompt id>.<extension>` */
export function fileName(profile, suffix) {
  const id = String(profile.prompt_id).replace(/[^A-Za-z0-9-]/g, "_");
  return `device_control_profile_${id}${suffix}`;
}

/** The three exports; `fetchText(path)` reads one of the server's routes as text (throws with its error). */
export function profileExports(fetchText, decimal, onError) {
  const guarded = (work) => async (...args) => {
    try {
      await work(...args);
    } catch (error) {
      onError(error);
    }
  };
  return {
    json: guarded(async (profile) => {
      download(fileName(profile, ".json"), new Blob([JSON.stringify(profile, null, 1)], { type: "application/json" }));
    }),
    markdown: guarded(async (profile) => {
      const query = new URLSearchParams({ prompt_id: profile.prompt_id, format: "markdown" });
      const text = await fetchText(`/device_control/profile?${query}`);
      download(fileName(profile, ".md"), new Blob([text], { type: "text/markdown" }));
    }),
    png: guarded(async (profile) => {
      const canvas = document.createElement("canvas");
      const options = { decimal: decimal(), background: PNG_BACKGROUND, legend: true, ratio: 1 };
      new RunChart().draw(canvas, profile, PNG_SIZE.width, PNG_SIZE.height, options);
      const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
      if (!blob) throw new Error("the browser could not encode the chart as PNG");
      download(fileName(profile, "_timeline.png"), blob);
    }),
  };
}
