//! The Python binding: converts arguments, releases the GIL around the core, and maps the
//! core's errors to `fastpack.FastpackError`. No algorithm lives here.

use fastpack_core::{
    layout, pack_limited, pack_segments as core_pack_segments, pool, Bucket, Error, Levels, Limit,
    Metrics, Overlong, PackOptions, PlanArrays, Strategy, TwoLevelPlan,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList};

mod column;
mod context_parallel;
mod materialize;
mod schedule;
mod targets;
mod tree;
mod vlm;

/// Raises `fastpack.FastpackError` (a `ValueError`) with the core's message; a failed
/// allocation raises `MemoryError`.
pub(crate) fn to_py(err: Error) -> PyErr {
    match err {
        Error::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
        _ => fastpack_error(&err.to_string()),
    }
}

/// Runs core work so that a bug surfaces as a `FastpackError`, never as a panic that
/// aborts a training run.
pub(crate) fn guarded<T>(work: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|_| {
        Err(Error::InvalidArgument {
            arg: "fastpack",
            message: "internal error (a fastpack bug; please report it)".into(),
        })
    })
}

/// A `fastpack.Plan` as the binding reads it: its arrays and options, read by attribute
/// name (one argument, `plan`, in every binding that reads a plan's segments) and borrowed
/// in place for the core.
#[derive(FromPyObject)]
pub(crate) struct PlanArgs<'py> {
    sample_ids: PyReadonlyArray1<'py, i64>,
    starts: PyReadonlyArray1<'py, i64>,
    seqlens: PyReadonlyArray1<'py, i32>,
    pack_offsets: PyReadonlyArray1<'py, i64>,
    reserve: u64,
    strategy: PyBackedStr,
    overlong: PyBackedStr,
    /// A plan of shared-prefix trees: each segment's parent, and its paths.
    parents: Option<PyReadonlyArray1<'py, i64>>,
    path_sample_ids: Option<PyReadonlyArray1<'py, i64>>,
    path_ends: Option<PyReadonlyArray1<'py, i64>>,
}

impl PlanArgs<'_> {
    /// The plan borrowed for the core (`parents` set for a plan of trees).
    pub(crate) fn plan_ref(&self) -> PyResult<fastpack_core::materialize::PlanRef<'_>> {
        Ok(fastpack_core::materialize::PlanRef {
            sample_ids: slice(&self.sample_ids)?,
            starts: slice(&self.starts)?,
            seqlens: slice(&self.seqlens)?,
            pack_offsets: slice(&self.pack_offsets)?,
            reserve: self.reserve,
            strategy: Strategy::parse(&self.strategy).map_err(to_py)?,
            overlong: Overlong::parse(&self.overlong).map_err(to_py)?,
            parents: self.parents.as_ref().map(slice).transpose()?,
        })
    }

    /// A plan of trees' paths: `(path_sample_ids, path_ends)`.
    pub(crate) fn paths(&self) -> PyResult<(&[i64], &[i64])> {
        match (&self.path_sample_ids, &self.path_ends) {
            (Some(ids), Some(ends)) => Ok((slice(ids)?, slice(ends)?)),
            _ => Err(fastpack_error("plan: not a plan of shared-prefix trees (no paths)")),
        }
    }
}

fn slice<'a, T: numpy::Element>(array: &'a PyReadonlyArray1<'_, T>) -> PyResult<&'a [T]> {
    array.as_slice().map_err(|_| fastpack_error("plan: expected contiguous arrays"))
}

