//! List columns read in place: the Arrow layout of a Hugging Face `datasets` column or a
//! pyarrow `ListArray` / `ChunkedArray`, as it lies in memory.
//!
//! A [`Column`] is a list of chunks (no concatenation), each with int32 or int64 `offsets`
//! (sliced arrays included: `offsets[0]` need not be 0) into a value buffer of any
//! fixed-width type, or of bit-packed booleans. An optional [`Indices`] mapping (what
//! `datasets` keeps after `shuffle`, `select` or `filter`) is read through, never applied:
//! row `r` of the column is physical row `indices[r]`.
//!
//! Rows are checked when they are read (offsets monotone and inside the values, the index
//! inside the table), so reading a few rows out of a large column costs those rows.
//!
//! ```
//! use fastpack_core::column::{Column, Indices, Ints, ListChunk, Values};
//! let chunks = vec![
//!     ListChunk { offsets: Ints::I32(&[0, 1, 3]), values: Values::of(&[10i32, 11, 12]) },
//!     ListChunk { offsets: Ints::I64(&[0, 2]), values: Values::of(&[20i32, 21]) },
//! ];
//! let column = Column::new("input_ids", chunks.clone(), None).unwrap();
//! assert_eq!(column.lengths().unwrap(), [1, 2, 2]);
//! // After `dataset.select([2, 0])`: rows are read through the mapping.
//! let selected = Column::new("input_ids", chunks, Some(Indices::new(vec![&[2, 0]]))).unwrap();
//! assert_eq!(selected.lengths().unwrap(), [2, 1]);
//! ```

use rayon::prelude::*;

use crate::error::{Error, Result};

/// An integer array read in place: int32 or int64 (token ids, labels or offsets).
#[derive(Debug, Clone, Copy)]
pub enum Ints<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl Ints<'_> {
    pub fn len(&self) -> usize {
        match self {
            Ints::I32(v) => v.len(),
            Ints::I64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            Ints::I32(v) => v[i] as i64,
            Ints::I64(v) => v[i],
        }
    }
}

/// The type of a column's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Int8,
    Int16,
    Int32,
    Int64,
    UInt8,
    UInt16,
    UInt32,
    UInt64,
    Float16,
    Float32,
    Float64,
    /// Bit-packed, as Arrow stores booleans.
    Bool,
}

impl Dtype {
    pub const NAMES: &'static str =
        "int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, float64 or bool";

    /// Parses numpy / Arrow names (`"int32"`, `"float"`, `"halffloat"`, `"bool"`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "int8" => Self::Int8,
            "int16" => Self::Int16,
            "int32" => Self::Int32,
            "int64" => Self::Int64,
            "uint8" => Self::UInt8,
            "uint16" => Self::UInt16,
            "uint32" => Self::UInt32,
            "uint64" => Self::UInt64,
            "float16" | "halffloat" => Self::Float16,
            "float32" | "float" => Self::Float32,
            "float64" | "double" => Self::Float64,
            "bool" => Self::Bool,
            other => {
                return Err(Error::invalid(
                    "dtype",
                    format!("unsupported value type {other:?}; expected {}", Self::NAMES),
                ))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Int8 => "int8",
            Self::Int16 => "int16",
            Self::Int32 => "int32",
            Self::Int64 => "int64",
            Self::UInt8 => "uint8",
            Self::UInt16 => "uint16",
            Self::UInt32 => "uint32",
            Self::UInt64 => "uint64",
            Self::Float16 => "float16",
            Self::Float32 => "float32",
            Self::Float64 => "float64",
            Self::Bool => "bool",
        }
    }

    /// Bytes per value in memory; booleans are read from bits and written as bits, but
    /// gathered through one byte each.
    pub fn width(self) -> usize {
        match self {
            Self::Int8 | Self::UInt8 | Self::Bool => 1,
            Self::Int16 | Self::UInt16 | Self::Float16 => 2,
            Self::Int32 | Self::UInt32 | Self::Float32 => 4,
            Self::Int64 | Self::UInt64 | Self::Float64 => 8,
        }
    }

    pub fn is_integer(self) -> bool {
        !matches!(self, Self::Float16 | Self::Float32 | Self::Float64 | Self::Bool)
    }
}

/// Rust types that are values of a column (for building one from typed slices).
pub trait Native: Copy {
    const DTYPE: Dtype;
}

