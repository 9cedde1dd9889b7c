//! Vision-language models: the 3-D rotary positions (mRoPE) of Qwen-VL documents, and the
//! media sizes an image processor makes, computed without a model and without a pixel.
//!
//! **Positions.** A Qwen2-VL-style model rotates each token by three positions (temporal,
//! height, width). Text tokens get `p, p, p` and advance `p` by one; an image or video of
//! grid `(t, h, w)` (in patches) covers `t·h·w / m²` placeholder tokens (`m` the spatial
//! merge size), each at `(p + ⌊i·interval⌋, p + row, p + column)` over the merged grid,
//! and advances `p` by `max(h, w) / m`. The families differ in `interval` and in what one
//! grid covers (see [`Family`]). [`rope_index`] computes one document the way the model's
//! `get_rope_index` does; [`rope_index_many`] computes many documents laid end to end
//! (every document from position 0, each with its own grids), in parallel over documents
//! and independent of the thread count.
//!
//! Placeholders are counted per grid, so a document whose placeholder tokens disagree
//! with its grids is an error naming the document and the image or video, never a
//! silently shifted position.
//!
//! **Media sizes.** [`media_grid`] is the Qwen-VL processors' resize rule (`smart_resize`:
//! sides rounded to a multiple of `patch_size · merge_size`, the area kept within
//! `min_pixels..=max_pixels`), so the tokens and patches of a million images are known
//! from their heights and widths alone.

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::memory;

/// The rotary-position rule of a model family (its Hugging Face `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `qwen2_vl`: a video's temporal positions step by 1 per grid.
    Qwen2Vl,
    /// `qwen2_5_vl`: a video's temporal positions step by `tokens_per_second ·
    /// second_per_grid_ts[video]` (truncated), images by 1.
    Qwen25Vl,
    /// `qwen3_vl` / `qwen3_vl_moe`: every frame of a video is its own grid `(1, h, w)`
    /// (timestamps are text tokens between frames).
    Qwen3Vl,
}

impl Family {
    pub const NAMES: &'static str =
        "\"qwen2_vl\", \"qwen2_5_vl\", \"qwen3_vl\" or \"qwen3_vl_moe\"";

    pub fn parse(model_type: &str) -> Result<Self> {
        match model_type {
            "qwen2_vl" => Ok(Self::Qwen2Vl),
            "qwen2_5_vl" => Ok(Self::Qwen25Vl),
            "qwen3_vl" | "qwen3_vl_moe" => Ok(Self::Qwen3Vl),
            other => Err(Error::invalid(
                "config",
                format!(
                    "model_type {other:?} has no mRoPE rule in fastpack; expected one of {}",
                    Self::NAMES
                ),
            )),
        }
    }
}

/// How a video's temporal step is computed: as Hugging Face computes it for the dtype of
/// `second_per_grid_ts` (a float32 tensor, the processor's, multiplies in float32; a
/// float16 or bfloat16 tensor rounds the step, each frame index and each product to its
/// dtype, the product itself computed exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeMath {
    F16,
    BF16,
    F32,
    F64,
}

/// The largest temporal offset of a video (`⌊(t - 1)·interval⌋`): beyond 2^53 a position
/// is no longer an exact float, and `as i64` would saturate.
const TIME_LIMIT: f64 = 9_007_199_254_740_992.0;

/// `x` rounded to the nearest float16 (ties to even), as a float32: what casting a float32
/// to `torch.float16` gives (`inf` beyond its range).
fn round_f16(x: f32) -> f32 {
    let a = x.abs();
    if !a.is_finite() || a >= 65520.0 {
        return if a.is_nan() { x } else { f32::INFINITY.copysign(x) };
    }
    if a < 6.103_515_6e-5 {
        // Subnormal float16: multiples of 2^-24.
        let q = 5.960_464_5e-8_f32;
        return ((x / q).round_ties_even()) * q;
    }
    // 10 mantissa bits of float32's 23: round away the low 13 (ties to even).
    let bits = x.to_bits();
    let rounded = bits + 0x0fff + ((bits >> 13) & 1);
    f32::from_bits(rounded & !0x1fff)
}

/// `x` rounded to the nearest bfloat16 (ties to even), as a float32.
fn round_bf16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    f32::from_bits(rounded & 0xffff_0000)
}

/// What a model's positions depend on: its family and its config's numbers.
#[derive(Debug, Clone, Copy)]
pub struct RopeConfig {
    pub family: Family,
    pub image_token_id: i64,
    pub video_token_id: i64,
    pub spatial_merge_size: u32,
    /// Qwen2.5-VL's `vision_config.tokens_per_second` (unused by the others).
    pub tokens_per_second: f64,
}

