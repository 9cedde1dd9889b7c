//! Shared prefixes computed once: samples that start with the same tokens become one tree
//! whose shared tokens are stored (and computed) once.
//!
//! A *tree* is a forest node of the plan: a segment whose tokens a *parent* segment
//! precedes. A shared prefix is one segment; each continuation is a segment starting where
//! its parent ends (its `start` is its first token's position in the sample), with its
//! parent pointing at the prefix. A sample is a *path*: the segments from a root to the
//! segment it ends at. Two ways to find the trees, both exact and O(total tokens) apart
//! from a sort:
//!
//! - **prompts** (samples with one prompt id, as RL rollouts of one prompt carry it):
//!   the prompt's samples' longest common token prefix is the root, each sample's remainder
//!   a child; samples of one prompt sharing nothing are one root each;
//! - **a trie** over all samples (branching conversations): the samples sorted by their
//!   tokens, the longest common prefix of neighbours, and a compressed trie built from them
//!   in one pass. Every shared token is stored once; siblings start with different tokens.
//!
//! A tree that fits `max_len` is one *item*. A larger one is split: the children of an
//! oversized node are best-fit into bins of what the path above them leaves, each bin an
//! item that repeats the path (the prefix is charged again in every item); an oversized
//! child is split the same way below. Items are what the packing core packs (its `pack`
//! over the item costs, so every strategy, shuffle and two-level grouping applies as is),
//! and [`expand`] turns the packed items into the plan's segments with their parents.
//!
//! ```
//! use fastpack_core::column::{Column, Ints, ListChunk, Values};
//! use fastpack_core::tree::{build, TreeOptions};
//! // Two rollouts of one prompt [1, 2, 3] and an unrelated sample.
//! let values = Values::of(&[1i32, 2, 3, 7, 8, 1, 2, 3, 9, 5, 6]);
//! let chunk = ListChunk { offsets: Ints::I64(&[0, 5, 9, 11]), values };
//! let tokens = Column::new("input_ids", vec![chunk], None).unwrap();
//! let items = build(&tokens, Some(&[0, 0, 1]), &TreeOptions::new(16)).unwrap();
//! assert_eq!(items.item_costs, [6, 2]); // 3 + 2 + 1 tokens instead of 5 + 4, then 2
//! assert_eq!(items.seqlens, [3, 2, 1, 2]);
//! assert_eq!(items.parents, [-1, 0, 0, -1]);
//! assert_eq!(items.starts, [0, 3, 3, 0]); // positions continue from the prefix
//! ```

use std::collections::BTreeSet;

use rayon::prelude::*;

use crate::column::{check_row_len, Column, Dtype, Native, Values};
use crate::error::{Error, Result};
use crate::materialize::{PlanRef, Sources, IGNORE_INDEX};
use crate::memory;
use crate::plan::{Overlong, MAX_ITEMS};

const NONE: u32 = u32::MAX;
/// The virtual root above every tree.
const ROOT: u32 = 0;
/// Samples per parallel task when reading rows.
const TASK_ROWS: usize = 1 << 12;

/// Options of [`build`].
#[derive(Debug, Clone)]
pub struct TreeOptions {
    /// Tokens per pack: no item is longer.
    pub max_len: u64,
    /// A sample longer than `max_len`: `Error`, `Truncate` (keep its first `max_len`
    /// tokens) or `Drop`. `Split` is refused: a piece could not attend to the pieces
    /// before it.
    pub overlong: Overlong,
    /// Split a tree larger than `max_len` into items that repeat its prefix; when false
    /// (preference pairs, which must stay in one pack) such a tree is an error.
    pub split: bool,
}

impl TreeOptions {
    pub fn new(max_len: u64) -> Self {
        Self { max_len, overlong: Overlong::Error, split: true }
    }
}

/// What building the trees did with the input: nothing is lost silently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeStats {
    pub num_sequences: u64,
    pub empty_sequences: u64,
    pub dropped_sequences: u64,
    pub dropped_tokens: u64,
    pub truncated_sequences: u64,
    pub truncated_tokens: u64,
    /// Tokens of the kept samples, each counted in full: what packing them without sharing
    /// would compute.
    pub sample_tokens: u64,
    /// Trees (before splitting), and those larger than `max_len`, split into items.
    pub trees: u64,
    pub split_trees: u64,
}

/// The items to pack, CSR over their entries (segments to be). Entry `e` is tokens
/// `starts[e] .. starts[e] + seqlens[e]` of sample `sample_ids[e]`; its parent is entry
/// `parents[e]` of the same item (an index inside the item, `-1` for a root). Item `k`
/// holds entries `item_offsets[k] .. item_offsets[k + 1]` in preorder (a parent before its
/// children, every subtree contiguous) and `item_costs[k]` tokens. Its paths (the samples
/// it trains) are `path_offsets[k] .. path_offsets[k + 1]`: sample `path_sample_ids[j]`
/// ends at entry `path_ends[j]` of the item, in ascending order of that entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Items {
    pub sample_ids: Vec<i64>,
    pub starts: Vec<i64>,
    pub seqlens: Vec<i32>,
    pub parents: Vec<i32>,
    pub item_offsets: Vec<i64>,
    pub item_costs: Vec<u32>,
    pub path_sample_ids: Vec<i64>,
    pub path_ends: Vec<i32>,
    pub path_offsets: Vec<i64>,
    pub stats: TreeStats,
}

/// Borrowed [`Items`] (as they come back from Python).
#[derive(Debug, Clone, Copy)]
pub struct ItemsRef<'a> {
    pub sample_ids: &'a [i64],
    pub starts: &'a [i64],
    pub seqlens: &'a [i32],
    pub parents: &'a [i32],
    pub item_offsets: &'a [i64],
    pub path_sample_ids: &'a [i64],
    pub path_ends: &'a [i32],
    pub path_offsets: &'a [i64],
}

impl<'a> From<&'a Items> for ItemsRef<'a> {
    fn from(items: &'a Items) -> Self {
        ItemsRef {
            sample_ids: &items.sample_ids,
            starts: &items.starts,
            seqlens: &items.seqlens,
            parents: &items.parents,
            item_offsets: &items.item_offsets,
            path_sample_ids: &items.path_sample_ids,
            path_ends: &items.path_ends,
            path_offsets: &items.path_offsets,
        }
    }
}

