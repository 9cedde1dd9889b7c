"""fastpack: fast, correct sequence packing for LLM training.

The layers and which module owns which idea: docs/architecture.md.

>>> import fastpack
>>> plan = fastpack.pack([3, 5, 2, 6], max_len=8)
>>> plan.num_packs, plan.efficiency
(2, 1.0)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ._affinity import Affinity, affinity_keys, measure_affinity
from ._context_parallel import CP_MODES, CPLayout, RankLayout, cp_layout
from ._errors import FastpackError, FastpackTypeError
from ._examples import example_lengths
from ._gather import gather
from ._materialize import IGNORE_INDEX, Ragged, as_ragged, loss_mask_from_spans, materialize
from ._microbatch import BudgetController, MemoryModel, MicroBatches, plan_micro_batches
from ._mix import MixedPlan, MixSource, Mixture, mix
from ._options import PackOptions
from ._plan import OVERLONG_POLICIES, STRATEGIES, Bucket, LimitUse, Plan, pack
from ._stream import StreamPacker, StreamStats
from ._tree import pack_trees, tree_rows
from .cost import CostModel


def __getattr__(name: str) -> object:
    # `fastpack.hf` imports on first use, so `import fastpack` stays light; so do the
    # drop-ins `fastpack.trl` and `fastpack.transformers` (which imports transformers).
    if name in ("hf", "vlm", "trl", "transformers"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fastpack' has no attribute {name!r}")


#: The distribution's name on the index (``pip install fastpack-seq``): the name
#: "fastpack" there belongs to an unrelated package.
DISTRIBUTION = "fastpack-seq"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "OVERLONG_POLICIES",
    "STRATEGIES",
    "Affinity",
    "Bucket",
    "BudgetController",
    "CPLayout",
    "CostModel",
    "CP_MODES",
    "FastpackError",
    "FastpackTypeError",
    "IGNORE_INDEX",
    "LimitUse",
    "MemoryModel",
    "MicroBatches",
    "MixSource",
    "MixedPlan",
    "Mixture",
    "PackOptions",
    "Plan",
    "Ragged",
    "RankLayout",
    "StreamPacker",
    "StreamStats",
    "__version__",
    "affinity_keys",
    "as_ragged",
    "cp_layout",
    "example_lengths",
    "gather",
    "loss_mask_from_spans",
    "materialize",
    "measure_affinity",
    "mix",
    "pack",
    "pack_trees",
    "plan_micro_batches",
    "tree_rows",
]
