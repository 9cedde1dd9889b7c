//! Binding of `fastpack_core::column` and `fastpack_core::gather`: a `ListColumn` holds
//! the buffers of a list column (numpy views of Arrow buffers, every chunk, an optional
//! indices mapping) once, so that each later call reads them without converting anything.

use fastpack_core::column::{self, Column, Dtype, Indices, Ints, ListChunk, Values};
use fastpack_core::gather::{self as core, Buffer, GatherOptions, PlanRef};
use fastpack_core::pool;
use numpy::prelude::*;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyUntypedArray};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::{fastpack_error, guarded, to_py, PlanArgs};

/// A list column read in place: chunks of `(offsets, values, value_offset, value_len)`
/// — int32/int64 offsets, and the value buffer as any contiguous 1-D numpy array whose
/// bytes hold `value_len` values of `dtype` from value (for `bool`, bit) `value_offset` —
/// and an optional indices mapping (int64 arrays in row order). The arrays are kept
/// alive, and read in place, as long as the column lives; every use first checks that
/// none of them was resized or reallocated since (`ndarray.resize(refcheck=False)` frees
/// the buffer under a live view). Writing into them while a call runs is the caller's race.
#[pyclass(frozen, module = "fastpack._core")]
pub struct ListColumn {
    // Borrows from `owners`; declared first so it is dropped first.
    column: Column<'static>,
    owners: Vec<Py<PyUntypedArray>>,
    /// Where each owner's data lay when the column was made: (address, bytes).
    spans: Vec<(usize, usize)>,
}

/// The address and size of a numpy array's data.
fn span_of(array: &Bound<'_, PyUntypedArray>) -> (usize, usize) {
    // SAFETY: reads two fields of a live array object (the GIL is held).
    let data = unsafe { (*array.as_array_ptr()).fields.data } as usize;
    (data, array.len() * array.dtype().itemsize())
}

/// The bytes of a contiguous 1-D numpy array, for as long as the array lives.
fn bytes_of(arg: &str, array: &Bound<'_, PyUntypedArray>) -> PyResult<&'static [u8]> {
    if array.ndim() != 1 || !array.is_c_contiguous() {
        return Err(fastpack_error(&format!("{arg}: expected a contiguous 1-D array")));
    }
    let nbytes = array.len() * array.dtype().itemsize();
    if nbytes == 0 {
        return Ok(&[]);
    }
    // SAFETY: the data pointer of a contiguous array holds `nbytes` bytes; the caller keeps
    // a reference to the array (which keeps its buffer alive) as long as the slice is used.
    Ok(unsafe {
        std::slice::from_raw_parts((*array.as_array_ptr()).fields.data as *const u8, nbytes)
    })
}

/// An int32 / int64 array as `Ints`, for as long as the array lives.
fn ints_of(arg: &str, obj: &Bound<'_, PyAny>) -> PyResult<Ints<'static>> {
    let aligned = |p: *const u8, a: usize| (p as usize) % a == 0;
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let b = bytes_of(arg, a.as_untyped())?;
        if aligned(b.as_ptr(), 8) {
            // SAFETY: aligned, and as long as the array (see `bytes_of`).
            return Ok(Ints::I64(unsafe {
                std::slice::from_raw_parts(b.as_ptr() as *const i64, b.len() / 8)
            }));
        }
    } else if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let b = bytes_of(arg, a.as_untyped())?;
        if aligned(b.as_ptr(), 4) {
            // SAFETY: as above.
            return Ok(Ints::I32(unsafe {
                std::slice::from_raw_parts(b.as_ptr() as *const i32, b.len() / 4)
            }));
        }
    }
    Err(fastpack_error(&format!("{arg}: expected an aligned 1-D int32 or int64 numpy array")))
}

type ChunkSpec<'py> = (Bound<'py, PyAny>, Bound<'py, PyUntypedArray>, usize, usize);

#[pymethods]
impl ListColumn {
    #[new]
    #[pyo3(signature = (name, dtype, chunks, indices=None))]
    fn new(
        name: String,
        dtype: &str,
        chunks: Vec<ChunkSpec<'_>>,
        indices: Option<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<Self> {
        let dtype = Dtype::parse(dtype).map_err(to_py)?;
        let mut owners: Vec<Py<PyUntypedArray>> = Vec::with_capacity(2 * chunks.len());
        let mut parts = Vec::with_capacity(chunks.len());
        for (offsets, buffer, value_offset, value_len) in &chunks {
            let bytes = bytes_of("values", buffer)?;
            let values = Values::new(bytes, dtype, *value_offset, *value_len).map_err(to_py)?;
            parts.push(ListChunk { offsets: ints_of("offsets", offsets)?, values });
            owners.push(untyped("offsets", offsets)?);
            owners.push(buffer.clone().unbind());
        }
        let indices = match indices {
            None => None,
            Some(arrays) => {
                let mut slices = Vec::with_capacity(arrays.len());
                for a in &arrays {
                    match ints_of("indices", a)? {
                        Ints::I64(s) => slices.push(s),
                        Ints::I32(_) => {
                            return Err(fastpack_error("indices: expected int64 arrays"));
                        }
                    }
                    owners.push(untyped("indices", a)?);
                }
                Some(Indices::new(slices))
            }
        };
        let column = Column::new(name, parts, indices).map_err(to_py)?;
        let spans = Python::attach(|py| owners.iter().map(|o| span_of(o.bind(py))).collect());
        Ok(Self { column, owners, spans })
    }

    #[getter]
    fn name(&self) -> &str {
        self.column.name()
    }

    /// The value type: int8 .. uint64, float16 .. float64 or bool.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.column.dtype().name()
    }