pub(crate) fn fastpack_error(message: &str) -> PyErr {
    Python::attach(|py| {
        match py.import("fastpack._errors").and_then(|m| m.getattr("FastpackError")) {
            Ok(cls) => match cls.call1((message,)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(_) => PyRuntimeError::new_err(message.to_string()),
        }
    })
}

fn options(
    max_len: u64,
    strategy: &str,
    overlong: &str,
    reserve: u64,
    seed: Option<u64>,
    shard_items: Option<usize>,
) -> PyResult<PackOptions> {
    let mut opts = PackOptions::new(max_len);
    opts.strategy = Strategy::parse(strategy).map_err(to_py)?;
    opts.overlong = Overlong::parse(overlong).map_err(to_py)?;
    opts.reserve = reserve;
    opts.shuffle_seed = seed;
    if let Some(n) = shard_items {
        opts.shard_items = n;
    }
    Ok(opts)
}

/// Every metric into `d`: the same keys whether the core made the plan or measured one.
fn set_metrics(py: Python<'_>, d: &Bound<'_, PyDict>, m: Metrics) -> PyResult<()> {
    d.set_item("total_tokens", m.total_tokens)?;
    d.set_item("lower_bound", m.lower_bound)?;
    d.set_item("efficiency", m.efficiency)?;
    d.set_item("group_lower_bound", m.group_lower_bound)?;
    d.set_item("group_efficiency", m.group_efficiency)?;
    let buckets = PyList::empty(py);
    for b in &m.buckets {
        let bd = PyDict::new(py);
        bd.set_item("max_len", b.max_len)?;
        bd.set_item("num_sequences", b.num_sequences)?;
        bd.set_item("num_packs", b.num_packs)?;
        bd.set_item("total_tokens", b.total_tokens)?;
        bd.set_item("lower_bound", b.lower_bound())?;
        bd.set_item("efficiency", b.efficiency())?;
        buckets.append(bd)?;
    }
    d.set_item("buckets", buckets)?;
    match m.group_fills {
        Some(fills) => d.set_item("group_fills", fills.into_pyarray(py))?,
        None => d.set_item("group_fills", py.None())?,
    }
    Ok(())
}

fn plan_to_dict<'py>(py: Python<'py>, out: TwoLevelPlan) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    // Every metric comes from the core; Python reads them and never recomputes them.
    let mut metrics = out.metrics();
    metrics.group_fills = None; // moved below, with the groups
    set_metrics(py, &d, metrics)?;
    if let Some(long) = out.buckets.get(1) {
        d.set_item("long_max_len", long.max_len)?;
    }
    let plan = out.plan;
    let s = &plan.stats;
    d.set_item("num_sequences", s.num_sequences)?;
    d.set_item("empty_sequences", s.empty_sequences)?;
    d.set_item("dropped_sequences", s.dropped_sequences)?;
    d.set_item("dropped_tokens", s.dropped_tokens)?;
    d.set_item("truncated_sequences", s.truncated_sequences)?;
    d.set_item("truncated_tokens", s.truncated_tokens)?;
    d.set_item("split_sequences", s.split_sequences)?;
    d.set_item("max_len", plan.max_len)?;
    d.set_item("reserve", plan.reserve)?;
    d.set_item("strategy", plan.strategy.name())?;
    d.set_item("overlong", plan.overlong.name())?;
    // Moved, not copied: numpy takes ownership of each Vec's buffer.
    d.set_item("sample_ids", plan.sample_ids.into_pyarray(py))?;
    d.set_item("starts", plan.starts.into_pyarray(py))?;
    d.set_item("seqlens", plan.seqlens.into_pyarray(py))?;
    d.set_item("pack_offsets", plan.pack_offsets.into_pyarray(py))?;
    if let Some(caps) = out.pack_caps {
        d.set_item("pack_caps", caps.into_pyarray(py))?;
    }
    if !out.limits.is_empty() {
        let uses = PyList::empty(py);
        for u in &out.limits {
            let ud = PyDict::new(py);
            ud.set_item("name", &u.name)?;
            ud.set_item("cap", u.cap)?;
            ud.set_item("total", u.total)?;
            ud.set_item("lower_bound", u.lower_bound)?;
            ud.set_item("max_used", u.max_used)?;
            uses.append(ud)?;
        }
        d.set_item("limits", uses)?;
    }
    if let Some(groups) = out.groups {
        d.set_item("group_tokens", groups.group_tokens)?;
        d.set_item("group_offsets", groups.group_offsets.into_pyarray(py))?;
        d.set_item("group_fills", groups.group_fills.into_pyarray(py))?;
    }
    Ok(d)
}

