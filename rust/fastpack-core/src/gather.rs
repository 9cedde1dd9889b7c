//! Gather: the packs of a plan copied out of list columns (read in place, see
//! [`crate::column`]) into packed list columns — one row per pack, every column alongside,
//! plus each pack's `seq_lengths` and `position_ids`.
//!
//! This is what turns a Hugging Face dataset into its packed form: the values move once,
//! from wherever the input chunks lie to the output buffers, in parallel over groups of
//! whole segments (so the output is the same on any thread count), as raw bytes of their
//! type (any fixed width; booleans are read from bits and written as bits). A caller
//! gathers a large plan in slices of packs to bound the memory of each output batch.
//! Only the chosen packs' segments and rows are checked, so a slice costs the slice.
//!
//! ```
//! use fastpack_core::column::{Column, Ints, ListChunk, Values};
//! use fastpack_core::gather::{gather, Buffer, GatherOptions, PlanRef};
//! use fastpack_core::{pack, PackOptions};
//! let ids = Values::of(&[10i32, 11, 12, 20, 21]);
//! let chunk = ListChunk { offsets: Ints::I32(&[0, 3, 5]), values: ids };
//! let columns = [Column::new("input_ids", vec![chunk], None).unwrap()];
//! let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
//! let out = gather(&PlanRef::from(&plan), &[0], &columns, &GatherOptions::new(1)).unwrap();
//! assert_eq!(out.offsets, [0, 5]);
//! assert!(matches!(&out.columns[0], Buffer::U32(v) if v == &[10, 11, 12, 20, 21]));
//! assert_eq!((out.seq_lengths, out.position_ids), (vec![3, 2], vec![0, 1, 2, 0, 1]));
//! ```

use rayon::prelude::*;

use crate::column::{check_row_len, same_rows, Column, Dtype, Row};
use crate::error::{Error, Result};
use crate::memory::{self, SyncPtr};
use crate::plan::{Overlong, Plan, Strategy};

/// A borrowed plan: its CSR arrays and the options that decide what each segment holds.
#[derive(Debug, Clone, Copy)]
pub struct PlanRef<'a> {
    pub sample_ids: &'a [i64],
    pub starts: &'a [i64],
    pub seqlens: &'a [i32],
    pub pack_offsets: &'a [i64],
    pub reserve: u64,
    pub strategy: Strategy,
    pub overlong: Overlong,
    /// A plan of shared-prefix trees (see [`crate::tree`]): each segment's parent, `-1`
    /// for a root. Its segments are pieces of their samples that continue their parents.
    pub parents: Option<&'a [i64]>,
}

impl<'a> From<&'a Plan> for PlanRef<'a> {
    fn from(plan: &'a Plan) -> Self {
        PlanRef {
            sample_ids: &plan.sample_ids,
            starts: &plan.starts,
            seqlens: &plan.seqlens,
            pack_offsets: &plan.pack_offsets,
            reserve: plan.reserve,
            strategy: plan.strategy,
            overlong: plan.overlong,
            parents: None,
        }
    }
}

