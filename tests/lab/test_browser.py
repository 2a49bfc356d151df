"""The whole flow in a real browser (Debian's Chromium through Playwright) against the demo hub.

A demo user logs in, spawns a CPU notebook server from the spawn page, opens a notebook that
trains a small model with DDP, clicks "Run distributed", chooses 2 GPUs, and watches the job reach
``succeeded`` in the GPU jobs panel, with both ranks' logs. A second user does not see that job.
Screenshots of the spawn page, the dialog and the panel go to ``docs/img/`` for the README.

Then, while another member's notebook holds the team's whole quota (and every whole GPU), the
dialog says the job will queue and why, lets it be submitted, and the job shows queued in the
panel and in the hub; more nodes than the team may ever hold are refused. Last, the toolbar
button, the dialog and the panel in JupyterLab's dark theme: rendered, restyled, legible.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.accounts import give_to_shared_account, homes
from tests.conftest import TRAIN, TRAIN_CELL
from tests.hub.conftest import ROOT, Hub, running
from tests.lab.browser_fixtures import ARGS, CHROMIUM, NEEDS_CHROMIUM, SLOW, log_in, offer_line

pytestmark = NEEDS_CHROMIUM
IMG = ROOT / "docs" / "img"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root:
        h = Hub(tmp_path_factory.mktemp("browser-hub"), home_root)
        home = home_root / "ada"
        home.mkdir()
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(TRAIN_CELL)]
        nbformat.write(nb, home / "train.ipynb")
        give_to_shared_account(home)
        with running(h):
            yield h


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def spawn(hub: Hub, user: str, choice: str) -> None:
    """Start ``user``'s server from the spawn form (``team|offer|count``) and wait until ready."""
    r = hub.spawn_form(user, choice)
    assert r.status_code == 302, f"spawn of {user} ({choice}): {r.status_code} {r.text[-600:]}"
    hub.wait_ready(user)


def open_notebook(page: Page, hub: Hub, user: str) -> Locator:
    """Open ``train.ipynb`` in ``user``'s JupyterLab (logged in); its Run distributed button."""
    page.goto(f"{hub.url}/user/{user}/lab/tree/train.ipynb")
    button = page.locator(".gpupool-run-distributed").first
    button.wait_for(timeout=SLOW)
    kernel = page.get_by_role("button", name="Select")  # asked only if the kernel is unknown
    if kernel.count():
        # the dialog may close by itself between the look and the click (JupyterLab picks the
        # kernel once its specs arrive): a click that finds no button then is no failure
        with contextlib.suppress(PlaywrightTimeout):
            kernel.click(timeout=5_000)
    return button


def test_run_distributed_from_a_notebook(hub: Hub, browser: Browser) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(page, hub, "ada")
    page.goto(f"{hub.url}/hub/spawn")
    expect(page.locator(".gpupool-form")).to_contain_text("Team vision")
    expect(page.locator(".gpupool-simulated")).to_contain_text("Simulated pool")
    page.screenshot(path=IMG / "spawn-page.png", full_page=True)
    page.check('input[value="vision|cpu|1"]')
    page.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
    page.wait_for_url(re.compile(r".*/user/ada/lab.*"), timeout=SLOW)

    page.goto(f"{hub.url}/user/ada/lab/tree/train.ipynb")
    button = page.locator(".gpupool-run-distributed").first
    button.wait_for(timeout=SLOW)
    kernel = page.get_by_role("button", name="Select")  # asked only if the kernel is unknown
    if kernel.count():
        # the dialog may close by itself between the look and the click (JupyterLab picks the
        # kernel once its specs arrive): a click that finds no button then is no failure
        with contextlib.suppress(PlaywrightTimeout):
            kernel.click(timeout=5_000)
    expect(page.locator(".gpupool-status")).to_contain_text("CPU only", timeout=60_000)
    button.click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator("select[name=offer]")).to_be_visible()
    dialog.locator("select[name=team]").select_option("vision")
    dialog.locator("select[name=offer]").select_option("h100")
    dialog.locator("input[name=gpus]").fill("2")
    dialog.locator("input[name=nodes]").fill("1")
    dialog.locator("input[name=cells][value=all]").check()
    dialog.screenshot(path=IMG / "run-distributed-dialog.png")
    dialog.get_by_role("button", name="Submit").click()

    panel = page.locator(".gpupool-jobs-panel")
    expect(panel.locator(".gpupool-job-detail .gpupool-state-succeeded")).to_be_visible(
        timeout=SLOW
    )
    log = panel.locator(".gpupool-log")
    expect(log).to_contain_text("FINAL 0 2", timeout=30_000)
    panel.locator("select[name=rank]").select_option("1")
    expect(log).to_contain_text("FINAL 1 2", timeout=30_000)
    page.screenshot(path=IMG / "jobs-panel.png")
    page.close()

    other = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(other, hub, "ben")
    other.goto(f"{hub.url}/hub/spawn")
    other.check('input[value="vision|cpu|1"]')
    other.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
    other.wait_for_url(re.compile(r".*/user/ben/lab.*"), timeout=SLOW)
    other.locator('li[data-id="gpupool-jobs"]').click(timeout=SLOW)
    expect(other.locator(".gpupool-jobs-panel .gpupool-empty")).to_be_visible(timeout=30_000)
    expect(other.locator(".gpupool-jobs-panel")).not_to_contain_text("train")
    ben = hub.as_user(hub.token("ben"), "GET", "/jobs").json()["jobs"]
    assert ben == []
    other.close()


