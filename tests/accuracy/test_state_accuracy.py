"""State accuracy on trained models (issue 24): what the tiers' int8 checkpoints cost a model that remembers.

The models (``tiered_cache.accuracy.recall``: a gated delta-net hybrid and a Bamba hybrid, trained on
multi-query associative recall with the attention layers windowed away from the pairs, weights in the
repository) answer each query only from their recurrent state. Per model, through the reference engine:

- recall accuracy with the states resumed from T2 int8 (T1 and T0 evicted first) over ``N`` sequences
  (``N * pairs >= 1,000`` answers), with its Wilson interval, within 0.5 points of the exact states'
  (the no-cache run: a full forward per sequence); top-1 agreement with the no-cache run >= 99.5 %; the
  logit drift;
- T1 and T3 (a fresh engine over the file store the first one wrote through to) hand the model the
  same int8 bytes: on a subset their answer logits equal T2's bit for bit (same requests, so the decode
  batches match), and lossless (fp32) states equal the no-cache run's to 1e-4;
- zeroed states: accuracy at chance (inside the 99 % Wilson interval of it);
- a chain of one turn per query (>= 10 turns), each resuming from a state cached by the turn before,
  which itself came from an int8 copy: at turn ``t`` the drift stays within ``t + 1`` roundings' worth,
  one rounding's worth being the most that one int8 resume of the exact state moved an answer at any
  turn (measured beside it); a flipped answer is a near-tie (top-2 margin under twice the drift).

Numbers: README "State accuracy" (``benchmarks/bench_accuracy.py`` writes the codec table).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tiered_cache.accuracy import measure, recall  # noqa: E402

MODELS = sorted(recall.MODELS)
# sequences: scored through T2 (1,008 answers); through T1 / T3 / lossless; zeroed; chains
N, SUBSET, ZEROED, CHAIN = 84, 4, 24, 4
SEED = 20_241  # evaluation sequences (the training batches and held-out set use other seeds)
pytestmark = pytest.mark.usefixtures("one_thread")

_runs: dict[tuple[str, str], dict] = {}


def runs(name: str, device: str = "cpu", tmp=None) -> dict:
    """Every measurement of model ``name``, once per module (the tests below assert on parts of it)."""
    if (name, device) in _runs:
        return _runs[name, device]
    model = recall.load(name, device=device)
    task = recall.task_of(name)
    ids, answers = task.sample(N, SEED)
    ref = measure.exact_logits(model, task, ids, answers)
    r = dict(task=task, ref=ref, answers=answers)
    r["T2"] = measure.engine_recall(model, task, ids, answers, via="T2")
    sub, sub_ans = ids[:SUBSET], answers[:SUBSET]
    r["T2_subset"] = measure.engine_recall(model, task, sub, sub_ans, via="T2", check=True)
    r["T1"] = measure.engine_recall(model, task, sub, sub_ans, via="T1", check=True)
    r["T3"] = measure.engine_recall(model, task, sub, sub_ans, via="T3", storage_url=f"file://{tmp}/store")
    r["lossless"] = measure.engine_recall(model, task, sub, sub_ans, via="T2", codec="lossless", check=True)
    r["zeroed"] = measure.engine_recall(model, task, ids[:ZEROED], answers[:ZEROED], via="T2", codec="lossless",
                                        zeroed=True)
    chain, resumed = measure.engine_chain(model, task, ids[:CHAIN], answers[:CHAIN])
    chain_ref = measure.Scored(ref.logits[:CHAIN], answers[:CHAIN])
    r["chain"], r["resumed"], r["chain_ref"] = chain, resumed, chain_ref
    r["one_rounding"] = measure.one_rounding_drift(model, task, ids[:CHAIN], resumed, chain_ref)
    _runs[name, device] = r
    return r


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("t3")


def _subset(s: measure.Scored, n: int) -> measure.Scored:
    return measure.Scored(s.logits[:n], s.answers[:n])


def check_t2(r: dict, name: str) -> None:
    ref, got = r["ref"], r["T2"]
    print(f"{name}: exact {ref.summary()}\n  int8 via T2 {got.summary(ref)}")
    assert got.n >= 1000 and set(got.tiers) == {"T2"}, set(got.tiers)
    assert got.stats["hits"]["T2_states"] >= N
    assert abs(got.accuracy - ref.accuracy) <= 0.005, (got.accuracy, ref.accuracy)
    assert got.agreement(ref) >= 0.995
    assert 0 < got.drift(ref)  # 0 would mean no int8 state was used


@pytest.mark.parametrize("name", MODELS)
def test_int8_through_t2_recalls_as_the_exact_state(name, store):
    check_t2(runs(name, tmp=store), name)


@pytest.mark.parametrize("name", MODELS)
def test_t1_and_t3_hand_the_model_the_same_bytes_and_lossless_is_exact(name, store):
    r = runs(name, tmp=store)
    t2 = r["T2_subset"]  # the same requests batched alike (the full run batches others beside them)
    assert set(r["T1"].tiers) == {"T1"} and set(r["T3"].tiers) == {"T2"}  # T3 lands in T2, loads from there
    t3 = r["T3"].stats["T3"]
    assert t3["hits"] >= SUBSET, t3
    assert torch.equal(r["T1"].logits, t2.logits) and torch.equal(r["T3"].logits, t2.logits)
    lossless = r["lossless"]
    assert lossless.drift(_subset(r["ref"], SUBSET)) < 1e-4 and lossless.correct == _subset(r["ref"], SUBSET).correct


@pytest.mark.parametrize("name", MODELS)
def test_zeroed_states_fall_to_chance(name, store):
    r = runs(name, tmp=store)
    z, task = r["zeroed"], r["task"]
    lo, hi = recall.wilson(z.correct, z.n, z=2.576)
    print(f"{name}: zeroed {z.summary()} chance {task.chance:.4f}")
    assert lo <= task.chance <= hi, (z.accuracy, (lo, hi), task.chance)
    assert recall.wilson(r["ref"].correct, r["ref"].n)[0] > task.chance  # with its state the model beats chance


@pytest.mark.parametrize("name", MODELS)
def test_chain_drift_is_one_rounding_per_turn(name, store):
    r = runs(name, tmp=store)
    chain, ref, one, resumed = r["chain"], r["chain_ref"], r["one_rounding"], r["resumed"]
    task = r["task"]
    assert task.pairs >= 10
    q0 = task.query_start
    turns = torch.arange(task.pairs)
    assert torch.equal(resumed, (q0 + 2 * turns - 2).clamp(min=q0).expand_as(resumed)), resumed
    assert chain.stats["hits"]["T2_states"] >= CHAIN * task.pairs
    drift = (chain.logits - ref.logits).abs().amax(-1)  # [chains, turns]
    rounding = one.max()  # one rounding's worth: the most one int8 resume moved an answer, at any turn
    ratio = (drift / ((turns + 1) * rounding)).amax(0)
    print(f"{name}: chain {chain.summary(ref)}; drift per turn (max over chains) "
          f"{[round(x, 4) for x in drift.amax(0).tolist()]}; one rounding {rounding:.4f}; "
          f"drift / (turns x one rounding) {[round(x, 3) for x in ratio.tolist()]}")
    assert (drift > 0).all() and rounding > 0
    assert (ratio <= 1).all()  # at turn t, within t + 1 roundings' worth
    top2 = ref.logits.topk(2, -1).values
    flipped = chain.logits.argmax(-1) != ref.logits.argmax(-1)
    assert ((top2[..., 0] - top2[..., 1])[flipped] < 2 * drift[flipped]).all()  # a flip is a near-tie


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_int8_through_t2_on_cuda(name, tmp_path):
    """The same on the GPU: the Triton store and load kernels instead of their torch twins."""
    check_t2(runs(name, device="cuda", tmp=tmp_path), name)


def test_the_window_hides_the_pairs_from_attention():
    """What makes the answer the state's alone: each attention layer sees the last ``window`` tokens,
    as an explicit softmax over them computes (prefill and a decode token), so from a query, with
    ``gap >= window``, no pair is in reach."""
    import types

    torch.manual_seed(0)
    w, t = 8, 20
    mod = types.SimpleNamespace(config=types.SimpleNamespace(recall_window=w), num_key_value_groups=2, is_causal=True)
    q, k, v = torch.randn(1, 4, t, 16), torch.randn(1, 2, t, 16), torch.randn(1, 2, t, 16)
    out, _ = recall.window_sdpa(mod, q, k, v, None, scaling=0.25)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(t):
        lo = max(0, i - w + 1)
        want = torch.softmax(q[:, :, i:i + 1] @ kk[:, :, lo:i + 1].transpose(-1, -2) * 0.25, -1) @ vv[:, :, lo:i + 1]
        assert torch.allclose(out[:, i], want[:, :, 0], atol=1e-5), i
    last, _ = recall.window_sdpa(mod, q[:, :, -1:], k, v, torch.ones(1, 1, 1, t, dtype=torch.bool), scaling=0.25)
    assert torch.allclose(last[:, 0], out[:, -1], atol=1e-5)
    assert recall.TASK.gap >= recall.TASK.window