impl PlanRef<'_> {
    pub fn num_packs(&self) -> usize {
        self.pack_offsets.len().saturating_sub(1)
    }

    /// Checks the plan's shape (O(1)) and the offsets of the chosen packs (O(packs)): a
    /// call touches nothing else of the plan, so it checks nothing else.
    pub(crate) fn check_packs(&self, packs: &[i64]) -> Result<()> {
        let segments = self.seqlens.len();
        if self.sample_ids.len() != segments || self.starts.len() != segments {
            return Err(Error::invalid(
                "plan",
                format!(
                    "sample_ids, starts and seqlens differ in length ({}, {}, {segments})",
                    self.sample_ids.len(),
                    self.starts.len()
                ),
            ));
        }
        self.check_pack_offsets(packs)
    }

    /// [`Self::check_packs`] without the segment arrays other than `seqlens`.
    fn check_pack_offsets(&self, packs: &[i64]) -> Result<()> {
        let segments = self.seqlens.len();
        let offsets = self.pack_offsets;
        if offsets.first() != Some(&0) || offsets.last().copied() != Some(segments as i64) {
            return Err(Error::invalid(
                "plan",
                "pack_offsets must rise from 0 to the number of segments".to_string(),
            ));
        }
        let num_packs = self.num_packs();
        for &p in packs {
            if p < 0 || p as u64 >= num_packs as u64 {
                return Err(Error::invalid(
                    "packs",
                    format!("pack index {p} out of range; the plan has {num_packs} packs"),
                ));
            }
            let (lo, hi) = (offsets[p as usize], offsets[p as usize + 1]);
            if lo < 0 || hi < lo || hi as u64 > segments as u64 {
                return Err(Error::invalid(
                    "plan",
                    format!("pack_offsets of pack {p} ({lo}, {hi}) are not monotone"),
                ));
            }
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn pack_range(&self, p: i64) -> std::ops::Range<usize> {
        self.pack_offsets[p as usize] as usize..self.pack_offsets[p as usize + 1] as usize
    }

    /// What segment `s` holds — the one definition that [`gather`],
    /// [`materialize`](crate::materialize::materialize) and
    /// [`segment_targets`](crate::targets::segment_targets) all read: the part of its
    /// sequence (of `len` values) as `(first value, values)`, checked against the plan's
    /// policy (a truncation keeps the sequence's start and leaves its reserved slots; the
    /// error and drop policies never cut a sequence). The rest of the segment, up to
    /// `seqlens[s]`, is reserved slots (separators). `s` must be a segment of the plan.
    /// A segment of a tree plan is any piece of its sequence (the trees applied the
    /// over-long policy when they were built; they reserve no slots).
    pub fn segment_source(&self, s: usize, len: u64) -> Result<(usize, usize)> {
        let (start, seqlen) = (self.starts[s], self.seqlens[s]);
        if self.parents.is_some() {
            if self.reserve > 0 || start < 0 || seqlen <= 0 || start as u64 + seqlen as u64 > len {
                return Err(Error::invalid(
                    "plan",
                    format!(
                        "segment {s} (sequence {}, start {start}, {seqlen} tokens) is not a piece \
                         of its sequence of {len} tokens; was the plan made from this data?",
                        self.sample_ids[s]
                    ),
                ));
            }
            return Ok((start as usize, seqlen as usize));
        }
        let extended = len + self.reserve;
        let i = self.sample_ids[s];
        let mismatch = |why: &str| {
            Error::invalid(
                "plan",
                format!(
                    "segment {s} (sequence {i}, start {start}, {seqlen} tokens) {why}: the sequence \
                     has {len} tokens + {} reserved; was the plan made from these lengths?",
                    self.reserve
                ),
            )
        };
        if start < 0 || seqlen <= 0 || start as u64 + seqlen as u64 > extended {
            return Err(mismatch("runs past the end of its sequence"));
        }
        let (start, seqlen) = (start as u64, seqlen as u64);
        let whole = start == 0 && seqlen == extended;
        let cut = self.strategy != Strategy::Wrapped;
        let kept = match self.overlong {
            Overlong::Truncate if cut && !whole => {
                if start != 0 || seqlen < self.reserve {
                    return Err(mismatch("is not a truncation of its sequence"));
                }
                seqlen - self.reserve
            }
            Overlong::Error | Overlong::Drop if cut && !whole => {
                return Err(mismatch("does not cover its whole sequence"));
            }
            _ => len,
        };
        let sources = kept.saturating_sub(start).min(seqlen);
        // A segment of separators only (a wrapped or split tail) starts past the data.
        Ok((start.min(len) as usize, sources as usize))
    }

    /// The sequence of segment `s` as a row index.
    pub(crate) fn sample(&self, s: usize, rows: usize) -> Result<usize> {
        let i = self.sample_ids[s];
        if i < 0 || i as u64 >= rows as u64 {
            return Err(Error::invalid(
                "plan",
                format!(
                    "segment {s} refers to sequence {i}, but the token data has {rows} sequences"
                ),
            ));
        }
        Ok(i as usize)
    }
}

/// Tokens in each of `packs` (reserved slots included): what a caller needs to cut a
/// plan into output batches of bounded size. Costs the chosen packs' segments.
/// Only `seqlens` and `pack_offsets` of the plan are read.
pub fn pack_tokens(plan: &PlanRef<'_>, packs: &[i64]) -> Result<Vec<i64>> {
    plan.check_pack_offsets(packs)?;
    Ok(packs
        .iter()
        .map(|&p| plan.seqlens[plan.pack_range(p)].iter().map(|&n| n as i64).sum())
        .collect())
}

/// An empty output vector with room for `n` values (see the comment in [`gather`] on
/// why it is not advised to use huge pages).
fn output<T>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    memory::try_reserve(&mut v, n, "gathered columns")?;
    Ok(v)
}