/// Finds the trees of the samples in `tokens` (by `prompts`, one id per sample, or by a
/// trie when `None`) and cuts them into items of at most `opts.max_len` tokens. The result
/// does not depend on the thread count (run it inside [`crate::pool::install`]).
pub fn build(tokens: &Column<'_>, prompts: Option<&[i64]>, opts: &TreeOptions) -> Result<Items> {
    tokens.require_integers("tokens")?;
    crate::PackOptions::new(opts.max_len).validate()?; // the one check of max_len
    if opts.overlong == Overlong::Split {
        return Err(Error::invalid(
            "overlong",
            "\"split\" does not apply to shared prefixes (a piece of a sample could not attend \
             to the pieces before it); expected \"error\", \"truncate\" or \"drop\"",
        ));
    }
    let n = tokens.rows();
    if n as u64 > MAX_ITEMS {
        return Err(Error::overflow("tokens", format!("{n} samples; at most {MAX_ITEMS}")));
    }
    if let Some(g) = prompts {
        if g.len() != n {
            return Err(Error::invalid(
                "prompt_ids",
                format!("{} values for {n} samples; expected one prompt id per sample", g.len()),
            ));
        }
    }
    match tokens.dtype() {
        Dtype::Int8 => typed::<i8>(tokens, prompts, opts),
        Dtype::Int16 => typed::<i16>(tokens, prompts, opts),
        Dtype::Int32 => typed::<i32>(tokens, prompts, opts),
        Dtype::Int64 => typed::<i64>(tokens, prompts, opts),
        Dtype::UInt8 => typed::<u8>(tokens, prompts, opts),
        Dtype::UInt16 => typed::<u16>(tokens, prompts, opts),
        Dtype::UInt32 => typed::<u32>(tokens, prompts, opts),
        Dtype::UInt64 => typed::<u64>(tokens, prompts, opts),
        other => Err(Error::invalid(
            "tokens",
            format!("column '{}' holds {} values; expected integers", tokens.name(), other.name()),
        )),
    }
}

/// Token ids of one dtype, compared as they lie.
trait Token: Native + Ord + Send + Sync {}
impl<T: Native + Ord + Send + Sync> Token for T {}

fn typed<T: Token>(
    tokens: &Column<'_>,
    prompts: Option<&[i64]>,
    opts: &TreeOptions,
) -> Result<Items> {
    let n = tokens.rows();
    // Every row as a typed slice, kept to its length under the over-long policy.
    let blocks: Vec<Result<Vec<&[T]>>> = (0..n.div_ceil(TASK_ROWS))
        .into_par_iter()
        .map(|b| {
            (b * TASK_ROWS..((b + 1) * TASK_ROWS).min(n))
                .map(|r| {
                    let row = tokens.row(r)?;
                    tokens.values(row).slice::<T>(row.lo, row.len()).ok_or_else(|| {
                        Error::invalid("tokens", "a chunk's values differ in type from the first")
                    })
                })
                .collect()
        })
        .collect();
    let mut rows: Vec<&[T]> = memory::try_with_capacity(n, "tree rows")?;
    for block in blocks {
        rows.extend(block?);
    }
    let mut stats = TreeStats { num_sequences: n as u64, ..Default::default() };
    let cap = opts.max_len as usize;
    let mut over = (0u64, None::<(usize, usize)>);
    for (i, row) in rows.iter_mut().enumerate() {
        let len = row.len();
        if len == 0 {
            stats.empty_sequences += 1;
        } else if len > cap {
            over.0 += 1;
            over.1.get_or_insert((i, len));
            match opts.overlong {
                Overlong::Truncate => {
                    stats.truncated_sequences += 1;
                    stats.truncated_tokens += (len - cap) as u64;
                    *row = &row[..cap];
                }
                _ => {
                    stats.dropped_sequences += 1;
                    stats.dropped_tokens += len as u64;
                    *row = &row[..0];
                }
            }
        }
    }
    if let (Overlong::Error, Some((first, length))) = (opts.overlong, over.1) {
        return Err(Error::Overlong {
            count: over.0,
            first_index: first as u64,
            first_length: length as u64,
            cap: opts.max_len,
            reserve_note: String::new(),
        });
    }
    stats.sample_tokens = rows.iter().map(|r| r.len() as u64).sum();
    let arena = match prompts {
        Some(g) => Arena::of_prompts(&rows, g)?,
        None => Arena::trie(&rows)?,
    };
    let forest = Forest::new(&arena)?;
    stats.trees = forest.trees.len() as u64;
    stats.split_trees =
        forest.trees.iter().filter(|&&t| forest.cost[t as usize] > opts.max_len).count() as u64;
    let locals: Vec<Result<Local>> = forest
        .trees
        .par_iter()
        .map(|&t| {
            let mut local = Local::default();
            forest.items(t, opts, &mut local)?;
            Ok(local)
        })
        .collect();
    let mut items = Items { stats, ..Default::default() };
    items.concat(locals)?;
    Ok(items)
}

fn lcp<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A node of the compressed trie: positions `start..end` of sample `sample`.
#[derive(Debug, Clone, Copy)]
struct Node {
    start: u32,
    end: u32,
    sample: u32,
    parent: u32,
    first_child: u32,
    last_child: u32,
    next: u32,
    prev: u32,
}

/// Every tree's nodes, under a virtual root (node 0), and the node each sample ends at.
struct Arena {
    nodes: Vec<Node>,
    ends: Vec<u32>,
}

impl Arena {
    fn new(samples: usize) -> Result<Self> {
        let mut nodes = memory::try_with_capacity(2 * samples + 1, "tree nodes")?;
        nodes.push(Node {
            start: 0,
            end: 0,
            sample: NONE,
            parent: NONE,
            first_child: NONE,
            last_child: NONE,
            next: NONE,
            prev: NONE,
        });
        Ok(Self { nodes, ends: memory::try_filled(samples, NONE, "tree ends")? })
    }

    fn add_child(&mut self, parent: u32, start: usize, end: usize, sample: usize) -> Result<u32> {
        let id = self.nodes.len() as u32;
        let last = self.nodes[parent as usize].last_child;
        let node = Node {
            start: start as u32,
            end: end as u32,
            sample: sample as u32,
            parent,
            first_child: NONE,
            last_child: NONE,
            next: NONE,
            prev: last,
        };
        memory::try_push(&mut self.nodes, node, "tree nodes")?;
        if last == NONE {
            self.nodes[parent as usize].first_child = id;
        } else {
            self.nodes[last as usize].next = id;
        }
        self.nodes[parent as usize].last_child = id;
        Ok(id)
    }

    /// Cuts `node` (its parent's last child) at position `at`: a new node takes positions
    /// `start..at` in its place, and `node` keeps `at..end`, its children and its samples
    /// below it. Nothing else moves, so the cut is O(1).
    fn split(&mut self, node: u32, at: usize) -> Result<u32> {
        let old = self.nodes[node as usize];
        let id = self.nodes.len() as u32;
        let upper = Node {
            start: old.start,
            end: at as u32,
            sample: old.sample,
            parent: old.parent,
            first_child: node,
            last_child: node,
            next: NONE,
            prev: old.prev,
        };
        memory::try_push(&mut self.nodes, upper, "tree nodes")?;
        let parent = old.parent as usize;
        if old.prev == NONE {
            self.nodes[parent].first_child = id;
        } else {
            self.nodes[old.prev as usize].next = id;
        }
        debug_assert_eq!(self.nodes[parent].last_child, node);
        self.nodes[parent].last_child = id;
        let lower = &mut self.nodes[node as usize];
        lower.start = at as u32;
        lower.parent = id;
        lower.prev = NONE;
        Ok(id)
    }

