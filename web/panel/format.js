// Device Control panel: number formatting. Pure functions, no ComfyUI imports.

const BINARY = ["B", "KiB", "MiB", "GiB", "TiB"];
const DECIMAL = ["B", "kB", "MB", "GB", "TB"];

/** Bytes for people: "3.20 GiB" (binary, as drivers count) or "3.44 GB" (decimal). */
export function formatBytes(value, decimal = false) {
  if (value === null || value === undefined || Number.isNaN(value)) return "n/a";
  const base = decimal ? 1000 : 1024;
  const names = decimal ? DECIMAL : BINARY;
  let size = Math.abs(value);
  let unit = 0;
  while (size >= base && unit < names.length - 1) {
    size /= base;
    unit += 1;
  }
  const sign = value < 0 ? "-" : "";
  return unit === 0 ? `${sign}${Math.round(size)} B` : `${sign}${size.toFixed(2)} ${names[unit]}`;
}

/** "42%" of a whole, or "" when the whole is unknown. */
export function percent(part, whole) {
  if (!whole) return "";
  return `${Math.round((100 * part) / whole)}%`;
}

/** "14:03:21" for a time in seconds since the epoch. */
export function clock(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString([], { hour12: false });
}

/** A duration for people: "450 ms", "2.4 s", "38 s". */
export function seconds(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "n/a";
  if (value < 1) return `${Math.round(value * 1000)} ms`;
  return `${value.toFixed(value < 10 ? 1 : 0)} s`;
}
