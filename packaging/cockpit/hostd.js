/* hostd's Cockpit page: the models of org.hostd1, live from the manager's
 * signals (PropertiesChanged, OperationFinished, OperationRemoved), one model
 * with its units (systemd's D-Bus), config with origins (hostctl config) and
 * journal (hostctl logs NAME), a reload dialog built from the manager's
 * EditableSchema, and start / stop / restart.
 *
 * Trust: the page runs as the logged-in user through cockpit-bridge; it
 * decides nothing. Every action goes to the manager, which asks polkit; the
 * page only asks first (Manager.Access, see probePermission) so that it
 * offers no action the manager would refuse, and
 * shows each refusal as the manager words it, on the field it names.
 */
"use strict";

const BUS = "org.hostd1";
const MANAGER = "/org/hostd1";
const M_IFACE = "org.hostd1.Manager";
const MODEL_IFACE = "org.hostd1.Model";
const OP_IFACE = "org.hostd1.Operation";
const PROPS = "org.freedesktop.DBus.Properties";
const OUTCOME_TEXT = {
    done: "done", unchanged: "unchanged", "rolled-back": "rolled back", failed: "failed", cancelled: "cancelled",
};

const hostd = cockpit.dbus(BUS, { bus: "system" });
const systemd = cockpit.dbus("org.freedesktop.systemd1", { bus: "system" });

const $ = id => document.getElementById(id);
const models = new Map(); // name -> {path, props, lastOp}
const operations = new Map(); // path -> props
// The polkit action of each verb (hostd/manager/api.py VERB_ACTIONS).
const VERB_ACTIONS = {
    reload: "org.hostd1.reload", start: "org.hostd1.manage", stop: "org.hostd1.manage",
    restart: "org.hostd1.manage", cancel: "org.hostd1.manage",
};
const may = { reload: null, start: null, stop: null, restart: null, cancel: null }; // null: allowed; a string: why not
let current = null; // the model the model view shows
let journal = null;
let dialogOp = null; // the operation the reload dialog follows

function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
        if (key === "class") node.className = value;
        else if (key === "text") node.textContent = value;
        else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child);
    return node;
}

const unwrap = variants => Object.fromEntries(Object.entries(variants).map(([k, v]) => [k, v.v]));

