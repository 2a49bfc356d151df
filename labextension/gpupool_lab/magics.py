"""``%%distributed``: run one cell's code as a multi-GPU job (``%load_ext gpupool_lab``).

Contract: ``%%distributed [--gpus N] [--nodes N] [--offer O] [--team T] [--time-limit 30m]
[--name X] [--wait]``. The cell's code is converted like a one-cell notebook (so magics are
refused the same way, naming the cell and line) and submitted as :func:`gpupool_lab.job.submit`
would, from the kernel's working folder, named after the kernel's notebook (``<stem>-cell``,
file ``<stem>_cell.py``). The options parse as the CLI's (:mod:`gpupool_lab.options`; a bad one
is IPython's ``UsageError``). The magic prints the job id and returns the
:class:`~gpupool_lab.job.Job`; ``--wait`` waits for the end and prints the final state and rank
0's log. Errors (the hub's, word for word, or conversion's) are printed on stderr and the magic
returns None.
"""

from __future__ import annotations

import argparse
import os
import sys

from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from nbformat.v4 import new_code_cell, new_notebook

from gpupool_lab.client import Client, ClientError
from gpupool_lab.convert import ConversionError, notebook_to_script
from gpupool_lab.job import Job, notebook_path, submit_script
from gpupool_lab.options import parse_duration, positive

__all__ = ["DistributedMagics"]


@magics_class
class DistributedMagics(Magics):
    """``%%distributed``: run the cell's code as a multi-GPU job (see the module docstring)."""

    @magic_arguments()
    @argument("--gpus", type=positive, default=1, help="GPUs (processes) per node; default 1")
    @argument("--nodes", type=positive, default=None, help="nodes; default 1")
    @argument("--offer", default=None, help="the offer (default: as the gpupool CLI chooses)")
    @argument("--team", default=None, help="the team to charge")
    @argument("--time-limit", type=parse_duration, default=None, help="e.g. 30m, 2h, 1h30m")
    @argument("--name", default=None, help="the job's name")
    @argument("--wait", action="store_true", help="wait for the end; print rank 0's log")
    @argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    @cell_magic
    def distributed(self, line: str, cell: str) -> Job | None:
        args = parse_argstring(self.distributed, line)
        notebook = notebook_path()
        stem = notebook.stem if notebook else "notebook"
        try:
            script = notebook_to_script(
                new_notebook(cells=[new_code_cell(cell)]), name=f"{stem} %%distributed cell"
            )
            job = submit_script(
                Client(),
                script,
                filename=f"{stem}_cell.py",
                name=args.name or f"{stem}-cell",
                workdir=os.getcwd(),
                offer=args.offer,
                gpus=args.gpus,
                nodes=args.nodes,
                team=args.team,
                time_limit=args.time_limit,
            )
            print(f"Submitted job {job.id} ({job.last.get('name')}): {job.last.get('state')}")
            if args.wait:
                _wait_and_show(job, args.poll)
        except ConversionError as exc:
            print(f"%%distributed: this cell cannot run as a job:\n{exc}", file=sys.stderr)
            return None
        except (ClientError, ValueError) as exc:
            print(exc, file=sys.stderr)
            return None
        return job


def _wait_and_show(job: Job, poll: float) -> None:
    print(f"Waiting for job {job.id} to end (interrupting stops waiting, not the job)…")
    state = job.wait(poll=poll)
    reason = job.last.get("reason")
    print(f"Job {job.id} {state}" + (f": {reason}" if reason else ""))
    log = job.logs(0)
    if log:
        print(f"--- rank 0 ---\n{log}", end="" if log.endswith("\n") else "\n")