macro_rules! pack_dtypes {
    ($py:expr, $lengths:expr, $opts:expr, $levels:expr, $limits:expr, $threads:expr, $($t:ty),*) => {{
        $(
            if let Ok(array) = $lengths.extract::<PyReadonlyArray1<$t>>() {
                let slice = array.as_slice().map_err(|_| fastpack_error(
                    "lengths: expected a contiguous array"))?;
                let (opts, levels, limits) = (&$opts, &$levels, &$limits);
                let result = $py.detach(|| {
                    pool::install($threads, || guarded(|| pack_limited(slice, opts, levels, limits)))
                });
                let plan = result.map_err(to_py)?.map_err(to_py)?;
                return plan_to_dict($py, plan);
            }
        )*
    }};
}

/// `pack(lengths, max_len, strategy, overlong, reserve, seed, threads, shard_items,
/// long_max_len, group_tokens, limits)`: `lengths` is a 1-D contiguous numpy integer array
/// (the Python layer converts anything else once), `limits` a list of `(name, values, cap)`
/// with int64 values; returns a dict of the plan's arrays and counts.
#[pyfunction]
#[pyo3(signature = (lengths, max_len, strategy="bfd", overlong="error", reserve=0, seed=None, threads=None, shard_items=None, long_max_len=None, group_tokens=None, limits=None))]
#[allow(clippy::too_many_arguments)]
fn pack<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyAny>,
    max_len: u64,
    strategy: &str,
    overlong: &str,
    reserve: u64,
    seed: Option<u64>,
    threads: Option<usize>,
    shard_items: Option<usize>,
    long_max_len: Option<u64>,
    group_tokens: Option<u64>,
    limits: Option<Vec<(String, PyReadonlyArray1<'py, i64>, u64)>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = options(max_len, strategy, overlong, reserve, seed, shard_items)?;
    let levels = Levels { long_max_len, group_tokens };
    let limits = limits.unwrap_or_default();
    let budgets = limits
        .iter()
        .map(|(name, values, cap)| {
            let values = values.as_slice().map_err(|_| {
                fastpack_error(&format!("limits[{name:?}]: expected a contiguous array"))
            })?;
            Ok(Limit { name, values, cap: *cap })
        })
        .collect::<PyResult<Vec<_>>>()?;
    pack_dtypes!(py, lengths, opts, levels, budgets, threads, i64, i32, u32, u16, u64, u8, i8, i16);
    Err(fastpack_error("lengths: expected a 1-D numpy array of an integer dtype"))
}

/// `pack_segments(lengths, offsets, max_len, strategy, overlong, reserve, seeds, threads,
/// long_max_len)`: each segment `lengths[offsets[k]:offsets[k + 1]]` packed on its own
/// (shuffled by `seeds[k]` when given), the plans joined in segment order
/// (`fastpack_core::pack_segments`); the plan's dict (its `sample_ids` index `lengths`)
/// with `pack_starts` (int64, segments + 1: where each segment's packs begin).
#[pyfunction]
#[pyo3(signature = (lengths, offsets, max_len, strategy="bfd", overlong="error", reserve=0, seeds=None, threads=None, long_max_len=None))]
#[allow(clippy::too_many_arguments)]
fn pack_segments<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    max_len: u64,
    strategy: &str,
    overlong: &str,
    reserve: u64,
    seeds: Option<PyReadonlyArray1<'py, u64>>,
    threads: Option<usize>,
    long_max_len: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = options(max_len, strategy, overlong, reserve, None, None)?;
    let levels = Levels { long_max_len, group_tokens: None };
    let lengths =
        lengths.as_slice().map_err(|_| fastpack_error("lengths: expected a contiguous array"))?;
    let bounds = offsets
        .as_slice()
        .map_err(|_| fastpack_error("offsets: expected a contiguous array"))?
        .iter()
        .map(|&o| usize::try_from(o))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| fastpack_error("offsets: expected non-negative bounds"))?;
    let seeds = match &seeds {
        Some(s) => {
            Some(s.as_slice().map_err(|_| fastpack_error("seeds: expected a contiguous array"))?)
        }
        None => None,
    };
    let result = py.detach(|| {
        pool::install(threads, || {
            guarded(|| core_pack_segments(lengths, &bounds, seeds, &opts, &levels))
        })
    });
    let out = result.map_err(to_py)?.map_err(to_py)?;
    let d = plan_to_dict(py, out.plan)?;
    d.set_item("pack_starts", out.pack_starts.into_pyarray(py))?;
    Ok(d)
}

