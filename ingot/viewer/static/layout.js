// Layered (Sugiyama-style) layout of a directed graph, top to bottom, run in a Web Worker.
//
// in:  {id, nodes: [{w, h}], edges: [[source, target], ...]}
// out: {id, x: [...], y: [...] (node centres), edges: [{s, t, points: [[x, y], ...], stub}], width, height,
//       columns, column: [...] (each node's column)}
//
// 1. break cycles (edges found going back in a depth-first search are laid out reversed)
// 2. layers: longest path from the sources; a source sits just above its first reader
// 3. edges over several layers get one dummy node per layer crossed; edges that span more than
//    LONG layers, or leave a node read by more than FANOUT others, are drawn as short stubs
//    (they would cross everything: a shared position input, a mask)
// 4. order within layers: barycentre sweeps, down and up
// 5. x: each node pulled toward the mean of its neighbours, then spaced, alternately down and up
// 6. a graph much taller than the window (msg.aspect: its width / height) is cut between layers into
//    columns set side by side, like a newspaper's, so that fitting it in the window keeps it readable;
//    an edge from one column to another is drawn as a stub
"use strict";

const LONG = 24, FANOUT = 10, GAP_X = 24, GAP_Y = 36, DUMMY_W = 8, SWEEPS = 4, PASSES = 4, GAP_COLUMN = 80,
      MAX_COLUMNS = 16;

