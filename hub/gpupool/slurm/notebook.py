"""What the Slurm notebook spawner (:mod:`gpupool_spawner.slurm`) builds and decides, as pure
functions: the ``sbatch`` arguments, the batch script, the progress message, the exit status.

Vocabulary
- *server job*: the Slurm batch job that runs one JupyterLab server: named for people
  (:func:`gpupool.slurm.names.server_job_name`), tagged for the hub (``--comment``,
  :class:`gpupool.slurm.names.Tag` of kind ``server`` with the allocation's id).
- *port report*: the batch script, on the node, picks a free port, reports it to the hub with the
  server's own token (``POST /hub/api/gpupool/servers/port``, body ``{"port": N}``), and only then
  starts the server on it. The host is never reported: the hub takes it from Slurm (the node's
  address in ``sinfo``).
- *output file*: the job's ``--output``, written by Slurm as the user; the hub reads its tail
  (as a file owned by that account, :func:`gpupool.usercode.read_owned`) when the job dies.
- *exit status*: what ``Spawner.poll`` returns for an ended job (:class:`JobExit`, an ``int``
  that says the Slurm state when written out).

Contract: no I/O; every function here is a decision or a text the spawner hands to Slurm.
:func:`check_spawner_config` raises :class:`ConfigError` naming the key, so ``setup(c)`` stops
the hub at start on a bad Slurm spawner setting.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool.core.errors import PoolError
from gpupool.declarations import ConfigError
from gpupool.slurm.parse import SlurmJob
from gpupool.slurm.settings import check_time_limit

PORT_PATH = "gpupool/servers/port"
"""Where a server reports its port, under ``JUPYTERHUB_API_URL``."""

REPORT_FAILED = 97
"""The batch script's exit status when the port could not be reported (its words are in the
output file)."""


class NotTheServersToken(PoolError):
    """A port report with a token that is not a starting server's own (HTTP 403)."""

    code = "not_the_servers_token"


class NotStarting(PoolError):
    """A port report for a server that is not waiting for one (HTTP 409)."""

    code = "not_starting"


@dataclass(frozen=True)
class ServerJob:
    """What one server's Slurm job is: everything :func:`sbatch_args` needs."""

    job_name: str
    tag: str
    time_limit: str
    gres: str
    node: str
    account: str
    partition: str
    output: str
    workdir: str
    extra: tuple[str, ...] = ()


def sbatch_args(job: ServerJob) -> list[str]:
    """The arguments of ``sbatch`` for a server job (``--parsable --export=ALL`` are added by
    :meth:`gpupool.slurm.commands.SlurmCommands.sbatch`). ``--nodelist`` holds the job to the
    node the ledger chose (Slurm cannot be asked for a device index: sbatch(1)); one task, the
    batch step itself runs the server."""
    args = [
        f"--job-name={job.job_name}",
        f"--comment={job.tag}",
        f"--time={job.time_limit}",
        "--nodes=1",
        "--ntasks=1",
        f"--output={job.output}",
        f"--chdir={job.workdir}",
    ]
    if job.gres:
        args.append(f"--gres={job.gres}")
    if job.node:
        args.append(f"--nodelist={job.node}")
    if job.account:
        args.append(f"--account={job.account}")
    if job.partition:
        args.append(f"--partition={job.partition}")
    return [*args, *job.extra]


def output_path(template: str, home: str, username: str, job_name: str) -> str:
    """The job's output file from ``template`` (``{home}``, ``{username}``, ``{job_name}``);
    Slurm's own ``%`` patterns are doubled away so the hub knows the exact path it will read."""
    path = template.format(home=home.rstrip("/") or "/", username=username, job_name=job_name)
    return path.replace("%", "%%")