/// Options of [`gather`].
#[derive(Debug, Clone)]
pub struct GatherOptions {
    /// For each column, its separator value: what the plan's reserved slots hold, as the
    /// little-endian bytes of a value of the column's type (booleans: non-zero is true).
    /// Only used when the plan reserves slots.
    pub separator_values: Vec<[u8; 8]>,
    /// Also write `position_ids` (restarting at 0 in every segment).
    pub position_ids: bool,
}

impl GatherOptions {
    /// Separator values 0 for `columns` columns, with position ids.
    pub fn new(columns: usize) -> Self {
        Self { separator_values: vec![[0; 8]; columns], position_ids: true }
    }
}

/// A packed column's values, as the bytes of its type: `U8` .. `U64` by width (the
/// caller knows the type), `Bits` for booleans (`len` values, LSB first, as Arrow).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Buffer {
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    Bits { bits: Vec<u8>, len: usize },
}

/// The chosen packs as packed columns: row `k` (pack `packs[k]`) holds values
/// `offsets[k]..offsets[k + 1]` of every column and of `position_ids`, and segments
/// `seq_offsets[k]..seq_offsets[k + 1]` of `seq_lengths`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gathered {
    pub offsets: Vec<i64>,
    pub columns: Vec<Buffer>,
    pub seq_offsets: Vec<i64>,
    /// Tokens of every segment (reserved slots included), in row order: TRL's
    /// `seq_lengths`.
    pub seq_lengths: Vec<i32>,
    /// Empty unless asked for. int64, as every position id of fastpack (see docs/core.md).
    pub position_ids: Vec<i64>,
}

impl Gathered {
    pub fn num_tokens(&self) -> usize {
        *self.offsets.last().unwrap_or(&0) as usize
    }
}

/// One segment to write: where, how many values from where, and its rows' index in the
/// flat list of resolved rows (one per column).
#[derive(Clone, Copy)]
struct Piece {
    out: usize,
    len: usize,
    sources: usize,
    source_start: usize,
}

/// Segments per parallel resolution task.
const RESOLVE_SEGMENTS: usize = 1 << 12;
/// Output tokens per parallel write task; smaller outputs are written on one thread.
const TASK_TOKENS: usize = 1 << 15;