macro_rules! native {
    ($($t:ty => $d:ident),*) => {$(impl Native for $t { const DTYPE: Dtype = Dtype::$d; })*};
}
native!(i8 => Int8, i16 => Int16, i32 => Int32, i64 => Int64, u8 => UInt8, u16 => UInt16,
        u32 => UInt32, u64 => UInt64, f32 => Float32, f64 => Float64);

/// The value array of one chunk, read in place: `len` values of `dtype` starting at value
/// `offset` of `bytes` (for booleans, at bit `offset`).
#[derive(Debug, Clone, Copy)]
pub struct Values<'a> {
    bytes: &'a [u8],
    dtype: Dtype,
    offset: usize,
    len: usize,
}

impl<'a> Values<'a> {
    /// Checks that `bytes` holds the values and is aligned for their type.
    pub fn new(bytes: &'a [u8], dtype: Dtype, offset: usize, len: usize) -> Result<Self> {
        if len == 0 {
            // Nothing is read; an empty buffer's pointer may be unaligned (numpy, `&[]`).
            const EMPTY: &[u64] = &[];
            // SAFETY: an empty slice at an 8-aligned dangling pointer.
            let empty = unsafe { std::slice::from_raw_parts(EMPTY.as_ptr() as *const u8, 0) };
            return Ok(Self { bytes: empty, dtype, offset: 0, len: 0 });
        }
        let end = offset.checked_add(len).ok_or_else(|| Error::invalid("values", "overflow"))?;
        let needed = match dtype {
            Dtype::Bool => end.div_ceil(8),
            _ => end.saturating_mul(dtype.width()),
        };
        if needed > bytes.len() {
            return Err(Error::invalid(
                "values",
                format!(
                    "{len} {} values from offset {offset} need {needed} bytes; the buffer has {}",
                    dtype.name(),
                    bytes.len()
                ),
            ));
        }
        if dtype != Dtype::Bool && (bytes.as_ptr() as usize) % dtype.width() != 0 {
            return Err(Error::invalid(
                "values",
                format!("the {} buffer is not aligned to {} bytes", dtype.name(), dtype.width()),
            ));
        }
        Ok(Self { bytes, dtype, offset, len })
    }

