"""The ``gpupool`` command: submit notebooks and scripts as DDP jobs, and watch and cancel them.

Commands: ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``, ``offers``, ``teams``; every one
takes ``--json`` (the hub's JSON, for scripts; ``logs -f --json`` writes one JSON object per line
and chunk) and ``--url``/``--token`` (needed only outside a single-user server). Everything goes
through :class:`gpupool_lab.client.Client`; options parse as :mod:`gpupool_lab.options` says
(the widget and the lab parse them the same way) and tables print as
:mod:`gpupool_lab.command.tables` says.

Exit codes: 0 success; 1 an error from the hub (its message printed word for word on stderr), an
unreachable hub, a notebook that cannot be converted, or (``submit --wait``) a job that did not
succeed; 2 a usage error (bad arguments, missing file, no offer that fits, an offer that could
never start for you, no hub URL/token); 130 interrupted.

``submit`` goes by the offers document's verdict for the job's line (:mod:`gpupool_lab.options`):
``wait`` is submitted with a note "will queue: <reason>" on stderr (the hub queues the job),
``never`` is refused with the reason before anything is sent.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpupool_lab.client import Client, ClientError, HubError, NotConfigured
from gpupool_lab.command.tables import format_job, format_jobs, format_offers, format_teams, state
from gpupool_lab.options import (
    Choice,
    OptionError,
    check_offer,
    choose_offer,
    default_choice,
    non_negative,
    parse_cells,
    parse_duration,
    positive,
)

__all__ = ["Failure", "UsageError", "choose_offer", "main", "parse_cells", "parse_duration"]

SUBMIT_HELP = """\
Submit a notebook (.ipynb) or a Python script (.py) as a torchrun DDP job.

A notebook is converted first: its code cells run in order inside main(), cells tagged
skip-distributed are left out, and magics other than %matplotlib, %config, %autoreload,
%aimport and %load_ext/%reload_ext autoreload are refused (the message names the cell and line).
A script is sent as it is. Arguments after "--" go to the script (sys.argv[1:]).

--cells counts cells from 1 in notebook order, markdown cells included (the numbers that
conversion errors use): "all" (default), "upto:N" (cells 1..N), or "1,2,5" / "1-3,7".

--gpus is GPUs per node for a whole-GPU offer, MIG instances per node for a MIG offer (one rank
on each, over gloo when there are several), processes per node for a CPU offer, and 1 for a share
offer (a share job runs one process per node).