function age(usec) {
    if (!usec) return "";
    const s = Math.max(0, Math.round(Date.now() / 1000 - Number(usec) / 1e6));
    if (s < 60) return `${s} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    if (s < 86400) return `${Math.round(s / 3600)} h ago`;
    return `${Math.round(s / 86400)} d ago`;
}

function json(text, fallback) {
    try {
        return JSON.parse(text);
    } catch (e) {
        return fallback;
    }
}

function showFatal(text) {
    $("fatal").textContent = text;
    $("fatal").hidden = !text;
}

// ------------------------------------------------------------ reading state

async function getAll(path, iface) {
    const [props] = await hostd.call(path, PROPS, "GetAll", [iface], { type: "s" });
    return unwrap(props);
}

async function refreshModel(name, path) {
    const props = await getAll(path, MODEL_IFACE);
    const entry = { path, props, lastOp: null };
    const before = models.get(name);
    if (name === current && before && before.props.Config !== props.Config) showConfig(name); // a reload committed
    if (props.LastOperation && props.LastOperation !== "/") {
        entry.lastOp = await refreshOperation(props.LastOperation).catch(() => null);
    }
    models.set(name, entry);
    render();
}

async function refreshOperation(path) {
    const props = await getAll(path, OP_IFACE);
    operations.set(path, props);
    if (dialogOp === path) renderProgress(props);
    return props;
}

async function refreshList() {
    try {
        const [rows] = await hostd.call(MANAGER, M_IFACE, "ListModels", []);
        const names = new Set(rows.map(r => r[0]));
        for (const name of [...models.keys()]) if (!names.has(name)) models.delete(name);
        await Promise.all(rows.map(([name, , path]) => refreshModel(name, path)));
        showFatal("");
    } catch (err) {
        showFatal(`Cannot read the models from ${BUS} on the system bus: ${err.message || err}. ` +
                  "Is hostd installed (hostd install) and hostd.service able to start?");
    }
    render();
}

function modelOfPath(path) {
    for (const [name, entry] of models) if (entry.path === path) return name;
    return null;
}

// Live: every signal of the manager's objects, no polling.
hostd.subscribe({ interface: PROPS, member: "PropertiesChanged", path_namespace: MANAGER }, (path, iface, signal, args) => {
    if (args[0] === MODEL_IFACE) {
        const name = modelOfPath(path);
        if (name) refreshModel(name, path);
        else refreshList();
    } else if (args[0] === OP_IFACE) {
        refreshOperation(path).then(props => {
            const name = props.Model;
            if (models.has(name)) refreshModel(name, models.get(name).path);
        }).catch(() => {});
    }
});
hostd.subscribe({ interface: M_IFACE, path: MANAGER }, (path, iface, signal, args) => {
    if (signal === "OperationFinished" && dialogOp === args[1]) refreshOperation(args[1]).catch(() => {});
    refreshList();
});

// -------------------------------------------------------------- permission

/* Ask the manager what this user may do with a model (Manager.Access: for
 * each verb, "" or the refusal the mutating method would give, from the same
 * polkit question, its action and verb, without interaction): nothing is tried, so
 * nothing is refused or journalled. A rule may grant per model, so it is
 * asked again for the model the view shows. */
async function probePermission() {
    const name = current || models.keys().next().value;
    if (!name)
        return;
    let answer;
    try {
        [answer] = await hostd.call(MANAGER, M_IFACE, "Access", [name], { type: "s" });
    } catch (err) {
        answer = Object.fromEntries(Object.keys(VERB_ACTIONS).map(v => [v, err.message]));
    }
    // A manager older than the per-verb answer gives the actions' only.
    for (const [v, action] of Object.entries(VERB_ACTIONS))
        may[v] = (v in answer ? answer[v] : answer[action]) || null;
    const why = Object.values(may).find(refusal => refusal) || null;
    $("readonly").hidden = !why;
    $("readonly").textContent = why ? `Read only: ${why}` : "";
    render();
}

// --------------------------------------------------------------- rendering

function stateBadge(state) {
    return el("span", { class: `state state-${state}`, text: state || "unknown" });
}

function weightsText(p) {
    if (p.WeightsRetained) return "retained";
    return p.WeightsNotRetainedReason ? `not retained: ${p.WeightsNotRetainedReason}` : "not retained";
}

function servingText(p) {
    if (p.Standby && p.State === "serving" && !p.EnginePID && p.StandbyState === "active") return "standby engine";
    if (p.State === "serving" || p.State === "reloading") return p.Standby ? "main engine (standby waits)" : "main engine";
    return "—";
}

function lastOpText(entry) {
    const op = entry.lastOp;
    if (!op) return "—";
    const outcome = op.State === "running" ? `running (${op.Stage})` : (OUTCOME_TEXT[op.State] || op.State);
    return `${op.Kind} #${op.Id}: ${outcome}, ${age(op.FinishedUSec || op.CreatedUSec)}`;
}

function render() {
    const body = $("models").tBodies[0];
    body.replaceChildren();
    for (const [name, { props: p }] of [...models].sort()) {
        const config = json(p.Config, {});
        const link = el("a", { href: `#/${encodeURIComponent(name)}`, text: name });
        const row = el("tr", { "data-model": name },
                       el("td", {}, link), el("td", {}, stateBadge(p.State)),
                       el("td", { text: p.Backend || "—" }), el("td", { text: config.device || "—" }),
                       el("td", { text: p.ConfigProblem ? "—" : weightsText(p) }),
                       el("td", { text: String(p.InFlight ?? 0) }), el("td", { text: servingText(p) }),
                       el("td", { text: lastOpText(models.get(name)) }));
        if (p.ConfigProblem) {
            body.append(row, el("tr", { class: "problem-row" },
                                el("td", { colspan: "8" }, el("pre", { class: "problem", text: p.ConfigProblem }))));
        } else {
            body.append(row);
        }
    }
    $("no-models").hidden = models.size > 0;
    renderModel();
}