/// The grids of the media of one document, or of many in placeholder order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Media<'a> {
    /// `(t, h, w)` per image, flat: `3·images` values.
    pub image_grid_thw: &'a [i64],
    /// `(t, h, w)` per video, flat.
    pub video_grid_thw: &'a [i64],
    /// Seconds per temporal grid of each video (Qwen2.5-VL); `None`: 1 for every video.
    pub second_per_grid_ts: Option<&'a [f64]>,
    pub time_math: Option<TimeMath>,
}

/// One unit of media as the placeholders see it: a grid covering `tokens` placeholders.
#[derive(Debug, Clone, Copy)]
struct Grid {
    t: u64,
    /// Merged height and width.
    h: u64,
    w: u64,
    /// Temporal step (1 for images).
    interval: Interval,
}

#[derive(Debug, Clone, Copy)]
enum Interval {
    One,
    F16(f32),
    BF16(f32),
    F32(f32),
    F64(f64),
}

impl Interval {
    /// The product before truncation: Hugging Face's `arange(t) * interval` in the
    /// interval's dtype (for half precision: the index rounded, the exact product rounded).
    #[inline]
    fn value(self, i: u64) -> f64 {
        match self {
            Interval::One => i as f64,
            Interval::F16(x) => f64::from(round_f16(round_f16(i as f32) * x)),
            Interval::BF16(x) => f64::from(round_bf16(round_bf16(i as f32) * x)),
            Interval::F32(x) => f64::from((i as f32) * x),
            Interval::F64(x) => (i as f64) * x,
        }
    }

    /// `(arange(t) * interval).long()`: the product truncated; checked finite and at most
    /// [`TIME_LIMIT`] for the last frame when the grid is made.
    #[inline]
    fn at(self, i: u64) -> i64 {
        match self {
            Interval::One => i as i64,
            other => other.value(i) as i64,
        }
    }
}

impl Grid {
    fn tokens(&self) -> u64 {
        self.t * self.h * self.w
    }
}

/// The media of a call, as units of placeholders: images, then video units (a video, or
/// each frame of one for Qwen3-VL), each with its owner index for messages.
struct Units {
    images: Vec<Grid>,
    videos: Vec<Grid>,
    /// The input video of each video unit (frames of one video share it).
    video_of: Vec<u32>,
}

const MEDIA_LIMIT: i64 = 1 << 20;

