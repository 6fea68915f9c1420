"""CPU affinity planning for CPU executors (pagedserve.affinity) and the executor flag."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pagedserve.affinity import (
    AffinityError,
    format_cores,
    name_current_thread,
    parse_cores,
    plan_serve,
)


def test_parse_and_format_cores():
    assert parse_cores("1") == [1]
    assert parse_cores("0,2-3") == [0, 2, 3]
    assert parse_cores(" 4-5 , 1") == [1, 4, 5]
    assert format_cores([0, 2, 3]) == "0,2,3"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(AffinityError):
            parse_cores(bad)


def test_plan_serve_takes_executor_cores_from_the_end_and_leaves_one_for_the_router():
    assert plan_serve(1, 1, [0, 1]) == ([[1]], [0])
    assert plan_serve(2, 1, [0, 1, 2, 3]) == ([[3], [2]], [0, 1])
    assert plan_serve(2, 2, [0, 1, 2, 3, 4, 5]) == ([[4, 5], [2, 3]], [0, 1])
    assert plan_serve(2, 1, [0, 1]) is None  # no core left for the router
    assert plan_serve(1, 2, [0, 1]) is None
    assert plan_serve(1, 1, []) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no sched_setaffinity")
def test_executor_pins_its_compute_thread_and_returns_the_other_cores():
    from pagedserve.executor.startup import _pin_compute

    before = os.sched_getaffinity(0)
    try:
        core = max(before)
        others = _pin_compute(str(core))
        assert os.sched_getaffinity(0) == {core}
        assert others == [c for c in sorted(before) if c != core] or others == sorted(before)
        assert _pin_compute("auto") == [] and _pin_compute("off") == []
        with pytest.raises(AffinityError):
            _pin_compute(str((os.cpu_count() or 1) + 7))
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc")
def test_name_current_thread_is_what_the_os_shows():
    """The name goes to the calling thread alone, cut to the 15 bytes Linux keeps."""
    seen = {}

    def run():
        seen["ok"] = name_current_thread("executor-io-and-more")
        seen["tid"] = threading.get_native_id()
        seen["comm"] = Path(f"/proc/self/task/{seen['tid']}/comm").read_text().strip()

    before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["ok"] and seen["comm"] == "executor-io-and"
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == before


def test_cpu_quota_from_cgroup_v2_and_v1(tmp_path):
    from pagedserve.affinity import cpu_quota

    assert cpu_quota(str(tmp_path)) is None  # neither file
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(str(tmp_path)) is None  # unlimited
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(str(tmp_path)) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert cpu_quota(str(v1)) == 1.5


def test_api_workers_auto(monkeypatch):
    """`--api-workers auto` (the default): 2 where serve's executors are on GPUs and the
    router may use 8 cores or more; else 0 (a router alone too); a number as given."""
    import argparse

    from pagedserve.router.api_workers import resolve_api_workers

    from pagedserve import affinity
    from pagedserve.flags import add_server_flags

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    assert parser.parse_args([]).api_workers == "auto"
    assert parser.parse_args(["--api-workers", "3"]).api_workers == 3
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--api-workers", bad])
    for cores, on_gpu, want in ((16, True, 2), (16, None, 0), (16, False, 0), (8, True, 2),
                                (7.5, True, 0), (2, True, 0)):
        monkeypatch.setattr(affinity, "usable_cores", lambda cores=cores: cores)
        assert resolve_api_workers("auto", on_gpu) == want, (cores, on_gpu)
    assert resolve_api_workers(0, True) == 0 and resolve_api_workers(3, False) == 3
