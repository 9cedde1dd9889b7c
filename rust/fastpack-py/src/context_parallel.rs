//! Binding of `fastpack_core::context_parallel`: CP layouts of a stream (a packed row's
//! `cu_seqlens`) and of many streams (a plan's packs or a dataset's steps), with the GIL
//! released.

use fastpack_core::context_parallel::{self as core, CpMode, CpSpec, StreamLayout};
use fastpack_core::{pool, Error};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{fastpack_error, guarded, to_py};

fn spec(cp_size: u64, mode: &str, pad_multiple: u64) -> PyResult<CpSpec> {
    CpSpec::new(cp_size, CpMode::parse(mode).map_err(to_py)?, pad_multiple).map_err(to_py)
}

fn contiguous<'a, T: numpy::Element>(
    name: &str,
    array: &'a PyReadonlyArray1<'_, T>,
) -> PyResult<&'a [T]> {
    array.as_slice().map_err(|_| fastpack_error(&format!("{name}: expected a contiguous array")))
}

fn layout(cu: &[i32], spec: CpSpec) -> Result<StreamLayout, Error> {
    core::stream_layout(cu, spec)
}

type Stream<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<u64>>);

/// `cp_stream(cu_seqlens, cp_size, mode, pad_multiple)`: `(cu_seqlens_padded, work)` of
/// one stream — int32 [N+1] and each rank's attention work, uint64 [cp].
#[pyfunction]
pub fn cp_stream<'py>(
    py: Python<'py>,
    cu_seqlens: PyReadonlyArray1<'py, i32>,
    cp_size: u64,
    mode: &str,
    pad_multiple: u64,
) -> PyResult<Stream<'py>> {
    let spec = spec(cp_size, mode, pad_multiple)?;
    let cu = contiguous("cu_seqlens", &cu_seqlens)?;
    let (padded, work) = py
        .detach(|| {
            guarded(|| {
                let l = layout(cu, spec)?;
                let work = core::stream_work(&l);
                Ok((l.cu_seqlens_padded, work))
            })
        })
        .map_err(to_py)?;
    Ok((padded.into_pyarray(py), work.into_pyarray(py)))
}

type Tokens<'py> =
    (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// `cp_rank_tokens(cu_seqlens, cp_size, mode, pad_multiple, rank)`: the rank's
/// `(indices, positions, sources)`, int64 each (see `RankTokens`).
#[pyfunction]
#[pyo3(signature = (cu_seqlens, cp_size, mode, pad_multiple, rank, threads=None))]
pub fn cp_rank_tokens<'py>(
    py: Python<'py>,
    cu_seqlens: PyReadonlyArray1<'py, i32>,
    cp_size: u64,
    mode: &str,
    pad_multiple: u64,
    rank: u64,
    threads: Option<usize>,
) -> PyResult<Tokens<'py>> {
    let spec = spec(cp_size, mode, pad_multiple)?;
    let cu = contiguous("cu_seqlens", &cu_seqlens)?;
    let tokens = py
        .detach(|| {
            pool::install(threads, || guarded(|| core::rank_tokens(&layout(cu, spec)?, rank)))
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok((
        tokens.indices.into_pyarray(py),
        tokens.positions.into_pyarray(py),
        tokens.sources.into_pyarray(py),
    ))
}

/// `cp_rank_attention(cu_seqlens, cp_size, mode, pad_multiple, rank)`: a dict of the
/// rank's runs and keys (see `RankAttention`).
#[pyfunction]
#[pyo3(signature = (cu_seqlens, cp_size, mode, pad_multiple, rank, threads=None))]
pub fn cp_rank_attention<'py>(
    py: Python<'py>,
    cu_seqlens: PyReadonlyArray1<'py, i32>,
    cp_size: u64,
    mode: &str,
    pad_multiple: u64,
    rank: u64,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let spec = spec(cp_size, mode, pad_multiple)?;
    let cu = contiguous("cu_seqlens", &cu_seqlens)?;
    let a = py
        .detach(|| {
            pool::install(threads, || guarded(|| core::rank_attention(&layout(cu, spec)?, rank)))
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("cu_seqlens_q", a.cu_seqlens_q.into_pyarray(py))?;
    d.set_item("cu_seqlens_k", a.cu_seqlens_k.into_pyarray(py))?;
    d.set_item("max_seqlen_q", a.max_seqlen_q)?;
    d.set_item("max_seqlen_k", a.max_seqlen_k)?;
    d.set_item("run_sequences", a.run_sequences.into_pyarray(py))?;
    d.set_item("local_k_slice", a.local_k_slice)?;
    match a.k_index {
        Some(index) => d.set_item("k_index", index.into_pyarray(py))?,
        None => d.set_item("k_index", py.None())?,
    }
    Ok(d)
}

type Streams<'py> = (Bound<'py, PyArray1<i64>>, Option<Bound<'py, PyArray1<u64>>>);

/// `cp_streams(seqlens, offsets, cp_size, mode, pad_multiple, threads=None, work=True)`:
/// `(padded_tokens, work)` of every stream `offsets[i]:offsets[i+1]` of `seqlens`; `work`
/// is row-major [P * cp], or None with `work=False` (only the padded tokens computed).
#[pyfunction]
#[pyo3(signature = (seqlens, offsets, cp_size, mode, pad_multiple, threads=None, work=true))]
#[allow(clippy::too_many_arguments)]
pub fn cp_streams<'py>(
    py: Python<'py>,
    seqlens: PyReadonlyArray1<'py, i32>,
    offsets: PyReadonlyArray1<'py, i64>,
    cp_size: u64,
    mode: &str,
    pad_multiple: u64,
    threads: Option<usize>,
    work: bool,
) -> PyResult<Streams<'py>> {
    let spec = spec(cp_size, mode, pad_multiple)?;
    let (s, o) = (contiguous("seqlens", &seqlens)?, contiguous("offsets", &offsets)?);
    let out = py
        .detach(|| pool::install(threads, || guarded(|| core::streams_layout(s, o, spec, work))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok((out.padded_tokens.into_pyarray(py), work.then(|| out.work.into_pyarray(py))))
}

/// Calls `$run` with `$lengths` as a slice of int32 or int64 (the dtypes `pack` passes).
macro_rules! with_lengths {
    ($lengths:expr, |$l:ident| $run:expr) => {{
        if let Ok(array) = $lengths.extract::<PyReadonlyArray1<'_, i64>>() {
            let $l = contiguous("lengths", &array)?;
            $run
        } else if let Ok(array) = $lengths.extract::<PyReadonlyArray1<'_, i32>>() {
            let $l = contiguous("lengths", &array)?;
            $run
        } else {
            Err(fastpack_error("lengths: expected a 1-D int32 or int64 numpy array"))
        }
    }};
}

