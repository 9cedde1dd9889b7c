//! Materialize: turn packs of a [`crate::Plan`] plus the token data into training
//! rows — `input_ids`, `position_ids`, `labels`, `seq_idx`, `cu_seqlens` — ready for any
//! attention backend.
//!
//! Token data comes as list [`Column`]s (the Arrow layout, every chunk in place, through an
//! indices mapping if there is one), so a Hugging Face dataset column is read where it
//! lies. Only the packs and sequences the call uses are touched (and checked), so
//! materializing one batch out of a plan over millions of sequences costs the batch, not
//! the dataset.
//!
//! Labels are *unshifted* (the model shifts them, as Hugging Face causal LMs do): the label
//! of a token is the token itself, except `-100` at the first position of every segment
//! (so no sequence is trained to predict the next one's first token), where the loss mask
//! is 0, and on padding. Padding is one extra trailing segment per row, so no real token
//! attends to it and its positions restart at 0.
//!
//! ```
//! use fastpack_core::column::{Column, Ints, ListChunk, Values};
//! use fastpack_core::materialize::{materialize, MaterializeOptions, PlanRef, Sources};
//! use fastpack_core::{pack, PackOptions};
//! let plan = pack(&[3u32, 2], &PackOptions::new(8)).unwrap();
//! let chunk = ListChunk { offsets: Ints::I64(&[0, 3, 5]), values: Values::of(&[10i32, 11, 12, 20, 21]) };
//! let tokens = Column::new("tokens", vec![chunk], None).unwrap();
//! let sources = Sources { tokens: &tokens, labels: None, loss_mask: None };
//! let rows = materialize(&PlanRef::from(&plan), &sources, &[0], &MaterializeOptions::default()).unwrap();
//! assert_eq!(rows.input_ids, [10, 11, 12, 20, 21]);
//! assert_eq!(rows.position_ids, [0, 1, 2, 0, 1]);
//! assert_eq!(rows.labels, [-100, 11, 12, -100, 21]);
//! assert_eq!(rows.cu_seqlens, [0, 3, 5]);
//! ```

use rayon::prelude::*;

use crate::column::{check_row_len, Column, Row};
use crate::error::{Error, Result};
pub use crate::gather::PlanRef;

/// The label that losses ignore.
pub const IGNORE_INDEX: i64 = -100;

/// The token data: ids, optional labels (default: the ids) and an optional loss mask
/// (zero: not a target, e.g. a user turn in chat SFT), each a list column with one value
/// per token. Ids and labels must hold integers; the mask may hold any type.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    pub tokens: &'a Column<'a>,
    pub labels: Option<&'a Column<'a>>,
    pub loss_mask: Option<&'a Column<'a>>,
}

/// How packs become rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// All chosen packs end to end in one row (`[1, T]`: flash-attn's varlen layout).
    Flat,
    /// One row per pack, all of the same width (`[P, W]`).
    Rows,
}

/// Options of [`materialize`].
#[derive(Debug, Clone)]
pub struct MaterializeOptions {
    /// Token written into the plan's `reserve` slots; required when `reserve > 0`.
    pub separator_id: Option<i64>,
    /// Whether separators are targets (their label is the separator) or not (`-100`).
    pub train_separators: bool,
    pub layout: Layout,
    /// Flat: pad the row to exactly this many tokens. Rows: pad each row to this width
    /// (default: the longest chosen pack). Fails if the tokens do not fit.
    pub width: Option<u64>,
    /// Round the row width up to a multiple of this (1: no rounding).
    pub pad_to_multiple_of: u64,
    pub pad_id: i64,
}

impl Default for MaterializeOptions {
    fn default() -> Self {
        Self {
            separator_id: None,
            train_separators: false,
            layout: Layout::Flat,
            width: None,
            pad_to_multiple_of: 1,
            pad_id: 0,
        }
    }
}

/// Packed rows, flattened row-major (`rows * width` tokens each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Materialized {
    pub input_ids: Vec<i64>,
    pub position_ids: Vec<i64>,
    pub labels: Vec<i64>,
    /// Segment index of every token, restarting at 0 in every row (Mamba / FLA layout).
    pub seq_idx: Vec<i32>,
    /// Boundaries of every segment over all rows laid end to end, padding segments
    /// included, starting at 0 and ending at `rows * width`.
    pub cu_seqlens: Vec<i32>,
    pub max_seqlen: i32,
    pub rows: usize,
    pub width: usize,
    /// Labels other than `-100`: the loss's `num_items_in_batch`.
    pub num_targets: u64,
    /// Real (non-padding) tokens.
    pub num_tokens: u64,
}