    /// One tree per prompt's samples: their longest common prefix as the root (when
    /// it has one), each sample's remainder a child of it. Groups come in the order of
    /// their first sample, samples in input order.
    fn of_prompts<T: Token>(rows: &[&[T]], prompts: &[i64]) -> Result<Self> {
        let mut kept: Vec<(i64, u32)> = memory::try_with_capacity(rows.len(), "tree prompts")?;
        kept.extend(
            (0..rows.len()).filter(|&i| !rows[i].is_empty()).map(|i| (prompts[i], i as u32)),
        );
        kept.par_sort_unstable();
        // Runs of one prompt id, ordered by their first sample.
        let mut runs: Vec<(u32, usize, usize)> = Vec::new();
        let mut lo = 0;
        for hi in 1..=kept.len() {
            if hi == kept.len() || kept[hi].0 != kept[lo].0 {
                runs.push((kept[lo].1, lo, hi));
                lo = hi;
            }
        }
        runs.par_sort_unstable();
        let prefix: Vec<usize> = runs
            .par_iter()
            .map(|&(first, lo, hi)| {
                let head = rows[first as usize];
                kept[lo + 1..hi]
                    .iter()
                    .map(|&(_, j)| lcp(head, rows[j as usize]))
                    .fold(if hi - lo == 1 { head.len() } else { usize::MAX }, usize::min)
            })
            .collect();
        let mut arena = Self::new(rows.len())?;
        for (&(first, lo, hi), &shared) in runs.iter().zip(&prefix) {
            let members = kept[lo..hi].iter().map(|&(_, i)| i as usize);
            if shared == 0 {
                for i in members {
                    arena.ends[i] = arena.add_child(ROOT, 0, rows[i].len(), i)?;
                }
                continue;
            }
            let root = arena.add_child(ROOT, 0, shared, first as usize)?;
            for i in members {
                let len = rows[i].len();
                arena.ends[i] =
                    if len == shared { root } else { arena.add_child(root, shared, len, i)? };
            }
        }
        Ok(arena)
    }

    /// The compressed trie of every non-empty sample: the samples in lexicographic order of
    /// their tokens (ties by index), then each one's path below the longest common prefix
    /// with the one before it, cutting the node that prefix ends inside.
    fn trie<T: Token>(rows: &[&[T]]) -> Result<Self> {
        let mut order: Vec<u32> = memory::try_with_capacity(rows.len(), "tree order")?;
        order.extend((0..rows.len() as u32).filter(|&i| !rows[i as usize].is_empty()));
        order.par_sort_unstable_by(|&a, &b| rows[a as usize].cmp(rows[b as usize]).then(a.cmp(&b)));
        let shared: Vec<usize> =
            (0..order.len())
                .into_par_iter()
                .map(|k| {
                    if k == 0 {
                        0
                    } else {
                        lcp(rows[order[k - 1] as usize], rows[order[k] as usize])
                    }
                })
                .collect();
        let mut arena = Self::new(rows.len())?;
        // The path of the previous sample, from the top: nodes that may be shared next.
        let mut path: Vec<u32> = vec![ROOT];
        for (&x, &h) in order.iter().zip(&shared) {
            let x = x as usize;
            while path.len() > 1 && arena.nodes[*path.last().unwrap() as usize].start as usize >= h
            {
                path.pop();
            }
            let mut top = *path.last().unwrap();
            if arena.nodes[top as usize].end as usize > h {
                path.pop();
                top = arena.split(top, h)?;
                path.push(top);
            }
            let len = rows[x].len();
            if len > h {
                let child = arena.add_child(top, h, len, x)?;
                path.push(child);
                arena.ends[x] = child;
            } else {
                arena.ends[x] = top; // the same tokens as the sample before it
            }
        }
        Ok(arena)
    }
}

/// The arena in preorder, with each node's subtree cost and the samples ending at it.
struct Forest<'a> {
    arena: &'a Arena,
    /// Top-level nodes (one per tree), in order.
    trees: Vec<u32>,
    /// Tokens in each node's subtree.
    cost: Vec<u64>,
    member_offsets: Vec<u32>,
    members: Vec<u32>,
}

impl<'a> Forest<'a> {
    fn new(arena: &'a Arena) -> Result<Self> {
        let nodes = &arena.nodes;
        let count = nodes.len();
        let mut order: Vec<u32> = memory::try_with_capacity(count, "tree order")?;
        let mut stack = vec![ROOT];
        while let Some(v) = stack.pop() {
            order.push(v);
            let first = stack.len();
            let mut c = nodes[v as usize].first_child;
            while c != NONE {
                stack.push(c);
                c = nodes[c as usize].next;
            }
            stack[first..].reverse();
        }
        let mut cost: Vec<u64> = memory::try_zeroed(count, "tree costs")?;
        for &v in order.iter().rev() {
            let node = nodes[v as usize];
            cost[v as usize] += (node.end - node.start) as u64;
            if node.parent != NONE {
                cost[node.parent as usize] += cost[v as usize];
            }
        }
        let mut trees = Vec::new();
        let mut c = nodes[ROOT as usize].first_child;
        while c != NONE {
            trees.push(c);
            c = nodes[c as usize].next;
        }
        // Samples by the node they end at (a counting sort: samples stay in index order).
        let mut member_offsets: Vec<u32> = memory::try_zeroed(count + 1, "tree members")?;
        for &e in arena.ends.iter().filter(|&&e| e != NONE) {
            member_offsets[e as usize + 1] += 1;
        }
        for k in 0..count {
            member_offsets[k + 1] += member_offsets[k];
        }
        let mut members: Vec<u32> =
            memory::try_zeroed(member_offsets[count] as usize, "tree members")?;
        let mut cursor = member_offsets.clone();
        for (i, &e) in arena.ends.iter().enumerate().filter(|&(_, &e)| e != NONE) {
            members[cursor[e as usize] as usize] = i as u32;
            cursor[e as usize] += 1;
        }
        Ok(Self { arena, trees, cost, member_offsets, members })
    }

    fn node(&self, v: u32) -> Node {
        self.arena.nodes[v as usize]
    }

    fn members(&self, v: u32) -> &[u32] {
        &self.members
            [self.member_offsets[v as usize] as usize..self.member_offsets[v as usize + 1] as usize]
    }

