//! Context parallelism (CP): a packed stream of sequences split across `cp_size` ranks.
//!
//! Every framework re-derives these arrays and keeps getting one wrong (a length-7 sequence
//! read as 6, unpadded `cu_seqlens` leaking across sequences, rank-local `cu_seqlens` wrong
//! on every rank but 0); this module computes them once, from the stream's real
//! `cu_seqlens`, for three modes:
//!
//! - [`CpMode::Zigzag`] — TransformerEngine's THD layout: every sequence is padded to a
//!   multiple of `2·cp·pad_multiple` and cut into `2·cp` chunks; rank `r` holds chunks `r`
//!   and `2·cp−1−r` of every sequence, in that order, so causal attention work is the same
//!   on every rank. `cu_seqlens_padded` is TE's `cu_seqlens_{q,kv}_padded` and
//!   [`rank_tokens`]'s indices are `tex.thd_get_partitioned_indices(cu_seqlens_padded, ...)`.
//! - [`CpMode::Contiguous`] — ring-flash-attn's "llama3" layout: the stream is padded to a
//!   multiple of `cp·pad_multiple` (the last sequence absorbs the pad, as NeMo-RL and
//!   OpenRLHF do) and cut into `cp` contiguous slices; [`rank_attention`] gives
//!   `llama3_flash_attn_prepare_cu_seqlens`' `cu_seqlens_q`, `cu_seqlens_k`,
//!   `max_seqlen_q/k` and `local_k_slice`.
//! - [`CpMode::Ulysses`] — the contiguous slices (heads are exchanged by an all-to-all
//!   around attention, which then sees whole sequences).
//!
//! Pads never move a real token: a sequence's pads come after its last real token, so no
//! real query attends to one, and positions continue through them (TE's
//! `generate_positional_ids_for_cp`). Nothing is rounded down and no array a kernel reads
//! holds a sentinel.
//!
//! ```
//! use fastpack_core::context_parallel::{rank_tokens, stream_layout, CpMode, CpSpec};
//! // TransformerEngine's test vector: two sequences of 8 tokens, cp = 2.
//! let layout = stream_layout(&[0, 8, 16], CpSpec::new(2, CpMode::Zigzag, 1).unwrap()).unwrap();
//! assert_eq!(rank_tokens(&layout, 0).unwrap().indices, [0, 1, 6, 7, 8, 9, 14, 15]);
//! assert_eq!(rank_tokens(&layout, 1).unwrap().indices, [2, 3, 4, 5, 10, 11, 12, 13]);
//! ```

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory::{try_fill_blocks, try_filled, try_with_capacity, Word};

/// `n` zeros for an output that is written in full: zeros written up front (a fresh zeroed
/// mapping, `memory::try_zeroed`'s choice for buffers mostly never written, costs more
/// page faults than writing them saves here).
fn try_filled_zero<T: Word>(n: usize, what: &'static str) -> Result<Vec<T>> {
    try_filled(n, T::default(), what)
}

/// How a stream is split across the ranks of a CP group (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpMode {
    Zigzag,
    Contiguous,
    Ulysses,
}

impl CpMode {
    pub const ALL: [CpMode; 3] = [CpMode::Zigzag, CpMode::Contiguous, CpMode::Ulysses];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "zigzag" => Ok(CpMode::Zigzag),
            "contiguous" => Ok(CpMode::Contiguous),
            "ulysses" => Ok(CpMode::Ulysses),
            other => Err(Error::invalid(
                "cp_mode",
                format!("unknown value {other:?}; expected 'zigzag', 'contiguous' or 'ulysses'"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CpMode::Zigzag => "zigzag",
            CpMode::Contiguous => "contiguous",
            CpMode::Ulysses => "ulysses",
        }
    }
}

/// The largest CP group and padding divisor accepted: padded lengths stay far inside
/// int32 `cu_seqlens`.
pub const MAX_CP_SIZE: u64 = 1 << 16;
pub const MAX_DIVISOR: u64 = 1 << 30;

/// A CP group's size, mode and padding multiple, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpSpec {
    pub cp_size: u64,
    pub mode: CpMode,
    pub pad_multiple: u64,
}

impl CpSpec {
    pub fn new(cp_size: u64, mode: CpMode, pad_multiple: u64) -> Result<Self> {
        if !(1..=MAX_CP_SIZE).contains(&cp_size) {
            return Err(Error::invalid(
                "cp_size",
                format!("got {cp_size}; expected an integer in 1..={MAX_CP_SIZE}"),
            ));
        }
        if pad_multiple == 0 {
            return Err(Error::invalid("pad_multiple", "got 0; expected an integer >= 1"));
        }
        let spec = CpSpec { cp_size, mode, pad_multiple };
        match spec.chunks().checked_mul(pad_multiple) {
            Some(d) if d <= MAX_DIVISOR => Ok(spec),
            _ => Err(Error::invalid(
                "pad_multiple",
                format!(
                    "got {pad_multiple}; with cp_size={cp_size} and cp_mode={:?} lengths would \
                     be padded to multiples of more than 2^30; expected a smaller multiple",
                    mode.name()
                ),
            )),
        }
    }

    /// Whether sequences are cut into `2·cp` chunks: zigzag on more than one rank (one
    /// rank holds every token in order, whatever the mode, as TE and NeMo-RL do at cp = 1).
    pub fn chunked(&self) -> bool {
        self.mode == CpMode::Zigzag && self.cp_size > 1
    }

    /// Chunks a padded sequence (zigzag) or the padded stream is cut into.
    fn chunks(&self) -> u64 {
        match self.mode {
            CpMode::Zigzag if self.cp_size > 1 => 2 * self.cp_size,
            CpMode::Zigzag => 1,
            CpMode::Contiguous | CpMode::Ulysses => self.cp_size,
        }
    }

    /// What padded lengths are multiples of: each sequence's (zigzag: `2·cp·pad_multiple`,
    /// or `pad_multiple` on one rank) or the stream's (`cp·pad_multiple`, contiguous and
    /// Ulysses).
    pub fn divisor(&self) -> u64 {
        self.chunks() * self.pad_multiple
    }

    /// The padded length of a sequence of `len` tokens inside a stream (zigzag rounds it
    /// up; the other modes pad only the stream's end).
    #[inline(always)]
    pub fn sequence_padded(&self, len: u64) -> u64 {
        match self.mode {
            CpMode::Zigzag => round_up(len, self.divisor()),
            CpMode::Contiguous | CpMode::Ulysses => len,
        }
    }

    /// The padded length of a whole stream whose sequences' padded lengths sum to `total`.
    pub fn stream_padded(&self, total: u64) -> u64 {
        match self.mode {
            CpMode::Zigzag => total,
            CpMode::Contiguous | CpMode::Ulysses => round_up(total, self.divisor()),
        }
    }
}

/// `x` rounded up to a multiple of `d` (a mask when `d` is a power of two, as CP groups
/// and their multiples usually are).
#[inline(always)]
fn round_up(x: u64, d: u64) -> u64 {
    if d.is_power_of_two() {
        (x + d - 1) & !(d - 1)
    } else {
        x.div_ceil(d) * d
    }
}

/// One stream (a packed row): its real and padded `cu_seqlens`.
#[derive(Clone, Debug)]
pub struct StreamLayout {
    pub spec: CpSpec,
    /// Real lengths (int32 [N+1], from 0): TE's `cu_seqlens_{q,kv}`.
    pub cu_seqlens: Vec<i32>,
    /// Offsets in the padded stream (int32 [N+1]): TE's `cu_seqlens_{q,kv}_padded`. In the
    /// contiguous modes only the last entry differs from `cu_seqlens`.
    pub cu_seqlens_padded: Vec<i32>,
}