Default offer (no --offer): among the offers the hub lists (for --team, or across your teams in
the hub's order) of the first kind you have of "gpu", "mig", "share" and "cpu", those that take
--gpus per node: the first that would start now, else the first that would queue (busy, or your
team's quota in use), never one that could never start (over your team's limit or your cap, or
larger than any node). Use --offer to choose; "gpupool offers" lists them with their
availability. An offer that would queue is submitted with a note "will queue: <reason>"; one that
could never start is refused with the reason.
"""


class UsageError(OptionError):
    """A mistake in the command line (exit code 2); every :class:`OptionError` counts as one."""


class Failure(Exception):
    """A command that could not do its work, with a message for the user (exit code 1)."""


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise UsageError(f"not KEY=VALUE: {text!r}")
    return key, value


# -- output ---------------------------------------------------------------------------------------


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def _output(args: argparse.Namespace, value: object, text: Callable[[], str]) -> None:
    """Print ``value`` as JSON under ``--json``, else the readable ``text()``."""
    if args.json:
        _print_json(value)
    else:
        print(text())


# -- commands -------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    return Client(url=args.url, token=args.token)


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".ipynb":
        from gpupool_lab.convert import ConversionError, notebook_to_script

        try:
            script = notebook_to_script(path, cells=args.cells, name=path.name)
        except ConversionError as exc:
            raise Failure(f"{path.name}: cannot run as a job:\n{exc}") from exc
    elif suffix == ".py":
        if args.cells != "all":
            raise UsageError("--cells applies to notebooks only")
        script = path.read_text(encoding="utf-8")
    else:
        raise UsageError(f"not a notebook (.ipynb) or a script (.py): {path}")
    client = _client(args)
    offers = client.offers()
    offer = args.offer
    line: Choice | None
    if offer is None:
        line = default_choice(offers, args.gpus, args.team)
        offer = line.offer
        note = f"offer: {offer} (the default for --gpus {args.gpus}; --offer chooses another)"
        print(note, file=sys.stderr)
    else:
        line = check_offer(offers, offer, args.gpus, args.team)  # None: the hub judges
    if line is not None and line.admission == "wait":
        print(f"will queue: {line.reason}" if line.reason else "will queue", file=sys.stderr)
    job = client.submit(
        script,
        name=args.name or path.stem,
        filename=path.name,
        workdir=args.workdir or str(path.resolve().parent),
        args=args.script_args or None,
        env=dict(args.env) or None,
        offer=offer,
        gpus=args.gpus,
        nodes=args.nodes,
        # the team of the line chosen or judged above (a member of several teams who names
        # none: the hub's own default team may not even have that offer)
        team=args.team or (line.team if line is not None else None),
        time_limit=args.time_limit,
        max_restarts=args.max_restarts,
        priority=args.priority,
    )
    if not args.json:
        print(f"Submitted job {job.get('id')} ({job.get('name')}): {state(job)}")
    if not args.wait:
        if args.json:
            _print_json(job)
        return 0
    if not args.json:
        print(f"Waiting for job {job.get('id')} to end (Ctrl-C stops waiting, not the job)…")
    job = client.wait(job["id"], poll=args.poll)
    if args.json:
        _print_json(job)
    else:
        reason = f": {job['reason']}" if job.get("reason") else ""
        print(f"Job {job.get('id')} {job.get('state')}{reason}")
    return 0 if job.get("state") == "succeeded" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs = _client(args).jobs(limit=args.limit)  # page by page
    _output(args, {"jobs": jobs}, lambda: format_jobs(jobs))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    job = _client(args).job(args.id)
    _output(args, job, lambda: format_job(job))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.id)
    _output(args, job, lambda: f"Job {job.get('id')}: {state(job)}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.follow:  # under --json: one JSON object per line and chunk (JSON Lines)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for chunk in client.follow_logs(args.id, rank=args.rank):
            if args.json:
                print(json.dumps({"rank": args.rank, "log": decoder.decode(chunk)}))
            else:
                sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return 0
    data, size, job_state = client.logs(args.id, rank=args.rank)
    if args.json:
        text = data.decode(errors="replace")
        _print_json(
            {"id": args.id, "rank": args.rank, "size": size, "state": job_state, "log": text}
        )
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def cmd_offers(args: argparse.Namespace) -> int:
    doc = _client(args).offers()
    _output(args, doc, lambda: format_offers(doc))
    return 0


def cmd_teams(args: argparse.Namespace) -> int:
    teams = _client(args).teams()
    _output(args, {"teams": teams}, lambda: format_teams(teams))
    return 0


# -- parser ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the hub's JSON")
    common.add_argument("--url", help="hub address (default: $JUPYTERHUB_API_URL)")
    common.add_argument("--token", help="hub API token (default: $JUPYTERHUB_API_TOKEN)")

    parser = argparse.ArgumentParser(
        prog="gpupool",
        description="Run notebooks as multi-GPU DDP jobs on the GPU pool.",
        epilog="Every command takes --json, --url and --token. Exit codes: 0 done; 1 an error "
        "from the hub (printed as the hub wrote it) or a job that did not succeed (submit "
        "--wait); 2 a usage error; 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], **kw: Any
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], **kw)
        p.set_defaults(handler=handler)
        return p

    s = command(
        "submit",
        cmd_submit,
        help="submit a notebook or script as a job",
        description=SUBMIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="gpupool submit PATH [options] [-- ARGS...]",
    )
    s.add_argument("path", metavar="PATH", help="NOTEBOOK.ipynb or SCRIPT.py")
    s.add_argument(
        "--gpus",
        type=positive,
        default=1,
        help="GPUs, MIG instances or processes per node (default 1)",
    )
    s.add_argument("--nodes", type=positive, help="nodes (default: the hub's, 1)")
    s.add_argument("--offer", help="offer name (default: see above)")
    s.add_argument(
        "--team",
        help="team to charge (default: the team of the offer line chosen, as `gpupool offers` "
        "lists them; the hub's choice when it lists none)",
    )
    s.add_argument("--time-limit", type=parse_duration, help="seconds, or 30m, 2h, 1h30m")
    s.add_argument(
        "--max-restarts",
        type=non_negative,
        help="how often the pool may requeue the job after preempting it to give borrowed GPUs "
        "back (default 0); a job that fails is never restarted",
    )
    s.add_argument(
        "--priority",
        type=int,
        help="order among your team's jobs, higher first (default 0); your team allows -100 to "
        "0 (lower only) unless an admin set another range; other teams' jobs are unaffected",
    )
    s.add_argument("--name", help="job name (default: the file's stem)")
    s.add_argument("--workdir", help="working folder of the job (default: the file's folder)")
    s.add_argument("-e", "--env", type=_env_pair, action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--cells", type=parse_cells, default="all", help="all | upto:N | 1,2,5")
    s.add_argument("-w", "--wait", action="store_true", help="wait for the job to end")
    s.add_argument(
        "--poll", type=float, default=2.0, help="seconds between checks for --wait (default 2)"
    )

    jobs = command("jobs", cmd_jobs, help="list your jobs, newest first (an admin: all jobs)")
    jobs.add_argument("--limit", type=positive, help="only the newest N (default: all)")
    command("show", cmd_show, help="show one job").add_argument("id", metavar="ID")
    command("cancel", cmd_cancel, help="cancel a job").add_argument("id", metavar="ID")
    logs = command("logs", cmd_logs, help="print a rank's log")
    logs.add_argument("id", metavar="ID")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    logs.add_argument("--rank", type=non_negative, default=0, help="which rank's log (default 0)")
    command("offers", cmd_offers, help="what you may request now, per team")
    command("teams", cmd_teams, help="teams' quotas and usage")
    return parser


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    own, script_args = _split_script_args(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    try:
        args = parser.parse_args(own)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    if script_args and args.command != "submit":
        parser.print_usage(sys.stderr)
        print('gpupool: error: arguments after "--" are for submit only', file=sys.stderr)
        return 2
    args.script_args = script_args
    try:
        return int(args.handler(args))
    except OptionError as exc:  # UsageError, or an option that fits no offer
        print(f"gpupool {args.command}: {exc}", file=sys.stderr)
        return 2
    except NotConfigured as exc:
        print(
            f"gpupool: {exc}.\nPass --url https://HUB-ADDRESS and --token TOKEN "
            "(a token from the hub's Token page).",
            file=sys.stderr,
        )
        return 2
    except HubError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    except (ClientError, Failure) as exc:  # an unreachable hub, a notebook that cannot convert
        print(str(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpupool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
