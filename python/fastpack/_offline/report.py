"""What a run reports: the plan's numbers (mergeable across plan shards), report.json,
report.png and the summary a person reads -- every token dropped, truncated or split is
counted, and every input column left out is named with the reason. The metrics (lower
bounds, efficiencies) are the core's, from the buckets' totals, so shards merged on Ray
report what one plan of theirs would.

report.json holds what the output is, never how it was made, so the whole output
directory is the same bytes whoever writes it (any ``--memory``, threads, Ray, ``--shard``
jobs). How this run went (seconds, gather passes, memory budget, Ray's CPUs, the jobs)
goes to ``run.json`` (:data:`.outdir.RUN_FILE`), which no manifest checksum covers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _core
from .._plan import Plan
from .formats import entry_files
from .outdir import FORMAT, OutputDir
from .progress import human_bytes
from .settings import PackSettings
from .stats import LengthHistogram

__all__ = ["FILL_BINS", "PlanStats", "make_report", "summary_lines"]

FILL_BINS = 50


@dataclass
class PlanStats:
    """A plan's numbers for the report, mergeable across plan shards (a cluster's plan
    is never in one place)."""

    max_len: int
    documents: int
    empty: int
    input_tokens: int
    packed_tokens: int
    packs: int
    dropped: tuple[int, int]  # (documents, tokens)
    truncated: tuple[int, int]
    split: tuple[int, int]
    buckets: list[dict[str, int]]  # max_len, documents, packs, tokens
    group_cap: int | None
    groups: int
    fill_histogram: np.ndarray  # packs per 1/FILL_BINS of their cap filled
    lengths: LengthHistogram

    @classmethod
    def of(cls, plan: Plan, lengths: np.ndarray, settings: PackSettings) -> PlanStats:
        long = lengths > settings.max_cap
        split = (int(long.sum()), int(lengths[long].sum(dtype=np.int64))) \
            if settings.overlong == "split" and settings.strategy != "wrapped" else (0, 0)
        buckets = [{"max_len": b.max_len, "documents": b.num_sequences, "packs": b.num_packs,
                    "tokens": b.total_tokens} for b in plan.buckets] or [
            {"max_len": plan.max_len, "documents": plan.num_sequences - plan.empty_sequences,
             "packs": plan.num_packs, "tokens": plan.total_tokens}]
        shares = plan.pack_fills / plan.pack_caps  # each pack's fill over its cap
        counts = np.histogram(shares, bins=FILL_BINS, range=(0.0, 1.0))[0].astype(np.int64)
        return cls(plan.max_len, int(len(lengths)), plan.empty_sequences,
                   int(lengths.sum(dtype=np.int64)), plan.total_tokens, plan.num_packs,
                   (plan.dropped_sequences, plan.dropped_tokens),
                   (plan.truncated_sequences, plan.truncated_tokens), split, buckets,
                   plan.group_tokens, plan.num_groups, counts, LengthHistogram.of(lengths))

    @classmethod
    def merge(cls, parts: Sequence[PlanStats]) -> PlanStats:
        first = parts[0]

        def total(name: str) -> Any:
            values = [getattr(p, name) for p in parts]
            if isinstance(values[0], tuple):
                return tuple(sum(v[i] for v in values) for i in range(len(values[0])))
            return sum(values)

        buckets = [{"max_len": b["max_len"], **{k: sum(p.buckets[i][k] for p in parts)
                                                for k in ("documents", "packs", "tokens")}}
                   for i, b in enumerate(first.buckets)]
        return cls(first.max_len, total("documents"), total("empty"), total("input_tokens"),
                   total("packed_tokens"), total("packs"), total("dropped"),
                   total("truncated"), total("split"), buckets, first.group_cap,
                   total("groups"), np.sum([p.fill_histogram for p in parts], axis=0),
                   LengthHistogram.merge([p.lengths for p in parts]))

    @property
    def metrics(self) -> dict[str, Any]:
        """The core's metrics of these buckets and groups (``_core.bucket_metrics``)."""
        return _core.bucket_metrics(
            [(b["max_len"], b["documents"], b["packs"], b["tokens"]) for b in self.buckets],
            self.group_cap, self.groups)

    @property
    def lower_bound(self) -> int:
        """Fewest packs any plan can use: per bucket ``ceil(tokens / cap)``."""
        return int(self.metrics["lower_bound"])

    @property
    def efficiency(self) -> float:
        """Tokens over the packs' capacity, each at its cap."""
        return float(self.metrics["efficiency"])

    def report(self) -> dict[str, Any]:
        metrics = self.metrics
        groups = None
        if self.group_cap is not None:
            groups = {"group_tokens": self.group_cap, "groups": self.groups,
                      "lower_bound": metrics["group_lower_bound"],
                      "efficiency": metrics["group_efficiency"]}
        return {
            "documents": self.documents,
            "empty_documents": self.empty,
            "input_tokens": self.input_tokens,
            "packed_tokens": self.packed_tokens,
            "packs": self.packs,
            "lower_bound": metrics["lower_bound"],
            "packs_over_lower_bound": self.packs - metrics["lower_bound"],
            "efficiency": metrics["efficiency"],
            "dropped": {"documents": self.dropped[0], "tokens": self.dropped[1]},
            "truncated": {"documents": self.truncated[0], "tokens": self.truncated[1]},
            "split": {"documents": self.split[0], "tokens": self.split[1]},
            "buckets": self.buckets if len(self.buckets) > 1 else [],
            "groups": groups,
            "lengths": self.lengths.summary(),
        }

