// The runs list: polls its rows every 2 s and swaps in only those whose etag changed, so that ticked compare boxes,
// keyboard focus and scroll stay put; rename, notes, archive and delete through the REST API; a notice for new alerts.
(() => {
  const csrf = JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRF-Token"];
  const key = (row) => row.dataset.runId || "empty";

  function formatTimes(root) {
    for (const el of root.querySelectorAll(".created[data-time]")) {
      const when = new Date(Number(el.dataset.time) * 1000);
      el.textContent = when.toLocaleString([], {dateStyle: "short", timeStyle: "short"});
      el.title = when.toLocaleString();
    }
  }

  function alertNotice(row, added) {
    // dismissible, and it stays until dismissed: an alert is worth a click
    const el = document.createElement("div");
    el.className = "toast"; el.setAttribute("role", "alert");
    const link = document.createElement("a");
    link.href = `/runs/${row.dataset.runId}`;
    link.textContent = `Run #${row.dataset.runId} ${row.dataset.name}: ${added} new alert${added > 1 ? "s" : ""}`;
    const close = document.createElement("button");
    close.className = "close"; close.textContent = "×"; close.setAttribute("aria-label", "dismiss");
    close.onclick = () => el.remove();
    el.append(link, close);
    document.getElementById("toasts").appendChild(el);
  }

  function replaceRow(old, row) {
    // the new row takes the old one's ticked box and, when focus was inside it, the focus
    const box = old.querySelector("input[name=ids]");
    if (box && box.checked) row.querySelector("input[name=ids]").checked = true;
    const focusables = [...old.querySelectorAll("a, button, input")];
    const focused = focusables.indexOf(document.activeElement);
    old.replaceWith(row);
    if (focused >= 0) row.querySelectorAll("a, button, input")[focused]?.focus();
    const added = Number(row.dataset.alerts || 0) - Number(old.dataset.alerts || 0);
    if (added > 0) alertNotice(row, added);
  }

  async function refresh() {
    const body = document.getElementById("runs-rows");
    const response = await fetch(body.dataset.src, {headers: {"HX-Request": "true"}});
    if (response.status === 401) { location.href = "/login"; return; }
    if (!response.ok) return;
    const template = document.createElement("template");
    template.innerHTML = await response.text();
    const fresh = [...template.content.querySelectorAll("#runs-rows > tr")];
    const current = new Map([...body.children].map((row) => [key(row), row]));
    fresh.forEach((row, i) => {
      let node = current.get(key(row));
      current.delete(key(row));
      if (!node || node.dataset.etag !== row.dataset.etag) {
        formatTimes(row);
        if (node) replaceRow(node, row);
        node = row;
      }
      // move only a row that is out of place: moving a node drops the focus inside it
      if (body.children[i] !== node) body.insertBefore(node, body.children[i] || null);
    });
    for (const gone of current.values()) gone.remove();
    body.dataset.polls = Number(body.dataset.polls || 0) + 1;  // a signal for tests and scripts: a poll is done
  }

  async function poll() {
    try { await refresh(); } catch (e) { /* offline: the next poll tries again */ }
    setTimeout(poll, 2000);
  }

  async function send(method, runId, body) {
    const response = await fetch(`/api/v1/runs/${runId}`, {
      method, headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
      body: body ? JSON.stringify(body) : undefined});
    if (response.ok) return null;
    const detail = (await response.json().catch(() => ({}))).detail;
    return Array.isArray(detail) ? detail.map((d) => `${d.loc.at(-1)}: ${d.msg}`).join("; ")
      : detail || `HTTP ${response.status}`;
  }

  function edit(row) {
    const dialog = document.getElementById("run-edit");
    const form = dialog.querySelector("form");
    const name = form.querySelector("[name=name]"), notes = form.querySelector("[name=notes]");
    name.value = row.dataset.name; notes.value = row.dataset.notes;
    form.querySelector(".error").textContent = "";
    form.onsubmit = async (e) => {
      if (e.submitter?.value !== "save") return;
      e.preventDefault();  // the dialog stays open until the server took it
      const error = await send("PATCH", row.dataset.runId, {name: name.value, notes: notes.value});
      form.querySelector(".error").textContent = error || "";
      if (!error) { dialog.close(); refresh(); }
    };
    dialog.showModal();
  }

  async function act(button) {
    const row = button.closest("tr");
    const id = row.dataset.runId;
    let error = null;
    if (button.dataset.action === "edit") return edit(row);
    if (button.dataset.action === "archive") {
      error = await send("PATCH", id, {archived: button.textContent.trim() === "archive"});
    } else if (button.dataset.action === "delete") {
      if (!confirm(`Delete run #${id} ${row.dataset.name} with its files (checkpoints, policies, logs)? ` +
                   "This cannot be undone.")) return;
      error = await send("DELETE", id);
    }
    if (error) Molt.toast(`Run #${id}: ${error}`);
    refresh();
  }

  document.addEventListener("DOMContentLoaded", () => {
    formatTimes(document.getElementById("runs-rows"));
    document.getElementById("runs-rows").addEventListener("click", (e) => {
      const button = e.target.closest("button[data-action]");
      if (button) act(button);
    });
    setTimeout(poll, 2000);
  });
})();