# The port report, run with ``python -I`` (no user site, no PYTHON* variables) before the server
# starts: the standard library only, so any Python on the node runs it. It prints the port.
REPORTER = """\
import json, os, socket, sys, time, urllib.error, urllib.request
s = socket.socket()
s.bind(("", 0))
port = s.getsockname()[1]
s.close()
api, token = os.environ.get("JUPYTERHUB_API_URL"), os.environ.get("JUPYTERHUB_API_TOKEN")
if not api or not token:
    print("gpupool: the job's environment lacks JUPYTERHUB_API_URL or JUPYTERHUB_API_TOKEN "
          "(does a sudo rule drop them? see docs/slurm.md)", file=sys.stderr)
    sys.exit(1)
url = api.rstrip("/") + "/" + PORT_PATH
req = urllib.request.Request(
    url,
    json.dumps({"port": port}).encode(),
    {"Authorization": "token " + token, "Content-Type": "application/json"},
    method="POST",
)
for attempt in range(ATTEMPTS):
    try:
        urllib.request.urlopen(req, timeout=30).read()
        break
    except urllib.error.HTTPError as e:
        words = e.read().decode(errors="replace")[:500]
        print(f"gpupool: the hub refused the port report ({e.code}): {words}", file=sys.stderr)
        if e.code < 500:
            sys.exit(1)
    except OSError as e:
        print(f"gpupool: the hub at {url} did not answer: {e}", file=sys.stderr)
    time.sleep(min(2 ** attempt, 10))
else:
    sys.exit(1)
print(port)
"""


def reporter_code(attempts: int = 6) -> str:
    return REPORTER.replace("PORT_PATH", repr(PORT_PATH)).replace("ATTEMPTS", str(attempts))


def batch_script(cmd: Sequence[str], python: str, bind_ip: str = "0.0.0.0", note: str = "") -> str:
    """The batch script of a server job: report a free port (see :data:`REPORTER`), point
    ``JUPYTERHUB_SERVICE_URL`` (which ``jupyterhub-singleuser`` binds to) at it, and ``exec`` the
    server, so ``scancel``'s signal reaches it and the job's exit status is the server's."""
    quoted = " ".join(shlex.quote(part) for part in cmd)
    return (
        f"#!/bin/bash\n# gpupool: a JupyterLab server {note}\n".rstrip() + "\n"
        f"port=$({shlex.quote(python)} -I -c {shlex.quote(reporter_code())}) || {{\n"
        '  echo "gpupool: the server could not report its port to the hub; it does not start"'
        " >&2\n"
        f"  exit {REPORT_FAILED}\n"
        "}\n"
        'echo "gpupool: serving on $(hostname) port $port"\n'
        f'export JUPYTERHUB_SERVICE_URL="http://{bind_ip}:$port${{JUPYTERHUB_SERVICE_PREFIX:-/}}"\n'
        f"exec {quoted}\n"
    )