/// One run of output tokens: a plan segment or a padding segment.
#[derive(Clone, Copy)]
struct Piece {
    /// Plan segment index, or `usize::MAX` for padding.
    segment: usize,
    len: usize,
    seq_idx: i32,
    /// Source tokens in the piece (the rest, up to `len`, are separators).
    sources: usize,
    /// Position of the piece's first token inside its sequence's data.
    source_start: usize,
    /// The position id of the piece's first token: 0, or in a tree plan its position in
    /// its sample (a segment continues its parent).
    first_position: i64,
    /// Where the sequence lies in the tokens, labels and mask (the last two only when
    /// given).
    rows: [Row; 3],
}

const PAD: usize = usize::MAX;
/// Output tokens per parallel task; smaller outputs are written on one thread.
const TASK_TOKENS: usize = 1 << 15;

/// Builds the chosen `packs` of `plan` from `sources`; see the module docs. Run it inside
/// [`crate::pool::install`] to choose the thread count; the output does not depend on it.
pub fn materialize(
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    packs: &[i64],
    opts: &MaterializeOptions,
) -> Result<Materialized> {
    plan.check_packs(packs)?;
    sources.tokens.require_integers("tokens")?;
    if let Some(labels) = sources.labels {
        labels.require_integers("labels")?;
    }
    if plan.reserve > 0 && opts.separator_id.is_none() {
        return Err(Error::invalid(
            "separator_id",
            format!(
                "the plan reserves {} slot(s) after every sequence; pass the separator token id",
                plan.reserve
            ),
        ));
    }
    if opts.pad_to_multiple_of == 0 {
        return Err(Error::invalid("pad_to_multiple_of", "got 0; expected at least 1"));
    }
    let pack_range = |p: i64| plan.pack_range(p);
    let pack_len = |p: i64| plan.seqlens[pack_range(p)].iter().map(|&n| n as u64).sum::<u64>();

    // Row width.
    let round = |n: u64| n.div_ceil(opts.pad_to_multiple_of) * opts.pad_to_multiple_of;
    let (rows, width) = match opts.layout {
        Layout::Flat => {
            let total: u64 = packs.iter().map(|&p| pack_len(p)).sum();
            let width = match opts.width {
                Some(w) if total > w => {
                    return Err(Error::invalid(
                        "pad_to",
                        format!(
                            "the chosen packs hold {total} tokens, more than the row width {w}"
                        ),
                    ))
                }
                Some(w) => w,
                None => total,
            };
            (1usize, round(width))
        }
        Layout::Rows => {
            let longest = packs.iter().map(|&p| pack_len(p)).max().unwrap_or(0);
            let width = match opts.width {
                Some(w) if longest > w => {
                    return Err(Error::invalid(
                        "pad_to",
                        format!(
                            "a chosen pack holds {longest} tokens, more than the row width {w}"
                        ),
                    ))
                }
                Some(w) => w,
                None => longest,
            };
            (packs.len(), round(width))
        }
    };
    let total =
        (rows as u64).checked_mul(width).filter(|&t| t <= i32::MAX as u64).ok_or_else(|| {
            Error::overflow("packs", "the output holds 2^31 tokens or more; cu_seqlens is int32")
        })? as usize;
    let width = width as usize;

    // Pieces, in output order, with every index they read checked.
    let mut pieces =
        Vec::with_capacity(packs.iter().map(|&p| pack_range(p).len() + 1).sum::<usize>() + 1);
    let mut row_used = 0usize;
    let mut row_segments = 0i32;
    let close_row = |pieces: &mut Vec<Piece>, used: &mut usize, segs: &mut i32| {
        if *used < width {
            pieces.push(Piece {
                segment: PAD,
                len: width - *used,
                seq_idx: *segs,
                sources: 0,
                source_start: 0,
                first_position: 0,
                rows: [NO_ROW; 3],
            });
        }
        *used = 0;
        *segs = 0;
    };
    for (k, &p) in packs.iter().enumerate() {
        for s in pack_range(p) {
            let piece = segment_piece(plan, sources, s, row_segments)?;
            row_used += piece.len;
            row_segments += 1;
            pieces.push(piece);
        }
        if opts.layout == Layout::Rows || k + 1 == packs.len() {
            close_row(&mut pieces, &mut row_used, &mut row_segments);
        }
    }
    if packs.is_empty() && opts.layout == Layout::Flat {
        close_row(&mut pieces, &mut row_used, &mut row_segments);
    }

    let mut cu_seqlens = Vec::with_capacity(pieces.len() + 1);
    cu_seqlens.push(0i32);
    let mut acc = 0i32;
    let mut max_seqlen = 0i32;
    let mut num_tokens = 0u64;
    for piece in &pieces {
        acc += piece.len as i32;
        cu_seqlens.push(acc);
        max_seqlen = max_seqlen.max(piece.len as i32);
        if piece.segment != PAD {
            num_tokens += piece.len as u64;
        }
    }
    debug_assert_eq!(acc as usize, total);

    let mut out = Materialized {
        input_ids: vec![0; total],
        position_ids: vec![0; total],
        labels: vec![0; total],
        seq_idx: vec![0; total],
        cu_seqlens,
        max_seqlen,
        rows,
        width,
        num_targets: 0,
        num_tokens,
    };
    out.num_targets = write_pieces(&pieces, plan, sources, opts, &mut out);
    Ok(out)
}