impl StreamLayout {
    pub fn num_sequences(&self) -> usize {
        self.cu_seqlens.len() - 1
    }
    pub fn padded_total(&self) -> i64 {
        *self.cu_seqlens_padded.last().unwrap_or(&0) as i64
    }
    pub fn real_total(&self) -> i64 {
        *self.cu_seqlens.last().unwrap_or(&0) as i64
    }
    /// Tokens each rank holds (every rank the same).
    pub fn local_tokens(&self) -> i64 {
        self.padded_total() / self.spec.cp_size as i64
    }
    fn len(&self, seq: usize) -> i64 {
        (self.cu_seqlens[seq + 1] - self.cu_seqlens[seq]) as i64
    }
    fn padded_start(&self, seq: usize) -> i64 {
        self.cu_seqlens_padded[seq] as i64
    }
    fn padded_len(&self, seq: usize) -> i64 {
        (self.cu_seqlens_padded[seq + 1] - self.cu_seqlens_padded[seq]) as i64
    }
}

/// Checks real `cu_seqlens` (from 0, non-decreasing, no sentinel) and pads them.
pub fn stream_layout(cu_seqlens: &[i32], spec: CpSpec) -> Result<StreamLayout> {
    check_cu_seqlens(cu_seqlens)?;
    let n = cu_seqlens.len() - 1;
    let mut padded = try_with_capacity::<i32>(n + 1, "cu_seqlens_padded")?;
    padded.push(0);
    let mut acc: u64 = 0;
    for w in cu_seqlens.windows(2) {
        acc += spec.sequence_padded((w[1] - w[0]) as u64);
        padded.push(fit_i32(acc, spec)?);
    }
    let total = spec.stream_padded(acc);
    if let Some(last) = padded.last_mut() {
        // The last sequence absorbs the stream's pad (NeMo-RL's and OpenRLHF's rule).
        *last = fit_i32(total, spec)?;
    }
    let mut real = try_with_capacity::<i32>(n + 1, "cu_seqlens")?;
    real.extend_from_slice(cu_seqlens);
    Ok(StreamLayout { spec, cu_seqlens: real, cu_seqlens_padded: padded })
}

fn fit_i32(value: u64, spec: CpSpec) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        Error::overflow(
            "cu_seqlens",
            format!(
                "padded to multiples of {} ({} mode, cp_size={}, pad_multiple={}) the stream \
                 would hold {value} tokens or more, over 2^31 - 1 (cu_seqlens are int32)",
                spec.divisor(),
                spec.mode.name(),
                spec.cp_size,
                spec.pad_multiple
            ),
        )
    })
}

fn check_cu_seqlens(cu: &[i32]) -> Result<()> {
    let Some(&first) = cu.first() else {
        return Err(Error::invalid(
            "cu_seqlens",
            "is empty; expected [0, ..., total] (N+1 entries)",
        ));
    };
    if let Some(i) = cu.iter().position(|&v| v < 0) {
        return Err(Error::invalid(
            "cu_seqlens",
            format!(
                "entry {i} is {}: a padding sentinel (fixed-shape cu_seqlens pad with -1)? \
                 expected non-negative offsets; pass only the valid prefix",
                cu[i]
            ),
        ));
    }
    if first != 0 {
        return Err(Error::invalid("cu_seqlens", format!("starts at {first}; expected 0")));
    }
    if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::invalid(
            "cu_seqlens",
            format!(
                "decreases at entry {}: {} after {}; expected non-decreasing offsets",
                i + 1,
                cu[i + 1],
                cu[i]
            ),
        ));
    }
    Ok(())
}

fn check_rank(layout: &StreamLayout, rank: u64) -> Result<()> {
    if rank >= layout.spec.cp_size {
        return Err(Error::invalid(
            "cp_rank",
            format!("got {rank}; expected an integer in 0..={}", layout.spec.cp_size - 1),
        ));
    }
    Ok(())
}

/// The tokens one rank holds, in its local order (int64 [padded_total / cp] each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankTokens {
    /// Positions in the padded stream (TE's `thd_get_partitioned_indices` for zigzag).
    pub indices: Vec<i64>,
    /// Position of each token inside its sequence, continuing through its pads
    /// (`generate_positional_ids_for_cp`, taken at `indices`).
    pub positions: Vec<i64>,
    /// Each token's position in the real (unpadded) stream, or -1 for a pad.
    pub sources: Vec<i64>,
}

/// Local tokens per parallel task.
const TOKEN_BLOCK: usize = 1 << 15;

/// [`RankTokens`] of `rank`, in parallel over blocks of the output (the same result on any
/// number of threads; run inside [`crate::pool::install`] to choose them).
pub fn rank_tokens(layout: &StreamLayout, rank: u64) -> Result<RankTokens> {
    check_rank(layout, rank)?;
    let n = layout.local_tokens() as usize;
    let mut out = RankTokens {
        indices: try_filled_zero(n, "indices")?,
        positions: try_filled_zero(n, "positions")?,
        sources: try_filled_zero(n, "sources")?,
    };
    out.indices
        .par_chunks_mut(TOKEN_BLOCK)
        .zip(out.positions.par_chunks_mut(TOKEN_BLOCK))
        .zip(out.sources.par_chunks_mut(TOKEN_BLOCK))
        .enumerate()
        .for_each(|(block, ((indices, positions), sources))| {
            write_tokens(layout, rank as i64, block * TOKEN_BLOCK, indices, positions, sources)
        });
    Ok(out)
}

/// Writes local tokens `first..first + indices.len()` of `rank`, a run (consecutive
/// stream positions of one sequence) at a time.
fn write_tokens(
    layout: &StreamLayout,
    rank: i64,
    first: usize,
    indices: &mut [i64],
    positions: &mut [i64],
    sources: &mut [i64],
) {
    let cp = layout.spec.cp_size as i64;
    let padded = &layout.cu_seqlens_padded;
    let zigzag = layout.spec.chunked();
    // Zigzag walks each sequence's local share (cu_seqlens_padded / cp, the same offsets
    // on every rank); the other modes walk the rank's slice of the stream.
    let base = if zigzag { 0 } else { rank * layout.local_tokens() };
    let scale = if zigzag { cp } else { 1 };
    let (mut j, end) = (first as i64, (first + indices.len()) as i64);
    // The last sequence starting at or before the first token (an empty one is skipped:
    // the next start is past the token too).
    let mut seq = padded.partition_point(|&s| s as i64 <= (base + j) * scale) - 1;
    let mut k = 0usize;
    while j < end {
        while padded[seq + 1] as i64 <= (base + j) * scale {
            seq += 1;
        }
        let start = layout.padded_start(seq);
        // This run: `count` tokens from stream position `p`.
        let (p, count) = if zigzag {
            let c = layout.padded_len(seq) / (2 * cp);
            let o = j - start / cp;
            if o < c {
                (start + rank * c + o, (c - o).min(end - j))
            } else {
                (start + (2 * cp - 1 - rank) * c + (o - c), (2 * c - o).min(end - j))
            }
        } else {
            let p = base + j;
            (p, (padded[seq + 1] as i64 - p).min(end - j))
        };
        let real = (start + layout.len(seq) - p).clamp(0, count) as usize;
        let n = count as usize;
        let source = layout.cu_seqlens[seq] as i64 - start;
        for (i, ((index, position), src)) in indices[k..k + n]
            .iter_mut()
            .zip(&mut positions[k..k + n])
            .zip(&mut sources[k..k + n])
            .enumerate()
        {
            let at = p + i as i64;
            *index = at;
            *position = at - start;
            *src = if i < real { at + source } else { -1 };
        }
        j += count;
        k += n;
    }
}

/// What attention on one rank needs: the rank's runs (a run is a piece of one sequence
/// that is contiguous both locally and in the stream) and the keys each run attends to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankAttention {
    /// Run boundaries in the rank's local tokens (int32 [R+1]). Contiguous and Ulysses:
    /// ring-flash-attn's llama3 `cu_seqlens_q`. Also the rank-local `cu_seqlens` that
    /// convolution and linear-attention layers need (`seq_idx` restarts at every run).
    pub cu_seqlens_q: Vec<i32>,
    /// Each run's keys (int32 [R+1]): from its sequence's first token through the run's
    /// last, causally. Contiguous: llama3's `cu_seqlens_k`.
    pub cu_seqlens_k: Vec<i32>,
    pub max_seqlen_q: i32,
    pub max_seqlen_k: i32,
    /// The sequence each run belongs to (int64 [R]).
    pub run_sequences: Vec<i64>,
    /// Contiguous and Ulysses (and zigzag on one rank): llama3's `local_k_slice` — the
    /// keys of every run, one range of the padded stream (all-gathered K/V in rank order
    /// are the stream).
    pub local_k_slice: Option<(i64, i64)>,
    /// Zigzag on more than one rank: for each run's keys, its row in K/V all-gathered in
    /// rank order
    /// (`rank · padded_total/cp + local index`); int64 [cu_seqlens_k[-1]].
    pub k_index: Option<Vec<i64>>,
}

