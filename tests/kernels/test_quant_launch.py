"""The bound launches of the per-call T1 moves (``kernels/launch.py``, ``quant.StorePlan`` ...).

On the CPU: ``Bound``'s logic against a stand-in kernel that records every launch (which path, which
arguments, which grid); the plans through the interpreter, one plan serving calls of several sizes,
against the torch twins into poisoned outputs (int8 bit-exact); ``IdRing``'s reuse and growth. On the
H200 (``-m gpu``): the same plans through the compiled kernels, with the bound path taken.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tiered_cache.kernels import launch, quant
from tiered_cache.kernels.reference import (
    copy_rows_reference,
    dequantize_load_reference,
    quantize_store_reference,
)


class FakeCompiled:
    """A compiled kernel whose launcher takes exactly ``accept`` arguments after the nine of the launch."""

    def __init__(self, log: list, accept: set[int], tag: tuple) -> None:
        self.log, self.accept, self.tag = log, accept, tag
        self.function, self.packed_metadata = "function", "packed"

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert (function, packed, meta, enter, exit_) == ("function", "packed", None, None, None)
        if len(args) not in self.accept:
            raise TypeError(f"takes {self.accept} arguments ({len(args)} given)")
        self.log.append(("fast", self.tag, (g0, g1, g2), stream, args))


class FakeKernel:
    """``kernel(a_ptr, N, x, BLOCK: constexpr, MODE: constexpr = 7)``: an ordinary launch logs itself and
    returns the compiled kernel of its specialization (``_spec_class`` of the pointer and ``N``)."""

    def __init__(self, accept: set[int]) -> None:
        def fn(a_ptr, N, x, BLOCK, MODE=7):
            pass

        self.fn, self.accept, self.log, self.compiled = fn, accept, [], {}
        self.params = [SimpleNamespace(is_constexpr=n in ("BLOCK", "MODE")) for n in ("a_ptr", "N", "x", "BLOCK",
                                                                                          "MODE")]

    def warmup(self) -> None:  # present on a JITFunction, absent on the interpreter's function
        pass

    def __getitem__(self, grid):
        def go(*args, **meta):
            tag = (launch._spec_class(args[0]), launch._spec_class(args[1]))
            self.log.append(("ordinary", tag, grid, args, meta))
            return self.compiled.setdefault(tag, FakeCompiled(self.log, self.accept, tag))
        return go


@pytest.fixture
def compiled_mode(monkeypatch):
    """Launches as on a GPU (no interpreter), the driver's stream ``1234 + device`` on the current device,
    ``current[0]`` (0; a test sets another to switch devices)."""
    current = [0]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_driver_getters", lambda: ((lambda dev: 1234 + dev), lambda: current[0]))
    return current


def test_bound_binds_once_per_class_and_passes_the_arguments_in_signature_order(compiled_mode):
    k = FakeKernel(accept={5})
    ids = torch.zeros(64, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 3.5], dict(BLOCK=64, num_warps=4), ("a_ptr", "N"))
    b((4,), ids[:4], 4)  # ordinary: compiles the class (aligned, N not 1 nor a multiple of 16)
    b((5, 2), ids[:5], 5)  # the same class: bound
    b((16,), ids[:16], 16)  # N % 16 == 0: a class of its own, ordinary once
    b((1,), ids[:1], 1)  # N == 1: another
    b((17,), ids[:17], 17)  # back in the first class: bound
    b((3,), ids[1:4], 3)  # a pointer 8 bytes off alignment: a class of its own
    kinds = [(e[0], e[2]) for e in k.log]
    assert kinds == [("ordinary", (4,)), ("fast", (5, 2, 1)), ("ordinary", (16,)), ("ordinary", (1,)),
                     ("fast", (17, 1, 1)), ("ordinary", (3,))]
    first = k.log[0][3]
    assert first[0].data_ptr() == ids.data_ptr() and first[1:] == (4, 3.5) and k.log[0][4] == dict(BLOCK=64,
                                                                                                   num_warps=4)
    # signature order, constexprs and defaults included, tensors as pointers, on the driver's stream
    assert k.log[1][3] == 1234 and k.log[1][4] == (ids.data_ptr(), 5, 3.5, 64, 7)
    assert k.log[4][4] == (ids.data_ptr(), 17, 3.5, 64, 7)
    assert len({e[1] for e in k.log}) == 4  # four specialization classes, each launch under its own


def test_a_plain_varying_int_keeps_its_class(compiled_mode):
    """``plain``: an int the kernel does not specialize on (a per-call mark) never splits the class."""
    k = FakeKernel(accept={5})
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 0], dict(BLOCK=8), ("a_ptr", "N", "x"), plain=("x",))
    for mark in (1, 2, 16, 17):
        b((3,), ids[:3], 3, mark)
    assert [e[0] for e in k.log] == ["ordinary", "fast", "fast", "fast"]
    assert [e[4][2] for e in k.log[1:]] == [2, 16, 17]


def test_fixed_varying_ints_are_passed_without_keying_and_must_be_plain(compiled_mode):
    """``fixed``: leading plain ints whose class the caller guarantees (``quant.pack_ids``' arguments) go into the
    launch as they are and do not take part in the class: the second call is bound whatever they hold."""
    k = FakeKernel(accept={5})
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 0], dict(BLOCK=8), ("x", "a_ptr", "N"), plain=("x",), fixed=1)
    b((3,), 1 << 62, ids[:3], 3)
    b((3,), (1 << 62) | 5, ids[:3], 3)
    assert [e[0] for e in k.log] == ["ordinary", "fast"]
    assert k.log[1][4][:3] == (ids.data_ptr(), 3, (1 << 62) | 5)  # in signature order: a_ptr, N, x
    with pytest.raises(ValueError):
        launch.Bound(k, [None, None, 0], dict(BLOCK=8), ("N", "x"), plain=("x",), fixed=1)


def test_runs_group_neighbouring_positions():
    assert launch._runs((11, 12, 13, 6, 7, 30)) == ((11, 0, 3), (6, 3, 2), (30, 5, 1))
    assert launch._runs(()) == ()


def test_bound_takes_the_list_without_constexprs_where_the_launcher_wants_it(compiled_mode):
    k = FakeKernel(accept={3})  # a Triton that does not pass constexprs to its launcher
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    for n in (2, 3, 5):
        b((n,), ids[:n], n)
    assert [e[0] for e in k.log] == ["ordinary", "fast", "fast"]  # one launch per call, the refused try none
    assert [e[4] for e in k.log[1:]] == [(ids.data_ptr(), 3, 2.0), (ids.data_ptr(), 5, 2.0)]


def test_bound_falls_back_to_ordinary_launches_when_the_launcher_refuses_both(compiled_mode):
    k = FakeKernel(accept={9})
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    before = launch.stats["ordinary"]
    for n in (2, 3, 5):
        b((n,), ids[:n], n)
    assert [e[0] for e in k.log] == ["ordinary"] * 3 and [e[3][1] for e in k.log] == [2, 3, 5]
    assert launch.stats["ordinary"] - before == 3


def test_bound_launches_ordinarily_under_a_launch_hook_or_the_interpreter(compiled_mode, monkeypatch):
    ids = torch.zeros(8, dtype=torch.int64)
    k = FakeKernel(accept={5})
    monkeypatch.setattr(launch, "_hooks_set", lambda: True)
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    for n in (2, 3):
        b((n,), ids[:n], n)
    assert [e[0] for e in k.log] == ["ordinary"] * 2
    monkeypatch.setattr(launch, "_hooks_set", lambda: False)
    for env in ("TRITON_INTERPRET", "TIERED_CACHE_ORDINARY_LAUNCHES"):  # the interpreter, or asked for
        monkeypatch.setenv(env, "1")
        k = FakeKernel(accept={5})
        b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
        for n in (2, 3):
            b((n,), ids[:n], n)
        assert [e[0] for e in k.log] == ["ordinary"] * 2
        monkeypatch.delenv(env)
    k = FakeKernel(accept={5})  # neither: bound from the second call of a class on
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    for n in (2, 2):
        b((n,), ids[:n], n)
    assert [e[0] for e in k.log] == ["ordinary", "fast"]


def test_bound_keeps_a_compiled_kernel_per_device(compiled_mode):
    """A kernel compiled (and loaded) on one device is never launched on another's stream: the current device
    is part of the key, so the first call of a class on device 1 compiles there, and later ones go to device 1's
    stream with its own kernel."""
    k = FakeKernel(accept={5})
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    b((2,), ids[:2], 2)
    b((3,), ids[:3], 3)
    compiled_mode[0] = 1
    b((4,), ids[:4], 4)
    b((5,), ids[:5], 5)
    compiled_mode[0] = 0
    b((6,), ids[:6], 6)
    assert [e[0] for e in k.log] == ["ordinary", "fast", "ordinary", "fast", "fast"]
    assert [e[3] for e in k.log if e[0] == "fast"] == [1234, 1235, 1234]  # each on its device's stream
    assert len(b._classes) == 2 and {key[0] for key in b._classes} == {0, 1}


def test_a_hook_set_after_binding_sees_every_launch(compiled_mode, monkeypatch):
    """The hooks are read at every call: bound launches stop while one is set (each call launches ordinarily,
    for the profiler to see) and resume when it is removed, with the kernel bound before."""
    hooked = [False]
    monkeypatch.setattr(launch, "_hooks_set", lambda: hooked[0])
    k = FakeKernel(accept={5})
    ids = torch.zeros(8, dtype=torch.int64)
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    for n, hook in ((2, False), (3, False), (4, True), (5, True), (6, False)):
        hooked[0] = hook
        b((n,), ids[:n], n)
    assert [(e[0], e[2]) for e in k.log] == [("ordinary", (2,)), ("fast", (3, 1, 1)), ("ordinary", (4,)),
                                             ("ordinary", (5,)), ("fast", (6, 1, 1))]
    k = FakeKernel(accept={5})  # a hook set at the first call: nothing bound then, bound once it is gone
    b = launch.Bound(k, [None, None, 2.0], dict(BLOCK=8), ("a_ptr", "N"))
    for n, hook in ((2, True), (3, False), (4, False)):
        hooked[0] = hook
        b((n,), ids[:n], n)
    assert [e[0] for e in k.log] == ["ordinary", "ordinary", "fast"]


def test_hooks_set_reads_tritons_hooks_now():
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps one hook, not a chain")

    def hook(*args):
        pass

    assert not launch._hooks_set()
    chain.add(hook)
    try:
        assert launch._hooks_set()
    finally:
        chain.remove(hook)
    assert not launch._hooks_set()


def test_launch_key_is_the_device_and_each_values_class():
    t = torch.zeros(4, dtype=torch.int64)
    plain = (False, False, True)
    vals, key = launch.launch_key(3, (t, 17, 5), plain)
    assert vals == [t.data_ptr(), 17, 5]
    assert key == (3, launch._spec_class(t), launch._spec_class(17), launch._spec_class(5, plain=True))
    assert launch.launch_key(4, (t, 17, 5), plain)[1] != key  # another device
    for mark in (1, 16, 2**31 - 1):  # a plain int: its range only
        assert launch.launch_key(3, (t, 17, mark), plain)[1] == key
    assert launch.launch_key(3, (t, 17, 2**40), plain)[1] != key
    spec = (False, False, False)  # specialized: 5 and 6 share a class, 1 and 16 each have their own
    assert launch.launch_key(3, (t, 17, 5), spec)[1] == launch.launch_key(3, (t, 17, 6), spec)[1]
    assert len({launch.launch_key(3, (t, 17, v), spec)[1] for v in (5, 1, 16)}) == 3
    assert launch.launch_key(3, (t[1:], 17, 5), plain)[1] != key  # a pointer off 16-byte alignment


def test_spec_class_separates_what_triton_specializes_on():
    classes = {launch._spec_class(v) for v in (1, 2, 3, 16, 32, 2**31, 2**40, 2**63)}
    assert launch._spec_class(2) == launch._spec_class(3) and launch._spec_class(16) == launch._spec_class(32)
    assert len(classes) == 5  # {1}, {2, 3}, {16, 32}, {2**31, 2**40} (int64 multiples of 16), {2**63} (uint64)
    t = torch.zeros(4, dtype=torch.int64)
    assert launch._spec_class(t) != launch._spec_class(t[1:]) and launch._spec_class(t) == launch._spec_class(t[2:])


def test_id_ring_reuses_a_landed_entry_and_grows_past_one_in_flight():
    ring = launch.IdRing(torch.device("cpu"), width=8)
    a, b = ring.send(np.array([3, 1, 2]), np.array([7, 5, 6]))
    assert a.tolist() == [3, 1, 2] and b.tolist() == [7, 5, 6] and b.data_ptr() % 16 == 0
    ring.done()
    pending = ring._ring[0]
    pending.event = SimpleNamespace(query=lambda: False, record=lambda: None)  # its kernels still run
    c, d = ring.send(np.array([4]), np.array([9]))
    ring.done()
    assert len(ring._ring) == 2 and c.tolist() == [4] and d.tolist() == [9]
    assert a.tolist() == [3, 1, 2] and b.tolist() == [7, 5, 6]  # the entry in flight kept its ids
    pending.event = SimpleNamespace(query=lambda: True, record=lambda: None)
    ring.send(np.array([0, 0]), np.array([1, 1]))
    ring.done()
    assert len(ring._ring) == 2  # landed: reused


# ------------------------------------------------------------------- plans, through the real kernels
def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as integers: NaNs (the poison) compare equal, and every byte counts."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _plans_case(poison, device, dtype, value_axis, backend):
    L, R, S, H, dv, dk = 2, 17, 18, 2, 16, 32
    g = torch.Generator().manual_seed(5)
    shape = (R, L, H, dv, dk) if value_axis == 1 else (R, L, H, dk, dv)
    src = torch.randn(shape, generator=g).to(dtype).transpose(0, 1).to(device)
    conv = torch.randn(R, L, 12, 3, generator=g).to(torch.bfloat16).transpose(0, 1).to(device)
    q, s = poison((L, S, H, dv, dk), torch.int8, device), poison((L, S, H, 1, dk), dtype, device)
    conv_t1 = poison((L, S, 12, 3), torch.bfloat16, device)
    fin = torch.ones(S, dtype=torch.uint8, device=device)
    state = quant.validate_quantize_store(src, torch.zeros(0, dtype=torch.int64, device=device), q, s,
                                          torch.zeros(0, dtype=torch.int64, device=device), value_axis, finite=fin)
    store = quant.StorePlan(src, state, q, s, value_axis, backend, fin, conv=(conv, conv_t1))
    dst, conv_dst = poison.like(src), poison.like(conv)
    dstate = quant.validate_dequantize_load(q, s, torch.zeros(0, dtype=torch.int64, device=device), dst,
                                            torch.zeros(0, dtype=torch.int64, device=device), value_axis)
    load = quant.LoadPlan(q, s, dst, dstate, value_axis, backend, conv=(conv_t1, conv_dst))
    copy = quant.CopyPlan(conv, conv_dst, backend, None)
    return src, conv, q, s, conv_t1, fin, store, dst, conv_dst, load, copy


def _ids_call(plan, packed: bool, a: torch.Tensor, b: torch.Tensor, *mark: int) -> None:
    """``plan`` on ids ``a -> b``: as device tensors, or (``packed``) as ``pack_ids``' kernel arguments."""
    if packed:
        ids = quant.pack_ids(a.tolist(), b.tolist())
        assert ids is not None and len(ids) == quant.PACKED
        plan.packed(ids, a.numel(), *mark)
    else:
        plan(a, b, *mark)


def check_plans_serve_every_call(poison, device, dtype, value_axis, backend, packed=False):
    """One set of plans, calls of 1, 3, 2, 9, 16 and 3 states (new ids each; 3 and 9 leave packed arguments unused;
    the second 3 repeats a launch class, so it takes the bound path on a GPU), each against the twins, the ids as
    device tensors or (``packed``) as kernel arguments."""
    src, conv, q, s, conv_t1, fin, store, dst, conv_dst, load, copy = _plans_case(poison, device, dtype,
                                                                                 value_axis, backend)
    g = torch.Generator().manual_seed(6)
    for n in (1, 3, 2, 9, 16, 3):
        rows = torch.randint(src.shape[1], (n,), generator=g).to(device)  # a store may read a row twice
        slots = (torch.randperm(q.shape[1] - 1, generator=g)[:n] + 1).to(device)
        q_ref, s_ref, c_ref = q.clone(), s.clone(), conv_t1.clone()
        _ids_call(store, packed, rows, slots, 0)
        quantize_store_reference(src, rows, q_ref, s_ref, slots, value_axis)
        copy_rows_reference(conv, rows, c_ref, slots)
        # every byte, the poison of the slots not written included
        assert torch.equal(q, q_ref) and torch.equal(bits(s), bits(s_ref)) and torch.equal(bits(conv_t1), bits(c_ref))
        assert bool(fin.all())
        back = torch.randperm(src.shape[1], generator=g)[:n].to(device)  # distinct destinations
        dst.copy_(poison.like(dst))
        conv_dst.copy_(poison.like(conv_dst))
        _ids_call(load, packed, slots, back)
        want, want_conv = poison.like(dst), poison.like(conv_dst)
        dequantize_load_reference(q_ref, s_ref, slots, want, back, value_axis)
        copy_rows_reference(c_ref, slots, want_conv, back)
        assert torch.equal(bits(dst), bits(want)) and torch.equal(bits(conv_dst), bits(want_conv))
        conv_dst.copy_(poison.like(conv_dst))
        _ids_call(copy, packed, rows, back, 0)
        want_conv = poison.like(conv_dst)
        copy_rows_reference(conv, rows, want_conv, back)
        assert torch.equal(bits(conv_dst), bits(want_conv))


@pytest.mark.parametrize("packed", [False, True], ids=["id_tensors", "packed"])
@pytest.mark.parametrize("value_axis", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plans_serve_calls_of_every_size(poison, dtype, value_axis, packed):
    check_plans_serve_every_call(poison, "cpu", dtype, value_axis, "triton", packed)


def test_plans_packed_on_the_torch_twins(poison):
    """A plan on the torch backend takes packed arguments too (unpacked to tensors): the same bytes."""
    check_plans_serve_every_call(poison, "cpu", torch.float32, 2, "torch", packed=True)


def test_pack_ids_packs_pairs_above_the_marker_and_refuses_what_does_not_fit():
    ids = quant.pack_ids([0, 5, 2**31 - 1], [7, 0, 3])
    assert ids is not None and len(ids) == quant.PACKED
    assert all(p >= 1 << 62 for p in ids)  # one 64-bit class for every value: one compiled kernel per count
    a, b = quant._unpack(ids, 3, torch.device("cpu"))
    assert a.tolist() == [0, 5, 2**31 - 1] and b.tolist() == [7, 0, 3]
    assert quant.pack_ids([], []) == (1 << 62,) * quant.PACKED
    assert quant.pack_ids(list(range(17)), list(range(17))) is None  # more than PACKED
    assert quant.pack_ids([2**31], [1]) is None and quant.pack_ids([1], [2**31]) is None  # past 31 bits


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["id_tensors", "packed"])
@pytest.mark.parametrize("value_axis", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_plans_take_the_bound_path(poison, dtype, value_axis, packed):
    before = launch.stats["fast"]
    check_plans_serve_every_call(poison, "cuda", dtype, value_axis, "triton", packed)
    torch.cuda.synchronize()
    assert launch.stats["fast"] > before  # calls after the first of a class went through the bound launcher


def test_id_ring_never_records_a_lent_event_again(monkeypatch):
    """A store lends its entry's event to its flags (``done(lend=True)``): when the entry is reused it records a
    fresh one, so the lent event fires after that store's launches and is not re-recorded behind newer ones."""
    from tiered_cache import device as dev

    class CountingEvent:
        def __init__(self) -> None:
            self.records = 0

        def record(self, stream: object = None) -> None:
            self.records += 1

        def query(self) -> bool:
            return True

    monkeypatch.setattr(dev, "new_event", lambda device: CountingEvent())
    ring = launch.IdRing(torch.device("cpu"), width=4)
    ring.send(np.array([1]), np.array([2]))
    lent = ring.done(lend=True)
    ring.send(np.array([3]), np.array([4]))  # the same entry (its event fired)
    kept = ring.done()
    assert len(ring._ring) == 1 and kept is not lent and lent.records == 1 and kept.records == 1
    ring.send(np.array([5]), np.array([6]))
    assert ring.done() is kept and kept.records == 2  # not lent: the entry records its own event again