@pytest.fixture(scope="module")
def ada_lab(hub: Hub) -> str:
    """ada's CPU server (the first test starts it from the browser; started here if not)."""
    if hub.server("ada") is None:
        spawn(hub, "ada", "vision|cpu|1")
    hub.wait_ready("ada")
    return hub.token("ada")


@pytest.fixture(scope="module")
def vision_busy(hub: Hub) -> Iterator[None]:
    """cal's notebook holds 2 whole H100s: team vision's whole limit (2 GPU-eq) and every whole
    GPU of the simulated pool (the other two are MIG)."""
    spawn(hub, "cal", "vision|h100|2")
    try:
        yield
    finally:
        if hub.server("cal") is not None:
            hub.stop_server("cal")


def test_a_job_that_would_wait_is_submitted_and_shows_queued(
    hub: Hub, browser: Browser, ada_lab: str, vision_busy: None
) -> None:
    # What the hub says first: one H100 for ada would wait (vision uses 2 of 2 GPU-eq).
    line = offer_line(hub.as_user(ada_lab, "GET", "/offers").json(), "vision", "h100", 1)
    assert line["admission"] == "wait", line
    assert line["enabled"] is False and line["reason"], line

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(page, hub, "ada")
    open_notebook(page, hub, "ada").click()
    dialog = page.locator(".jp-Dialog")
    submit = dialog.get_by_role("button", name="Submit")
    notice = dialog.locator(".gpupool-form-notice")
    error = dialog.locator(".gpupool-form-error")
    dialog.locator("select[name=team]").select_option("vision")
    offer = dialog.locator("select[name=offer]")
    expect(offer.locator("option[value=h100]")).to_contain_text("will queue")
    expect(offer.locator("option[value=h100]")).to_be_enabled()
    offer.select_option("h100")
    dialog.locator("input[name=gpus]").fill("1")

    # More nodes than the team may ever hold: refused, with the reason.
    dialog.locator("input[name=nodes]").fill("3")
    expect(error).to_contain_text("needs 3 GPU-eq (3 × 1); team vision may hold at most 2")
    expect(notice).to_be_hidden()
    expect(submit).to_be_disabled()

    # One node: it would wait, and may be submitted.
    dialog.locator("input[name=nodes]").fill("1")
    expect(notice).to_be_visible()
    expect(notice).to_have_text(re.compile(r"will queue: \S.*"))
    expect(notice).to_contain_text(f"will queue: {line['reason']}")
    expect(error).to_have_text("")
    expect(submit).to_be_enabled()
    dialog.locator("input[name=cells][value=all]").check()
    dialog.locator("input[name=time_limit]").fill("5")
    submit.click()
    expect(dialog).to_have_count(0)

    panel = page.locator(".gpupool-jobs-panel")
    detail = panel.locator(".gpupool-job-detail")
    expect(detail.locator(".gpupool-state-queued")).to_be_visible(timeout=60_000)
    job_id = detail.get_attribute("data-job-id")
    assert job_id
    try:
        row = panel.locator(f'.gpupool-job[data-job-id="{job_id}"]')
        expect(row.locator(".gpupool-state")).to_have_text("queued")
        expect(row.locator(".gpupool-job-queue")).to_have_text("#1 in queue")
        expect(detail.locator(".gpupool-detail-info")).to_contain_text("vision")
        expect(detail.locator(".gpupool-log-status")).to_contain_text("Waiting for the job")

        job = hub.as_user(ada_lab, "GET", f"/jobs/{job_id}").json()
        assert job["state"] == "queued", job
        assert job["owner"] == "ada" and job["offer"] == "h100" and job["gpus"] == 1, job
        assert job["queue_position"] == 1 and "vision" in job["reason"], job
        expect(detail.locator(".gpupool-detail-info")).to_contain_text(job["reason"])
    finally:
        r = hub.as_user(ada_lab, "DELETE", f"/jobs/{job_id}")
        assert r.status_code in (200, 202), r.text
        page.close()
    assert hub.as_user(ada_lab, "GET", f"/jobs/{job_id}").json()["state"] == "cancelled"


