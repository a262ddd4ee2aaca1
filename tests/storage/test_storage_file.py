"""FileStore: a restart finds earlier entries, writes are atomic, damage on disk is a counted miss."""

from __future__ import annotations

import os
import threading

import pytest

from tests.support.storage_util import FP, check_slots, fill_slots, make_region, wait_done
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.storage import FileStore, Kind, RedisStore, StorageTier, open_backend

SLOT = 4096
TOKENS = list(range(500, 532))  # 8 pages of 4


def _write_all(tier, region, keys):
    slots = region.alloc(len(keys))
    fill_slots(region, slots, keys)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, slots)).hits)


def test_a_restarted_store_finds_earlier_entries(tmp_path):
    first = StorageTier(FileStore(str(tmp_path / "t3")), FP, salt="tenant")
    keys = first.keys(TOKENS)
    _write_all(first, make_region(SLOT, 8), keys)
    first.close()
    # A new process would build all of this anew: nothing but the directory carries over.
    again = StorageTier(open_backend(f"file://{tmp_path / 't3'}"), FP, salt="tenant")
    region = make_region(SLOT, 8)
    dst = region.alloc(8)
    op = wait_done(again, again.prefetch(again.keys(TOKENS), Kind.KV, region, dst))
    assert all(op.hits)
    check_slots(region, dst, keys)
    again.close()


@pytest.mark.parametrize("size", [0, 50, 96, SLOT // 2])
def test_a_file_cut_short_on_disk_is_a_counted_miss(tmp_path, size):
    store = FileStore(str(tmp_path))
    tier = StorageTier(store, FP)
    keys = tier.keys(TOKENS[:8])
    _write_all(tier, make_region(SLOT, 4), keys)
    os.truncate(store.path(tier.storage_key(Kind.KV, keys[0])), size)  # a crash without fsync, a full disk
    region = make_region(SLOT, 4)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, region.alloc(2)))
    # refused by its size before a byte is read (issue 17 item 2): a length miss, not a parse of it
    assert op.hits == [False, True] and tier.stats["bad_length"] == 1
    tier.close()


def test_bytes_flipped_on_disk_are_a_counted_miss(tmp_path):
    store = FileStore(str(tmp_path))
    tier = StorageTier(store, FP)
    keys = tier.keys(TOKENS[:4])
    _write_all(tier, make_region(SLOT, 4), keys)
    with open(store.path(tier.storage_key(Kind.KV, keys[0])), "r+b") as f:
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 0x04]))
    region = make_region(SLOT, 4)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, region.alloc(1)))
    assert op.hits == [False] and tier.stats["bad_checksum"] == 1
    tier.close()


def test_writes_are_atomic_and_leave_no_temp_files(tmp_path):
    store = FileStore(str(tmp_path), fsync=True)
    value = os.urandom(1 << 20)
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            v = store.get_many(["blob-aa"])[0]
            if v is not None:
                seen.append(len(v))

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20):  # the same content-addressed key written again and again, as two engines would
        store.put_many([("blob-aa", [value[:100], memoryview(value)[100:]])])
    stop.set()
    t.join()
    assert set(seen) <= {len(value)}  # a reader never saw a torn file
    assert bytes(store.get_many(["blob-aa"])[0]) == value
    assert os.listdir(tmp_path / ".tmp") == []
    stale = tmp_path / ".tmp" / "blob-bb.1.2.3"
    stale.write_bytes(b"x")
    os.utime(stale, (0, 0))  # a writer that died long ago
    FileStore(str(tmp_path))
    assert not stale.exists()
    assert store.exists_many(["blob-aa", "blob-cc"]) == [True, False]
    store.delete_many(["blob-aa", "blob-cc"])
    assert store.get_many(["blob-aa"]) == [None]


def test_open_backend_urls(tmp_path):
    assert isinstance(open_backend(str(tmp_path)), FileStore)
    r = open_backend("redis://127.0.0.1:1234", socket_timeout=0.5)
    assert isinstance(r, RedisStore) and (r.host, r.port) == ("127.0.0.1", 1234)
    c = open_backend("redis-cluster://127.0.0.1:7000,127.0.0.1:7001")
    assert c.cluster_nodes == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    for bad in ("", "s3://bucket", "redis://a:1,b:2", "redis://nohost"):
        with pytest.raises(InvalidArgumentError, match="url"):
            open_backend(bad)
    with pytest.raises(InvalidArgumentError, match="key"):
        FileStore(str(tmp_path)).path("../escape")