    /// Rows, through the indices mapping if there is one.
    #[getter]
    fn rows(&self) -> usize {
        self.column.rows()
    }

    #[getter]
    fn num_chunks(&self) -> usize {
        self.column.num_chunks()
    }

    fn __len__(&self) -> usize {
        self.column.rows()
    }

    fn __repr__(&self) -> String {
        format!(
            "ListColumn({:?}, {} rows, {} chunk(s) of {})",
            self.column.name(),
            self.column.rows(),
            self.column.num_chunks(),
            self.column.dtype().name()
        )
    }
}

impl ListColumn {
    /// The column, after checking that every array it reads still lies where it did.
    pub(crate) fn column(&self, py: Python<'_>) -> PyResult<&Column<'_>> {
        for (owner, &(data, bytes)) in self.owners.iter().zip(&self.spans) {
            let (now, now_bytes) = span_of(owner.bind(py));
            if bytes > 0 && (now != data || now_bytes < bytes) {
                return Err(fastpack_error(&format!(
                    "{}: an array this column reads was resized or reallocated after the \
                     column was made (fastpack reads numpy arrays in place); build the data \
                     again from the new array",
                    self.column.name()
                )));
            }
        }
        Ok(&self.column)
    }
}

fn untyped(arg: &str, obj: &Bound<'_, PyAny>) -> PyResult<Py<PyUntypedArray>> {
    obj.cast::<PyUntypedArray>()
        .map(|a| a.clone().unbind())
        .map_err(|_| fastpack_error(&format!("{arg}: expected a numpy array")))
}

/// `column_lengths(columns, threads)`: the row lengths (int64) of `columns[0]`, after
/// checking every row of every column (offsets, indices, and that each column has as
/// many values per row as the first).
#[pyfunction]
#[pyo3(signature = (columns, threads=None))]
pub fn column_lengths<'py>(
    py: Python<'py>,
    columns: Vec<PyRef<'py, ListColumn>>,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let cols: Vec<Column<'_>> =
        columns.iter().map(|c| c.column(py).cloned()).collect::<PyResult<_>>()?;
    let lengths = py
        .detach(|| pool::install(threads, || guarded(|| column::lengths(&cols))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(lengths.into_pyarray(py))
}

/// `pack_tokens(plan, packs)`: tokens (int64) in each of `packs`.
#[pyfunction]
pub fn pack_tokens<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    packs: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let plan = plan.plan_ref()?;
    let packs = packs.as_slice()?;
    let tokens = py.detach(|| guarded(|| core::pack_tokens(&plan, packs))).map_err(to_py)?;
    Ok(tokens.into_pyarray(py))
}

/// `gather(plan, packs, columns, separator_values, position_ids, threads)`: the
/// packs as packed columns; see `fastpack.gather`. `separator_values` holds each column's
/// separator value as 8 little-endian bytes. Returns a dict of numpy arrays: `offsets`,
/// `seq_offsets`, `position_ids` (int64), `seq_lengths` (int32), and `columns`, one entry per column:
/// its values (uint8..uint64 by width), or `(bits, len)` for booleans.
#[pyfunction]
#[pyo3(signature = (
    plan, packs, columns, separator_values, position_ids=true, threads=None
))]
pub fn gather<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    packs: PyReadonlyArray1<'py, i64>,
    columns: Vec<PyRef<'py, ListColumn>>,
    separator_values: Vec<Vec<u8>>,
    position_ids: bool,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let plan = PlanRef { parents: None, ..plan.plan_ref()? }; // gather reads flat plans
    let packs = packs.as_slice()?;
    let mut separators = Vec::with_capacity(separator_values.len());
    for value in &separator_values {
        let mut b = [0u8; 8];
        if value.len() > 8 {
            return Err(fastpack_error("separator_values: expected at most 8 bytes per column"));
        }
        b[..value.len()].copy_from_slice(value);
        separators.push(b);
    }
    let opts = GatherOptions { separator_values: separators, position_ids };
    let cols: Vec<Column<'_>> =
        columns.iter().map(|c| c.column(py).cloned()).collect::<PyResult<_>>()?;
    let out = py
        .detach(|| pool::install(threads, || guarded(|| core::gather(&plan, packs, &cols, &opts))))
        .map_err(to_py)?
        .map_err(to_py)?;

    let d = PyDict::new(py);
    let values = PyList::empty(py);
    for b in out.columns {
        // Moved, not copied: numpy takes ownership of each Vec's buffer.
        match b {
            Buffer::U8(v) => values.append(v.into_pyarray(py))?,
            Buffer::U16(v) => values.append(v.into_pyarray(py))?,
            Buffer::U32(v) => values.append(v.into_pyarray(py))?,
            Buffer::U64(v) => values.append(v.into_pyarray(py))?,
            Buffer::Bits { bits, len } => values.append((bits.into_pyarray(py), len))?,
        }
    }
    d.set_item("columns", values)?;
    d.set_item("offsets", out.offsets.into_pyarray(py))?;
    d.set_item("seq_offsets", out.seq_offsets.into_pyarray(py))?;
    d.set_item("seq_lengths", out.seq_lengths.into_pyarray(py))?;
    d.set_item("position_ids", out.position_ids.into_pyarray(py))?;
    Ok(d)
}
