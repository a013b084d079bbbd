"""The randomized fault soak (``bench/nemesis.py``) for three minutes: NATS nodes killed and
paused, workers and front ends killed, under a steady load through both front ends.

Nothing acknowledged may be lost, no process may die by itself, and every duplicate at the
sink must be explained by a worker stopped between the MX's 250 and its record (or logged
as unrecorded by the worker). With a quorum standing throughout (one node down or paused
at most), no client may be refused and no delivery deferred for the queue's own store
trouble (``--strict``): the classes the soak found (ingest writes during an election, a
paused node's clients, body reads from a lagging replica, a withheld final dot) stay
fixed. The seed is random unless ``NEMESIS_SEED`` is set; it is in the failure message.
The soak's figures and JSON summary are kept in ``bench/results/`` (not committed;
pytest's temporary directories, where the logs and stores are, are removed after a few
later runs).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "nemesis.py"
RESULTS = BENCH.parent / "results"
DURATION_S = 180
DRAIN_TIMEOUT_S = 120

pytestmark = pytest.mark.serial


@pytest.mark.timeout(DURATION_S + DRAIN_TIMEOUT_S + 180)
async def test_nemesis_soak(tmp_path: Path) -> None:
    # minutes of waiting on the soak are expected: no stack dump at the suite's 110 s
    faulthandler.cancel_dump_traceback_later()
    seed = int(os.environ.get("NEMESIS_SEED") or random.randrange(2**31))
    RESULTS.mkdir(exist_ok=True)
    summary_file = RESULTS / f"nemesis-test-{seed}.json"
    output = RESULTS / f"nemesis-test-{seed}.out"
    summary_file.unlink(missing_ok=True)
    with output.open("wb") as out:
        soak = await asyncio.create_subprocess_exec(
            sys.executable,
            str(BENCH),
            *("--duration", str(DURATION_S), "--drain-timeout", str(DRAIN_TIMEOUT_S)),
            *("--seed", str(seed), "--json", str(summary_file), "--workdir", str(tmp_path)),
            "--strict",
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            status = await soak.wait()
        finally:
            if soak.returncode is None:  # the test was cut short: the soak kills its fleet
                soak.terminate()
                await asyncio.wait_for(soak.wait(), 30)
    text = output.read_text(errors="replace")
    print(f"\n{text}")
    assert summary_file.exists(), f"seed {seed}: no summary (exit status {status})\n{text}"
    summary = json.loads(summary_file.read_text())
    where = f"seed {seed}, logs in {tmp_path}"
    assert summary["lost"] == 0, f"{where}: lost {summary['lost_examples']}"
    assert not summary["self_deaths"], f"{where}: died by themselves {summary['self_deaths']}"
    unexplained = summary["duplicates_unexplained"]
    assert not unexplained, f"{where}: duplicates unexplained {unexplained}"
    refused = summary["refusals_with_quorum"]
    assert refused == 0, f"{where}: {refused} refusals while a quorum stood"
    deferred = summary["store_trouble_deferrals"]
    assert deferred == 0, f"{where}: {summary['store_trouble_examples'][:3]}"
    assert status == 0, f"{where}: exit status {status}\n{text}"