/// [`RankAttention`] of `rank` (see its fields for the contracts matched).
pub fn rank_attention(layout: &StreamLayout, rank: u64) -> Result<RankAttention> {
    check_rank(layout, rank)?;
    if layout.spec.chunked() {
        zigzag_attention(layout, rank as i64)
    } else {
        contiguous_attention(layout, rank as i64)
    }
}

fn max_diff(cu: &[i32]) -> i32 {
    cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// ring-flash-attn's `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens_padded, causal=True,
/// rank, cp)`: the sequences from the one holding the slice's first token through the one
/// holding its end, their query parts clipped to the slice and their keys running from
/// the first sequence's start to the slice's end.
fn contiguous_attention(layout: &StreamLayout, rank: i64) -> Result<RankAttention> {
    let cu = &layout.cu_seqlens_padded;
    let length = layout.local_tokens();
    let (lo, hi) = (rank * length, (rank + 1) * length);
    let mut left = cu.partition_point(|&v| (v as i64) < lo);
    if left == cu.len() || cu[left] as i64 != lo {
        left -= 1;
    }
    let right = cu.partition_point(|&v| (v as i64) < hi).min(cu.len() - 1);
    let slice_left = cu[left] as i64;
    let runs = right - left;
    let mut q = try_with_capacity::<i32>(runs + 1, "cu_seqlens_q")?;
    let mut k = try_with_capacity::<i32>(runs + 1, "cu_seqlens_k")?;
    for (i, &v) in cu[left..=right].iter().enumerate() {
        let v = v as i64;
        let last = i == runs;
        q.push(if i == 0 {
            0
        } else if last {
            length
        } else {
            v - lo
        } as i32);
        k.push((if last { hi } else { v } - slice_left) as i32);
    }
    let mut run_sequences = try_with_capacity::<i64>(runs, "run_sequences")?;
    run_sequences.extend((left..right).map(|s| s as i64));
    Ok(RankAttention {
        max_seqlen_q: max_diff(&q),
        max_seqlen_k: max_diff(&k),
        cu_seqlens_q: q,
        cu_seqlens_k: k,
        run_sequences,
        local_k_slice: Some((slice_left, hi)),
        k_index: None,
    })
}

/// Zigzag: two runs per sequence, chunk `r` (keys: the first `r + 1` chunks) and chunk
/// `2cp − 1 − r` (keys: the first `2cp − r` chunks).
fn zigzag_attention(layout: &StreamLayout, rank: i64) -> Result<RankAttention> {
    let cp = layout.spec.cp_size as i64;
    let n = layout.num_sequences();
    let chunk = |seq: usize| layout.padded_len(seq) / (2 * cp);
    let key_counts = [rank + 1, 2 * cp - rank];
    let mut q = try_with_capacity::<i32>(2 * n + 1, "cu_seqlens_q")?;
    let mut k = try_with_capacity::<i32>(2 * n + 1, "cu_seqlens_k")?;
    let mut run_sequences = try_with_capacity::<i64>(2 * n, "run_sequences")?;
    q.push(0);
    k.push(0);
    let (mut q_acc, mut k_acc) = (0i64, 0i64);
    for seq in 0..n {
        let c = chunk(seq);
        for keys in key_counts {
            q_acc += c;
            k_acc += keys * c;
            q.push(q_acc as i32);
            k.push(i32::try_from(k_acc).map_err(|_| {
                Error::overflow(
                    "cu_seqlens",
                    "the keys of one rank's runs add up to 2^31 tokens or more (int32 \
                     cu_seqlens_k); use a smaller pack",
                )
            })?);
            run_sequences.push(seq as i64);
        }
    }
    // Rows of the rank-ordered all-gather: stream position p of sequence s, in chunk
    // q = (p - start) / c, lives on rank q (first half) or 2cp - 1 - q (second half), at
    // that rank's local offset start / cp (+ c in the second half).
    let local = layout.local_tokens();
    let mut k_index: Vec<i64> = try_filled_zero(k_acc as usize, "k_index")?;
    let mut rest: &mut [i64] = &mut k_index;
    let mut pieces = Vec::with_capacity(n);
    for seq in 0..n {
        let (head, tail) =
            rest.split_at_mut(((key_counts[0] + key_counts[1]) * chunk(seq)) as usize);
        pieces.push((seq, head));
        rest = tail;
    }
    pieces.par_iter_mut().with_min_len(64).for_each(|(seq, out)| {
        let (seq, c) = (*seq, chunk(*seq));
        let share = layout.padded_start(seq) / cp;
        let mut rows = out.chunks_exact_mut(c.max(1) as usize);
        for keys in key_counts {
            for q in 0..keys {
                // Chunk q of the sequence: its rank's first (q < cp) or second half.
                let row =
                    if q < cp { q * local + share } else { (2 * cp - 1 - q) * local + share + c };
                if let Some(run) = rows.next() {
                    for (i, slot) in run.iter_mut().enumerate() {
                        *slot = row + i as i64;
                    }
                }
            }
        }
    });
    Ok(RankAttention {
        max_seqlen_q: max_diff(&q),
        max_seqlen_k: max_diff(&k),
        cu_seqlens_q: q,
        cu_seqlens_k: k,
        run_sequences,
        local_k_slice: None,
        k_index: Some(k_index),
    })
}

/// `Σ (p + 1)` over real positions `p` in `[a, b)` of a sequence of `len` real tokens: the
/// keys those queries attend to, causally.
fn causal_work(a: u64, b: u64, len: u64) -> u64 {
    let b = b.min(len);
    if b <= a {
        return 0;
    }
    tri(b) - tri(a)
}

/// `x (x + 1) / 2` for `0 <= x < 2^32` (lengths are int32): fits a u64.
#[inline(always)]
fn tri(x: u64) -> u64 {
    x * (x + 1) / 2
}

/// Division by a divisor fixed for a whole call (a CP group's `2·cp` chunks, its `cp`
/// ranks, its padding multiple), for dividends below 2^32 (lengths and the padded totals
/// of streams are int32): [`Shift`] when every divisor of the call is a power of two, as
/// CP groups and their multiples usually are, else [`Reciprocal`]. The layout's loops are
/// compiled once for each, so neither branches per item.
trait Div: Copy + Send + Sync {
    fn new(d: u64) -> Self;
    /// `x / d`.
    fn div(self, x: u64) -> u64;
    /// `x` rounded up to a multiple of `d` (for `x + d - 1 < 2^32`).
    fn round_up(self, x: u64) -> u64;
}

/// A power-of-two divisor: a shift, and a mask to round up.
#[derive(Clone, Copy, Debug)]
struct Shift {
    shift: u32,
    low: u64,
}

impl Div for Shift {
    fn new(d: u64) -> Self {
        debug_assert!(d.is_power_of_two());
        Shift { shift: d.trailing_zeros(), low: d - 1 }
    }
    #[inline(always)]
    fn div(self, x: u64) -> u64 {
        x >> self.shift
    }
    #[inline(always)]
    fn round_up(self, x: u64) -> u64 {
        (x + self.low) & !self.low
    }
}

/// Any divisor below 2^32: a multiply by `ceil(2^64 / d)` and a shift by 64 (`1` and 0 for
/// `d = 1`), exact for every dividend below 2^32 (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019).
#[derive(Clone, Copy, Debug)]
struct Reciprocal {
    d: u64,
    magic: u64,
    shift: u32,
}

impl Div for Reciprocal {
    fn new(d: u64) -> Self {
        debug_assert!((1..1 << 32).contains(&d));
        match d {
            1 => Reciprocal { d, magic: 1, shift: 0 },
            _ => Reciprocal { d, magic: u64::MAX / d + 1, shift: 64 },
        }
    }
    #[inline(always)]
    fn div(self, x: u64) -> u64 {
        ((self.magic as u128 * x as u128) >> self.shift) as u64
    }
    #[inline(always)]
    fn round_up(self, x: u64) -> u64 {
        self.div(x + self.d - 1) * self.d
    }
}

/// Calls `$run` with the divisor type the CP group's divisors allow (see [`Div`]).
macro_rules! with_div {
    ($spec:expr, $run:ident ( $($arg:expr),* )) => {{
        let spec: CpSpec = $spec;
        if spec.divisor().is_power_of_two() && spec.cp_size.is_power_of_two() {
            $run(StreamRules::<Shift>::new(spec), $($arg),*)
        } else {
            $run(StreamRules::<Reciprocal>::new(spec), $($arg),*)
        }
    }};
}

/// What the layout of a stream needs besides its lengths, fixed for a whole call.
#[derive(Clone, Copy, Debug)]
struct StreamRules<D> {
    spec: CpSpec,
    cp: u64,
    /// The padding divisor: each sequence's (zigzag) or the stream's (the other modes).
    pad: D,
    /// `2·cp` (zigzag's chunks per sequence).
    chunks: D,
    /// `cp` (the contiguous modes' slices of a stream).
    ranks: D,
}

impl<D: Div> StreamRules<D> {
    fn new(spec: CpSpec) -> Self {
        let cp = spec.cp_size;
        StreamRules {
            spec,
            cp,
            pad: D::new(spec.divisor()),
            chunks: D::new(2 * cp),
            ranks: D::new(cp),
        }
    }

    /// The stream's padded tokens, and each rank's attention work into `work` (`[cp]`,
    /// every entry written) when given, from the real lengths of its sequences (each in
    /// `0..2^31`; `spill`: `[cp]` zeros, left so). `None`: the padded stream would not fit
    /// int32 `cu_seqlens` (`work` is then left unspecified).
    #[inline(always)]
    fn stream(&self, lens: &[i32], work: Option<&mut [u64]>, spill: &mut [u64]) -> Option<u64> {
        if self.spec.chunked() {
            return self.zigzag(lens, work, spill);
        }
        let lens = lens.iter().map(|&l| l as u64);
        let padded = if self.spec.mode == CpMode::Zigzag {
            // One rank: every sequence padded to `pad_multiple`, nothing cut.
            lens.clone().map(|l| self.pad.round_up(l)).sum::<u64>()
        } else {
            // The sum checked first: the divisor takes dividends below 2^32.
            let total = lens.clone().sum::<u64>();
            if total > i32::MAX as u64 {
                return None;
            }
            self.pad.round_up(total)
        };
        if padded > i32::MAX as u64 {
            return None;
        }
        let Some(work) = work else { return Some(padded) };
        if self.cp == 1 {
            work[0] = lens.map(tri).sum();
        } else if self.spec.mode == CpMode::Ulysses {
            let total: u64 = lens.map(tri).sum();
            let (share, rest) = (total / self.cp, total % self.cp);
            for (r, w) in work.iter_mut().enumerate() {
                *w = share + u64::from((r as u64) < rest);
            }
        } else {
            self.contiguous_work(lens, self.ranks.div(padded), work);
        }
        Some(padded)
    }

    /// Zigzag, in one pass: a sequence of `P` padded tokens is cut into `2·cp` chunks of
    /// `c = P / 2cp`; rank `r` holds chunks `r` and `2cp−1−r`, whose causal pairs add up
    /// to `2cp·c² + c` on every rank, less what the pad removes: the pairs of positions
    /// `len..P`, all in the top chunk (rank 0's) unless the pad is longer than a chunk. So
    /// a sequence costs a few sums and one product, and only short sequences, in a
    /// second pass, walk their chunks.
    #[inline(always)]
    fn zigzag(&self, lens: &[i32], work: Option<&mut [u64]>, spill: &mut [u64]) -> Option<u64> {
        let (mut padded, mut sum_c, mut sum_c2, mut top) = (0u64, 0u64, 0u64, 0u64);
        let mut spilled = false;
        // Wrapping: a stream padded past int32 is refused below, whatever the sums hold;
        // one that fits keeps every sum far below 2^64 (`Σc² <= (Σc)²`).
        for &l in lens {
            let len = l as u64;
            let p = self.pad.round_up(len);
            let c = self.chunks.div(p);
            padded = padded.wrapping_add(p);
            sum_c = sum_c.wrapping_add(c);
            sum_c2 = sum_c2.wrapping_add(c.wrapping_mul(c));
            // Rank 0's top chunk loses positions max(len, P - c)..P: tri(P) - tri(m).
            let m = len.max(p - c);
            top = top.wrapping_add((p - m).wrapping_mul(p + m + 1) / 2);
            spilled |= len < p - c;
        }
        if padded > i32::MAX as u64 {
            return None;
        }
        let Some(work) = work else { return Some(padded) };
        if spilled {
            for &l in lens {
                let len = l as u64;
                let p = self.pad.round_up(len);
                let c = self.chunks.div(p);
                if len < p - c {
                    self.spill(len, p - c, c, spill);
                }
            }
        }
        let common = 2 * self.cp * sum_c2 + sum_c;
        // Every rank's work written once; `spill` left all zero for the next stream.
        for (w, s) in work.iter_mut().zip(spill.iter_mut()) {
            *w = common - std::mem::take(s);
        }
        work[0] -= top;
        Some(padded)
    }

    /// A pad longer than a chunk: the pairs it removes below the top chunk (positions
    /// `len..hi`, `hi` the top chunk's start), chunk by chunk downwards, each to its
    /// chunk's rank (chunk `q`'s: `q` in the first half, `2cp−1−q` in the second).
    #[cold]
    fn spill(&self, len: u64, mut hi: u64, c: u64, spill: &mut [u64]) {
        let cp = self.cp;
        let mut q = 2 * cp - 2;
        loop {
            let lo = hi - c;
            let owner = if q < cp { q } else { 2 * cp - 1 - q };
            spill[owner as usize] += tri(hi) - tri(lo.max(len));
            if lo <= len {
                return;
            }
            (hi, q) = (lo, q - 1);
        }
    }

    /// Contiguous: rank `r` holds positions `[r·share, (r+1)·share)` of the stream (its
    /// pad at the end); a sequence inside one slice adds `tri(len)` to it, one across
    /// slices adds each slice its part. Each rank's work is written once, in order.
    #[inline(always)]
    fn contiguous_work(&self, lens: impl Iterator<Item = u64>, share: u64, work: &mut [u64]) {
        let (mut r, mut bound, mut acc, mut start) = (0usize, share, 0u64, 0u64);
        for len in lens {
            let end = start + len;
            if end <= bound {
                acc += tri(len);
            } else {
                let mut from = start;
                while end > bound && r + 1 < work.len() {
                    work[r] = acc + causal_work(from - start, bound - start, len);
                    (acc, r, from, bound) = (0, r + 1, bound, bound + share);
                }
                acc += causal_work(from - start, end - start, len);
            }
            start = end;
        }
        work[r] = acc;
        work[r + 1..].fill(0);
    }
}

/// Attention work of every rank of one stream: the (query, key) pairs its real queries
/// attend to, causally (`[cp]`), in units of all heads. Zigzag gives every rank the same
/// within a chunk's worth; contiguous gives the last ranks the long sequences' ends;
/// Ulysses gives every rank every pair for `1/cp` of the heads (the remainder of the
/// division to the first ranks, so the ranks' work adds up to the stream's).
pub fn stream_work(layout: &StreamLayout) -> Vec<u64> {
    let cp = layout.spec.cp_size as usize;
    let lens: Vec<i32> = layout.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
    let (mut work, mut spill) = (vec![0u64; cp], vec![0u64; cp]);
    fn run<D: Div>(rules: StreamRules<D>, lens: &[i32], work: &mut [u64], spill: &mut [u64]) {
        // The layout's padded total fits int32 (checked when it was made).
        rules.stream(lens, Some(work), spill);
    }
    with_div!(layout.spec, run(&lens, &mut work, &mut spill));
    work
}

/// Many streams at once (a plan's packs, or a dataset's steps): streams are CSR ranges
/// `offsets[i]..offsets[i+1]` of `seqlens`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamsLayout {
    /// Each stream's padded tokens (int64 [P]).
    pub padded_tokens: Vec<i64>,
    /// Each stream's attention work per rank (uint64 [P * cp], row-major), as
    /// [`stream_work`]; empty when not asked for.
    pub work: Vec<u64>,
}