    fn children(&self, v: u32) -> impl Iterator<Item = u32> + '_ {
        let mut next = self.node(v).first_child;
        std::iter::from_fn(move || {
            let c = next;
            (c != NONE).then(|| {
                next = self.node(c).next;
                c
            })
        })
    }

    /// The items of tree `top`: the whole tree when it fits, else the splits described in
    /// the module docs.
    fn items(&self, top: u32, opts: &TreeOptions, out: &mut Local) -> Result<()> {
        let max_len = opts.max_len;
        if self.cost[top as usize] <= max_len {
            return self.emit(&[], &[top], None, out);
        }
        if !opts.split {
            let node = self.node(top);
            let samples = self.subtree_samples(top);
            return Err(Error::invalid(
                "max_len",
                format!(
                    "samples {samples} share a prefix of {} tokens and hold {} tokens together, \
                     more than max_len ({max_len}); they must stay in one pack (a preference \
                     pair): raise max_len or shorten them",
                    node.end - node.start,
                    self.cost[top as usize]
                ),
            ));
        }
        let mut work = vec![top];
        while let Some(u) = work.pop() {
            let mut path = vec![u];
            while self.node(*path.last().unwrap()).parent != ROOT {
                path.push(self.node(*path.last().unwrap()).parent);
            }
            path.reverse();
            let room = max_len - self.node(u).end as u64;
            let (fitting, big): (Vec<u32>, Vec<u32>) =
                self.children(u).partition(|&c| self.cost[c as usize] <= room);
            let bins = best_fit(&fitting, &self.cost, room);
            if bins.is_empty() {
                if !self.members(u).is_empty() {
                    self.emit(&path, &[], Some(u), out)?;
                }
            } else {
                for (b, bin) in bins.iter().enumerate() {
                    self.emit(&path, bin, (b == 0).then_some(u), out)?;
                }
            }
            work.extend(big.iter().rev());
        }
        Ok(())
    }

    /// The first few samples below `top`, for an error message.
    fn subtree_samples(&self, top: u32) -> String {
        let mut found = Vec::new();
        let mut stack = vec![top];
        while let Some(v) = stack.pop() {
            found.extend_from_slice(self.members(v));
            stack.extend(self.children(v));
        }
        found.sort_unstable();
        let more = if found.len() > 4 { ", ..." } else { "" };
        let shown: Vec<String> = found.iter().take(4).map(u32::to_string).collect();
        format!("{}{more}", shown.join(", "))
    }

    /// One item: the nodes of `path` (repeated from the top), then each subtree of `roots`
    /// in preorder below the path's last node; the samples ending at its subtrees' nodes,
    /// and at `extra` (the path's last node) when given.
    fn emit(&self, path: &[u32], roots: &[u32], extra: Option<u32>, out: &mut Local) -> Result<()> {
        let base = out.sample_ids.len();
        let entry = |out: &mut Local, v: u32, parent: i32| -> Result<i32> {
            let node = self.node(v);
            let local = (out.sample_ids.len() - base) as i32;
            memory::try_push(&mut out.sample_ids, node.sample as i64, "tree items")?;
            memory::try_push(&mut out.starts, node.start as i64, "tree items")?;
            memory::try_push(&mut out.seqlens, (node.end - node.start) as i32, "tree items")?;
            memory::try_push(&mut out.parents, parent, "tree items")?;
            Ok(local)
        };
        let paths = out.path_sample_ids.len();
        let mut attach = -1i32;
        for &v in path {
            attach = entry(out, v, attach)?;
        }
        if let Some(u) = extra {
            for &i in self.members(u) {
                out.path_sample_ids.push(i as i64);
                out.path_ends.push(attach);
            }
        }
        let mut stack: Vec<(u32, i32)> = Vec::new();
        for &r in roots {
            stack.push((r, attach));
            while let Some((v, parent)) = stack.pop() {
                let local = entry(out, v, parent)?;
                for &i in self.members(v) {
                    out.path_sample_ids.push(i as i64);
                    out.path_ends.push(local);
                }
                let first = stack.len();
                stack.extend(self.children(v).map(|c| (c, local)));
                stack[first..].reverse();
            }
        }
        let size = out.sample_ids.len() - base;
        out.item_sizes.push(size as u64);
        out.item_costs.push(out.seqlens[base..].iter().map(|&n| n as u32).sum());
        out.path_counts.push((out.path_sample_ids.len() - paths) as u64);
        Ok(())
    }
}

/// Best fit decreasing of `nodes` (by subtree cost, ties in input order) into bins of
/// `room` tokens; each bin lists its nodes in input order.
fn best_fit(nodes: &[u32], cost: &[u64], room: u64) -> Vec<Vec<u32>> {
    let mut by_size: Vec<usize> = (0..nodes.len()).collect();
    by_size.sort_by_key(|&k| (std::cmp::Reverse(cost[nodes[k] as usize]), k));
    let mut left: BTreeSet<(u64, usize)> = BTreeSet::new();
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for k in by_size {
        let c = cost[nodes[k] as usize];
        let fit = left.range((c, 0)..).next().copied();
        match fit {
            Some((rest, b)) => {
                left.remove(&(rest, b));
                left.insert((rest - c, b));
                bins[b].push(k);
            }
            None => {
                left.insert((room - c, bins.len()));
                bins.push(vec![k]);
            }
        }
    }
    bins.into_iter()
        .map(|mut bin| {
            bin.sort_unstable();
            bin.into_iter().map(|k| nodes[k]).collect()
        })
        .collect()
}

/// One tree's items, before they are joined.
#[derive(Default)]
struct Local {
    sample_ids: Vec<i64>,
    starts: Vec<i64>,
    seqlens: Vec<i32>,
    parents: Vec<i32>,
    item_sizes: Vec<u64>,
    item_costs: Vec<u32>,
    path_sample_ids: Vec<i64>,
    path_ends: Vec<i32>,
    path_counts: Vec<u64>,
}

impl Items {
    fn concat(&mut self, locals: Vec<Result<Local>>) -> Result<()> {
        let locals: Vec<Local> = locals.into_iter().collect::<Result<_>>()?;
        let entries: usize = locals.iter().map(|l| l.sample_ids.len()).sum();
        let items: usize = locals.iter().map(|l| l.item_sizes.len()).sum();
        let paths: usize = locals.iter().map(|l| l.path_sample_ids.len()).sum();
        if entries as u64 > MAX_ITEMS {
            return Err(Error::overflow(
                "tokens",
                format!("the trees hold {entries} segments; at most {MAX_ITEMS}"),
            ));
        }
        self.sample_ids = memory::try_with_capacity(entries, "tree items")?;
        self.starts = memory::try_with_capacity(entries, "tree items")?;
        self.seqlens = memory::try_with_capacity(entries, "tree items")?;
        self.parents = memory::try_with_capacity(entries, "tree items")?;
        self.item_offsets = memory::try_with_capacity(items + 1, "tree items")?;
        self.item_costs = memory::try_with_capacity(items, "tree items")?;
        self.path_sample_ids = memory::try_with_capacity(paths, "tree paths")?;
        self.path_ends = memory::try_with_capacity(paths, "tree paths")?;
        self.path_offsets = memory::try_with_capacity(items + 1, "tree paths")?;
        self.item_offsets.push(0);
        self.path_offsets.push(0);
        for local in locals {
            self.sample_ids.extend_from_slice(&local.sample_ids);
            self.starts.extend_from_slice(&local.starts);
            self.seqlens.extend_from_slice(&local.seqlens);
            self.parents.extend_from_slice(&local.parents);
            self.item_costs.extend_from_slice(&local.item_costs);
            self.path_sample_ids.extend_from_slice(&local.path_sample_ids);
            self.path_ends.extend_from_slice(&local.path_ends);
            for (&size, &count) in local.item_sizes.iter().zip(&local.path_counts) {
                let (e, p) =
                    (*self.item_offsets.last().unwrap(), *self.path_offsets.last().unwrap());
                self.item_offsets.push(e + size as i64);
                self.path_offsets.push(p + count as i64);
            }
        }
        Ok(())
    }
}

