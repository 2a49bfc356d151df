"""The notebook-side launcher, job handles, ``submit()`` and ``%%distributed``, against the
stand-in hub (:class:`tests.lab.fake_hub.FakeHub`, the hub's contract over real HTTP; the ``hub``
fixture of ``conftest.py``).

The magic runs through a real IPython ``InteractiveShell`` (history in memory, its own
IPYTHONDIR), as ``%load_ext gpupool_lab`` would load it in a kernel.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import nbformat
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from traitlets.config import Config

import gpupool_lab
from gpupool_lab import Job, launcher, submit
from gpupool_lab.client import Client, HubError
from gpupool_lab.convert import ConversionError
from gpupool_lab.widget import Launcher
from tests.lab.conftest import later, run_script
from tests.lab.fake_hub import OFFERS, FakeHub


@pytest.fixture
def nb(tmp_path: Path) -> Path:
    path = tmp_path / "train.ipynb"
    cells = [
        new_markdown_cell("# Train"),
        new_code_cell("%matplotlib inline\nprint('one')"),
        new_code_cell("print('two')"),
        new_code_cell("print('three')"),
    ]
    nbformat.write(new_notebook(cells=cells), path)
    return path


def texts(widget: Launcher) -> list[str]:
    return [text for text, _ in widget.choice.options]


# -- the launcher ---------------------------------------------------------------------------------


def test_the_launcher_shows_the_hubs_choices(hub: FakeHub, nb: Path) -> None:
    widget = launcher(path=nb)
    assert isinstance(widget, Launcher)
    assert texts(widget) == [  # what a job may take: now, or queued (with why)
        "CPU only · vision — 16 free",
        "1× H100 · vision — 2 free",
        "2× H100 · vision — 2 free",
        "3× H100 · vision — 2 free (will queue: needs 3 GPU-eq; team vision has 2.5 left)",
        "MIG 3g.40gb · vision — 2 free",
        "1× H100 · nlp — 2 free",
        "2× H100 · nlp — 2 free",
    ]
    chosen = widget.choice.value
    assert (chosen.offer, chosen.team, chosen.count) == ("h100", "vision", 1)  # the CLI's rule
    assert (widget.gpus.value, widget.nodes.value, widget.cells.value) == (1, 1, "all")
    assert widget.cell_numbers.disabled and widget.name.value == "train"
    assert widget.unavailable.value == (  # could never start
        "<div>Unavailable (could never start):<ul>"
        "<li>4× H100 · vision: needs 4 GPU-eq; your cap in team vision is 3</li></ul></div>"
    )
    assert widget.quota.value == (
        "Team vision: 1.5 of 4 GPU-eq used, 2.5 left; you use 1 of your cap 3<br>"
        "Team nlp: 0 of 2 GPU-eq used, 2 left"
    )
    head = widget.children[0].value
    assert "train.ipynb" in head and "SIMULATED pool" in head
    assert not widget.submit_button.disabled and widget.status.value == ""


def test_the_launcher_takes_defaults_and_follows_the_choice(hub: FakeHub, nb: Path) -> None:
    widget = launcher(nb, offer="h100-nlp", team="nlp", gpus=2, cells=[0, 2], time_limit="1h")
    assert widget.choice.value.text == "2× H100 · nlp — 2 free"
    assert (widget.gpus.value, widget.time_limit.value) == (2, "1h")
    assert (widget.cells.value, widget.cell_numbers.value) == ("selected", "1,3")
    assert not widget.cell_numbers.disabled
    by_text = dict(widget.choice.options)
    widget.choice.value = by_text["MIG 3g.40gb · vision — 2 free"]
    assert widget.gpus.value == 1
    widget.choice.value = by_text["2× H100 · vision — 2 free"]
    assert widget.gpus.value == 2
    widget.cells.value = "all"
    assert widget.cell_numbers.disabled
    assert launcher(nb, cells=2).cell_numbers.value == "3"
    with pytest.raises(TypeError, match="unexpected keywords: gpu"):
        launcher(nb, gpu=2)  # type: ignore[call-arg]


def test_the_launchers_default_follows_the_ranking(hub: FakeHub, nb: Path) -> None:
    widget = launcher(nb, gpus=3)  # the line for 3 GPUs would wait: still the default
    assert widget.choice.value.text == (
        "3× H100 · vision — 2 free (will queue: needs 3 GPU-eq; team vision has 2.5 left)"
    )
    assert widget.status.value == ""
    widget = launcher(nb, gpus=4)  # the one line for 4 could never start: not chosen, and why
    assert widget.choice.value.text == "CPU only · vision — 16 free"  # the first of the now lines
    assert "4× H100 · vision could never start for you: needs 4 GPU-eq" in widget.status.value
    assert not widget.submit_button.disabled
    widget = launcher(nb, offer="h100", gpus=3)
    assert (widget.choice.value.count, widget.choice.value.admission) == (3, "wait")
    widget = launcher(nb, team="nlp", gpus=3)  # no default in nlp: its first line
    assert widget.choice.value.text == "1× H100 · nlp — 2 free"


class Offering:
    """A client that answers only ``GET offers``, with ``document``."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    def offers(self) -> dict[str, Any]:
        return self.document