type Planned<'py> = (Option<Bound<'py, PyArray1<i64>>>, u64, Option<usize>, u64, u64);

/// `cp_plan_lengths(lengths, cp_size, mode, pad_multiple, reserve, top, threads=None)`:
/// `(planned, overlong, first_overlong, overlong_tokens, overlong_excess)` (see
/// `PlannedLengths`; `planned` is None outside zigzag).
#[pyfunction]
#[pyo3(signature = (lengths, cp_size, mode, pad_multiple, reserve, top, threads=None))]
#[allow(clippy::too_many_arguments)]
pub fn cp_plan_lengths<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyAny>,
    cp_size: u64,
    mode: &str,
    pad_multiple: u64,
    reserve: u64,
    top: u64,
    threads: Option<usize>,
) -> PyResult<Planned<'py>> {
    let spec = spec(cp_size, mode, pad_multiple)?;
    let out = with_lengths!(lengths, |l| py
        .detach(|| pool::install(threads, || guarded(|| core::plan_lengths(l, spec, reserve, top))))
        .map_err(to_py)?
        .map_err(to_py))?;
    let zigzag = spec.mode == CpMode::Zigzag;
    Ok((
        zigzag.then(|| out.planned.into_pyarray(py)),
        out.overlong,
        out.first_overlong,
        out.overlong_tokens,
        out.overlong_excess,
    ))
}

/// The segments of a plan being built (the dict `pack` returns), read by key: zigzag
/// writes their real lengths over the planned ones in place.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct PlanFields<'py> {
    seqlens: PyReadwriteArray1<'py, i32>,
    sample_ids: PyReadonlyArray1<'py, i64>,
    starts: PyReadonlyArray1<'py, i64>,
}

/// `cp_real_seqlens(plan, lengths, reserve, threads=None)`: a zigzag plan's `seqlens`
/// (int32, written in place in `plan`, the dict `pack` returns) mapped back from the
/// planned lengths to the real ones (see `real_seqlens`).
#[pyfunction]
#[pyo3(signature = (plan, lengths, reserve, threads=None))]
pub fn cp_real_seqlens<'py>(
    py: Python<'py>,
    plan: PlanFields<'py>,
    lengths: &Bound<'py, PyAny>,
    reserve: u64,
    threads: Option<usize>,
) -> PyResult<()> {
    let PlanFields { mut seqlens, sample_ids, starts } = plan;
    let (ids, st) = (contiguous("sample_ids", &sample_ids)?, contiguous("starts", &starts)?);
    let out = seqlens
        .as_slice_mut()
        .map_err(|_| fastpack_error("seqlens: expected a contiguous array"))?;
    with_lengths!(lengths, |l| py
        .detach(|| {
            pool::install(threads, || guarded(|| core::real_seqlens(out, ids, st, l, reserve)))
        })
        .map_err(to_py)?
        .map_err(to_py))
}