type Csr<'py> =
    (PyReadonlyArray1<'py, i32>, PyReadonlyArray1<'py, i64>, PyReadonlyArray1<'py, i64>);

fn check_contiguous(arrays: &Csr<'_>) -> PyResult<()> {
    if !(arrays.0.is_contiguous() && arrays.1.is_contiguous() && arrays.2.is_contiguous()) {
        return Err(fastpack_error("seqlens, pack_offsets, packs: expected contiguous arrays"));
    }
    Ok(())
}

/// `cu_seqlens` (int32) over the segments of `packs` laid end to end.
#[pyfunction]
fn cu_seqlens<'py>(
    py: Python<'py>,
    seqlens: PyReadonlyArray1<'py, i32>,
    pack_offsets: PyReadonlyArray1<'py, i64>,
    packs: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let arrays = (seqlens, pack_offsets, packs);
    check_contiguous(&arrays)?;
    let (s, o, p) = (arrays.0.as_slice()?, arrays.1.as_slice()?, arrays.2.as_slice()?);
    let cu = py.detach(|| guarded(|| layout::cu_seqlens(s, o, p))).map_err(to_py)?;
    Ok(cu.into_pyarray(py))
}

type Varlen<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i64>>);

/// The pack of each of `lengths` (in the order given) under best fit with TRL's rule for
/// ties (the oldest pack among equal rooms): `fastpack.trl.pack_dataset`'s placement.
#[pyfunction]
fn best_fit_oldest<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, u32>,
    max_len: u32,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let lens = lengths.as_slice()?;
    let packs =
        py.detach(|| guarded(|| fastpack_core::best_fit_oldest(lens, max_len))).map_err(to_py)?;
    Ok(packs.into_pyarray(py))
}