function renderModel() {
    const showing = current !== null;
    $("list-view").hidden = showing;
    $("model-view").hidden = !showing;
    if (!showing) return;
    const entry = models.get(current);
    $("m-name").textContent = current;
    $("m-title").textContent = current;
    $("j-name").textContent = current;
    if (!entry) {
        $("m-state").replaceChildren(stateBadge("unknown"));
        return;
    }
    const p = entry.props;
    $("m-state").replaceChildren(stateBadge(p.State));
    $("m-problem").hidden = !p.ConfigProblem;
    $("m-problem").textContent = p.ConfigProblem || "";
    const running = !["stopped", "failed", "unknown"].includes(p.State);
    const busy = p.ActiveOperation && p.ActiveOperation !== "/";
    for (const [id, enabled, why] of [
        ["btn-start", !running && !busy, may.start],
        ["btn-stop", running, may.stop],
        ["btn-restart", running && !busy, may.restart],
        ["btn-reload", running && !busy && !p.ConfigProblem, may.reload],
    ]) {
        const button = $(id);
        button.disabled = !enabled || why !== null;
        button.title = why || "";
    }
    if (gpu.model !== current || gpu.pid !== p.EnginePID) readGpu(current, p.EnginePID);
    const details = [
        ["Backend", p.Backend], ["Listen", p.Listen], ["Weights", weightsText(p)], ["GPU memory", gpu.text],
        ["In flight", String(p.InFlight)], ["Serving", servingText(p)], ["Engine status", p.EngineStatus || "—"],
        ["Editable", (p.EditableFields || []).join(", ") || "—"], ["Last operation", lastOpText(entry)],
    ];
    if (entry.lastOp && entry.lastOp.Error) details.push(["Last error", entry.lastOp.Error]);
    $("m-details").replaceChildren(...details.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v || "—" })]));
    renderUnits(p.Units || []);
}

/* GPU memory, NVML's view as the reload's preflight reads it (Model.GpuMemory):
 * read when the model view opens and again when its engine's PID changes. */
const gpu = { model: null, pid: null, text: "reading…" };
const gib = bytes => (bytes / 2 ** 30).toFixed(1);

async function readGpu(name, pid) {
    Object.assign(gpu, { model: name, pid, text: "reading…" });
    let text;
    try {
        const [out] = await hostd.call(models.get(name).path, MODEL_IFACE, "GpuMemory", [], { type: "" });
        const value = json(out, []);
        text = Array.isArray(value)
            ? value.map(g => `GPU ${g.index}: engine ${gib(g.engine)} GiB, weights ${gib(g.weights)} GiB, ` +
                             `${gib(g.free)} of ${gib(g.total)} GiB free`).join("; ") || "none (not on a GPU)"
            : `NVML cannot be read: ${value.unreadable}`;
    } catch (err) {
        text = err.message || String(err);
    }
    if (gpu.model === name && gpu.pid === pid) {
        gpu.text = text;
        render();
    }
}

// ----------------------------------------------------------- systemd units

const unitProxies = new Map();

function renderUnits(names) {
    const body = $("units").tBodies[0];
    if (body.dataset.units !== names.join(" ")) {
        body.dataset.units = names.join(" ");
        body.replaceChildren(...names.map(n => el("tr", { "data-unit": n }, el("td", { text: n }),
                                                   el("td", { class: "u-state", text: "…" }), el("td", { class: "u-pid" }))));
        for (const name of names) followUnit(name);
    }
}