const NO_ROW: Row = Row { chunk: 0, lo: 0, hi: 0 };

/// The piece of segment `s`, after checking it against the data.
fn segment_piece(
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    s: usize,
    seq_idx: i32,
) -> Result<Piece> {
    let tokens = sources.tokens;
    let i = plan.sample(s, tokens.rows())?;
    let row = tokens.row(i)?;
    let len = row.len();
    let mut rows = [row, NO_ROW, NO_ROW];
    for (k, side) in [sources.labels, sources.loss_mask].into_iter().enumerate() {
        if let Some(column) = side {
            if column.rows() != tokens.rows() {
                return Err(Error::invalid(
                    "columns",
                    format!(
                        "column '{}' has {} rows, but the tokens have {}; every column needs \
                         one row per sequence",
                        column.name(),
                        column.rows(),
                        tokens.rows()
                    ),
                ));
            }
            rows[k + 1] = check_row_len(column, tokens, i, len)?;
        }
    }
    let (source_start, sources_in) = plan.segment_source(s, len as u64)?;
    Ok(Piece {
        segment: s,
        len: plan.seqlens[s] as usize,
        seq_idx,
        sources: sources_in,
        source_start,
        first_position: if plan.parents.is_some() { plan.starts[s] } else { 0 },
        rows,
    })
}

/// Output slices of one task.
struct Slab<'o> {
    input_ids: &'o mut [i64],
    position_ids: &'o mut [i64],
    labels: &'o mut [i64],
    seq_idx: &'o mut [i32],
}