def _picture(out: OutputDir, stats: PlanStats, plot: bool | None,
             mix: dict[str, Any] | None = None) -> str:
    """Draws report.png; returns what became of it (for the report and summary)."""
    from .stats import plot_report, plot_unavailable

    if plot is False:
        return "not asked (--no-plot)"
    missing = plot_unavailable()
    if missing:
        return f"report.png skipped: {missing}"
    settings = out.settings
    long_max_len = settings.options.long_max_len
    caps = [settings.max_len] + ([long_max_len] if long_max_len else [])
    try:
        plot_report(stats.lengths, stats.fill_histogram, caps,
                    f"{stats.packs:,} packs, efficiency {stats.efficiency:.3%} "
                    f"(lower bound {stats.lower_bound:,})", out.path / "report.png", mix=mix)
    except Exception as e:  # the shards are written: a picture never undoes that
        return f"report.png not written: {type(e).__name__}: {e}"
    return "report.png"


def make_report(out: OutputDir, stats: PlanStats, entries: Sequence[dict[str, Any]],
                columns: Sequence[str], extra: dict[str, Any], *, plot: bool | None,
                left_out: dict[str, str]) -> dict[str, Any]:
    """Draws report.png and returns the report (what report.json holds) of a run whose
    shards are ``entries`` (journal entries) with ``columns``; ``extra``: more of what
    the output is (``mix``, ``affinity``), never how the run went (``run.json``).
    ``plot``: None draws the picture where matplotlib is installed and notes why not
    elsewhere; a picture that fails is noted too, never the end of a run whose shards
    are written."""
    picture = _picture(out, stats, plot, extra.get("mix"))
    return {
        "format": FORMAT,
        "inputs": [s.path for s in out.sources],
        "settings": out.settings.to_json(),
        **stats.report(),
        "shards": len(entries),
        "rows": sum(e["rows"] for e in entries),
        "bytes": sum(f["bytes"] for e in entries for f in entry_files(e)),
        "columns": list(columns),
        "left_out": dict(left_out),
        "picture": picture,
        **extra,
    }


def summary_lines(report: dict[str, Any], outdir: str) -> Iterator[str]:
    """The final summary a person reads (``report``: what a run returns, report.json's
    with run.json's under ``run``): nothing lost goes unmentioned."""
    r, run = report, report["run"]
    yield (f"packed {r['documents']:,} documents, {r['input_tokens']:,} tokens -> "
           f"{r['packs']:,} packs of {r['settings']['max_len']:,} in {r['shards']} "
           + (f"{r['settings']['format']} " if "format" in r["settings"] else "")
           + f"shard{'s' if r['shards'] != 1 else ''} "
           f"({human_bytes(r['bytes'])}) in {outdir}")
    yield (f"efficiency {r['efficiency']:.4%}; packs over the lower bound: "
           f"{r['packs_over_lower_bound']:,} ({r['packs']:,} for {r['lower_bound']:,})")
    lost = r["input_tokens"] - r["packed_tokens"]
    yield (f"tokens dropped: {r['dropped']['tokens']:,} ({r['dropped']['documents']:,} "
           f"documents); truncated: {r['truncated']['tokens']:,} "
           f"({r['truncated']['documents']:,} documents); split: {r['split']['tokens']:,} "
           f"({r['split']['documents']:,} documents, no token lost); "
           f"empty documents: {r['empty_documents']:,}; tokens not packed: {lost:,}")
    yield "columns: " + ", ".join(r["columns"]) + (
        "; left out: " + "; ".join(f"{k!r} ({v})" for k, v in r["left_out"].items())
        if r["left_out"] else "; none left out")
    if r["picture"] != "report.png":
        yield f"picture: {r['picture']}"
    if r.get("mix"):
        m = r["mix"]
        yield (f"mix of {len(m['sources'])} sources in {m['steps']:,} steps of "
               f"~{m['step_tokens']:,} tokens: " + "; ".join(
                   f"{s['name']} {s['realised_share']:.2%} (target {s['target_share']:.2%}, "
                   f"{s['repeated']:,} repeated, {s['left_out']:,} left out)"
                   for s in m["sources"]))
    if r["groups"]:
        g = r["groups"]
        yield (f"groups of <= {g['group_tokens']:,} tokens: {g['groups']:,} (lower bound "
               f"{g['lower_bound']:,}), group efficiency {g['efficiency']:.4%}")
    if r.get("affinity"):
        a = r["affinity"]
        yield (f"affinity ({r['settings'].get('affinity_column')}): {a['num_keys']:,} keys; "
               f"token pairs of one key in a pack {a['same_key_share']:.2%} (random packing "
               f"{a['random_share']:.2%})")
    if "ray" in run:
        nodes = run["ray"]["nodes"]
        how = f"on Ray ({nodes} node{'s' if nodes != 1 else ''}, {run['ray']['cpus']} CPUs)"
    else:
        how = (f"{run['passes']} gather pass{'es' if run['passes'] != 1 else ''} within a "
               f"budget of {human_bytes(run['memory_budget'])}")
        if "parts" in run:
            how = f"written by {run['parts']} --shard jobs, each {how} (the slowest's times)"
    yield f"{how}; time: " + ", ".join(f"{k} {v:.1f} s" for k, v in run["seconds"].items())
