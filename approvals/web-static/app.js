// The egressd approvals page: keeps the page current from its events stream (server-sent events).
// Every text that came from a sandbox is added with textContent, never as HTML.
"use strict";

(function () {
  const csrfMeta = document.querySelector('meta[name="csrf"]');
  if (!csrfMeta) return;  // the sign-in form has no live parts
  const csrf = csrfMeta.content;
  const list = document.getElementById("approvals");
  const nothing = document.getElementById("nothing-waiting");
  const status = document.getElementById("status");
  const tail = document.getElementById("tail");
  const runsBox = document.getElementById("runs");
  const filters = document.getElementById("filters");
  const FIELDS = ["ts", "run", "kind", "host", "port", "decision", "reason"];
  const MAX_ROWS = 500;           // egress rows kept on the page
  const SETTLED_SHOWN_MS = 60000;  // a settled approval stays, marked, this long

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function countdownText(expires) {
    const left = Math.floor(expires - Date.now() / 1000);
    if (left <= 0) return "expired";
    return "expires in " + Math.floor(left / 60) + ":" + String(left % 60).padStart(2, "0");
  }

  function tick() {
    for (const p of document.querySelectorAll(".approval:not(.settled) .countdown")) {
      p.textContent = countdownText(Number(p.dataset.expires));
    }
  }

  function hidden(name, value) {
    const input = el("input");
    input.type = "hidden";
    input.name = name;
    input.value = value;
    return input;
  }

  // The Allow and Deny form; a scope choice belongs here too (as in webpage.answer_form).
  // The answer buttons, as webpage.ANSWERS: the value each posts, its label, the scope it needs offered.
  const ANSWERS = [
    ["once", "Allow once", "once"],
    ["allow", "Allow for this run", "run"],
    ["always", "Allow always", "always"],
    ["deny", "Deny", null],
  ];

  // A POST form of the page to ``action`` (relative: the page lives under its own random path),
  // carrying the session's CSRF token and ``fields`` as hidden inputs.
  function postForm(cls, action, fields) {
    const form = el("form", cls);
    form.method = "post";
    form.action = action;
    form.appendChild(hidden("csrf", csrf));
    for (const [name, value] of fields) form.appendChild(hidden(name, value));
    return form;
  }

  function buildForm(id, scopes) {
    const form = postForm("answer", "answer", [["id", id]]);
    for (const [value, label, scope] of ANSWERS) {
      if (scope !== null && !(scopes || ["once", "run"]).includes(scope)) continue;
      const button = el("button", value === "deny" ? "deny" : value === "always" ? "allow risky" : "allow", label);
      button.type = "submit";
      button.name = "decision";
      button.value = value;
      form.appendChild(button);
    }
    return form;
  }

  function findApproval(id) {
    return document.getElementById("approval-" + id);
  }

  // The tab's title counts what waits, so a background tab is enough to see it.
  const baseTitle = document.title;
  function updateNothing() {
    const waiting = list.querySelectorAll(".approval:not(.settled)").length;
    nothing.hidden = waiting > 0;
    document.title = (waiting ? "(" + waiting + ") " : "") + baseTitle;
  }

  // A desktop notification per new request, once the person said yes (asked once, from a button:
  // a browser asks only on a click). Requests already waiting when the page opened are not announced.
  const notifyButton = document.getElementById("notify");
  let live = false;
  if (notifyButton && "Notification" in window && Notification.permission === "default") {
    notifyButton.hidden = false;
    notifyButton.addEventListener("click", function () {
      Notification.requestPermission().then(function () { notifyButton.hidden = true; });
    });
  }
  function announce(a) {
    if (!live || !("Notification" in window) || Notification.permission !== "granted") return;
    new Notification("egressd: " + a.host + ":" + a.port + " is waiting for an answer", { tag: a.id });
  }

  // An optional sound per new request (a checkbox, remembered in this browser): a short tone, no file.
  const sound = document.getElementById("sound");
  if (sound) {
    sound.checked = localStorage.getItem("egressd-sound") === "on";
    sound.addEventListener("change", function () { localStorage.setItem("egressd-sound", sound.checked ? "on" : "off"); });
  }
  let audio = null;
  function chime() {
    if (!live || !sound || !sound.checked) return;
    try {
      audio = audio || new AudioContext();
      const tone = audio.createOscillator();
      const gain = audio.createGain();
      tone.frequency.value = 880;
      gain.gain.setValueAtTime(0.2, audio.currentTime);
      gain.gain.exponentialRampToValueAtTime(0.001, audio.currentTime + 0.4);
      tone.connect(gain).connect(audio.destination);
      tone.start();
      tone.stop(audio.currentTime + 0.4);
      document.body.dataset.chimes = String(Number(document.body.dataset.chimes || 0) + 1);
    } catch (e) { /* no audio here: the title and the notification still say it */ }
  }

  // One waiting approval, as webview.approval_html lays out the same event: the domain (its registered
  // domain emphasised) and badges, the fields in the order sent, the notes, the countdown, the answers.
  function addApproval(a) {
    if (findApproval(a.id)) return;
    const li = el("li", "approval");
    li.id = "approval-" + a.id;
    li.dataset.id = a.id;
    li.appendChild(el("p", "intro", a.intro));
    const domain = el("h3", "domain");
    domain.append(el("span", "sub", a.domain[0]), el("strong", "site", a.domain[1]), el("span", "port", a.domain[2]));
    if (a.unrelated) domain.appendChild(el("span", "badge unrelated", "unrelated"));
    if (a.punycode) domain.appendChild(el("span", "badge idn", "punycode"));
    li.appendChild(domain);
    const fields = el("dl", "fields");
    for (const [kind, label, text] of a.fields) fields.append(el("dt", null, label), el("dd", "field " + kind, text));
    li.appendChild(fields);
    for (const [key, cls] of [["unrelated", "warning"], ["closing", "hint"], ["scope_note", "scope-note"]]) {
      if (a[key]) li.appendChild(el("p", cls, a[key]));
    }
    const countdown = el("p", "countdown", countdownText(a.expires_at));
    countdown.dataset.expires = String(a.expires_at);
    li.appendChild(countdown);
    li.appendChild(el("p", "state", a.abandoned || ""));
    li.appendChild(buildForm(a.id, a.scopes));
    list.appendChild(li);
    updateNothing();
    announce(a);
    chime();
  }

  // The recent decisions, newest first (webview.HISTORY_COLUMNS).
  const history = document.getElementById("history");
  const noHistory = document.getElementById("no-history");
  const historyTable = document.getElementById("history-table");
  const HISTORY_COLUMNS = ["at", "domain", "run", "text"];
  const HISTORY_KEPT = 50;
  function historyRow(d) {
    const row = el("tr", d.allowed ? "allow" : "deny");
    for (const name of HISTORY_COLUMNS) row.appendChild(el("td", name, d[name]));
    return row;
  }
  function showHistory(rows) {
    history.replaceChildren(...rows.map(historyRow));
    noHistory.hidden = rows.length > 0;
    historyTable.hidden = rows.length === 0;
  }
  function decided(d) {
    history.insertBefore(historyRow(d), history.firstChild);
    while (history.rows.length > HISTORY_KEPT) history.deleteRow(history.rows.length - 1);
    noHistory.hidden = true;
    historyTable.hidden = false;
  }

  // A Revoke button, as webview.revoke_form: a run's approved host, or (no run) an always entry.
  function revokeForm(entry, run) {
    const form = postForm("revoke", "revoke", run === null ? [["entry", entry]] : [["entry", entry], ["run", run]]);
    const button = el("button", null, "Revoke");
    button.type = "submit";
    button.title = "Revoke " + entry;
    form.appendChild(button);
    return form;
  }

  const alwaysBox = document.getElementById("always");
  function showAlways(rows) {
    if (!alwaysBox) return;
    alwaysBox.replaceChildren();
    if (rows.length === 0) { alwaysBox.appendChild(el("p", "none", "No always entry stands.")); return; }
    const table = el("table", "always");
    const head = el("tr");
    for (const h of ["Entry", "Given by", "At", ""]) head.appendChild(el("th", null, h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const r of rows) {
      const row = el("tr");
      const entry = el("td");
      entry.appendChild(el("code", null, r.entry));
      const action = el("td");
      action.appendChild(revokeForm(r.entry, null));
      row.append(entry, el("td", null, r.by + " via " + r.channel), el("td", null, r.at), action);
      body.appendChild(row);
    }
    alwaysBox.appendChild(table);
  }

  function settle(d) {
    const li = findApproval(d.id);
    if (!li) return;
    li.classList.add("settled");
    li.querySelector(".state").textContent = "Settled: " + d.text;
    li.querySelector(".countdown").textContent = "";
    const form = li.querySelector("form");
    if (form) form.remove();
    updateNothing();
    setTimeout(function () { li.remove(); updateNothing(); }, SETTLED_SHOWN_MS);
  }

  function shows(row) {
    const run = filters.elements.run.value.trim();
    const decision = filters.elements.decision.value;
    const host = filters.elements.host.value.trim().toLowerCase();
    const cell = function (name) { return row.querySelector("." + name).textContent; };
    return (!run || cell("run").includes(run)) &&
      (!decision || cell("decision") === decision) &&
      (!host || cell("host").toLowerCase().includes(host));
  }

  function filter() {
    for (const row of tail.rows) row.hidden = !shows(row);
  }

  function addEgress(r) {
    // A stream starts with the latest records, some of which the page may show already.
    const id = String(r.id || "");
    if (id && Array.from(tail.rows).some(function (row) { return row.dataset.id === id; })) return;
    const row = el("tr", r.decision || "");
    row.dataset.id = id;
    for (const name of FIELDS) row.appendChild(el("td", name, r[name] === null || r[name] === undefined ? "" : r[name]));
    row.hidden = !shows(row);
    tail.appendChild(row);
    while (tail.rows.length > MAX_ROWS) tail.deleteRow(0);
  }

  // A cell of entries; given a run, each entry has its Revoke button (the run's approvals).
  function entries(values, run) {
    const td = el("td");
    if (!values || values.length === 0) td.appendChild(el("span", "none", "(none)"));
    for (const v of values || []) {
      if (run === undefined) { td.appendChild(el("code", null, v)); td.append(" "); continue; }
      const item = el("span", "entry");
      item.append(el("code", null, v), revokeForm(v, run));
      td.appendChild(item);
    }
    return td;
  }

  function showRuns(runs) {
    runsBox.replaceChildren();
    if (runs.length === 0) { runsBox.appendChild(el("p", "none", "No run is live.")); return; }
    const table = el("table", "runs");
    const head = el("tr");
    for (const h of ["Run", "Task", "Command", "Allowed", "Approved", "Denied", "Deny entries"]) head.appendChild(el("th", null, h));
    table.appendChild(el("thead")).appendChild(head);
    const body = table.appendChild(el("tbody"));
    for (const r of runs) {
      const row = el("tr");
      row.dataset.run = r.id;
      // A run of another instance of the fleet: where it lives, and no Revoke (it is that instance's).
      const id = el("td", null, r.id);
      if (r.instance) id.append(" ", el("span", "instance", "on " + r.instance));
      row.append(id, el("td", null, r.task || ""), el("td", null, r.command || ""),
        entries(r.allow), entries(r.approved, r.instance ? undefined : r.id), entries(r.denied), entries(r.deny));
      body.appendChild(row);
    }
    runsBox.appendChild(table);
  }

  function notice(d) {
    const p = el("p", "notice", d.text);
    p.setAttribute("role", "status");
    list.parentNode.insertBefore(p, list);
  }

  const events = new EventSource("events");
  const on = function (name, fn) {
    events.addEventListener(name, function (e) { fn(JSON.parse(e.data)); });
  };
  on("approval", addApproval);
  on("settled", settle);
  on("abandoned", function (d) {
    const li = findApproval(d.id);
    if (li) li.querySelector(".state").textContent = d.text;
  });
  on("notice", notice);
  on("history", showHistory);
  on("decided", decided);
  on("always", showAlways);
  on("egress", addEgress);
  on("runs", showRuns);
  on("ready", function () { live = true; status.textContent = "Live updates: on"; status.className = "status live"; });
  on("ended", function () { events.close(); location.reload(); });
  events.onerror = function () {
    status.textContent = "Live updates: reconnecting…";
    status.className = "status";
    // Closed for good (signed out, or too many pages): the page itself says why.
    if (events.readyState === EventSource.CLOSED) setTimeout(function () { location.reload(); }, 3000);
  };
  filters.addEventListener("input", filter);
  filters.addEventListener("submit", function (e) { e.preventDefault(); });
  setInterval(tick, 1000);
  updateNothing();
})();
