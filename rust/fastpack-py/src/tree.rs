//! Binding of `fastpack_core::tree`: shared-prefix trees of token data read in place, their
//! packed plan, and each batch's target map, with the GIL released.

use fastpack_core::materialize::Sources;
use fastpack_core::pool;
use fastpack_core::tree::{self as core, ItemsRef, TreeOptions, TreeRef};
use fastpack_core::Overlong;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::column::ListColumn;
use crate::{guarded, to_py, PlanArgs};

/// `tree_items(tokens, prompt_ids, max_len, overlong, split, threads)`: the trees of the
/// samples (by `prompt_ids`, int64 per sample, or a trie) cut into items of at most `max_len`
/// tokens; a dict of the items' arrays and the counts of what was kept.
#[pyfunction]
#[pyo3(signature = (tokens, prompt_ids, max_len, overlong="error", split=true, threads=None))]
pub fn tree_items<'py>(
    py: Python<'py>,
    tokens: PyRef<'py, ListColumn>,
    prompt_ids: Option<PyReadonlyArray1<'py, i64>>,
    max_len: u64,
    overlong: &str,
    split: bool,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = TreeOptions { max_len, overlong: Overlong::parse(overlong).map_err(to_py)?, split };
    let column = tokens.column(py)?;
    let prompts = prompt_ids.as_ref().map(|g| g.as_slice()).transpose()?;
    let items = py
        .detach(|| pool::install(threads, || guarded(|| core::build(column, prompts, &opts))))
        .map_err(to_py)?
        .map_err(to_py)?;
    let d = PyDict::new(py);
    let s = &items.stats;
    d.set_item("num_sequences", s.num_sequences)?;
    d.set_item("empty_sequences", s.empty_sequences)?;
    d.set_item("dropped_sequences", s.dropped_sequences)?;
    d.set_item("dropped_tokens", s.dropped_tokens)?;
    d.set_item("truncated_sequences", s.truncated_sequences)?;
    d.set_item("truncated_tokens", s.truncated_tokens)?;
    d.set_item("sample_tokens", s.sample_tokens)?;
    d.set_item("trees", s.trees)?;
    d.set_item("split_trees", s.split_trees)?;
    d.set_item("sample_ids", items.sample_ids.into_pyarray(py))?;
    d.set_item("starts", items.starts.into_pyarray(py))?;
    d.set_item("seqlens", items.seqlens.into_pyarray(py))?;
    d.set_item("parents", items.parents.into_pyarray(py))?;
    d.set_item("item_offsets", items.item_offsets.into_pyarray(py))?;
    d.set_item("item_costs", items.item_costs.into_pyarray(py))?;
    d.set_item("path_sample_ids", items.path_sample_ids.into_pyarray(py))?;
    d.set_item("path_ends", items.path_ends.into_pyarray(py))?;
    d.set_item("path_offsets", items.path_offsets.into_pyarray(py))?;
    Ok(d)
}

/// `tree_expand(items arrays..., item_ids, item_pack_offsets)`: the packed items as the
/// plan's segments (`sample_ids`, `starts`, `seqlens`, `pack_offsets`), `parents` and
/// paths (`path_sample_ids`, `path_ends`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn tree_expand<'py>(
    py: Python<'py>,
    sample_ids: PyReadonlyArray1<'py, i64>,
    starts: PyReadonlyArray1<'py, i64>,
    seqlens: PyReadonlyArray1<'py, i32>,
    parents: PyReadonlyArray1<'py, i32>,
    item_offsets: PyReadonlyArray1<'py, i64>,
    path_sample_ids: PyReadonlyArray1<'py, i64>,
    path_ends: PyReadonlyArray1<'py, i32>,
    path_offsets: PyReadonlyArray1<'py, i64>,
    item_ids: PyReadonlyArray1<'py, i64>,
    item_pack_offsets: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyDict>> {
    let items = ItemsRef {
        sample_ids: sample_ids.as_slice()?,
        starts: starts.as_slice()?,
        seqlens: seqlens.as_slice()?,
        parents: parents.as_slice()?,
        item_offsets: item_offsets.as_slice()?,
        path_sample_ids: path_sample_ids.as_slice()?,
        path_ends: path_ends.as_slice()?,
        path_offsets: path_offsets.as_slice()?,
    };
    let (ids, offsets) = (item_ids.as_slice()?, item_pack_offsets.as_slice()?);
    let plan = py.detach(|| guarded(|| core::expand(&items, ids, offsets))).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("sample_ids", plan.sample_ids.into_pyarray(py))?;
    d.set_item("starts", plan.starts.into_pyarray(py))?;
    d.set_item("seqlens", plan.seqlens.into_pyarray(py))?;
    d.set_item("pack_offsets", plan.pack_offsets.into_pyarray(py))?;
    d.set_item("parents", plan.parents.into_pyarray(py))?;
    d.set_item("path_sample_ids", plan.path_sample_ids.into_pyarray(py))?;
    d.set_item("path_ends", plan.path_ends.into_pyarray(py))?;
    Ok(d)
}

