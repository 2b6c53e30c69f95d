"""Browser tier: Debian's Chromium, headless, driven by Playwright against the real ComfyUI frontend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.runtime.provision import CHROMIUM, frontend_root
from tools.templates.workflow_api import load_workflow

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUR_EXTENSION_PATH = "/extensions/comfyui-device-control/"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "browser" in item.path.parts:
            item.add_marker(pytest.mark.browser)


class FrontendPage:
    """A page of the real frontend, with the console messages it printed."""

    def __init__(self, page: Any, server: Any) -> None:
        self.page = page
        self.server = server
        self.console: list[dict[str, str]] = []
        page.on("console", lambda m: self.console.append({"type": m.type, "text": m.text, "url": m.location["url"]}))
        page.on("pageerror", lambda e: self.console.append({"type": "pageerror", "text": f"{e}\n{e.stack}", "url": ""}))

    def open(self) -> None:
        """Load the frontend and wait until it has started: its app and our extension ready, and its first workflow
        loaded. The frontend shows ``window.app`` before it loads that workflow (after a request to the server), so
        a test that built a graph at once could have it replaced, on a loaded machine, by the default workflow
        (links then refused from nodes no longer in the graph). Every frontend we test keeps a workspace store with
        a startup spinner and the active workflow."""
        self.page.goto(self.server.url + "/")
        self.page.wait_for_function(
            """() => { const app = window.app, workspace = app && app.extensionManager;
                return !!(app && app.graph && app.extensions && app.extensions.length > 0 && workspace
                          && !workspace.spinner && workspace.workflow && workspace.workflow.activeWorkflow); }""",
            timeout=90_000,
        )

    def click_run(self) -> None:
        """Press the frontend's Run button (queue the workflow). Frontend 1.45 adds a menu button also named Run
        beside it (the queue mode); the queue button itself carries ``data-testid="queue-button"`` there."""
        queue = self.page.locator('[data-testid="queue-button"]')
        (queue if queue.count() else self.page.get_by_role("button", name="Run", exact=True)).click()

    def load_workflow(self, path: Path) -> None:
        """Open a UI-format workflow file the way the frontend's Load does, on the test models (``for_fixtures``)."""
        self.page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", load_workflow(path))

    def our_errors(self) -> list[dict[str, str]]:
        """Console errors that come from our extension's files."""
        return [
            m
            for m in self.console
            if m["type"] in ("error", "pageerror")
            and (OUR_EXTENSION_PATH in m["url"] or OUR_EXTENSION_PATH in m["text"])
        ]


@pytest.fixture(scope="session")
def browser(comfy_runtime, require) -> Iterator[Any]:
    if not CHROMIUM.exists():
        require(f"Chromium is not installed at {CHROMIUM}; run 'python3 tools/runtime/provision.py --browser'")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require("playwright is not installed in the runtime; run 'python3 tools/runtime/provision.py'")
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        yield instance
        instance.close()


PINNED = "pinned"


@pytest.fixture(scope="module")
def frontend_version(request) -> str:
    """Which frontend the server serves: the one ComfyUI pins, or a version of comfyui-frontend-package
    (a module parametrizes this indirectly to check the newest too)."""
    return getattr(request, "param", PINNED)


@pytest.fixture(scope="module")
def browser_server(request, synthetic_models, comfy_factory, tmp_path_factory, frontend_version) -> Iterator[Any]:
    """A ComfyUI with a simulated 8 GiB GPU, so the page shows a GPU placement on any machine (a module's
    ``SIMULATE_GPU`` asks for other simulated GPUs)."""
    extra: tuple[str, ...] = ()
    if frontend_version != PINNED:
        extra = ("--front-end-root", str(frontend_root(frontend_version)))
    gpus = getattr(request.module, "SIMULATE_GPU", "8GiB")
    server = comfy_factory(
        tmp_path_factory.mktemp("browser-base"), env={"DEVICE_CONTROL_SIMULATE_GPU": gpus}, extra_args=extra
    )
    # First-run dialogs (templates, tutorial) would cover the canvas; a returning user has dismissed them.
    server.post("/settings/Comfy.TutorialCompleted", True)
    yield server
    server.stop()


#: Run before each page's own scripts: a page starts as a new user's would, with nothing the page before it in its
#: module stored (the frontend keeps the open workflows in the browser's storage and restores them on load).
FORGET_STORAGE = "try { localStorage.clear(); sessionStorage.clear(); } catch (e) {}"


@pytest.fixture(scope="module")
def browser_context(browser, browser_server) -> Iterator[Any]:
    """One browser context per module: its pages share the HTTP cache, so the frontend's scripts are fetched and
    compiled once per module rather than once per test (each test still gets a page of its own)."""
    context = browser.new_context(viewport={"width": 1800, "height": 1100})
    context.add_init_script(FORGET_STORAGE)
    yield context
    context.close()


@pytest.fixture
def frontend(browser_context, browser_server) -> Iterator[FrontendPage]:
    page = FrontendPage(browser_context.new_page(), browser_server)
    yield page
    page.page.close()


@pytest.fixture(scope="module")
def _opened_page(browser_context, browser_server) -> Iterator[FrontendPage]:
    page = FrontendPage(browser_context.new_page(), browser_server)
    page.open()
    yield page
    page.page.close()


@pytest.fixture
def graph_page(_opened_page) -> FrontendPage:
    """One opened page of the editor for a module's tests that only build or load a graph through the frontend's
    graph API, each from a cleared or newly loaded graph: a page load of the frontend takes about 7 s of CPU
    (``docs/bench/ci_cpu_where.txt``), most of a browser tier's cost. Its console is emptied for each test, so an
    error is reported by the test that made it. A test of what a page does as it loads, or of what the page shows
    as it runs (toasts, dialogs, badges, the panel), takes a page of its own (:func:`frontend`)."""
    _opened_page.console.clear()
    return _opened_page