fn grids(cfg: &RopeConfig, media: &Media<'_>) -> Result<Units> {
    let m = cfg.spatial_merge_size as i64;
    if m < 1 {
        return Err(Error::invalid(
            "config",
            format!("vision_config.spatial_merge_size is {m}; expected a positive integer"),
        ));
    }
    let read = |flat: &[i64], what: &'static str| -> Result<Vec<[u64; 3]>> {
        if flat.len() % 3 != 0 {
            return Err(Error::invalid(
                what,
                format!("has {} values; expected 3 per grid (t, h, w)", flat.len()),
            ));
        }
        let mut out = memory::try_with_capacity(flat.len() / 3, "media grids")?;
        for (k, g) in flat.chunks_exact(3).enumerate() {
            let (t, h, w) = (g[0], g[1], g[2]);
            let bad =
                |why: String| Error::invalid(what, format!("grid {k} is ({t}, {h}, {w}): {why}"));
            if [t, h, w].iter().any(|&v| !(1..=MEDIA_LIMIT).contains(&v)) {
                return Err(bad(format!("each of t, h, w must be in 1..={MEDIA_LIMIT}")));
            }
            if h % m != 0 || w % m != 0 {
                return Err(bad(format!(
                    "h and w must be multiples of vision_config.spatial_merge_size ({m})"
                )));
            }
            out.push([t as u64, (h / m) as u64, (w / m) as u64]);
        }
        Ok(out)
    };
    let image = read(media.image_grid_thw, "image_grid_thw")?;
    let video = read(media.video_grid_thw, "video_grid_thw")?;
    if let Some(s) = media.second_per_grid_ts {
        if s.len() != video.len() {
            return Err(Error::invalid(
                "second_per_grid_ts",
                format!("has {} values; expected one per video ({})", s.len(), video.len()),
            ));
        }
        if let Some((k, v)) = s.iter().enumerate().find(|(_, v)| !v.is_finite() || **v < 0.0) {
            return Err(Error::invalid(
                "second_per_grid_ts",
                format!("value {k} is {v}; expected a finite number >= 0"),
            ));
        }
    }
    let per_second = cfg.tokens_per_second;
    if cfg.family == Family::Qwen25Vl
        && !video.is_empty()
        && !(per_second.is_finite() && per_second >= 0.0)
    {
        return Err(Error::invalid(
            "tokens_per_second",
            format!(
                "is {per_second}; expected a finite number >= 0 (vision_config.tokens_per_second)"
            ),
        ));
    }
    let images = image.iter().map(|&[t, h, w]| Grid { t, h, w, interval: Interval::One }).collect();
    let mut videos = Vec::new();
    let mut video_of = Vec::new();
    for (k, &[t, h, w]) in video.iter().enumerate() {
        match cfg.family {
            Family::Qwen2Vl => {
                videos.push(Grid { t, h, w, interval: Interval::One });
                video_of.push(k as u32);
            }
            Family::Qwen25Vl => {
                let seconds = media.second_per_grid_ts.map_or(1.0, |s| s[k]);
                let step = per_second * seconds;
                // Hugging Face's `tokens_per_second * second_per_grid_ts[k]`: a Python
                // number times a 0-d tensor, computed in float32 and rounded to its dtype.
                let step32 = (per_second as f32) * (seconds as f32);
                let interval = match media.time_math.unwrap_or(TimeMath::F32) {
                    TimeMath::F16 => Interval::F16(round_f16(step32)),
                    TimeMath::BF16 => Interval::BF16(round_bf16(step32)),
                    TimeMath::F32 => Interval::F32(step as f32),
                    TimeMath::F64 => Interval::F64(step),
                };
                let last = interval.value(t - 1);
                if !(last.is_finite() && last <= TIME_LIMIT) {
                    // Name the larger factor: the one a user would have mistyped.
                    let arg = if seconds > per_second {
                        "second_per_grid_ts"
                    } else {
                        "tokens_per_second"
                    };
                    return Err(Error::invalid(
                        arg,
                        format!(
                            "video {k}: its last temporal position ({} frames x tokens_per_second \
                             {per_second} x second_per_grid_ts {seconds}) is {last}, beyond \
                             2^53; expected seconds per temporal grid and a tokens_per_second \
                             of a real video",
                            t - 1
                        ),
                    ));
                }
                videos.push(Grid { t, h, w, interval });
                video_of.push(k as u32);
            }
            Family::Qwen3Vl => {
                memory::try_reserve(&mut videos, t as usize, "media grids")?;
                for _ in 0..t {
                    videos.push(Grid { t: 1, h, w, interval: Interval::One });
                    video_of.push(k as u32);
                }
            }
        }
    }
    Ok(Units { images, videos, video_of })
}

/// Where one document's grids start: its first image unit and first video unit.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor {
    image: usize,
    video: usize,
}

/// Writes one document's positions into `rows` (three rows of the document's length)
/// starting with grid `at`; returns the grids it used. `doc` names it in errors.
fn one_document(
    cfg: &RopeConfig,
    ids: &[i64],
    units: &Units,
    at: Cursor,
    rows: [&mut [i64]; 3],
    doc: Option<usize>,
) -> Result<Cursor> {
    let [r0, r1, r2] = rows;
    let name = |what: &str| match doc {
        Some(d) => format!("document {d}: {what}"),
        None => what.to_string(),
    };
    let mut cursor = at;
    let mut pos: i64 = 0;
    let mut i = 0;
    let n = ids.len();
    while i < n {
        let id = ids[i];
        let (kind, list, next) = if id == cfg.image_token_id {
            ("image", &units.images, &mut cursor.image)
        } else if id == cfg.video_token_id {
            ("video", &units.videos, &mut cursor.video)
        } else {
            r0[i] = pos;
            r1[i] = pos;
            r2[i] = pos;
            pos += 1;
            i += 1;
            continue;
        };
        let Some(grid) = list.get(*next) else {
            let arg = if kind == "image" { "image_grid_thw" } else { "video_grid_thw" };
            return Err(Error::invalid(
                arg,
                name(&format!(
                    "a {kind} placeholder at token {i} has no grid left: {} {kind} grid(s) \
                     were given and all are used by earlier placeholders",
                    list.len()
                )),
            ));
        };
        let tokens = grid.tokens() as usize;
        let run = ids[i..].iter().take(tokens).take_while(|&&x| x == id).count();
        if run != tokens {
            let which = if kind == "image" {
                format!("image {}", *next)
            } else {
                format!("video {}", units.video_of[*next])
            };
            return Err(Error::invalid(
                "input_ids",
                name(&format!(
                    "{which} has {run} placeholder token(s) from token {i}, but its grid \
                     needs {tokens} (t·h·w / merge²); the placeholders and the grids disagree"
                )),
            ));
        }
        let mut k = i;
        // Positions grow by at most 2^20 per grid and by the temporal offset (at most
        // 2^53, checked with the grid); checked all the same, never a wrapped position.
        let overflow =
            || Error::invalid("input_ids", name(&format!("the positions overflow at token {i}")));
        let span = grid.h.max(grid.w) as i64;
        pos.checked_add(grid.interval.at(grid.t - 1)).ok_or_else(overflow)?;
        pos.checked_add(span).ok_or_else(overflow)?;
        for ti in 0..grid.t {
            let t_pos = pos + grid.interval.at(ti);
            for hi in 0..grid.h {
                for wi in 0..grid.w {
                    r0[k] = t_pos;
                    r1[k] = pos + hi as i64;
                    r2[k] = pos + wi as i64;
                    k += 1;
                }
            }
        }
        pos += span;
        *next += 1;
        i += tokens;
    }
    Ok(cursor)
}