    /// The values of a typed slice.
    pub fn of<T: Native>(values: &'a [T]) -> Self {
        // SAFETY: plain numbers viewed as their bytes; the slice is aligned for `T`.
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values))
        };
        Self { bytes, dtype: T::DTYPE, offset: 0, len: values.len() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The raw bytes of values `lo..hi` (fixed-width types only).
    #[inline]
    fn raw(&self, lo: usize, hi: usize) -> &'a [u8] {
        let w = self.dtype.width();
        &self.bytes[(self.offset + lo) * w..(self.offset + hi) * w]
    }

    /// Values `lo..hi` as a typed slice (the alignment was checked in [`Values::new`]).
    #[inline]
    fn typed<T: Copy>(&self, lo: usize, hi: usize) -> &'a [T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.width());
        let raw = self.raw(lo, hi);
        // SAFETY: `raw` lies in the buffer, is aligned for the dtype (checked in `new`),
        // and every bit pattern is a valid value of the integer / float types used here.
        unsafe { std::slice::from_raw_parts(raw.as_ptr() as *const T, hi - lo) }
    }

    /// Values `lo..lo + n` as a typed slice, if they are of type `T`.
    #[inline]
    pub(crate) fn slice<T: Native>(&self, lo: usize, n: usize) -> Option<&'a [T]> {
        (self.dtype == T::DTYPE).then(|| self.typed::<T>(lo, lo + n))
    }

    #[inline]
    fn bit(&self, i: usize) -> bool {
        let b = self.offset + i;
        self.bytes[b / 8] >> (b % 8) & 1 == 1
    }

    /// Hints the CPU to start loading the first bytes of value `lo` (a row about to be
    /// copied): rows are read in plan order, scattered over the input.
    #[inline]
    pub(crate) fn prefetch(&self, lo: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let byte = match self.dtype {
                Dtype::Bool => (self.offset + lo) / 8,
                _ => (self.offset + lo) * self.dtype.width(),
            };
            if let Some(p) = self.bytes.get(byte..) {
                for line in (0..p.len().min(256)).step_by(64) {
                    // SAFETY: a hint on an address inside the buffer; it reads nothing.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            p.as_ptr().add(line) as *const i8,
                        )
                    };
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = lo;
    }

    /// Copies values `lo..lo + out.len() / width` as they are (booleans as bytes 0 / 1).
    #[inline]
    pub(crate) fn copy_bytes(&self, lo: usize, out: &mut [u8]) {
        if self.dtype == Dtype::Bool {
            for (k, o) in out.iter_mut().enumerate() {
                *o = self.bit(lo + k) as u8;
            }
        } else {
            out.copy_from_slice(self.raw(lo, lo + out.len() / self.dtype.width()));
        }
    }

    /// Copies integer values `lo..lo + out.len()` widened to i64 (one dispatch per call).
    #[inline]
    pub(crate) fn copy_i64(&self, lo: usize, out: &mut [i64]) {
        let hi = lo + out.len();
        macro_rules! widen {
            ($t:ty) => {
                out.iter_mut().zip(self.typed::<$t>(lo, hi)).for_each(|(o, &x)| *o = x as i64)
            };
        }
        match self.dtype {
            Dtype::Int8 => widen!(i8),
            Dtype::Int16 => widen!(i16),
            Dtype::Int32 => widen!(i32),
            Dtype::Int64 => out.copy_from_slice(self.typed::<i64>(lo, hi)),
            Dtype::UInt8 => widen!(u8),
            Dtype::UInt16 => widen!(u16),
            Dtype::UInt32 => widen!(u32),
            Dtype::UInt64 => widen!(u64),
            // Columns of other types are refused where integers are required.
            _ => out.fill(0),
        }
    }

    /// Calls `f(k)` for every value `lo + k` (k < n) that is zero (false).
    #[inline]
    pub(crate) fn for_each_zero(&self, lo: usize, n: usize, mut f: impl FnMut(usize)) {
        let hi = lo + n;
        macro_rules! zeros {
            ($t:ty, $zero:expr) => {
                for (k, &x) in self.typed::<$t>(lo, hi).iter().enumerate() {
                    if x == $zero {
                        f(k);
                    }
                }
            };
        }
        match self.dtype {
            Dtype::Bool => (0..n).filter(|&k| !self.bit(lo + k)).for_each(f),
            Dtype::Int8 | Dtype::UInt8 => zeros!(u8, 0),
            Dtype::Int16 | Dtype::UInt16 => zeros!(u16, 0),
            Dtype::Int32 | Dtype::UInt32 => zeros!(u32, 0),
            Dtype::Int64 | Dtype::UInt64 => zeros!(u64, 0),
            // -0.0 is zero too (the half float is tested on its bits, sign cleared).
            Dtype::Float16 => {
                for (k, &x) in self.typed::<u16>(lo, hi).iter().enumerate() {
                    if x & 0x7fff == 0 {
                        f(k);
                    }
                }
            }
            Dtype::Float32 => zeros!(f32, 0.0),
            Dtype::Float64 => zeros!(f64, 0.0),
        }
    }
}

/// One chunk of a list column: row `i` is `values[offsets[i]..offsets[i + 1]]`.
#[derive(Debug, Clone, Copy)]
pub struct ListChunk<'a> {
    pub offsets: Ints<'a>,
    pub values: Values<'a>,
}

impl ListChunk<'_> {
    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
}

/// A row-index mapping in chunks (`datasets`' indices table, uint64 read as int64).
#[derive(Debug, Clone)]
pub struct Indices<'a> {
    parts: Vec<&'a [i64]>,
    /// `starts[k]`: rows before part `k`; the last entry is the total.
    starts: Vec<usize>,
}

impl<'a> Indices<'a> {
    pub fn new(parts: Vec<&'a [i64]>) -> Self {
        let starts = prefix(parts.iter().map(|p| p.len()));
        Self { parts, starts }
    }

    pub fn len(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn get(&self, i: usize) -> i64 {
        let (k, local) = locate(&self.starts, i);
        self.parts[k][local]
    }
}

fn prefix(counts: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut starts = vec![0usize];
    let mut acc = 0usize;
    for n in counts {
        acc += n;
        starts.push(acc);
    }
    starts
}

/// The part holding item `i` (< total) and its index inside it.
#[inline]
fn locate(starts: &[usize], i: usize) -> (usize, usize) {
    if starts.len() == 2 {
        return (0, i);
    }
    // The last part whose start is <= i (empty parts are skipped).
    let k = starts.partition_point(|&s| s <= i) - 1;
    (k, i - starts[k])
}

/// Where a row's values lie: chunk `chunk`, values `lo..hi`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub chunk: u32,
    pub lo: usize,
    pub hi: usize,
}

impl Row {
    pub fn len(&self) -> usize {
        self.hi - self.lo
    }
}