/// Streams per parallel task: a few hundred tasks for a plan of 10^7 sequences, enough to
/// balance two busy cores, few enough that a task's start costs nothing (a few under the
/// tests, so their small plans cross blocks as real ones do).
const STREAM_BLOCK: usize = if cfg!(any(test, miri)) { 3 } else { 1 << 12 };

/// [`StreamsLayout`] of every stream, each output written once, in place, in parallel over
/// blocks of streams (the same result on any number of threads); `with_work: false`
/// computes only the padded tokens (`Plan.pad_tokens` reads nothing else).
pub fn streams_layout(
    seqlens: &[i32],
    offsets: &[i64],
    spec: CpSpec,
    with_work: bool,
) -> Result<StreamsLayout> {
    check_offsets(offsets, seqlens.len())?;
    let width = if with_work { spec.cp_size as usize } else { 0 };
    let filled = with_div!(spec, fill_streams(seqlens, offsets, width))?;
    match filled {
        Ok((padded_tokens, work)) => Ok(StreamsLayout { padded_tokens, work }),
        Err(Failure::Negative(i)) => Err(Error::invalid(
            "seqlens",
            format!("entry {i} is {}; expected non-negative lengths", seqlens[i]),
        )),
        Err(Failure::Overflow(real)) => Err(Error::overflow(
            "cu_seqlens",
            format!(
                "padded to multiples of {} ({} mode, cp_size={}, pad_multiple={}) a stream of \
                 {real} tokens would hold over 2^31 - 1 (cu_seqlens are int32)",
                spec.divisor(),
                spec.mode.name(),
                spec.cp_size,
                spec.pad_multiple
            ),
        )),
    }
}