/// A plan's tree arrays: the segments of [`Items`] in packed order, each `parents` entry
/// a segment index of the plan (`-1` for a root), and every path's sample and last
/// segment, in ascending order of that segment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreePlan {
    pub sample_ids: Vec<i64>,
    pub starts: Vec<i64>,
    pub seqlens: Vec<i32>,
    pub pack_offsets: Vec<i64>,
    pub parents: Vec<i64>,
    pub path_sample_ids: Vec<i64>,
    pub path_ends: Vec<i64>,
}

fn check_csr(name: &'static str, offsets: &[i64], total: usize) -> Result<()> {
    if offsets.first() != Some(&0)
        || offsets.last().copied() != Some(total as i64)
        || offsets.windows(2).any(|w| w[1] < w[0])
    {
        return Err(Error::invalid(name, format!("must rise from 0 to {total}")));
    }
    Ok(())
}

/// The plan of packed items: `item_ids` (the packing plan's `sample_ids`: one whole item
/// per segment, never split) and `item_pack_offsets` (its `pack_offsets`) expanded into
/// the items' segments, parents and paths.
pub fn expand(
    items: &ItemsRef<'_>,
    item_ids: &[i64],
    item_pack_offsets: &[i64],
) -> Result<TreePlan> {
    let entries = items.seqlens.len();
    for (name, len) in [
        ("sample_ids", items.sample_ids.len()),
        ("starts", items.starts.len()),
        ("parents", items.parents.len()),
    ] {
        if len != entries {
            return Err(Error::invalid(name, format!("{len} entries; seqlens has {entries}")));
        }
    }
    if items.path_ends.len() != items.path_sample_ids.len() {
        return Err(Error::invalid("path_ends", "one entry per path sample expected"));
    }
    let count = items.item_offsets.len().saturating_sub(1);
    check_csr("item_offsets", items.item_offsets, entries)?;
    check_csr("path_offsets", items.path_offsets, items.path_sample_ids.len())?;
    if items.path_offsets.len() != count + 1 {
        return Err(Error::invalid("path_offsets", format!("expected {} entries", count + 1)));
    }
    check_csr("item_pack_offsets", item_pack_offsets, item_ids.len())?;
    let mut seen = vec![false; count];
    for &k in item_ids {
        if k < 0 || k as u64 >= count as u64 || std::mem::replace(&mut seen[k as usize], true) {
            return Err(Error::invalid(
                "item_ids",
                format!("item {k} is out of range or packed twice; the trees have {count} items"),
            ));
        }
    }
    let size = |k: usize| (items.item_offsets[k + 1] - items.item_offsets[k]) as usize;
    let segments: usize = item_ids.iter().map(|&k| size(k as usize)).sum();
    let paths: usize = item_ids
        .iter()
        .map(|&k| (items.path_offsets[k as usize + 1] - items.path_offsets[k as usize]) as usize)
        .sum();
    let mut out = TreePlan {
        sample_ids: memory::try_with_capacity(segments, "tree plan")?,
        starts: memory::try_with_capacity(segments, "tree plan")?,
        seqlens: memory::try_with_capacity(segments, "tree plan")?,
        parents: memory::try_with_capacity(segments, "tree plan")?,
        pack_offsets: memory::try_with_capacity(item_pack_offsets.len(), "tree plan")?,
        path_sample_ids: memory::try_with_capacity(paths, "tree plan")?,
        path_ends: memory::try_with_capacity(paths, "tree plan")?,
    };
    let mut at = 0usize;
    out.pack_offsets.push(0);
    for w in item_pack_offsets.windows(2) {
        for &k in &item_ids[w[0] as usize..w[1] as usize] {
            let k = k as usize;
            let (lo, hi) = (items.item_offsets[k] as usize, items.item_offsets[k + 1] as usize);
            out.sample_ids.extend_from_slice(&items.sample_ids[lo..hi]);
            out.starts.extend_from_slice(&items.starts[lo..hi]);
            out.seqlens.extend_from_slice(&items.seqlens[lo..hi]);
            for (e, &p) in items.parents[lo..hi].iter().enumerate() {
                if p < -1 || p as i64 >= e as i64 {
                    return Err(Error::invalid(
                        "parents",
                        format!(
                            "entry {} of item {k} has parent {p}; expected -1 or an earlier entry",
                            e
                        ),
                    ));
                }
                out.parents.push(if p < 0 { -1 } else { (at + p as usize) as i64 });
            }
            let (plo, phi) = (items.path_offsets[k] as usize, items.path_offsets[k + 1] as usize);
            for j in plo..phi {
                let end = items.path_ends[j];
                if end < 0 || end as usize >= hi - lo {
                    return Err(Error::invalid(
                        "path_ends",
                        format!(
                            "path {j} ends at entry {end}, outside its item of {} entries",
                            hi - lo
                        ),
                    ));
                }
                out.path_sample_ids.push(items.path_sample_ids[j]);
                out.path_ends.push((at + end as usize) as i64);
            }
            at += hi - lo;
        }
        out.pack_offsets.push(at as i64);
    }
    Ok(out)
}

/// A plan's tree arrays, borrowed: what the batch and target counts read.
#[derive(Debug, Clone, Copy)]
pub struct TreeRef<'a> {
    pub plan: PlanRef<'a>,
    pub path_sample_ids: &'a [i64],
    pub path_ends: &'a [i64],
}

