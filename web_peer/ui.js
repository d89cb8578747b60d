// The phone UI: one state line in words, a progress bar while loading, this phone's share of the
// model (a percentage, a picture, ranges in words) and the facts a user checks (requests served,
// ms per request, the swarm's pace, GPU, coordinator, errors).
import { describeShare, drawShare, layerFractions, shareFraction, unitsFromAssignments } from "./share.js";

const STATES = {
  starting: "Starting…",
  connecting: "Connecting to the swarm…",
  authenticated: "Connected — waiting for work",
  loading: "Loading weights",
  serving: "Serving",
  standby: "Standing by",
  refused: "Refused by the swarm",
  "cannot-serve": "This browser cannot serve",
  disconnected: "Disconnected — reconnecting…",
  stopped: "Stopped — left the swarm",
  error: "Error",
};

const $ = (id) => document.getElementById(id);

/** Show `state` (a key of STATES) with an optional detail line; standing by, the detail is the
 * reason and goes on the state line itself ("Standing by — the model fits the Python peers …"). */
export function setState(state, detail = "") {
  const el = $("state");
  el.dataset.state = state;
  const inline = state === "standby" && detail;
  el.textContent = inline ? `${STATES.standby} — ${detail}` : STATES[state] ?? state;
  $("detail").textContent = inline ? "" : detail;
  $("progress").hidden = state !== "loading";
}

/** Loading progress: `pct` (0–100, whole) of the bytes of the whole batch being loaded. */
export function setProgress(pct) {
  $("progress").value = pct;
  $("state").textContent = `${STATES.loading} ${pct} %`;
}

export function setFacts(facts) {
  for (const [id, text] of Object.entries(facts)) if ($(id)) $(id).textContent = text;
}

export function showError(message) { $("error").textContent = message ?? ""; }

/** Assignments of this peer only, from the keys of the blocks it holds ("layer/dense/s/e", "layer/expert/e"). */
function heldAssignments(keys, peer) {
  return keys.map((k) => k.split("/")).map(([layer, kind, a, b]) => ({
    layer: Number(layer), peer, experts: kind === "expert" ? [Number(a)] : [], dense: kind === "dense" ? [[Number(a), Number(b)]] : [] }));
}

/**
 * This peer's share: of the plan `assignments` (every peer's, as in the PlanMessage) when one
 * came; before any plan, what the GPU holds (`heldKeys`), without a percentage (no whole to divide by).
 */
export function showShare(assignments, peerId, heldKeys = []) {
  const planned = assignments.length > 0;
  const units = unitsFromAssignments(planned ? assignments : heldAssignments(heldKeys, peerId));
  const pct = 100 * shareFraction(units, peerId);
  $("share-pct").textContent = !planned ? "– %" : `${pct < 10 && pct > 0 ? pct.toFixed(1) : Math.round(pct)} %`;
  $("assigned").textContent = units.size ? describeShare(units, peerId) : "nothing yet";
  drawShare($("share-picture"), layerFractions(units, peerId));
}
