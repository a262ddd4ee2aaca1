"""A seeded multi-turn conversation workload and the closed loop that drives an engine with it.

``clients`` conversations of ``rounds`` turns. Turn 0's prompt is a system prompt and a question of
``question_len`` tokens; turn ``r + 1``'s prompt is turn ``r``'s prompt, its answer (what the engine
generated) and a new question. With ``shared_system`` every client starts with the same system
prompt (a prefix shared across conversations: branch points in the tree); else each has its own::

    turn 0: | system | q0 |
    turn 1: | system | q0 | a0 | q1 |            a0 = the engine's answer to turn 0
    turn 2: | system | q0 | a0 | q1 | a1 | q2 |

Closed loop: every client sends turn 0 at once; a client sends its next turn when its previous one
finishes, so prompts depend on the engine's own output (two engines see the same prompts exactly
when they generate the same tokens, or when ``forced`` feeds them a reference run's answers).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from tiered_cache.engine.request import Request, Status
from tiered_cache.errors import InvalidArgumentError


@dataclass(frozen=True)
class WorkloadConfig:
    clients: int = 8
    rounds: int = 4
    question_len: int = 32
    system_len: int = 64
    shared_system: bool = True
    max_new_tokens: int = 32
    seed: int = 0
    vocab: tuple[int, int] = (3, 256)  # token ids drawn from [lo, hi) (ids below 3 are special)

    def __post_init__(self) -> None:
        for name in ("clients", "rounds", "question_len", "max_new_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(name, "an int >= 1", v)
        if not isinstance(self.system_len, int) or self.system_len < 0:
            raise InvalidArgumentError("system_len", "an int >= 0", self.system_len)
        lo, hi = self.vocab
        if not 0 <= lo < hi:
            raise InvalidArgumentError("vocab", "(lo, hi) with 0 <= lo < hi", self.vocab)


@dataclass
class Conversation:
    cid: int
    system: list[int]
    questions: list[list[int]]


def make_conversations(cfg: WorkloadConfig) -> list[Conversation]:
    """The workload's fixed parts (system prompts, questions), the same for the same ``cfg``."""
    g = torch.Generator().manual_seed(cfg.seed)
    lo, hi = cfg.vocab

    def draw(n: int) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    shared = draw(cfg.system_len)
    return [Conversation(c, shared if cfg.shared_system else draw(cfg.system_len),
                         [draw(cfg.question_len) for _ in range(cfg.rounds)]) for c in range(cfg.clients)]


@dataclass
class Turn:
    """One finished turn: what the engine produced for client ``client``'s round ``round``."""

    client: int
    round: int
    prompt: list[int]
    output: list[int]
    argmax: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    attempts: int = 1


def run_workload(engine, cfg: WorkloadConfig, *, progress: Optional[Callable[[Turn], None]] = None,
                 forced: Optional[dict[tuple[int, int], list[int]]] = None, record_logits: bool = False,
                 abort_prob: float = 0.0, abort_seed: int = 0, on_step: Optional[Callable[[], None]] = None,
                 max_steps: int = 10_000_000) -> list[Turn]:
    """Drive ``engine`` with the workload until every turn of every client has finished.

    ``forced``: ``(client, round) -> answer`` to feed instead of the argmax (teacher forcing).
    ``abort_prob``: after each step, each request still in prefill with some of its prompt computed is
    aborted with this probability (seeded) and its client sends the same turn again: aborts land in
    the middle of prefills. ``on_step``: called after every step (tests check invariants there).
    Returns the turns in (client, round) order.
    """
    if not 0.0 <= abort_prob < 1.0:
        raise InvalidArgumentError("abort_prob", "a probability in [0, 1)", abort_prob)
    convs = make_conversations(cfg)
    rng = random.Random(abort_seed)
    history = {c.cid: list(c.system) for c in convs}
    attempts: dict[tuple[int, int], int] = {}
    live: dict[str, tuple[int, int, list[int]]] = {}
    turns: dict[tuple[int, int], Turn] = {}

    def send(cid: int, rnd: int, prompt: list[int]) -> None:
        k = attempts[(cid, rnd)] = attempts.get((cid, rnd), 0) + 1
        rid = f"c{cid}r{rnd}" + (f"a{k}" if k > 1 else "")
        live[rid] = (cid, rnd, prompt)
        engine.submit(Request(rid=rid, prompt=prompt, max_new_tokens=cfg.max_new_tokens,
                              forced_output=None if forced is None else forced[(cid, rnd)],
                              record_logits=record_logits))

    for c in convs:
        send(c.cid, 0, history[c.cid] + c.questions[0])
    steps = 0
    while engine.has_work():
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"workload did not finish in {max_steps} steps")
        for req in engine.step():
            cid, rnd, prompt = live.pop(req.rid)
            t = Turn(cid, rnd, prompt, list(req.output), list(req.argmax), list(req.logits), req.summary(),
                     attempts[(cid, rnd)])
            turns[(cid, rnd)] = t
            if progress is not None:
                progress(t)
            history[cid] = prompt + req.output
            if rnd + 1 < cfg.rounds:
                send(cid, rnd + 1, history[cid] + convs[cid].questions[rnd + 1])
        if abort_prob:
            for req in list(engine.running):
                if req.status is Status.PREFILL and req.filled > req.reused_tokens and rng.random() < abort_prob:
                    engine.abort(req.rid)
                    cid, rnd, prompt = live.pop(req.rid)
                    send(cid, rnd, prompt)
        if on_step is not None:
            on_step()
    return [turns[k] for k in sorted(turns)]
