//! Binding of `fastpack_core::schedule`: a sampler's per-epoch orders, with the GIL
//! released.

use fastpack_core::schedule as core;
use fastpack_core::{pool, Error};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::{fastpack_error, guarded, to_py};

/// `permutation(n, seed)`: a uniformly random permutation of `0..n` (uint32).
#[pyfunction]
#[pyo3(signature = (n, seed, threads=None))]
pub fn permutation(
    py: Python<'_>,
    n: usize,
    seed: u64,
    threads: Option<usize>,
) -> PyResult<Bound<'_, PyArray1<u32>>> {
    if n > u32::MAX as usize {
        return Err(fastpack_error(&format!("n: got {n}; at most 2^32 - 1 items")));
    }
    let perm = py
        .detach(|| pool::install(threads, || guarded(|| core::permutation(n, seed))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(perm.into_pyarray(py))
}

/// `by_cost(cost, seed)`: indices in ascending order of `cost` (float64, finite, >= 0),
/// ties in an order drawn from `seed` (uint32).
#[pyfunction]
#[pyo3(signature = (cost, seed, threads=None))]
pub fn by_cost<'py>(
    py: Python<'py>,
    cost: PyReadonlyArray1<'py, f64>,
    seed: u64,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let cost = cost.as_slice().map_err(|_| fastpack_error("cost: expected a contiguous array"))?;
    if cost.len() > u32::MAX as usize {
        return Err(fastpack_error("cost: at most 2^32 - 1 steps"));
    }
    if let Some(bad) = cost.iter().find(|c| !c.is_finite() || **c < 0.0) {
        return Err(fastpack_error(&format!("cost: {bad} is not a finite non-negative number")));
    }
    let order = py
        .detach(|| pool::install(threads, || guarded(|| Ok::<_, Error>(core::by_cost(cost, seed)))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(order.into_pyarray(py))
}

/// `step_sums(seqlens, segment_targets, segment_offsets)`: per-step tokens, Σl², targets
/// and sequences with a target (four int64 arrays).
#[pyfunction]
#[pyo3(signature = (seqlens, segment_targets, segment_offsets, threads=None))]
#[allow(clippy::type_complexity)]
pub fn step_sums<'py>(
    py: Python<'py>,
    seqlens: PyReadonlyArray1<'py, i32>,
    segment_targets: PyReadonlyArray1<'py, u32>,
    segment_offsets: PyReadonlyArray1<'py, i64>,
    threads: Option<usize>,
) -> PyResult<(
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
)> {
    let contiguous = |_| fastpack_error("step_sums: expected contiguous arrays");
    let (seqlens, targets, offsets) = (
        seqlens.as_slice().map_err(contiguous)?,
        segment_targets.as_slice().map_err(contiguous)?,
        segment_offsets.as_slice().map_err(contiguous)?,
    );
    let [tokens, squared, targets, sequences] = py
        .detach(|| {
            pool::install(threads, || guarded(|| core::step_sums(seqlens, targets, offsets)))
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok((
        tokens.into_pyarray(py),
        squared.into_pyarray(py),
        targets.into_pyarray(py),
        sequences.into_pyarray(py),
    ))
}

/// `lpt_groups(group, cost, tokens, bins, token_cap, cost_cap)`: each unit's bin (int64,
/// -1: no room) and each group's failure (bool), longest-processing-time first inside
/// every group under the caps (see `fastpack_core::schedule::lpt_groups`).
#[pyfunction]
#[pyo3(signature = (group, cost, tokens, bins, token_cap, cost_cap, threads=None))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn lpt_groups<'py>(
    py: Python<'py>,
    group: PyReadonlyArray1<'py, i64>,
    cost: PyReadonlyArray1<'py, f64>,
    tokens: PyReadonlyArray1<'py, f64>,
    bins: PyReadonlyArray1<'py, i64>,
    token_cap: f64,
    cost_cap: f64,
    threads: Option<usize>,
) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<bool>>)> {
    let group =
        group.as_slice().map_err(|_| fastpack_error("group: expected a contiguous array"))?;
    let bins = bins.as_slice().map_err(|_| fastpack_error("bins: expected a contiguous array"))?;
    let cost = cost.as_slice().map_err(|_| fastpack_error("cost: expected a contiguous array"))?;
    let tokens =
        tokens.as_slice().map_err(|_| fastpack_error("tokens: expected a contiguous array"))?;
    let (placed, failed) = py
        .detach(|| {
            pool::install(threads, || {
                guarded(|| core::lpt_groups(group, cost, tokens, bins, token_cap, cost_cap))
            })
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok((placed.into_pyarray(py), failed.into_pyarray(py)))
}