/// The blocks of [`streams_layout`], with the divisors of `rules`.
#[allow(clippy::type_complexity)]
fn fill_streams<D: Div>(
    rules: StreamRules<D>,
    seqlens: &[i32],
    offsets: &[i64],
    width: usize,
) -> Result<std::result::Result<(Vec<i64>, Vec<u64>), Failure>> {
    let (streams, cp) = (offsets.len() - 1, rules.cp as usize);
    try_fill_blocks(
        (streams, STREAM_BLOCK),
        (streams * width, STREAM_BLOCK * width),
        "the streams' layout",
        |block, tokens, works| {
            let o = &offsets[block * STREAM_BLOCK..=block * STREAM_BLOCK + tokens.capacity()];
            let base = o[0];
            let lens = &seqlens[base as usize..o[o.len() - 1] as usize];
            // Checked before any arithmetic (the rules take lengths in 0..2^31), in one
            // vectorised pass over the block (it stays in cache for the next).
            if lens.iter().fold(0, |any, &l| any | l) < 0 {
                let i = lens.iter().position(|&l| l < 0).unwrap_or(0);
                return Err(Failure::Negative(base as usize + i));
            }
            let (mut one, mut spill) = (vec![0u64; width], vec![0u64; cp]);
            for w in o.windows(2) {
                let lens = &lens[(w[0] - base) as usize..(w[1] - base) as usize];
                let want = (width > 0).then_some(&mut one[..]);
                let Some(padded) = rules.stream(lens, want, &mut spill) else {
                    return Err(Failure::Overflow(lens.iter().map(|&l| l as u64).sum()));
                };
                tokens.push(padded as i64);
                for &w in &one {
                    works.push(w);
                }
            }
            Ok(())
        },
    )
}

/// Why a block of streams stopped.
#[derive(Clone, Copy, Debug)]
enum Failure {
    /// `seqlens[i]` is negative.
    Negative(usize),
    /// A stream of these real tokens would be padded past int32.
    Overflow(u64),
}

/// What planning packs for a CP group needs from the real lengths of a plan's sequences
/// (see [`plan_lengths`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlannedLengths {
    /// Zigzag: each sequence's length as the packer plans it, `roundup(len + reserve, d) −
    /// reserve` (an empty one stays 0), so every piece of it starts at a multiple of `d`;
    /// empty in the other modes (they pad a pack's end: a smaller cap plans for it).
    pub planned: Vec<i64>,
    /// Sequences whose length plus `reserve` exceeds the top cap.
    pub overlong: u64,
    /// The first of them.
    pub first_overlong: Option<usize>,
    /// Their real tokens.
    pub overlong_tokens: u64,
    /// Their tokens (with `reserve`) beyond the top cap.
    pub overlong_excess: u64,
}

/// Lengths per parallel task of [`plan_lengths`] and [`real_seqlens`].
const LENGTH_BLOCK: usize = if cfg!(any(test, miri)) { 5 } else { 1 << 16 };

/// One pass over a plan's real lengths for a CP group: the lengths the packer plans on
/// (zigzag) and the sequences longer than `top` (the largest cap, rounded down to the
/// padding divisor) with `reserve`, in parallel; a negative length is refused as the
/// packer refuses it.
pub fn plan_lengths<L: Copy + Into<i64> + Sync>(
    lengths: &[L],
    spec: CpSpec,
    reserve: u64,
    top: u64,
) -> Result<PlannedLengths> {
    #[derive(Clone, Copy, Default)]
    struct Scan {
        negative: Option<(usize, i64)>,
        overlong: u64,
        first: Option<usize>,
        tokens: u64,
        excess: u64,
    }
    let scan = lengths
        .par_chunks(LENGTH_BLOCK)
        .enumerate()
        .map(|(b, chunk)| {
            let mut s = Scan::default();
            for (i, &l) in chunk.iter().enumerate() {
                let l: i64 = l.into();
                if l < 0 {
                    s.negative = s.negative.or(Some((b * LENGTH_BLOCK + i, l)));
                } else if l > 0 && (l as u64).saturating_add(reserve) > top {
                    s.overlong += 1;
                    s.first = s.first.or(Some(b * LENGTH_BLOCK + i));
                    s.tokens = s.tokens.saturating_add(l as u64);
                    s.excess = s.excess.saturating_add(l as u64 + reserve - top);
                }
            }
            s
        })
        // In order: the first negative and overlong of the leftmost block win.
        .reduce(Scan::default, |a, b| Scan {
            negative: a.negative.or(b.negative),
            overlong: a.overlong + b.overlong,
            first: a.first.or(b.first),
            tokens: a.tokens.saturating_add(b.tokens),
            excess: a.excess.saturating_add(b.excess),
        });
    if let Some((i, v)) = scan.negative {
        return Err(Error::invalid(
            "lengths",
            format!("negative length {v} at index {i}; lengths must be non-negative integers"),
        ));
    }
    let mut planned = Vec::new();
    if spec.mode == CpMode::Zigzag {
        let d = spec.divisor();
        let (filled, _) = try_fill_blocks(
            (lengths.len(), LENGTH_BLOCK),
            (0, 0),
            "the planned lengths",
            |b, out, _: &mut crate::memory::Fill<'_, u8>| {
                for &l in &lengths[b * LENGTH_BLOCK..b * LENGTH_BLOCK + out.capacity()] {
                    let l: i64 = l.into();
                    out.push(match l {
                        0 => 0,
                        // Lengths past 2^62 tokens saturate (no pack holds them anyway).
                        _ => {
                            let extended = (l as u64).saturating_add(reserve).min(1 << 62);
                            (round_up(extended, d) - reserve.min(extended)) as i64
                        }
                    });
                }
                Ok::<(), ()>(())
            },
        )?
        .map_err(|()| Error::invalid("fastpack", "internal error: planned lengths"))?;
        planned = filled;
    }
    Ok(PlannedLengths {
        planned,
        overlong: scan.overlong,
        first_overlong: scan.first,
        overlong_tokens: scan.tokens,
        overlong_excess: scan.excess,
    })
}