/// A list column read in place: its chunks, in row order, and an optional row mapping.
#[derive(Debug, Clone)]
pub struct Column<'a> {
    name: String,
    chunks: Vec<ListChunk<'a>>,
    /// `starts[k]`: physical rows before chunk `k`; the last entry is the total.
    starts: Vec<usize>,
    indices: Option<Indices<'a>>,
    dtype: Dtype,
}

impl<'a> Column<'a> {
    /// A column named `name` (the name is for error messages). Every chunk must hold
    /// values of the same type; `indices`, if given, maps each row to a physical row.
    pub fn new(
        name: impl Into<String>,
        chunks: Vec<ListChunk<'a>>,
        indices: Option<Indices<'a>>,
    ) -> Result<Self> {
        let name = name.into();
        let dtype = chunks.first().map_or(Dtype::Int64, |c| c.values.dtype);
        for (k, c) in chunks.iter().enumerate() {
            if c.offsets.is_empty() {
                return Err(Error::invalid(
                    "columns",
                    format!("column '{name}': chunk {k} has no offsets (expected rows + 1)"),
                ));
            }
            if c.values.dtype != dtype {
                return Err(Error::invalid(
                    "columns",
                    format!(
                        "column '{name}': chunk {k} holds {} values, chunk 0 {}",
                        c.values.dtype.name(),
                        dtype.name()
                    ),
                ));
            }
        }
        let starts = prefix(chunks.iter().map(|c| c.rows()));
        Ok(Self { name, chunks, starts, indices, dtype })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    pub fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Rows as the user sees them: through the indices mapping when there is one.
    pub fn rows(&self) -> usize {
        match &self.indices {
            Some(ix) => ix.len(),
            None => self.physical_rows(),
        }
    }

    fn physical_rows(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// Requires integer values (token ids, labels).
    pub fn require_integers(&self, arg: &'static str) -> Result<()> {
        if self.dtype.is_integer() {
            return Ok(());
        }
        Err(Error::invalid(
            arg,
            format!("column '{}' holds {} values; expected integers", self.name, self.dtype.name()),
        ))
    }

    /// Resolves row `r`: its chunk and value range, checked.
    #[inline]
    pub(crate) fn row(&self, r: usize) -> Result<Row> {
        let rows = self.rows();
        if r >= rows {
            return Err(Error::invalid(
                "plan",
                format!(
                    "refers to row {r}, but column '{}' has {rows} rows; was the plan made from \
                     this data?",
                    self.name
                ),
            ));
        }
        let physical = match &self.indices {
            Some(ix) => {
                let p = ix.get(r);
                if p < 0 || p as u64 >= self.physical_rows() as u64 {
                    return Err(Error::invalid(
                        "indices",
                        format!(
                            "column '{}': row {r} maps to row {p}, outside the {} rows of the \
                             table",
                            self.name,
                            self.physical_rows()
                        ),
                    ));
                }
                p as usize
            }
            None => r,
        };
        let (k, local) = locate(&self.starts, physical);
        let chunk = &self.chunks[k];
        let (lo, hi) = (chunk.offsets.get(local), chunk.offsets.get(local + 1));
        if lo < 0 || hi < lo {
            return Err(Error::invalid(
                "columns",
                format!(
                    "column '{}': row {r} has offsets {lo}, {hi}: not monotone non-negative",
                    self.name
                ),
            ));
        }
        if hi as u64 > chunk.values.len as u64 {
            return Err(Error::invalid(
                "columns",
                format!(
                    "column '{}': row {r} ends at value {hi}, past the end of its chunk's {} values",
                    self.name, chunk.values.len
                ),
            ));
        }
        Ok(Row { chunk: k as u32, lo: lo as usize, hi: hi as usize })
    }

    #[inline]
    pub(crate) fn values(&self, row: Row) -> &Values<'a> {
        &self.chunks[row.chunk as usize].values
    }

    /// The length of every row (through the indices), each row checked.
    pub fn lengths(&self) -> Result<Vec<i64>> {
        lengths(std::slice::from_ref(self))
    }
}

/// Rows per parallel task when scanning whole columns.
const SCAN_ROWS: usize = 1 << 14;

/// The first of `columns` and the number of rows they all have: at least one column, and
/// the first that has another number of rows is named. (The gather and [`lengths`].)
pub(crate) fn same_rows<'c, 'a>(columns: &'c [Column<'a>]) -> Result<(&'c Column<'a>, usize)> {
    let Some(first) = columns.first() else {
        return Err(Error::invalid("columns", "expected at least one column"));
    };
    let rows = first.rows();
    for c in &columns[1..] {
        if c.rows() != rows {
            return Err(Error::invalid(
                "columns",
                format!(
                    "column '{}' has {} rows, column '{}' {rows}",
                    c.name,
                    c.rows(),
                    first.name
                ),
            ));
        }
    }
    Ok((first, rows))
}

