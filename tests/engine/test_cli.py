"""The command line as a newcomer meets it (issue 26): bad flags fail at once, in one line naming the
flag, exit 2, before any run; ``--help`` shows every default. Each call here fails before a model is
built (milliseconds), except where a test says otherwise."""

from __future__ import annotations

import argparse
import os
import re
import socket
import time

import pytest

pytest.importorskip("transformers")

from tiered_cache import cli  # noqa: E402
from tiered_cache.engine.stress import add_arguments  # noqa: E402

# Small enough that, if a check were missing, the run it let through would end in seconds (and the
# test would still fail on the exit code), never in minutes.
TINY = ["--clients", "1", "--rounds", "1", "--question-len", "4", "--system-len", "4", "--max-new-tokens", "2",
        "--page-size", "4", "--chunk-size", "8", "--kv-pages", "16", "--max-running", "1", "--t0-states", "1",
        "--t1-states", "2", "--host-kv-pages", "8", "--host-states", "2", "--no-progress", "--repeats", "1",
        "--no-forced", "--no-baseline"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _usage_error(argv, capsys, flag):
    t0 = time.perf_counter()
    try:
        rc = cli.main(["stress", *TINY, *argv])
    except SystemExit as e:  # argparse's own errors exit from parse_args
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert flag in err, err
    return err, time.perf_counter() - t0


BAD = [
    (["--threads", "-1"], "--threads"),                       # was accepted, then hung
    (["--hidden", "-64"], "--hidden"),                        # was a raw torch RuntimeError
    (["--layers", "2"], "--layers"),                          # no full-attention layer
    (["--device", "tpu"], "--device"),
    (["--clients", "0"], "--clients"),
    (["--clients", "abc"], "--clients"),                      # argparse's own error, one line too
    (["--dtype", "int8"], "--dtype"),
    (["--kv-pages", "0"], "--kv-pages"),
    (["--kv-pages", "3"], "--kv-pages"),                      # the longest turn cannot fit in T0
    (["--max-running", "4"], "--max-running"),                # > --t0-states: was named max_running
    (["--host-kv-pages", "0"], "--host-kv-pages"),            # with --host-states 2: was host_kv_pages
    (["--chunk-size", "6"], "--chunk-size"),                  # not a multiple of --page-size
    (["--abort-prob", "1"], "--abort-prob"),
    (["--abort-prob", "nan"], "--abort-prob"),
    (["--repeats", "0"], "--repeats"),
    (["--storage", "notaurl"], "--storage"),                  # was a bare path: a folder in the cwd
    (["--storage", "s3://bucket"], "--storage"),
    (["--storage", "file:///tmp/x", "--host-kv-pages", "0", "--host-states", "0"], "--storage"),  # needs T2
]


@pytest.mark.parametrize("argv,flag", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_one_line_naming_the_flag_exit_2(argv, flag, capsys, tmp_path, monkeypatch):
    """Issue 26 items 4-5: each of these ran (or hung, or printed a ~19-line traceback naming Python
    fields such as ``kv_pages``); now one line naming the flag, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    _usage_error([*argv, "--out", str(out)], capsys, flag)
    assert os.listdir(tmp_path) == []  # no --out folder, no store folder in the cwd: nothing changed


def test_out_folder_that_cannot_be_created_fails_before_the_run(tmp_path, capsys):
    """Issue 26 item 4: ``--out`` under a file failed after the whole run with a raw FileNotFoundError
    and the report was lost; now it fails first, naming ``--out``."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err, took = _usage_error(["--out", str(blocker / "sub")], capsys, "--out")
    assert "a-file" in err
    assert took < 5, took  # no model built, nothing run


def test_unreachable_redis_fails_before_the_run(tmp_path, capsys):
    """Issue 26 item 4: a Redis URL with nothing listening ran to the end, exit 0, with warnings; now one
    write-and-read probe fails before the run, naming ``--storage``."""
    url = f"redis://127.0.0.1:{_free_port()}"
    err, _ = _usage_error(["--storage", url, "--out", str(tmp_path / "o")], capsys, "--storage")
    assert url in err


def test_reachable_file_store_passes_the_probe_and_leaves_nothing(tmp_path):
    """The storage probe writes, reads and deletes one key: a good store passes and keeps no probe file
    (pins that the check is a real round trip, not a scheme test)."""
    from tiered_cache.engine.stress import check_storage

    root = tmp_path / "store"
    check_storage(f"file://{root}")
    left = [f for _, _, fs in os.walk(root) for f in fs if f.startswith("probe-")]
    assert left == []


def test_demo_bad_flag_is_one_line(capsys):
    """Issue 26 item 5: ``demo --pages 0`` ended in a traceback naming ``low_slots``."""
    rc = cli.main(["demo", "--pages", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--pages" in err and "low_slots" not in err, err


def test_help_shows_every_default(capsys):
    """Issue 26 item 8: ``--help`` hid the defaults of --clients, --rounds, --dtype, --page-size and
    --write-policy (argparse shows a default only beside a help text)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["stress", "--help"])
    assert e.value.code == 0
    text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))  # undo wrapping at hyphens
    p = argparse.ArgumentParser()
    add_arguments(p)
    for a in p._actions:
        if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) and a.dest != "help":
            assert a.help, a.option_strings
            assert f"(default: {a.default})" in text, a.option_strings
    for flag, default in (("--clients", 16), ("--rounds", 4), ("--dtype", "float32"), ("--page-size", 16),
                          ("--write-policy", "write_through")):
        assert re.search(rf"{flag} \S+ [^(]*\(default: {default}\)", text), flag