/// A zigzag plan made on [`plan_lengths`]' lengths, mapped back to the real ones, in
/// place: segment `k` (a piece of sequence `sample_ids[k]` from `starts[k]`, as the packer
/// wrote it) keeps `min(seqlens[k], len + reserve − start)` tokens, the pad dropped. Every
/// piece starts at a multiple of the divisor below its sequence's real end, so none is
/// left empty.
pub fn real_seqlens<L: Copy + Into<i64> + Sync>(
    seqlens: &mut [i32],
    sample_ids: &[i64],
    starts: &[i64],
    lengths: &[L],
    reserve: u64,
) -> Result<()> {
    if sample_ids.len() != seqlens.len() || starts.len() != seqlens.len() {
        return Err(Error::invalid(
            "sample_ids",
            format!(
                "sample_ids and starts have {} and {} entries; seqlens has {}",
                sample_ids.len(),
                starts.len(),
                seqlens.len()
            ),
        ));
    }
    let bad = seqlens
        .par_chunks_mut(LENGTH_BLOCK)
        .zip(sample_ids.par_chunks(LENGTH_BLOCK))
        .zip(starts.par_chunks(LENGTH_BLOCK))
        .enumerate()
        .map(|(b, ((seqlens, ids), starts))| {
            for (k, ((len, &id), &start)) in seqlens.iter_mut().zip(ids).zip(starts).enumerate() {
                let Some(&real) = usize::try_from(id).ok().and_then(|i| lengths.get(i)) else {
                    return Some(b * LENGTH_BLOCK + k);
                };
                let reserve = i64::try_from(reserve).unwrap_or(i64::MAX);
                let kept = Into::<i64>::into(real).saturating_add(reserve).saturating_sub(start);
                if kept <= 0 {
                    return Some(b * LENGTH_BLOCK + k);
                }
                *len = (*len as i64).min(kept) as i32;
            }
            None
        })
        .reduce(|| None, |a, b| a.or(b));
    match bad {
        Some(k) => Err(Error::invalid(
            "sample_ids",
            format!(
                "segment {k} (sample {}, from {}) is not a piece of lengths' sequences",
                sample_ids[k], starts[k]
            ),
        )),
        None => Ok(()),
    }
}