/// Copies the segments of `packs` (in that order) out of `columns` into packed columns;
/// see the module docs. Every column must have one value per token of the first (they are
/// checked row by row as they are read). Run it inside [`crate::pool::install`] to choose
/// the thread count; the output does not depend on it.
pub fn gather(
    plan: &PlanRef<'_>,
    packs: &[i64],
    columns: &[Column<'_>],
    opts: &GatherOptions,
) -> Result<Gathered> {
    if plan.parents.is_some() {
        return Err(Error::invalid(
            "plan",
            "is a plan of trees: its packs are not rows of whole sequences (a segment continues \
             its parent), so they cannot be gathered into packed columns",
        ));
    }
    plan.check_packs(packs)?;
    let (first, rows) = same_rows(columns)?;
    let (values, wanted) = (opts.separator_values.len(), columns.len());
    if values != wanted {
        let message = format!("got {values} separator values for {wanted} columns");
        return Err(Error::invalid("separator_values", message));
    }

    // Segments in output order, with where each starts in the output.
    let mut segments = Vec::new();
    let mut outs = Vec::new();
    let mut offsets = Vec::with_capacity(packs.len() + 1);
    let mut seq_offsets = Vec::with_capacity(packs.len() + 1);
    offsets.push(0i64);
    seq_offsets.push(0i64);
    let mut total = 0usize;
    for &p in packs {
        for s in plan.pack_range(p) {
            segments.push(s);
            outs.push(total);
            total += plan.seqlens[s].max(0) as usize;
        }
        offsets.push(total as i64);
        seq_offsets.push(segments.len() as i64);
    }
    let seq_lengths: Vec<i32> = segments.iter().map(|&s| plan.seqlens[s]).collect();

    // Resolve every segment's rows in every column (checked), in parallel blocks; the
    // first error in segment order wins, on any thread count.
    let ncols = columns.len();
    let blocks: Vec<Result<(Vec<Piece>, Vec<Row>)>> = segments
        .par_chunks(RESOLVE_SEGMENTS)
        .zip(outs.par_chunks(RESOLVE_SEGMENTS))
        .map(|(segs, outs)| {
            let mut pieces = Vec::with_capacity(segs.len());
            let mut resolved = Vec::with_capacity(segs.len() * ncols);
            for (&s, &out) in segs.iter().zip(outs) {
                let r = plan.sample(s, rows)?;
                let row = first.row(r)?;
                let n = row.len();
                resolved.push(row);
                for c in &columns[1..] {
                    resolved.push(check_row_len(c, first, r, n)?);
                }
                let (source_start, sources) = plan.segment_source(s, n as u64)?;
                let len = plan.seqlens[s] as usize;
                pieces.push(Piece { out, len, sources, source_start });
            }
            Ok((pieces, resolved))
        })
        .collect();
    let mut pieces = Vec::with_capacity(segments.len());
    let mut resolved = Vec::with_capacity(segments.len() * ncols);
    for block in blocks {
        let (p, r) = block?;
        pieces.extend_from_slice(&p);
        resolved.extend_from_slice(&r);
    }
    drop((segments, outs));

    // Output buffers, written whole by the tasks below (never zeroed first). Not advised
    // to use huge pages: with the kernel's default THP `defrag=madvise`, a fresh process's
    // first fault of an advised region stalls in direct compaction (1.9 s of system time
    // for 685 MiB against 0.2 s on 4 KiB pages, on a host whose page cache fragments
    // memory), and this output is written once, in order, so the TLB gains little.
    let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(ncols);
    let mut buffers: Vec<Buffer> = Vec::with_capacity(ncols);
    for c in columns {
        if c.dtype() == Dtype::Bool {
            bytes.push(output(total)?);
            buffers.push(Buffer::Bits { bits: Vec::new(), len: total });
        } else {
            buffers.push(match c.dtype().width() {
                1 => Buffer::U8(output(total)?),
                2 => Buffer::U16(output(total)?),
                4 => Buffer::U32(output(total)?),
                _ => Buffer::U64(output(total)?),
            });
        }
    }
    let mut position_ids: Vec<i64> = if opts.position_ids { output(total)? } else { Vec::new() };
    let mut next_bytes = bytes.iter_mut();
    let targets: Vec<SyncPtr<u8>> = buffers
        .iter_mut()
        .map(|b| {
            SyncPtr(match b {
                Buffer::U8(v) => v.as_mut_ptr(),
                Buffer::U16(v) => v.as_mut_ptr() as *mut u8,
                Buffer::U32(v) => v.as_mut_ptr() as *mut u8,
                Buffer::U64(v) => v.as_mut_ptr() as *mut u8,
                Buffer::Bits { .. } => {
                    next_bytes.next().map_or(std::ptr::null_mut(), |v| v.as_mut_ptr())
                }
            })
        })
        .collect();
    let positions = SyncPtr(position_ids.as_mut_ptr());

    // Tasks of about TASK_TOKENS output tokens, over whole segments.
    let mut bounds = vec![0usize];
    let mut acc = 0usize;
    for (k, piece) in pieces.iter().enumerate() {
        acc += piece.len;
        if acc >= TASK_TOKENS && k + 1 < pieces.len() {
            bounds.push(k + 1);
            acc = 0;
        }
    }
    bounds.push(pieces.len());
    const AHEAD: usize = 2;
    let write = |w: &[usize]| {
        for k in w[0]..w[1] {
            if k + AHEAD < w[1] {
                let ahead = &pieces[k + AHEAD];
                for (c, column) in columns.iter().enumerate() {
                    let row = resolved[(k + AHEAD) * ncols + c];
                    column.values(row).prefetch(row.lo + ahead.source_start);
                }
            }
            let piece = &pieces[k];
            for (c, column) in columns.iter().enumerate() {
                let width = column.dtype().width();
                let row = resolved[k * ncols + c];
                // SAFETY: segments' output ranges are disjoint and inside `total`; every
                // buffer has room for `total` values of its width.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(
                        targets[c].get().add(piece.out * width),
                        piece.len * width,
                    )
                };
                let (data, rest) = out.split_at_mut(piece.sources * width);
                column.values(row).copy_bytes(row.lo + piece.source_start, data);
                let separator = separator_bytes(column.dtype(), &opts.separator_values[c]);
                for slot in rest.chunks_exact_mut(width) {
                    slot.copy_from_slice(&separator[..width]);
                }
            }
            if opts.position_ids {
                // SAFETY: as above, for the i64 position buffer.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(positions.get().add(piece.out), piece.len)
                };
                for (j, p) in out.iter_mut().enumerate() {
                    *p = j as i64;
                }
            }
        }
    };
    if bounds.len() <= 2 {
        bounds.windows(2).for_each(write);
    } else {
        bounds.par_windows(2).for_each(write);
    }
    // SAFETY: the tasks wrote every value of every buffer.
    unsafe {
        for b in &mut buffers {
            match b {
                Buffer::U8(v) => v.set_len(total),
                Buffer::U16(v) => v.set_len(total),
                Buffer::U32(v) => v.set_len(total),
                Buffer::U64(v) => v.set_len(total),
                Buffer::Bits { .. } => {}
            }
        }
        for v in &mut bytes {
            v.set_len(total);
        }
        if opts.position_ids {
            position_ids.set_len(total);
        }
    }
    let mut bytes = bytes.into_iter();
    for b in &mut buffers {
        if let Buffer::Bits { bits, .. } = b {
            *bits = pack_bits(&bytes.next().unwrap_or_default());
        }
    }
    Ok(Gathered { offsets, columns: buffers, seq_offsets, seq_lengths, position_ids })
}