/// The `(3, T)` positions of one document (row-major: row `r` at `r·T`), as the model's
/// `get_rope_index` gives them; every grid must be used by the document's placeholders.
///
/// ```
/// use fastpack_core::vlm::{rope_index, Family, Media, RopeConfig};
/// let cfg = RopeConfig { family: Family::Qwen2Vl, image_token_id: 9, video_token_id: 8,
///                        spatial_merge_size: 2, tokens_per_second: 1.0 };
/// // text, a 1x4x4 image (4 placeholders after a 2x2 merge), text
/// let ids = [1, 9, 9, 9, 9, 2];
/// let media = Media { image_grid_thw: &[1, 4, 4], ..Media::default() };
/// let p = rope_index(&cfg, &ids, &media).unwrap();
/// assert_eq!(&p[0..6], &[0, 1, 1, 1, 1, 3]); // temporal
/// assert_eq!(&p[6..12], &[0, 1, 1, 2, 2, 3]); // height
/// assert_eq!(&p[12..18], &[0, 1, 2, 1, 2, 3]); // width
/// ```
pub fn rope_index(cfg: &RopeConfig, input_ids: &[i64], media: &Media<'_>) -> Result<Vec<i64>> {
    let units = grids(cfg, media)?;
    let n = input_ids.len();
    let mut out = memory::try_zeroed::<i64>(3 * n, "positions")?;
    let (r0, rest) = out.split_at_mut(n);
    let (r1, r2) = rest.split_at_mut(n);
    let used = one_document(cfg, input_ids, &units, Cursor::default(), [r0, r1, r2], None)?;
    unused_grids(&units, used)?;
    Ok(out)
}

fn unused_grids(units: &Units, used: Cursor) -> Result<()> {
    if used.image < units.images.len() {
        return Err(Error::invalid(
            "image_grid_thw",
            format!(
                "{} image grid(s) given, but the placeholders use {}; the placeholders and \
                 the grids disagree",
                units.images.len(),
                used.image
            ),
        ));
    }
    if used.video < units.videos.len() {
        let given = units.video_of.last().map_or(0, |&v| v as usize + 1);
        let placed = if used.video == 0 { 0 } else { units.video_of[used.video - 1] as usize + 1 };
        return Err(Error::invalid(
            "video_grid_thw",
            format!(
                "{given} video grid(s) given, but the placeholders use {placed} (or part of \
                 one); the placeholders and the grids disagree"
            ),
        ));
    }
    Ok(())
}