def _tree(path) -> dict:
    """Every file and folder under ``path`` with its size (what a write outside the root would change)."""
    out = {}
    for d, subdirs, files in os.walk(path):
        for n in subdirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, path)] = os.path.getsize(p) if os.path.isfile(p) else -1
    return out


BAD_KEYS = ["evil..", "..", "../x", "x/../../y", "a/b", ".", "", ".hidden", "kv-ab.", "/abs/olute", "/tmp",
            "a\0b", "\0", "x" * 201, "é", "a b", "a\\b", "kv-" + "0" * 62 + "..", "\n"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=[repr(k)[:24] for k in BAD_KEYS])
def test_a_key_that_could_leave_the_root_is_refused_everywhere(tmp_path, key):
    """Issue 17 item 5: ``"evil.."`` was written, read and deleted one directory above the root (its
    shard folder was ``".."``). Keys are a fixed alphabet: every call refuses a bad one with a typed
    error naming ``key``, before anything is done (nothing written anywhere under the parent)."""
    root = tmp_path / "store" / "t3"
    store = FileStore(str(root))
    store.put_many([("kv-good", [b"fine"])])
    before = _tree(tmp_path)
    calls = [lambda: store.put_many([("kv-first", [b"x"]), (key, [b"payload"])]),  # checked first, then written
             lambda: store.get_many([key]), lambda: store.exists_many([key]), lambda: store.delete_many([key]),
             lambda: store.path(key)]
    for call in calls:
        with pytest.raises(InvalidArgumentError) as ei:
            call()
        assert ei.value.arg == "key"
    assert _tree(tmp_path) == before
    assert bytes(store.get_many(["kv-good"])[0]) == b"fine"


@pytest.mark.parametrize("key", [None, 3, b"kv-aa", ["kv-aa"]])
def test_a_key_of_the_wrong_type_is_a_type_error(tmp_path, key):
    from tiered_cache.errors import InvalidTypeError

    store = FileStore(str(tmp_path))
    with pytest.raises(InvalidTypeError) as ei:
        store.get_many([key])
    assert ei.value.arg == "key"


def test_a_shard_folder_linked_out_of_the_root_is_refused(tmp_path):
    """Issue 17 item 5, the second guard: paths are resolved and must lie under the resolved root, so a
    shard folder replaced by a symlink to elsewhere is not followed."""
    root = tmp_path / "t3"
    outside = tmp_path / "outside"
    outside.mkdir()
    store = FileStore(str(root))
    os.symlink(outside, root / "aa")
    with pytest.raises(InvalidArgumentError, match="key"):
        store.put_many([("kv-aa", [b"x"])])
    assert os.listdir(outside) == []


def test_a_full_disk_does_not_turn_reads_off(tmp_path, monkeypatch):
    """Issue 17 item 10: write failures opened the one shared circuit breaker, so entries already on disk
    read as unavailable for ``retry_after_s``. Reads and writes have breakers of their own."""
    import errno

    import tiered_cache.storage.file_store as fs

    store = FileStore(str(tmp_path / "t3"))
    tier = StorageTier(store, FP, retry_after_s=60.0)
    keys = tier.keys(TOKENS[:16])
    _write_all(tier, make_region(SLOT, 4), keys[:2])

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_all", full)
    region = make_region(SLOT, 8)
    slots = region.alloc(2)
    fill_slots(region, slots, keys[2:])
    op = wait_done(tier, tier.write(keys[2:], Kind.KV, region, slots))
    assert op.hits == [False, False] and tier.stats["write_unavailable"] == 2
    assert not os.listdir(tmp_path / "t3" / ".tmp")  # the failed temp files are gone
    dst = region.alloc(2)
    op = wait_done(tier, tier.prefetch(keys[:2], Kind.KV, region, dst))
    assert op.hits == [True, True] and tier.stats["unavailable"] == 0
    check_slots(region, dst, keys[:2])
    assert wait_done(tier, tier.lookup(keys, Kind.KV)).hits == [True, True, False, False]
    # ... while writes stay off for retry_after_s (no disk hammering): the next write fails fast
    n_calls = []
    monkeypatch.setattr(fs, "_write_all", lambda f, data: n_calls.append(1))
    op = wait_done(tier, tier.write(keys[2:], Kind.KV, region, slots))
    assert op.hits == [False, False] and not n_calls
    tier.close()