def edge_line(kind: str, count: int = 1, admission: str = "now") -> dict[str, Any]:
    """A line of team edge: CPU, a share of an RTX 3090, or MIG 1g.10gb instances (2 free)."""
    name, label = {
        "cpu": ("cpu", "CPU only"),
        "share": ("share-6gb", "6 GB share of RTX3090-24GB"),
        "mig": ("mig-1g", f"MIG 1g.10gb ×{count}"),
    }[kind]
    reason = "" if admission == "now" else "only 2 free on one node"
    return {
        "name": name,
        "kind": kind,
        "label": label,
        "description": "",
        "count": count,
        "cost": 0.125 * count,
        "free": 2,
        "admission": admission,
        "enabled": admission == "now",
        "reason": reason,
    }


def test_the_launcher_counts_mig_instances_and_takes_one_share_per_node(nb: Path) -> None:
    edge = {"team": "edge", "used": 0, "limit": 4, "left": 4, "user_used": 0, "user_cap": None}
    lines = [edge_line("cpu"), edge_line("share")]
    lines += [edge_line("mig", n, "now" if n < 3 else "wait") for n in (1, 2, 3)]
    document = {"simulated": False, "inventory": "", "teams": [{**edge, "offers": lines}]}
    widget = Launcher(nb, client=cast(Client, Offering(document)), gpus=2)
    chosen = widget.choice.value  # no whole GPUs in the pool: MIG, as in the dialog
    assert (chosen.offer, chosen.count) == ("mig-1g", 2)
    gpus = widget.gpus
    assert (gpus.value, gpus.description, gpus.disabled) == (2, "MIG instances per node", False)
    by_text = dict(widget.choice.options)
    queued = "MIG 1g.10gb ×3 · edge — 2 free (will queue: only 2 free on one node)"
    widget.choice.value = by_text[queued]
    assert gpus.value == 3
    widget.choice.value = by_text["6 GB share of RTX3090-24GB · edge — 2 free"]
    assert (gpus.value, gpus.description, gpus.disabled) == (1, "Processes per node", True)
    widget.choice.value = by_text["CPU only · edge — 2 free"]
    assert (gpus.value, gpus.description, gpus.disabled) == (1, "Processes per node", False)
    widget.choice.value = by_text["MIG 1g.10gb ×2 · edge — 2 free"]
    assert (gpus.value, gpus.description) == (2, "MIG instances per node")
    shared = Launcher(nb, client=cast(Client, Offering(document)), offer="share-6gb")
    assert (shared.gpus.value, shared.gpus.disabled) == (1, True)


def test_a_line_that_would_wait_is_submitted_and_queued(hub: FakeHub, nb: Path) -> None:
    widget = launcher(nb)
    by_text = dict(widget.choice.options)
    widget.choice.value = by_text[
        "3× H100 · vision — 2 free (will queue: needs 3 GPU-eq; team vision has 2.5 left)"
    ]
    assert widget.gpus.value == 3
    job = widget.submit()
    assert job is not None and job.last["state"] == "queued"
    assert job.last["reason"] == "waiting: needs 3 GPU-eq; team vision has 2.5 left"
    assert widget.status.value.endswith(">Submitted job 1 (train): queued</pre>")
    assert {k: hub.posted[0][k] for k in ("offer", "team", "gpus")} == {
        "offer": "h100",
        "team": "vision",
        "gpus": 3,
    }


