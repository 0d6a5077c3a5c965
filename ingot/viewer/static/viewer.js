// ingot view: the page. Data comes from /api/graph (served) or an inline JSON element (--html);
// the layout runs in a Web Worker (layout.js); the graph is SVG inside one transformed <g>.
"use strict";

const V = window.ingotViewer = {};   // a handle for tests and the console
window.__ingot = {firstPaint: null, layouts: 0, marks: {}};
const mark = name => { if (!(name in window.__ingot.marks)) window.__ingot.marks[name] = Math.round(performance.now()); };
const $ = id => document.getElementById(id);
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const fmtBytes = b => b >= 1 << 20 ? (b / (1 << 20)).toFixed(2) + " MiB" : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B";
const fmtNum = x => typeof x !== "number" ? String(x) : Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(3) : +x.toFixed(5) + "";

let D = null;                       // the model's data
const S = V.state = {collapsed: new Set(), selected: null, device: "", overlay: "", view: {x: 0, y: 0, k: 1},
           layout: null, vis: null, filterOp: null, matches: []};
const CAT = {quantized_matmul: "matmul", matmul: "matmul", quantized_gather: "matmul", gather: "matmul", sdpa: "attention",
             softmax: "attention", rms_norm: "norm", layer_norm: "norm", variable: "state", assign: "state",
             slice_update: "state", placeholder: "input", reshape: "shape", transpose: "shape", slice: "shape",
             concat: "shape", broadcast_to: "shape", array_view: "shape"};

// ---- data ------------------------------------------------------------------------------------------
async function loadData() {
  const inline = document.getElementById("ingot-data");
  if (inline) return JSON.parse(inline.textContent);
  const r = await fetch("api/graph");
  if (!r.ok) throw new Error("the server answered " + r.status);
  return r.json();
}

function prepare() {
  D.drawn = D.nodes.filter(n => n.kind !== "constant").map(n => n.i);
  D.users = D.nodes.map(() => []);
  for (const n of D.nodes) for (const s of n.src) D.users[s].push(n.i);
  D.groupById = {};
  D.blockOf = new Int32Array(D.nodes.length).fill(-1);
  D.groups.forEach((g, k) => { D.groupById[g.id] = g; g.k = k; });
  D.groups.forEach((g, k) => { for (const i of g.nodes || []) D.blockOf[i] = k; });
  for (const g of D.groups) S.collapsed.add(g.id);       // folded at first: one box for the repeated blocks
  D.text = D.nodes.map(n => [n.op, n.name || "", n.type, ...Object.entries(n.attrs || {}).map(([k, v]) => k + "=" + v)]
    .join(" ").toLowerCase());
  D.regionOf = {};
  for (const dev of Object.keys(D.regions)) {
    D.regionOf[dev] = {};
    D.regions[dev].groups.forEach((g, k) => g.nodes.forEach(i => { D.regionOf[dev][i] = k; }));
  }
}

const label = n => n.kind === "variable" || n.kind === "input" ? n.name : n.op;
function subtitle(n) {
  let s = n.type;
  if (n.kind === "op" && n.name) s = n.name + " " + s;
  if (S.overlay === "profile" && D.profile && D.profile.nodes[n.i] !== undefined) s = fmtMs(D.profile.nodes[n.i]) + "  " + s;
  if (S.overlay === "qerror") { const e = qerrorOf(n.i); if (e !== null) s = "err " + (e * 100).toFixed(2) + "%  " + s; }
  return s.length > 44 ? s.slice(0, 43) + "…" : s;
}
const fmtMs = ms => ms >= 1 ? ms.toFixed(2) + " ms" : (ms * 1000).toFixed(1) + " µs";

// the visible item of a node: itself, or the outermost folded group holding it
function visibleOf(i) {
  let k = D.blockOf[i];
  if (k < 0) return "n" + i;
  let item = "n" + i;
  while (k >= 0) {
    const g = D.groups[k];
    if (S.collapsed.has(g.id)) item = "g" + g.id;
    k = g.parent ? D.groupById[g.parent].k : -1;
  }
  return item;
}

function visibleGraph() {
  const items = [], at = new Map(), edges = [], seen = new Set();
  const add = id => { if (!at.has(id)) { at.set(id, items.length); items.push(id); } return at.get(id); };
  for (const i of D.drawn) {
    const b = add(visibleOf(i));
    for (const s of D.nodes[i].src) {
      if (D.nodes[s].kind === "constant") continue;
      const a = add(visibleOf(s));
      const key = a + ":" + b;
      if (a !== b && !seen.has(key)) { seen.add(key); edges.push([a, b]); }
    }
  }
  const sizes = items.map(id => id[0] === "g" ? {w: 240, h: 46} : nodeSize(D.nodes[+id.slice(1)]));
  return {items, at, edges, sizes};
}

function nodeSize(n) {
  const chars = Math.max(label(n).length * 1.15, Math.min(44, subtitle(n).length) * 0.9);
  return {w: Math.max(70, Math.round(chars * 6.6 + 20)), h: 34};
}

function groupInfo(id) {
  const g = D.groupById[id];
  const members = [];
  const collect = gg => { for (const i of gg.nodes || []) members.push(i); for (const c of D.groups) if (c.parent === gg.id) collect(c); };
  collect(g);
  return {g, members};
}