impl TreeRef<'_> {
    fn parents(&self) -> Result<&[i64]> {
        self.plan
            .parents
            .ok_or_else(|| Error::invalid("plan", "has no parents: it is not a plan of trees"))
    }

    /// The segments of path `j` from its root, checked: each in `lo..=end` (the pack),
    /// each parent before its child, the positions continuing from 0.
    fn path(&self, j: usize, lo: usize, out: &mut Vec<usize>) -> Result<usize> {
        let parents = self.parents()?;
        let (starts, seqlens) = (self.plan.starts, self.plan.seqlens);
        let end = self.path_ends[j];
        let bad = |why: String| {
            Error::invalid("plan", format!("path {j} (sample {}): {why}", self.path_sample_ids[j]))
        };
        if end < lo as i64 || end as u64 >= seqlens.len() as u64 {
            return Err(bad(format!("ends at segment {end}, outside its pack")));
        }
        out.clear();
        let mut v = end as usize;
        loop {
            out.push(v);
            let p = parents[v];
            if p < 0 {
                break;
            }
            if p < lo as i64 || p as usize >= v {
                return Err(bad(format!(
                    "segment {v} has parent {p}, not an earlier segment of its pack"
                )));
            }
            v = p as usize;
        }
        out.reverse();
        let mut position = 0i64;
        for &s in out.iter() {
            if starts[s] != position || seqlens[s] <= 0 {
                return Err(bad(format!(
                    "segment {s} starts at position {} with {} tokens; expected position {position}",
                    starts[s], seqlens[s]
                )));
            }
            position += seqlens[s] as i64;
        }
        Ok(position as usize)
    }
}

/// The labels of sample `i`'s first `len` positions as training sees them: its labels
/// (default: its tokens), -100 where its loss mask is 0; with its tokens, to check them.
fn sample_labels(sources: &Sources<'_>, i: usize, len: usize, labels: &mut Vec<i64>) -> Result<()> {
    let tokens = sources.tokens;
    let row = tokens.row(i)?;
    if row.len() < len {
        return Err(Error::invalid(
            "plan",
            format!("sample {i} has {} tokens, fewer than its path's {len}; was the plan made from this data?", row.len()),
        ));
    }
    labels.clear();
    labels.resize(len, 0);
    match sources.labels {
        Some(column) => {
            let r = check_row_len(column, tokens, i, row.len())?;
            column.values(r).copy_i64(r.lo, labels);
        }
        None => tokens.values(row).copy_i64(row.lo, labels),
    }
    if let Some(mask) = sources.loss_mask {
        let r = check_row_len(mask, tokens, i, row.len())?;
        let values: &Values<'_> = mask.values(r);
        values.for_each_zero(r.lo, len, |k| labels[k] = IGNORE_INDEX);
    }
    Ok(())
}

fn check_sources(sources: &Sources<'_>) -> Result<()> {
    sources.tokens.require_integers("tokens")?;
    if let Some(labels) = sources.labels {
        labels.require_integers("labels")?;
    }
    for side in [sources.labels, sources.loss_mask].into_iter().flatten() {
        if side.rows() != sources.tokens.rows() {
            return Err(Error::invalid(
                "columns",
                format!(
                    "column '{}' has {} rows, but the tokens have {}; every column needs one row per sequence",
                    side.name(),
                    side.rows(),
                    sources.tokens.rows()
                ),
            ));
        }
    }
    Ok(())
}

/// Targets of every path of `tree` (labels other than -100 at positions 1.. of its sample,
/// as [`rows`] lists them): what a sampler's normaliser counts, without building a batch.
pub fn path_targets(tree: &TreeRef<'_>, sources: &Sources<'_>) -> Result<Vec<u32>> {
    check_sources(sources)?;
    let parents = tree.parents()?;
    let segments = tree.plan.seqlens.len();
    if parents.len() != segments || tree.path_ends.len() != tree.path_sample_ids.len() {
        return Err(Error::invalid("plan", "parents and paths do not match the segments"));
    }
    let plain = sources.labels.is_none() && sources.loss_mask.is_none();
    (0..tree.path_ends.len())
        .into_par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(path, labels), j| {
                let len = tree.path(j, 0, path)?;
                let sample = sample_index(tree, j)?;
                if plain {
                    return Ok(len.saturating_sub(1) as u32);
                }
                sample_labels(sources, sample, len, labels)?;
                Ok(labels[1..].iter().filter(|&&l| l != IGNORE_INDEX).count() as u32)
            },
        )
        .collect()
}

fn sample_index(tree: &TreeRef<'_>, j: usize) -> Result<usize> {
    let i = tree.path_sample_ids[j];
    if i < 0 {
        return Err(Error::invalid("plan", format!("path {j} has sample {i}")));
    }
    Ok(i as usize)
}

/// A batch of packs of a tree plan laid end to end in one row, as the model reads it
/// beside the tokens (which [`materialize`](crate::materialize::materialize) writes):
/// each segment's parent in the batch, the *target map* (every target of every sample:
/// the row position of the logit that predicts it and its label) and every sample's
/// tokens (row positions, in order). Samples come in ascending order of their ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeRows {
    /// Per segment of the chosen packs: its parent's index among them, or -1.
    pub parents: Vec<i32>,
    pub target_index: Vec<i64>,
    pub target_labels: Vec<i64>,
    /// Sample `k`'s targets are `target_offsets[k] .. target_offsets[k + 1]`.
    pub target_offsets: Vec<i64>,
    pub sample_ids: Vec<i64>,
    pub sample_tokens: Vec<i64>,
    pub sample_offsets: Vec<i64>,
}