/// `(cu_seqlens, position_ids)` of `packs` laid end to end, in one call.
#[pyfunction]
fn varlen<'py>(
    py: Python<'py>,
    seqlens: PyReadonlyArray1<'py, i32>,
    pack_offsets: PyReadonlyArray1<'py, i64>,
    packs: PyReadonlyArray1<'py, i64>,
    threads: Option<usize>,
) -> PyResult<Varlen<'py>> {
    let arrays = (seqlens, pack_offsets, packs);
    check_contiguous(&arrays)?;
    let (s, o, p) = (arrays.0.as_slice()?, arrays.1.as_slice()?, arrays.2.as_slice()?);
    let (cu, positions) = py
        .detach(|| {
            pool::install(threads, || {
                guarded(|| {
                    let cu = layout::cu_seqlens(s, o, p)?;
                    let positions = layout::positions_from_cu(&cu);
                    Ok((cu, positions))
                })
            })
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok((cu.into_pyarray(py), positions.into_pyarray(py)))
}

/// Every metric of a plan assembled outside the core (a step's sub-plan, shards joined, a
/// stream's window), from its arrays, after checking that they describe a plan: the
/// definitions of the plans the core makes (`fastpack_core::metrics`).
#[pyfunction]
#[pyo3(signature = (seqlens, pack_offsets, max_len, bucket_sequences, pack_caps=None, long_max_len=None, group_offsets=None, group_tokens=None))]
#[allow(clippy::too_many_arguments)]
fn plan_metrics<'py>(
    py: Python<'py>,
    seqlens: PyReadonlyArray1<'py, i32>,
    pack_offsets: PyReadonlyArray1<'py, i64>,
    max_len: u64,
    bucket_sequences: Vec<u64>,
    pack_caps: Option<PyReadonlyArray1<'py, i32>>,
    long_max_len: Option<u64>,
    group_offsets: Option<PyReadonlyArray1<'py, i64>>,
    group_tokens: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let contiguous = |name: &str, ok: bool| {
        if ok {
            Ok(())
        } else {
            Err(fastpack_error(&format!("{name}: expected a contiguous array")))
        }
    };
    contiguous("seqlens", seqlens.is_contiguous())?;
    contiguous("pack_offsets", pack_offsets.is_contiguous())?;
    contiguous("pack_caps", pack_caps.as_ref().is_none_or(|a| a.is_contiguous()))?;
    contiguous("group_offsets", group_offsets.as_ref().is_none_or(|a| a.is_contiguous()))?;
    let arrays = PlanArrays {
        seqlens: seqlens.as_slice()?,
        pack_offsets: pack_offsets.as_slice()?,
        max_len,
        pack_caps: pack_caps.as_ref().map(|a| a.as_slice()).transpose()?,
        long_max_len,
        group_offsets: group_offsets.as_ref().map(|a| a.as_slice()).transpose()?,
        group_tokens,
        bucket_sequences: &bucket_sequences,
    };
    let metrics = py.detach(|| guarded(|| fastpack_core::metrics(&arrays))).map_err(to_py)?;
    let d = PyDict::new(py);
    set_metrics(py, &d, metrics)?;
    Ok(d)
}

/// Every metric of a plan known only by its buckets' totals — `(max_len, num_sequences,
/// num_packs, total_tokens)` each — and, with `group_tokens`, its number of groups: the
/// report of plan shards merged (`fastpack_core::bucket_metrics`, which every other
/// metric of fastpack goes through). No group fills: totals cannot give them.
#[pyfunction]
#[pyo3(signature = (buckets, group_tokens=None, num_groups=0))]
fn bucket_metrics<'py>(
    py: Python<'py>,
    buckets: Vec<(u64, u64, u64, u64)>,
    group_tokens: Option<u64>,
    num_groups: u64,
) -> PyResult<Bound<'py, PyDict>> {
    if let Some((i, _)) = buckets.iter().enumerate().find(|(_, b)| b.0 == 0) {
        return Err(fastpack_error(&format!("buckets: bucket {i} has max_len 0; expected >= 1")));
    }
    if group_tokens == Some(0) {
        return Err(fastpack_error("group_tokens: got 0; expected at least 1"));
    }
    let buckets = buckets
        .into_iter()
        .map(|(max_len, num_sequences, num_packs, total_tokens)| Bucket {
            max_len,
            num_sequences,
            num_packs,
            total_tokens,
        })
        .collect();
    let metrics = fastpack_core::bucket_metrics(buckets, group_tokens.map(|b| (num_groups, b)));
    let d = PyDict::new(py);
    set_metrics(py, &d, metrics)?;
    Ok(d)
}