// ---- layout (Web Worker) ---------------------------------------------------------------------------
let worker = null, pending = new Map(), nextId = 1;
function makeWorker() {
  const inline = document.getElementById("ingot-layout");
  const url = inline ? URL.createObjectURL(new Blob([inline.textContent], {type: "text/javascript"})) : "static/layout.js";
  const w = new Worker(url);
  w.onmessage = ev => { const done = pending.get(ev.data.id); pending.delete(ev.data.id); if (done) done(ev.data); };
  w.onerror = ev => { status("the layout failed: " + (ev.message || "an error in the worker")); window.__ingot.error = ev.message; };
  return w;
}
function runLayout(vis) {
  const id = nextId++;
  const r = $("canvas").getBoundingClientRect();
  const msg = {id, nodes: vis.sizes, edges: vis.edges, aspect: r.width > 0 && r.height > 0 ? r.width / r.height : 0};
  // a one-file page (--html) lays out its first view here, before the page's load event: a screenshot
  // taken as soon as it loads shows the graph; later layouts (unfolding) go to the worker
  if (window.ingotLayout && !S.layout) return Promise.resolve(window.ingotLayout(msg));
  worker = worker || makeWorker();
  return new Promise(resolve => {
    pending.set(id, resolve);
    worker.postMessage(msg);
  });
}

async function relayout(keepView) {
  const vis = visibleGraph();
  status(`laying out ${vis.items.length} items…`);
  const t0 = performance.now();
  mark("visible");
  const lay = await runLayout(vis);
  mark("laid out");
  S.vis = vis; S.layout = lay;
  window.__ingot.layouts++;
  window.__ingot.layoutMs = performance.now() - t0;
  if (!keepView) fit();      // before the new content is in the page: reading its size is then cheap
  render();
  mark("rendered");
  status(`${D.drawn.length} ops and values (${Object.keys(D.constants).length} constants not drawn), ` +
         `${vis.items.length} shown · layout ${Math.round(window.__ingot.layoutMs)} ms`);
}

// ---- rendering -------------------------------------------------------------------------------------
function itemClass(id) {
  if (id[0] === "g") return "node group";
  const n = D.nodes[+id.slice(1)];
  return "node cat-" + (CAT[n.op] || "other") + " op-" + n.op;
}

function heat(t) {  // 0..1 -> white..red
  const c = Math.round(255 - 200 * Math.min(1, Math.max(0, t)));
  return `rgb(255,${c},${Math.round(c * 0.85)})`;
}

function overlayFill(id) {
  if (!S.overlay) return null;
  const ids = id[0] === "g" ? groupInfo(id.slice(1)).members : [+id.slice(1)];
  if (S.overlay === "profile" && D.profile) {
    let t = 0; for (const i of ids) t += D.profile.nodes[i] || 0;
    const max = D.profile.maxNode || 1;
    return t ? heat(Math.sqrt(t / (id[0] === "g" ? max * ids.length / 3 : max))) : null;
  }
  if (S.overlay === "qerror" && D.qerror) {
    let e = null; for (const i of ids) { const x = qerrorOf(i); if (x !== null) e = Math.max(e || 0, x); }
    return e === null ? null : heat(e / (D.qerror.max || 1));
  }
  return null;
}

function qerrorOf(i) {
  if (!D.qerror) return null;
  let worst = null;
  for (const s of D.nodes[i].src) { const e = D.qerror.constants[s]; if (e) worst = Math.max(worst || 0, e.relative); }
  const own = D.qerror.constants[i];
  return own ? own.relative : worst;
}

const FAR = 0.3;   // below this zoom, labels are too small to read: they are left out of the page

function render() {
  S.far = S.view.k < FAR;
  const svg = $("graph");
  mark("svg text");
  const {markup, shown, hidden} = graphMarkup(!S.far);
  svg.innerHTML = markup;
  mark("svg dom");
  applyView();
  mark("view");
  legend(shown, hidden);
  mark("legend");
  if (window.__ingot.firstPaint === null) {
    // a task queued from a frame callback runs once that frame is painted
    requestAnimationFrame(() => { mark("frame"); setTimeout(() => { window.__ingot.firstPaint = performance.now(); }, 0); });
  }
}

