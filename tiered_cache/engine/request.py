"""A request of the reference engine: its tokens, where its KV and state live, and its timings.

A request carries the fields the prefix cache reads (SGLang's ``Req`` plus its ``req_to_token_pool``
row, as ``radix.params.CacheReq`` lists them), so it can be passed to ``match_prefix(cow_mamba=True)``
and ``init_load_back`` as is. Its token positions, and which part of ``kv_indices`` is whose::

    0                cache_protected_len         filled          len(tokens)       reserved
    |-- the tree's ids --|---- the request's KV, written ----|-- not yet run --|-- room for decode --|
                      ^ last_node (locked)   ^ slot_pos: the T0 state slot holds the state after these

``tokens`` is the prompt followed by the tokens fed back so far; the last sampled token is in
``output`` but not yet in the KV (``filled == len(prompt) + len(output) - 1`` while decoding).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError


class Status(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted (no match, no slots yet)
    LOADING = "loading"  # admitted: prefix matched and locked, KV reserved; its host load in flight
    PREFILL = "prefill"  # admitted, prefix on the device: chunks running
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One generation request. ``prompt``: token ids; ``max_new_tokens``: how many to generate.

    ``forced_output``: feed these tokens back instead of the model's argmax (teacher forcing), so two
    engines that round differently still see the same sequence and their logits can be compared
    position by position; ``argmax`` keeps what the model would have picked. ``record_logits``: keep
    the last-position logits of every generated token (fp32, on the CPU).
    """

    rid: Any
    prompt: list[int]
    max_new_tokens: int
    extra_key: Optional[str] = None
    forced_output: Optional[list[int]] = None
    record_logits: bool = False

    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    argmax: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    # --- what the prefix cache reads and writes (CacheReq's fields)
    kv_indices: Optional[torch.Tensor] = None
    mamba_pool_idx: Optional[torch.Tensor] = None
    swa_kv_indices: Optional[torch.Tensor] = None  # SWA models: T0 SWA KV ids beside kv_indices
    last_node: Any = None
    cache_protected_len: int = 0
    prefix_indices: Optional[torch.Tensor] = None
    load_back: Any = None  # the host tier's load handle (set by init_load_back)
    # --- engine bookkeeping
    filled: int = 0  # positions whose KV is written (in the model cache and the pool)
    slot_pos: int = 0  # the T0 state slot holds the state after this many tokens
    branching: Optional[int] = None  # match's mamba_branching_seqlen: export a state there
    model_cache: Any = None  # the transformers cache the request runs on (dropped when it ends)
    # field name -> (the device tensor, its copy on the host): ``on_host`` refreshes an entry when the
    # field is replaced
    host_copies: dict = field(default_factory=dict)
    # --- stats
    reused_tokens: int = 0  # prompt tokens taken from the cache (not computed)
    reused_host_tokens: int = 0  # of those, loaded back from T2
    # where the resume point came from: "T1"/"T2" (a state), "T0_swa"/"T2_swa" (an SWA window), or "miss"
    state_tier: str = "miss"
    computed_tokens: int = 0  # prompt tokens run through the model
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admitted: Optional[float] = None
    t_first_token: Optional[float] = None
    t_finish: Optional[float] = None

    def __post_init__(self) -> None:
        self.prompt = [int(t) for t in self.prompt]
        if not self.prompt:
            raise InvalidArgumentError("prompt", "at least one token", self.prompt)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens", "an int >= 1", self.max_new_tokens)
        if self.forced_output is not None and len(self.forced_output) < self.max_new_tokens:
            raise InvalidArgumentError("forced_output", f">= max_new_tokens ({self.max_new_tokens}) tokens",
                                       len(self.forced_output))
        self.tokens: list[int] = list(self.prompt)

    @property
    def token_ids(self) -> list[int]:
        """The tokens whose KV is written (what ``cache_*_req`` would cache)."""
        return self.tokens[:self.filled]

    def held(self, name: str) -> torch.Tensor:
        """``self.<name>`` (``kv_indices``, ``swa_kv_indices``, ``mamba_pool_idx``), which the caller knows
        the request holds now (admitted, not yet finished)."""
        src = getattr(self, name)
        if src is None:
            raise InvalidArgumentError(name, "ids the request holds (an admitted request's)", None)
        return src

    def on_host(self, name: str) -> torch.Tensor:
        """``held(name)`` on the host, copied once each time the tensor is replaced (admission, a checkpoint
        that hands pages to the tree): the adapter then checks and translates those ids on the side's host
        table, with no wait for the device."""
        src = self.held(name)
        held = self.host_copies.get(name)
        if held is None or held[0] is not src:
            held = self.host_copies[name] = (src, src.cpu())
        return held[1]

    def emit(self, am: int, row: torch.Tensor) -> int:
        """Record a generated token: the model's pick ``am`` (its argmax of ``row``, the next-token logits),
        or the forced one in its place. Returns its index in ``output``; the first one stamps the TTFT."""
        i = len(self.output)
        tok = am if self.forced_output is None else int(self.forced_output[i])
        self.output.append(tok)
        self.argmax.append(am)
        self.tokens.append(tok)
        if self.record_logits:
            self.logits.append(row.detach().float().cpu().clone())
        if i == 0:
            self.t_first_token = time.perf_counter()
        return i

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from submission to the first generated token."""
        return None if self.t_first_token is None else self.t_first_token - self.t_arrival

    @property
    def ttft_admitted(self) -> Optional[float]:
        """Seconds from admission (the match) to the first generated token: TTFT without queueing."""
        if self.t_first_token is None or self.t_admitted is None:
            return None
        return self.t_first_token - self.t_admitted

    def summary(self) -> dict:
        return {"rid": self.rid if isinstance(self.rid, (int, str)) else str(self.rid),
                "status": self.status.value, "prompt_len": len(self.prompt), "output_len": len(self.output),
                "reused": self.reused_tokens, "reused_host": self.reused_host_tokens,
                "computed": self.computed_tokens, "state_tier": self.state_tier, "ttft_s": self.ttft}
