"""The views behind ``/hub/gpupool`` and ``/hub/gpupool/mine``: the slot drawing of each GPU, the
holders, the team figures, the queue, and that the templates escape what users can name.

A real pool over a simulated inventory (SQLite in ``tmp_path``), a job manager and a reclaimer,
passed to the views as the hub passes its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
from traitlets.config import Config

import gpupool.hub as hub_module
from gpupool.config import GPUPool
from gpupool.core.idle import DeviceReading, Reading, Watch
from gpupool.hub.pages_view import admin_view, mine_view, relative
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from tests.accounts import shared_mode

TEMPLATES = Path(hub_module.__file__).parent / "templates"
SPEC = "simulated:n: 3x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb"
"""GPU 0 whole (MIG off); GPUs 1 and 2 with fixed instances 3g.40gb@0, 2g.20gb@4, 1g.10gb@6."""


Parts = tuple[Pool, JobManager, IdleReclaimer]


@pytest.fixture
def pool(tmp_path: Path) -> Parts:
    c = Config()
    c.GPUPool.inventory = SPEC
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {
        "cpu": {},
        "h100": {"model": "H100-80GB", "max_count": 1},
        "mig-2g.20gb": {"model": "H100-80GB"},
        "mig-1g.10gb": {"model": "H100-80GB"},
    }
    c.GPUPool.teams = {"vision": {"guarantee": 1.5, "borrow_limit": 0.5}, "nlp": {"guarantee": 1}}
    shared_mode(c)
    p = Pool.from_config(GPUPool(config=c))
    return p, JobManager(p, config=c), IdleReclaimer(p, config=c)


def view(parts: Parts) -> dict[str, Any]:
    p, jobs, reclaimer = parts
    return admin_view(p, jobs, reclaimer, p.clock().timestamp())


def layout(gpu: dict[str, Any]) -> list[tuple[str, int, str, str | None]]:
    return [
        (c["slots"], c["span"], c["label"], c["holder"]["user"] if c["holder"] else None)
        for c in gpu["cells"]
    ]


def test_fixed_mig_instances_are_drawn_over_their_slots_and_slot_7_is_free(
    pool: Parts,
) -> None:
    gpus = view(pool)["nodes"][0]["gpus"]
    assert [g["mig_mode"] for g in gpus] == ["off", "fixed", "fixed"]
    assert layout(gpus[1]) == [
        ("0-3", 4, "3g.40gb", None),
        ("4-5", 2, "2g.20gb", None),
        ("6", 1, "1g.10gb", None),
        ("7", 1, "free", None),
    ]
    assert all(c["free"] for c in gpus[1]["cells"])
    assert gpus[1]["cells"][0]["uuid"].startswith("MIG-")
    assert layout(gpus[0]) == [("0-7", 8, "whole GPU", None)]  # MIG off: one box


def test_holders_colour_their_cells_and_a_whole_gpu_fills_the_row(
    pool: Parts,
) -> None:
    p = pool[0]
    whole = p.allocate("ada", ["vision"], "h100", ref="ada/")
    mig = p.allocate("dee", ["nlp"], "mig-2g.20gb", ref="dee/")
    v = view(pool)
    gpus = {g["uuid"]: g for g in v["nodes"][0]["gpus"]}
    ada_gpu = gpus[whole.devices[0].gpu]
    assert layout(ada_gpu) == [("0-7", 8, "whole GPU", "ada")]
    dee_gpu = gpus[mig.devices[0].gpu]
    assert ("4-5", 2, "2g.20gb", "dee") in layout(dee_gpu)
    assert [c["holder"] is None for c in dee_gpu["cells"]] == [True, False, True, True]
    colours = {t["name"]: t["colour"] for t in v["teams"]}
    assert ada_gpu["cells"][0]["holder"]["colour"] == colours["vision"]
    assert dee_gpu["cells"][1]["holder"]["colour"] == colours["nlp"] != colours["vision"]
    assert dee_gpu["holders"] == [
        {"user": "dee", "team": "nlp", "kind": "notebook", "ref": "dee/", "colour": colours["nlp"]}
    ]


def test_a_dynamic_mig_gpu_draws_created_instances_at_their_start(tmp_path: Path) -> None:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 1x H100-80GB, mig=1"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {
        "mig-3g.40gb": {"model": "H100-80GB"},
        "mig-1g.10gb": {"model": "H100-80GB"},
    }
    c.GPUPool.teams = {"t": {"guarantee": 1}}
    shared_mode(c)
    p = Pool.from_config(GPUPool(config=c))
    a = p.allocate("ann", ["t"], "mig-3g.40gb", ref="ann/")
    p.allocate("bob", ["t"], "mig-1g.10gb", kind="job", ref="job1")
    gpu = view((p, JobManager(p, config=c), IdleReclaimer(p, config=c)))["nodes"][0]["gpus"][0]
    assert gpu["mig_mode"] == "dynamic"
    start = a.devices[0].start
    cells = {c["start"]: c for c in gpu["cells"]}
    assert cells[start]["span"] == 4 and cells[start]["holder"]["user"] == "ann"
    assert sum(c["span"] for c in gpu["cells"]) == 8
    assert [c["holder"]["user"] for c in gpu["cells"] if c["holder"]] in (
        ["ann", "bob"],
        ["bob", "ann"],
    )
    assert sum(c["free"] for c in gpu["cells"]) == 3  # 8 - 4 - 1, drawn one slot each


def test_rows_teams_and_queue_carry_what_the_page_prints(pool: Parts) -> None:
    p, jobs, _ = pool
    p.allocate("ada", ["vision"], "h100", ref="ada/")
    p.allocate("ben", ["vision"], "mig-2g.20gb", ref="ben/")
    queued = jobs.submit("cal", ["vision"], {"script": "print(1)", "offer": "h100", "gpus": 1})
    v = view(pool)
    ada = next(a for a in v["allocations"] if a["user"] == "ada")
    assert ada["action"]["kind"] == "stop"
    assert ada["action"]["fields"] == {"user": "ada", "server": ""}
    assert ada["action"]["confirm"] == "Stop ada's server? Unsaved work is lost."
    assert ada["since_when"]["relative"] == "just now"
    assert ada["device_rows"][0]["utilisation"] == "not measured"
    teams = {t["name"]: t for t in v["teams"]}
    assert (teams["vision"]["used"], teams["vision"]["borrowed"], teams["vision"]["left"]) == (
        "1.25",
        "0",
        "0.75",
    )
    assert teams["everyone"]["used"] == "0"
    assert [q["id"] for q in v["queue"]] == [queued.id]
    assert v["queue"][0]["queue_position"] == 1
    assert v["queue"][0]["shape"] == "h100 ×1 ×1"
    assert v["queue"][0]["action"]["fields"] == {"job": queued.id}


def test_mine_shows_only_the_callers_own(pool: Parts) -> None:
    p, jobs, reclaimer = pool
    p.allocate("ada", ["vision"], "h100", ref="ada/")
    p.allocate("dee", ["nlp"], "mig-1g.10gb", ref="dee/")
    v = mine_view(p, jobs, reclaimer, "ada", ["vision"], p.clock().timestamp())
    assert [a["user"] for a in v["allocations"]] == ["ada"]
    assert "action" not in v["allocations"][0]
    assert [(t["name"], t["used"], t["left"], t["mine"]) for t in v["teams"]] == [
        ("vision", "1", "1", "1")
    ]
    eve = mine_view(p, jobs, reclaimer, "eve", [], p.clock().timestamp())
    assert eve["allocations"] == [] and [t["name"] for t in eve["teams"]] == ["everyone"]


def test_idle_state_utilisation_and_the_warning_come_from_the_reclaimer(
    pool: Parts,
) -> None:
    p, jobs, reclaimer = pool
    whole = p.allocate("ada", ["vision"], "h100", ref="ada/")
    mig = p.allocate("dee", ["nlp"], "mig-1g.10gb", ref="dee/")
    now = p.clock().timestamp()
    gpu, instance = whole.devices[0].visible_id, mig.devices[0].visible_id
    reclaimer.watches[whole.id] = Watch(last=Reading({gpu: DeviceReading(80, 0, ())}))
    reclaimer.watches[mig.id] = Watch(
        idle_since=now - 50 * 60,
        warned_at=now - 5 * 60,
        last=Reading({instance: DeviceReading(None, 0, ())}),
    )
    rows = {a["user"]: a for a in view(pool)["allocations"]}
    assert rows["ada"]["device_rows"] == [{"id": gpu, "utilisation": "80%"}]
    assert rows["ada"]["state"] == {"level": "active", "text": "in use"}
    assert rows["dee"]["device_rows"] == [{"id": instance, "utilisation": "n/a (MIG)"}]
    assert rows["dee"]["state"]["level"] == "warning"
    assert rows["dee"]["state"]["short"].startswith("stop at ")
    assert rows["dee"]["action"]["kind"] == "stop"
    mine = mine_view(p, jobs, reclaimer, "dee", ["nlp"], now)["allocations"][0]
    assert mine["state"]["text"].startswith("This server's GPU (mig-1g.10gb) has been idle")
    reclaimer.watches.clear()
    assert view(pool)["allocations"][0]["state"]["text"] == "not checked yet"


def test_relative_times() -> None:
    assert relative(100.0, 130.0) == "just now"
    assert relative(0.0, 130.0) == ""
    assert relative(1000.0, 1000.0 + 5 * 60) == "5 min ago"
    assert relative(1000.0, 1000.0 + 2 * 3600 + 5 * 60) == "2 h 5 min ago"
    assert relative(1000.0, 1000.0 + 3 * 86400 + 4 * 3600) == "3 d 4 h ago"


def test_the_admin_template_escapes_names_and_the_confirm_text(
    pool: Parts,
) -> None:
    """What users can name (server names, job names) reaches HTML and a JavaScript string."""
    p = pool[0]
    evil = "x'\"><script>alert(1)</script>"
    p.allocate("ada", ["vision"], "h100", ref=f"ada/{evil}")
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.FileSystemLoader(str(TEMPLATES)),
                jinja2.DictLoader(
                    {
                        "page.html": "{% block stylesheet %}{% endblock %}"
                        "<nav>{% block nav_bar_left_items %}{% endblock %}</nav>"
                        "{% block main %}{% endblock %}"
                    }
                ),
            ]
        ),
        autoescape=True,  # as JupyterHub's
    )
    html = env.get_template("gpupool-admin.html").render(
        view=view(pool), flash="", base_url="/hub/", xsrf="TOKEN", pool_admin=True
    )
    assert "<script>alert(1)" not in html
    form = re.search(r"<form method=\"post\"[^>]*onsubmit='return confirm\((.*?)\)'>", html)
    assert form, html
    confirm = json.loads(form.group(1))
    assert confirm == f"Stop ada's server {evil!r}? Unsaved work is lost."
    assert 'name="_xsrf" value="TOKEN"' in html
    assert 'action="/hub/gpupool/stop"' in html
