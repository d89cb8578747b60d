// The phone UI: one state line in words, a progress bar while loading, and the facts a user
// checks (this peer, GPU, coordinator, assigned work, requests served, ms per request, errors).
const STATES = {
  starting: "Starting…",
  connecting: "Connecting to the swarm…",
  authenticated: "Authenticated — waiting for work",
  loading: "Loading weights",
  serving: "Serving",
  refused: "Refused by the swarm",
  "cannot-serve": "This browser cannot serve",
  disconnected: "Disconnected — reconnecting…",
  error: "Error",
};

const $ = (id) => document.getElementById(id);

/** Show `state` (a key of STATES) with an optional detail line. */
export function setState(state, detail = "") {
  const el = $("state");
  el.dataset.state = state;
  el.textContent = STATES[state] ?? state;
  $("detail").textContent = detail;
  $("progress").hidden = state !== "loading";
}

export function setProgress(done, total) {
  const pct = total ? Math.floor((100 * done) / total) : 0;
  $("progress").value = pct;
  $("state").textContent = `${STATES.loading} ${pct} %`;
}

export function setFacts(facts) {
  for (const [id, text] of Object.entries(facts)) if ($(id)) $(id).textContent = text;
}

export function showError(message) { $("error").textContent = message ?? ""; }

/** Describe assignments [{layer, experts, dense}] in words, e.g. "layer 3: experts 0–7". */
export function describeAssignments(assignments) {
  if (!assignments.length) return "nothing yet";
  return assignments.map((a) => {
    const parts = [];
    if (a.experts.length) parts.push(`experts ${a.experts.join(", ")}`);
    if (a.dense.length) parts.push(`MLP rows ${a.dense.map(([s, e]) => `${s}–${e}`).join(", ")}`);
    return `layer ${a.layer}: ${parts.join("; ")}`;
  }).join(" · ");
}