/// The row lengths of `columns[0]`, after checking that every other column has the same
/// number of rows and, row by row, the same length: per-token columns (labels, masks)
/// must line up with the tokens. The first bad row is reported, on any thread count.
pub fn lengths(columns: &[Column<'_>]) -> Result<Vec<i64>> {
    let (first, rows) = same_rows(columns)?;
    let blocks: Vec<Result<Vec<i64>>> = (0..rows.div_ceil(SCAN_ROWS))
        .into_par_iter()
        .map(|b| {
            let range = b * SCAN_ROWS..((b + 1) * SCAN_ROWS).min(rows);
            let mut out = Vec::with_capacity(range.len());
            for r in range {
                let n = first.row(r)?.len();
                for c in &columns[1..] {
                    check_row_len(c, first, r, n)?;
                }
                out.push(n as i64);
            }
            Ok(out)
        })
        .collect();
    let mut out = Vec::with_capacity(rows);
    for block in blocks {
        out.extend_from_slice(&block?);
    }
    Ok(out)
}

/// Resolves row `r` of `column` and checks it has `n` values, as `first` has.
#[inline]
pub(crate) fn check_row_len(
    column: &Column<'_>,
    first: &Column<'_>,
    r: usize,
    n: usize,
) -> Result<Row> {
    let row = column.row(r)?;
    if row.len() != n {
        return Err(Error::invalid(
            "columns",
            format!(
                "column '{}': row {r} has {} values, but '{}' has {n}; every packed column \
                 needs one value per token",
                column.name,
                row.len(),
                first.name
            ),
        ));
    }
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_indices_and_errors() {
        let a = [1i32, 2, 3, 4, 5];
        // A sliced chunk: offsets start at 1.
        let v = Values::of(&a);
        let chunks = vec![
            ListChunk { offsets: Ints::I64(&[1, 3, 3]), values: v },
            ListChunk { offsets: Ints::I32(&[3, 5]), values: v },
        ];
        let idx = [2i64, 0, 1];
        let c =
            Column::new("x", chunks.clone(), Some(Indices::new(vec![&idx[..1], &[], &idx[1..]])))
                .unwrap();
        assert_eq!(c.lengths().unwrap(), [2, 2, 0]);
        let mut out = [0i64; 2];
        let r = c.row(0).unwrap();
        c.values(r).copy_i64(r.lo, &mut out);
        assert_eq!(out, [4, 5]);
        let bad = Column::new("x", chunks.clone(), Some(Indices::new(vec![&[7]]))).unwrap();
        assert!(bad.lengths().unwrap_err().to_string().contains("maps to row 7"));
        let broken = vec![ListChunk { offsets: Ints::I32(&[0, 9]), values: v }];
        let e = Column::new("y", broken, None).unwrap().lengths().unwrap_err().to_string();
        assert!(e.contains("column 'y': row 0 ends at value 9"), "{e}");
        let other = Column::new(
            "labels",
            vec![ListChunk { offsets: Ints::I32(&[0, 2, 3, 5]), values: v }],
            None,
        )
        .unwrap();
        let plain = Column::new("input_ids", chunks, None).unwrap();
        let e = lengths(&[plain, other]).unwrap_err().to_string();
        assert!(e.contains("column 'labels': row 1 has 1 values, but 'input_ids' has 0"), "{e}");
    }

    #[test]
    fn booleans_and_zeros() {
        let bits = [0b1011_0110u8, 0b0000_0001];
        let v = Values::new(&bits, Dtype::Bool, 1, 8).unwrap();
        let mut out = [9u8; 8];
        v.copy_bytes(0, &mut out);
        assert_eq!(out, [1, 1, 0, 1, 1, 0, 1, 1]);
        let mut zeros = vec![];
        v.for_each_zero(0, 8, |k| zeros.push(k));
        assert_eq!(zeros, [2, 5]);
        assert!(Values::new(&bits, Dtype::Bool, 9, 8).is_err());
        let f = [0.0f32, 1.5, -0.0];
        let v = Values::of(&f);
        let mut zeros = vec![];
        v.for_each_zero(0, 3, |k| zeros.push(k));
        assert_eq!(zeros, [0, 2]);
    }
}
