"""The Jupyter Server extension in a real Jupyter Server, against the stand-in hub over HTTP.

The server comes from jupyter_server's own pytest fixtures (``pytest_jupyter.jupyter_server``:
``jp_serverapp``, ``jp_fetch``, ``jp_root_dir``, ``jp_server_config``), configured with the very
file that ships to enable the extension (``labextension/jupyter-config/server-config``). The
stand-in hub is :class:`tests.lab.fake_hub.FakeHub` (the hub's gpupool contract over real HTTP;
the ``hub`` fixture of ``conftest.py``), reached through ``JUPYTERHUB_API_URL`` and
``JUPYTERHUB_API_TOKEN`` as in a single-user server.

The plugin's fixtures are imported into this module only, not registered with
``pytest_plugins``: a test module's ``pytest_plugins`` registers the plugin for the whole session,
and its autouse fixtures (a fresh event loop per test, a ``ServerApp`` cleanup) would then run
around every test collected after this module. The tests are plain functions that drive the
server's event loop with ``run_until_complete``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell
from pytest_jupyter import jupyter_server as jupyter_server_fixtures
from tornado.httpclient import HTTPClientError

import gpupool_lab
from gpupool_lab.allocation import allocation_info, idle_state
from gpupool_lab.server import log_reply
from tests.lab.conftest import run_script, write_notebook
from tests.lab.fake_hub import OFFERS, FakeHub

globals().update(
    {
        name: fixture
        for name, fixture in vars(jupyter_server_fixtures).items()
        if name.startswith(("jp_", "http_server", "echo_kernel", "io_loop"))
    }
)

CONFIG_FILE = (
    Path(__file__).parents[2] / "labextension/jupyter-config/server-config/gpupool_lab.json"
)

Api = Callable[..., tuple[int, Any]]
FIX = "remove it or tag the cell skip-distributed"
DEEP = "The request body nests arrays and objects too deeply."


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(CONFIG_FILE.read_text(encoding="utf-8"))
    return config


@pytest.fixture
def api(jp_fetch: Any, jp_asyncio_loop: Any, hub: FakeHub) -> Api:
    """``api(method, *path, body=..., params=..., headers=...)`` → ``(status, JSON reply)``."""

    def call(
        method: str,
        *parts: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = None if body is None else body if isinstance(body, str) else json.dumps(body)
        if data is None and method in ("POST", "PUT"):
            data = "{}"
        response = jp_asyncio_loop.run_until_complete(
            jp_fetch(
                "gpupool",
                *parts,
                method=method,
                body=data,
                params=params,
                headers=headers,
                raise_error=False,
            )
        )
        return response.code, json.loads(response.body) if response.body else None

    return call


FOUR_CELLS = (
    new_markdown_cell("# Title"),
    new_code_cell("print('one')"),
    new_code_cell("print('two')"),
    new_code_cell("print('three')"),
)

# -- the hooks and the shipped configuration -------------------------------------------------------


def test_the_package_declares_the_extension_hooks() -> None:
    assert gpupool_lab._jupyter_server_extension_points() == [{"module": "gpupool_lab.server"}]
    assert gpupool_lab._jupyter_labextension_paths() == [
        {"src": "labextension", "dest": "gpupool-lab"}
    ]
    assert json.loads(CONFIG_FILE.read_text()) == {
        "ServerApp": {"jpserver_extensions": {"gpupool_lab": True}}
    }


def test_the_extension_is_loaded_under_the_base_url(jp_serverapp: Any, api: Api) -> None:
    assert jp_serverapp.extension_manager.extensions["gpupool_lab"].enabled
    assert api("GET", "offers") == (200, OFFERS)


# -- authentication -------------------------------------------------------------------------------

ROUTES = [
    ("GET", "offers"),
    ("POST", "submit"),
    ("GET", "jobs"),
    ("GET", "jobs/1"),
    ("DELETE", "jobs/1"),
    ("POST", "jobs/1/resubmit"),
    ("GET", "jobs/1/logs"),
    ("GET", "allocation"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_a_request_without_the_servers_token_is_refused(
    api: Api,
    hub: FakeHub,
    http_server_client: Any,
    jp_base_url: str,
    jp_asyncio_loop: Any,
    method: str,
    path: str,
) -> None:
    job = hub.add_job("alice")
    status, _ = api(method, path, headers={"Authorization": "token not-the-servers"})
    assert status == 403
    body = "{}" if method == "POST" else None
    with pytest.raises(HTTPClientError) as refused:
        jp_asyncio_loop.run_until_complete(
            http_server_client.fetch(f"{jp_base_url}gpupool/{path}", method=method, body=body)
        )
    assert refused.value.code == 403
    assert hub.posted == [] and hub.jobs[job["id"]]["state"] == "queued"


# -- forwarding -----------------------------------------------------------------------------------


def test_jobs_job_and_cancel_are_the_hubs(api: Api, hub: FakeHub) -> None:
    assert api("GET", "jobs") == (200, {"jobs": [], "next": None})
    mine = hub.add_job("alice", name="train", gpus=2)
    hub.add_job("bob", name="hidden")
    status, reply = api("GET", "jobs")
    assert (status, [j["name"] for j in reply["jobs"]]) == (200, ["train"])
    assert api("GET", "jobs", mine["id"]) == (
        200,
        {**hub.jobs[mine["id"]], "resubmittable": False},  # the hub's job, with our one field
    )
    status, reply = api("DELETE", "jobs", mine["id"])
    assert (status, reply["state"], reply["reason"]) == (200, "cancelled", "cancelled by alice")
    assert hub.jobs[mine["id"]]["state"] == "cancelled"


def test_jobs_come_a_page_at_a_time_as_the_hub_pages_them(api: Api, hub: FakeHub) -> None:
    newest_first = [hub.add_job("alice", name=f"j{i}")["id"] for i in range(5)][::-1]
    status, first = api("GET", "jobs", params={"limit": 2})
    assert (status, [j["id"] for j in first["jobs"]]) == (200, newest_first[:2])
    assert first["next"] and all(j["resubmittable"] is False for j in first["jobs"])
    status, second = api("GET", "jobs", params={"limit": 3, "cursor": first["next"]})
    assert (status, [j["id"] for j in second["jobs"]], second["next"]) == (
        200,
        newest_first[2:],
        None,
    )
    status, reply = api("GET", "jobs", params={"limit": "0"})
    assert (status, reply["message"]) == (400, "limit must be a whole number from 1 to 500.")


def test_hub_errors_reach_the_user_word_for_word(
    api: Api, hub: FakeHub, jp_root_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert api("GET", "jobs", "77") == (404, {"message": "No such job: 77"})
    assert api("GET", "jobs", "2", "logs") == (404, {"message": "No such job: 2"})
    write_notebook(jp_root_dir / "big.ipynb", new_code_cell("pass"))
    body = {"path": "big.ipynb", "offer": "h100", "gpus": 2, "nodes": 3}
    assert api("POST", "submit", body=body) == (
        403,
        {
            "message": "The job needs 6 GPU-eq; team vision may hold at most 4; "
            "it could never start."
        },
    )
    body = {"path": "big.ipynb", "offer": "a100"}
    status, reply = api("POST", "submit", body=body)
    assert (status, reply["message"]) == (
        400,
        "No offer 'a100' for team vision: ['cpu', 'h100', 'h100-mig-3g']",
    )
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "nope")
    assert api("GET", "offers") == (403, {"message": "Missing or invalid credentials."})


def test_an_unreachable_or_missing_hub(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:9/hub/api")
    status, reply = api("GET", "jobs")
    assert status == 502
    assert reply["message"].startswith("cannot reach the hub at http://127.0.0.1:9/hub/api: ")
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN")
    status, reply = api("GET", "offers")
    assert status == 503 and "not inside a JupyterHub single-user server" in reply["message"]


# -- submitting -----------------------------------------------------------------------------------


def test_submit_converts_the_notebook_from_the_contents_manager(
    api: Api, hub: FakeHub, jp_serverapp: Any, jp_root_dir: Path, jp_home_dir: Path
) -> None:
    write_notebook(
        jp_root_dir / "exp" / "train.ipynb",
        new_markdown_cell("# Train"),
        new_code_cell("%matplotlib inline\nimport os\nprint('in', os.path.basename(os.getcwd()))"),
        new_code_cell("!nvidia-smi", metadata={"tags": ["skip-distributed"]}),
    )
    request = {
        "path": "exp/train.ipynb",
        "cells": "all",
        "gpus": 2,
        "nodes": 1,
        "offer": "h100",
        "team": "vision",
        "time_limit": "1h30m",
        "name": "first run",
    }
    status, job = api("POST", "submit", body=request)
    assert status == 201, job
    assert (job["id"], job["name"], job["state"], job["ranks"]) == ("1", "first run", "queued", 2)
    (posted,) = hub.posted
    script = posted.pop("script")
    assert posted == {
        "gpus": 2,
        "name": "first run",
        "filename": "train.ipynb",
        "workdir": os.path.join(jp_serverapp.contents_manager.root_dir, "exp"),
        "offer": "h100",
        "nodes": 1,
        "team": "vision",
        "time_limit": 5400,
    }
    assert script.startswith("# Generated by gpupool from 'train.ipynb'")
    assert "# Left out (tagged skip-distributed): #3" in script
    remembered = json.loads((jp_home_dir / ".gpupool" / "submissions.json").read_text())
    assert remembered == {"1": {**request, "time_limit": 5400}}


def test_submit_defaults_name_and_offer(api: Api, hub: FakeHub, jp_root_dir: Path) -> None:
    write_notebook(jp_root_dir / "eval.ipynb", new_code_cell("print('x')"))
    status, job = api("POST", "submit", body={"path": "/eval.ipynb", "gpus": 2})
    assert (status, job["name"], job["offer"]) == (201, "eval", "h100")  # the CLI's default rule
    assert os.path.samefile(hub.posted[0]["workdir"], jp_root_dir)
    status, job = api("POST", "submit", body={"path": "/eval.ipynb", "gpus": 3})
    assert (status, job["offer"], job["state"]) == (201, "h100", "queued")  # it would wait
    assert job["reason"] == "waiting: needs 3 GPU-eq; team vision has 2.5 left"


@pytest.mark.parametrize(
    ("cells", "included", "output"),
    [
        ("all", "#2, #3, #4", "one\ntwo\nthree\n"),
        ({"upto": 2}, "#2, #3", "one\ntwo\n"),
        ({"selected": [3, 1]}, "#2, #4", "one\nthree\n"),
    ],
)
def test_the_chosen_cells_reach_the_hub_as_the_script(
    api: Api, hub: FakeHub, jp_root_dir: Path, cells: Any, included: str, output: str
) -> None:
    write_notebook(jp_root_dir / "four.ipynb", *FOUR_CELLS)
    status, _ = api("POST", "submit", body={"path": "four.ipynb", "cells": cells, "offer": "cpu"})
    assert status == 201
    script = hub.posted[0]["script"]
    assert f"# Cells included: {included}\n" in script
    assert run_script(script) == output


def test_a_notebook_with_a_magic_is_refused_naming_the_cell(
    api: Api, hub: FakeHub, jp_root_dir: Path
) -> None:
    write_notebook(jp_root_dir / "t.ipynb", new_code_cell("x = 1"), new_code_cell("%pip install x"))
    assert api("POST", "submit", body={"path": "t.ipynb", "offer": "h100"}) == (
        400,
        {"message": f"cell #2 uses %pip install x (line 1): {FIX}"},
    )
    assert hub.posted == []


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("not json", 400, "The request body is not valid JSON."),
        ("[" * 100_000 + "]" * 100_000, 400, DEEP),
        (
            '{"path": ' + "[" * 10_000 + "]" * 10_000 + "}",
            400,
            DEEP,
        ),
        ([], 400, "The request body must be a JSON object."),
        ({"cells": "all"}, 400, "path must be the notebook's path relative to the server root."),
        ({"path": "four.ipynb", "gpu": 2}, 400, "Unknown fields: gpu."),
        (
            {"path": "four.ipynb", "cells": {"upto": "2"}},
            400,
            'cells must be "all", {"upto": index} or {"selected": [index, ...]} (0-based cell '
            'indexes), not {"upto": "2"}',
        ),
        (
            {"path": "four.ipynb", "cells": {"upto": 9}},
            400,
            "cell index 9 is out of range: the notebook has 4",
        ),
        (
            {"path": "four.ipynb", "time_limit": "soon"},
            400,
            "time_limit: not a duration: 'soon' (use seconds, or e.g. 30m, 2h, 1h30m)",
        ),
        ({"path": "missing.ipynb"}, 404, "No such file or directory: missing.ipynb"),
        ({"path": "100% done.ipynb"}, 404, "No such file or directory: 100% done.ipynb"),
        (
            {"path": "four.ipynb", "gpus": 5},
            400,
            "no GPU offer comes with 5 GPU(s) per node (counts offered: 1, 2, 3, 4); "
            "pass --offer (see: gpupool offers)",
        ),
        (
            {"path": "four.ipynb", "gpus": 4},
            400,
            "4× H100 · vision could never start for you: needs 4 GPU-eq; your cap in team "
            "vision is 3",
        ),
    ],
)
def test_bad_submit_requests(
    api: Api, hub: FakeHub, jp_root_dir: Path, body: Any, status: int, message: str
) -> None:
    write_notebook(jp_root_dir / "four.ipynb", *FOUR_CELLS)
    answer = api("POST", "submit", body=body)
    assert answer[0] == status
    assert answer[1]["message"] == message
    assert hub.posted == []


def test_resubmit_converts_the_same_notebook_again(
    api: Api, hub: FakeHub, jp_root_dir: Path
) -> None:
    path = write_notebook(jp_root_dir / "four.ipynb", *FOUR_CELLS)
    request = {"path": "four.ipynb", "cells": {"selected": [1, 2]}, "gpus": 2, "offer": "h100"}
    status, first = api("POST", "submit", body=request)
    assert status == 201
    edited = nbformat.read(path, as_version=4)
    edited.cells[1].source = "print('one, edited')"
    nbformat.write(edited, path)
    status, second = api("POST", "jobs", first["id"], "resubmit")
    assert (status, second["id"]) == (201, "2")
    before, after = ({k: v for k, v in p.items() if k != "script"} for p in hub.posted)
    assert before == after
    assert run_script(hub.posted[1]["script"]) == "one, edited\ntwo\n"
    status, third = api("POST", "jobs", second["id"], "resubmit")  # a resubmission is remembered
    assert (status, third["id"], third["resubmittable"]) == (201, "3", True)
    assert api("POST", "jobs", "99", "resubmit") == (404, {"message": not_resubmittable("99")})


def not_resubmittable(job_id: str) -> str:
    return (
        f"Job {job_id} cannot be resubmitted from JupyterLab: no notebook and options are "
        "remembered for it (only for your latest jobs sent from the Run distributed dialog). "
        "Submit it again the way it was sent."
    )


def test_resubmittable_says_which_jobs_resubmit_can_send_again(
    api: Api, hub: FakeHub, jp_root_dir: Path
) -> None:
    write_notebook(jp_root_dir / "four.ipynb", *FOUR_CELLS)
    status, dialog = api("POST", "submit", body={"path": "four.ipynb", "offer": "cpu"})
    assert (status, dialog["resubmittable"]) == (201, True)
    # a job the hub knows but this server extension never submitted (REST, the CLI, the widget)
    by_cli = hub.add_job("alice", name="from the CLI")
    status, reply = api("GET", "jobs")
    assert status == 200
    assert {j["id"]: j["resubmittable"] for j in reply["jobs"]} == {
        dialog["id"]: True,
        by_cli["id"]: False,
    }
    assert reply["jobs"][0] == {**hub.jobs[by_cli["id"]], "resubmittable": False}  # newest
    assert api("GET", "jobs", dialog["id"])[1]["resubmittable"] is True
    assert api("GET", "jobs", by_cli["id"])[1]["resubmittable"] is False
    status, cancelled = api("DELETE", "jobs", dialog["id"])
    assert (status, cancelled["state"], cancelled["resubmittable"]) == (200, "cancelled", True)

    before = len(hub.posted)
    assert api("POST", "jobs", by_cli["id"], "resubmit") == (
        404,
        {"message": not_resubmittable(by_cli["id"])},
    )
    assert len(hub.posted) == before  # nothing was sent
    status, again = api("POST", "jobs", dialog["id"], "resubmit")
    assert (status, again["resubmittable"]) == (201, True)
    status, reply = api("GET", "jobs")
    assert [j["resubmittable"] for j in reply["jobs"]] == [True, False, True]


def test_jobs_are_not_resubmittable_when_the_store_is_unreadable(
    api: Api, hub: FakeHub, jp_home_dir: Path
) -> None:
    job = hub.add_job("alice")
    store = jp_home_dir / ".gpupool" / "submissions.json"
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text("not json", encoding="utf-8")
    assert api("GET", "jobs")[1]["jobs"][0]["resubmittable"] is False
    store.write_text(json.dumps({job["id"]: {"path": "four.ipynb"}}), encoding="utf-8")
    assert api("GET", "jobs", job["id"])[1]["resubmittable"] is True


# -- logs -----------------------------------------------------------------------------------------


def test_logs_as_text_with_size_and_state(api: Api, hub: FakeHub) -> None:
    job = hub.add_job("alice", gpus=2)
    hub.start(job["id"])
    check = "✓".encode()
    hub.write(job["id"], 1, b"step 1 " + check[:2])  # a character cut in two
    assert api("GET", "jobs", job["id"], "logs", params={"rank": 1}) == (
        200,
        {"text": "step 1 ", "size": 7, "state": "running"},
    )
    hub.write(job["id"], 1, check[2:] + b"\n")
    assert api("GET", "jobs", job["id"], "logs", params={"rank": 1, "offset": 7}) == (
        200,
        {"text": "✓\n", "size": 11, "state": "running"},
    )
    hub.write(job["id"], 0, b"bad \xff\n")
    hub.finish(job["id"])
    assert api("GET", "jobs", job["id"], "logs") == (
        200,
        {"text": "bad \ufffd\n", "size": 6, "state": "succeeded"},
    )
    assert api("GET", "jobs", job["id"], "logs", params={"rank": "x"}) == (
        400,
        {"message": "rank and offset must be whole numbers"},
    )
    assert api("GET", "jobs", job["id"], "logs", params={"rank": 5}) == (
        400,
        {"message": f"Job {job['id']} has ranks 0 to 1"},
    )


def test_log_reply_holds_back_only_a_cut_character() -> None:
    snow = "☃".encode()  # 3 bytes
    assert log_reply(b"ab" + snow[:1], 10, 13, "running") == {
        "text": "ab",
        "size": 12,
        "state": "running",
    }
    assert log_reply(snow + "é".encode()[:1], 0, 4, "running")["size"] == 3
    assert log_reply(b"ab" + snow[:2], 0, 4, "failed")["text"] == "ab\ufffd"  # it has ended
    assert log_reply(b"", 5, 5, "queued") == {"text": "", "size": 5, "state": "queued"}


# -- allocation -----------------------------------------------------------------------------------

ENV_KEYS = (
    "GPUPOOL_ALLOCATION",
    "GPUPOOL_OFFER",
    "GPUPOOL_TEAM",
    "GPUPOOL_SIMULATED",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)


@pytest.mark.parametrize(
    ("env", "hub_up", "expected"),
    [
        (
            {
                "GPUPOOL_OFFER": "h100",
                "GPUPOOL_TEAM": "vision",
                "GPUPOOL_SIMULATED": "0",  # the server's own word wins over the hub's
                "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
            },
            True,
            {"label": "2× H100 · vision", "offer": "h100", "team": "vision", "simulated": False},
        ),
        (
            {
                "GPUPOOL_OFFER": "h100-mig-3g",
                "GPUPOOL_TEAM": "vision",
                "CUDA_VISIBLE_DEVICES": "MIG-1",
            },
            True,
            {"label": "MIG 3g.40gb · vision", "offer": "h100-mig-3g", "simulated": True},
        ),
        (
            {"GPUPOOL_OFFER": "cpu", "GPUPOOL_TEAM": "vision", "CUDA_VISIBLE_DEVICES": ""},
            True,
            {"label": "CPU only", "offer": "cpu", "team": "vision"},
        ),
        (
            {
                "GPUPOOL_OFFER": "h100",
                "GPUPOOL_TEAM": "vision",
                "GPUPOOL_SIMULATED": "1",
                "CUDA_VISIBLE_DEVICES": "GPU-a",
            },
            True,
            {"label": "1× H100 · vision", "simulated": True},
        ),
        ({}, True, {"label": "CPU only", "offer": "", "team": "", "simulated": True}),
        (
            {
                "GPUPOOL_OFFER": "h100",
                "GPUPOOL_TEAM": "vision",
                "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
            },
            False,
            {"label": "h100 ×2 · vision", "simulated": False},
        ),
        (
            {"GPUPOOL_OFFER": "mig-3g.40gb", "GPUPOOL_TEAM": "nlp", "GPUPOOL_SIMULATED": "1"},
            False,
            {"label": "MIG 3g.40gb · nlp", "simulated": True},
        ),
        ({"GPUPOOL_OFFER": "cpu"}, False, {"label": "CPU only", "simulated": False}),
    ],
)
def test_allocation_label(
    api: Api,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    hub_up: bool,
    expected: dict[str, Any],
) -> None:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {"GPUPOOL_ALLOCATION": "alloc-7", **env}.items():
        monkeypatch.setenv(key, value)
    if not hub_up:
        monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:9/hub/api")
    status, reply = api("GET", "allocation")
    assert status == 200
    assert set(reply) == {
        "label",
        "offer",
        "team",
        "simulated",
        "allocation",
        "idle_since",
        "warning",
    }
    assert reply["allocation"] == "alloc-7"
    assert (reply["idle_since"], reply["warning"]) == (None, None)  # the hub lists none
    assert {key: reply[key] for key in expected} == expected


def test_allocation_labels_from_the_real_hubs_offer_labels() -> None:
    def choice(name: str, kind: str, label: str, count: int = 1) -> dict[str, Any]:
        return {"name": name, "kind": kind, "label": label, "count": count}

    offers = {
        "simulated": False,
        "teams": [
            {"team": "nlp", "offers": [choice("h100", "gpu", "H100-80GB ×1")]},
            {
                "team": "vision",
                "offers": [
                    choice("cpu", "cpu", "CPU only"),
                    choice("h100", "gpu", "H100-80GB ×1"),
                    choice("h100", "gpu", "H100-80GB ×2", 2),
                    choice("mig-3g.40gb", "mig", "MIG 3g.40gb"),
                ],
            },
        ],
    }

    def label(**env: str) -> str:
        return str(allocation_info(env, offers)["label"])

    assert label(GPUPOOL_OFFER="h100", GPUPOOL_TEAM="vision", CUDA_VISIBLE_DEVICES="GPU-a") == (
        "H100-80GB ×1 · vision"
    )
    assert label(GPUPOOL_OFFER="h100", GPUPOOL_TEAM="vision", CUDA_VISIBLE_DEVICES="a,b,c,d") == (
        "H100-80GB ×4 · vision"
    )
    assert label(
        GPUPOOL_OFFER="h100", GPUPOOL_TEAM="nlp", NVIDIA_VISIBLE_DEVICES="GPU-x,GPU-y"
    ) == ("H100-80GB ×2 · nlp")
    assert label(GPUPOOL_OFFER="h100", GPUPOOL_TEAM="vision") == "H100-80GB · vision"  # no list
    assert label(GPUPOOL_OFFER="mig-3g.40gb", GPUPOOL_TEAM="vision") == "MIG 3g.40gb · vision"
    assert label(GPUPOOL_OFFER="cpu", GPUPOOL_TEAM="vision") == "CPU only"
    assert allocation_info({}, offers)["simulated"] is False


def test_allocation_answers_while_the_hub_hangs(
    api: Api, monkeypatch: pytest.MonkeyPatch, hub: FakeHub
) -> None:
    monkeypatch.setenv("GPUPOOL_OFFER", "h100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a")
    monkeypatch.setattr("gpupool_lab.server.ALLOCATION_HUB_TIMEOUT", 0.3)
    with hub.lock:  # the stand-in cannot answer while the test holds its lock
        status, reply = api("GET", "allocation")
    assert (status, reply["label"]) == (200, "h100 ×1")


# -- the idle reclaimer's warning -----------------------------------------------------------------

WARNING = {
    "reclaim_at": "2025-01-01T14:05:00+00:00",
    "action": "cpu",
    "reason": "idle",
    "message": "This server's GPU (h100) has been idle; at 14:05 UTC it will be restarted "
    "without a GPU (CPU only).",
}


def gpu_server(monkeypatch: pytest.MonkeyPatch, allocation: str = "alloc-2") -> None:
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in {
        "GPUPOOL_ALLOCATION": allocation,
        "GPUPOOL_OFFER": "h100",
        "GPUPOOL_TEAM": "vision",
        "CUDA_VISIBLE_DEVICES": "GPU-a",
    }.items():
        monkeypatch.setenv(key, value)


def test_allocation_passes_on_this_servers_idle_warning(
    api: Api, hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_server(monkeypatch)
    hub.add_allocation("alice", id="alloc-1", idle={"idle_since": "2025-01-01T13:00:00+00:00"})
    hub.add_allocation(
        "alice", id="alloc-2", idle={"idle_since": "2025-01-01T13:35:00+00:00", "warning": WARNING}
    )
    status, reply = api("GET", "allocation")
    assert status == 200
    assert (reply["label"], reply["allocation"]) == ("1× H100 · vision", "alloc-2")
    assert reply["warning"] == WARNING
    assert reply["idle_since"] == "2025-01-01T13:35:00+00:00"

    hub.allocations[1]["idle"].update(warning=None, idle_since=None)  # the GPU is used again
    status, reply = api("GET", "allocation")
    assert (status, reply["warning"], reply["idle_since"]) == (200, None, None)


@pytest.mark.parametrize("failure", [403, 500, "unreachable"])
def test_allocation_answers_without_a_warning_when_the_hubs_allocations_fail(
    api: Api,
    hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
    failure: int | str,
) -> None:
    gpu_server(monkeypatch)
    hub.add_allocation("alice", id="alloc-2", idle={"warning": WARNING})
    if failure == "unreachable":
        monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:9/hub/api")
    else:
        hub.allocations_fail = int(failure)
    status, reply = api("GET", "allocation")
    assert status == 200
    assert reply["allocation"] == "alloc-2" and reply["label"].endswith(" · vision")
    assert (reply["warning"], reply["idle_since"]) == (None, None)


def test_idle_state_of_this_servers_allocation() -> None:
    def listed(allocation_id: str, idle: Any = None) -> dict[str, Any]:
        return {
            "id": allocation_id,
            "kind": "notebook",
            **({"idle": idle} if idle is not None else {}),
        }

    idle = {"idle_since": "2025-01-01T13:35:00+00:00", "action": "stop", "warning": WARNING}
    none = {"idle_since": None, "warning": None}
    assert idle_state([listed("a", {"warning": None}), listed("b", idle)], "b") == {
        "idle_since": "2025-01-01T13:35:00+00:00",
        "warning": WARNING,
    }
    assert idle_state([listed("b", idle)], "a") == none  # not this server's
    assert idle_state([listed("b", idle)], "") == none  # a server without an allocation
    assert idle_state(None, "b") == none  # the hub did not answer
    assert idle_state([listed("b")], "b") == none  # CPU: nothing for the reclaimer to watch
    partial = {"warning": {"reclaim_at": "soon"}, "idle_since": 5}
    assert idle_state([listed("b", partial)], "b") == none  # not the contract's shape
    extra = {"warning": {**WARNING, "extra": 1}}
    assert idle_state([listed("b", extra)], "b")["warning"] == WARNING
    assert allocation_info({"GPUPOOL_ALLOCATION": "b"}, None, [listed("b", idle)])["warning"] == (
        WARNING
    )
