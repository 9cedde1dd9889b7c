//! Binding of `fastpack_core::targets`: the targets of every segment of a plan, read from
//! the token data's `ListColumn`s in place (as `materialize` reads them), with the GIL
//! released.

use fastpack_core::materialize::Sources;
use fastpack_core::pool;
use fastpack_core::targets as core;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::column::ListColumn;
use crate::{guarded, to_py, PlanArgs};

/// `segment_targets(plan, tokens, labels, loss_mask, ...)`: labels other than
/// -100 that `materialize` gives each segment (uint32 [S]), a token of `ignore_tokens`
/// never one. The token values are read only with `ignore_tokens` (else only their row
/// lengths); labels and mask are read in place.
#[pyfunction]
#[pyo3(signature = (
    plan, tokens, labels=None, loss_mask=None, separator_id=None, train_separators=false,
    threads=None, ignore_tokens=None
))]
#[allow(clippy::too_many_arguments)]
pub fn segment_targets<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    tokens: PyRef<'py, ListColumn>,
    labels: Option<PyRef<'py, ListColumn>>,
    loss_mask: Option<PyRef<'py, ListColumn>>,
    separator_id: Option<i64>,
    train_separators: bool,
    threads: Option<usize>,
    ignore_tokens: Option<Vec<i64>>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let ignore = ignore_tokens.unwrap_or_default();
    // A segment's targets are its sequence's (a flat plan's segments; trees have theirs).
    let plan = fastpack_core::materialize::PlanRef { parents: None, ..plan.plan_ref()? };
    let sources = Sources {
        tokens: tokens.column(py)?,
        labels: labels.as_ref().map(|c| c.column(py)).transpose()?,
        loss_mask: loss_mask.as_ref().map(|c| c.column(py)).transpose()?,
    };
    let counts = py
        .detach(|| {
            pool::install(threads, || {
                guarded(|| {
                    core::segment_targets(&plan, &sources, separator_id, train_separators, &ignore)
                })
            })
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(counts.into_pyarray(py))
}
