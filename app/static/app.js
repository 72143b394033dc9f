// Molt Studio, every page: toasts, local times, the daemon banner; the namespace charts.js, run.js and compare.js add to.
"use strict";
const Molt = (() => {
  function duration(secs) {
    const h = Math.floor(secs / 3600), m = Math.floor(secs / 60) % 60, s = Math.floor(secs % 60);
    return h ? `${h}h ${m}m` : m ? `${m}m ${s}s` : `${s}s`;
  }

  function throttled(fn, ms) {
    let timer = null;
    return () => { if (!timer) timer = setTimeout(() => { timer = null; fn(); }, ms); };
  }


  // ---- toasts ----------------------------------------------------------------------------------------------------
  function toast(text, kind = "alert") {
    const el = document.createElement("div");
    el.className = `toast ${kind}`; el.setAttribute("role", "alert");
    el.textContent = text;
    const close = document.createElement("button");
    close.textContent = "×"; close.className = "close"; close.onclick = () => el.remove();
    el.appendChild(close);
    document.getElementById("toasts").appendChild(el);
    setTimeout(() => el.remove(), 20000);
  }

  function formatTimes(root) {
    for (const el of root.querySelectorAll(".time[data-time]")) {
      const t = Number(el.dataset.time);
      el.textContent = el.dataset.time && t ? new Date(t * 1000).toLocaleString() : "";
    }
  }

  // ---- every page: the banner while the daemon is down, from /ws/daemon; a toast when it is back ------------------
  // A daemon stopped on request stays stopped: the banner then offers to start it (through `molt serve`).
  async function startDaemon(button) {
    button.disabled = true;
    const csrf = JSON.parse(document.body.getAttribute("hx-headers"))["X-CSRF-Token"];
    const r = await fetch("/api/v1/daemon/start", {method: "POST", headers: {"X-CSRF-Token": csrf}});
    if (!r.ok) {
      toast((await r.json()).detail);
      button.disabled = false;
    }
  }

  function daemonBanner() {
    const banner = document.getElementById("daemon-banner");
    if (!banner) return;  // the login page: no token yet
    let retry = 0, wasDown = false;
    function connect() {
      const proto = location.protocol === "https:" ? "wss" : "ws";
      const ws = new WebSocket(`${proto}://${location.host}/ws/daemon`);
      ws.onopen = () => { retry = 0; };
      ws.onmessage = (e) => {
        const msg = JSON.parse(e.data);
        banner.hidden = msg.alive; banner.textContent = msg.message;
        if (msg.stopped) {
          const button = document.createElement("button");
          button.id = "daemon-start"; button.textContent = "Start";
          button.onclick = () => startDaemon(button);
          banner.append(" ", button);
        }
        if (msg.alive && wasDown) toast(`The daemon is back (pid ${msg.pid}).`, "info");
        wasDown = !msg.alive;
      };
      ws.onclose = () => setTimeout(connect, Math.min(5000, 300 * 2 ** retry++));
    }
    connect();
  }

  document.addEventListener("DOMContentLoaded", daemonBanner);
  document.addEventListener("DOMContentLoaded", () => formatTimes(document));
  document.addEventListener("htmx:load", (e) => formatTimes(e.target));
  return {toast, duration, throttled};
})();
