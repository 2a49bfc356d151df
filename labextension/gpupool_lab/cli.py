"""The ``gpupool`` command: submit notebooks and scripts as DDP jobs, and watch and cancel them.

Commands: ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``, ``offers``, ``teams``; every one
takes ``--json`` (the hub's JSON, for scripts; ``logs -f --json`` writes one JSON object per line
and chunk) and ``--url``/``--token`` (needed only outside a single-user server). Everything goes
through :class:`gpupool_lab.client.Client`. Tables are aligned columns, numbers right-aligned.

Exit codes: 0 success; 1 an error from the hub (its message printed word for word on stderr), an
unreachable hub, a notebook that cannot be converted, or (``submit --wait``) a job that did not
succeed; 2 a usage error (bad arguments, missing file, no hub URL/token); 130 interrupted.
"""

from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpupool_lab.client import Client, ClientError, HubError, NotConfigured

__all__ = ["choose_offer", "main", "parse_cells", "parse_duration"]

SUBMIT_HELP = """\
Submit a notebook (.ipynb) or a Python script (.py) as a torchrun DDP job.

A notebook is converted first: its code cells run in order inside main(), cells tagged
skip-distributed are left out, and magics other than %matplotlib, %config, %autoreload,
%aimport and %load_ext/%reload_ext autoreload are refused (the message names the cell and line).
A script is sent as it is. Arguments after "--" go to the script (sys.argv[1:]).

--cells counts cells from 1 in notebook order, markdown cells included (the numbers that
conversion errors use): "all" (default), "upto:N" (cells 1..N), or "1,2,5" / "1-3,7".

Default offer (no --offer): the first offer the hub lists (for --team, or across your teams in
the hub's order) of kind "gpu" whose count equals --gpus and that is enabled (free within quota
now); else the first such offer even if busy (the job waits in the queue); only when the pool has
no GPU offers at all, the first "cpu" offer, with --gpus processes per node. Use --offer to choose;
"gpupool offers" lists them.
"""

DURATION_TEXT = re.compile(r"(?:\d+[smhd]?)+")
DURATION_PART = re.compile(r"(\d+)([smhd]?)")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class UsageError(Exception):
    """A mistake in the command line (exit code 2)."""


class Failure(Exception):
    """A command that could not do its work, with a message for the user (exit code 1)."""


# -- argument types -------------------------------------------------------------------------------


def parse_duration(text: str) -> int:
    """``"90"``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``, ``"1d"`` → seconds."""
    compact = re.sub(r"\s+", "", text.lower())
    if not DURATION_TEXT.fullmatch(compact):
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (use seconds, or e.g. 30m, 2h, 1h30m)"
        )
    seconds = sum(int(n) * UNITS[unit] for n, unit in DURATION_PART.findall(compact))
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a time limit must be positive, not {text!r}")
    return seconds


def parse_cells(text: str) -> str | int | list[int]:
    """``all`` | ``upto:N`` | ``1,2,5`` / ``1-3,7`` (1-based numbers) → convert's 0-based form."""
    text = text.strip().lower()
    if text == "all":
        return "all"
    try:
        if text.startswith("upto:"):
            number = int(text.removeprefix("upto:"))
            if number < 1:
                raise ValueError
            return number - 1
        indexes: set[int] = set()
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 1 or high < low:
                raise ValueError
            indexes.update(range(low - 1, high))
        return sorted(indexes)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a cell choice: {text!r} (use all, upto:N, or numbers like 1,2,5 or 1-3)"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text!r}")
    return key, value


# -- the default offer ----------------------------------------------------------------------------