async function followUnit(name) {
    if (unitProxies.has(name)) return showUnit(name, unitProxies.get(name));
    const [path] = await systemd.call("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                                      "LoadUnit", [name], { type: "s" });
    const proxy = systemd.proxy("org.freedesktop.systemd1.Unit", path);
    const service = name.endsWith(".service") ? systemd.proxy("org.freedesktop.systemd1.Service", path) : null;
    unitProxies.set(name, { proxy, service });
    const update = () => showUnit(name, unitProxies.get(name));
    proxy.addEventListener("changed", update);
    if (service) service.addEventListener("changed", update);
    await proxy.wait();
    if (service) await service.wait();
    update();
}

function showUnit(name, { proxy, service }) {
    const row = document.querySelector(`#units tr[data-unit="${CSS.escape(name)}"]`);
    if (!row) return;
    row.querySelector(".u-state").textContent = proxy.valid ? `${proxy.ActiveState} (${proxy.SubState})` : "not loaded";
    row.querySelector(".u-pid").textContent = service && service.valid && service.MainPID ? String(service.MainPID) : "";
}

// ------------------------------------------------------ config and journal

function showConfig(name) {
    const body = $("config").tBodies[0];
    body.replaceChildren(el("tr", {}, el("td", { colspan: "3", class: "muted", text: "reading…" })));
    // The name comes from the URL: after "--", never an option of hostctl's.
    cockpit.spawn(["hostctl", "config", "--json=short", "--", name], { err: "message" })
        .then(out => {
            // hostctl's --json document, version 1 (hostd/hostctl_output.py): the config is its data.
            const doc = json(out, {});
            if (doc.version !== 1) throw new Error(`hostctl config --json: expected version 1, got ${doc.version}`);
            const rows = Object.entries(doc.data || {}).map(([key, { value, origin }]) =>
                el("tr", {}, el("td", { text: key }), el("td", { text: JSON.stringify(value) }),
                   el("td", { class: "muted", text: origin })));
            body.replaceChildren(...rows);
        })
        .catch(err => body.replaceChildren(el("tr", {}, el("td", { colspan: "3" },
                                                               el("pre", { class: "problem", text: err.message || String(err) })))));
}

/* `hostctl logs` (journalctl, as the logged-in user: cockpit 287's base1 has
 * no cockpit.journal, Cockpit's own pages bundle theirs), following: it reads
 * the system journal when the user may (root, adm or systemd-journal), and
 * only the lines the model's units and the manager wrote (HOSTD_MODEL= alone
 * is a field any local user can write). The name, from the URL, after "--". */
function followJournal(name) {
    if (journal) journal.close("cancelled");
    const box = $("journal");
    box.replaceChildren();
    let partial = "";
    journal = cockpit.spawn(["hostctl", "logs", "--follow", "--lines=200", "--json=short", "--", name],
                            { err: "message" });
    journal.stream(data => {
        const lines = (partial + data).split("\n");
        partial = lines.pop();
        for (const text of lines) {
            const entry = json(text, null);
            if (!entry) continue;
            const message = Array.isArray(entry.MESSAGE) ? new TextDecoder().decode(new Uint8Array(entry.MESSAGE)) : entry.MESSAGE;
            const when = new Date(Number(entry.__REALTIME_TIMESTAMP) / 1000);
            box.append(el("div", { class: `j-line prio-${entry.PRIORITY || 6}` },
                          el("span", { class: "j-time", text: when.toLocaleTimeString() }),
                          el("span", { class: "j-id", text: entry.SYSLOG_IDENTIFIER || entry._COMM || "" }),
                          el("span", { class: "j-msg", text: message })));
        }
        while (box.childElementCount > 500) box.firstChild.remove();
        box.scrollTop = box.scrollHeight;
    });
    journal.catch(err => {
        if (err.problem !== "cancelled") box.append(el("div", { class: "problem", text: `hostctl logs: ${err.message || err}` }));
    });
}

// ------------------------------------------------------------------ actions

async function verb(method) {
    $("m-action-error").hidden = true;
    try {
        await hostd.call(MANAGER, M_IFACE, method, [current], { type: "s" });
    } catch (err) {
        $("m-action-error").textContent = err.message || String(err);
        $("m-action-error").hidden = false;
    }
}

$("btn-start").addEventListener("click", () => verb("Start"));
$("btn-stop").addEventListener("click", () => verb("Stop"));
$("btn-restart").addEventListener("click", () => verb("Restart"));

// ------------------------------------------------------------ reload dialog

/* One input per property of the EditableSchema (msgspec's JSON Schema of the
 * backend's engine section); the checks below are its keywords, the same
 * constraints the manager's schema enforces. */
function fieldKind(spec) {
    const options = spec.anyOf || [spec];
    const nullable = options.some(o => o.type === "null");
    const main = options.find(o => o.type !== "null") || {};
    return { nullable, main, kind: main.enum ? "enum" : main.type };
}

function checkField(name, spec, raw) {
    const { nullable, main, kind } = fieldKind(spec);
    if (raw === "" || raw === null) return nullable ? { value: null } : { error: `${name}: a value is required` };
    if (kind === "boolean") return { value: raw === true || raw === "true" };
    if (kind === "enum") return main.enum.includes(raw) ? { value: raw } : { error: `${name}: one of ${main.enum.join(", ")}` };
    if (kind === "array") {
        const items = String(raw).split(",").map(s => s.trim()).filter(Boolean);
        const out = [];
        for (const item of items) {
            const r = checkField(name, main.items || {}, item);
            if (r.error) return r;
            out.push(r.value);
        }
        return { value: out };
    }
    if (kind === "integer" || kind === "number") {
        const n = Number(raw);
        if (!Number.isFinite(n) || (kind === "integer" && !Number.isInteger(n))) {
            return { error: `${name}: expected ${kind === "integer" ? "an integer" : "a number"}` };
        }
        if (main.minimum !== undefined && n < main.minimum) return { error: `${name}: expected >= ${main.minimum}` };
        if (main.maximum !== undefined && n > main.maximum) return { error: `${name}: expected <= ${main.maximum}` };
        if (main.exclusiveMinimum !== undefined && n <= main.exclusiveMinimum) return { error: `${name}: expected > ${main.exclusiveMinimum}` };
        if (main.exclusiveMaximum !== undefined && n >= main.exclusiveMaximum) return { error: `${name}: expected < ${main.exclusiveMaximum}` };
        return { value: n };
    }
    return { value: String(raw) };
}

function rangeText(main) {
    const parts = [];
    if (main.minimum !== undefined) parts.push(`≥ ${main.minimum}`);
    if (main.exclusiveMinimum !== undefined) parts.push(`> ${main.exclusiveMinimum}`);
    if (main.maximum !== undefined) parts.push(`≤ ${main.maximum}`);
    if (main.exclusiveMaximum !== undefined) parts.push(`< ${main.exclusiveMaximum}`);
    return parts.join(", ");
}

let dialogSchema = {};
let dialogCurrent = {};

async function openReload() {
    await refreshModel(current, models.get(current).path); // the files may have changed without a signal
    const entry = models.get(current);
    const schema = json(entry.props.EditableSchema, {});
    dialogSchema = schema.properties || {};
    dialogCurrent = json(entry.props.Config, {}).engine || {};
    dialogOp = null;
    $("r-name").textContent = current;
    $("r-error").hidden = true;
    $("r-progress").hidden = true;
    $("r-outcome").hidden = true;
    $("r-cancel-op").hidden = true;
    $("r-submit").disabled = false;
    const fields = Object.entries(dialogSchema).map(([name, spec]) => {
        const { nullable, main, kind } = fieldKind(spec);
        const value = dialogCurrent[name] ?? null;
        let input;
        if (kind === "boolean") {
            input = el("input", { type: "checkbox" });
            input.checked = Boolean(value);
        } else if (kind === "enum") {
            input = el("select", {}, ...(nullable ? [el("option", { value: "", text: "(unset)" })] : []),
                       ...main.enum.map(v => el("option", { value: v, text: v })));
            input.value = value ?? "";
        } else {
            input = el("input", { type: kind === "integer" || kind === "number" ? "number" : "text" });
            if (kind === "integer") input.step = "1";
            if (kind === "number") input.step = "any";
            if (main.minimum !== undefined) input.min = main.minimum;
            if (main.maximum !== undefined) input.max = main.maximum;
            input.value = value === null ? "" : Array.isArray(value) ? value.join(", ") : String(value);
            if (nullable) input.placeholder = "unset";
        }
        input.id = `field-${name}`;
        input.name = name;
        const hint = [kind === "enum" ? "one of the list" : kind, rangeText(main), nullable ? "empty: unset" : ""]
            .filter(Boolean).join("; ");
        return el("div", { class: "field", "data-field": name },
                  el("label", { for: input.id, text: name }), input,
                  el("div", { class: "hint", text: `${hint}. ${spec.description || ""}` }),
                  el("div", { class: "field-error", hidden: "" }));
    });
    $("r-fields").replaceChildren(...fields);
    $("reload-dialog").showModal();
}

function fieldError(name, text) {
    const box = document.querySelector(`#r-fields [data-field="${CSS.escape(name)}"]`);
    if (!box) return false;
    const error = box.querySelector(".field-error");
    error.textContent = text;
    error.hidden = false;
    box.classList.add("has-error");
    return true;
}

function clearErrors() {
    for (const box of document.querySelectorAll("#r-fields .field")) {
        box.classList.remove("has-error");
        box.querySelector(".field-error").hidden = true;
    }
    $("r-error").hidden = true;
}

function readPatch() {
    const patch = {};
    let ok = true;
    for (const [name, spec] of Object.entries(dialogSchema)) {
        const input = $(`field-${name}`);
        const raw = input.type === "checkbox" ? input.checked : input.value.trim();
        const checked = checkField(name, spec, raw);
        if (checked.error) {
            fieldError(name, checked.error);
            ok = false;
            continue;
        }
        if (JSON.stringify(checked.value) !== JSON.stringify(dialogCurrent[name] ?? null)) patch[name] = checked.value;
    }
    return ok ? patch : null;
}

async function submitReload() {
    clearErrors();
    const patch = readPatch();
    if (patch === null) return;
    $("r-submit").disabled = true;
    try {
        const [path] = await hostd.call(MANAGER, M_IFACE, "ReloadJSON", [current, JSON.stringify(patch)], { type: "ss" });
        dialogOp = path;
        $("r-progress").hidden = false;
        $("r-stages").replaceChildren();
        await refreshOperation(path);
    } catch (err) {
        // A refusal changes nothing; it goes on the field it names.
        const text = err.message || String(err);
        const named = Object.keys(dialogSchema).filter(name => new RegExp(`\\b${name}\\b`).test(text));
        if (!named.length || !named.map(name => fieldError(name, text)).some(Boolean)) {
            $("r-error").textContent = text;
            $("r-error").hidden = false;
        }
        $("r-submit").disabled = false;
    }
}

/* The stages the page saw pass (the whole path of a reload done before it
 * looked), then those still ahead on the strategy's path; both the path
 * (Stages) and whether Cancel would be honoured now (Cancellable) are the
 * manager's, never a table of the page's own. */
function renderProgress(op) {
    const stages = $("r-stages");
    for (const ahead of stages.querySelectorAll("li.ahead")) ahead.remove();
    const running = op.State === "running";
    const path = op.Stages || [];
    if (!running && op.State === "done" && !stages.childElementCount) {
        // Done before the page saw it run (an in-place reload takes well under a
        // second): a reload that ends done passed exactly its strategy's path.
        stages.replaceChildren(...path.map(stage => el("li", { class: "passed", "data-stage": stage, text: stage })));
    }
    const last = stages.lastElementChild;
    if (!last || last.dataset.stage !== op.Stage) {
        if (last) last.classList.add("passed");
        stages.append(el("li", { "data-stage": op.Stage, text: op.Stage }));
    }
    if (running && path.includes(op.Stage)) {
        for (const stage of path.slice(path.indexOf(op.Stage) + 1))
            stages.append(el("li", { class: "ahead", "data-stage": stage, text: stage }));
    }
    $("r-engine").textContent = op.EngineStatus ? `engine: ${op.EngineStatus}` : "";
    $("r-cancel-op").hidden = !(running && op.Cancellable === true && may.cancel === null);
    if (running) return;
    stages.lastElementChild.classList.add("passed");
    const outcome = $("r-outcome");
    const text = OUTCOME_TEXT[op.State] || op.State;
    outcome.className = `alert ${op.State === "done" || op.State === "unchanged" ? "alert-success" : "alert-danger"}`;
    outcome.replaceChildren(el("strong", { class: "outcome", "data-state": op.State, text: `Reload ${text}` }),
                            ...(op.Error ? [el("pre", { class: "cause", text: op.Error })] : []),
                            ...(op.Notes && op.Notes.length ? [el("p", { text: op.Notes.join("; ") })] : []));
    outcome.hidden = false;
    $("r-submit").disabled = false;
}

$("btn-reload").addEventListener("click", openReload);
$("r-submit").addEventListener("click", submitReload);
$("r-close").addEventListener("click", () => $("reload-dialog").close());
$("r-cancel-op").addEventListener("click", () => {
    if (dialogOp) hostd.call(dialogOp, OP_IFACE, "Cancel", []).catch(err => {
        $("r-error").textContent = err.message || String(err);
        $("r-error").hidden = false;
    });
});
$("reload-dialog").addEventListener("close", () => { dialogOp = null; });

// ------------------------------------------------------------------ routing

function route() {
    const [name] = cockpit.location.path;
    const next = name ? decodeURIComponent(name) : null;
    if (next !== current) {
        current = next;
        if (current) {
            showConfig(current);
            followJournal(current);
            probePermission();
        } else if (journal) {
            journal.close("cancelled");
            journal = null;
        }
    }
    render();
}

$("back").addEventListener("click", ev => { ev.preventDefault(); cockpit.location.go([]); });
cockpit.addEventListener("locationchanged", route);

refreshList().then(probePermission).then(route);
cockpit.transport.wait(() => document.body.classList.add("ready"));