/// A separator value as written: booleans become one byte 0 / 1.
fn separator_bytes(dtype: Dtype, value: &[u8; 8]) -> [u8; 8] {
    if dtype == Dtype::Bool {
        [(value.iter().any(|&b| b != 0)) as u8, 0, 0, 0, 0, 0, 0, 0]
    } else {
        *value
    }
}

/// Bytes 0 / 1 as Arrow's bit-packed booleans (LSB first), in parallel over whole bytes.
fn pack_bits(bytes: &[u8]) -> Vec<u8> {
    const BLOCK: usize = 1 << 16;
    let mut bits = vec![0u8; bytes.len().div_ceil(8)];
    bits.par_chunks_mut(BLOCK / 8).zip(bytes.par_chunks(BLOCK)).for_each(|(out, inp)| {
        for (o, eight) in out.iter_mut().zip(inp.chunks(8)) {
            *o = eight.iter().enumerate().fold(0u8, |acc, (j, &b)| acc | ((b != 0) as u8) << j);
        }
    });
    bits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::{Indices, Ints, ListChunk, Values};
    use crate::plan::Strategy as S;
    use crate::{pack, PackOptions};
    use proptest::prelude::*;

    /// Sequences as chunked i64 data: (values, offsets) per chunk, cut at `cuts` rows.
    fn chunked(seqs: &[Vec<i64>], cuts: &[usize]) -> Vec<(Vec<i64>, Vec<i64>)> {
        let mut out = Vec::new();
        let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c < seqs.len()).collect();
        bounds.sort();
        bounds.dedup();
        bounds.insert(0, 0);
        bounds.push(seqs.len());
        for w in bounds.windows(2) {
            // A leading unused value makes every chunk a slice whose offsets do not start at 0.
            let mut values = vec![-999i64];
            let mut offsets = vec![1i64];
            for s in &seqs[w[0]..w[1]] {
                values.extend_from_slice(s);
                offsets.push(values.len() as i64);
            }
            out.push((values, offsets));
        }
        out
    }

    fn column<'a>(
        name: &str,
        data: &'a [(Vec<i64>, Vec<i64>)],
        indices: Option<&'a [i64]>,
    ) -> Column<'a> {
        let chunks = data
            .iter()
            .map(|(v, o)| ListChunk { offsets: Ints::I64(o), values: Values::of(v) })
            .collect();
        Column::new(name, chunks, indices.map(|ix| Indices::new(vec![ix]))).unwrap()
    }

    fn as_i64(b: &Buffer) -> Vec<i64> {
        match b {
            Buffer::U64(v) => v.iter().map(|&x| x as i64).collect(),
            _ => panic!("expected 64-bit values"),
        }
    }

    #[test]
    fn separators_booleans_and_errors() {
        let seqs = vec![vec![1, 2], vec![3, 4, 5]];
        let data = chunked(&seqs, &[1]);
        // Offsets past the values are refused when the row is read.
        let bits = [0b101u8];
        let mask = ListChunk {
            offsets: Ints::I32(&[0, 2, 5]),
            values: Values::new(&bits, Dtype::Bool, 1, 4).unwrap(),
        };
        assert!(Column::new("m", vec![mask], None).unwrap().lengths().is_err());
        let bits = [0b0110_1101u8];
        let mask = ListChunk {
            offsets: Ints::I32(&[0, 2, 5]),
            values: Values::new(&bits, Dtype::Bool, 0, 5).unwrap(),
        };
        let columns =
            [column("input_ids", &data, None), Column::new("mask", vec![mask], None).unwrap()];
        let plan = pack(&[2u32, 3], &PackOptions { reserve: 1, ..PackOptions::new(8) }).unwrap();
        let mut opts = GatherOptions::new(2);
        opts.separator_values[0] = 9i64.to_le_bytes();
        opts.separator_values[1] = [1, 0, 0, 0, 0, 0, 0, 0];
        let out = gather(&PlanRef::from(&plan), &[0], &columns, &opts).unwrap();
        // bfd puts the longer sequence first; separators after each.
        assert_eq!(as_i64(&out.columns[0]), [3, 4, 5, 9, 1, 2, 9]);
        // Mask rows: row 0 = 1,0; row 1 = 1,1,0 → packed 1,1,0,(1), 1,0,(1).
        assert_eq!(out.columns[1], Buffer::Bits { bits: vec![0b0101_1011], len: 7 });
        assert_eq!(out.seq_lengths, [4, 3]);
        assert_eq!(out.position_ids, [0, 1, 2, 3, 0, 1, 2]);

        let short = chunked(&[vec![1, 2], vec![3, 4]], &[]);
        let e = gather(
            &PlanRef::from(&plan),
            &[0],
            &[column("input_ids", &data, None), column("labels", &short, None)],
            &GatherOptions::new(2),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("column 'labels': row 1 has 2 values, but 'input_ids' has 3"), "{e}");
        let e = gather(&PlanRef::from(&plan), &[1], &columns, &opts).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn a_slice_of_a_broken_plan_checks_only_its_packs() {
        let seqs = vec![vec![1], vec![2], vec![3]];
        let data = chunked(&seqs, &[]);
        let columns = [column("input_ids", &data, None)];
        let plan = pack(&[1u32, 1, 1], &PackOptions::new(1)).unwrap();
        let mut offsets = plan.pack_offsets.clone();
        offsets[2] = 0; // pack 1 and 2 are broken, pack 0 is fine
        let broken = PlanRef { pack_offsets: &offsets, ..PlanRef::from(&plan) };
        assert!(gather(&broken, &[0], &columns, &GatherOptions::new(1)).is_ok());
        assert!(gather(&broken, &[1], &columns, &GatherOptions::new(1)).is_err());
    }

    proptest! {
        #[test]
        fn every_row_holds_its_segments_in_order(
            lens in proptest::collection::vec(0u32..40, 0..60),
            cuts in proptest::collection::vec(0usize..60, 0..4),
            max_len in 8u64..64,
            reserve in 0u64..3,
            policy in 0usize..4,
            strategy in 0usize..4,
            reverse in any::<bool>(),
            threads in 1usize..4,
        ) {
            let overlong = [Overlong::Split, Overlong::Truncate, Overlong::Drop, Overlong::Split][policy];
            let strategy = [S::BestFitDecreasing, S::FirstFitDecreasing, S::NextFit, S::Wrapped][strategy];
            let opts = PackOptions { reserve, overlong, strategy, ..PackOptions::new(max_len) };
            let n = lens.len();
            // Row r of the columns holds `seqs[r]`; with `reverse` it is stored at physical
            // row n-1-r and read through an indices mapping.
            let seqs: Vec<Vec<i64>> = (0..n)
                .map(|r| (0..lens[r] as i64).map(|j| r as i64 * 1000 + j + 1).collect())
                .collect();
            let stored = |v: &[Vec<i64>]| -> Vec<Vec<i64>> {
                if reverse { v.iter().rev().cloned().collect() } else { v.to_vec() }
            };
            let indices: Vec<i64> = (0..n as i64).rev().collect();
            let data = chunked(&stored(&seqs), &cuts);
            let labels: Vec<Vec<i64>> = seqs.iter().map(|s| s.iter().map(|t| -t).collect()).collect();
            let ldata = chunked(&stored(&labels), &[]);
            let ix = reverse.then_some(&indices[..]);
            let columns = [column("input_ids", &data, ix), column("labels", &ldata, ix)];
            let row_lens = lens.clone();
            let plan = pack(&row_lens, &opts).unwrap();
            let packs: Vec<i64> = (0..plan.num_packs() as i64).rev().collect();
            let mut gopts = GatherOptions::new(2);
            gopts.separator_values = vec![(-7i64).to_le_bytes(), (-8i64).to_le_bytes()];
            let pr = PlanRef::from(&plan);
            let one = crate::pool::install(Some(1), || gather(&pr, &packs, &columns, &gopts)).unwrap().unwrap();
            let many = crate::pool::install(Some(threads), || gather(&pr, &packs, &columns, &gopts)).unwrap().unwrap();
            prop_assert_eq!(&one, &many);
            let ids = as_i64(&one.columns[0]);
            let labs = as_i64(&one.columns[1]);
            // Row by row, segment by segment: exactly the segment's tokens, then separators.
            let mut at = 0usize;
            let mut seg = 0usize;
            for (k, &p) in packs.iter().enumerate() {
                prop_assert_eq!(one.offsets[k] as usize, at);
                for s in plan.pack_offsets[p as usize] as usize..plan.pack_offsets[p as usize + 1] as usize {
                    let r = plan.sample_ids[s] as usize;
                    let (start, len) = (plan.starts[s] as usize, plan.seqlens[s] as usize);
                    let seq = &seqs[r];
                    let truncated = overlong == Overlong::Truncate && strategy != S::Wrapped
                        && seq.len() as u64 + reserve > max_len;
                    let kept = if truncated { len - reserve as usize } else { seq.len() };
                    let data: Vec<i64> = seq[start.min(kept)..(start + len).min(kept)].to_vec();
                    let mut want = data.clone();
                    want.resize(len, -7);
                    prop_assert_eq!(&ids[at..at + len], &want[..]);
                    let mut lwant: Vec<i64> = data.iter().map(|t| -t).collect();
                    lwant.resize(len, -8);
                    prop_assert_eq!(&labs[at..at + len], &lwant[..]);
                    prop_assert_eq!(one.seq_lengths[seg], len as i32);
                    let positions: Vec<i64> = (0..len as i64).collect();
                    prop_assert_eq!(&one.position_ids[at..at + len], &positions[..]);
                    at += len;
                    seg += 1;
                }
                prop_assert_eq!(one.seq_offsets[k + 1] as usize, seg);
            }
            prop_assert_eq!(at, one.num_tokens());
        }
    }
}