def test_the_jobs_panel_pages_through_older_jobs(
    hub: Hub, browser: Browser, ada_lab: str, vision_busy: None
) -> None:
    """More jobs than the hub answers on one page (50): the panel shows the newest page, and
    "Show older jobs" opens the next."""
    for i in range(52):  # queued behind cal's notebook, then cancelled: cheap ended jobs
        body = {"script": "print(1)", "offer": "h100", "name": f"old-{i}", "time_limit": 60}
        r = hub.as_user(ada_lab, "POST", "/jobs", json=body)
        assert r.status_code == 201, r.text
        assert hub.as_user(ada_lab, "DELETE", f"/jobs/{r.json()['id']}").status_code == 200
    total = len(hub.as_user(ada_lab, "GET", "/jobs", params={"limit": 500}).json()["jobs"])
    assert 52 <= total < 100
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        log_in(page, hub, "ada")
        page.goto(f"{hub.url}/user/ada/lab")
        page.locator(".gpupool-status").click(timeout=SLOW)  # shows the panel (a tab toggles)
        panel = page.locator(".gpupool-jobs-panel")
        rows, older = panel.locator(".gpupool-job"), panel.locator(".gpupool-older")
        expect(rows).to_have_count(50, timeout=60_000)
        expect(rows.first.locator(".gpupool-job-name")).to_have_text("old-51")  # newest first
        expect(older).to_be_visible()
        older.click()
        expect(rows).to_have_count(total)
        expect(older).to_be_hidden()  # the last page
    finally:
        page.close()


# Computed colours, read in the page: the text colour of an element and the colour behind it
# (the first ancestor with an opaque background).
COLOURS = r"""(node) => {
    const style = getComputedStyle(node);
    let back = 'rgb(255, 255, 255)';
    for (let n = node; n; n = n.parentElement) {
        const c = getComputedStyle(n).backgroundColor;
        if (c !== 'transparent' && !/^rgba\(.*,\s*0\)$/.test(c)) { back = c; break; }
    }
    return [style.color, back];
}"""


def _rgba(css: str) -> tuple[float, float, float, float]:
    m = re.fullmatch(r"rgba?\(([^)]*)\)", css.strip())
    assert m, css
    parts = [float(p) for p in re.split(r"[,\s/]+", m.group(1).strip()) if p]
    return (parts[0], parts[1], parts[2], parts[3] if len(parts) > 3 else 1.0)


