// A peer's share of the model, read from a plan: compressed ranges in words and a picture.
// The peer page computes its own share from the PlanMessage's assignments, turned into `units`:
//   units: Map layer → Map kind → {total, byPeer: Map peer → [[start, stop), …]}
// kind is "experts" (expert indices) or "dense" (rows of the MLP's intermediate dimension).
// The words and fractions are those of swarm/peer/status.py (tests/browser/test_share_js.py
// holds them to it over the same plans). The dashboard computes nothing: it draws the shares
// the coordinator sends (drawShare). Pure functions, no DOM except drawShare.

const NS = "http://www.w3.org/2000/svg";

/** "0–7, 12, 14–15" for sorted-or-not integers; [] → "". Consecutive runs become a–b. */
export function compressInts(values) {
  const v = [...new Set(values)].sort((a, b) => a - b);
  const out = [];
  for (let i = 0; i < v.length; i++) {
    let j = i;
    while (j + 1 < v.length && v[j + 1] === v[j] + 1) j++;
    out.push(j > i ? `${v[i]}–${v[j]}` : `${v[i]}`);
    i = j;
  }
  return out.join(", ");
}

function add(units, layer, kind, peer, start, stop) {
  if (!units.has(layer)) units.set(layer, new Map());
  const kinds = units.get(layer);
  if (!kinds.has(kind)) kinds.set(kind, { total: 0, byPeer: new Map() });
  const k = kinds.get(kind);
  k.total += stop - start;
  if (!k.byPeer.has(peer)) k.byPeer.set(peer, []);
  k.byPeer.get(peer).push([start, stop]);
}

/** Units of a PlanMessage's assignments [{layer, peer, experts: [int], dense: [[start, stop]]}]. */
export function unitsFromAssignments(assignments) {
  const units = new Map();
  for (const a of assignments) {
    for (const e of a.experts) add(units, a.layer, "experts", a.peer, e, e + 1);
    for (const [s, e] of a.dense) add(units, a.layer, "dense", a.peer, s, e);
  }
  return units;
}

/** [{layer, fraction}] for `peer`, one per layer of the plan (0 where it holds nothing), sorted. */
export function layerFractions(units, peer) {
  return [...units.keys()].sort((a, b) => a - b).map((layer) => {
    const kinds = [...units.get(layer).values()];
    const held = kinds.map((k) => (k.byPeer.get(peer) ?? []).reduce((s, [a, b]) => s + b - a, 0) / (k.total || 1));
    return { layer, fraction: held.reduce((s, f) => s + f, 0) / kinds.length };
  });
}

/** The peer's share of all FFN work in the plan, in [0, 1] (each layer weighs the same). */
export function shareFraction(units, peer) {
  const f = layerFractions(units, peer);
  return f.length ? f.reduce((s, x) => s + x.fraction, 0) / f.length : 0;
}

const KIND_WORDS = { experts: "experts", dense: "MLP rows" };

function layerWords(kinds, peer) {
  const parts = [];
  for (const [kind, k] of kinds) {
    const spans = k.byPeer.get(peer);
    if (!spans?.length) continue;
    const text = kind === "experts" ? compressInts(spans.flatMap(([a, b]) => Array.from({ length: b - a }, (_, i) => a + i)))
      : spans.map(([a, b]) => `${a}–${b}`).join(", ");
    parts.push(`${KIND_WORDS[kind] ?? kind} ${text}`);
  }
  return parts.join("; ");
}

/**
 * The peer's share in words, consecutive layers with the same work merged:
 * "layers 0–29: MLP rows 1274–1536". At most `maxGroups` groups, then "… and N more";
 * "nothing" when the peer holds no unit of the plan.
 */
export function describeShare(units, peer, maxGroups = 3) {
  const groups = [];
  for (const layer of [...units.keys()].sort((a, b) => a - b)) {
    const words = layerWords(units.get(layer), peer);
    if (!words) continue;
    const last = groups.at(-1);
    if (last && last.words === words && last.stop === layer - 1) last.stop = layer;
    else groups.push({ start: layer, stop: layer, words });
  }
  if (!groups.length) return "nothing";
  const text = groups.slice(0, maxGroups).map((g) =>
    `${g.start === g.stop ? `layer ${g.start}` : `layers ${g.start}–${g.stop}`}: ${g.words}`).join(" · ");
  return groups.length > maxGroups ? `${text} · … and ${groups.length - maxGroups} more` : text;
}

/**
 * Draw the share as a strip of one bar per layer, filled to the peer's fraction of that layer,
 * into `el` (its children are replaced by one <svg>). `fractions`: [{layer, fraction}].
 */
export function drawShare(el, fractions, { height = 40 } = {}) {
  const svg = document.createElementNS(NS, "svg");
  const n = Math.max(fractions.length, 1);
  svg.setAttribute("viewBox", `0 0 ${n * 10} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "share-picture");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", fractions.length ? `share per layer, layers ${fractions[0].layer}–${fractions.at(-1).layer}` : "no plan yet");
  fractions.forEach(({ layer, fraction }, i) => {
    const bg = document.createElementNS(NS, "rect");
    Object.entries({ x: i * 10 + 1, y: 0, width: 8, height, class: "share-layer" }).forEach(([k, v]) => bg.setAttribute(k, v));
    const fill = document.createElementNS(NS, "rect");
    const h = Math.max(0, Math.min(1, fraction)) * height;
    Object.entries({ x: i * 10 + 1, y: height - h, width: 8, height: h, class: "share-held" }).forEach(([k, v]) => fill.setAttribute(k, v));
    const title = document.createElementNS(NS, "title");
    title.textContent = `layer ${layer}: ${(100 * fraction).toFixed(1)} %`;
    bg.append(title);
    svg.append(bg, fill);
  });
  el.replaceChildren(svg);
}