/// The positions of many documents laid end to end: document `d` is
/// `input_ids[cu_seqlens[d]..cu_seqlens[d+1]]`, its positions start at 0, and its grids are
/// the next ones in placeholder order. Returns `(3, T)` row-major, or `(4, T)` with
/// `text_row`: first the text position (`0..len` in every document, where packed
/// attention reads the boundaries), then the three mRoPE rows, as the model's
/// `position_ids` `[4, 1, T]`. Documents run in parallel; the result does not depend on
/// the thread count.
pub fn rope_index_many(
    cfg: &RopeConfig,
    input_ids: &[i64],
    cu_seqlens: &[i64],
    media: &Media<'_>,
    text_row: bool,
) -> Result<Vec<i64>> {
    let units = grids(cfg, media)?;
    let n = input_ids.len();
    check_cu(cu_seqlens, n)?;
    let docs = cu_seqlens.len().saturating_sub(1);
    // Each document's first grids: its placeholders before it, matched to whole grids.
    let counts: Vec<(u64, u64)> = (0..docs)
        .into_par_iter()
        .map(|d| {
            let ids = &input_ids[cu_seqlens[d] as usize..cu_seqlens[d + 1] as usize];
            let image = ids.iter().filter(|&&x| x == cfg.image_token_id).count() as u64;
            let video = ids.iter().filter(|&&x| x == cfg.video_token_id).count() as u64;
            (image, video)
        })
        .collect();
    let starts = first_grids(&units, &counts)?;
    let rows = if text_row { 4 } else { 3 };
    let mut out = memory::try_zeroed::<i64>(rows * n, "positions")?;
    let (text, mrope) = out.split_at_mut(if text_row { n } else { 0 });
    let (r0, rest) = mrope.split_at_mut(n);
    let (r1, r2) = rest.split_at_mut(n);
    let pieces = split_rows([r0, r1, r2], cu_seqlens);
    let mut texts: Vec<&mut [i64]> = Vec::with_capacity(docs);
    let mut rest = text;
    for w in cu_seqlens.windows(2) {
        let len = if text_row { (w[1] - w[0]) as usize } else { 0 };
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
        texts.push(mine);
        rest = tail;
    }
    let results: Vec<Result<Cursor>> = pieces
        .into_par_iter()
        .zip(texts)
        .enumerate()
        .map(|(d, (rows, text))| {
            for (k, p) in text.iter_mut().enumerate() {
                *p = k as i64;
            }
            let ids = &input_ids[cu_seqlens[d] as usize..cu_seqlens[d + 1] as usize];
            one_document(cfg, ids, &units, starts[d], rows, Some(d))
        })
        .collect();
    let mut last = Cursor::default();
    for (d, r) in results.into_iter().enumerate() {
        let used = r?;
        // The counts said where the next document's grids start; each document must
        // have used exactly the grids up to there.
        let end = starts
            .get(d + 1)
            .copied()
            .unwrap_or(Cursor { image: units.images.len(), video: units.videos.len() });
        if used.image != end.image || used.video != end.video {
            return Err(Error::invalid(
                "input_ids",
                format!("document {d}: its placeholders and its grids disagree"),
            ));
        }
        last = used;
    }
    unused_grids(&units, last)?;
    Ok(out)
}

fn check_cu(cu: &[i64], n: usize) -> Result<()> {
    let ok = !cu.is_empty()
        && cu[0] == 0
        && cu.windows(2).all(|w| w[0] <= w[1])
        && *cu.last().expect("non-empty") as usize == n;
    if !ok {
        return Err(Error::invalid(
            "cu_seqlens",
            format!(
                "expected offsets from 0, non-decreasing, ending at the number of tokens ({n}); \
                 got {} offsets",
                cu.len()
            ),
        ));
    }
    Ok(())
}

/// Each document's first image and video unit, from the placeholder counts of the
/// documents before it: a document that starts inside a grid's placeholders is an error.
fn first_grids(units: &Units, counts: &[(u64, u64)]) -> Result<Vec<Cursor>> {
    let prefix = |grids: &[Grid]| -> Vec<u64> {
        let mut p = Vec::with_capacity(grids.len() + 1);
        p.push(0u64);
        for g in grids {
            p.push(p[p.len() - 1] + g.tokens());
        }
        p
    };
    let (image_prefix, video_prefix) = (prefix(&units.images), prefix(&units.videos));
    let mut starts = memory::try_with_capacity(counts.len(), "documents")?;
    let (mut image_tokens, mut video_tokens) = (0u64, 0u64);
    for (d, &(image, video)) in counts.iter().enumerate() {
        let find = |p: &[u64], tokens: u64, kind: &str| -> Result<usize> {
            // The first grid at or after this many placeholders (a document without
            // placeholders of this kind starts where the next one would).
            let k = p.partition_point(|&x| x < tokens);
            if k < p.len() && p[k] == tokens {
                return Ok(k);
            }
            Err(Error::invalid(
                "input_ids",
                format!(
                    "document {d}: the {kind} placeholders before it ({tokens}) do not end on a \
                     whole {kind} grid; the placeholder counts and the grids disagree"
                ),
            ))
        };
        starts.push(Cursor {
            image: find(&image_prefix, image_tokens, "image")?,
            video: find(&video_prefix, video_tokens, "video")?,
        });
        image_tokens += image;
        video_tokens += video;
    }
    Ok(starts)
}

