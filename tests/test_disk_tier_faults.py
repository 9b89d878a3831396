"""The prefix cache's disk tier is best effort: injected OS errors (full disk, read-only fs, EIO,
EACCES, EPERM), special files where entries belong (directories, FIFOs), a loader stuck in a
read, and a failing write-back never take the engine down; requests finish with the outputs of
an uncached run, faults are counted, the tier degrades to read-only or off, close() never raises."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest

from flashlane import LLM
from flashlane.cli.main import build_parser
from flashlane.engine.cache.disk_tier import FAILURES_TO_DEGRADE, TierState
from flashlane.engine.cache.rate_limited_log import RateLimitedLog
from flashlane.server.metrics import ServerMetrics

from engine_models import preset
from server_harness import metric
from test_prefix_cache_tiers import PARAMS, TIGHT, _ids, _run_round_robin, _sessions

MAX_STEPS = 20_000      # an idle engine step sleeps ~2 ms: far more than any request here needs
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def setup():
    m = preset("tiny-flash")
    firsts, extras = _sessions(min(m.config.vocab_size, 4000))
    ref = LLM(m, dtype="float32", enable_prefix_caching=False)
    want, next_prompts = _run_round_robin(ref, firsts, extras)
    return m, firsts, extras, _ids(want), ref, next_prompts


@pytest.fixture(scope="module")
def written(setup, tmp_path_factory):
    """A disk-tier directory holding what a round-robin workload stored (written back at close)."""
    m, firsts, extras, *_ = setup
    root = tmp_path_factory.mktemp("written")
    llm = LLM(m, dtype="float32", disk_cache_dir=str(root), **TIGHT)
    _run_round_robin(llm, firsts, extras)
    llm.close()
    assert list(root.rglob("page-*.st")), "the workload stored no pages"
    return root


@pytest.fixture
def copy_of_written(written, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(written, root)
    return root


def _engine(setup, root, **kwargs) -> LLM:
    return LLM(setup[0], dtype="float32", disk_cache_dir=str(root), **{**TIGHT, **kwargs})


def _complete(llm: LLM, prompt: list[int]) -> SimpleNamespace:
    """One request to its end (its token ids and cached prompt tokens), failing (instead of
    hanging) if it never finishes."""
    rid = f"fault-{next(_request_ids)}"
    llm.engine.add_request(rid, prompt, PARAMS)
    ids = []
    for _ in range(MAX_STEPS):
        for delta in llm.engine.step():
            if delta.request_id == rid:
                ids += delta.token_ids
                if delta.finished:
                    return SimpleNamespace(token_ids=ids, num_cached_tokens=delta.num_cached_tokens)
    pytest.fail(f"request {rid} unfinished after {MAX_STEPS} engine steps: stuck on the disk tier")


def _reference(setup, prompt):
    return setup[4].generate([prompt], PARAMS)[0].token_ids


def _under(path, root) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fsdecode(path).startswith(str(root))


def _inject(monkeypatch, name: str, root, code: int, when=lambda *args: True) -> None:
    """Make ``os.<name>`` raise OSError(code) for paths under ``root`` (where ``when(*args)``)."""
    real = getattr(os, name)

    def failing(path, *args, **kwargs):
        if _under(path, root) and when(*args):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, name, failing)


def _writing(flags, *rest) -> bool:
    return bool(flags & (os.O_WRONLY | os.O_RDWR))


def _reading(flags, *rest) -> bool:
    return not _writing(flags)


def _disk_warnings(caplog, needle: str) -> int:
    return sum(1 for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage())


# ---- write faults ----------------------------------------------------------------------------
@pytest.mark.parametrize("op,code", [("open", errno.ENOSPC), ("replace", errno.EROFS), ("open", errno.EDQUOT)])
def test_failing_writes_keep_serving_and_make_the_tier_read_only(setup, tmp_path, monkeypatch, caplog, op, code):
    m, firsts, extras, want, *_ = setup
    llm = _engine(setup, tmp_path)
    _inject(monkeypatch, op, tmp_path, code, _writing if op == "open" else (lambda *a: True))
    with caplog.at_level(logging.WARNING, logger="flashlane.cache"):
        got, _ = _run_round_robin(llm, firsts, extras)
        assert _ids(got) == want
        stats = llm.engine.stats()
        assert stats["prefix_cache_disk_errors_write"] == FAILURES_TO_DEGRADE     # then no more tries
        assert stats["disk_cache_state"] == TierState.READ_ONLY
        assert stats["prefix_cache_hits_disk"] == 0
        llm.close()                                                   # write-back skipped, not raised
    assert llm.engine.stats()["prefix_cache_disk_writeback_skipped"] > 0
    name = errno.errorcode[code]
    assert _disk_warnings(caplog, name) == 1 + 1       # the first failure, then the read-only switch
    assert _disk_warnings(caplog, "read-only") == 1
    assert not list(tmp_path.rglob("*.st")) and not list(tmp_path.rglob("*.tmp"))


def test_failing_removals_are_counted_and_serving_goes_on(setup, written, tmp_path, monkeypatch):
    m, firsts, extras, want, *_ = setup
    entry = max(f.stat().st_size for f in written.rglob("*.st"))
    llm = _engine(setup, tmp_path, disk_cache_bytes=3 * entry)         # room for three: evictions unlink
    _inject(monkeypatch, "unlink", tmp_path, errno.EPERM)
    got, _ = _run_round_robin(llm, firsts, extras)
    assert _ids(got) == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_evictions"] > 0 and stats["prefix_cache_disk_errors_remove"] > 0
    assert stats["disk_cache_state"] == TierState.READ_WRITE           # a failed unlink is no storage fault
    llm.close()


def test_write_back_with_a_failing_disk_does_not_raise(setup, tmp_path, monkeypatch):
    m, firsts, extras, *_ = setup
    llm = _engine(setup, tmp_path)
    _run_round_robin(llm, firsts, extras, turns=1)
    _inject(monkeypatch, "open", tmp_path, errno.EIO, _writing)
    llm.close()
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_errors_write"] == FAILURES_TO_DEGRADE
    assert stats["prefix_cache_disk_writeback_skipped"] > 0 and stats["disk_cache_state"] == TierState.READ_ONLY


# ---- read faults -----------------------------------------------------------------------------
def test_unreadable_entries_are_misses(setup, copy_of_written, monkeypatch):
    *_, next_prompts = setup
    llm = _engine(setup, copy_of_written)
    _inject(monkeypatch, "open", copy_of_written, errno.EACCES, _reading)       # chmod 000 does not bite root
    out = _complete(llm, next_prompts[0])
    assert out.token_ids == _reference(setup, next_prompts[0]) and out.num_cached_tokens == 0
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_errors_read"] > 0 and stats["prefix_cache_hits_disk"] == 0
    assert stats["disk_cache_state"] == TierState.READ_WRITE
    llm.close()


def test_repeated_read_io_errors_turn_the_tier_off(setup, copy_of_written, monkeypatch):
    *_, next_prompts = setup
    llm = _engine(setup, copy_of_written)
    _inject(monkeypatch, "open", copy_of_written, errno.EIO, _reading)
    out = _complete(llm, next_prompts[0])
    assert out.token_ids == _reference(setup, next_prompts[0])
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_errors_read"] >= FAILURES_TO_DEGRADE
    assert stats["disk_cache_state"] == TierState.OFF and stats["disk_cache_bytes_used"] == 0
    out = _complete(llm, next_prompts[1])                       # off: nothing is looked up on disk
    assert out.token_ids == _reference(setup, next_prompts[1])
    assert llm.engine.stats()["prefix_cache_disk_errors_read"] == stats["prefix_cache_disk_errors_read"]
    llm.close()


def test_a_failing_directory_scan_starts_with_an_empty_tier(setup, copy_of_written, monkeypatch):
    *_, next_prompts = setup
    _inject(monkeypatch, "scandir", copy_of_written, errno.EIO)
    llm = _engine(setup, copy_of_written)
    assert llm.engine.stats()["prefix_cache_disk_errors_list"] == 1
    out = _complete(llm, next_prompts[0])
    assert out.token_ids == _reference(setup, next_prompts[0]) and out.num_cached_tokens == 0
    llm.close()


# ---- special files where entries belong ------------------------------------------------------
def _unblock_fifos(root) -> None:
    """Give readers blocked on FIFOs under ``root`` their end of file, one FIFO after another (a
    loader that waits on them would otherwise keep the test process from exiting)."""
    for _ in range(500):
        fifos = [f for f in root.rglob("*.st") if f.is_fifo()]
        if not fifos:
            return
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_special_files_in_place_of_indexed_pages_are_rejected(setup, copy_of_written, request, kind):
    *_, next_prompts = setup
    request.addfinalizer(lambda: _unblock_fifos(copy_of_written))
    running = _engine(setup, copy_of_written)            # has indexed the page files
    pages = list(copy_of_written.rglob("page-*.st"))
    for f in pages:
        f.unlink()
        f.mkdir() if kind == "directory" else os.mkfifo(f)
    out = _complete(running, next_prompts[0])
    assert out.token_ids == _reference(setup, next_prompts[0])
    stats = running.engine.stats()
    assert stats["prefix_cache_disk_rejected"] > 0 and stats["prefix_cache_hits_disk"] == 0
    running.close()

    restarted = _engine(setup, copy_of_written)          # the start-up scan indexes regular files only
    assert restarted.engine.stats()["prefix_cache_disk_rejected"] > 0
    out = _complete(restarted, next_prompts[1])
    assert out.token_ids == _reference(setup, next_prompts[1])
    restarted.close()
    if kind == "fifo":
        assert not any(f.exists() and not f.is_file() for f in pages)       # removed where possible


def test_directories_where_pages_will_be_written(setup, written, tmp_path):
    m, firsts, extras, want, *_ = setup
    llm = _engine(setup, tmp_path)
    names = [f.relative_to(written) for f in written.rglob("page-*.st")]
    for name in names:
        (tmp_path / name).mkdir(parents=True)
    got, _ = _run_round_robin(llm, firsts, extras)
    assert _ids(got) == want
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_errors_write"] > 0
    assert stats["disk_cache_state"] == TierState.READ_WRITE           # a directory in the way is no full disk
    llm.close()
    assert all((tmp_path / name).is_dir() for name in names)


# ---- a stuck load ----------------------------------------------------------------------------
def test_a_stuck_load_is_given_up_and_later_loads_still_work(setup, copy_of_written, monkeypatch, request):
    *_, next_prompts = setup
    llm = _engine(setup, copy_of_written, disk_load_timeout_s=0.2)
    release, stuck_fds = threading.Event(), set()
    request.addfinalizer(release.set)
    real_open, real_read = os.open, os.read

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if _under(path, copy_of_written) and _reading(flags) and not stuck_fds:
            stuck_fds.add(fd)                                # the first disk-tier read will hang
        return fd

    def hanging_read(fd, n):
        if fd in stuck_fds:
            release.wait()
        return real_read(fd, n)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "read", hanging_read)
    out = _complete(llm, next_prompts[0])
    assert out.token_ids == _reference(setup, next_prompts[0])
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_load_timeouts"] == 1 and stuck_fds

    hits_before = stats["prefix_cache_hits_disk"]
    out = _complete(llm, next_prompts[1])                    # served by a fresh loader, from disk
    assert out.token_ids == _reference(setup, next_prompts[1])
    assert out.num_cached_tokens > 0 and llm.engine.stats()["prefix_cache_hits_disk"] > hits_before
    llm.close()                                              # the stuck thread is a daemon: no hang
    release.set()


# ---- arguments, metrics, log -----------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1.0, "soon", float("inf"), True])
def test_disk_load_timeout_is_validated(value):
    with pytest.raises(ValueError, match="disk_load_timeout_s"):
        LLM(preset("tiny-flash"), dtype="float32", disk_load_timeout_s=value)


def test_disk_load_timeout_flag():
    args = build_parser("serve").parse_args(["serve", "--model", "m", "--disk-load-timeout", "0.5"])
    assert args.disk_load_timeout_s == 0.5
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--model", "m", "--disk-load-timeout", "0"])


def test_disk_fault_metrics():
    snapshot = {"running": 0, "waiting": 0, "pages_used": 0, "pages_free": 4, "pages_total": 4, "slots_used": 0,
                "slots_free": 1, "preemptions": 0, "disk_cache_bytes_used": 0, "disk_cache_bytes_total": 0,
                "disk_cache_state": 1, "prefix_cache_disk_errors_write": 3, "prefix_cache_disk_errors_read": 2,
                "prefix_cache_disk_load_timeouts": 1, "prefix_cache_disk_rejected": 4}
    text = ServerMetrics("m").render(snapshot).decode()
    scraped = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                        if line and not line.startswith("#"))}
    assert metric(scraped, "flashlane:disk_cache_state") == 1
    assert metric(scraped, "flashlane:prefix_cache_disk_errors_total", op="write") == 3
    assert metric(scraped, "flashlane:prefix_cache_disk_errors_total", op="read") == 2
    assert metric(scraped, "flashlane:prefix_cache_disk_errors_total", op="list") == 0
    assert metric(scraped, "flashlane:prefix_cache_disk_load_timeouts_total") == 1
    assert metric(scraped, "flashlane:prefix_cache_disk_rejected_total") == 4
    assert "2 = read-write, 1 = read-only" in text and "0 = off" in text


def test_rate_limited_log_reports_a_cause_once_then_a_summary(caplog):
    clock = [100.0]
    limited = RateLimitedLog(logging.getLogger("flashlane.test"), interval_s=60, clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="flashlane.test"):
        for _ in range(5):
            limited.warning("write ENOSPC", "disk full")
        limited.warning("read EIO", "read failed")
        clock[0] += 61
        limited.warning("write ENOSPC", "disk full")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["disk full", "read failed", "disk full (5 times since the last report of write ENOSPC)"]