function layout(msg) {
  const n = msg.nodes.length;
  const w = msg.nodes.map(d => d.w), h = msg.nodes.map(d => d.h);
  const out = Array.from({length: n}, () => []), inc = Array.from({length: n}, () => []);
  const edges = [];
  for (const [s, t] of msg.edges) {
    if (s === t) continue;
    edges.push({s, t, rev: false, stub: false});
  }
  // 1. cycles: iterative DFS, an edge to a node on the stack is reversed
  const state = new Uint8Array(n), adj = Array.from({length: n}, () => []);
  edges.forEach((e, k) => adj[e.s].push(k));
  for (let r = 0; r < n; r++) {
    if (state[r]) continue;
    const stack = [[r, 0]]; state[r] = 1;
    while (stack.length) {
      const top = stack[stack.length - 1], v = top[0];
      if (top[1] < adj[v].length) {
        const e = edges[adj[v][top[1]++]];
        if (state[e.t] === 1) e.rev = true;
        else if (!state[e.t]) { state[e.t] = 1; stack.push([e.t, 0]); }
      } else { state[v] = 2; stack.pop(); }
    }
  }
  const fanout = new Int32Array(n);
  for (const e of edges) fanout[e.s]++;
  for (const e of edges) {
    const a = e.rev ? e.t : e.s, b = e.rev ? e.s : e.t;
    e.a = a; e.b = b;
    out[a].push(b); inc[b].push(a);
  }
  // 2. longest-path layers in topological order (Kahn)
  const indeg = new Int32Array(n), layer = new Int32Array(n), order = [];
  for (let v = 0; v < n; v++) indeg[v] = inc[v].length;
  const queue = [];
  for (let v = 0; v < n; v++) if (!indeg[v]) queue.push(v);
  for (let qi = 0; qi < queue.length; qi++) {
    const v = queue[qi]; order.push(v);
    for (const t of out[v]) { layer[t] = Math.max(layer[t], layer[v] + 1); if (--indeg[t] === 0) queue.push(t); }
  }
  for (let k = order.length - 1; k >= 0; k--) {   // sources and short chains move down next to their readers
    const v = order[k];
    if (!out[v].length) continue;
    let m = Infinity;
    for (const t of out[v]) m = Math.min(m, layer[t]);
    if (!inc[v].length || m - 1 > layer[v]) layer[v] = Math.max(layer[v], m - 1);
  }
  // 3. dummies
  const W = w.slice(), H = h.slice(), L = Array.from(layer), up = Array.from({length: n}, () => []),
        down = Array.from({length: n}, () => []);
  const link = (a, b) => { down[a].push(b); up[b].push(a); };
  for (const e of edges) {
    const span = L[e.b] - L[e.a];
    if (span > LONG || (fanout[e.s] > FANOUT && span > 1)) { e.stub = true; continue; }
    let prev = e.a;
    e.chain = [];
    for (let l = L[e.a] + 1; l < L[e.b]; l++) {
      const d = W.length; W.push(DUMMY_W); H.push(0); L.push(l); up.push([]); down.push([]);
      link(prev, d); e.chain.push(d); prev = d;
    }
    link(prev, e.b);
  }
  const total = W.length;
  const big = total > 6000;   // thousands of boxes are seen zoomed out: fewer refinement rounds
  let depth = 0;
  for (let v = 0; v < total; v++) depth = Math.max(depth, L[v] + 1);
  const rows = Array.from({length: depth}, () => []);
  for (const v of order) rows[L[v]].push(v);               // original nodes in topological order
  for (let v = n; v < total; v++) rows[L[v]].push(v);
  const pos = new Float64Array(total);
  const renumber = row => row.forEach((v, i) => { pos[v] = i; });
  rows.forEach(renumber);
  // 4. barycentre sweeps
  const bary = new Float64Array(total);
  for (let s = 0; s < (big ? 2 : SWEEPS); s++) {
    const downward = s % 2 === 0;
    for (let li = downward ? 1 : depth - 2; downward ? li < depth : li >= 0; li += downward ? 1 : -1) {
      const row = rows[li];
      for (const v of row) {
        const nb = downward ? up[v] : down[v];
        if (!nb.length) { bary[v] = pos[v]; continue; }
        let sum = 0;
        for (const u of nb) sum += pos[u];
        bary[v] = sum / nb.length;
      }
      row.sort((a, b) => bary[a] - bary[b] || pos[a] - pos[b]);
      renumber(row);
    }
  }
  // 5. x coordinates
  const x = new Float64Array(total);
  for (const row of rows) {
    let at = 0;
    for (const v of row) { x[v] = at + W[v] / 2; at += W[v] + GAP_X; }
  }
  const want = new Float64Array(total), a = new Float64Array(total), b = new Float64Array(total);
  const place = row => {
    for (let i = 0; i < row.length; i++) {             // left to right: no overlap, as near as possible
      const v = row[i];
      a[v] = i ? Math.max(want[v], a[row[i - 1]] + (W[row[i - 1]] + W[v]) / 2 + GAP_X) : want[v];
    }
    for (let i = row.length - 1; i >= 0; i--) {        // right to left
      const v = row[i];
      b[v] = i < row.length - 1 ? Math.min(want[v], b[row[i + 1]] - (W[row[i + 1]] + W[v]) / 2 - GAP_X) : want[v];
    }
    for (let i = 0; i < row.length; i++) {             // the mean of both, spaced again
      const v = row[i], m = (a[v] + b[v]) / 2;
      x[v] = i ? Math.max(m, x[row[i - 1]] + (W[row[i - 1]] + W[v]) / 2 + GAP_X) : m;
    }
  };
  for (let p = 0; p < (big ? 2 : PASSES); p++) {
    const downward = p % 2 === 0;
    for (let li = downward ? 0 : depth - 1; downward ? li < depth : li >= 0; li += downward ? 1 : -1) {
      const row = rows[li];
      for (const v of row) {
        const nb = (downward ? up[v] : down[v]).length ? (downward ? up[v] : down[v]) : (downward ? down[v] : up[v]);
        if (!nb.length) { want[v] = x[v]; continue; }
        let sum = 0;
        for (const u of nb) sum += x[u];
        want[v] = 0.5 * x[v] + 0.5 * sum / nb.length;
        if (nb.length && (v >= n || nb.length === 1)) want[v] = sum / nb.length;  // straight chains
      }
      place(row);
    }
  }
  let minX = Infinity, maxX = -Infinity;
  for (let v = 0; v < total; v++) { minX = Math.min(minX, x[v] - W[v] / 2); maxX = Math.max(maxX, x[v] + W[v] / 2); }
  for (let v = 0; v < total; v++) x[v] -= minX;
  const top = new Float64Array(depth + 1), rowH = new Float64Array(depth);
  for (let v = 0; v < total; v++) rowH[L[v]] = Math.max(rowH[L[v]], H[v]);
  for (let l = 0; l < depth; l++) top[l + 1] = top[l] + rowH[l] + GAP_Y;
  const y = new Float64Array(total);
  for (let v = 0; v < total; v++) y[v] = top[L[v]] + rowH[L[v]] / 2;
  // 6. columns
  let width = maxX - minX, height = top[depth];
  const columns = msg.aspect > 0 ? Math.min(MAX_COLUMNS, depth, Math.round(Math.sqrt(height * msg.aspect / Math.max(width, 1)))) : 1;
  const columnOf = new Int32Array(depth);            // layer -> column
  if (columns >= 2) {
    const firstLayer = [0];
    for (let c = 1; c < columns; c++) {
      let l = firstLayer[c - 1] + 1;
      while (l < depth - 1 && top[l] < height * c / columns) l++;
      if (l < depth) firstLayer.push(l);
    }
    for (let c = 0; c < firstLayer.length; c++)
      for (let l = firstLayer[c]; l < (c + 1 < firstLayer.length ? firstLayer[c + 1] : depth); l++) columnOf[l] = c;
    let tallest = 0;
    for (let c = 0; c < firstLayer.length; c++) {
      const end = c + 1 < firstLayer.length ? top[firstLayer[c + 1]] - GAP_Y : height;
      tallest = Math.max(tallest, end - top[firstLayer[c]]);
    }
    for (let v = 0; v < total; v++) {
      const c = columnOf[L[v]];
      x[v] += c * (width + GAP_COLUMN);
      y[v] -= top[firstLayer[c]];
    }
    width = firstLayer.length * width + (firstLayer.length - 1) * GAP_COLUMN;
    height = tallest;
  }
  // ports: the edges into (out of) a node spread over its top (bottom) edge, ordered by where they come from (go)
  const near = (e, end) => {     // x of the point next to this end of the edge
    const c = e.chain || [];
    return end === "a" ? (c.length ? x[c[0]] : x[e.b]) : (c.length ? x[c[c.length - 1]] : x[e.a]);
  };
  const portX = new Map();
  const spread = (list, v, end) => {
    list.sort((p, q) => near(p, end) - near(q, end));
    const span = Math.min(W[v] * 0.6, 14 * (list.length - 1));
    list.forEach((e, k) => portX.set(e, [end, x[v] + (list.length > 1 ? -span / 2 + span * k / (list.length - 1) : 0)]));
  };
  const ins = new Map(), outs = new Map();
  for (const e of edges) {
    if (e.stub) continue;
    if (!ins.has(e.b)) ins.set(e.b, []);
    if (!outs.has(e.a)) outs.set(e.a, []);
    ins.get(e.b).push(e); outs.get(e.a).push(e);
  }
  const start = new Map(), end = new Map();
  for (const [v, list] of outs) { spread(list, v, "a"); for (const e of list) start.set(e, portX.get(e)[1]); }
  for (const [v, list] of ins) { spread(list, v, "b"); for (const e of list) end.set(e, portX.get(e)[1]); }
  const routed = edges.map(e => {
    // an edge between columns: a stub at its target (the ports were placed before the columns moved)
    const across = columnOf[L[e.a]] !== columnOf[L[e.b]] || (e.chain || []).some(d => columnOf[L[d]] !== columnOf[L[e.a]]);
    const stub = e.stub || across;
    const pts = [[stub ? x[e.a] : start.get(e), y[e.a] + H[e.a] / 2]];
    if (!stub) for (const d of e.chain || []) pts.push([x[d], y[d]]);
    pts.push([stub ? x[e.b] : end.get(e), y[e.b] - H[e.b] / 2]);
    if (e.rev) pts.reverse();
    return {s: e.s, t: e.t, points: pts, stub};
  });
  return {id: msg.id, x: Array.from(x.subarray(0, n)), y: Array.from(y.subarray(0, n)), edges: routed,
          width, height, columns: Math.max(1, columns >= 2 ? columnOf[depth - 1] + 1 : 1),
          column: Array.from({length: n}, (_, v) => columnOf[L[v]])};
}

if (typeof self !== "undefined" && typeof window === "undefined") {
  self.onmessage = ev => self.postMessage(layout(ev.data));
}
