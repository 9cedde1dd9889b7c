//! Binding of `fastpack_core::materialize`: reads the token data in place (int32 or int64
//! values and offsets, uint8 masks), releases the GIL, and moves the rows into numpy.

use fastpack_core::materialize::{self as core, Layout, MaterializeOptions, Sources};
use fastpack_core::pool;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::column::ListColumn;
use crate::{fastpack_error, guarded, to_py, PlanArgs};

/// `materialize(plan, packs, tokens, labels, loss_mask, ...)`: the chosen packs
/// as training rows; see `fastpack.materialize` for the arguments (the token data are
/// `ListColumn`s). Returns a dict of flat numpy arrays (`rows * width` tokens, row-major)
/// and counts.
#[pyfunction]
#[pyo3(signature = (
    plan, packs, tokens, labels=None, loss_mask=None, separator_id=None,
    train_separators=false, layout="flat", pad_to=None, pad_to_multiple_of=1, pad_id=0,
    threads=None
))]
#[allow(clippy::too_many_arguments)]
pub fn materialize<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    packs: PyReadonlyArray1<'py, i64>,
    tokens: PyRef<'py, ListColumn>,
    labels: Option<PyRef<'py, ListColumn>>,
    loss_mask: Option<PyRef<'py, ListColumn>>,
    separator_id: Option<i64>,
    train_separators: bool,
    layout: &str,
    pad_to: Option<u64>,
    pad_to_multiple_of: u64,
    pad_id: i64,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let plan = plan.plan_ref()?;
    let layout = match layout {
        "flat" => Layout::Flat,
        "rows" => Layout::Rows,
        other => {
            return Err(fastpack_error(&format!(
                "layout: unknown value {other:?}; expected \"flat\" or \"rows\""
            )))
        }
    };
    let sources = Sources {
        tokens: tokens.column(py)?,
        labels: labels.as_ref().map(|c| c.column(py)).transpose()?,
        loss_mask: loss_mask.as_ref().map(|c| c.column(py)).transpose()?,
    };
    let opts = MaterializeOptions {
        separator_id,
        train_separators,
        layout,
        width: pad_to,
        pad_to_multiple_of,
        pad_id,
    };
    let packs = packs.as_slice()?;
    let rows = py
        .detach(|| {
            pool::install(threads, || guarded(|| core::materialize(&plan, &sources, packs, &opts)))
        })
        .map_err(to_py)?
        .map_err(to_py)?;

    let d = PyDict::new(py);
    d.set_item("rows", rows.rows)?;
    d.set_item("width", rows.width)?;
    d.set_item("max_seqlen", rows.max_seqlen)?;
    d.set_item("num_targets", rows.num_targets)?;
    // The same word as `Plan.total_tokens`: tokens of the packs, separators included.
    d.set_item("total_tokens", rows.num_tokens)?;
    // Moved, not copied: numpy takes ownership of each Vec's buffer.
    d.set_item("input_ids", rows.input_ids.into_pyarray(py))?;
    d.set_item("position_ids", rows.position_ids.into_pyarray(py))?;
    d.set_item("labels", rows.labels.into_pyarray(py))?;
    d.set_item("seq_idx", rows.seq_idx.into_pyarray(py))?;
    d.set_item("cu_seqlens", rows.cu_seqlens.into_pyarray(py))?;
    Ok(d)
}

/// `flatten_int_lists(rows, mask)`: a Python list of lists of ints as `(values, offsets)`
/// (int64, or uint8 0/1 when `mask`), read straight from the list objects: the collator's
/// per-batch conversion, several times faster than going through numpy per row.
#[pyfunction]
#[pyo3(signature = (rows, mask=false))]
pub fn flatten_int_lists<'py>(
    py: Python<'py>,
    rows: &Bound<'py, PyList>,
    mask: bool,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArray1<i64>>)> {
    let mut offsets = Vec::with_capacity(rows.len() + 1);
    offsets.push(0i64);
    let mut total = 0usize;
    for row in rows.iter() {
        let row = row
            .cast_into::<PyList>()
            .map_err(|_| fastpack_error("rows: expected a list of lists of ints"))?;
        total += row.len();
        offsets.push(total as i64);
    }
    let bad =
        |i: usize| fastpack_error(&format!("rows: row {i} holds a value that is not an integer"));
    if mask {
        let mut values = Vec::with_capacity(total);
        for (i, row) in rows.iter().enumerate() {
            for v in row.cast_into::<PyList>()?.iter() {
                values.push((v.extract::<i64>().map_err(|_| bad(i))? != 0) as u8);
            }
        }
        return Ok((values.into_pyarray(py).into_any(), offsets.into_pyarray(py)));
    }
    let mut values = Vec::with_capacity(total);
    for (i, row) in rows.iter().enumerate() {
        for v in row.cast_into::<PyList>()?.iter() {
            values.push(v.extract::<i64>().map_err(|_| bad(i))?);
        }
    }
    Ok((values.into_pyarray(py).into_any(), offsets.into_pyarray(py)))
}