/// The token data a tree's targets are read from, as the core takes it.
fn sources<'a>(
    py: Python<'_>,
    tokens: &'a PyRef<'_, ListColumn>,
    labels: &'a Option<PyRef<'_, ListColumn>>,
    loss_mask: &'a Option<PyRef<'_, ListColumn>>,
) -> PyResult<Sources<'a>> {
    Ok(Sources {
        tokens: tokens.column(py)?,
        labels: labels.as_ref().map(|c| c.column(py)).transpose()?,
        loss_mask: loss_mask.as_ref().map(|c| c.column(py)).transpose()?,
    })
}

fn tree_ref<'a>(plan: &'a PlanArgs<'_>) -> PyResult<TreeRef<'a>> {
    let (path_sample_ids, path_ends) = plan.paths()?;
    Ok(TreeRef { plan: plan.plan_ref()?, path_sample_ids, path_ends })
}

/// `tree_path_targets(plan, tokens, labels, loss_mask, threads)`: the targets of
/// every path (uint32 [paths]), counted without building a batch.
#[pyfunction]
#[pyo3(signature = (
    plan, tokens, labels=None, loss_mask=None, threads=None
))]
pub fn tree_path_targets<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    tokens: PyRef<'py, ListColumn>,
    labels: Option<PyRef<'py, ListColumn>>,
    loss_mask: Option<PyRef<'py, ListColumn>>,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    let tree = tree_ref(&plan)?;
    let sources = sources(py, &tokens, &labels, &loss_mask)?;
    let counts = py
        .detach(|| pool::install(threads, || guarded(|| core::path_targets(&tree, &sources))))
        .map_err(to_py)?
        .map_err(to_py)?;
    Ok(counts.into_pyarray(py))
}

/// `tree_rows(plan, packs, tokens, labels, loss_mask, threads)`: the batch of
/// `packs` laid end to end: each segment's parent in the batch, the target map and every
/// sample's row positions (a dict of numpy arrays).
#[pyfunction]
#[pyo3(signature = (
    plan, packs, tokens, labels=None, loss_mask=None, threads=None
))]
pub fn tree_rows<'py>(
    py: Python<'py>,
    plan: PlanArgs<'py>,
    packs: PyReadonlyArray1<'py, i64>,
    tokens: PyRef<'py, ListColumn>,
    labels: Option<PyRef<'py, ListColumn>>,
    loss_mask: Option<PyRef<'py, ListColumn>>,
    threads: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let tree = tree_ref(&plan)?;
    let sources = sources(py, &tokens, &labels, &loss_mask)?;
    let packs = packs.as_slice()?;
    let out = py
        .detach(|| pool::install(threads, || guarded(|| core::rows(&tree, &sources, packs))))
        .map_err(to_py)?
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("parents", out.parents.into_pyarray(py))?;
    d.set_item("target_index", out.target_index.into_pyarray(py))?;
    d.set_item("target_labels", out.target_labels.into_pyarray(py))?;
    d.set_item("target_offsets", out.target_offsets.into_pyarray(py))?;
    d.set_item("sample_ids", out.sample_ids.into_pyarray(py))?;
    d.set_item("sample_tokens", out.sample_tokens.into_pyarray(py))?;
    d.set_item("sample_offsets", out.sample_offsets.into_pyarray(py))?;
    Ok(d)
}
