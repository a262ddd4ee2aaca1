"""The state codecs measured on the trained recall models (issue 24): bytes per state and what each costs
the model's answers.

    python benchmarks/bench_accuracy.py [--sequences 256]

Per model (``tiered_cache.accuracy.recall.MODELS``, weights from the repository) and codec
(``tiered_cache.accuracy.codecs.CODECS``: T1's int8 per (head, k-channel), int8 per 32 values, fp8 e4m3
with int8's scale layout, bf16, and fp32 as it is), on ``--sequences`` held-out recall sequences
(seed ``SEED``, neither trained on nor the tests'), teacher-forced:

- one resume: the state at the end of the prefix (pairs and gap) through the codec, then every query;
- chain: the state through the codec again before every query (a turn each), each rounding applied to
  what the last one produced, as a conversation resumed from quantized states turn after turn.

Scored against the no-cache run of the same sequences, measured in the same process: recall accuracy
(with its Wilson 95 % interval), top-1 agreement at the answers, the largest logit drift. Bytes per
state: the recurrent states of all layers as the codec stores them (payload and scales, scales in the
state's dtype as T1 keeps them), and with the conv windows (kept in the model's dtype by every codec).
The codecs are the torch twins; ``int8`` is bit-exact with the T1 kernels (``kernels/_ref_quant.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_results  # noqa: E402
from tiered_cache.accuracy import codecs, measure, recall  # noqa: E402
from tiered_cache.engine.model_specs import spec_for  # noqa: E402

SEED = 31_337


def state_bytes(model, codec: codecs.Codec) -> tuple[int, int]:
    """(recurrent state bytes as ``codec`` stores them, plus the conv windows) of one cached state."""
    spec = spec_for(model).state
    h, a, b = spec.temporal_shape
    d_v, d_k = (a, b) if spec.value_axis == 1 else (b, a)
    temporal = codec.state_bytes((spec.num_layers, h, d_v, d_k), spec.temporal_dtype)
    isz = torch.empty((), dtype=spec.conv_dtype).element_size()
    conv = sum(spec.num_layers * int(torch.tensor(s).prod()) * isz for s in spec.conv_shapes)
    return temporal, temporal + conv


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    rows, metrics = [], {}
    for name in sorted(recall.MODELS):
        model, task = recall.load(name), recall.task_of(name)
        ids, answers = task.sample(a.sequences, SEED)
        ref = measure.exact_logits(model, task, ids, answers)
        fp32 = state_bytes(model, codecs.CODECS["fp32"])[0]
        lo, hi = recall.wilson(ref.correct, ref.n)
        print(f"{name}: no cache {ref.correct}/{ref.n} = {ref.accuracy:.4f} [{lo:.4f}, {hi:.4f}], "
              f"chance {task.chance:.4f}", flush=True)
        metrics[f"{name}.no_cache_accuracy"] = ref.accuracy
        for cname, codec in codecs.CODECS.items():
            once = measure.direct_recall(model, task, ids, answers, cname)
            chain = measure.direct_recall(model, task, ids, answers, cname, chain=True)
            tb, total = state_bytes(model, codec)
            o, c = once.summary(ref), chain.summary(ref)
            row = dict(model=name, codec=cname, state_bytes=tb, with_conv=total, vs_fp32=round(fp32 / tb, 3),
                       accuracy=round(o["accuracy"], 4), wilson95=f"[{o['wilson95'][0]:.4f}, {o['wilson95'][1]:.4f}]",
                       top1=round(o["top1_agreement"], 4), drift=round(o["max_logit_drift"], 4),
                       chain_accuracy=round(c["accuracy"], 4), chain_top1=round(c["top1_agreement"], 4),
                       chain_drift=round(c["max_logit_drift"], 4), answers=o["n"])
            rows.append(row)
            print(row, flush=True)
            for k in ("accuracy", "top1", "chain_top1"):
                metrics[f"{name}.{cname}.{k}"] = float(row[k])  # type: ignore[arg-type]
    path = write_results("accuracy", metrics, rows=rows, out_dir=a.out, notes=(
        "Recall accuracy of the trained models with their recurrent states through each codec twin, "
        "teacher-forced, against the no-cache run of the same sequences (measured in the same run); "
        "`chain`: the state re-encoded before every query. Bytes: one cached state, all layers."),
        info=dict(sequences=a.sequences, seed=SEED))
    print(path)


if __name__ == "__main__":
    main()
