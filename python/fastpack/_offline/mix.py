"""``fastpack pack --mix``: the inputs of a mixture (each source's files, in the mixture's
order) and the plan of a run, a mixture's (``fastpack._mix``) or the plain one
(:mod:`.plan`). The report's ``mix`` section and the picture's panel come from
:meth:`fastpack.MixedPlan.report`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._mix import MixedPlan, Mixture, plan_mixture
from .._plan import Plan
from .plan import check_overlong, make_plan
from .sources import Source, expand_inputs

if TYPE_CHECKING:
    from .scan import Scan
    from .settings import PackSettings

__all__ = ["mix_inputs", "plan_run"]


def mix_inputs(mix: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The files of a mixture's sources, in order (globs expanded, directories listed),
    and how many files each source has."""
    inputs: list[str] = []
    counts: list[int] = []
    seen: dict[str, str] = {}
    mixture = Mixture.from_dict(mix)
    for source, paths in zip(mixture.sources, mixture.files()):
        files = [s.path for s in expand_inputs(paths)]
        for f in files:
            if f in seen:
                from .._errors import FastpackError

                raise FastpackError(f"mix: {f} is in sources {seen[f]!r} and "
                                    f"{source.name!r}; a file belongs to one source")
            seen[f] = source.name
        inputs.extend(files)
        counts.append(len(files))
    return inputs, counts


def plan_run(scan: Scan, settings: PackSettings, sources: Sequence[Source],
             key_sources: Sequence[Source] | None = None,
             ) -> tuple[Plan, list[int], MixedPlan | None]:
    """The run's plan, the packs of each plan shard, and the mixture's plan (None without
    ``--mix``); ``key_sources``: the files holding ``--affinity-column`` (default:
    ``sources``)."""
    if settings.mix is None:
        plan, counts = make_plan(scan, settings, sources, key_sources)
        return plan, counts, None
    check_overlong(scan, settings, sources)
    _, files = mix_inputs(settings.mix)
    rows = np.concatenate([[0], np.cumsum(scan.file_rows, dtype=np.int64)])
    file_base = np.concatenate([[0], np.cumsum(files)])
    lengths = [scan.lengths[rows[file_base[k]]:rows[file_base[k + 1]]].astype(np.int64)
               for k in range(len(files))]
    mixed = plan_mixture(lengths, Mixture.from_dict(settings.mix), settings.options)
    return mixed.plan, [mixed.plan.num_packs], mixed