/// The [`TreeRows`] of `packs` of `tree`. Every path is checked (its segments in its
/// pack, parents before children, positions continuing) and so is every token: a
/// sample's own tokens must equal the segments' (the plan was made from this data).
pub fn rows(tree: &TreeRef<'_>, sources: &Sources<'_>, packs: &[i64]) -> Result<TreeRows> {
    check_sources(sources)?;
    let plan = &tree.plan;
    plan.check_packs(packs)?;
    let parents = tree.parents()?;
    let segments = plan.seqlens.len();
    if parents.len() != segments || tree.path_ends.len() != tree.path_sample_ids.len() {
        return Err(Error::invalid("plan", "parents and paths do not match the segments"));
    }
    if tree.path_ends.windows(2).any(|w| w[1] < w[0]) {
        return Err(Error::invalid("plan", "path_ends must be in ascending order"));
    }
    // Each chosen segment's index in the batch and first row position.
    let mut out = TreeRows::default();
    let mut local: Vec<(usize, usize, usize)> = Vec::with_capacity(packs.len()); // (lo, base, flat)
    let (mut base, mut flat) = (0usize, 0usize);
    let mut jobs: Vec<(usize, usize)> = Vec::new(); // (path, pack k)
    for (k, &p) in packs.iter().enumerate() {
        let range = plan.pack_range(p);
        local.push((range.start, base, flat));
        for s in range.clone() {
            let parent = parents[s];
            out.parents.push(if parent < 0 {
                -1
            } else if parent >= range.start as i64 && (parent as usize) < s {
                (parent as usize - range.start + base) as i32
            } else {
                return Err(Error::invalid(
                    "plan",
                    format!("segment {s} has parent {parent}, not an earlier segment of pack {p}"),
                ));
            });
        }
        let first = tree.path_ends.partition_point(|&e| e < range.start as i64);
        let last = tree.path_ends.partition_point(|&e| e < range.end as i64);
        jobs.extend((first..last).map(|j| (j, k)));
        base += range.len();
        flat += plan.seqlens[range].iter().map(|&n| n as usize).sum::<usize>();
    }
    let mut flat_start = vec![0i64; base];
    for (k, &p) in packs.iter().enumerate() {
        let (lo, b, mut f) = local[k];
        for s in plan.pack_range(p) {
            flat_start[b + s - lo] = f as i64;
            f += plan.seqlens[s] as usize;
        }
    }
    jobs.sort_by_key(|&(j, _)| (tree.path_sample_ids[j], j));
    type PathRows = (i64, Vec<i64>, Vec<i64>, Vec<i64>);
    let per_path: Vec<Result<PathRows>> = jobs
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(path, labels, own), &(j, k)| {
                let (lo, b, _) = local[k];
                let len = tree.path(j, lo, path)?;
                let i = sample_index(tree, j)?;
                sample_labels(sources, i, len, labels)?;
                let tokens = sources.tokens;
                let row = tokens.row(i)?;
                own.clear();
                own.resize(len, 0);
                tokens.values(row).copy_i64(row.lo, own);
                let mut index = Vec::with_capacity(len);
                let mut source = Vec::new();
                for &s in path.iter() {
                    let n = plan.seqlens[s] as usize;
                    let at = flat_start[b + s - lo];
                    index.extend((0..n as i64).map(|t| at + t));
                    // The segment's tokens as stored (its source sample) must be this sample's.
                    let src = plan.sample(s, tokens.rows())?;
                    if src != i {
                        let r = tokens.row(src)?;
                        let (from, count) = plan.segment_source(s, r.len() as u64)?;
                        source.clear();
                        source.resize(count, 0);
                        tokens.values(r).copy_i64(r.lo + from, &mut source);
                        let mine = &own[plan.starts[s] as usize..plan.starts[s] as usize + n];
                        if count != n || source != mine {
                            return Err(Error::invalid(
                                "plan",
                                format!(
                                    "sample {i} differs from segment {s} (sample {src}, positions {}..{}) \
                                     that its path shares; was the plan made from this data?",
                                    plan.starts[s],
                                    plan.starts[s] as usize + n
                                ),
                            ));
                        }
                    }
                }
                let mut target_index = Vec::new();
                let mut target_labels = Vec::new();
                for t in 1..len {
                    if labels[t] != IGNORE_INDEX {
                        target_index.push(index[t - 1]);
                        target_labels.push(labels[t]);
                    }
                }
                Ok((i as i64, index, target_index, target_labels))
            },
        )
        .collect();
    out.target_offsets.push(0);
    out.sample_offsets.push(0);
    for result in per_path {
        let (i, index, target_index, target_labels) = result?;
        out.sample_ids.push(i);
        out.sample_tokens.extend_from_slice(&index);
        out.sample_offsets.push(out.sample_tokens.len() as i64);
        out.target_index.extend_from_slice(&target_index);
        out.target_labels.extend_from_slice(&target_labels);
        out.target_offsets.push(out.target_index.len() as i64);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::{Ints, ListChunk};
    use crate::materialize::{materialize, MaterializeOptions};
    use crate::plan::Strategy;
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

    fn column<'a>(values: &'a [i64], offsets: &'a [i64]) -> Column<'a> {
        Column::new(
            "input_ids",
            vec![ListChunk { offsets: Ints::I64(offsets), values: Values::of(values) }],
            None,
        )
        .unwrap()
    }

    /// Items packed by the core and expanded: the tree plan, as Python assembles it.
    fn plan_of(items: &Items, max_len: u64) -> TreePlan {
        let costs: Vec<u32> = items.item_costs.clone();
        let opts =
            PackOptions { strategy: Strategy::BestFitDecreasing, ..PackOptions::new(max_len) };
        let packed = pack(&costs, &opts).unwrap();
        expand(&ItemsRef::from(items), &packed.sample_ids, &packed.pack_offsets).unwrap()
    }

    fn tree_ref<'a>(plan: &'a TreePlan) -> TreeRef<'a> {
        TreeRef {
            plan: PlanRef {
                sample_ids: &plan.sample_ids,
                starts: &plan.starts,
                seqlens: &plan.seqlens,
                pack_offsets: &plan.pack_offsets,
                reserve: 0,
                strategy: Strategy::BestFitDecreasing,
                overlong: Overlong::Error,
                parents: Some(&plan.parents),
            },
            path_sample_ids: &plan.path_sample_ids,
            path_ends: &plan.path_ends,
        }
    }

    #[test]
    fn prompts_share_their_longest_common_prefix() {
        let seqs = vec![vec![1, 2, 3, 4], vec![1, 2, 3], vec![1, 2, 5, 6, 7], vec![9], vec![8, 1]];
        let (v, o) = flat(&seqs);
        let items = build(&column(&v, &o), Some(&[7, 7, 7, -1, 3]), &TreeOptions::new(8)).unwrap();
        // Group 7: prefix [1, 2], children [3, 4], [3] and [5, 6, 7].
        assert_eq!(items.item_costs, [8, 1, 2]);
        assert_eq!(items.seqlens[..4], [2, 2, 1, 3]);
        assert_eq!(items.parents[..4], [-1, 0, 0, 0]);
        assert_eq!(items.path_sample_ids, [0, 1, 2, 3, 4]);
        assert_eq!(items.stats.sample_tokens, 15);
        assert_eq!(items.stats.trees, 3);
    }

    #[test]
    fn a_trie_shares_every_common_prefix_once() {
        let seqs = vec![
            vec![1, 2, 3],
            vec![1, 2, 4, 5],
            vec![1, 2],
            vec![1, 2, 4, 6],
            vec![1, 2, 3],
            vec![2],
        ];
        let (v, o) = flat(&seqs);
        let items = build(&column(&v, &o), None, &TreeOptions::new(16)).unwrap();
        // [1,2] -> {[3], [4] -> {[5], [6]}}; [2].
        assert_eq!(items.seqlens, [2, 1, 1, 1, 1, 1]);
        assert_eq!(items.parents, [-1, 0, 0, 2, 2, -1]);
        assert_eq!(items.starts, [0, 2, 2, 3, 3, 0]);
        // Sample 2 ends at the prefix, samples 0 and 4 (equal) at [3].
        assert_eq!(items.path_sample_ids, [2, 0, 4, 1, 3, 5]);
        assert_eq!(items.path_ends, [0, 1, 1, 3, 4, 0]);
    }

    #[test]
    fn an_oversized_tree_is_split_with_its_prefix_repeated() {
        let seqs: Vec<Vec<i64>> = (0..4).map(|k| vec![1, 2, 3, 10 + k, 20 + k]).collect();
        let (v, o) = flat(&seqs);
        let items = build(&column(&v, &o), Some(&[0; 4]), &TreeOptions::new(7)).unwrap();
        // 3 + 4 * 2 = 11 > 7: two items of the prefix and two responses each.
        assert_eq!(items.item_costs, [7, 7]);
        assert_eq!(items.stats.split_trees, 1);
        let opts = TreeOptions { split: false, ..TreeOptions::new(7) };
        let e = build(&column(&v, &o), Some(&[0; 4]), &opts).unwrap_err().to_string();
        assert!(e.contains("samples 0, 1, 2, 3 share a prefix of 3 tokens"), "{e}");
        let over = build(&column(&v, &o), Some(&[0; 4]), &TreeOptions::new(4)).unwrap_err();
        assert!(over.to_string().contains("4 sequence(s) longer than 4"), "{over}");
        let opts = TreeOptions { overlong: Overlong::Truncate, ..TreeOptions::new(4) };
        let items = build(&column(&v, &o), Some(&[0; 4]), &opts).unwrap();
        assert_eq!(items.stats.truncated_tokens, 4);
        // Each sample kept to [1, 2, 3, 10 + k]: the prefix leaves room for one response.
        assert_eq!(items.item_costs, [4, 4, 4, 4]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(crate::proptest_cases(64)))]
        #[test]
        fn every_sample_is_one_path_with_its_own_tokens(
            seqs in proptest::collection::vec(proptest::collection::vec(0i64..3, 0..9), 0..40),
            prompt_of in proptest::collection::vec(0i64..4, 40),
            with_prompts in any::<bool>(),
            max_len in 1u64..24,
            policy in 0usize..2,
        ) {
            let (v, o) = flat(&seqs);
            let col = column(&v, &o);
            let prompts = with_prompts.then(|| prompt_of[..seqs.len()].to_vec());
            let overlong = [Overlong::Truncate, Overlong::Drop][policy];
            let opts = TreeOptions { overlong, ..TreeOptions::new(max_len) };
            let one = crate::pool::install(Some(1), || build(&col, prompts.as_deref(), &opts)).unwrap().unwrap();
            let many = crate::pool::install(Some(3), || build(&col, prompts.as_deref(), &opts)).unwrap().unwrap();
            prop_assert_eq!(&one, &many);
            for w in one.item_offsets.windows(2) {
                let cost: i64 = one.seqlens[w[0] as usize..w[1] as usize].iter().map(|&n| n as i64).sum();
                prop_assert!(cost as u64 <= max_len);
            }
            let plan = plan_of(&one, max_len);
            let tree = tree_ref(&plan);
            // Every kept sample is exactly one path, and its path spells its tokens.
            let mut held: Vec<i64> = plan.path_sample_ids.clone();
            held.sort();
            let kept: Vec<i64> = (0..seqs.len() as i64)
                .filter(|&i| !seqs[i as usize].is_empty() && (overlong == Overlong::Truncate || seqs[i as usize].len() as u64 <= max_len))
                .collect();
            prop_assert_eq!(held, kept);
            let mut path = Vec::new();
            for j in 0..plan.path_ends.len() {
                let p = (0..plan.pack_offsets.len() - 1)
                    .find(|&p| plan.path_ends[j] < plan.pack_offsets[p + 1]).unwrap();
                let len = tree.path(j, plan.pack_offsets[p] as usize, &mut path).unwrap();
                let i = plan.path_sample_ids[j] as usize;
                let mut spelled = Vec::new();
                for &s in &path {
                    let src = &seqs[plan.sample_ids[s] as usize];
                    let a = plan.starts[s] as usize;
                    spelled.extend_from_slice(&src[a..a + plan.seqlens[s] as usize]);
                }
                let want = &seqs[i][..seqs[i].len().min(max_len as usize)];
                prop_assert_eq!(len, want.len());
                prop_assert_eq!(&spelled[..], want);
            }
            // A trie stores every shared token once: siblings start with different tokens.
            if !with_prompts {
                for s in 0..plan.parents.len() {
                    for t in s + 1..plan.parents.len() {
                        if plan.parents[s] == plan.parents[t] && plan.parents[s] >= 0 {
                            let first = |u: usize| seqs[plan.sample_ids[u] as usize][plan.starts[u] as usize];
                            prop_assert!(first(s) != first(t) || one.stats.split_trees > 0);
                        }
                    }
                }
            }
        }

        #[test]
        fn rows_give_every_target_once(
            seqs in proptest::collection::vec(proptest::collection::vec(1i64..4, 1..7), 1..12),
            with_prompts in any::<bool>(),
            masked in proptest::collection::vec(any::<bool>(), 84),
        ) {
            let (v, o) = flat(&seqs);
            let col = column(&v, &o);
            let prompts = vec![0i64; seqs.len()];
            let items = build(&col, with_prompts.then_some(&prompts[..]), &TreeOptions::new(16)).unwrap();
            let plan = plan_of(&items, 16);
            let tree = tree_ref(&plan);
            let mask: Vec<u8> = masked[..v.len()].iter().map(|&m| m as u8).collect();
            let mask_col = Column::new("loss_mask", vec![ListChunk { offsets: Ints::I64(&o), values: Values::of(&mask) }], None).unwrap();
            let sources = Sources { tokens: &col, labels: None, loss_mask: Some(&mask_col) };
            let packs: Vec<i64> = (0..plan.pack_offsets.len() as i64 - 1).collect();
            let out = rows(&tree, &sources, &packs).unwrap();
            let counts = path_targets(&tree, &sources).unwrap();
            prop_assert_eq!(counts.iter().map(|&c| c as usize).sum::<usize>(), out.target_index.len());
            let m = materialize(&tree.plan, &Sources { labels: None, loss_mask: None, ..sources }, &packs, &MaterializeOptions::default()).unwrap();
            // Every (sample, position) once: its token at its row position, and every
            // target's label the sample's next token, predicted from the token before.
            prop_assert_eq!(&out.sample_ids, &(0..seqs.len() as i64).collect::<Vec<_>>());
            for (k, s) in seqs.iter().enumerate() {
                let index = &out.sample_tokens[out.sample_offsets[k] as usize..out.sample_offsets[k + 1] as usize];
                let got: Vec<i64> = index.iter().map(|&f| m.input_ids[f as usize]).collect();
                prop_assert_eq!(&got, s);
                let positions: Vec<i64> = index.iter().map(|&f| m.position_ids[f as usize]).collect();
                prop_assert_eq!(positions, (0..s.len() as i64).collect::<Vec<_>>());
                let mut want = Vec::new();
                for t in 1..s.len() {
                    if mask[o[k] as usize + t] != 0 {
                        want.push((index[t - 1], s[t]));
                    }
                }
                let lo = out.target_offsets[k] as usize;
                let hi = out.target_offsets[k + 1] as usize;
                let got: Vec<(i64, i64)> = (lo..hi).map(|x| (out.target_index[x], out.target_labels[x])).collect();
                prop_assert_eq!(got, want);
            }
        }
    }
}
