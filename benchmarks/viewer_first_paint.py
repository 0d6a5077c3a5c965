"""The viewer's first paint in headless Chromium: random elementwise graphs of growing size (nothing
folds: every op laid out and drawn) and the default model (SmolLM2-135M, blocks folded).

First paint is `performance.now()` in a task queued from the first frame that holds the graph (ms
from navigation start: page, data, layout in the Web Worker, SVG). Median of --repeats page loads
on one server per graph.

    python -m benchmarks viewer [--sizes 1000,3000,10000] [--repeats 3] [--no-model]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from playwright.sync_api import sync_playwright  # noqa: E402

from ingot.viewer.server import model_server  # noqa: E402
from ingot.viewer.source import from_graph  # noqa: E402
from test_viewer_browser import ARGS, CHROMIUM, random_graph  # noqa: E402


def measure(browser, model, repeats: int) -> dict:
    server = model_server(model)
    server.start()
    paints, layouts = [], []
    try:
        for _ in range(repeats):
            page = browser.new_page(viewport={"width": 1400, "height": 900}, bypass_csp=True)
            page.goto(server.url)
            page.wait_for_function("window.__ingot && window.__ingot.ready === true", timeout=120_000)
            paints.append(page.evaluate("window.__ingot.firstPaint"))
            layouts.append(page.evaluate("window.__ingot.layoutMs"))
            items = page.locator("#graph .node").count()
            page.close()
    finally:
        server.close()
    return {"first_paint_ms": statistics.median(paints), "layout_ms": statistics.median(layouts), "drawn": items}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,3000,10000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-model", action="store_true", help="skip the default model")
    args = parser.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        print(f"{'graph':<28} {'ops':>7} {'drawn':>7} {'first paint ms':>15} {'layout ms':>10}")
        for n in [int(s) for s in args.sizes.split(",") if s]:
            g, sinks = random_graph(n)
            model = from_graph(g, sinks, name=f"random-{n}")
            ops = sum(node.op.name != "CONSTANT" for node in model.program.nodes())
            r = measure(browser, model, args.repeats)
            print(f"{'random ' + str(n):<28} {ops:>7} {r['drawn']:>7} {r['first_paint_ms']:>15.0f} {r['layout_ms']:>10.0f}")
        if not args.no_model:
            from ingot.llm.generate import default_model_path
            from ingot.viewer import open_model
            start = time.perf_counter()
            model = open_model(default_model_path())
            opened = time.perf_counter() - start
            ops = sum(node.op.name != "CONSTANT" for node in model.program.nodes())
            r = measure(browser, model, args.repeats)
            print(f"{'SmolLM2-135M (folded)':<28} {ops:>7} {r['drawn']:>7} {r['first_paint_ms']:>15.0f} {r['layout_ms']:>10.0f}"
                  f"   (build + compile pipeline {opened:.1f} s)")
        browser.close()


if __name__ == "__main__":
    main()
