"""``python -m benchmarks.jobs [--runs N] [--json]``: what gpupool adds to a small DDP job.

Vocabulary
- *to running*: from the submit (or the launch) until every rank has started (its rank log
  exists; through gpupool: the job's state says ``running``).
- *to success*: until the job has succeeded (bare: torchrun has exited 0).
- *gpupool*: ``POST /hub/api/gpupool/jobs`` on a real hub (the repository's demo config, simulated
  pool, 2 whole GPUs, 2 ranks, gloo on CPU), timed by polling the job every 50 ms; *bare*: the
  same script under the same ``torchrun --nproc-per-node 2 … -m gpupool_lab.rank_log`` command,
  started directly. Runs alternate between the two; medians.

Contract: starts (and stops) its own hub in a temporary directory; prints a table or, with
``--json``, an object with the times and ``ratio_to_running``, ``ratio_to_success``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.accounts import homes
from tests.hub.conftest import Hub, free_port, kill_servers
from tests.hub.test_jobs import TRAIN, TRAIN_CELL

SCRIPT = TRAIN + "\n\ndef main():\n" + "".join(f"    {line}\n" for line in TRAIN_CELL.splitlines())
SCRIPT += '\n\nif __name__ == "__main__":\n    main()\n'


def through_gpupool(hub: Hub, token: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    r = hub.as_user(token, "POST", "/jobs", json={"script": SCRIPT, "offer": "h100", "gpus": 2})
    r.raise_for_status()
    job_id = r.json()["id"]
    running = None
    while True:
        state = hub.as_user(token, "GET", f"/jobs/{job_id}").json()["state"]
        now = time.perf_counter() - t0
        if running is None and state in ("running", "succeeded"):
            running = now
        if state in ("succeeded", "failed", "cancelled", "lost"):
            if state != "succeeded":
                job = hub.as_user(token, "GET", f"/jobs/{job_id}").json()
                tail = hub.as_user(token, "GET", f"/jobs/{job_id}/logs").text[-2000:]
                raise SystemExit(f"job {job_id} {state}: {job['reason']}\n{tail}")
            return running or now, now
        time.sleep(0.05)


def bare(workdir: Path) -> tuple[float, float]:
    logs = workdir / f"bare-{time.monotonic_ns()}"
    logs.mkdir()
    script = logs / "script.py"
    script.write_text(SCRIPT)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         "--max-restarts", "0",
         "-m", "gpupool_lab.rank_log", str(logs), str(script)],
        stdout=(logs / "launcher.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    running = None
    while proc.poll() is None:
        if running is None and all((logs / f"rank-{r}.log").exists() for r in range(2)):
            running = time.perf_counter() - t0
        time.sleep(0.05)
    done = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "".join(p.read_text()[-1500:] for p in sorted(logs.glob("*.log")))
        raise SystemExit(f"bare torchrun exited {proc.returncode}:\n{tail}")
    return running or done, done


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (default 3)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    args = parser.parse_args(argv)
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="gpupool-jobs-bench-") as tmp, homes() as home_root:
        hub = Hub(Path(tmp), home_root)
        hub.start()
        try:
            token = hub.token("ada")
            through_gpupool(hub, token)  # warm-up, not counted
            bare(Path(tmp))
            for _ in range(args.runs):
                ours.append(through_gpupool(hub, token))
                theirs.append(bare(Path(tmp)))
        finally:
            hub.stop_hub()
            kill_servers(hub)
    result = {
        "runs": args.runs,
        "gpupool_to_running_s": round(statistics.median(r for r, _ in ours), 3),
        "gpupool_to_success_s": round(statistics.median(s for _, s in ours), 3),
        "bare_to_running_s": round(statistics.median(r for r, _ in theirs), 3),
        "bare_to_success_s": round(statistics.median(s for _, s in theirs), 3),
    }
    result["ratio_to_running"] = round(
        result["gpupool_to_running_s"] / result["bare_to_running_s"], 3
    )
    result["ratio_to_success"] = round(
        result["gpupool_to_success_s"] / result["bare_to_success_s"], 3
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"small DDP job, 2 ranks (gloo on CPU), medians of {args.runs} runs each")
    print(f"{'':10}{'to running':>12}{'to success':>12}")
    print(
        f"{'gpupool':10}{result['gpupool_to_running_s']:>11.2f}s{result['gpupool_to_success_s']:>11.2f}s"
    )
    print(f"{'bare':10}{result['bare_to_running_s']:>11.2f}s{result['bare_to_success_s']:>11.2f}s")
    print(f"{'ratio':10}{result['ratio_to_running']:>12.3f}{result['ratio_to_success']:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