/// The three rows cut at every document boundary: document `d`'s three row pieces.
fn split_rows<'a>(rows: [&'a mut [i64]; 3], cu: &[i64]) -> Vec<[&'a mut [i64]; 3]> {
    let [mut a, mut b, mut c] = rows;
    let mut out = Vec::with_capacity(cu.len().saturating_sub(1));
    for w in cu.windows(2) {
        let len = (w[1] - w[0]) as usize;
        let (a0, a1) = std::mem::take(&mut a).split_at_mut(len);
        let (b0, b1) = std::mem::take(&mut b).split_at_mut(len);
        let (c0, c1) = std::mem::take(&mut c).split_at_mut(len);
        out.push([a0, b0, c0]);
        (a, b, c) = (a1, b1, c1);
    }
    out
}

/// The Qwen-VL processors' resize rule (their `smart_resize`).
#[derive(Debug, Clone, Copy)]
pub struct ResizeRule {
    pub patch_size: u32,
    pub merge_size: u32,
    pub temporal_patch_size: u32,
    pub min_pixels: u64,
    pub max_pixels: u64,
    /// Videos: how frames enter the pixel budget.
    pub video: VideoRule,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VideoRule {
    /// Qwen2-VL's video processor: each frame resized on its own area.
    PerFrame,
    /// Qwen3-VL's: the budget counts frames (`frames · h · w`), tiny frames are scaled up
    /// to one merged patch first.
    Temporal,
}

/// Largest accepted side and frame count: every product the rule forms stays below 2^53,
/// so the float arithmetic is Python's exactly.
pub const SIDE_LIMIT: u64 = 1 << 20;
pub const FRAMES_LIMIT: u64 = 1 << 12;

/// Python's `round` (half to even) of `a / b`.
fn round_div(a: f64, b: f64) -> f64 {
    (a / b).round_ties_even()
}

/// `(t, grid_h, grid_w)` in patches of an image (`frames = None`) or a video of `frames`
/// frames of `height × width`, as the processor makes it.
///
/// ```
/// use fastpack_core::vlm::{media_grid, ResizeRule, VideoRule};
/// let rule = ResizeRule { patch_size: 14, merge_size: 2, temporal_patch_size: 2,
///                         min_pixels: 56 * 56, max_pixels: 28 * 28 * 1280,
///                         video: VideoRule::PerFrame };
/// assert_eq!(media_grid(480, 640, None, &rule).unwrap(), [1, 34, 46]);
/// ```
pub fn media_grid(
    height: u64,
    width: u64,
    frames: Option<u64>,
    rule: &ResizeRule,
) -> Result<[u64; 3]> {
    let (patch, merge) = (rule.patch_size as u64, rule.merge_size as u64);
    if patch == 0 || merge == 0 || rule.temporal_patch_size == 0 {
        return Err(Error::invalid(
            "config",
            "patch_size, merge_size and temporal_patch_size must be positive",
        ));
    }
    if rule.max_pixels > 1 << 53 {
        return Err(Error::invalid(
            "config",
            format!("max_pixels is {}; expected at most 2^53", rule.max_pixels),
        ));
    }
    if rule.min_pixels > rule.max_pixels {
        return Err(Error::invalid(
            "config",
            format!("min_pixels ({}) exceeds max_pixels ({})", rule.min_pixels, rule.max_pixels),
        ));
    }
    let factor = patch * merge;
    if !(1..=SIDE_LIMIT).contains(&height) || !(1..=SIDE_LIMIT).contains(&width) {
        return Err(Error::invalid(
            "heights",
            format!("got a {height}x{width} image; sides must be in 1..={SIDE_LIMIT}"),
        ));
    }
    let tf = rule.temporal_patch_size as u64;
    let (mut h, mut w) = (height as f64, width as f64);
    let (h_bar, w_bar) = match (frames, rule.video) {
        (Some(t), VideoRule::Temporal) => {
            if !(tf..=FRAMES_LIMIT).contains(&t) {
                return Err(Error::invalid(
                    "frames",
                    format!(
                        "got {t} frames; expected {tf}..={FRAMES_LIMIT} (at least \
                         temporal_patch_size)"
                    ),
                ));
            }
            let f = factor as f64;
            if height < factor || width < factor {
                let scale = (f / h).max(f / w);
                h = (h * scale).trunc();
                w = (w * scale).trunc();
            }
            aspect(h, w)?;
            let t_bar = round_div(t as f64, tf as f64) * tf as f64;
            let (mut hb, mut wb) = (round_div(h, f) * f, round_div(w, f) * f);
            let volume = (t as f64) * h * w;
            if t_bar * hb * wb > rule.max_pixels as f64 {
                let beta = (volume / rule.max_pixels as f64).sqrt();
                hb = f.max((h / beta / f).floor() * f);
                wb = f.max((w / beta / f).floor() * f);
            } else if t_bar * hb * wb < rule.min_pixels as f64 {
                let beta = (rule.min_pixels as f64 / volume).sqrt();
                hb = (h * beta / f).ceil() * f;
                wb = (w * beta / f).ceil() * f;
            }
            (hb, wb)
        }
        (frames, _) => {
            if let Some(t) = frames {
                if !(1..=FRAMES_LIMIT).contains(&t) {
                    return Err(Error::invalid(
                        "frames",
                        format!("got {t} frames; expected 1..={FRAMES_LIMIT}"),
                    ));
                }
            }
            aspect(h, w)?;
            let f = factor as f64;
            let (mut hb, mut wb) = (round_div(h, f) * f, round_div(w, f) * f);
            if hb * wb > rule.max_pixels as f64 {
                let beta = (h * w / rule.max_pixels as f64).sqrt();
                hb = f.max((h / beta / f).floor() * f);
                wb = f.max((w / beta / f).floor() * f);
            } else if hb * wb < rule.min_pixels as f64 {
                let beta = (rule.min_pixels as f64 / (h * w)).sqrt();
                hb = (h * beta / f).ceil() * f;
                wb = (w * beta / f).ceil() * f;
            }
            (hb, wb)
        }
    };
    let t = match frames {
        None => 1,
        Some(t) => t.div_ceil(tf),
    };
    Ok([t, h_bar as u64 / patch, w_bar as u64 / patch])
}

fn aspect(h: f64, w: f64) -> Result<()> {
    if h.max(w) / h.min(w) > 200.0 {
        return Err(Error::invalid(
            "heights",
            format!("a {h}x{w} image has an aspect ratio over 200, which the processor refuses"),
        ));
    }
    Ok(())
}

/// [`media_grid`] of many images (or videos, with `frames`), in parallel: `(t, h, w)` per
/// item, flat. An error names the first bad item.
pub fn media_grids(
    heights: &[i64],
    widths: &[i64],
    frames: Option<&[i64]>,
    rule: &ResizeRule,
) -> Result<Vec<i64>> {
    if heights.len() != widths.len() || frames.is_some_and(|f| f.len() != heights.len()) {
        return Err(Error::invalid(
            "widths",
            format!(
                "heights has {} values, widths {}{}; expected one of each per item",
                heights.len(),
                widths.len(),
                frames.map_or(String::new(), |f| format!(", frames {}", f.len()))
            ),
        ));
    }
    let mut out = memory::try_zeroed::<i64>(3 * heights.len(), "media grids")?;
    let failed: Option<(usize, Error)> = out
        .par_chunks_mut(3)
        .enumerate()
        .filter_map(|(k, slot)| {
            let (h, w) = (heights[k], widths[k]);
            if h < 1 || w < 1 {
                let e = format!("got a {h}x{w} image; sides must be in 1..={SIDE_LIMIT}");
                return Some((k, Error::invalid("heights", e)));
            }
            let frames = match frames.map(|f| f[k]) {
                Some(t) if t < 1 => {
                    let e = format!("got {t} frames; expected at least 1");
                    return Some((k, Error::invalid("frames", e)));
                }
                t => t.map(|t| t as u64),
            };
            match media_grid(h as u64, w as u64, frames, rule) {
                Ok(g) => {
                    for (s, v) in slot.iter_mut().zip(g) {
                        *s = v as i64;
                    }
                    None
                }
                Err(e) => Some((k, e)),
            }
        })
        .min_by_key(|(k, _)| *k);
    match failed {
        None => Ok(out),
        Some((k, Error::InvalidArgument { arg, message })) => {
            Err(Error::invalid(arg, format!("item {k}: {message}")))
        }
        Some((_, e)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(family: Family) -> RopeConfig {
        RopeConfig {
            family,
            image_token_id: 9,
            video_token_id: 8,
            spatial_merge_size: 2,
            tokens_per_second: 2.0,
        }
    }

    #[test]
    fn half_precision_rounds_as_torch_casts() {
        // torch.tensor([x]).half() / .bfloat16(), read back as float32.
        for (x, half, brain) in [
            (0.1f32, 0.099_975_586f32, 0.100_097_656f32),
            (2.0 / 24.0, 0.083_312_99, 0.083_496_094),
            (65519.0, 65504.0, 65536.0),
            (3e-8, 5.960_464_5e-8, 3e-8),
            (1.0, 1.0, 1.0),
        ] {
            assert_eq!(round_f16(x), half, "{x}");
            if x != 3e-8 {
                assert_eq!(round_bf16(x), brain, "{x}");
            }
        }
        assert_eq!(round_f16(65520.0), f32::INFINITY);
        assert_eq!(round_f16(1e-8), 0.0);
    }

    #[test]
    fn a_huge_time_step_is_an_error_naming_its_argument() {
        let ids = [1, 8, 8, 2];
        for (per_second, seconds, arg) in
            [(2.0, 1e300, "second_per_grid_ts"), (1e300, 0.5, "tokens_per_second")]
        {
            let c = RopeConfig { tokens_per_second: per_second, ..cfg(Family::Qwen25Vl) };
            for math in [TimeMath::F16, TimeMath::BF16, TimeMath::F32, TimeMath::F64] {
                let media = Media {
                    video_grid_thw: &[2, 2, 2],
                    second_per_grid_ts: Some(&[seconds]),
                    time_math: Some(math),
                    ..Media::default()
                };
                let err = rope_index(&c, &ids, &media).unwrap_err().to_string();
                assert!(err.starts_with(&format!("{arg}: video 0")), "{err}");
            }
        }
    }

    #[test]
    fn many_equals_one_by_one() {
        let c = cfg(Family::Qwen25Vl);
        // doc 0: text + image(1,2,4) ; doc 1: video (2,2,2) + text ; doc 2: text only
        let docs: Vec<Vec<i64>> = vec![vec![1, 9, 9, 3], vec![8, 8, 5, 6], vec![4, 4, 4]];
        let images = [1, 2, 4];
        let videos = [2, 2, 2];
        let seconds = [0.75];
        let ids: Vec<i64> = docs.concat();
        let cu = [0i64, 4, 8, 11];
        let media = Media {
            image_grid_thw: &images,
            video_grid_thw: &videos,
            second_per_grid_ts: Some(&seconds),
            time_math: Some(TimeMath::F32),
        };
        let many = rope_index_many(&c, &ids, &cu, &media, false).unwrap();
        let four = rope_index_many(&c, &ids, &cu, &media, true).unwrap();
        assert_eq!(&four[ids.len()..], &many[..]);
        assert_eq!(&four[..ids.len()], &[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]);
        let per = [
            Media { image_grid_thw: &images, ..Media::default() },
            Media {
                video_grid_thw: &videos,
                second_per_grid_ts: Some(&seconds),
                time_math: Some(TimeMath::F32),
                ..Media::default()
            },
            Media::default(),
        ];
        let n = ids.len();
        for (d, doc) in docs.iter().enumerate() {
            let one = rope_index(&c, doc, &per[d]).unwrap();
            let (lo, len) = (cu[d] as usize, doc.len());
            for r in 0..3 {
                assert_eq!(&many[r * n + lo..r * n + lo + len], &one[r * len..(r + 1) * len]);
            }
        }
        // The video's two temporal grids step by floor(2 * 0.75) = 1.
        assert_eq!(&many[4..6], &[0, 1]);
    }

    #[test]
    fn qwen3_splits_videos_into_frames() {
        let c = cfg(Family::Qwen3Vl);
        // a video of 2 frames of 1 merged token each, a timestamp token between
        let ids = [8, 7, 8];
        let media = Media { video_grid_thw: &[2, 2, 2], ..Media::default() };
        let p = rope_index(&c, &ids, &media).unwrap();
        assert_eq!(&p[0..3], &[0, 1, 2]);
    }

    #[test]
    fn disagreement_names_the_document() {
        let c = cfg(Family::Qwen2Vl);
        let ids = [1, 9, 9, 9, 2];
        let media = Media { image_grid_thw: &[1, 2, 4], ..Media::default() };
        let e = rope_index_many(&c, &ids, &[0, 5], &media, false).unwrap_err().to_string();
        assert!(e.contains("document 0"), "{e}");
        let e = rope_index(&c, &[1, 2], &media).unwrap_err().to_string();
        assert!(
            e.starts_with("image_grid_thw: 1 image grid(s) given, but the placeholders use 0"),
            "{e}"
        );
    }

    #[test]
    fn smart_resize_examples() {
        let rule = ResizeRule {
            patch_size: 14,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            video: VideoRule::PerFrame,
        };
        // 2000x3000: over the budget, scaled down.
        let [t, h, w] = media_grid(2000, 3000, None, &rule).unwrap();
        assert_eq!(t, 1);
        assert!(h * w * 14 * 14 <= 28 * 28 * 1280);
        assert!(media_grid(10, 2500, None, &rule).is_err());
        assert_eq!(media_grid(28, 28, Some(5), &rule).unwrap()[0], 3);
    }
}
