"""Text an older gpupool stored before it refused lone surrogates (issue 23) comes back as text
every page, log and terminal can encode: a lone surrogate reads as U+FFFD, everything else
(pairs, astral characters, markup) exactly as stored; on SQLite and on PostgreSQL."""

from __future__ import annotations

import json

from gpupool.core.jobs import Job, JobSpec
from gpupool.store import Store

LONE = "\ud800x\udfff"  # each half of a pair on its own: no UTF-8 encoding exists


def test_a_lone_surrogate_an_older_hub_stored_reads_back_as_a_replacement(db_url: str) -> None:
    store = Store(db_url)
    spec = JobSpec(
        "print(1)", "h100", 1, 1, "vision", LONE, f"{LONE}.ipynb", "/home/ada",
        (LONE, "🙂<b>"), (("NAME", LONE),), 600, 0, 5,
    )  # fmt: skip
    store.save_job(Job("j1", "ada", "vision", spec, created=10.0))
    (job,) = store.load_jobs()
    store.close()
    assert job.spec.name == "\ufffdx\ufffd" and job.spec.filename == "\ufffdx\ufffd.ipynb"
    assert job.spec.args == ("\ufffdx\ufffd", "🙂<b>")
    assert job.spec.env == (("NAME", "\ufffdx\ufffd"),)
    json.dumps(job.spec.__dict__, ensure_ascii=False).encode()  # encodable everywhere
