"""Train the recall models (``recall.MODELS``) on the recall task and commit what they reached.

    python -m tiered_cache.accuracy.train --model qwen3_next_recall --steps 3000 --out DIR

Seeded throughout: the model's init (``--seed``), every training batch (``task.sample`` with seed
``seed * 1_000_003 + step``) and the held-out set (seed ``HELDOUT_SEED``, never trained on). AdamW,
linear warm-up then cosine decay, gradient clipping at 1, a curriculum (``--curriculum``: the share of
the steps over which pairs and gap grow from 4 and the window to the task's); the loss is the cross-entropy of the value
at each query key (nothing else is scored). ``--time-limit`` plans the steps from the first
``TIMING_STEPS`` steps' time so the schedule ends inside it (the steps planned and done are recorded;
``--steps`` that number reruns the same batches), so one short GPU run cannot overrun its budget.
Writes ``<model>.safetensors`` and ``<model>.json`` (model keywords, task, training config, seed,
steps, held-out accuracy with its Wilson interval) into ``--out``, and logs loss and accuracy every
``--log-every`` steps.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from tiered_cache.accuracy import recall

HELDOUT_SEED = 999_983
HELDOUT_N = 1024
TIMING_STEPS = 20  # steps timed before a time limit fixes the planned steps


def train(name: str, steps: int, batch: int, lr: float, seed: int, time_limit: float, log_every: int,
          device: str, out: str, task: recall.RecallTask = recall.TASK, heldout_n: int = HELDOUT_N,
          init: str | None = None, curriculum: float = 0.4, save_every: int = 0) -> dict:
    """``init``: a folder of weights to continue from (its JSON is kept as ``previous``); ``save_every``:
    also evaluate and save every that many steps (a run stopped from outside keeps its last save)."""
    torch.manual_seed(seed)
    if init is None:
        model, previous = recall.build(name, seed=seed, task=task).to(device).train(), None
    else:
        model, previous = recall.load(name, device=device, root=init).train(), recall.meta_of(name, init)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
    plan = dict(steps=steps, warm=max(1, steps // 20))  # shortened once the step time is known (time_limit)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / plan["warm"]) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / plan["steps"]))))
    held_ids, held_ans = task.sample(heldout_n, HELDOUT_SEED)
    t0, done, curve = time.perf_counter(), 0, []
    for step in range(steps):
        if step == TIMING_STEPS and math.isfinite(time_limit):
            # The schedule must end when training does: plan the steps that fit the rest of the time limit
            rate = (time.perf_counter() - t0) / step
            plan["steps"] = max(step, min(steps, step + int((time_limit - (time.perf_counter() - t0)) / rate)))
            plan["warm"] = min(plan["warm"], max(1, plan["steps"] // 20))
            print(f"{name}: {rate * 1e3:.1f} ms/step, planned {plan['steps']} steps", flush=True)
        if step >= plan["steps"] or time.perf_counter() - t0 > time_limit:
            break
        # Curriculum: pairs from 4 and the gap from the window up to the task's, linearly over the first
        # CURRICULUM of the planned steps (a circuit forms on short recalls, then learns to hold them)
        # (the first TIMING_STEPS run at full size, so the planned steps are timed at the slowest)
        f = 1.0 if step < TIMING_STEPS or not curriculum else min(1.0, step / (curriculum * plan["steps"]))
        pairs = round(min(4, task.pairs) + f * (task.pairs - min(4, task.pairs)))
        gap = round(task.window + f * (task.gap - task.window))
        ids, ans = task.sample(batch, seed * 1_000_003 + step, pairs=pairs, gap=gap)
        q0 = 1 + pairs + gap
        logits = model(input_ids=ids.to(device)).logits[:, q0:q0 + 2 * pairs:2]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ans.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        if done % log_every == 0 or done == plan["steps"]:
            acc = (logits.argmax(-1) == ans.to(device)).float().mean().item()
            el = time.perf_counter() - t0
            curve.append(dict(step=done, pairs=pairs, gap=gap, loss=round(loss.item(), 4), batch_acc=round(acc, 4),
                              s=round(el, 1)))
            print(f"{name} step {done} pairs {pairs} gap {gap} loss {loss.item():.4f} batch acc {acc:.4f} {el:.1f}s",
                  flush=True)
        if save_every and done % save_every == 0:
            _finish(model, name, task, held_ids, held_ans, seed, curve, plan, done, t0, time_limit, batch,
                    lr, device, curriculum, previous, out)
            model.train()
    return _finish(model, name, task, held_ids, held_ans, seed, curve, plan, done, t0, time_limit, batch, lr, device,
                   curriculum, previous, out)


def _finish(model, name, task, held_ids, held_ans, seed, curve, plan, done, t0, time_limit, batch, lr, device,
            curriculum, previous, out) -> dict:
    """Evaluate on the held-out set and save the weights with what they reached."""
    train_s = time.perf_counter() - t0
    model.eval()
    correct, n = recall.recall_accuracy(model, task, held_ids, held_ans)
    lo, hi = recall.wilson(correct, n)
    result = dict(heldout_accuracy=correct / n, heldout_correct=correct, heldout_n=n, wilson95=[lo, hi],
                  chance=task.chance)
    print(f"{name}: held-out accuracy {correct}/{n} = {correct / n:.4f} [{lo:.4f}, {hi:.4f}]", flush=True)
    meta = dict(task=recall.task_dict(task), seed=seed, result=result, curve=curve, train=dict(
        steps=plan["steps"], steps_done=done, time_limit_s=time_limit if math.isfinite(time_limit) else None,
        batch=batch, lr=lr, optimizer="AdamW(0.9, 0.98), wd 0.1, clip 1",
        schedule=f"linear warm-up {plan['warm']} steps, cosine to 0", curriculum=curriculum, heldout_seed=HELDOUT_SEED,
        train_s=round(train_s, 1),
        device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", torch=torch.__version__,
        transformers=__import__("transformers").__version__))
    if previous is not None:
        meta["previous"] = previous
    recall.save(model, name, meta, root=out)
    return meta


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(recall.MODELS), required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=float("inf"), help="seconds; stop training after them")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=recall.WEIGHTS_DIR)
    p.add_argument("--pairs", type=int, default=recall.TASK.pairs, help="a smaller task, for trying the curve")
    p.add_argument("--gap", type=int, default=recall.TASK.gap)
    p.add_argument("--curriculum", type=float, default=0.4)
    p.add_argument("--init", default=None, help="a folder of weights to continue training from")
    p.add_argument("--save-every", type=int, default=0)
    a = p.parse_args(argv)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    task = recall.RecallTask(pairs=a.pairs, gap=a.gap)
    train(a.model, a.steps, a.batch, a.lr, a.seed, a.time_limit, a.log_every, a.device, a.out, task,
          init=a.init, curriculum=a.curriculum, save_every=a.save_every)


if __name__ == "__main__":
    main()