def _luminance(rgb: tuple[float, float, float]) -> float:
    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(text: str, back: str) -> float:
    """WCAG contrast ratio of text (blended onto its background when translucent)."""
    fr, fg, fb, fa = _rgba(text)
    br, bg, bb, _ = _rgba(back)
    blended = (fr * fa + br * (1 - fa), fg * fa + bg * (1 - fa), fb * fa + bb * (1 - fa))
    lighter, darker = sorted((_luminance(blended), _luminance((br, bg, bb))), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def colours(page: Page) -> dict[str, tuple[str, str]]:
    """Text and background colours of the extension's parts: the toolbar button, the dialog's
    form, its field labels and queue notice, and the jobs panel."""
    parts = {
        "button": ".gpupool-run-distributed",
        "form": ".jp-Dialog .gpupool-run-form",
        "label": ".jp-Dialog .gpupool-field-label",
        "notice": ".jp-Dialog .gpupool-form-notice",
        "panel": ".gpupool-jobs-panel .gpupool-jobs-title",
    }
    return {
        name: tuple(page.locator(selector).first.evaluate(COLOURS))
        for name, selector in parts.items()
    }


def use_theme(page: Page, theme: str) -> None:
    """Make ``theme`` the user's JupyterLab theme (the setting the theme menu writes, through the
    server's settings API), reload, and wait until the page wears it."""
    status = page.evaluate(
        """async (theme) => {
            const base = location.pathname.split("/lab")[0] + "/";  // /user/ada/
            const xsrf = (document.cookie.match(/(?:^|; )_xsrf=([^;]*)/) || [])[1] || "";
            const r = await fetch(base + "lab/api/settings/@jupyterlab/apputils-extension:themes", {
                method: "PUT",
                headers: {
                    "Content-Type": "application/json",
                    "X-XSRFToken": decodeURIComponent(xsrf),
                },
                body: JSON.stringify({raw: JSON.stringify({theme})}),
            });
            return r.status;
        }""",
        theme,
    )
    assert status == 204, status
    page.reload()
    light = "true" if "Light" in theme else "false"
    expect(page.locator("body")).to_have_attribute("data-jp-theme-name", theme, timeout=60_000)
    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", light)


def open_dialog_that_queues(page: Page, button: Locator) -> Locator:
    button.click()
    dialog = page.locator(".jp-Dialog")
    dialog.locator("select[name=team]").select_option("vision")
    dialog.locator("select[name=offer]").select_option("h100")
    dialog.locator("input[name=gpus]").fill("1")
    dialog.locator("input[name=nodes]").fill("1")
    expect(dialog.locator(".gpupool-form-notice")).to_contain_text("will queue")
    return dialog


def test_the_dark_theme(hub: Hub, browser: Browser, ada_lab: str, vision_busy: None) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(page, hub, "ada")
    button = open_notebook(page, hub, "ada")
    page.locator(".gpupool-status").click()  # shows the GPU jobs panel (a tab would toggle it)
    expect(page.locator(".gpupool-jobs-panel")).to_be_visible()
    expect(page.locator("body")).to_have_attribute("data-jp-theme-light", "true")

    dialog = open_dialog_that_queues(page, button)
    light = colours(page)
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_have_count(0)

    use_theme(page, "JupyterLab Dark")
    try:
        expect(button).to_be_visible()
        dialog = open_dialog_that_queues(page, button)
        expect(dialog.get_by_role("button", name="Submit")).to_be_enabled()
        dark = colours(page)
        dialog.get_by_role("button", name="Cancel").click()
        expect(dialog).to_have_count(0)
    finally:
        use_theme(page, "JupyterLab Light")
        page.close()

    for part, (text, back) in dark.items():
        # Restyled by the theme: another background or another text colour than in light.
        assert (text, back) != light[part], (part, text, back)
        # Still legible: WCAG AA for normal text (3:1 for secondary texts, the field labels).
        least = 3.0 if part == "label" else 4.5
        assert contrast(text, back) >= least, (part, text, back, contrast(text, back))
    assert _luminance(_rgba(dark["form"][1])[:3]) < _luminance(_rgba(light["form"][1])[:3])


def test_screenshots_are_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("spawn-page.png", "run-distributed-dialog.png", "jobs-panel.png"):
        assert f"docs/img/{name}" in readme
        assert Path(IMG / name).exists()
