"""The one seam to Slurm: its commands (``squeue``, ``sinfo``, ``sbatch``, ``scancel``), run
without a shell, bounded in time, and read into :mod:`gpupool.slurm.parse`'s data.

Vocabulary
- *as an account*: ``sbatch`` and ``scancel`` of a user's job run as the user's unix account, so
  Slurm charges, limits and runs the job as them: a root hub becomes the account
  (:func:`gpupool.usercode.become`), any other hub goes through ``SlurmSettings.sudo``.
- *unavailable*: the controller did not answer (a timeout, ``slurm_load_jobs error``, an exit
  status without output, output that is not Slurm's): :class:`SlurmUnavailable`. It means
  "unknown", never "no jobs": callers keep what they knew.

Contract: every call is one child process with ``SLURM_CONF`` from the settings and nothing a
user chose in its environment besides what the caller hands ``sbatch`` for the job; a call that
outlives ``command_timeout`` is killed and raises :class:`SlurmUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool.core.errors import InvalidRequest, PoolError
from gpupool.slurm.parse import SlurmJob, SlurmNode, SlurmOutputError, sinfo_nodes, squeue_jobs
from gpupool.usercode import Account, become

BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")
"""What a Slurm command keeps of the hub's environment (and ``SLURM_CONF``)."""


class SlurmUnavailable(PoolError):
    """Slurm's controller did not answer: what it runs is unknown (HTTP 503)."""

    code = "slurm_unavailable"


class SlurmRefused(InvalidRequest):
    """Slurm refused a submission (``sbatch: error: ...``), with Slurm's words (HTTP 400)."""

    code = "slurm_refused"


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


class SlurmCommands:
    """Runs Slurm's commands for the hub (see the module's docstring)."""

    def __init__(
        self,
        slurm_conf: str = "",
        slurm_bin: str = "",
        timeout: float = 30.0,
        sudo: Sequence[str] = ("sudo", "-n", "-u", "{user}", "--"),
    ) -> None:
        self.slurm_conf = slurm_conf
        self.slurm_bin = slurm_bin
        self.timeout = timeout
        self.sudo = tuple(sudo)
        self.calls = 0
        """How many commands ran (the shared poller's tests count them)."""

    @classmethod
    def from_settings(cls, settings: Any) -> SlurmCommands:
        return cls(settings.slurm_conf, settings.slurm_bin, settings.command_timeout, settings.sudo)

    def path(self, name: str) -> str:
        if self.slurm_bin:
            return os.path.join(self.slurm_bin, name)
        return shutil.which(name) or name

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
        env.update(extra or {})
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        elif "SLURM_CONF" in os.environ and "SLURM_CONF" not in env:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        return env

    def argv(self, name: str, args: Sequence[str], account: Account | None) -> list[str]:
        argv = [self.path(name), *args]
        if account is None or account.uid == os.geteuid() or os.geteuid() == 0:
            return argv
        return [part.replace("{user}", account.name) for part in self.sudo] + argv

    async def run(
        self,
        name: str,
        *args: str,
        account: Account | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        cwd: str | None = None,
    ) -> Result:
        """Run one Slurm command; :class:`SlurmUnavailable` when it cannot start or times out."""
        self.calls += 1
        extra = become(account) if account is not None and os.geteuid() == 0 else {}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(name, args, account),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env(env),
                cwd=cwd or "/",
                **extra,
            )
        except OSError as e:
            raise SlurmUnavailable(f"Slurm's {name} could not run: {e}") from None
        try:
            out, err = await asyncio.wait_for(
                proc.communicate(stdin.encode() if stdin is not None else None), self.timeout
            )
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise SlurmUnavailable(
                f"Slurm's {name} did not answer in {self.timeout:g} s (is slurmctld up?)"
            ) from None
        return Result(
            proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def _json(self, name: str, *args: str) -> dict[str, Any]:
        result = await self.run(name, *args, "--json")
        if result.returncode != 0:
            raise SlurmUnavailable(
                f"{name} failed: {_first_line(result.stderr) or result.returncode}"
            )
        try:
            document = json.loads(result.stdout)
        except ValueError:
            raise SlurmUnavailable(f"{name} --json printed something that is not JSON") from None
        if not isinstance(document, dict):
            raise SlurmUnavailable(f"{name} --json printed something that is not an object")
        errors = document.get("errors") or []
        if errors:
            raise SlurmUnavailable(f"{name}: {errors[0]}")
        return document

    async def squeue(self) -> list[SlurmJob]:
        """Every job the controller knows now (all users), one call."""
        try:
            return squeue_jobs(await self._json("squeue", "--all"))
        except SlurmOutputError as e:
            raise SlurmUnavailable(str(e)) from None

    async def sinfo(self) -> list[SlurmNode]:
        try:
            return sinfo_nodes(await self._json("sinfo"))
        except SlurmOutputError as e:
            raise SlurmUnavailable(str(e)) from None

    def sinfo_now(self) -> list[SlurmNode]:
        """``sinfo`` from synchronous code (the inventory at start)."""
        import subprocess

        self.calls += 1
        try:
            result = subprocess.run(
                [self.path("sinfo"), "--json"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=self.timeout,
                cwd="/",
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmUnavailable(f"Slurm's sinfo did not answer: {e}") from None
        if result.returncode != 0:
            raise SlurmUnavailable(f"sinfo failed: {_first_line(result.stderr)}")
        try:
            return sinfo_nodes(json.loads(result.stdout))
        except (ValueError, SlurmOutputError) as e:
            raise SlurmUnavailable(f"sinfo --json: {e}") from None

    async def sbatch(
        self,
        script: str,
        args: Sequence[str],
        account: Account,
        env: Mapping[str, str],
        cwd: str,
    ) -> int:
        """Submit ``script`` as ``account`` with ``args`` and the job's environment ``env``
        (exported to the job: ``--export=ALL`` of this clean environment); its job id.
        :class:`SlurmRefused` with Slurm's words when sbatch refuses it."""
        result = await self.run(
            "sbatch",
            "--parsable",
            "--export=ALL",
            *args,
            account=account,
            env=env,
            stdin=script,
            cwd=cwd,
        )
        if result.returncode != 0:
            words = _first_line(result.stderr.replace("sbatch: error: ", "")) or "no reason given"
            if (
                "Unable to contact slurm controller" in result.stderr
                or "Socket timed out" in result.stderr
            ):
                raise SlurmUnavailable(f"sbatch: {words}")
            raise SlurmRefused(f"Slurm refused the job: {words}")
        first = result.stdout.strip().split(";")[0]
        if not first.isdigit():
            raise SlurmUnavailable(f"sbatch printed no job id: {result.stdout.strip()[:200]!r}")
        return int(first)

    async def scancel(self, job_id: int, account: Account | None = None) -> None:
        """Cancel a job (pending or running); a job Slurm no longer knows is already gone."""
        result = await self.run("scancel", str(job_id), account=account)
        if result.returncode != 0 and "Invalid job id" not in result.stderr:
            raise SlurmUnavailable(f"scancel {job_id}: {_first_line(result.stderr)}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
