"""The hub API client and the ``gpupool`` command against the stand-in hub over real HTTP.

The stand-in is :class:`tests.lab.fake_hub.FakeHub` (the ``hub`` fixture of ``conftest.py``):
the hub's gpupool contract over real HTTP, as ``openapi.yaml`` documents it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell

from gpupool_lab.client import Client, HubError, HubUnreachable, NotConfigured, hub_api_url
from gpupool_lab.command import main as cli
from gpupool_lab.options import OptionError
from tests.lab.conftest import later, write_notebook
from tests.lab.fake_hub import OFFERS, TEAMS, FakeHub, offer


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- the client -----------------------------------------------------------------------------------


def test_client_configures_itself_from_the_single_user_environment(hub: FakeHub) -> None:
    client = Client()
    assert client.base_url == hub.api_url + "/gpupool/"
    assert client.user == "alice"
    assert client.offers() == OFFERS
    assert client.teams() == TEAMS
    assert client.jobs() == []
    assert client.allocations() == []


def test_client_allocations_are_the_users_own_with_the_idle_warning(hub: FakeHub) -> None:
    warning = {"reclaim_at": "2025-01-01T14:05:00+00:00", "action": "stop", "message": "idle"}
    mine = hub.add_allocation("alice", idle={"warning": warning})
    hub.add_allocation("bob")
    assert Client().allocations() == [mine]
    assert mine["idle"]["warning"] == warning
    assert len(Client(token="admin-token").allocations()) == 0
    hub.allocations_fail = 403
    with pytest.raises(HubError, match="allocations are unavailable"):
        Client().allocations()


def test_hub_api_url_accepts_the_hub_address_in_several_forms() -> None:
    assert hub_api_url("https://hub.example.org") == "https://hub.example.org/hub/api"
    assert hub_api_url("https://x.org/jupyter/hub/") == "https://x.org/jupyter/hub/api"
    assert hub_api_url("http://127.0.0.1:8081/hub/api/") == "http://127.0.0.1:8081/hub/api"


def test_client_raises_the_hubs_message_word_for_word(hub: FakeHub) -> None:
    client = Client()
    with pytest.raises(HubError) as info:
        client.job("404")
    assert (info.value.status, info.value.message, str(info.value)) == (
        404,
        "No such job: 404",
        "No such job: 404",
    )
    with pytest.raises(HubError) as info:
        Client(token="wrong").jobs()
    assert (info.value.status, info.value.message) == (403, "Missing or invalid credentials.")
    with pytest.raises(HubError, match=r"^No offer 'a100' for team vision"):
        client.submit("print(1)", offer="a100")


def test_client_submit_sends_only_given_fields_and_users_see_their_own_jobs(hub: FakeHub) -> None:
    other = hub.add_job("bob", name="bobs")
    job = Client().submit("print(1)", name="mine", gpus=2, env={"A": "1"}, time_limit=60)
    assert hub.posted == [
        {"script": "print(1)", "gpus": 2, "name": "mine", "env": {"A": "1"}, "time_limit": 60}
    ]
    assert (job["state"], job["owner"], job["ranks"]) == ("queued", "alice", 2)
    assert [j["id"] for j in Client().jobs()] == [job["id"]]
    assert {j["id"] for j in Client(token="admin-token").jobs()} == {job["id"], other["id"]}
    with pytest.raises(HubError, match=f"No such job: {other['id']}"):
        Client().cancel(other["id"])
    assert Client().cancel(job["id"])["state"] == "cancelled"


def test_client_and_cli_page_through_every_job_newest_first(
    hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub answers ``GET jobs`` a page at a time (50 by default): the client, and so the
    command, follow ``next`` to the last page; ``--limit`` shows only the newest."""
    made = [hub.add_job("alice", name=f"j{i}")["id"] for i in range(120)]
    hub.add_job("bob")
    newest_first = made[::-1]
    assert [j["id"] for j in Client().jobs()] == newest_first
    first, after = Client().jobs_page(limit=7)
    assert [j["id"] for j in first] == newest_first[:7] and after
    second, _ = Client().jobs_page(limit=7, cursor=after)
    assert [j["id"] for j in second] == newest_first[7:14]
    assert [j["id"] for j in Client().jobs(limit=60)] == newest_first[:60]
    code, out, _ = run(capsys, "jobs", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)["jobs"]] == newest_first
    code, out, _ = run(capsys, "jobs", "--limit", "3")
    assert code == 0 and [row.split()[1] for row in out.splitlines()[1:]] == [
        "j119",
        "j118",
        "j117",
    ]
    assert run(capsys, "jobs", "--limit", "0")[0] == 2