def choose_offer(offers: dict[str, Any], gpus: int, team: str | None = None) -> str:
    """The default offer for ``gpus`` processes per node (the rule is in ``submit --help``)."""
    teams = [t for t in offers.get("teams", []) if team is None or t.get("team") == team]
    if team is not None and not teams:
        known = ", ".join(t.get("team", "?") for t in offers.get("teams", [])) or "none"
        raise UsageError(f"you are not in team {team!r} (your teams: {known})")
    choices = [o for t in teams for o in t.get("offers", [])]
    gpu = [o for o in choices if o.get("kind") == "gpu"]
    cpu = [o for o in choices if o.get("kind") == "cpu"]
    matching = [o for o in gpu if o.get("count") == gpus]
    for candidates in ([o for o in matching if o.get("enabled")], matching):
        if candidates:
            return str(candidates[0]["name"])
    if not gpu and cpu:
        return str(([o for o in cpu if o.get("enabled")] or cpu)[0]["name"])
    counts = sorted({int(o.get("count", 0)) for o in gpu})
    raise UsageError(
        f"no GPU offer comes with {gpus} GPU(s) per node"
        + (f" (counts offered: {', '.join(map(str, counts))})" if counts else "")
        + "; pass --offer (see: gpupool offers)"
    )


# -- output ---------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned columns; numbers right-aligned, text left-aligned, ``None`` as ``-``."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _when(value: str | None) -> str:
    """An ISO 8601 timestamp as ``YYYY-MM-DD HH:MM:SS`` (the hub's zone), ``-`` when unset."""
    if not value:
        return "-"
    return value.replace("T", " ")[:19]


def _state(job: dict[str, Any]) -> str:
    state = str(job.get("state", "?"))
    if state == "queued" and job.get("queue_position") is not None:
        return f"queued #{job['queue_position']}"
    return state


def _gpus(job: dict[str, Any]) -> str:
    nodes = job.get("nodes") or 1
    return f"{job.get('gpus')}×{nodes}" if nodes != 1 else str(job.get("gpus"))


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


def _output(args: argparse.Namespace, value: Any, text: Callable[[], str]) -> None:
    """Print ``value`` as JSON under ``--json``, else the readable ``text()``."""
    if args.json:
        _print_json(value)
    else:
        print(text())


def format_jobs(jobs: Sequence[dict[str, Any]]) -> str:
    if not jobs:
        return "No jobs."
    rows = [
        [
            str(j.get("id")),
            j.get("name") or "-",
            j.get("owner") or "-",
            j.get("team") or "-",
            j.get("offer") or "-",
            _gpus(j),
            _state(j),
            _when(j.get("created")),
        ]
        for j in jobs
    ]
    headers = ["ID", "NAME", "OWNER", "TEAM", "OFFER", "GPUS", "STATE", "CREATED"]
    return table(headers, rows)


def format_job(job: dict[str, Any]) -> str:
    codes = job.get("exit_codes") or {}
    exit_codes = ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items(), key=_rank_key))
    limit = job.get("time_limit")
    fields = [
        ("id", job.get("id")),
        ("name", job.get("name")),
        ("owner", job.get("owner")),
        ("team", job.get("team")),
        ("offer", job.get("offer")),
        ("gpus per node", job.get("gpus")),
        ("nodes", job.get("nodes")),
        ("ranks", job.get("ranks")),
        ("state", _state(job)),
        ("reason", job.get("reason") or None),
        ("priority", job.get("priority")),
        ("time limit", f"{limit} s" if limit else None),
        ("restarts", f"{job.get('restarts', 0)} of {job.get('max_restarts', 0)}"),
        ("devices", ", ".join(job.get("devices") or []) or None),
        ("created", _when(job.get("created"))),
        ("started", _when(job.get("started"))),
        ("finished", _when(job.get("finished"))),
        ("exit codes", exit_codes or None),
    ]
    width = max(len(k) for k, _ in fields)
    return "\n".join(f"{k + ':':<{width + 1}} {_cell(v)}" for k, v in fields)


def _rank_key(item: tuple[str, Any]) -> tuple[int, str]:
    return (int(item[0]), "") if str(item[0]).isdigit() else (1 << 30, str(item[0]))


