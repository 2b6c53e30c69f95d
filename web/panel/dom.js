// Device Control panel: the few DOM pieces its views share. Text goes in with textContent only (never parsed
// as HTML), so model and node names from files cannot inject markup.

export function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function button(label, className, onClick, title) {
  const node = element("button", `dc-button ${className}`, label);
  node.type = "button";
  if (title) node.title = title;
  node.addEventListener("click", onClick);
  Object.assign(node.style, {
    padding: "2px 8px",
    margin: "2px 4px 2px 0",
    fontSize: "12px",
    cursor: "pointer",
    borderRadius: "4px",
    border: "1px solid var(--p-content-border-color, #555)",
    background: "var(--comfy-input-bg, transparent)",
    color: "inherit",
  });
  return node;
}

/** A legend entry: a swatch in a line's color, then its name (`prefix` names the classes: `dc-legend`). */
export function legendEntry(prefix, color, name) {
  const entry = element("span", `${prefix}-entry`);
  const swatch = element("span", `${prefix}-swatch`);
  Object.assign(swatch.style, {
    display: "inline-block",
    width: "10px",
    height: "3px",
    margin: "0 4px 3px 0",
    verticalAlign: "middle",
    background: color,
  });
  entry.append(swatch, document.createTextNode(name));
  return entry;
}