def check_port_body(body: Mapping[str, Any]) -> int:
    """The port of a report body, which must be exactly ``{"port": <1..65535>}``."""
    from gpupool.core.errors import InvalidRequest

    if set(body) != {"port"}:
        extra = sorted(set(body) - {"port"})
        raise InvalidRequest(
            'A port report is exactly {"port": <1..65535>}'
            + (f"; it may set nothing else ({', '.join(map(str, extra))[:80]})" if extra else "")
        )
    port = body["port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidRequest('"port" must be a whole number from 1 to 65535')
    return port


def progress_message(job: SlurmJob | None, unknown: str = "", now: float | None = None) -> str:
    """What the spawn page says of a server job now: Slurm's pending reason and start estimate
    (``Slurm: waiting for Resources; estimated start 12:40``), where it runs, or that the
    controller does not answer."""
    if unknown:
        return f"Slurm's controller does not answer ({unknown}); waiting"
    if job is None:
        return "submitted to Slurm; waiting for it to list the job"
    if job.pending:
        text = f"Slurm: waiting for {job.reason or 'its turn'}"
        now = time.time() if now is None else now
        if job.start_time and job.start_time > now:
            text += "; estimated start " + time.strftime("%H:%M", time.localtime(job.start_time))
        return text
    if job.ended:
        return f"Slurm job {job.job_id} ended ({job.state})"
    node = job.nodes[0] if job.nodes else "a node"
    return f"Slurm job {job.job_id} running on {node}, waiting for the server to report its port"


class JobExit(int):
    """An ended job's exit status (``exit_code``'s wait status decoded: the exit code, or 128 +
    the signal), that says the job and its Slurm state where it is written out."""

    words: str

    def __new__(cls, status: int, words: str) -> JobExit:
        out = super().__new__(cls, status)
        out.words = words
        return out

    def __str__(self) -> str:
        return f"{int(self)} ({self.words})"

    __repr__ = __str__


def exit_status(job: SlurmJob) -> JobExit:
    """``squeue --json``'s ``exit_code`` is the raw wait status (exit 3 is 768: see
    ``slurm_job_info_t.exit_code`` in slurm.h, read with WEXITSTATUS/WTERMSIG)."""
    raw = job.exit_code
    code = (raw >> 8) & 0xFF if raw & 0x7F == 0 else 128 + (raw & 0x7F)
    if code == 0 and job.state not in ("COMPLETED",):
        code = 1  # cancelled, timed out, node failure: JupyterHub must not read it as success
    return JobExit(code, f"Slurm job {job.job_id} {job.state}")


def spawn_failure(job_id: int, state: str, tail: str) -> str:
    """The spawn page's message for a job that ended before its server answered."""
    head = f"The Slurm job {job_id} ended ({state}) before its server answered."
    if not tail.strip():
        return head + " Its output file was empty or could not be read."
    return f"{head} The end of its output:\n{tail.rstrip()}"


def tail_text(data: bytes, lines: int = 20, width: int = 300) -> str:
    """The last ``lines`` lines of ``data`` as text, each cut to ``width`` characters."""
    text = data.decode(errors="replace").replace("\r", "")
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(line[:width] for line in kept)


def node_address(sinfo: Mapping[str, Any], node: str) -> str:
    """The address of ``node`` in ``sinfo --json`` (``NodeAddr`` of slurm.conf; the node's name
    when Slurm gives none): where the hub reaches a server on it."""
    for entry in sinfo.get("nodes") or ():
        if isinstance(entry, Mapping) and entry.get("name") == node:
            address = str(entry.get("address") or "")
            return address or node
    return node


SPAWNER_NAMES = ("gpupool-slurm", "gpupool_spawner.slurm.SlurmSpawner", "SlurmSpawner")


def check_spawner_config(c: Any, inventory: str) -> None:
    """When ``c.JupyterHub.spawner_class`` is gpupool's Slurm spawner: the Slurm inventory, a
    Slurm time limit, an output template whose only fields are ``{home}``, ``{username}`` and
    ``{job_name}``; :class:`ConfigError` naming the key otherwise (``setup(c)`` calls it)."""
    spawner = c.JupyterHub.get("spawner_class", "")
    name = spawner if isinstance(spawner, str) else getattr(spawner, "__name__", "")
    if name not in SPAWNER_NAMES:
        return
    if inventory != "slurm" and not inventory.startswith("slurm:"):
        raise ConfigError(
            "GPUPool.inventory",
            f"the Slurm spawner ({name}) needs the Slurm inventory: set it to 'slurm' "
            f"(it is {inventory!r})",
        )
    section = c.SlurmSpawner if "SlurmSpawner" in c else {}
    if "time_limit" in section:
        check_time_limit(str(section["time_limit"]), "SlurmSpawner.time_limit")
    if "output_template" in section:
        try:
            output_path(str(section["output_template"]), "/home/ada", "ada", "jupyter-ada")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                "SlurmSpawner.output_template",
                f"{section['output_template']!r} may name only {{home}}, {{username}} and "
                f"{{job_name}} ({e!s})",
            ) from None