function graphMarkup(withText) {
  const {items} = S.vis, lay = S.layout;
  const parts = ['<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" orient="auto">' +
                 '<path d="M0,0L8,4L0,8z" fill="#8a94a8"/></marker></defs>', '<g id="viewport">'];
  const box = k => { const s = S.vis.sizes[k]; return [lay.x[k] - s.w / 2, lay.y[k] - s.h / 2, s.w, s.h]; };
  // outlines of unfolded blocks
  parts.push('<g class="blocks">');
  for (const g of D.groups) {
    if (S.collapsed.has(g.id) || !g.nodes) continue;
    const ks = g.nodes.map(i => S.vis.at.get("n" + i)).filter(k => k !== undefined);
    if (!ks.length) continue;
    const byColumn = new Map();   // a block cut between two columns gets an outline in each
    for (const k of ks) { const c = lay.column ? lay.column[k] : 0; if (!byColumn.has(c)) byColumn.set(c, []); byColumn.get(c).push(k); }
    [...byColumn.keys()].sort((a, b) => a - b).forEach((c, part) => {
      const [x0, y0, x1, y1] = bounds(byColumn.get(c).map(box), 10);
      parts.push(`<rect class="block-outline" x="${x0}" y="${y0}" width="${x1 - x0}" height="${y1 - y0}"/>` +
                 `<text class="block-label" x="${x0 + 6}" y="${y0 + 12}">${esc(g.label)}${part ? " (continued)" : ""}</text>`);
    });
  }
  parts.push("</g>");
  // fused regions of the chosen device
  parts.push('<g class="regions">');
  let shown = 0, hidden = 0;
  if (S.device) {
    for (const r of D.regions[S.device].groups) {
      const ks = r.nodes.map(i => "n" + i).filter(id => S.vis.at.has(id)).map(id => S.vis.at.get(id));
      if (ks.length < r.nodes.length) { hidden++; continue; }
      const [x0, y0, x1, y1] = bounds(ks.map(box), 6);
      parts.push(`<rect class="region ${S.device} kind-${r.kind}" x="${x0}" y="${y0}" width="${x1 - x0}" height="${y1 - y0}"><title>${esc(r.label)}</title></rect>`);
      shown++;
    }
  }
  parts.push("</g>");
  // edges: one path each with arrowheads when near; zoomed far out, all of them one path (a smaller page)
  parts.push('<g class="edges">');
  const far = [], farStubs = [];
  for (const e of lay.edges) {
    const p = e.points;
    if (e.stub) {
      const [tx, ty] = p[p.length - 1];
      if (!withText) { farStubs.push(`M${tx},${ty - 16}L${tx},${ty}`); continue; }
      parts.push(`<path class="edge stub" d="M${tx},${ty - 16}L${tx},${ty}" marker-end="url(#arrow)"/>` +
                 `<text class="stub-label" x="${tx}" y="${ty - 19}">${esc(itemName(items[e.s]))}</text>`);
      continue;
    }
    let d = `M${p[0][0]},${p[0][1]}`;
    for (let k = 1; k < p.length; k++) {
      const [x0, y0] = p[k - 1], [x1, y1] = p[k], my = (y0 + y1) / 2;
      d += `C${x0},${my} ${x1},${my} ${x1},${y1}`;
    }
    if (withText) parts.push(`<path class="edge" d="${d}" marker-end="url(#arrow)"/>`);
    else far.push(d);
  }
  if (far.length) parts.push(`<path class="edge" d="${far.join("")}"/>`);
  if (farStubs.length) parts.push(`<path class="edge stub" d="${farStubs.join("")}"/>`);
  parts.push("</g>", '<g class="nodes">');
  items.forEach((id, k) => {
    const [x, y, w, h] = box(k);
    const fill = overlayFill(id);
    const style = fill ? ` style="fill:${fill}"` : "";
    let title, sub;
    if (id[0] === "g") {
      const {g, members} = groupInfo(id.slice(1));
      title = g.repeat ? `${g.label}  ×${g.repeat}` : g.label;
      sub = `${members.length} ops · double-click to unfold`;
    } else {
      const n = D.nodes[+id.slice(1)];
      title = label(n); sub = subtitle(n);
    }
    const cls = itemClass(id) + (S.selected === id ? " selected" : "") + (S.matchSet && S.matchSet.has(id) ? " match" : "");
    if (!withText) {   // far out: the box alone, one element
      parts.push(`<rect class="${cls}" data-item="${id}" x="${x}" y="${y}" width="${w}" height="${h}"${style}/>`);
      return;
    }
    parts.push(`<g class="${cls}" data-item="${id}" transform="translate(${x},${y})"><rect width="${w}" height="${h}"${style}/>` +
               `<text x="${w / 2}" y="14">${esc(title)}</text><text class="sub" x="${w / 2}" y="${h - 7}">${esc(sub)}</text></g>`);
  });
  parts.push("</g></g>");
  return {markup: parts.join(""), shown, hidden};
}

function itemName(id) {
  if (id[0] === "g") return D.groupById[id.slice(1)].label;
  const n = D.nodes[+id.slice(1)];
  return n.name || n.op;
}

function bounds(boxes, pad) {
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  for (const [x, y, w, h] of boxes) { x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + w); y1 = Math.max(y1, y + h); }
  return [x0 - pad, y0 - pad, x1 + pad, y1 + pad];
}

function legend(shown, hidden) {
  const parts = [];
  if (S.device) {
    const r = D.regions[S.device];
    parts.push(`<b>${S.device}</b>: ${r.groups.length} fused group(s)` + (hidden ? ` (${hidden} inside folded blocks: unfold to see)` : "") +
               `<div class="note">${esc(r.note)}</div>`);
  }
  if (S.overlay === "profile") parts.push(D.profile ? `time per node: ${D.profile.runs} run(s) on ${D.profile.device}, ` +
    `${fmtMs(D.profile.total_ms)} per run` : "no profile: run <code>ingot view --profile</code>");
  if (S.overlay === "qerror") parts.push(D.qerror ? `quantization error vs ${esc(D.qerror.reference)} (relative RMS, worst ${(100 * D.qerror.max).toFixed(2)}%)`
    : "no reference: run <code>ingot view --reference REF</code>");
  $("legend").innerHTML = parts.join("<br>");
}

