"""``fastpack stats``: a corpus's length distribution and, for each cap, the rows and
efficiency of every way to batch it — padding to the cap, padding per batch, length
bucketing, next-fit and best-fit-decreasing packing — against the lower bound. Also the
pictures (this command's and ``fastpack pack``'s report.png) and the length histogram a
pack run reports, which merges across machines."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .. import _core
from .._errors import FastpackError
from .._plan import pack

__all__ = [
    "METHODS",
    "LengthHistogram",
    "check_plot",
    "compare",
    "length_summary",
    "plot_report",
    "plot_unavailable",
    "plot_stats",
    "table_lines",
]

METHODS = (
    ("pad_to_cap", "pad every row to the cap"),
    ("pad_per_batch", "pad each batch to its longest"),
    ("bucketing", "length bucketing (sorted batches)"),
    ("next_fit", "pack next-fit (input order)"),
    ("bfd", "pack best-fit decreasing"),
    ("lower_bound", "lower bound ceil(tokens / cap)"),
)
PERCENTILES = (50, 90, 99)


def length_summary(lengths: np.ndarray) -> dict[str, Any]:
    if lengths.size == 0:
        return {"documents": 0, "tokens": 0}
    q = np.percentile(lengths, PERCENTILES, method="higher")
    return {
        "documents": int(lengths.size),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "empty": int((lengths == 0).sum()),
        "min": int(lengths.min()),
        "mean": float(lengths.mean()),
        **{f"p{p}": int(v) for p, v in zip(PERCENTILES, q)},
        "max": int(lengths.max()),
    }


# Lengths below this are counted exactly; above, in 1/16-octave bins.
_EXACT = 1 << 16
_FINE = 16


class LengthHistogram:
    """Document lengths as counts that merge across machines: exact below 2^16 tokens,
    1/16 of an octave above. Percentiles are exact where they fall below 2^16 (and agree
    with :func:`length_summary` there)."""

    __slots__ = ("counts", "max", "min", "tokens")

    _EDGES = np.unique(np.concatenate([
        np.arange(_EXACT + 1, dtype=np.int64),
        np.round(_EXACT * 2 ** (np.arange(1, 16 * _FINE + 1) / _FINE)).astype(np.int64),
    ]))  # bin i holds lengths in [edges[i], edges[i + 1])

    def __init__(self, counts: np.ndarray, tokens: int, lo: int, hi: int) -> None:
        self.counts, self.tokens, self.min, self.max = counts, tokens, lo, hi

    @classmethod
    def of(cls, lengths: np.ndarray) -> LengthHistogram:
        lengths = np.asarray(lengths, dtype=np.int64)
        bins = lengths.copy()  # below 2^16 a length is its own bin
        long = lengths >= _EXACT
        if long.any():
            bins[long] = np.searchsorted(cls._EDGES, lengths[long], side="right") - 1
        counts = np.bincount(bins, minlength=len(cls._EDGES) - 1).astype(np.int64)
        if lengths.size == 0:
            return cls(counts, 0, 0, 0)
        return cls(counts, int(lengths.sum(dtype=np.int64)), int(lengths.min()),
                   int(lengths.max()))

    @classmethod
    def merge(cls, parts: Sequence[LengthHistogram]) -> LengthHistogram:
        full = [p for p in parts if p.counts.sum()]
        counts = np.sum([p.counts for p in parts], axis=0)
        if not full:
            return cls(counts, 0, 0, 0)
        return cls(counts, sum(p.tokens for p in full), min(p.min for p in full),
                   max(p.max for p in full))

    @property
    def documents(self) -> int:
        return int(self.counts.sum())

    def percentile(self, q: float) -> int:
        """The length at sorted position ``ceil(q/100 * (n - 1))`` (numpy's "higher")."""
        rank = int(np.ceil(q / 100 * (self.documents - 1)))
        b = int(np.searchsorted(np.cumsum(self.counts), rank, side="right"))
        return min(int(self._EDGES[b]) if b < _EXACT else int(self._EDGES[b + 1] - 1),
                   self.max)

    def summary(self) -> dict[str, Any]:
        n = self.documents
        if n == 0:
            return {"documents": 0, "tokens": 0}
        return {
            "documents": n,
            "tokens": self.tokens,
            "empty": int(self.counts[0]),
            "min": self.min,
            "mean": self.tokens / n,
            **{f"p{p}": self.percentile(p) for p in PERCENTILES},
            "max": self.max,
        }

    def samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(bin lower edges, counts) of the non-empty bins, for plotting."""
        nz = np.flatnonzero(self.counts)
        return self._EDGES[nz], self.counts[nz]


def _pieces(lengths: np.ndarray, cap: int) -> np.ndarray:
    """Documents cut into pieces of at most ``cap`` (what padding methods must do with a
    document longer than a row), empty documents left out."""
    full, rest = np.divmod(lengths.astype(np.int64), cap)
    return np.concatenate([np.full(int(full.sum()), cap, dtype=np.int64), rest[rest > 0]])


def _padded_batches(pieces: np.ndarray, batch: int) -> int:
    """Slots (rows x padded width) of consecutive batches of ``batch`` pieces."""
    n = len(pieces)
    if n == 0:
        return 0
    starts = np.arange(0, n, batch)
    longest = np.maximum.reduceat(pieces, starts)
    rows = np.diff(np.append(starts, n))
    return int((longest * rows).sum(dtype=np.int64))


def compare(lengths: np.ndarray, caps: Sequence[int], *, batch_size: int = 32,
            seed: int = 0) -> list[dict[str, Any]]:
    """For each cap: ``{"cap", "tokens", methods...: {"rows", "efficiency"}}``. Rows are
    training rows of ``cap`` slots (for padding, the pieces of documents cut at the cap);
    efficiency is real tokens over the slots they occupy."""
    results = []
    for cap in caps:
        pieces = _pieces(lengths, cap)
        tokens = int(pieces.sum(dtype=np.int64))

        def entry(rows: int, slots: int, tokens: int = tokens) -> dict[str, Any]:
            return {"rows": rows, "efficiency": tokens / slots if slots else 1.0}

        shuffled = pieces[np.random.default_rng(seed).permutation(len(pieces))]
        row: dict[str, Any] = {"cap": cap, "tokens": tokens, "pieces": int(len(pieces))}
        row["pad_to_cap"] = entry(len(pieces), len(pieces) * cap)
        row["pad_per_batch"] = entry(len(pieces), _padded_batches(shuffled, batch_size))
        row["bucketing"] = entry(len(pieces), _padded_batches(np.sort(pieces), batch_size))
        for strategy in ("next_fit", "bfd"):
            plan = pack(lengths, cap, strategy=strategy, overlong="split", shuffle=False)
            row[strategy] = entry(plan.num_packs, plan.num_packs * cap)
        lb = _core.bucket_metrics([(cap, len(pieces), 0, tokens)])["lower_bound"]
        row["lower_bound"] = entry(lb, lb * cap)
        results.append(row)
    return results


def table_lines(summary: dict[str, Any], results: list[dict[str, Any]],
                batch_size: int) -> Iterator[str]:
    s = summary
    if not s["documents"]:
        yield "no documents"
        return
    yield (f"{s['documents']:,} documents, {s['tokens']:,} tokens; length min {s['min']:,}, "
           f"median {s['p50']:,}, mean {s['mean']:,.0f}, p90 {s['p90']:,}, p99 {s['p99']:,}, "
           f"max {s['max']:,}" + (f"; {s['empty']:,} empty" if s["empty"] else ""))
    caps = [r["cap"] for r in results]
    labels = [(key, label.replace("each batch to its", f"batches of {batch_size} to their")
               .replace("sorted batches", f"sorted batches of {batch_size}"))
              for key, label in METHODS]
    width = max(len(label) for _, label in labels) + 2
    yield ""
    yield f"{'rows / efficiency':{width}}" + "".join(f"{'cap ' + format(c, ','):>24}"
                                                     for c in caps)
    for key, label in labels:
        cells = "".join(f"{r[key]['rows']:>15,} {r[key]['efficiency']:>8.2%}" for r in results)
        yield f"{label:{width}}{cells}"
    over = [(r["cap"], r["pieces"]) for r in results]
    yield ""
    yield ("documents longer than a cap count as several rows (cut at the cap); packing "
           "splits them too. " + ", ".join(f"cap {c:,}: {p:,} pieces" for c, p in over))


def plot_unavailable() -> str | None:
    """Why no picture can be drawn here (matplotlib, the ``cli`` extra, is not installed),
    or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # Named by the package, not the extra: fastpack-seq is not on the public index yet.
        return "matplotlib is not installed (pip install matplotlib: the cli extra)"
    return None


def check_plot(plot: bool | None, name: str = "plot") -> None:
    """A picture asked for explicitly where none can be drawn: an error before any work."""
    missing = plot_unavailable() if plot else None
    if missing:
        raise FastpackError(f"{name}: the picture needs matplotlib: {missing}")


def _figure(ncols: int) -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.5), constrained_layout=True)


