"""The backend config: what of the tiers SGLang does not own (T1, T2, T3), from a JSON object.

SGLang owns T0 (its KV pool, req-to-token pool and mamba pool) and sizes it itself, so the keys that
size T0 (``page_size``, ``kv_pages``, ``t0_states``, ``swa_pages``) are refused here: they come from
SGLang's pools. Everything else of ``CacheConfig`` that sits above T0 is a key, plus ``model_id``
(the model part of T3's fingerprint). The text is given the way SGLang's
``--hicache-storage-backend-extra-config`` takes its own: a JSON object, or the path of a file
holding one. Every problem is a typed error naming the key (``CacheConfig`` checks the values).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError

# CacheConfig fields that SGLang's pools decide, not the backend config.
T0_KEYS = ("page_size", "kv_pages", "t0_states", "swa_pages", "lazy_compaction")
# The keys a backend config may set: CacheConfig's fields above T0, and model_id.
KEYS = tuple(f.name for f in dataclasses.fields(CacheConfig) if f.name not in T0_KEYS) + ("model_id",)


@dataclasses.dataclass(frozen=True)
class BackendConfig:
    """A parsed backend config: ``tiers`` the CacheConfig fields it sets, ``model_id`` or None."""

    tiers: dict[str, Any]
    model_id: Optional[str] = None

    def cache_config(self, *, page_size: int, kv_pages: int, t0_states: int) -> CacheConfig:
        """The ``CacheConfig`` of these tiers over T0 sizes read from SGLang's pools (checked there)."""
        return CacheConfig(page_size=page_size, kv_pages=kv_pages, t0_states=t0_states, **self.tiers)


def parse_backend_config(text: Optional[str], arg: str = "config") -> BackendConfig:
    """``text``: None or "" (the defaults), a JSON object, or the path of a file holding one."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return BackendConfig({})
    if not isinstance(text, str):
        raise InvalidTypeError(arg, "a JSON object (str) or the path of a file holding one", text)
    src = text
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise InvalidArgumentError(arg, "a JSON object or the path of an existing file", text)
        with open(text, encoding="utf-8") as f:
            src = f.read()
    try:
        obj = json.loads(src)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(arg, f"valid JSON ({e.msg} at line {e.lineno} column {e.colno})", text) from None
    if not isinstance(obj, dict):
        raise InvalidTypeError(arg, "a JSON object", type(obj).__name__)
    for key in obj:
        if key in T0_KEYS:
            raise InvalidArgumentError(key, "no value here: SGLang's pools size T0", obj[key])
        if key not in KEYS:
            raise InvalidArgumentError(key, f"one of the backend config keys {', '.join(KEYS)}", key)
    tiers = {k: v for k, v in obj.items() if k != "model_id"}
    model_id = obj.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise InvalidTypeError("model_id", "a non-empty str", model_id)
    if tiers.get("storage_url") is not None and model_id is None:
        raise InvalidArgumentError("model_id", "a model id beside storage_url (T3 entries are per model)", None)
    CacheConfig(**tiers)  # every value checked now, under its own key (T0 sizes at their defaults)
    return BackendConfig(tiers, model_id)