fn check_offsets(offsets: &[i64], segments: usize) -> Result<()> {
    if offsets.first() != Some(&0) {
        return Err(Error::invalid("offsets", "must start at 0 (CSR offsets over the segments)"));
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::invalid(
            "offsets",
            format!("decrease at entry {}: expected non-decreasing offsets", i + 1),
        ));
    }
    if *offsets.last().unwrap() as usize != segments || *offsets.last().unwrap() < 0 {
        return Err(Error::invalid(
            "offsets",
            format!(
                "end at {}; expected the number of segments, {segments}",
                offsets.last().unwrap()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(cp: u64, mode: CpMode, pm: u64) -> CpSpec {
        CpSpec::new(cp, mode, pm).unwrap()
    }

    fn cu_of(lengths: &[u32]) -> Vec<i32> {
        let mut cu = vec![0i32];
        for &l in lengths {
            cu.push(cu.last().unwrap() + l as i32);
        }
        cu
    }

    /// TE's `thd_get_partitioned_indices`: rank r takes chunks r and 2cp-1-r of every
    /// padded sequence (written from its contract, token by token).
    fn te_indices(padded: &[i32], cp: i64, rank: i64) -> Vec<i64> {
        let mut out = Vec::new();
        for w in padded.windows(2) {
            let (s, c) = (w[0] as i64, (w[1] - w[0]) as i64 / (2 * cp));
            out.extend(s + rank * c..s + (rank + 1) * c);
            out.extend(s + (2 * cp - 1 - rank) * c..s + (2 * cp - rank) * c);
        }
        out
    }

    /// ring-flash-attn's `llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)`,
    /// transcribed from its documented semantics with a linear scan.
    #[allow(clippy::type_complexity)]
    fn llama3(cu: &[i32], rank: i64, world: i64) -> (Vec<i32>, Vec<i32>, i32, i32, (i64, i64)) {
        let total = *cu.last().unwrap() as i64;
        let l = total / world;
        let mut left = cu.iter().position(|&v| v as i64 >= rank * l).unwrap_or(cu.len());
        if left == cu.len() || cu[left] as i64 != rank * l {
            left -= 1;
        }
        let right = cu.iter().position(|&v| v as i64 >= (rank + 1) * l).unwrap_or(cu.len() - 1);
        let mut q: Vec<i32> = cu[left..=right].iter().map(|&v| v - (rank * l) as i32).collect();
        q[0] = 0;
        *q.last_mut().unwrap() = l as i32;
        let mut k: Vec<i32> = cu[left..=right].to_vec();
        *k.last_mut().unwrap() = ((rank + 1) * l) as i32;
        let slice_left = cu[left];
        for v in &mut k {
            *v -= slice_left;
        }
        let (mq, mk) = (max_diff(&q), max_diff(&k));
        (q, k, mq, mk, (slice_left as i64, (rank + 1) * l))
    }

    #[test]
    fn transformer_engine_vectors() {
        let layout = stream_layout(&[0, 8, 16], spec(2, CpMode::Zigzag, 1)).unwrap();
        assert_eq!(layout.cu_seqlens_padded, [0, 8, 16]);
        assert_eq!(rank_tokens(&layout, 0).unwrap().indices, [0, 1, 6, 7, 8, 9, 14, 15]);
        assert_eq!(rank_tokens(&layout, 1).unwrap().indices, [2, 3, 4, 5, 10, 11, 12, 13]);
        // pad_thd_sequences_for_cp's example: lengths 7, 11, 5 with cp = 2 -> [0, 8, 20, 28];
        // a length-7 sequence is padded to 8, never read as 6 (TE #1930).
        let layout = stream_layout(&[0, 7, 18, 23], spec(2, CpMode::Zigzag, 1)).unwrap();
        assert_eq!(layout.cu_seqlens_padded, [0, 8, 20, 28]);
        let t = rank_tokens(&layout, 0).unwrap();
        assert_eq!(t.positions[..4], [0, 1, 6, 7]);
        assert_eq!(t.sources[..4], [0, 1, 6, -1]); // token 7 of the first sequence is a pad
    }

    #[test]
    fn bad_input_is_an_error() {
        let s = spec(2, CpMode::Zigzag, 1);
        for (cu, what) in [
            (&[][..], "is empty"),
            (&[1, 4][..], "starts at 1"),
            (&[0, 4, 3][..], "decreases at entry 2"),
            (&[0, 4, -1][..], "entry 2 is -1: a padding sentinel"),
        ] {
            let err = stream_layout(cu, s).unwrap_err().to_string();
            assert!(err.starts_with("cu_seqlens: ") && err.contains(what), "{err}");
        }
        assert!(CpSpec::new(0, CpMode::Zigzag, 1).unwrap_err().to_string().starts_with("cp_size"));
        assert!(CpSpec::new(2, CpMode::Zigzag, 0).is_err());
        assert!(CpSpec::new(2, CpMode::Zigzag, 1 << 29).unwrap_err().to_string().contains("2^30"));
        let big = stream_layout(&[0, i32::MAX - 1], spec(4, CpMode::Contiguous, 1)).unwrap_err();
        assert!(big.to_string().contains("over 2^31 - 1"), "{big}");
        let layout = stream_layout(&[0, 8], s).unwrap();
        assert!(rank_tokens(&layout, 2).unwrap_err().to_string().starts_with("cp_rank: got 2"));
        assert!(streams_layout(&[1, 2], &[0, 3], s, true).is_err());
        let err = streams_layout(&[1, -2], &[0, 2], s, true).unwrap_err().to_string();
        assert!(err.starts_with("seqlens: entry 1 is -2"), "{err}");
        let err = streams_layout(&[i32::MAX - 1], &[0, 1], s, false).unwrap_err().to_string();
        assert!(err.contains("over 2^31 - 1"), "{err}");
        let err = streams_layout(&[i32::MAX, 1], &[0, 2], spec(2, CpMode::Ulysses, 1), true);
        assert!(err.unwrap_err().to_string().contains("over 2^31 - 1"));
    }

    fn modes() -> impl Strategy<Value = CpMode> {
        prop::sample::select(CpMode::ALL.to_vec())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(300)))]

        /// Every padded position is held by exactly one rank, every rank holds as many,
        /// pads are exactly the positions past a sequence's real tokens, sources and
        /// positions are the padded stream's, and zigzag is TE's partition.
        #[test]
        fn ranks_partition_the_padded_stream(
            lengths in prop::collection::vec(0u32..40, 0..12),
            cp in 1u64..5,
            pm in 1u64..4,
            mode in modes(),
        ) {
            let cu = cu_of(&lengths);
            let layout = stream_layout(&cu, spec(cp, mode, pm)).unwrap();
            let padded = &layout.cu_seqlens_padded;
            let total = layout.padded_total();
            prop_assert_eq!(total % (cp * pm) as i64, 0);
            for (s, &len) in lengths.iter().enumerate() {
                let plen = (padded[s + 1] - padded[s]) as i64;
                prop_assert!(plen >= len as i64);
                if mode == CpMode::Zigzag {
                    let d = if cp > 1 { 2 * cp * pm } else { pm } as i64;
                    prop_assert_eq!(layout.spec.divisor() as i64, d);
                    prop_assert_eq!(plen % d, 0);
                    prop_assert!(plen - (len as i64) < d);
                } else if s + 1 < lengths.len() {
                    prop_assert_eq!(plen, len as i64);
                }
            }
            prop_assert!(total - layout.real_total() < (layout.spec.divisor() as i64).max(1) * lengths.len().max(1) as i64);
            let mut seen = vec![0u8; total as usize];
            for r in 0..cp {
                let t = rank_tokens(&layout, r).unwrap();
                prop_assert_eq!(t.indices.len() as i64, total / cp as i64);
                if layout.spec.chunked() {
                    prop_assert_eq!(&t.indices, &te_indices(padded, cp as i64, r as i64));
                } else {
                    let lo = r as i64 * total / cp as i64;
                    prop_assert!(t.indices.iter().enumerate().all(|(k, &p)| p == lo + k as i64));
                }
                for k in 0..t.indices.len() {
                    let p = t.indices[k];
                    seen[p as usize] += 1;
                    let s = padded.partition_point(|&v| v as i64 <= p) - 1;
                    prop_assert_eq!(t.positions[k], p - padded[s] as i64);
                    let real = t.positions[k] < lengths[s] as i64;
                    prop_assert_eq!(t.sources[k], if real { cu[s] as i64 + t.positions[k] } else { -1 });
                }
            }
            prop_assert!(seen.iter().all(|&c| c == 1));
        }

        /// Contiguous and Ulysses runs are llama3's arrays; zigzag's are two per sequence;
        /// either way every run's keys are its sequence's prefix through the run's end,
        /// and the work adds up to every sequence's causal pairs.
        #[test]
        fn runs_and_keys(
            lengths in prop::collection::vec(0u32..40, 0..10),
            cp in 1u64..5,
            pm in 1u64..3,
            mode in modes(),
        ) {
            let cu = cu_of(&lengths);
            let layout = stream_layout(&cu, spec(cp, mode, pm)).unwrap();
            let padded = &layout.cu_seqlens_padded;
            let total = layout.padded_total();
            let local = total / cp as i64;
            for r in 0..cp {
                let a = rank_attention(&layout, r).unwrap();
                let t = rank_tokens(&layout, r).unwrap();
                if !layout.spec.chunked() && total > 0 {
                    let (q, k, mq, mk, slice) = llama3(padded, r as i64, cp as i64);
                    prop_assert_eq!(&a.cu_seqlens_q, &q);
                    prop_assert_eq!(&a.cu_seqlens_k, &k);
                    prop_assert_eq!((a.max_seqlen_q, a.max_seqlen_k), (mq, mk));
                    prop_assert_eq!(a.local_k_slice, Some(slice));
                }
                prop_assert_eq!(*a.cu_seqlens_q.last().unwrap() as i64, local);
                // Each run: local tokens contiguous in the stream, inside one sequence;
                // its keys are that sequence's positions 0..=last.
                for (j, w) in a.cu_seqlens_q.windows(2).enumerate() {
                    let seq = a.run_sequences[j] as usize;
                    let run = &t.indices[w[0] as usize..w[1] as usize];
                    prop_assert!(run.windows(2).all(|p| p[1] == p[0] + 1));
                    let (kq0, kq1) = (a.cu_seqlens_k[j] as usize, a.cu_seqlens_k[j + 1] as usize);
                    if let Some(&last) = run.last() {
                        prop_assert!(padded[seq] as i64 <= run[0] && last < padded[seq + 1] as i64);
                        prop_assert_eq!((kq1 - kq0) as i64, last + 1 - padded[seq] as i64);
                    }
                    let keys: Vec<i64> = match (&a.k_index, a.local_k_slice) {
                        (Some(index), _) => index[kq0..kq1].iter().map(|&g| {
                            let (owner, i) = (g / local.max(1), (g % local.max(1)) as usize);
                            rank_tokens(&layout, owner as u64).unwrap().indices[i]
                        }).collect(),
                        (None, Some((lo, _))) => (lo + kq0 as i64..lo + kq1 as i64).collect(),
                        _ => unreachable!(),
                    };
                    let expected: Vec<i64> = (padded[seq] as i64..padded[seq] as i64 + keys.len() as i64).collect();
                    prop_assert_eq!(keys, expected);
                }
            }
            let work = stream_work(&layout);
            let all: u64 = lengths.iter().map(|&l| l as u64 * (l as u64 + 1) / 2).sum();
            prop_assert_eq!(work.iter().sum::<u64>(), all);
            for r in 0..cp {
                // A rank's work: its real queries' positions + 1 (the keys each sees);
                // Ulysses: every pair, for 1/cp of the heads.
                let t = rank_tokens(&layout, r).unwrap();
                let mine: u64 = t.sources.iter().zip(&t.positions)
                    .filter(|(&s, _)| s >= 0).map(|(_, &p)| p as u64 + 1).sum();
                let want = if mode == CpMode::Ulysses { all / cp + u64::from(r < all % cp) } else { mine };
                prop_assert_eq!(work[r as usize], want);
            }
        }

        /// Many streams at once (a random plan) equal a slow reference, stream by stream
        /// and token by token: each stream's padded total from its `cu_seqlens_padded`,
        /// each rank's work the sum over its real tokens of `position + 1` (Ulysses: the
        /// stream's pairs split evenly), on any number of threads; without the work, the
        /// same padded totals.
        #[test]
        fn streams_equal_a_token_by_token_reference(
            lengths in prop::collection::vec(
                prop_oneof![0u32..8, 0u32..80, 300u32..700], 0..40),
            cuts in prop::collection::vec(0usize..40, 0..8),
            cp in 1u64..10,
            pm in 1u64..4,
            mode in modes(),
        ) {
            let s = spec(cp, mode, pm);
            let mut offsets: Vec<i64> = cuts.iter().map(|&c| c.min(lengths.len()) as i64).collect();
            offsets.push(0);
            offsets.push(lengths.len() as i64);
            offsets.sort();
            let seqlens: Vec<i32> = lengths.iter().map(|&l| l as i32).collect();
            let run = |threads, with_work| {
                crate::pool::install(Some(threads), || streams_layout(&seqlens, &offsets, s, with_work))
                    .unwrap()
                    .unwrap()
            };
            let one = run(1, true);
            prop_assert_eq!(&one, &run(3, true));
            let bare = run(2, false);
            prop_assert_eq!(&bare.padded_tokens, &one.padded_tokens);
            prop_assert!(bare.work.is_empty());
            prop_assert_eq!(one.work.len(), (offsets.len() - 1) * cp as usize);
            for (i, w) in offsets.windows(2).enumerate() {
                let stream = &lengths[w[0] as usize..w[1] as usize];
                let layout = stream_layout(&cu_of(stream), s).unwrap();
                prop_assert_eq!(one.padded_tokens[i], layout.padded_total());
                let all: u64 = stream.iter().map(|&l| l as u64 * (l as u64 + 1) / 2).sum();
                for r in 0..cp {
                    let t = rank_tokens(&layout, r).unwrap();
                    let mine: u64 = t.sources.iter().zip(&t.positions)
                        .filter(|(&src, _)| src >= 0).map(|(_, &p)| p as u64 + 1).sum();
                    let want = if mode == CpMode::Ulysses { all / cp + u64::from(r < all % cp) } else { mine };
                    prop_assert_eq!(one.work[i * cp as usize + r as usize], want, "stream {} rank {}", i, r);
                }
            }
        }

        /// The CP planning pass is its definition, item by item, across blocks and
        /// threads; a zigzag plan split into pieces at multiples of the divisor (as the
        /// packer splits) maps back to pieces that hold exactly each sequence's real tokens
        /// (with `reserve`), none empty.
        #[test]
        fn planned_lengths_map_back_to_the_real_ones(
            lengths in prop::collection::vec(prop_oneof![0i64..3, 0i64..100], 0..30),
            cp in 1u64..5,
            pm in 1u64..4,
            mode in modes(),
            reserve in 0u64..3,
            top in 1u64..120,
            pieces in 1u64..4,
        ) {
            let s = spec(cp, mode, pm);
            let d = s.divisor();
            let got = crate::pool::install(Some(3), || plan_lengths(&lengths, s, reserve, top))
                .unwrap()
                .unwrap();
            let ext = |l: i64| if l > 0 { l as u64 + reserve } else { 0 };
            let over: Vec<usize> = (0..lengths.len()).filter(|&i| ext(lengths[i]) > top).collect();
            prop_assert_eq!(got.overlong, over.len() as u64);
            prop_assert_eq!(got.first_overlong, over.first().copied());
            prop_assert_eq!(got.overlong_tokens, over.iter().map(|&i| lengths[i] as u64).sum::<u64>());
            prop_assert_eq!(got.overlong_excess, over.iter().map(|&i| ext(lengths[i]) - top).sum::<u64>());
            if mode != CpMode::Zigzag {
                prop_assert!(got.planned.is_empty());
                return Ok(());
            }
            let want: Vec<i64> = lengths
                .iter()
                .map(|&l| if l > 0 { (ext(l).div_ceil(d) * d - reserve) as i64 } else { 0 })
                .collect();
            prop_assert_eq!(&got.planned, &want);
            let cap = (pieces * d) as i64;
            let (mut seqlens, mut ids, mut starts) = (vec![], vec![], vec![]);
            for (i, &p) in got.planned.iter().enumerate().filter(|(_, &p)| p > 0) {
                let padded = p + reserve as i64;
                for start in (0..padded).step_by(cap as usize) {
                    seqlens.push((padded - start).min(cap) as i32);
                    ids.push(i as i64);
                    starts.push(start);
                }
            }
            crate::pool::install(Some(2), || real_seqlens(&mut seqlens, &ids, &starts, &lengths, reserve))
                .unwrap()
                .unwrap();
            prop_assert!(seqlens.iter().all(|&l| l > 0));
            let mut held = vec![0u64; lengths.len()];
            for (&l, &i) in seqlens.iter().zip(&ids) {
                held[i as usize] += l as u64;
            }
            prop_assert_eq!(held, lengths.iter().map(|&l| ext(l)).collect::<Vec<_>>());
        }

        /// The reciprocal divides exactly: every dividend and divisor below 2^32.
        #[test]
        fn divisor_divides_exactly(
            x in prop_oneof![0u64..1 << 32, Just((1u64 << 32) - 1), (1u64 << 31)..1 << 32],
            d in prop_oneof![1u64..64, 1u64..1 << 32, Just((1u64 << 31) + 1), Just((1u64 << 32) - 1)],
        ) {
            prop_assert_eq!(Reciprocal::new(d).div(x), x / d);
            if x + d - 1 < 1 << 32 {
                prop_assert_eq!(Reciprocal::new(d).round_up(x), x.div_ceil(d) * d);
            }
            let p = 1u64 << (d.ilog2() % 31);
            prop_assert_eq!(Shift::new(p).div(x), x / p);
            prop_assert_eq!(Reciprocal::new(p).div(x), x / p);
            prop_assert_eq!(Shift::new(p).round_up(x), x.div_ceil(p) * p);
        }
    }

    #[test]
    fn zigzag_balances_work_and_contiguous_does_not() {
        // One 4096-token sequence on 4 ranks: contiguous gives the last rank 7x the first.
        let layout = stream_layout(&[0, 4096], spec(4, CpMode::Zigzag, 1)).unwrap();
        let work = stream_work(&layout);
        assert!(work.iter().all(|&w| w == work[0]), "{work:?}");
        let layout = stream_layout(&[0, 4096], spec(4, CpMode::Contiguous, 1)).unwrap();
        let work = stream_work(&layout);
        assert!(work[3] > 6 * work[0], "{work:?}");
    }

    /// The shapes that cross each shortcut's boundary, with their work counted by hand:
    /// a pad longer than a chunk (zigzag's second pass), one sequence across contiguous
    /// slices, an empty stream, and the largest dividend and divisor.
    #[test]
    fn streams_at_the_boundaries() {
        let work = |lengths: &[i32], s: CpSpec| {
            let out = streams_layout(lengths, &[0, lengths.len() as i64], s, true).unwrap();
            (out.padded_tokens, out.work)
        };
        // 5 tokens padded to 24, chunks of 3: rank 0 holds positions 0..3 (1+2+3) and
        // 21..24 (pad), rank 1 positions 3..6 (4+5, 5..6 pad) and 18..21 (pad).
        assert_eq!(work(&[5], spec(4, CpMode::Zigzag, 3)), (vec![24], vec![6, 9, 0, 0]));
        // 20 tokens padded to 24, chunks of 6: rank 0 holds 0..6 and 18..24 (18, 19 real).
        assert_eq!(work(&[20], spec(2, CpMode::Zigzag, 2)), (vec![24], vec![60, 150]));
        // 300 tokens over two slices of 150: tri(150) and tri(300) - tri(150).
        assert_eq!(work(&[300], spec(2, CpMode::Contiguous, 1)), (vec![300], vec![11325, 33825]));
        assert_eq!(work(&[], spec(1, CpMode::Zigzag, 1)), (vec![0], vec![0]));
        let err = plan_lengths(&[3i64, 0, -2, -5], spec(2, CpMode::Zigzag, 1), 0, 8).unwrap_err();
        assert!(err.to_string().starts_with("lengths: negative length -2 at index 2"), "{err}");
        let mut seqlens = vec![4, 4];
        let err = real_seqlens(&mut seqlens, &[0, 1], &[0, 0], &[4i64], 0).unwrap_err();
        assert!(err.to_string().starts_with("sample_ids: segment 1 (sample 1, from 0)"), "{err}");
        let x = (1u64 << 32) - 1;
        for d in [1, 2, 3, (1 << 31) + 1, x] {
            assert_eq!(Reciprocal::new(d).div(x), x / d, "{d}");
        }
    }

    #[test]
    fn tokens_are_the_same_on_any_number_of_threads() {
        let lengths: Vec<u32> = (0..3000).map(|i| (i * 7919 % 97) as u32).collect();
        let cu = cu_of(&lengths);
        for mode in CpMode::ALL {
            let layout = stream_layout(&cu, spec(3, mode, 2)).unwrap();
            let one = crate::pool::install(Some(1), || rank_tokens(&layout, 1)).unwrap().unwrap();
            let many = crate::pool::install(Some(4), || rank_tokens(&layout, 1)).unwrap().unwrap();
            assert_eq!(one, many);
        }
    }
}