def _histogram(ax: Any, lengths: LengthHistogram, caps: Sequence[int]) -> None:
    edges, counts = lengths.samples()
    positive = edges > 0
    if positive.any():
        top = max(int(lengths.max), max(caps)) + 1
        bins = np.unique(np.geomspace(1, top, 60).astype(np.int64))
        ax.hist(edges[positive], bins=bins, weights=counts[positive], color="#4c72b0")
        ax.set_xscale("log")
    for cap in caps:
        ax.axvline(cap, color="#c44e52", linestyle="--", linewidth=1)
        ax.text(cap, ax.get_ylim()[1] * 0.97, f" {cap:,}", color="#c44e52", va="top",
                fontsize=8)
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{lengths.documents:,} documents, {lengths.tokens:,} tokens")


def _save(fig: Any, path: Any) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stats(lengths: np.ndarray, results: list[dict[str, Any]], path: Any) -> None:
    """Length histogram with the caps marked, and efficiency per method and cap."""
    fig, (left, right) = _figure(2)
    caps = [r["cap"] for r in results]
    _histogram(left, LengthHistogram.of(lengths), caps)
    width = 0.8 / len(METHODS)
    x = np.arange(len(caps))
    for k, (key, label) in enumerate(METHODS):
        values = [r[key]["efficiency"] * 100 for r in results]
        right.bar(x + (k - (len(METHODS) - 1) / 2) * width, values, width, label=label)
    right.set_xticks(x, [f"{c:,}" for c in caps])
    right.set_xlabel("cap (tokens per row)")
    right.set_ylabel("efficiency (% of slots holding tokens)")
    right.set_ylim(0, 135)
    right.set_yticks(range(0, 101, 20))
    right.legend(fontsize=8, loc="upper center", ncol=2)
    right.set_title("efficiency per method")
    _save(fig, path)