function status(text) { $("status").textContent = text; }

// ---- pan and zoom ------------------------------------------------------------------------------------
function applyView() {
  const g = document.getElementById("viewport");
  if (S.layout && S.far !== undefined && S.far !== S.view.k < FAR) { render(); markSelected(); return; }
  if (g) g.setAttribute("transform", `translate(${S.view.x},${S.view.y}) scale(${S.view.k})`);
}
function fit() {
  if (!S.layout) return;
  const r = $("canvas").getBoundingClientRect();
  // a margin of 20 px, 36 at the top where the status line lies over the canvas
  const k = Math.min(1.5, Math.max(0.02, Math.min((r.width - 40) / (S.layout.width || 1), (r.height - 56) / (S.layout.height || 1))));
  S.view = {k, x: (r.width - S.layout.width * k) / 2, y: 36};
  applyView();
}
function centerOn(k, zoom) {
  const r = $("graph").getBoundingClientRect();
  S.view.k = zoom || Math.max(S.view.k, 0.9);
  S.view.x = r.width / 2 - S.layout.x[k] * S.view.k;
  S.view.y = r.height / 2 - S.layout.y[k] * S.view.k;
  applyView();
}
function setupPanZoom() {
  const svg = $("graph");
  let drag = null;
  svg.addEventListener("wheel", ev => {
    ev.preventDefault();
    const r = svg.getBoundingClientRect(), px = ev.clientX - r.left, py = ev.clientY - r.top;
    const f = Math.exp(-ev.deltaY * 0.0015), k = Math.min(4, Math.max(0.01, S.view.k * f));
    S.view.x = px - (px - S.view.x) * k / S.view.k; S.view.y = py - (py - S.view.y) * k / S.view.k; S.view.k = k;
    applyView();
  }, {passive: false});
  svg.addEventListener("mousedown", ev => { drag = {x: ev.clientX, y: ev.clientY, vx: S.view.x, vy: S.view.y, moved: false}; });
  window.addEventListener("mousemove", ev => {
    if (!drag) return;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
    S.view.x = drag.vx + dx; S.view.y = drag.vy + dy; applyView();
  });
  window.addEventListener("mouseup", () => { setTimeout(() => { drag = null; }, 0); });
  svg.addEventListener("click", ev => {
    if (drag && drag.moved) return;
    const el = ev.target.closest(".node");
    if (el) select(el.dataset.item, false);
  });
  svg.addEventListener("dblclick", ev => {
    const el = ev.target.closest(".node");
    if (el && el.dataset.item[0] === "g") toggleGroup(el.dataset.item.slice(1));
  });
}

// ---- selection, focus, folding ---------------------------------------------------------------------
function markSelected() {
  for (const el of document.querySelectorAll(".node.selected")) el.classList.remove("selected");
  const el = S.selected && document.querySelector(`.node[data-item="${S.selected}"]`);
  if (el) el.classList.add("selected");
}
function select(item, center) {
  S.selected = item;
  markSelected();
  if (center && S.vis.at.has(item)) centerOn(S.vis.at.get(item));
  if (item[0] === "g") inspectGroup(item.slice(1)); else inspectNode(+item.slice(1));
}
async function focusNode(i) {   // unfold what hides node i, lay out again if needed, centre and select it
  if (D.nodes[i].kind === "constant") {   // constants are not drawn: focus the first reader, inspect the constant
    const u = D.users[i][0];
    if (u !== undefined) await focusNode(u);
    return inspectConstant(i);
  }
  let changed = false;
  for (let k = D.blockOf[i]; k >= 0; k = D.groups[k].parent ? D.groupById[D.groups[k].parent].k : -1) {
    if (S.collapsed.has(D.groups[k].id)) { S.collapsed.delete(D.groups[k].id); changed = true; }
  }
  if (changed) await relayout(true);
  select("n" + i, true);
}
V.focusNode = focusNode;
async function toggleGroup(id) {
  const g = D.groupById[id];
  if (S.collapsed.has(id)) {
    S.collapsed.delete(id);
  } else S.collapsed.add(id);
  await relayout(true);
  if (S.vis.at.has("g" + id)) return select("g" + id, true);
  // unfolded: show the whole group
  const ks = [...new Set(groupInfo(id).members.map(visibleOf))].map(v => S.vis.at.get(v)).filter(k => k !== undefined);
  if (ks.length) fitBox(bounds(ks.map(k => [S.layout.x[k] - S.vis.sizes[k].w / 2, S.layout.y[k] - S.vis.sizes[k].h / 2,
                                              S.vis.sizes[k].w, S.vis.sizes[k].h]), 20));
}
function fitBox([x0, y0, x1, y1]) {
  const r = $("canvas").getBoundingClientRect();
  const k = Math.min(1, Math.max(0.02, Math.min(r.width / (x1 - x0), r.height / (y1 - y0))));
  S.view = {k, x: (r.width - (x1 - x0) * k) / 2 - x0 * k, y: Math.max(0, (r.height - (y1 - y0) * k) / 2) - y0 * k};
  applyView();
}
V.fitBox = fitBox;
V.toggleGroup = toggleGroup;

