"""Tensor parallelism: every rank holds its heads' share, every rank makes the same tree decision.

``TPGroup`` (``group.py``): a rank, the group size and ``torch.distributed``'s group; ``Agreement``
(``agree.py``): the one MIN-reduction per step over what only one rank observed; ``tree_dump`` /
``digest`` (``dump.py``): the canonical form two ranks' trees must share. ``TieredCache.build(...,
tp=group)`` builds a rank's tiers from the model's whole specs and wires the agreement.
"""

from tiered_cache.parallel.agree import Agreement, attach
from tiered_cache.parallel.dump import digest, tree_dump
from tiered_cache.parallel.group import TPGroup

__all__ = ["Agreement", "TPGroup", "attach", "digest", "tree_dump"]
