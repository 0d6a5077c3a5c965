"""Serve the viewer on 127.0.0.1, or write it as one self-contained HTML file.

The server answers a fixed set of routes and nothing else: the page, its three static files (looked
up by exact name in a table, never joined onto a filesystem path), the model's JSON, and one
constant's preview by node index. Requests whose Host is not the loopback address it serves on are
refused (a page elsewhere cannot reach it through DNS rebinding).

    GET /                       the page
    GET /static/NAME            viewer.js, layout.js, viewer.css
    GET /api/graph              the model (ingot.viewer.export)
    GET /api/constant/INDEX     a constant's histogram, heatmap and quantization statistics
"""
from __future__ import annotations

import json
import os
import re
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable

from ..errors import IngotError

HOST = "127.0.0.1"
STATIC = {"viewer.js": "text/javascript", "layout.js": "text/javascript", "viewer.css": "text/css"}
CONSTANT_ROUTE = re.compile(r"/api/constant/(\d{1,9})")


def static_text(name: str) -> str:
    return resources.files("ingot.viewer").joinpath("static", name).read_text(encoding="utf-8")


def _json_bytes(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), allow_nan=False, default=_plain).encode("utf-8")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


class ViewerServer:
    """The page for one model on 127.0.0.1:port (0 = a free port), served from a thread."""

    def __init__(self, data: dict[str, Any], preview: Callable[[int], dict | None], port: int = 0):
        self.graph = _json_bytes(data)
        self.preview = preview
        self.previews: dict[int, bytes] = {}
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "ingot-view"
            sys_version = ""

            def log_message(self, *args) -> None:  # quiet: the terminal shows the URL only
                pass

            def do_GET(self) -> None:
                owner._handle(self)

            def do_HEAD(self) -> None:
                self._refuse(405)

            def _refuse(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = lambda self: self._refuse(405)  # noqa: E731

        try:
            self.httpd = ThreadingHTTPServer((HOST, port), Handler)
        except OSError as e:
            raise IngotError(f"view: cannot listen on {HOST}:{port} ({e.strerror or e}).") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{HOST}:{self.port}/"
        self.thread: threading.Thread | None = None

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        host = request.headers.get("Host", "")
        if host not in (f"{HOST}:{self.port}", f"localhost:{self.port}"):
            return self._send(request, 403, b"forbidden host\n", "text/plain")
        path = request.path.split("?", 1)[0]
        if path == "/":
            return self._send(request, 200, page().encode("utf-8"), "text/html; charset=utf-8")
        if path.startswith("/static/") and path[len("/static/"):] in STATIC:
            name = path[len("/static/"):]
            return self._send(request, 200, static_text(name).encode("utf-8"), STATIC[name] + "; charset=utf-8")
        if path == "/api/graph":
            return self._send(request, 200, self.graph, "application/json")
        m = CONSTANT_ROUTE.fullmatch(path)
        if m:
            index = int(m.group(1))
            with self.lock:
                if index not in self.previews:
                    found = self.preview(index)
                    if found is None:
                        return self._send(request, 404, b"not a constant\n", "text/plain")
                    self.previews[index] = _json_bytes(found)
                body = self.previews[index]
            return self._send(request, 200, body, "application/json")
        return self._send(request, 404, b"not found\n", "text/plain")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.send_header("X-Content-Type-Options", "nosniff")
        request.send_header("Content-Security-Policy", "default-src 'self'; img-src 'self' data: blob:; "
                            "style-src 'self' 'unsafe-inline'; worker-src 'self' blob:")
        request.end_headers()
        request.wfile.write(body)

    def start(self) -> str:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="ingot-view", daemon=True)
        self.thread.start()
        return self.url

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def page(data: dict[str, Any] | None = None, previews: bool = False) -> str:
    """The page: links to the static files, or with data, CSS and scripts inlined (one file)."""
    html = static_text("index.html")
    if data is None:
        return html
    css = static_text("viewer.css")
    js = static_text("viewer.js")
    layout = static_text("layout.js")
    safe = lambda text: text.replace("</", "<\\/")  # noqa: E731  (no early end of a script element)
    html = html.replace('<link rel="stylesheet" href="static/viewer.css">', f"<style>\n{css}\n</style>")
    html = html.replace('<script src="static/viewer.js"></script>',
                        f'<script type="application/json" id="ingot-data">{safe(_json_bytes(data).decode())}</script>\n'
                        f'<script type="text/plain" id="ingot-layout">{safe(layout)}</script>\n'
                        # the same layout in the page itself: the first view is drawn before the load event
                        f"<script>\nwindow.ingotLayout = (() => {{\n{safe(layout)}\nreturn layout;\n}})();\n</script>\n"
                        f"<script>\n{safe(js)}\n</script>")
    return html


def model_server(model, device: str = "cpu", profile: bool = False, reference: str | None = None, port: int = 0) -> ViewerServer:
    """A ViewerServer for a Model: its export, with previews computed when first asked for."""
    from ..ir import Op
    from . import stats

    data = build_data(model, device, profile, reference)
    nodes = model.program.nodes()

    def preview(index: int):
        if index >= len(nodes) or nodes[index].op != Op.CONSTANT:
            return None
        return stats.preview(model.program, nodes[index], nodes)

    return ViewerServer(data, preview, port)


def build_data(model, device: str = "cpu", profile: bool = False, reference: str | None = None, previews: bool = False):
    from .export import export

    timing = None
    if profile:
        from .profile import profile_run
        timing = profile_run(model, device)
    qerror = None
    if reference is not None:
        from .qerror import quantization_error
        qerror = quantization_error(model, reference)
    data = export(model, profile=timing, qerror=qerror, previews=previews)
    data["model"]["device"] = device
    return data


def write_html(model, out: str, device: str = "cpu", profile: bool = False, reference: str | None = None) -> str:
    """Write the viewer with the model's data, previews included, as one HTML file (atomically)."""
    data = build_data(model, device, profile, reference, previews=True)
    text = page(data)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise IngotError(f"view: the folder {folder} does not exist.")
    tmp = out + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise IngotError(f"view: cannot write {out} ({e.strerror or e}).") from None
    return out


def serve(model, port: int = 0, open_browser: bool = True, device: str = "cpu", profile: bool = False,
          reference: str | None = None, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = model_server(model, device, profile, reference, port)
    announce(f"ingot view: {server.url} (Ctrl-C to stop)")
    if open_browser:
        threading.Timer(0.2, lambda: webbrowser.open(server.url)).start()
    try:
        server.httpd.serve_forever()
    finally:
        server.httpd.server_close()