// ---- inspector -------------------------------------------------------------------------------------
const nodeLink = i => { const n = D.nodes[i]; return `<span class="link" data-node="${i}">${esc(n.name || n.op)}</span> <span class="note">${esc(n.op)} #${i} ${esc(n.type)}</span>`; };
function inspectNode(i) {
  const n = D.nodes[i], h = [];
  h.push(`<h2>${esc(n.op)}</h2>`);
  if (n.name) h.push(`<div><b>${esc(n.name)}</b></div>`);
  h.push(`<table><tr><td>node</td><td>#${i} (IR id ${n.id})</td></tr><tr><td>output</td><td>${esc(n.type)}</td></tr>`);
  for (const [k, v] of Object.entries(n.attrs || {})) h.push(`<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`);
  const bk = D.blockOf[i];
  if (bk >= 0) h.push(`<tr><td>block</td><td>${esc(D.groups[bk].label)}</td></tr>`);
  for (const dev of Object.keys(D.regions)) {
    const r = D.regionOf[dev][i];
    if (r !== undefined) h.push(`<tr><td>fused on ${dev}</td><td>${esc(D.regions[dev].groups[r].label)}</td></tr>`);
  }
  if (D.profile && D.profile.nodes[i] !== undefined) h.push(`<tr><td>time</td><td>${fmtMs(D.profile.nodes[i])} per run (${D.profile.device})</td></tr>`);
  h.push("</table>");
  if (n.src.length) {
    h.push("<h3>inputs (producers)</h3><ol start=0>");
    for (const s of n.src) {
      const c = D.constants[s];
      h.push(`<li>${nodeLink(s)}${c ? ` <span class="note">${esc(c.format)}, ${fmtBytes(c.bytes)}</span>` : ""}</li>`);
    }
    h.push("</ol>");
  }
  const users = D.users[i];
  h.push(`<h3>consumers (${users.length})</h3><ul>` + users.slice(0, 200).map(u => `<li>${nodeLink(u)}</li>`).join("") + "</ul>");
  if (n.kind === "variable") h.push(variableSection(n.name));
  if (n.kind === "assign") { const v = D.nodes[n.src[0]]; h.push(`<h3>assigns variable</h3>${nodeLink(n.src[0])}`); if (v) h.push(variableSection(v.name)); }
  $("inspector").innerHTML = h.join("");
}
function variableSection(name) {
  const v = D.variables[name];
  if (!v) return "";
  const list = (title, ids, cls) => `<h3>${title} (${ids.length})</h3><ul class="${cls}">` + ids.map(i => `<li>${nodeLink(i)}</li>`).join("") + "</ul>";
  return `<div class="variable-sites"><h3>variable ${esc(name)}</h3><div class="note">created by ${nodeLink(v.node)}, ${esc(v.type)}` +
    (v.initial ? `, initial value: ${esc(v.initial)}` : "") + ` (one copy per state: each sequence has its own)</div>` + list("assigned at", v.assigned, "assigned") +
    list("written in place by", v.written, "written") + list("read by", v.read, "read") + "</div>";
}
function inspectGroup(id) {
  const {g, members} = groupInfo(id);
  const counts = {};
  for (const i of members) counts[D.nodes[i].op] = (counts[D.nodes[i].op] || 0) + 1;
  $("inspector").innerHTML = `<h2>${esc(g.label)}</h2><div class="note">${esc(g.note || "")}</div>` +
    `<p><button id="toggle-group">${S.collapsed.has(id) ? "unfold" : "fold"}</button></p><table>` +
    Object.entries(counts).sort((a, b) => b[1] - a[1]).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${v}</td></tr>`).join("") + "</table>";
  $("toggle-group").onclick = () => toggleGroup(id);
}

async function preview(i) {
  if (D.previews && D.previews[i]) return D.previews[i];
  D.previews = D.previews || {};
  const r = await fetch("api/constant/" + i);
  if (!r.ok) throw new Error("preview: " + r.status);
  return (D.previews[i] = await r.json());
}
async function inspectConstant(i) {
  const n = D.nodes[i], c = D.constants[i];
  const box = document.createElement("div");
  box.className = "constant";
  const gguf = c.gguf ? `<tr><td>GGUF tensors</td><td>${c.gguf.map(p => esc(p.name) + " (" + esc(p.type) + ")").join("<br>")}</td></tr>`
    : c.parts ? `<tr><td>holds</td><td>${c.parts.map(esc).join("<br>")}</td></tr>` : "";
  box.innerHTML = `<h2>constant</h2><div><b>${esc(c.key)}</b></div><table>` +
    `<tr><td>type</td><td>${esc(n.type)}</td></tr><tr><td>format</td><td>${esc(c.format)}</td></tr>` +
    `<tr><td>role</td><td>${esc(c.role)}${c.weight !== undefined ? " of " + nodeLink(c.weight) : ""}</td></tr>` +
    `<tr><td>elements</td><td>${c.elements.toLocaleString()}</td></tr><tr><td>bytes</td><td>${fmtBytes(c.bytes)}` +
    (c.bytes_with_params ? ` (${fmtBytes(c.bytes_with_params)} with parameters)` : "") + `</td></tr>${gguf}` +
    `<tr><td>read by</td><td>${D.users[i].map(nodeLink).join("<br>")}</td></tr></table><div class="preview">loading preview…</div>`;
  $("inspector").innerHTML = "";
  $("inspector").appendChild(box);
  try { drawPreview(box.querySelector(".preview"), await preview(i), c); }
  catch (e) { box.querySelector(".preview").textContent = String(e); }
}
function histogramSvg(h, w = 300, hgt = 80) {
  const max = Math.max(1, ...h.counts), bw = w / h.counts.length;
  const bars = h.counts.map((c, k) => `<rect x="${k * bw}" y="${hgt - c / max * hgt}" width="${Math.max(1, bw - 1)}" height="${c / max * hgt}" fill="#4a72c4"/>`).join("");
  return `<svg class="histogram" width="${w}" height="${hgt + 14}" xmlns="http://www.w3.org/2000/svg">${bars}` +
    `<text x="0" y="${hgt + 12}" font-size="10">${fmtNum(h.lo)}</text><text x="${w}" y="${hgt + 12}" font-size="10" text-anchor="end">${fmtNum(h.hi)}</text></svg>`;
}
function drawPreview(el, p, c) {
  const h = [];
  if (p.histogram) {
    h.push(`<h3>values${p.sample.elements < p.sample.of ? ` (first ${p.sample.elements.toLocaleString()} of ${p.sample.of.toLocaleString()})` : ""}</h3>`);
    h.push(histogramSvg(p.histogram));
    const s = p.values;
    h.push(`<div class="note">min ${fmtNum(s.min)} · max ${fmtNum(s.max)} · mean ${fmtNum(s.mean)} · std ${fmtNum(s.std)}</div>`);
  }
  if (p.heatmap) h.push(`<h3>heatmap of the top-left ${p.heatmap.rows}×${p.heatmap.cols}</h3><canvas class="heatmap"></canvas>` +
                        `<div class="note">${fmtNum(p.heatmap.min)} (blue) … ${fmtNum(p.heatmap.max)} (red)</div>`);
  if (p.codes) {
    h.push(`<h3>integer codes (all ${p.codes.counts.reduce((a, b) => a + b, 0).toLocaleString()})</h3>`);
    h.push(histogramSvg({lo: p.codes.labels[0], hi: p.codes.labels[p.codes.labels.length - 1], counts: p.codes.counts}));
  }
  for (const [name, q] of Object.entries(p.params || {})) {
    h.push(`<h3>${esc(name)} [${q.shape.join(", ")}]</h3><div class="note param-stats">min ${fmtNum(q.min)} · max ${fmtNum(q.max)} · ` +
           `mean ${fmtNum(q.mean)} · std ${fmtNum(q.std)} · ${q.count.toLocaleString()} values</div>`);
    if (q.histogram) h.push(histogramSvg(q.histogram, 300, 50));
    if (q.values) h.push(`<div class="note">LUT (${q.tables} table(s)), first: ${q.values.map(fmtNum).join(", ")}</div>`);
  }
  el.innerHTML = h.join("");
  const canvas = el.querySelector("canvas.heatmap");
  if (canvas && p.heatmap.rows) {
    const {rows, cols, data} = p.heatmap, bytes = Uint8Array.from(atob(data), ch => ch.charCodeAt(0));
    canvas.width = cols; canvas.height = rows;
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(cols, rows);
    for (let k = 0; k < rows * cols; k++) {
      const t = bytes[k] / 255;
      img.data[4 * k] = Math.round(255 * Math.min(1, 2 * t)); img.data[4 * k + 1] = Math.round(255 * (1 - Math.abs(2 * t - 1)));
      img.data[4 * k + 2] = Math.round(255 * Math.min(1, 2 - 2 * t)); img.data[4 * k + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }
}

function inspectModel() {   // what the inspector shows before anything is selected
  const m = D.model, q = D.quantized;
  const changed = m.history.filter(([, c]) => c).map(([p]) => p), same = m.history.filter(([, c]) => !c).map(([p]) => p);
  $("inspector").innerHTML = `<h2>model</h2><div class="model-path"><b>${esc(m.path.split(/[\\/]/).pop())}</b> <span class="note">(${esc(m.kind)})</span></div>` +
    m.notes.map(t => `<div class="note">${esc(t)}</div>`).join("") +
    `<h3>inputs</h3><ul>${m.inputs.map(([n, t]) => `<li>${esc(n)} <span class="note">${esc(t)}</span></li>`).join("")}</ul>` +
    `<table><tr><td>ops and values</td><td>${D.drawn.length}</td></tr><tr><td>outputs, assigns</td><td>${D.outputs.length}, ${D.assigns.length}</td></tr>` +
    `<tr><td>constants</td><td>${Object.keys(D.constants).length} (${q.tensors} quantized weights, ${fmtBytes(q.bytes)})</td></tr>` +
    `<tr><td>variables</td><td>${Object.keys(D.variables).length}</td></tr></table>` +
    (m.history.length ? `<h3>compile passes</h3><div class="note">changed the graph: ${esc(changed.join(", ") || "none")}</div>` +
      `<div class="note">no change: ${esc(same.join(", ") || "none")}</div>` : "") +
    `<p class="hint">Click a node, a constant or a variable; double-click a folded block to unfold it.</p>`;
}

// ---- navigators ------------------------------------------------------------------------------------
const LIST_LIMIT = 20000;   // rows in a navigator list; past that, a search narrows it
function renderOps() {
  const counts = D.counts;
  $("op-counts").innerHTML = `<table>` + Object.entries(counts).map(([op, c]) =>
    `<tr data-op="${esc(op)}" class="${S.filterOp === op ? "active" : ""}"><td>${esc(op)}</td><td class="n">${c}</td></tr>`).join("") +
    `<tr data-op=""><td><i>all ops</i></td><td class="n">${Object.values(counts).reduce((a, b) => a + b, 0)}</td></tr></table>`;
  const q = $("search").value.trim().toLowerCase();
  const hits = D.drawn.filter(i => (!S.filterOp || D.nodes[i].op === S.filterOp) && (!q || D.text[i].includes(q)));
  S.matches = hits;
  $("op-list").innerHTML = hits.slice(0, LIST_LIMIT).map(i => { const n = D.nodes[i], b = D.blockOf[i];
    const meta = (n.name ? n.op + " " : "") + (b >= 0 ? D.groups[b].label + " " : "") + n.type;
    return `<div class="row" data-node="${i}">${esc(n.name || n.op)} <span class="meta">${esc(meta)}</span></div>`; }).join("") +
    (hits.length > LIST_LIMIT ? `<div class="more">${hits.length - LIST_LIMIT} more: refine the search</div>` : "") +
    `<div class="more" id="op-total">${hits.length} op(s)</div>`;
}
function renderConstants() {
  const q = D.quantized, parts = [];
  const total = Object.keys(D.constants).length;
  parts.push(`<div><b>${total}</b> constants, <b>${q.tensors}</b> quantized weights (${fmtBytes(q.bytes)} with parameters)</div>`);
  for (const [f, c] of Object.entries(q.formats)) parts.push(`<div class="note format-count" data-format="${esc(f)}">${c} × ${esc(f)}</div>`);
  const gg = Object.entries(q.gguf || {});
  const why = " — weights that multiply the same input (q/k/v, gate/up) are stored side by side as one constant";
  if (gg.length) parts.push(`<div class="note gguf-count">from GGUF tensors: ${gg.map(([t, c]) => `${c} ${esc(t)}`).join(", ")}${why}</div>`);
  else if (q.held > q.tensors) parts.push(`<div class="note gguf-count">holding ${q.held} original weight tensors${why}</div>`);
  $("const-summary").innerHTML = parts.join("");
  const key = $("const-sort").value;
  const rows = Object.entries(D.constants).map(([i, c]) => [+i, c]);
  rows.sort(key === "name" ? (a, b) => a[1].key.localeCompare(b[1].key) : (a, b) => b[1][key] - a[1][key]);
  $("const-list").innerHTML = rows.slice(0, LIST_LIMIT).map(([i, c]) =>
    `<div class="row" data-const="${i}" title="${esc(c.key)}">${esc(c.key)} <span class="meta">${esc(c.format)} · ${fmtBytes(c.bytes)} · ${c.elements.toLocaleString()} el.</span></div>`).join("") +
    (rows.length > LIST_LIMIT ? `<div class="more">${rows.length - LIST_LIMIT} more (smaller)</div>` : "");
}
function renderVariables() {
  $("var-list").innerHTML = Object.entries(D.variables).map(([name, v]) =>
    `<div class="row" data-node="${v.node}">${esc(name)} <span class="meta">${esc(v.type)} · ${v.assigned.length} assign, ${v.read.length} read</span></div>`).join("");
}

function search(focus) {
  renderOps();
  const q = $("search").value.trim().toLowerCase();
  S.matchSet = new Set(q ? S.matches.map(i => visibleOf(i)) : []);
  for (const el of document.querySelectorAll(".node.match")) el.classList.remove("match");
  for (const id of S.matchSet) { const el = document.querySelector(`.node[data-item="${id}"]`); if (el) el.classList.add("match"); }
  if (focus && S.matches.length) return focusNode(S.matches[0]);
  if (focus && q) {   // a constant's name: focus its first reader
    const hit = Object.entries(D.constants).find(([, c]) => c.key.toLowerCase().includes(q));
    if (hit) return focusNode(+hit[0]);
  }
}

// ---- export ----------------------------------------------------------------------------------------
// the area to export, in layout coordinates: the whole graph, or what the window shows now
function exportArea() {
  const pad = 20, lay = S.layout;
  if ($("export-area").value !== "view") return [-pad, -pad, lay.width + 2 * pad, lay.height + 2 * pad];
  const r = $("canvas").getBoundingClientRect(), k = S.view.k;
  return [-S.view.x / k, -S.view.y / k, r.width / k, r.height / k];
}
function svgText() {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.innerHTML = graphMarkup(true).markup;    // labels always, whatever the zoom
  const [x, y, w, h] = exportArea();
  svg.setAttribute("xmlns", "http://www.w3.org/2000/svg");
  svg.setAttribute("viewBox", `${x} ${y} ${w} ${h}`);
  svg.setAttribute("width", Math.ceil(w)); svg.setAttribute("height", Math.ceil(h));
  svg.querySelector("#viewport").removeAttribute("id");
  const css = [];
  for (const sheet of document.styleSheets) {
    try { for (const rule of sheet.cssRules) if (/\.(node|edge|stub|region|block)/.test(rule.selectorText || "")) css.push(rule.cssText); } catch (e) { /* other origin */ }
  }
  const style = document.createElementNS("http://www.w3.org/2000/svg", "style");
  style.textContent = css.join("\n");
  svg.insertBefore(style, svg.firstChild);
  const bg = document.createElementNS("http://www.w3.org/2000/svg", "rect");
  for (const [k, v] of [["x", x], ["y", y], ["width", w], ["height", h], ["fill", "#ffffff"]]) bg.setAttribute(k, v);
  svg.insertBefore(bg, style.nextSibling);
  return '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(svg);
}
V.svgText = svgText;
function download(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob); a.download = name;
  document.body.appendChild(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}
function baseName() { return (D.model.path.split(/[\\/]/).pop() || "graph").replace(/\.[^.]*$/, "") || "graph"; }
function exportSvg() { download(new Blob([svgText()], {type: "image/svg+xml"}), baseName() + ".svg"); }
async function exportPng() {
  const text = svgText(), [, , w, h] = exportArea();
  const scale = Math.min(2, 16000 / Math.max(w, h));
  const img = new Image();
  const url = URL.createObjectURL(new Blob([text], {type: "image/svg+xml"}));
  await new Promise((ok, fail) => { img.onload = ok; img.onerror = () => fail(new Error("the SVG did not load as an image")); img.src = url; });
  const canvas = document.createElement("canvas");
  canvas.width = Math.ceil(w * scale); canvas.height = Math.ceil(h * scale);
  const ctx = canvas.getContext("2d");
  ctx.scale(scale, scale); ctx.drawImage(img, 0, 0, w, h);
  URL.revokeObjectURL(url);
  const blob = await new Promise(ok => canvas.toBlob(ok, "image/png"));
  download(blob, baseName() + ".png");
}

// ---- wiring ----------------------------------------------------------------------------------------
function wire() {
  setupPanZoom();
  document.body.addEventListener("click", ev => {
    const t = ev.target.closest("[data-node], [data-const], [data-op], .tabs button");
    if (!t) return;
    if (t.dataset.tab) {
      for (const b of document.querySelectorAll(".tabs button")) b.classList.toggle("active", b === t);
      for (const s of document.querySelectorAll(".tab")) s.classList.toggle("active", s.id === "tab-" + t.dataset.tab);
    } else if (t.dataset.node !== undefined) focusNode(+t.dataset.node);
    else if (t.dataset.const !== undefined) { const i = +t.dataset.const; inspectConstant(i); }
    else if (t.dataset.op !== undefined) { S.filterOp = t.dataset.op || null; renderOps(); }
  });
  $("search").addEventListener("input", () => search(false));
  $("search").addEventListener("keydown", ev => { if (ev.key === "Enter") search(true); });
  $("device").addEventListener("change", () => { S.device = $("device").value; render(); markSelected(); });
  $("overlay").addEventListener("change", async () => { S.overlay = $("overlay").value; await relayout(true); markSelected(); });
  $("expand-all").onclick = async () => { S.collapsed.clear(); await relayout(false); };
  $("collapse-all").onclick = async () => { for (const g of D.groups) S.collapsed.add(g.id); await relayout(false); };
  $("fit").onclick = fit;
  $("export-svg").onclick = exportSvg;
  $("export-png").onclick = () => exportPng().catch(e => status(String(e)));
  $("const-sort").addEventListener("change", renderConstants);
  window.addEventListener("resize", () => applyView());
}

async function main() {
  if (!window.ingotLayout) worker = makeWorker();   // started now: its script loads while the data does
  try {
    D = await loadData();
  } catch (e) {
    document.body.innerHTML = `<p style="padding:20px">The model's data could not be loaded: ${esc(e.message || e)}</p>`;
    return;
  }
  mark("data");
  prepare();
  if (D.model.device && D.regions[D.model.device]) { S.device = D.model.device; $("device").value = S.device; }
  mark("prepared");
  if (D.profile) { D.profile.maxNode = Math.max(0, ...Object.values(D.profile.nodes)); }
  if (D.qerror) D.qerror.max = Math.max(1e-12, ...Object.values(D.qerror.constants).map(e => e.relative));
  $("title").textContent = "ingot view · " + (D.model.path.split(/[\\/]/).pop() || D.model.path);
  $("title").title = [D.model.path, ...D.model.notes].join("\n");
  document.title = $("title").textContent;
  wire();
  inspectModel();
  await relayout(false);
  mark("graph drawn");
  requestAnimationFrame(() => setTimeout(() => {   // the lists after the graph is on screen
    mark("lists"); renderOps(); renderConstants(); renderVariables(); mark("lists done"); window.__ingot.ready = true;
  }, 0));
}
main();