def test_client_logs_and_follow_stream_while_the_job_runs(hub: FakeHub) -> None:
    job = hub.add_job("alice", gpus=2)
    hub.start(job["id"])
    hub.write(job["id"], 1, b"hello from rank 1\n")
    client = Client()
    assert client.logs(job["id"], rank=1) == (b"hello from rank 1\n", 18, "running")
    assert client.logs(job["id"], rank=1, offset=6) == (b"from rank 1\n", 18, "running")
    stream = client.follow_logs(job["id"], rank=1, offset=6)
    assert next(stream) == b"from rank 1\n"  # arrives while the job still runs
    later(0.1, hub.write, job["id"], 1, "step 1 ✓\n".encode())
    assert next(stream) == "step 1 ✓\n".encode()
    later(0.1, hub.finish, job["id"])
    assert list(stream) == []


def test_follow_resumes_a_stream_that_is_cut_off(hub: FakeHub) -> None:
    job = hub.add_job("alice")
    hub.start(job["id"])
    hub.follow_cut_after = 1
    hub.write(job["id"], 0, b"one\n")
    later(0.2, hub.write, job["id"], 0, b"two\n")
    later(0.4, hub.write, job["id"], 0, b"three\n")
    later(0.6, hub.finish, job["id"])
    received = b"".join(Client().follow_logs(job["id"], poll=0.05))
    assert received == b"one\ntwo\nthree\n"


def test_wait_polls_until_the_job_has_ended(hub: FakeHub) -> None:
    job = hub.add_job("alice")
    later(0.1, hub.start, job["id"])
    later(0.3, hub.finish, job["id"], "failed", "rank 0 exited with 1")
    ended = Client().wait(job["id"], poll=0.05, timeout=10)
    assert (ended["state"], ended["reason"], ended["exit_codes"]) == (
        "failed",
        "rank 0 exited with 1",
        {"0": 1},
    )
    other = hub.add_job("alice")
    with pytest.raises(TimeoutError, match=f"job {other['id']} is still queued after 0.2 seconds"):
        Client().wait(other["id"], poll=0.05, timeout=0.2)


def test_unreachable_hub_and_missing_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        HubUnreachable, match=r"cannot reach the hub at http://127\.0\.0\.1:9/hub/api"
    ):
        Client(url="http://127.0.0.1:9", token="t", timeout=2).teams()
    monkeypatch.delenv("JUPYTERHUB_API_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    with pytest.raises(NotConfigured, match="no hub URL and API token: not inside a JupyterHub"):
        Client()


# -- the command line: reading ---------------------------------------------------------------------


def test_offers_table_and_json(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "offers")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "Inventory: simulated: 1 node, 4× H100-80GB  (SIMULATED: no real GPUs behind these offers)"
    )
    assert lines[2] == (
        "Team vision: 1.5 of 4 GPU-eq used (guarantee 3, may borrow 1), 2.5 left; "
        "you use 1 of your cap 3"
    )
    assert lines[3:10] == [
        "OFFER        KIND  LABEL        COUNT  COST  FREE  AVAILABLE",
        "cpu          cpu   CPU only         1     0    16  yes",
        "h100         gpu   1× H100          1     1     2  yes",
        "h100         gpu   2× H100          2     2     2  yes",
        "h100         gpu   3× H100          3     3     2  queues: needs 3 GPU-eq; team vision "
        "has 2.5 left",
        "h100         gpu   4× H100          4     4     2  no: needs 4 GPU-eq; your cap in team "
        "vision is 3",
        "h100-mig-3g  mig   MIG 3g.40gb      1   0.5     2  yes",
    ]
    assert lines[11].endswith("2 left; you use 0")
    code, out, _ = run(capsys, "offers", "--json")
    assert (code, json.loads(out)) == (0, OFFERS)