def format_offers(doc: dict[str, Any]) -> str:
    out = [f"Inventory: {doc.get('inventory', '?')}"]
    if doc.get("simulated"):
        out[0] += "  (SIMULATED: no real GPUs behind these offers)"
    for team in doc.get("teams", []):
        out.append("")
        cap = team.get("user_cap")
        out.append(
            f"Team {team.get('team')}: {_cell(team.get('used'))} of {_cell(team.get('limit'))} "
            f"GPU-eq used (guarantee {_cell(team.get('guarantee'))}, may borrow "
            f"{_cell(team.get('borrow_limit'))}), {_cell(team.get('left'))} left; "
            f"you use {_cell(team.get('user_used'))}"
            + (f" of your cap {_cell(cap)}" if cap is not None else "")
        )
        rows = [
            [
                o.get("name"),
                o.get("kind"),
                o.get("label"),
                o.get("count"),
                o.get("cost"),
                o.get("free"),
                "yes" if o.get("enabled") else f"no: {o.get('reason') or 'unavailable'}",
            ]
            for o in team.get("offers", [])
        ]
        headers = ["OFFER", "KIND", "LABEL", "COUNT", "COST", "FREE", "AVAILABLE"]
        out.append(table(headers, rows) if rows else "(no offers)")
    return "\n".join(out)


def format_teams(teams: Sequence[dict[str, Any]]) -> str:
    if not teams:
        return "No teams."
    rows = [
        [
            t.get("name"),
            t.get("guarantee"),
            t.get("borrow_limit"),
            t.get("used"),
            t.get("borrowed"),
            t.get("jobs_queued"),
            t.get("jobs_running"),
        ]
        for t in teams
    ]
    headers = ["TEAM", "GUARANTEE", "BORROW LIMIT", "USED", "BORROWED", "QUEUED", "RUNNING"]
    return table(headers, rows)


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
    offer = args.offer
    if offer is None:
        offer = choose_offer(client.offers(), args.gpus, args.team)
        note = f"offer: {offer} (the default for --gpus {args.gpus}; --offer chooses another)"
        print(note, file=sys.stderr)
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
        team=args.team,
        time_limit=args.time_limit,
        max_restarts=args.max_restarts,
        priority=args.priority,
    )
    if not args.json:
        print(f"Submitted job {job.get('id')} ({job.get('name')}): {_state(job)}")
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
    jobs = _client(args).jobs()
    _output(args, {"jobs": jobs}, lambda: format_jobs(jobs))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    job = _client(args).job(args.id)
    _output(args, job, lambda: format_job(job))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel(args.id)
    _output(args, job, lambda: f"Job {job.get('id')}: {_state(job)}")
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
    data, size, state = client.logs(args.id, rank=args.rank)
    if args.json:
        text = data.decode(errors="replace")
        _print_json({"id": args.id, "rank": args.rank, "size": size, "state": state, "log": text})
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

    def command(name: str, handler: Callable[[argparse.Namespace], int], **kw: Any) -> Any:
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
        "--gpus", type=_positive, default=1, help="processes (GPUs) per node (default 1)"
    )
    s.add_argument("--nodes", type=_positive, help="nodes (default: the hub's, 1)")
    s.add_argument("--offer", help="offer name (default: see above)")
    s.add_argument("--team", help="team to charge (default: the hub's choice)")
    s.add_argument("--time-limit", type=parse_duration, help="seconds, or 30m, 2h, 1h30m")
    s.add_argument("--max-restarts", type=_non_negative, help="torchrun restarts on failure")
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

    command("jobs", cmd_jobs, help="list your jobs (an admin: all jobs)")
    command("show", cmd_show, help="show one job").add_argument("id", metavar="ID")
    command("cancel", cmd_cancel, help="cancel a job").add_argument("id", metavar="ID")
    logs = command("logs", cmd_logs, help="print a rank's log")
    logs.add_argument("id", metavar="ID")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    logs.add_argument("--rank", type=_non_negative, default=0, help="which rank's log (default 0)")
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
    except UsageError as exc:
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