def test_the_launcher_with_an_older_hub(
    hub: FakeHub, nb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for team in OFFERS["teams"]:
        for line in team["offers"]:
            monkeypatch.delitem(line, "admission")  # only enabled: false reads as wait
    widget = launcher(nb)
    assert widget.unavailable.value == ""
    assert texts(widget)[3:5] == [
        "3× H100 · vision — 2 free (will queue: needs 3 GPU-eq; team vision has 2.5 left)",
        "4× H100 · vision — 2 free (will queue: needs 4 GPU-eq; your cap in team vision is 3)",
    ]
    assert widget.choice.value.text == "1× H100 · vision — 2 free"


def test_submit_from_the_launcher(hub: FakeHub, nb: Path) -> None:
    widget = launcher(path=nb)
    widget.choice.value = dict(widget.choice.options)["MIG 3g.40gb · vision — 2 free"]
    widget.choice.value = dict(widget.choice.options)["1× H100 · vision — 2 free"]
    widget.nodes.value = 2  # 2 GPU-eq in all: within alice's cap of 3
    widget.time_limit.value = "30m"
    widget.cells.value = "upto"
    widget.cell_numbers.value = "3"
    widget.name.value = "from the widget"
    widget.submit_button.click()
    assert widget.status.value.endswith(">Submitted job 1 (from the widget): queued</pre>")
    assert isinstance(widget.job, Job) and widget.job.id == "1"
    (posted,) = hub.posted
    script = posted.pop("script")
    assert posted == {
        "gpus": 1,
        "name": "from the widget",
        "filename": "train.ipynb",
        "workdir": str(nb.parent.resolve()),
        "offer": "h100",
        "nodes": 2,
        "team": "vision",
        "time_limit": 1800,
    }
    assert run_script(script) == "one\ntwo\n"
    widget.cells.value = "selected"
    widget.cell_numbers.value = "2,4"
    assert widget.submit() is not None
    assert run_script(hub.posted[1]["script"]) == "one\nthree\n"


def test_the_launcher_shows_refusals(hub: FakeHub, nb: Path, tmp_path: Path) -> None:
    widget = launcher(path=nb)
    widget.gpus.value, widget.nodes.value = 2, 3
    assert widget.submit() is None  # the hub's refusal, word for word
    assert (
        ">The job needs 6 GPU-eq; team vision may hold at most 4; it could never start.</pre>"
    ) in widget.status.value
    widget.gpus.value, widget.nodes.value = 4, 1
    assert widget.submit() is None  # the offers document says so before anything is sent
    assert (
        ">4× H100 · vision could never start for you: needs 4 GPU-eq; your cap in team vision "
        "is 3</pre>"
    ) in widget.status.value
    widget.gpus.value, widget.nodes.value = 1, 1
    widget.time_limit.value = "soon"
    assert widget.submit() is None and "not a duration: &#x27;soon&#x27;" in widget.status.value
    widget.time_limit.value = ""
    widget.cells.value, widget.cell_numbers.value = "upto", "9"
    assert widget.submit() is None
    assert "cell index 8 is out of range: the notebook has 4" in widget.status.value
    bad = tmp_path / "magic.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("!ls")]), bad)
    widget = launcher(path=bad)
    assert widget.submit() is None
    assert "magic.ipynb: cannot run as a job:\ncell #1 uses a shell escape !ls (line 1)" in (
        widget.status.value
    )
    assert hub.posted == []


def test_the_launcher_finds_its_notebook_or_says_so(
    hub: FakeHub, nb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JPY_SESSION_NAME", str(nb))
    assert launcher().path == nb
    monkeypatch.chdir(nb.parent)
    monkeypatch.setenv("JPY_SESSION_NAME", "some/folder/train.ipynb")  # an API path
    assert launcher().path == nb.parent / "train.ipynb"
    monkeypatch.delenv("JPY_SESSION_NAME")
    widget = launcher()
    assert widget.path is None and widget.submit() is None
    assert "JPY_SESSION_NAME is not set: use launcher(path=...)" in widget.status.value


def test_the_launcher_without_the_hub(nb: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:9/hub/api")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "t")
    widget = launcher(nb)
    assert widget.submit_button.disabled and texts(widget) == []
    assert "cannot reach the hub at http://127.0.0.1:9/hub/api" in widget.status.value


# -- submit() and Job -----------------------------------------------------------------------------


def test_submit_a_job_that_would_wait(hub: FakeHub, nb: Path) -> None:
    job = submit(nb, gpus=3)  # the default offer's line for 3 GPUs would wait: it queues
    assert (hub.posted[0]["offer"], job.last["state"]) == ("h100", "queued")
    assert job.status()["reason"] == "waiting: needs 3 GPU-eq; team vision has 2.5 left"


def test_submit_a_notebook_and_use_its_handle(hub: FakeHub, nb: Path) -> None:
    job = submit(nb, gpus=2, time_limit="1h30m", cells=[2])
    assert job.id == "1" and repr(job) == "Job('1', name='train', state='queued')"
    assert hub.posted[0]["offer"] == "h100" and hub.posted[0]["time_limit"] == 5400
    assert run_script(hub.posted[0]["script"]) == "two\n"
    hub.start("1")
    assert job.status()["state"] == "running"
    hub.write("1", 1, "loss 0.5 ✓\n".encode())
    assert job.logs(rank=1) == "loss 0.5 ✓\n" and job.logs() == ""
    html = job._repr_html_()
    assert "<th style='text-align:left'>state</th><td style='text-align:left'>running" in html
    assert "2 × 1" in html
    later(0.2, hub.finish, "1", "failed", "rank 1 exited with 1")
    assert job.wait(poll=0.05, timeout=10) == "failed"
    assert repr(job) == "Job('1', name='train', state='failed')"
    other = Job(hub.add_job("alice")["id"])  # a handle from an id
    with pytest.raises(TimeoutError, match=r"job 2 is still queued after 0\.2 seconds"):
        other.wait(timeout=0.2, poll=0.05)
    assert other.cancel()["state"] == "cancelled"
    assert other.status()["reason"] == "cancelled by alice"


def test_submit_scripts_and_refusals(hub: FakeHub, nb: Path, tmp_path: Path) -> None:
    job = submit("print('inline')\n", offer="cpu")
    assert hub.posted[-1]["script"] == "print('inline')\n" and "filename" not in hub.posted[-1]
    assert job.status()["offer"] == "cpu"
    script = tmp_path / "job.py"
    script.write_text("print('file')\n", encoding="utf-8")
    submit(str(script), offer="h100-nlp", team="nlp", gpus=2, name="n")
    assert {k: hub.posted[-1][k] for k in ("filename", "name", "team")} == {
        "filename": "job.py",
        "name": "n",
        "team": "nlp",
    }
    with pytest.raises(HubError, match=r"^No offer 'a100' for team vision"):
        submit(nb, offer="a100")
    with pytest.raises(ValueError, match=r"no GPU offer comes with 5 GPU\(s\) per node"):
        submit(nb, gpus=5)
    never = "4× H100 · vision could never start for you: needs 4 GPU-eq"
    with pytest.raises(ValueError, match=never):
        submit(nb, gpus=4)
    with pytest.raises(ValueError, match=never):
        submit(nb, gpus=4, offer="h100", team="vision")
    with pytest.raises(ValueError, match="cells applies to notebooks only"):
        submit(script, cells=[0])
    with pytest.raises(FileNotFoundError):
        submit(tmp_path / "missing.ipynb")
    bad = tmp_path / "bad.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("%time 1")]), bad)
    with pytest.raises(ConversionError, match="cell #1 uses %time 1"):
        submit(bad)
    assert len(hub.posted) == 2


# -- %%distributed --------------------------------------------------------------------------------


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InteractiveShell]:
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.chdir(tmp_path)
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    InteractiveShell.clear_instance()
    instance = InteractiveShell.instance(config=config)
    instance.run_line_magic("load_ext", "gpupool_lab")
    yield instance
    InteractiveShell.clear_instance()


def test_the_distributed_magic_runs_the_cell_as_a_job(
    hub: FakeHub, shell: InteractiveShell, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cell = "import sys\n%matplotlib inline\nprint('hello from', len(sys.argv), 'argv')\n"
    job = shell.run_cell_magic("distributed", "--gpus 2 --offer h100 --time-limit 30m", cell)
    assert isinstance(job, Job) and job.id == "1"
    assert capsys.readouterr().out == "Submitted job 1 (notebook-cell): queued\n"
    (posted,) = hub.posted
    assert {k: v for k, v in posted.items() if k != "script"} == {
        "gpus": 2,
        "name": "notebook-cell",
        "filename": "notebook_cell.py",
        "workdir": str(tmp_path),
        "offer": "h100",
        "time_limit": 1800,
    }
    assert run_script(posted["script"]) == "hello from 1 argv\n"


def test_the_distributed_magic_waits_and_shows_rank_0(
    hub: FakeHub,
    shell: InteractiveShell,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    nb: Path,
) -> None:
    monkeypatch.setenv("JPY_SESSION_NAME", str(nb))
    later(0.1, hub.start, "1")
    later(0.2, hub.write, "1", 0, b"rank 0 done\n")
    later(0.4, hub.finish, "1")
    line = "--team nlp --offer h100-nlp --gpus 2 --name eval --wait --poll 0.05"
    job = shell.run_cell_magic("distributed", line, "print('x')")
    assert job is not None and job.last["state"] == "succeeded"
    assert capsys.readouterr().out.splitlines() == [
        "Submitted job 1 (eval): queued",
        "Waiting for job 1 to end (interrupting stops waiting, not the job)…",
        "Job 1 succeeded",
        "--- rank 0 ---",
        "rank 0 done",
    ]
    assert hub.posted[0]["filename"] == "train_cell.py"
    assert "train %%distributed cell" in hub.posted[0]["script"]


def test_the_distributed_magic_reports_errors(
    hub: FakeHub, shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    assert shell.run_cell_magic("distributed", "--offer h100", "%pip install x\n") is None
    assert capsys.readouterr().err == (
        "%%distributed: this cell cannot run as a job:\n"
        "cell #1 uses %pip install x (line 1): remove it or tag the cell skip-distributed\n"
    )
    assert shell.run_cell_magic("distributed", "--gpus 2 --nodes 3 --offer h100", "pass") is None
    assert capsys.readouterr().err == (
        "The job needs 6 GPU-eq; team vision may hold at most 4; it could never start.\n"
    )
    assert shell.run_cell_magic("distributed", "--gpus 4", "pass") is None
    assert capsys.readouterr().err == (
        "4× H100 · vision could never start for you: needs 4 GPU-eq; your cap in team vision is 3\n"
    )
    with pytest.raises(UsageError, match="not a duration"):
        shell.run_cell_magic("distributed", "--time-limit soon", "pass")
    with pytest.raises(UsageError, match="must be at least 1, not 0"):  # as the CLI's --gpus
        shell.run_cell_magic("distributed", "--gpus 0", "pass")
    assert hub.posted == []


def test_the_package_exports_lazily() -> None:
    assert gpupool_lab.launcher is launcher and gpupool_lab.submit is submit
    assert gpupool_lab.Job is Job is gpupool_lab.widget.Job  # importable where it was before
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = gpupool_lab.nothing  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("module", "not_imported"),
    [
        ("gpupool_lab", ["IPython", "ipywidgets", "jupyter_server", "nbformat"]),
        ("gpupool_lab.command.main", ["IPython", "ipywidgets", "jupyter_server", "nbformat"]),
        ("gpupool_lab.job", ["ipywidgets", "jupyter_server"]),
    ],
)
def test_what_each_entry_point_imports(module: str, not_imported: list[str]) -> None:
    check = f"import sys, {module}\nprint(sorted(m for m in {not_imported!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", "")


def test_load_ext_registers_only_the_cell_magic(shell: InteractiveShell) -> None:
    magics: dict[str, Any] = shell.magics_manager.lsmagic()
    assert "distributed" in magics["cell"] and "distributed" not in magics["line"]