def test_offers_from_an_older_hub_without_admission(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for team in OFFERS["teams"]:
        for line in team["offers"]:
            monkeypatch.delitem(line, "admission")
    code, out, _ = run(capsys, "offers")
    rows = out.splitlines()[4:9]
    assert code == 0
    assert [r.split("  ")[-1] for r in rows] == [  # enabled: yes; else the hub decides
        "yes",
        "yes",
        "yes",
        "queues: needs 3 GPU-eq; team vision has 2.5 left",
        "queues: needs 4 GPU-eq; your cap in team vision is 3",
    ]


def test_teams_table_and_json(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "teams")
    assert code == 0
    assert out.splitlines() == [
        "TEAM    GUARANTEE  BORROW LIMIT  USED  BORROWED  QUEUED  RUNNING",
        "vision          3             1   1.5         0       1        2",
        "nlp             2             0     0         0       0        0",
    ]
    code, out, _ = run(capsys, "teams", "--json")
    assert json.loads(out) == {"teams": TEAMS}


def test_jobs_show_cancel(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "jobs") == (0, "No jobs.\n", "")
    first = hub.add_job("alice", name="train", gpus=2, nodes=2, time_limit=3600)
    second = hub.add_job("alice", name="eval", offer="h100-mig-3g", team="nlp")
    hub.add_job("bob", name="hidden")
    hub.start(first["id"])
    code, out, _ = run(capsys, "jobs")
    rows = out.splitlines()
    assert code == 0 and len(rows) == 3
    assert rows[0].split() == ["ID", "NAME", "OWNER", "TEAM", "OFFER", "GPUS", "STATE", "CREATED"]
    assert rows[1].split()[:8] == ["2", "eval", "alice", "nlp", "h100-mig-3g", "1", "queued", "#2"]
    assert rows[2].split()[:7] == ["1", "train", "alice", "vision", "h100", "2×2", "running"]
    assert rows[0].index("STATE") == rows[1].index("queued") == rows[2].index("running")

    code, out, _ = run(capsys, "show", first["id"])
    assert code == 0
    shown = dict(line.split(":", 1) for line in out.splitlines())
    assert {k: v.strip() for k, v in shown.items() if k in ("state", "ranks", "time limit")} == {
        "state": "running",
        "ranks": "4",
        "time limit": "3600 s",
    }
    assert shown["devices"].strip() == "GPU-a-0, GPU-a-1, GPU-a-2, GPU-a-3"
    code, out, _ = run(capsys, "show", second["id"], "--json")
    assert json.loads(out) == hub.jobs[second["id"]]

    assert run(capsys, "cancel", second["id"]) == (0, f"Job {second['id']}: cancelled\n", "")
    code, out, _ = run(capsys, "cancel", first["id"], "--json")
    assert (code, json.loads(out)["reason"]) == (0, "cancelled by alice")


def test_logs_print_bytes_and_follow(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    job = hub.add_job("alice", gpus=2)
    hub.start(job["id"])
    hub.write(job["id"], 1, "epoch 1 loss 0.5 ✓\n".encode())
    assert run(capsys, "logs", job["id"], "--rank", "1") == (0, "epoch 1 loss 0.5 ✓\n", "")
    code, out, _ = run(capsys, "logs", job["id"], "--rank", "1", "--json")
    assert code == 0
    assert json.loads(out) == {
        "id": job["id"],
        "rank": 1,
        "size": len("epoch 1 loss 0.5 ✓\n".encode()),
        "state": "running",
        "log": "epoch 1 loss 0.5 ✓\n",
    }
    later(0.2, hub.write, job["id"], 1, b"epoch 2\n")
    later(0.4, hub.finish, job["id"])
    assert run(capsys, "logs", job["id"], "-f", "--rank", "1") == (
        0,
        "epoch 1 loss 0.5 ✓\nepoch 2\n",
        "",
    )


# -- the command line: submitting ------------------------------------------------------------------


def test_submit_converts_a_notebook(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nb = write_notebook(
        tmp_path / "train.ipynb",
        new_markdown_cell("# Train"),
        new_code_cell("%matplotlib inline\nimport sys\nprint('args', sys.argv[1:])"),
        new_code_cell("!nvidia-smi", metadata={"tags": ["skip-distributed"]}),
        new_code_cell("print('last')"),
    )
    code, out, err = run(
        capsys,
        "submit",
        str(nb),
        "--gpus",
        "2",
        "--time-limit",
        "1h30m",
        "--priority",
        "5",
        "--max-restarts",
        "1",
        "-e",
        "SEED=1",
        "--cells",
        "upto:3",
        "--",
        "--lr",
        "0.1",
    )
    assert code == 0, err
    assert out == "Submitted job 1 (train): queued #1\n"
    assert err == "offer: h100 (the default for --gpus 2; --offer chooses another)\n"
    (body,) = hub.posted
    script = body.pop("script")
    assert body == {
        "gpus": 2,
        "name": "train",
        "filename": "train.ipynb",
        "workdir": str(tmp_path.resolve()),
        "args": ["--lr", "0.1"],
        "env": {"SEED": "1"},
        "offer": "h100",
        "team": "vision",  # the team of the line the default was chosen from
        "time_limit": 5400,
        "max_restarts": 1,
        "priority": 5,
    }
    assert "# Cells included: #2" in script and "print('last')" not in script
    assert "get_ipython" not in script and "nvidia-smi" not in script
    result = subprocess.run(
        [sys.executable, "-", "--lr", "0.1"], input=script, capture_output=True, text=True
    )
    assert result.stdout == "args ['--lr', '0.1']\n"


def test_submit_refuses_a_notebook_with_magics_before_asking_the_hub(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nb = write_notebook(
        tmp_path / "t.ipynb", new_code_cell("x = 1"), new_code_cell("%pip install x")
    )
    code, out, err = run(capsys, "submit", str(nb), "--offer", "h100")
    assert (code, out) == (1, "")
    assert err == (
        "t.ipynb: cannot run as a job:\n"
        "cell #2 uses %pip install x (line 1): remove it or tag the cell skip-distributed\n"
    )
    assert hub.posted == []


def test_submit_a_script_as_is_and_wait(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('plain script')\n", encoding="utf-8")
    later(0.3, hub.start, "1")
    later(0.5, hub.finish, "1")
    code, out, err = run(
        capsys,
        "submit",
        str(script),
        "--offer",
        "h100-nlp",
        "--team",
        "nlp",
        "--name",
        "n",
        "-w",
        "--poll",
        "0.05",
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "Submitted job 1 (n): queued #1",
        "Waiting for job 1 to end (Ctrl-C stops waiting, not the job)…",
        "Job 1 succeeded",
    ]
    assert hub.posted[0]["script"] == "print('plain script')\n"
    assert (hub.posted[0]["team"], hub.posted[0]["offer"]) == ("nlp", "h100-nlp")

    later(0.3, hub.finish, "2", "failed", "rank 1 exited with 1")
    code, out, _ = run(
        capsys, "submit", str(script), "--offer", "h100", "--wait", "--json", "--poll", "0.05"
    )
    assert code == 1
    assert json.loads(out)["reason"] == "rank 1 exited with 1"


def test_submit_charges_the_team_whose_line_it_judged(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A member of two teams who names no team: the job goes to the team of the line the
    command chose or judged (the hub's own default team may not have that offer at all)."""
    script = tmp_path / "job.py"
    script.write_text("print(1)\n", encoding="utf-8")
    code, _, err = run(capsys, "submit", str(script), "--offer", "h100-nlp")
    assert code == 0, err
    code, _, err = run(capsys, "submit", str(script), "--gpus", "2")
    assert code == 0, err
    assert [(p["team"], p["offer"]) for p in hub.posted] == [
        ("nlp", "h100-nlp"),
        ("vision", "h100"),
    ]


def test_submit_a_job_that_would_wait_queues_with_a_note(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "big.py"
    script.write_text("print('big')\n", encoding="utf-8")
    why = "needs 3 GPU-eq; team vision has 2.5 left"
    code, out, err = run(capsys, "submit", str(script), "--gpus", "3")
    assert (code, out) == (0, "Submitted job 1 (big): queued #1\n")
    assert err.splitlines() == [  # notes, not errors: the job was sent
        "offer: h100 (the default for --gpus 3; --offer chooses another)",
        f"will queue: {why}",
    ]
    assert {k: hub.posted[0][k] for k in ("offer", "gpus")} == {"offer": "h100", "gpus": 3}
    assert (hub.jobs["1"]["state"], hub.jobs["1"]["reason"]) == ("queued", f"waiting: {why}")
    code, out, _ = run(capsys, "show", "1")
    assert code == 0 and f"reason:        waiting: {why}" in out.splitlines()

    later(0.3, hub.start, "2")
    later(0.5, hub.finish, "2")
    code, out, err = run(
        capsys, "submit", str(script), "--offer", "h100", "--gpus", "3", "-w", "--poll", "0.05"
    )
    assert (code, err) == (0, f"will queue: {why}\n")
    assert out.splitlines()[-1] == "Job 2 succeeded"
    code, out, err = run(capsys, "submit", str(script), "--offer", "h100", "--gpus", "1", "--json")
    assert (code, err, json.loads(out)["reason"]) == (0, "", "waiting to start")  # it starts now
    assert len(hub.posted) == 3


def test_submit_refuses_an_offer_that_could_never_start(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "huge.py"
    script.write_text("pass\n", encoding="utf-8")
    never = (
        "4× H100 · vision could never start for you: needs 4 GPU-eq; your cap in team vision is 3"
    )
    for argv in (["--gpus", "4"], ["--gpus", "4", "--offer", "h100", "--team", "vision"]):
        assert run(capsys, "submit", str(script), *argv) == (2, "", f"gpupool submit: {never}\n")
    assert hub.posted == []


def test_default_offer_rules() -> None:  # the rule itself: test_lab_options.py
    assert cli.choose_offer(OFFERS, 1) == "h100"
    assert cli.choose_offer(OFFERS, 2, "nlp") == "h100-nlp"
    assert cli.choose_offer(OFFERS, 3) == "h100"  # over the team's quota in use: the job queues
    cpu_only = {"teams": [{"team": "t", "offers": [offer("cpu", "cpu", 1, 0.0, 8)]}]}
    assert cli.choose_offer(cpu_only, 4) == "cpu"
    with pytest.raises(OptionError, match="could never start for you: needs 4 GPU-eq"):
        cli.choose_offer(OFFERS, 4)
    with pytest.raises(OptionError, match=r"no GPU offer comes with 5 GPU\(s\) per node"):
        cli.choose_offer(OFFERS, 5)
    with pytest.raises(OptionError, match="you are not in team 'audio'"):
        cli.choose_offer(OFFERS, 1, "audio")


def test_hub_errors_pass_through_word_for_word(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "big.py"
    script.write_text("pass\n", encoding="utf-8")
    assert run(capsys, "submit", str(script), "--offer", "h100", "--gpus", "2", "--nodes", "3") == (
        1,
        "",
        "The job needs 6 GPU-eq; team vision may hold at most 4; it could never start.\n",
    )
    assert run(capsys, "show", "77") == (1, "", "No such job: 77\n")
    assert run(capsys, "jobs", "--token", "nope") == (1, "", "Missing or invalid credentials.\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "missing.ipynb"], "gpupool submit: no such file: missing.ipynb"),
        (["submit", "EXISTING.py", "--cells", "1,2"], "--cells applies to notebooks only"),
        (["submit", "EXISTING.py", "--time-limit", "soon"], "not a duration: 'soon'"),
        (["submit", "EXISTING.py", "--gpus", "0"], "must be at least 1"),
        (["submit", "EXISTING.py", "--cells", "upto:x"], "not a cell choice"),
        (["submit", "EXISTING.py", "--gpus", "5"], "no GPU offer comes with 5 GPU(s) per node"),
        (["jobs", "--", "x"], 'arguments after "--" are for submit only'),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(
    hub: FakeHub,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    message: str,
) -> None:
    (tmp_path / "EXISTING.py").write_text("pass\n", encoding="utf-8")
    argv = [str(tmp_path / a) if a == "EXISTING.py" else a for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert hub.posted == []


def test_cell_and_duration_parsing() -> None:
    assert cli.parse_cells("all") == "all"
    assert cli.parse_cells("upto:3") == 2
    assert cli.parse_cells("5, 1,2-3") == [0, 1, 2, 4]
    assert [cli.parse_duration(t) for t in ("90", "90s", "30m", "2h", "1h30m", "1d")] == [
        90,
        90,
        1800,
        7200,
        5400,
        86400,
    ]


def test_outside_a_single_user_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JUPYTERHUB_API_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    code, out, err = run(capsys, "jobs")
    assert (code, out) == (2, "")
    assert "not inside a JupyterHub single-user server" in err
    assert "Pass --url https://HUB-ADDRESS and --token TOKEN" in err
    code, _, err = run(capsys, "teams", "--url", "http://127.0.0.1:9", "--token", "t")
    assert code == 1 and err.startswith("cannot reach the hub at http://127.0.0.1:9/hub/api")


def test_the_installed_command_runs_as_a_process(hub: FakeHub) -> None:
    hub.add_job("alice", name="proc")
    env = dict(os.environ)
    script = Path(sys.executable).with_name("gpupool")  # the console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gpupool_lab.command"]
    result = subprocess.run(
        [*command, "show", "99"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "No such job: 99\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpupool_lab.command", "jobs", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0
    assert [j["name"] for j in json.loads(result.stdout)["jobs"]] == ["proc"]