def plot_report(lengths: LengthHistogram, fill_histogram: np.ndarray, caps: Sequence[int],
                title: str, path: Any, mix: dict[str, Any] | None = None) -> None:
    """report.png of a pack run: the length histogram with the caps, and how full the
    packs are (``fill_histogram``: packs per 2% of their cap filled); with a mixture
    (report.json's ``mix``), each source's target and realised share of the tokens."""
    fig, axes = _figure(3 if mix else 2)
    left, right = axes[0], axes[1]
    _histogram(left, lengths, caps)
    edges = np.linspace(0, 100, len(fill_histogram) + 1)
    right.bar(edges[:-1], fill_histogram, width=edges[1] - edges[0], align="edge",
              color="#55a868")
    if fill_histogram.any():
        right.set_yscale("log")
    right.set_xlabel("pack fill (% of its cap)")
    right.set_ylabel("packs")
    right.set_title(title)
    if mix:
        ax = axes[2]
        sources = mix["sources"]
        x = np.arange(len(sources))
        ax.bar(x - 0.2, [100 * s["target_share"] for s in sources], 0.4, label="target",
               color="#cccccc")
        ax.bar(x + 0.2, [100 * s["realised_share"] for s in sources], 0.4, label="realised",
               color="#4c72b0")
        ax.set_xticks(x, [f"{s['name']}\n{s['output_documents']:,} docs\n"
                          f"+{s['repeated']:,} / -{s['left_out']:,}" for s in sources])
        ax.set_ylabel("% of the output's tokens")
        ax.set_title(f"mix: {mix['steps']:,} steps of ~{mix['step_tokens']:,} tokens "
                     "(+repeated / -left out)")
        ax.legend()
    _save(fig, path)
