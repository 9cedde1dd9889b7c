//! Binding of `fastpack_core::vlm`: mRoPE positions and media grids, with the GIL
//! released.

use fastpack_core::pool;
use fastpack_core::vlm::{
    self as core, Family, Media, ResizeRule, RopeConfig, TimeMath, VideoRule,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::{fastpack_error, guarded, to_py};

fn slice<'a>(array: &'a Option<PyReadonlyArray1<'_, i64>>, name: &str) -> PyResult<&'a [i64]> {
    match array {
        None => Ok(&[]),
        Some(a) => a
            .as_slice()
            .map_err(|_| fastpack_error(&format!("{name}: expected a contiguous array"))),
    }
}

/// `rope_index(input_ids, cu_seqlens, model_type, image_token_id, video_token_id,
/// spatial_merge_size, tokens_per_second, image_grid_thw, video_grid_thw,
/// second_per_grid_ts, time_math, text_row, threads)`: the mRoPE positions `(3, T)` flat
/// (row-major) of one document (`cu_seqlens=None`) or of the documents `cu_seqlens` cuts
/// `input_ids` into (`text_row`: `(4, T)`, the text position first); grids flat
/// `(t, h, w)` int64 in placeholder order; `time_math` the dtype Hugging Face multiplies
/// `second_per_grid_ts` in (`"float16"`, `"bfloat16"`, `"float32"` or `"float64"`).
#[pyfunction]
#[pyo3(signature = (
    input_ids, cu_seqlens, model_type, image_token_id, video_token_id, spatial_merge_size,
    tokens_per_second, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
    time_math="float32", text_row=false, threads=None
))]
#[allow(clippy::too_many_arguments)]
pub fn rope_index<'py>(
    py: Python<'py>,
    input_ids: PyReadonlyArray1<'py, i64>,
    cu_seqlens: Option<PyReadonlyArray1<'py, i64>>,
    model_type: &str,
    image_token_id: i64,
    video_token_id: i64,
    spatial_merge_size: u32,
    tokens_per_second: f64,
    image_grid_thw: Option<PyReadonlyArray1<'py, i64>>,
    video_grid_thw: Option<PyReadonlyArray1<'py, i64>>,
    second_per_grid_ts: Option<PyReadonlyArray1<'py, f64>>,
    time_math: &str,
    text_row: bool,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let cfg = RopeConfig {
        family: Family::parse(model_type).map_err(to_py)?,
        image_token_id,
        video_token_id,
        spatial_merge_size,
        tokens_per_second,
    };
    let ids = input_ids
        .as_slice()
        .map_err(|_| fastpack_error("input_ids: expected a contiguous array"))?;
    let seconds = match &second_per_grid_ts {
        None => None,
        Some(a) => Some(
            a.as_slice()
                .map_err(|_| fastpack_error("second_per_grid_ts: expected a contiguous array"))?,
        ),
    };
    let media = Media {
        image_grid_thw: slice(&image_grid_thw, "image_grid_thw")?,
        video_grid_thw: slice(&video_grid_thw, "video_grid_thw")?,
        second_per_grid_ts: seconds,
        time_math: Some(match time_math {
            "float16" => TimeMath::F16,
            "bfloat16" => TimeMath::BF16,
            "float32" => TimeMath::F32,
            "float64" => TimeMath::F64,
            other => {
                return Err(fastpack_error(&format!(
                    "time_math: {other:?}; expected \"float16\", \"bfloat16\", \"float32\" \
                     or \"float64\""
                )))
            }
        }),
    };
    let cu = match &cu_seqlens {
        None => None,
        Some(_) => Some(slice(&cu_seqlens, "cu_seqlens")?),
    };
    let out = py
        .detach(|| {
            pool::install(threads, || {
                guarded(|| match cu {
                    None => core::rope_index(&cfg, ids, &media),
                    Some(cu) => core::rope_index_many(&cfg, ids, cu, &media, text_row),
                })
            })
        })
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(out.into_pyarray(py))
}

/// `media_grids(heights, widths, frames, patch_size, merge_size, temporal_patch_size,
/// min_pixels, max_pixels, temporal, threads)`: `(t, h, w)` in patches of every image (or
/// video, with `frames`), flat int64, by the processors' resize rule.
#[pyfunction]
#[pyo3(signature = (
    heights, widths, frames, patch_size, merge_size, temporal_patch_size, min_pixels,
    max_pixels, temporal=false, threads=None
))]
#[allow(clippy::too_many_arguments)]
pub fn media_grids<'py>(
    py: Python<'py>,
    heights: PyReadonlyArray1<'py, i64>,
    widths: PyReadonlyArray1<'py, i64>,
    frames: Option<PyReadonlyArray1<'py, i64>>,
    patch_size: u32,
    merge_size: u32,
    temporal_patch_size: u32,
    min_pixels: u64,
    max_pixels: u64,
    temporal: bool,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let rule = ResizeRule {
        patch_size,
        merge_size,
        temporal_patch_size,
        min_pixels,
        max_pixels,
        video: if temporal { VideoRule::Temporal } else { VideoRule::PerFrame },
    };
    let h =
        heights.as_slice().map_err(|_| fastpack_error("heights: expected a contiguous array"))?;
    let w = widths.as_slice().map_err(|_| fastpack_error("widths: expected a contiguous array"))?;
    let f = match &frames {
        None => None,
        Some(_) => Some(slice(&frames, "frames")?),
    };
    let out = py
        .detach(|| pool::install(threads, || guarded(|| core::media_grids(h, w, f, &rule))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(out.into_pyarray(py))
}
