"""The bad-input table (issue 17, items 6-8): bad-value classes, the fixtures they are tried on, the state
snapshot compared before and after every call, and ``Api``, which crosses each argument of a public call
with every value of its classes. The APIs themselves are listed in ``bad_inputs_apis.py``.

Every value is bad for the argument it is given to, and every other argument of the call is good, so
the call must raise a ``TieredCacheError`` naming that argument and change nothing.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tests.support.radix_util import insert_fresh, make_hi_cache
from tiered_cache import (
    HostMirror,
    Int8CheckpointPool,
    KVSpec,
    MultiEndedAllocator,
    RegionSpec,
    StateSpec,
    TransferEngine,
    UnifiedPool,
)
from tiered_cache.storage import FileStore, Kind, StorageFingerprint, StorageTier
from tiered_cache.transfer.moves import demote_kv, demote_states

NAN, INF = math.nan, math.inf

KV = KVSpec(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 4, 8), temporal_dtype=torch.float32, conv_shapes=((4, 3),),
               conv_dtype=torch.float32, value_axis=2)
FP = StorageFingerprint("test/bad-inputs", (0, 2), ("kv=float16",), "int8", 2)


@dataclass(frozen=True)
class Bad:
    """One bad value. ``typ``: of a wrong type, so the error must also be a ``TypeError``.
    ``dyn``: ``value`` is ``fn(world)`` (ids that exist only in the fixtures)."""

    label: str
    value: Any
    typ: bool = False
    dyn: bool = False

    def get(self, w: World) -> Any:
        return self.value(w) if self.dyn else copy.deepcopy(self.value)


def T(label: str, value: Any) -> Bad:  # noqa: N802 - reads as a table entry
    return Bad(label, value, typ=True)


def V(label: str, value: Any) -> Bad:  # noqa: N802
    return Bad(label, value)


def D(label: str, fn: Callable[[World], Any], typ: bool = False) -> Bad:  # noqa: N802
    return Bad(label, fn, typ=typ, dyn=True)


# ------------------------------------------------------------------------------------------ value classes
NOT_INT = [T("str", "1"), T("float", 1.5), T("integral_float", 2.0), T("bool", True), T("none", None),
           T("list", [1]), T("nan", NAN), T("inf", INF), T("float_tensor", torch.tensor(1.5)),
           T("np_float", np.float64(2.0)), T("object", object()), T("complex", 1j)]
POS_INT = NOT_INT + [V("zero", 0), V("negative", -1)]
NONNEG_INT = NOT_INT + [V("negative", -1), V("very_negative", -(2 ** 63))]
HUGE = [V("huge", 2 ** 64)]
NOT_REAL = [T("str", "1.0"), T("none", None), T("bool", True), T("list", [1.0]), T("object", object()),
            T("complex", 1j), T("tensor", torch.tensor(1.0))]
SECONDS = NOT_REAL + [V("nan", NAN), V("negative", -1.0), V("neg_inf", -INF)]  # > 0 or >= 0 (+ inf)
OPT_SECONDS = [b for b in SECONDS if b.label != "none"]  # where None means "no limit"
POS_SECONDS = SECONDS + [V("zero", 0.0)]
BOOL = [T("str", "false"), T("int", 1), T("zero", 0), T("none", None), T("float", 1.0), T("object", object())]
STR = [T("none", None), T("int", 3), T("bytes", b"x"), T("list", ["x"]), T("object", object())]
NAME = STR + [V("empty", "")]
CHOICE = [V("unknown", "bogus"), V("empty", ""), V("upper", "AUTO"), T("none", None), T("int", 3),
          T("bytes", b"auto"), T("list", ["auto"])]
DEVICE = [V("tpu", "tpu"), V("meta", "meta"), V("meta_device", torch.device("meta")), V("cuda_absent", "cuda:7"),
          V("bogus", "bogus"), V("empty", ""), T("int", 3), T("float", 1.5), T("object", object()),
          T("list", ["cpu"])]
DTYPE = [T("str", "float32"), T("none", None), T("numpy", np.float32), T("python_type", float), T("int", 3),
         V("complex", torch.complex64), V("bool", torch.bool)]
IDS_TYPE = [T("str", "12"), T("bytes", b"\x01\x02"), T("float_list", [3.7]), T("integral_float_list", [1.0]),
            T("bool_list", [True]), T("none_list", [None]), T("none", None), T("float", 3.5),
            T("inf_list", [INF]), T("nan_list", [NAN]), T("float_tensor", torch.tensor([1.5])),
            T("bool_tensor", torch.tensor([True])), T("float_array", np.array([1.5])), T("nested", [[1, 2]]),
            T("object", object()), T("set", {1}), T("str_list", ["1"]), T("tensor_2d", torch.tensor([[1]])),
            T("dict", {1: 1})]
INDEX = NOT_INT + [V("negative", -1), V("huge", 2 ** 63)]
TENSOR = [T("none", None), T("list", [[0] * 16]), T("str", "x"), T("array", np.zeros((2, 16), np.uint8))]
OBJ = [T("none", None), T("str", "x"), T("int", 3), T("object", object())]


def ids_state(ids: Callable[[World], list], free: Callable[[World], int], cap: Callable[[World], int],
              page: int = 1) -> list[Bad]:
    """Ids of the right type in the wrong state: free, repeated, the sink, out of range, partial pages."""
    def pages(vs):
        return [v * page + j for v in vs for j in range(page)]

    out = [D("freed", lambda w: pages([free(w)])), D("repeated", lambda w: pages([ids(w)[0]] * 2)),
           D("sink", lambda w: pages([0])), D("negative", lambda w: [-1] * page),
           D("past_end", lambda w: pages([cap(w)])), D("huge", lambda w: [2 ** 63 - 1] * page),
           D("uint64", lambda w: np.array([2 ** 64 - 1] * page, dtype=np.uint64)),
           D("past_end_tensor", lambda w: torch.tensor(pages([cap(w) + 5])))]
    if page > 1:
        out.append(D("partial_page", lambda w: [ids(w)[0] * page]))
    return out


# ----------------------------------------------------------------------------------------------- fixtures
class World:
    """Small live fixtures with something in every tier, so a bad call has state it could damage."""

    def __init__(self, tmp) -> None:
        self.pool = UnifiedPool(KV, ST, low_slots=12, high_slots=5, page_size=2, device="cpu", backend="torch")
        self.kv, self.st = self.pool.side("full"), self.pool.side("mamba")
        self.kv_ids = self.kv.alloc(6)  # pages 1, 2, 3
        self.kv.free(self.kv_ids[4:])  # page 3 freed again: a known free id
        self.kv_ids = self.kv_ids[:4]
        self.st_ids = self.st.alloc(3)
        self.st.free(self.st_ids[2:])
        self.st_ids = self.st_ids[:2]
        self.solo = MultiEndedAllocator(name="solo", entry_bytes=64, total_bytes=64 * 10, grows="up")
        self.solo_ids = self.solo.alloc(4)
        self.solo.free(self.solo_ids[3:])
        self.solo_ids = self.solo_ids[:3]
        self.t1 = Int8CheckpointPool(ST, 6, device="cpu", codec="int8", backend="torch")
        self.t1_ids = self.t1.alloc(3).tolist()
        self.t1.free(self.t1_ids[2:])
        self.t1_ids = self.t1_ids[:2]
        g = torch.Generator().manual_seed(7)
        self.pool.raw.copy_(torch.randint(0, 256, self.pool.raw.shape, dtype=torch.uint8, generator=g))
        self.t1.raw.copy_(torch.randint(0, 256, self.t1.raw.shape, dtype=torch.uint8, generator=g))
        self.mirror = HostMirror([RegionSpec("state", self.t1.slot_bytes, 6),
                                  RegionSpec("full", self.kv.entry_bytes, 8)])
        self.hs, self.hk = self.mirror.region("state"), self.mirror.region("full")
        self.engine = TransferEngine("cpu", backend="torch")
        self.hs_valid, self.hk_valid = self.hs.alloc(1), self.hk.alloc(1)
        demote_states(self.engine, self.t1, self.t1_ids[:1], self.hs, self.hs_valid)
        demote_kv(self.engine, self.kv, self.kv_ids[:2], self.hk, self.hk_valid)
        self.ticket = self.engine.wait_all()[0]
        self.hs_dst, self.hk_dst = self.hs.alloc(1), self.hk.alloc(1)  # allocated, not yet valid
        self.hs_freed = self.hs.alloc(1)[0]
        self.hs.free([self.hs_freed])
        self.hk_freed = self.hk.alloc(1)[0]
        self.hk.free([self.hk_freed])
        # T0 + T1 + T2 radix cache with two cached prefixes
        self.cache = make_hi_cache(page_size=1, kv_pages=32, states=4, t1_slots=8, codec="lossless")
        insert_fresh(self.cache, [1, 2, 3, 4])
        res, _ = insert_fresh(self.cache, [1, 2, 5, 6])
        self.node = res.last_device_node
        # T3 over a file store, one entry stored
        self.root = str(tmp / "store")
        self.store = FileStore(self.root)
        self.tier = StorageTier(self.store, FP, workers=1)
        self.keys = self.tier.keys([1, 2, 3, 4])
        self.sregion = HostMirror([RegionSpec("full", 64, 4)]).region("full")
        self.s_slots = self.sregion.alloc(2)
        for s in self.s_slots:
            self.sregion.slot(s).copy_(torch.arange(64, dtype=torch.uint8))
            self.sregion.valid[s] = True
        op = self.tier.put(self.keys[:1], Kind.KV, [bytes(64)])
        assert self.tier.wait(op, 30) and all(op.hits)
        self.tier.poll()
        self.op = op

    def snapshot(self) -> dict:
        """Everything a bad call could change: sizes, free counts, ids, bytes, invariants."""
        for obj in (self.pool, self.mirror, self.sregion, self.cache):
            obj.check_invariants()
        self.solo.check_invariants()
        self.t1.allocator.check_invariants()
        out: dict = {}
        for name, a in (("kv", self.kv.allocator), ("st", self.st.allocator), ("solo", self.solo)):
            out[name] = (a.available_size(), a.num_live, a.num_holes, a.busy_ids, a._v2p.tobytes())
        for name, r in (("hs", self.hs), ("hk", self.hk), ("sregion", self.sregion),
                        ("cs", self.cache.host.region("state")), ("ck", self.cache.host.region("full"))):
            out[name] = (r.available_size(), tuple(r.allocator.allocated_ids()), r.allocator.busy_ids,
                         r.valid.tobytes(), r.checksums.tobytes(), [zlib.crc32(c.numpy()) for c in r.chunks])
        out["t1"] = (self.t1.available_size(), tuple(self.t1.allocator.allocated_ids()),
                     zlib.crc32(self.t1.raw.numpy()))
        out["raw"] = zlib.crc32(self.pool.raw.numpy())
        out["engine"] = (self.engine.pending, self.engine.inflight_bytes, dict(self.engine.stats),
                         self.engine._next_id)
        c = self.cache
        out["cache"] = (c.total_size(), c.full_evictable_size(), c.full_protected_size(), c.mamba_evictable_size(),
                        c.mamba_protected_size(), c.kv.available_size(), c.states.available_size(),
                        c.ckpt.available_size(), c.engine.pending, self.node.full_lock_ref, self.node.mamba_lock_ref)
        import os

        out["tier"] = (self.tier.pending(), dict(self.tier.stats), sorted(os.listdir(self.root)))
        return out

    def close(self) -> None:
        self.tier.close()


# ------------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    api: str
    arg: str
    bad: Bad
    call: Callable[[World], Any]
    names: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.api}:{self.arg}:{self.bad.label}"


@dataclass
class Api:
    """``fn(w, **kwargs)`` with ``good`` arguments (values or ``fn(world)``); ``bad[arg]`` lists the
    values tried for ``arg``, one case each. ``names[arg]``: other names the error may give the argument
    (a field of a parameter object: ``params.key``)."""

    name: str
    fn: Callable[..., Any]
    good: dict[str, Any]
    bad: dict[str, list[Bad]]
    names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    control: bool = True  # False: the good values are placeholders (the one argument is always bad)

    def cases(self) -> list[Case]:
        out = []
        for arg, values in self.bad.items():
            for b in values:
                out.append(Case(self.name, arg, b, self._caller(arg, b), (arg, *self.names.get(arg, ()))))
        return out

    def good_call(self, w: World) -> Any:
        return self.fn(w, **{k: self._good(w, k) for k in self.good})

    def _good(self, w: World, k: str) -> Any:
        v = self.good[k]
        return v(w) if callable(v) and not isinstance(v, type) else v

    def _caller(self, arg: str, b: Bad) -> Callable[[World], Any]:
        def call(w: World) -> Any:
            kw = {k: self._good(w, k) for k in self.good if k != arg}
            kw[arg] = b.get(w)
            return self.fn(w, **kw)
        return call