/// `pack_affinity(lengths, keys, max_len, overlong, reserve, seed, threads, slack)`: best
/// fit preferring packs of one key (`fastpack_core::pack_affinity`); the plan's dict as
/// `pack` returns it, with `affinity` (a dict of `fastpack_core::Affinity`'s fields).
#[pyfunction]
#[pyo3(signature = (lengths, keys, max_len, overlong="error", reserve=0, seed=None, threads=None, slack=None))]
#[allow(clippy::too_many_arguments)]
fn pack_affinity<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, i64>,
    keys: PyReadonlyArray1<'py, i64>,
    max_len: u64,
    overlong: &str,
    reserve: u64,
    seed: Option<u64>,
    threads: Option<usize>,
    slack: Option<u32>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = options(max_len, "bfd", overlong, reserve, seed, None)?;
    let lens =
        lengths.as_slice().map_err(|_| fastpack_error("lengths: expected a contiguous array"))?;
    let keys =
        keys.as_slice().map_err(|_| fastpack_error("affinity: expected a contiguous array"))?;
    let result = py.detach(|| {
        pool::install(threads, || {
            guarded(|| fastpack_core::pack_affinity(lens, keys, &opts, slack))
        })
    });
    let out = result.map_err(to_py)?.map_err(to_py)?;
    let a = out.affinity;
    let s = &out.plan.stats;
    let bucket = Bucket {
        max_len: out.plan.max_len,
        num_sequences: s.num_sequences - s.empty_sequences,
        num_packs: out.plan.num_packs() as u64,
        total_tokens: s.total_tokens,
    };
    let two = TwoLevelPlan {
        plan: out.plan,
        pack_caps: None,
        buckets: vec![bucket],
        groups: None,
        limits: Vec::new(),
    };
    let d = plan_to_dict(py, two)?;
    d.set_item("affinity", affinity_dict(py, &a)?)?;
    Ok(d)
}

fn affinity_dict<'py>(
    py: Python<'py>,
    a: &fastpack_core::Affinity,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_keys", a.num_keys)?;
    d.set_item("same_key_share", a.same_key_share)?;
    d.set_item("random_share", a.random_share)?;
    d.set_item("pure_packs", a.pure_packs)?;
    d.set_item("slack", a.slack)?;
    d.set_item("bfd_packs", a.bfd_packs)?;
    Ok(d)
}

/// How related a plan's packs are under `keys` (one per input sequence): the dict of
/// `fastpack_core::measure_affinity` (its `slack` and `bfd_packs` are 0).
#[pyfunction]
fn affinity_metrics<'py>(
    py: Python<'py>,
    sample_ids: PyReadonlyArray1<'py, i64>,
    seqlens: PyReadonlyArray1<'py, i32>,
    pack_offsets: PyReadonlyArray1<'py, i64>,
    keys: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyDict>> {
    let (ids, lens, offs, keys) =
        (sample_ids.as_slice()?, seqlens.as_slice()?, pack_offsets.as_slice()?, keys.as_slice()?);
    let a = py
        .detach(|| guarded(|| fastpack_core::measure_affinity(lens, offs, ids, keys)))
        .map_err(to_py)?;
    affinity_dict(py, &a)
}

/// The thread count used when `threads=None`.
#[pyfunction]
fn default_threads() -> usize {
    pool::default_threads()
}

#[pymodule(gil_used = false)]
mod _core {
    #[pymodule_export]
    use super::column::{column_lengths, gather, pack_tokens, ListColumn};
    #[pymodule_export]
    use super::context_parallel::{
        cp_plan_lengths, cp_rank_attention, cp_rank_tokens, cp_real_seqlens, cp_stream, cp_streams,
    };
    #[pymodule_export]
    use super::materialize::{flatten_int_lists, materialize};
    #[pymodule_export]
    use super::schedule::{by_cost, lpt_groups, permutation, step_sums};
    #[pymodule_export]
    use super::targets::segment_targets;
    #[pymodule_export]
    use super::tree::{tree_expand, tree_items, tree_path_targets, tree_rows};
    #[pymodule_export]
    use super::vlm::{media_grids, rope_index};
    #[pymodule_export]
    use super::{
        affinity_metrics, best_fit_oldest, bucket_metrics, cu_seqlens, default_threads, pack,
        pack_affinity, pack_segments, plan_metrics, varlen,
    };
}