/// Writes every piece into `out`, in parallel over groups of whole pieces; returns the
/// number of targets.
fn write_pieces(
    pieces: &[Piece],
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    opts: &MaterializeOptions,
    out: &mut Materialized,
) -> u64 {
    // Cut the piece list into tasks of about TASK_TOKENS tokens.
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
    let mut tasks = Vec::with_capacity(bounds.len() - 1);
    let (mut ids, mut pos, mut lab, mut idx) = (
        &mut out.input_ids[..],
        &mut out.position_ids[..],
        &mut out.labels[..],
        &mut out.seq_idx[..],
    );
    for w in bounds.windows(2) {
        let group = &pieces[w[0]..w[1]];
        let n: usize = group.iter().map(|p| p.len).sum();
        let (a, ids_rest) = ids.split_at_mut(n);
        let (b, pos_rest) = pos.split_at_mut(n);
        let (c, lab_rest) = lab.split_at_mut(n);
        let (d, idx_rest) = idx.split_at_mut(n);
        (ids, pos, lab, idx) = (ids_rest, pos_rest, lab_rest, idx_rest);
        tasks.push((group, Slab { input_ids: a, position_ids: b, labels: c, seq_idx: d }));
    }
    let run = |(group, slab): (&[Piece], Slab<'_>)| write_group(group, plan, sources, opts, slab);
    if tasks.len() == 1 {
        tasks.into_iter().map(run).sum()
    } else {
        tasks.into_par_iter().map(run).sum()
    }
}

fn write_group(
    pieces: &[Piece],
    plan: &PlanRef<'_>,
    sources: &Sources<'_>,
    opts: &MaterializeOptions,
    slab: Slab<'_>,
) -> u64 {
    let separator = opts.separator_id.unwrap_or(0);
    let separator_label = if opts.train_separators { separator } else { IGNORE_INDEX };
    let mut at = 0usize;
    let mut targets = 0u64;
    for piece in pieces {
        let range = at..at + piece.len;
        at += piece.len;
        let ids = &mut slab.input_ids[range.clone()];
        let labels = &mut slab.labels[range.clone()];
        for (k, p) in slab.position_ids[range.clone()].iter_mut().enumerate() {
            *p = piece.first_position + k as i64;
        }
        slab.seq_idx[range].fill(piece.seq_idx);
        if piece.segment == PAD {
            ids.fill(opts.pad_id);
            labels.fill(IGNORE_INDEX);
            continue;
        }
        debug_assert!(piece.segment < plan.seqlens.len());
        let n = piece.sources;
        // Rows were checked when the piece was made.
        let [row, label_row, mask_row] = piece.rows;
        let from = piece.source_start;
        sources.tokens.values(row).copy_i64(row.lo + from, &mut ids[..n]);
        ids[n..].fill(separator);
        match sources.labels {
            Some(l) => l.values(label_row).copy_i64(label_row.lo + from, &mut labels[..n]),
            None => labels[..n].copy_from_slice(&ids[..n]),
        }
        labels[n..].fill(separator_label);
        if let Some(m) = sources.loss_mask {
            m.values(mask_row).for_each_zero(mask_row.lo + from, n, |k| labels[k] = IGNORE_INDEX);
        }
        labels[0] = IGNORE_INDEX;
        targets += labels.iter().filter(|&&l| l != IGNORE_INDEX).count() as u64;
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::{Ints, ListChunk, Values};
    use crate::plan::{Overlong, Plan};
    use crate::{pack, PackOptions};
    use proptest::prelude::*;

    fn flat(seqs: &[Vec<i64>]) -> (Vec<i64>, Vec<i64>) {
        let mut offsets = vec![0i64];
        let mut values = Vec::new();
        for s in seqs {
            values.extend_from_slice(s);
            offsets.push(values.len() as i64);
        }
        (values, offsets)
    }

    fn run(
        plan: &Plan,
        values: &[i64],
        offsets: &[i64],
        packs: &[i64],
        opts: &MaterializeOptions,
    ) -> Result<Materialized> {
        let chunk = ListChunk { offsets: Ints::I64(offsets), values: Values::of(values) };
        let tokens = Column::new("tokens", vec![chunk], None)?;
        let sources = Sources { tokens: &tokens, labels: None, loss_mask: None };
        materialize(&PlanRef::from(plan), &sources, packs, opts)
    }

    #[test]
    fn separators_padding_and_rows() {
        let plan = pack(&[2u32, 3], &PackOptions { reserve: 1, ..PackOptions::new(8) }).unwrap();
        let (v, o) = flat(&[vec![1, 2], vec![3, 4, 5]]);
        let opts = MaterializeOptions {
            separator_id: Some(9),
            pad_to_multiple_of: 4,
            ..Default::default()
        };
        let out = run(&plan, &v, &o, &[0], &opts).unwrap();
        // bfd puts the longer sequence first.
        assert_eq!(out.input_ids, [3, 4, 5, 9, 1, 2, 9, 0]);
        assert_eq!(out.labels, [-100, 4, 5, -100, -100, 2, -100, -100]);
        assert_eq!(out.position_ids, [0, 1, 2, 3, 0, 1, 2, 0]);
        assert_eq!(out.seq_idx, [0, 0, 0, 0, 1, 1, 1, 2]);
        assert_eq!(out.cu_seqlens, [0, 4, 7, 8]);
        assert_eq!((out.num_targets, out.num_tokens, out.max_seqlen), (3, 7, 4));

        let opts = MaterializeOptions {
            separator_id: Some(9),
            train_separators: true,
            layout: Layout::Rows,
            width: Some(8),
            ..Default::default()
        };
        let out = run(&plan, &v, &o, &[0, 0], &opts).unwrap();
        assert_eq!((out.rows, out.width), (2, 8));
        assert_eq!(&out.labels[..8], [-100, 4, 5, 9, -100, 2, 9, -100]);
        assert_eq!(out.cu_seqlens, [0, 4, 7, 8, 12, 15, 16]);
        assert_eq!(&out.seq_idx[8..], [0, 0, 0, 0, 1, 1, 1, 2]);
    }

    #[test]
    fn truncate_and_split_keep_the_right_tokens() {
        let (v, o) = flat(&[(0..10).collect()]);
        let trunc = pack(
            &[10u32],
            &PackOptions { reserve: 1, overlong: Overlong::Truncate, ..PackOptions::new(4) },
        )
        .unwrap();
        let out = run(
            &trunc,
            &v,
            &o,
            &[0],
            &MaterializeOptions { separator_id: Some(-1), ..Default::default() },
        )
        .unwrap();
        assert_eq!(out.input_ids, [0, 1, 2, -1]);
        let split = pack(
            &[10u32],
            &PackOptions { reserve: 1, overlong: Overlong::Split, ..PackOptions::new(4) },
        )
        .unwrap();
        let all: Vec<i64> = (0..split.num_packs() as i64).collect();
        let out = run(
            &split,
            &v,
            &o,
            &all,
            &MaterializeOptions { separator_id: Some(-1), ..Default::default() },
        )
        .unwrap();
        let mut ids = out.input_ids.clone();
        ids.sort();
        assert_eq!(ids, [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    }

    #[test]
    fn errors_are_clear() {
        let plan = pack(&[2u32, 3], &PackOptions::new(8)).unwrap();
        let (v, o) = flat(&[vec![1, 2], vec![3, 4, 5]]);
        let opts = MaterializeOptions::default();
        let e = run(&plan, &v, &o, &[1], &opts).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
        let e = run(&plan, &v, &[0, 3, 2], &[0], &opts).unwrap_err().to_string();
        assert!(e.contains("monotone"), "{e}");
        let e = run(&plan, &v, &[0, 2], &[0], &opts).unwrap_err().to_string();
        assert!(e.contains("token data has 1 sequences"), "{e}");
        let e = run(&plan, &v, &[0, 1, 5], &[0], &opts).unwrap_err().to_string();
        assert!(e.contains("whole sequence"), "{e}");
        let e = run(&plan, &v, &[0, 2, 9], &[0], &opts).unwrap_err().to_string();
        assert!(e.contains("past the end"), "{e}");
        let with_reserve =
            pack(&[2u32], &PackOptions { reserve: 1, ..PackOptions::new(8) }).unwrap();
        let e = run(&with_reserve, &v, &o, &[0], &opts).unwrap_err().to_string();
        assert!(e.contains("separator_id"), "{e}");
    }

    proptest! {
        #[test]
        fn every_token_once_and_thread_independent(
            lens in proptest::collection::vec(0u32..40, 0..60),
            max_len in 8u64..64,
            reserve in 0u64..3,
            policy in 0usize..3,
            rows in any::<bool>(),
            wrapped in any::<bool>(),
        ) {
            let overlong = if wrapped { Overlong::Split } else { [Overlong::Split, Overlong::Truncate, Overlong::Drop][policy] };
            let strategy = if wrapped { crate::plan::Strategy::Wrapped } else { crate::plan::Strategy::BestFitDecreasing };
            let opts = PackOptions { reserve, overlong, strategy, ..PackOptions::new(max_len) };
            let plan = pack(&lens, &opts).unwrap();
            let seqs: Vec<Vec<i64>> = lens.iter().enumerate()
                .map(|(i, &n)| (0..n as i64).map(|j| (i as i64) * 1000 + j + 1).collect()).collect();
            let (v, o) = flat(&seqs);
            let packs: Vec<i64> = (0..plan.num_packs() as i64).rev().collect();
            let mopts = MaterializeOptions {
                separator_id: Some(-7),
                layout: if rows { Layout::Rows } else { Layout::Flat },
                pad_to_multiple_of: 8,
                ..Default::default()
            };
            let one = crate::pool::install(Some(1), || run(&plan, &v, &o, &packs, &mopts)).unwrap().unwrap();
            let many = crate::pool::install(Some(3), || run(&plan, &v, &o, &packs, &mopts)).unwrap().unwrap();
            prop_assert_eq!(&one, &many);
            // Kept tokens appear exactly once; the rest is separators and padding.
            let mut got: Vec<i64> = one.input_ids.iter().copied().filter(|&t| t > 0).collect();
            got.sort();
            let mut want: Vec<i64> = Vec::new();
            for s in &seqs {
                let extended = s.len() as u64 + reserve;
                let keep = if extended <= max_len { s.len() } else {
                    match overlong { Overlong::Split => s.len(), Overlong::Truncate => (max_len - reserve) as usize, _ => 0 }
                };
                want.extend_from_slice(&s[..keep]);
            }
            want.sort();
            prop_assert_eq!(got, want);
            // Positions restart per segment; labels -100 at segment starts; cu_seqlens ends at the total.
            prop_assert_eq!(*one.cu_seqlens.last().unwrap() as usize, one.rows * one.width);
            for w in one.cu_seqlens.windows(2) {
                let (a, b) = (w[0] as usize, w[1] as usize);
                prop_assert!(b > a);
                prop_assert_eq!(one.labels[a], IGNORE_INDEX);
                for (k, &p) in one.position_ids[a..b].iter().enumerate() {
                    prop_assert_eq!(p, k as i64);
                }
            }
            let separators = one.input_ids.iter().filter(|&&t| t == -7).count() as u64;
            prop_assert_eq!(one.num_tokens, plan.stats.total_tokens);
            prop_assert!(separators <= reserve * plan.num_segments() as u64);
        }
    }
}
