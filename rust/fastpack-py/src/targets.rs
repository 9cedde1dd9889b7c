//! Binding of `fastpack_core::targets`: the targets of every segment of a plan, read from
//! the token data in place, with the GIL released.

use fastpack_core::pool;
use fastpack_core::targets as core;
use fastpack_core::targets::{Ragged, Sources};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::materialize::{optional_ints, IntArray};
use crate::{fastpack_error, guarded, plan_ref, to_py};

/// `segment_targets(plan arrays..., tokens, token_offsets, ...)`: labels other than -100
/// that `materialize` gives each segment (uint32 [S]).
#[pyfunction]
#[pyo3(signature = (
    sample_ids, starts, seqlens, reserve, strategy, overlong, tokens, token_offsets,
    labels=None, label_offsets=None, loss_mask=None, mask_offsets=None, separator_id=None,
    train_separators=false, threads=None
))]
#[allow(clippy::too_many_arguments)]
pub fn segment_targets<'py>(
    py: Python<'py>,
    sample_ids: PyReadonlyArray1<'py, i64>,
    starts: PyReadonlyArray1<'py, i64>,
    seqlens: PyReadonlyArray1<'py, i32>,
    reserve: u64,
    strategy: &str,
    overlong: &str,
    tokens: &Bound<'py, PyAny>,
    token_offsets: &Bound<'py, PyAny>,
    labels: Option<&Bound<'py, PyAny>>,
    label_offsets: Option<&Bound<'py, PyAny>>,
    loss_mask: Option<PyReadonlyArray1<'py, u8>>,
    mask_offsets: Option<&Bound<'py, PyAny>>,
    separator_id: Option<i64>,
    train_separators: bool,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if !(sample_ids.is_contiguous() && starts.is_contiguous() && seqlens.is_contiguous()) {
        return Err(fastpack_error("plan: expected contiguous arrays"));
    }
    let plan = plan_ref(&sample_ids, &starts, &seqlens, &[], reserve, strategy, overlong)?;
    let token_values = IntArray::extract("tokens", tokens)?;
    let token_offsets = IntArray::extract("token_offsets", token_offsets)?;
    let label_values = optional_ints("labels", labels)?;
    let label_offsets = optional_ints("label_offsets", label_offsets)?;
    let mask_offsets = optional_ints("mask_offsets", mask_offsets)?;
    if label_values.is_some() != label_offsets.is_some()
        || loss_mask.is_some() != mask_offsets.is_some()
    {
        return Err(fastpack_error(
            "labels, loss_mask: pass the values and their offsets together",
        ));
    }
    if loss_mask.as_ref().is_some_and(|m| !m.is_contiguous()) {
        return Err(fastpack_error("loss_mask: expected a contiguous array"));
    }
    let sources = Sources {
        tokens: Ragged { values: token_values.ints(), offsets: token_offsets.ints() },
        labels: match (&label_values, &label_offsets) {
            (Some(v), Some(o)) => Some(Ragged { values: v.ints(), offsets: o.ints() }),
            _ => None,
        },
        loss_mask: match (&loss_mask, &mask_offsets) {
            (Some(v), Some(o)) => Some(Ragged { values: v.as_slice()?, offsets: o.ints() }),
            _ => None,
        },
    };
    let counts = py
        .detach(|| {
            pool::install(threads, || {
                guarded(|| core::segment_targets(&plan, &sources, separator_id, train_separators))
            })
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(counts.into_pyarray(py))
}
