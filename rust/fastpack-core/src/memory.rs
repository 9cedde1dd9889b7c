//! Memory: allocation that can fail, huge-page hints, and shared writes. Every `unsafe`
//! block of the packing code lives in this module, behind safe types and functions.
//!
//! - [`Tiles`]: a fresh buffer that many threads fill, each position once, before anyone
//!   reads it (the counting sort, the replay). Its positions are cut into ranges that tile
//!   it; a range is filled front to back through its cursor, cursors are split between
//!   writers (never shared), and the buffer is read only once [`Tiles::finish`] has found
//!   every cursor exactly at its range's end — proof that every position was written.
//!   Writes are relaxed atomic stores (a plain `mov`) checked against the buffer's end: no
//!   write leaves the allocation, none can race, none is read unwritten, whatever the
//!   callers compute — and nothing is zeroed first.
//! - [`Slots`]: an initialized buffer that threads write at disjoint positions (the
//!   shuffle, the layout, `starts`). Stores are relaxed atomics — a plain `mov` on x86-64
//!   and aarch64 — and every index is bounds-checked: a bug that made two writers share a
//!   slot would give a wrong value, never undefined behaviour.
//! - [`try_zeroed`] and [`try_with_capacity`]: a large allocation that fails returns
//!   [`Error::OutOfMemory`] (a Python `MemoryError`) instead of aborting the process.
//!   Zeroed buffers come from `calloc`, so pages nobody writes cost nothing.
//! - [`prefault_zeroed`] and [`prefault_spare`]: a buffer's page faults paid on idle
//!   threads.
//! - [`fill_from`] and [`try_fill_blocks`]: fresh vectors written in parallel, each item
//!   once, nothing zeroed first.

use std::alloc::Layout;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// A machine word that has an atomic twin of the same size and alignment.
pub(crate) trait Word: Copy + Default + Send + Sync + 'static {
    type Atomic: Sync;
    fn store(cell: &Self::Atomic, value: Self);
    fn load(cell: &Self::Atomic) -> Self;
    /// A relaxed atomic store through a raw pointer.
    ///
    /// # Safety
    /// `ptr` is aligned, inside a live allocation, and every other access to it while
    /// others may store there is atomic too.
    unsafe fn store_at(ptr: *mut Self, value: Self);
}

macro_rules! word {
    ($($t:ty => $a:ty),*) => {$(
        impl Word for $t {
            type Atomic = $a;
            #[inline(always)]
            fn store(cell: &$a, value: $t) {
                cell.store(value, Ordering::Relaxed)
            }
            #[inline(always)]
            fn load(cell: &$a) -> $t {
                cell.load(Ordering::Relaxed)
            }
            #[inline(always)]
            unsafe fn store_at(ptr: *mut $t, value: $t) {
                // SAFETY: the caller's contract; the atomic has the layout of `$t`.
                unsafe { <$a>::from_ptr(ptr) }.store(value, Ordering::Relaxed)
            }
        }
    )*};
}
word!(i64 => AtomicI64, u64 => AtomicU64, i32 => AtomicI32, u32 => AtomicU32, usize => AtomicUsize);

/// A buffer shared by threads that each write their own positions.
///
/// Exclusively borrows the buffer for its lifetime, so nothing else reads or writes it
/// meanwhile; when the `Slots` are dropped the caller has the plain slice back.
pub(crate) struct Slots<'a, T: Word> {
    cells: &'a [T::Atomic],
}

impl<'a, T: Word> Slots<'a, T> {
    pub(crate) fn new(buffer: &'a mut [T]) -> Self {
        const {
            assert!(std::mem::size_of::<T>() == std::mem::size_of::<T::Atomic>());
            assert!(std::mem::align_of::<T>() == std::mem::align_of::<T::Atomic>());
        }
        // SAFETY: `T::Atomic` has the size and alignment of `T` (checked above, at compile
        // time) and, like every std atomic integer, the same bit validity; the buffer is
        // initialized and exclusively borrowed for 'a, so the atomics are its only
        // accessors while they live. Atomics allow shared mutation through `&`.
        let cells = unsafe {
            std::slice::from_raw_parts(buffer.as_mut_ptr() as *const T::Atomic, buffer.len())
        };
        Self { cells }
    }

    /// Writes `value` at `index` (panics out of bounds, like a slice).
    #[inline(always)]
    pub(crate) fn set(&self, index: usize, value: T) {
        T::store(&self.cells[index], value)
    }

    /// Writes `value` at `index` if it is in bounds; `false` otherwise.
    #[inline(always)]
    pub(crate) fn try_set(&self, index: usize, value: T) -> bool {
        match self.cells.get(index) {
            Some(cell) => {
                T::store(cell, value);
                true
            }
            None => false,
        }
    }

    #[inline(always)]
    pub(crate) fn get(&self, index: usize) -> T {
        T::load(&self.cells[index])
    }
}

/// An exclusively borrowed `u64` buffer as atomics, for bits set by many threads.
pub(crate) fn as_atomic(buffer: &mut [u64]) -> &[AtomicU64] {
    // SAFETY: `AtomicU64` has the size, alignment and bit validity of `u64`, and the
    // exclusive borrow makes the atomics the buffer's only accessors while they live.
    unsafe { std::slice::from_raw_parts(buffer.as_mut_ptr() as *const AtomicU64, buffer.len()) }
}

/// `n` zeros, or [`Error::OutOfMemory`]. Large buffers come from a fresh mapping whose
/// pages cost nothing until written (a plan's `starts` is mostly never written), and are
/// advised to use huge pages.
pub(crate) fn try_zeroed<T: Word>(n: usize, what: &'static str) -> Result<Vec<T>> {
    // glibc serves requests of at least its largest mmap threshold (32 MiB) from a fresh
    // mapping, already zero; smaller ones may reuse heap memory that calloc must clear. A
    // buffer of 1 MiB or more is asked at that size (only address space is spent).
    const MMAP_ALWAYS: usize = (32 << 20) + 4096;
    let size = std::mem::size_of::<T>();
    if n == 0 || size == 0 {
        return Ok(Vec::new());
    }
    let bytes = n.checked_mul(size).ok_or_else(|| Error::out_of_memory(what, u64::MAX))?;
    let capacity = if (1 << 20..MMAP_ALWAYS).contains(&bytes) { MMAP_ALWAYS / size } else { n };
    let layout = Layout::array::<T>(capacity).map_err(|_| Error::out_of_memory(what, bytes))?;
    // SAFETY: the layout has a non-zero size (n > 0, size > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(Error::out_of_memory(what, layout.size()));
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `capacity` items of
    // `T`, all zero, and zero is a valid `T` (an integer); `n <= capacity`.
    let v = unsafe { Vec::from_raw_parts(ptr, n, capacity) };
    advise_huge(v.as_ptr() as *const u8, bytes);
    Ok(v)
}

/// `n` copies of `value`, or [`Error::OutOfMemory`].
pub(crate) fn try_filled<T: Word>(n: usize, value: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for `capacity` items, or [`Error::OutOfMemory`]. Large ones
/// are advised to use huge pages: they hold per-pack state indexed at random, where 4 KiB
/// pages cost a TLB miss per access.
pub(crate) fn try_with_capacity<T>(capacity: usize, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    try_reserve(&mut v, capacity, what)?;
    advise_huge(v.as_ptr() as *const u8, capacity * std::mem::size_of::<T>());
    Ok(v)
}

/// Room for `more` items beyond `v.len()`, or [`Error::OutOfMemory`].
pub(crate) fn try_reserve<T>(v: &mut Vec<T>, more: usize, what: &'static str) -> Result<()> {
    v.try_reserve_exact(more).map_err(|_| {
        let bytes = (v.len() as u64 + more as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        Error::out_of_memory(what, bytes)
    })
}

/// Pushes `value`, growing by half the length when full, or [`Error::OutOfMemory`]. For
/// vectors whose final length is only known once filled (packs during the placement).
#[inline(always)]
pub(crate) fn try_push<T>(v: &mut Vec<T>, value: T, what: &'static str) -> Result<()> {
    if v.len() == v.capacity() {
        grow(v, what)?;
    }
    v.push(value);
    Ok(())
}

#[cold]
#[inline(never)]
fn grow<T>(v: &mut Vec<T>, what: &'static str) -> Result<()> {
    try_reserve(v, (v.len() / 2).max(64), what)
}

/// Faults in every page of a vector's spare capacity, in parallel (writing zero to one
/// item per page), so that they are paid by whichever threads are idle rather than later
/// by a sequential writer. The vector is unchanged: its spare capacity stays unread.
pub(crate) fn prefault_spare<T: Word + Default>(v: &mut Vec<T>) {
    use rayon::prelude::*;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    v.spare_capacity_mut().par_chunks_mut(step).with_min_len(512).for_each(|page| {
        page[0].write(T::default());
    });
}

const PAGE: usize = 4096;

/// Ranges per parallel task of a tiling's gathers and scatters.
const PARALLEL_RANGES: usize = 1 << 16;

/// How a buffer's positions are cut into ranges: each range's first position and end
/// (see [`Tiles`]). Positions are u32: a plan holds at most MAX_ITEMS segments.
pub(crate) struct Tiling {
    total: usize,
    /// Per range: its next position (its first, until written): the writers' only state,
    /// 4 bytes a range (the replay's hot array, indexed at random).
    next: Vec<u32>,
    /// Where each place ends (`offsets[q + 1]`; a CSR's offsets from 0), place `q` holding
    /// range `order[q]` (range `q` without an order). Read by [`Tiles::finish`] only.
    offsets: Vec<i64>,
    order: Option<Vec<u32>>,
}

impl Tiling {
    /// Ranges of `sizes[r]` positions laid end to end in the order `order` lists them
    /// (`order[q]` = the range at place `q`; `None`: `0, 1, 2, ...`). An `order` that is
    /// not a permutation of the ranges is an error.
    pub(crate) fn new(
        mut sizes: Vec<u32>,
        order: Option<Vec<u32>>,
        what: &'static str,
    ) -> Result<Self> {
        use rayon::prelude::*;
        let ranges = sizes.len();
        let mut offsets = try_with_capacity::<i64>(ranges + 1, what)?;
        offsets.push(0);
        let Some(order) = order else {
            // The sizes become the cursors, in place.
            let mut at = 0u64;
            for size in sizes.iter_mut() {
                let first = at as u32;
                at += *size as u64;
                *size = first;
                offsets.push(at as i64);
            }
            let total = check_total(at)?;
            return Ok(Self { total, next: sizes, offsets, order: None });
        };
        // Random gathers and scatters over millions of ranges: parallel (a few thousand
        // ranges, the counting sort's, stay on this thread: waking the pool costs more).
        let min_len = PARALLEL_RANGES;
        let mut seen = try_zeroed::<u64>(ranges.div_ceil(64), what)?;
        let bits = as_atomic(&mut seen);
        let once = order.len() == ranges
            && order.par_iter().with_min_len(min_len).all(|&r| {
                let (word, bit) = (r as usize >> 6, 1u64 << (r & 63));
                (r as usize) < ranges && bits[word].fetch_or(bit, Ordering::Relaxed) & bit == 0
            });
        if !once {
            return Err(Error::invalid("fastpack", "internal error: ranges do not tile"));
        }
        let mut in_order = try_with_capacity::<u32>(ranges, what)?;
        order
            .par_iter()
            .with_min_len(min_len)
            .map(|&r| sizes[r as usize])
            .collect_into_vec(&mut in_order);
        let mut at = 0u64;
        for size in in_order {
            at += size as u64;
            offsets.push(at as i64);
        }
        let total = check_total(at)?;
        // Every range is set (the order is a permutation): the sizes become the cursors.
        {
            let next = Slots::new(&mut sizes);
            let offsets = &offsets;
            order
                .par_iter()
                .enumerate()
                .for_each(|(q, &r)| next.set(r as usize, offsets[q] as u32));
        }
        Ok(Self { total, next: sizes, offsets, order: Some(order) })
    }

    /// Where each place ends (`offsets[q + 1]`), from 0.
    #[cfg(test)]
    pub(crate) fn offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// Binds the tiling to the positions after a vector's items (room is made for them,
    /// fallibly) for writers to fill.
    pub(crate) fn over<'v, T: Word>(
        self,
        v: &'v mut Vec<T>,
        what: &'static str,
    ) -> Result<Tiles<'v, T>> {
        try_reserve(v, self.total, what)?;
        advise_huge(v.as_ptr() as *const u8, (v.len() + self.total) * std::mem::size_of::<T>());
        Ok(Tiles { v, tiling: self })
    }
}

fn check_total(at: u64) -> Result<usize> {
    if at > u32::MAX as u64 {
        return Err(Error::overflow("lengths", "more than 2^32 - 1 segments"));
    }
    Ok(at as usize)
}

/// A fresh buffer filled, each position once, by writers that each hold the cursors of
/// some of its ranges (see the module docs): positions `v.len() .. v.len() + total` of
/// the vector it fills.
pub(crate) struct Tiles<'v, T: Word> {
    v: &'v mut Vec<T>,
    tiling: Tiling,
}

impl<T: Word> Tiles<'_, T> {
    /// The cursors of every range, for writers to split between them.
    pub(crate) fn cursors(&mut self) -> Cursors<'_, T> {
        // SAFETY: `Tiling::over` made room for `total` items after the vector's length, so
        // the pointer and every position below `total` from it are in the allocation.
        let base = unsafe { self.v.as_mut_ptr().add(self.v.len()) };
        let (total, next) = (self.tiling.total, &mut self.tiling.next);
        Cursors { base, total, next, _written: std::marker::PhantomData }
    }

    /// Every range full: the tiled positions become the vector's items, and the tiling's
    /// offsets are handed back. `None` (and the vector unchanged) if some range was not
    /// filled exactly.
    pub(crate) fn finish(self) -> Option<Vec<i64>> {
        use rayon::prelude::*;
        let Tiling { total, next, offsets, order } = self.tiling;
        let ends = &offsets[1..];
        let full = match &order {
            None => next.iter().zip(ends).all(|(&n, &e)| n as i64 == e),
            Some(order) => order
                .par_iter()
                .with_min_len(PARALLEL_RANGES)
                .zip(ends)
                .all(|(&r, &e)| next[r as usize] as i64 == e),
        };
        if !full {
            return None;
        }
        let len = self.v.len() + total;
        // SAFETY: the ranges tile positions `v.len() .. len` (`Tiling::new` laid them end to
        // end, each once: the order was checked to be a permutation). A range's cursor
        // starts at its first position and only moves forward: by one after a write at its
        // old value (`Cursors::push`), or past `k` positions that a `Claims` then writes or,
        // dropped unfilled, zeroes. Every cursor is now exactly at its range's end, so it
        // never left its range and every position of every range was written. All writes
        // are complete: the writers hold borrows of `self`, and they are gone. `T` is a
        // plain integer.
        unsafe { self.v.set_len(len) };
        Some(offsets)
    }
}

/// The cursors of some ranges of a [`Tiles`]. A write goes to its range's next position;
/// writes are relaxed atomic stores anywhere below the buffer's end, so even cursors that
/// (by a bug) ran past their range could not race — and [`Tiles::finish`] would refuse
/// the buffer. Split to hand ranges to several writers.
pub(crate) struct Cursors<'t, T> {
    base: *mut T,
    total: usize,
    next: &'t mut [u32],
    _written: std::marker::PhantomData<&'t mut [T]>,
}

// SAFETY: a `Cursors` stores only atomically, below the buffer's end, and nothing reads
// the buffer before `Tiles::finish` (which needs every writer gone): moving one to
// another thread cannot make a data race. `T` is a plain integer.
unsafe impl<T: Send> Send for Cursors<'_, T> {}

impl<'t, T: Word> Cursors<'t, T> {
    /// Ranges `0..mid` and `mid..` (renumbered from 0).
    pub(crate) fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.next.split_at_mut(mid);
        let (base, total, marker) = (self.base, self.total, std::marker::PhantomData);
        (
            Cursors { base, total, next: a, _written: marker },
            Cursors { base, total, next: b, _written: marker },
        )
    }

    /// How many ranges.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.next.len()
    }

    /// Writes `value` at range `r`'s next position; returns it, or `None` (writing nothing)
    /// past the buffer's end or when `r` is not one of these ranges.
    #[inline(always)]
    pub(crate) fn push(&mut self, r: usize, value: T) -> Option<usize> {
        let next = self.next.get_mut(r)?;
        let pos = *next as usize;
        if pos >= self.total {
            return None;
        }
        // SAFETY: `pos < total`: aligned and in the allocation (`Tiling::over`); every
        // store to the buffer before `finish` is atomic.
        unsafe { T::store_at(self.base.add(pos), value) };
        *next += 1;
        Some(pos)
    }

    /// An empty batch of claims on these ranges' buffer, with room for `capacity`.
    pub(crate) fn claims<P>(&self, capacity: usize) -> Claims<'t, T, P> {
        let runs = Vec::with_capacity(capacity);
        Claims { base: self.base, runs, filled: false, _written: std::marker::PhantomData }
    }

    /// Claims range `r`'s next `k` positions into `claims` (the cursor moves past them now)
    /// with `payload` for whoever fills them; `false` (claiming nothing) past the buffer's
    /// end or when `r` is not one of these ranges.
    #[inline(always)]
    pub(crate) fn claim<P>(
        &mut self,
        r: usize,
        k: usize,
        payload: P,
        claims: &mut Claims<'t, T, P>,
    ) -> bool {
        assert!(std::ptr::eq(claims.base, self.base), "claims on another buffer");
        let Some(next) = self.next.get_mut(r) else { return false };
        let pos = *next as usize;
        if pos + k > self.total {
            return false;
        }
        *next = (pos + k) as u32;
        claims.runs.push((pos as u32, k as u32, payload));
        true
    }
}

/// Runs of positions claimed from a [`Tiles`]'s ranges (see [`Cursors::claim`]), for one
/// writer — possibly on another thread — to fill. Dropped unfilled, it fills them with
/// zeros: no position a range counts as written is ever left unwritten.
pub(crate) struct Claims<'t, T: Word, P> {
    base: *mut T,
    /// (first position, count, payload) of each run.
    runs: Vec<(u32, u32, P)>,
    filled: bool,
    _written: std::marker::PhantomData<&'t mut [T]>,
}

// SAFETY: the `Claims` stores only atomically, below the buffer's end, and nothing reads
// the buffer before `Tiles::finish` (which needs every writer gone).
unsafe impl<T: Word, P: Send> Send for Claims<'_, T, P> {}

impl<T: Word, P> Claims<'_, T, P> {
    pub(crate) fn len(&self) -> usize {
        self.runs.len()
    }

    /// Fills every run: `values(payload, first position, count)` gives its values, exactly
    /// `count` of them. Whatever the iterator's `len()` says, at most `count` items are
    /// stored per run (the store stays inside the claim), and a run given fewer panics
    /// before `filled` is set, so the drop zero-fills every claimed position: an iterator
    /// that lies gives a panic, never a write outside the claim or a position unwritten.
    #[inline(always)]
    pub(crate) fn fill<I: Iterator<Item = T>>(
        mut self,
        mut values: impl FnMut(&P, usize, usize) -> I,
    ) {
        for (pos, k, payload) in &self.runs {
            let (pos, k) = (*pos as usize, *k as usize);
            let mut written = 0;
            // Zipped with the run's slots: stops at `k` items, and for slice-based
            // iterators compiles to one counted loop, as fast as trusting `len()`.
            for (j, value) in (0..k).zip(values(payload, pos, k)) {
                // SAFETY: `j < k` and `pos + k <= total` (`Cursors::claim`): aligned and in
                // the allocation; every store to the buffer before `finish` is atomic.
                unsafe { T::store_at(self.base.add(pos + j), value) };
                written = j + 1;
            }
            // Unwinding drops `self` unfilled, which zero-fills every run.
            assert_eq!(written, k, "a run is filled whole");
        }
        self.filled = true;
    }
}

impl<T: Word, P> Drop for Claims<'_, T, P> {
    fn drop(&mut self) {
        if self.filled {
            return;
        }
        for &(pos, k, _) in &self.runs {
            for j in pos as usize..(pos + k) as usize {
                // SAFETY: a claimed position, as in `fill`.
                unsafe { T::store_at(self.base.add(j), T::default()) };
            }
        }
    }
}

/// Sets `dst` to `f(&mut src[i])` for every `i`, in parallel (its old items are dropped:
/// plain integers), fallibly.
pub(crate) fn fill_from<S: Send, T: Word>(
    dst: &mut Vec<T>,
    src: &mut [S],
    f: impl Fn(&mut S) -> T + Sync,
    what: &'static str,
) -> Result<()> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let n = src.len();
    dst.clear();
    try_reserve(dst, n, what)?;
    let spare = &mut dst.spare_capacity_mut()[..n];
    src.par_chunks_mut(CHUNK).zip(spare.par_chunks_mut(CHUNK)).for_each(|(from, to)| {
        for (s, t) in from.iter_mut().zip(to) {
            t.write(f(s));
        }
    });
    // SAFETY: the chunks of `src` and of the first `n` spare items pair up one to one, and
    // the loop wrote every item of every chunk: items `0..n` are written.
    unsafe { dst.set_len(n) };
    Ok(())
}

/// The uninitialized items of one block of a vector being filled (see [`try_fill_blocks`]),
/// written front to back, each once.
pub(crate) struct Fill<'a, T> {
    out: &'a mut [std::mem::MaybeUninit<T>],
    len: usize,
}

impl<T> Fill<'_, T> {
    /// Items the block holds.
    pub(crate) fn capacity(&self) -> usize {
        self.out.len()
    }

    /// Writes the block's next item (panics past its end, like a slice).
    #[inline(always)]
    pub(crate) fn push(&mut self, value: T) {
        self.out[self.len].write(value);
        self.len += 1;
    }
}

/// Two fresh vectors of `na` and `nb` items, cut into the same number of blocks (`a`'s of
/// `a_block` items, `b`'s of `b_block`, the last ones shorter; `nb = 0`: every block of
/// `b` empty), filled in parallel, block `c` by `write(c, a's block, b's block)`, without
/// zeroing first. The first error of a block (in block order) is returned as is, and the
/// vectors are then left empty; a block that returns `Ok` without writing each of its items
/// is an internal error, never an unwritten item read.
#[allow(clippy::type_complexity)]
pub(crate) fn try_fill_blocks<A: Send, B: Send, E: Send>(
    (na, a_block): (usize, usize),
    (nb, b_block): (usize, usize),
    what: &'static str,
    write: impl Fn(usize, &mut Fill<'_, A>, &mut Fill<'_, B>) -> std::result::Result<(), E> + Sync,
) -> Result<std::result::Result<(Vec<A>, Vec<B>), E>> {
    use rayon::prelude::*;
    let blocks = na.div_ceil(a_block.max(1));
    if nb > 0 && nb.div_ceil(b_block.max(1)) != blocks {
        return Err(Error::invalid("fastpack", format!("internal error: {what} blocks differ")));
    }
    let mut a = try_with_capacity::<A>(na, what)?;
    let mut b = try_with_capacity::<B>(nb, what)?;
    let mut parts = Vec::with_capacity(blocks);
    let (mut rest_a, mut rest_b) =
        (&mut a.spare_capacity_mut()[..na], &mut b.spare_capacity_mut()[..nb]);
    for _ in 0..blocks {
        let (ka, kb) = (a_block.min(rest_a.len()), b_block.min(rest_b.len()));
        let (pa, ta) = std::mem::take(&mut rest_a).split_at_mut(ka);
        let (pb, tb) = std::mem::take(&mut rest_b).split_at_mut(kb);
        parts.push((Fill { out: pa, len: 0 }, Fill { out: pb, len: 0 }));
        (rest_a, rest_b) = (ta, tb);
    }
    if !(rest_a.is_empty() && rest_b.is_empty()) {
        return Err(Error::invalid("fastpack", format!("internal error: {what} blocks differ")));
    }
    let results: Vec<std::result::Result<bool, E>> = parts
        .into_par_iter()
        .enumerate()
        .map(|(c, (mut fa, mut fb))| {
            write(c, &mut fa, &mut fb)?;
            Ok(fa.len == fa.out.len() && fb.len == fb.out.len())
        })
        .collect();
    let mut complete = true;
    for r in results {
        match r {
            Ok(done) => complete &= done,
            Err(e) => return Ok(Err(e)),
        }
    }
    if !complete {
        return Err(Error::invalid("fastpack", format!("internal error: {what} left unwritten")));
    }
    // SAFETY: the blocks tile the first `na` (`nb`) spare items, and every block wrote each
    // of its items (its `Fill` reached its end, one `write` per item).
    unsafe {
        a.set_len(na);
        b.set_len(nb);
    }
    Ok(Ok((a, b)))
}

/// Faults in every page of an all-zero buffer (from [`try_zeroed`]), in parallel, by
/// storing zero to one item a page: for a buffer written at random slots later, by a
/// sequential writer. Only a store: a load first would map the shared zero page and then
/// fault again on the write.
pub(crate) fn prefault_zeroed<T: Word>(buffer: &mut [T]) {
    use rayon::prelude::*;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    let pages = buffer.len().div_ceil(step);
    let slots = Slots::new(buffer);
    (0..pages).into_par_iter().with_min_len(512).for_each(|page| {
        // A real store (an atomic store is never elided as dead) of the zero it holds.
        slots.set(page * step, T::default());
    });
}

#[cfg(all(target_os = "linux", not(miri)))]
fn advise_huge(ptr: *const u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 4 * HUGE {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE);
    let end = (ptr as usize + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside a live allocation; MADV_HUGEPAGE is only a hint and
        // leaves the contents unchanged. Its failure (THP disabled) is harmless.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Only a hint: nothing to do elsewhere (nor under Miri, which has no `madvise`).
#[cfg(any(not(target_os = "linux"), miri))]
fn advise_huge(_ptr: *const u8, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_write_disjoint_positions_from_many_threads() {
        use rayon::prelude::*;
        let n = if cfg!(miri) { 200 } else { 10_000 };
        let mut buffer = try_zeroed::<u32>(n, "test").unwrap();
        {
            let slots = Slots::new(&mut buffer);
            (0..n as u32).into_par_iter().for_each(|i| slots.set((i as usize * 7919) % n, i));
            assert!(!slots.try_set(n, 1));
        }
        let mut seen = buffer.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n);
    }

    #[test]
    fn zeroed_buffers_are_zero_at_every_size() {
        let sizes: &[usize] = if cfg!(miri) {
            &[0, 1, 1000]
        } else {
            &[0, 1, 1000, (1 << 20) / 8 + 1, (40 << 20) / 8]
        };
        for &n in sizes {
            let v = try_zeroed::<i64>(n, "test").unwrap();
            assert_eq!(v.len(), n);
            assert!(v.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn impossible_allocations_are_errors() {
        let err = try_zeroed::<u64>(usize::MAX / 4, "the test buffer").unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { what: "the test buffer", .. }), "{err}");
        assert!(try_with_capacity::<u64>(usize::MAX / 4, "x").is_err());
        let mut v = vec![1u8];
        assert!(try_reserve(&mut v, usize::MAX - 1, "x").is_err());
    }

    #[test]
    fn prefault_keeps_zeros() {
        let mut v = try_zeroed::<u64>(if cfg!(miri) { 3_000 } else { 1 << 20 }, "t").unwrap();
        prefault_zeroed(&mut v);
        assert!(v.iter().all(|&x| x == 0));
    }

    #[test]
    fn fill_from_maps_every_item() {
        let n = if cfg!(miri) { 3_000 } else { 300_000 };
        let mut src: Vec<u64> = (0..n as u64).collect();
        let mut dst: Vec<u32> = vec![7; 5];
        fill_from(
            &mut dst,
            &mut src,
            |s| {
                *s += 1;
                (*s * 2) as u32
            },
            "test",
        )
        .unwrap();
        assert_eq!(dst.len(), n);
        assert!(dst.iter().enumerate().all(|(i, &x)| x == 2 * (i as u32 + 1)));
        assert!(src.iter().enumerate().all(|(i, &x)| x == i as u64 + 1));
        let mut spare: Vec<u32> = Vec::with_capacity(100);
        prefault_spare(&mut spare);
        assert!(spare.is_empty());
    }

    #[test]
    fn tiles_fill_every_position_once() {
        use rayon::prelude::*;
        // Ranges of 2, 0, 3 and 1 positions laid out as 2, 0, 3, 1.
        let tiling = Tiling::new(vec![2, 0, 3, 1], Some(vec![2, 0, 3, 1]), "t").unwrap();
        assert_eq!(tiling.offsets(), &[0, 3, 5, 6, 6]);
        let mut v: Vec<u32> = vec![99];
        let mut tiles = tiling.over(&mut v, "t").unwrap();
        let mut cursors = tiles.cursors();
        assert_eq!(cursors.push(2, 20), Some(0));
        assert_eq!(cursors.push(2, 21), Some(1));
        assert_eq!(cursors.push(2, 22), Some(2));
        assert_eq!(cursors.push(9, 10), None, "no range 9");
        let (mut a, mut b) = cursors.split_at(1);
        let mut claims = a.claims(4);
        assert!(a.claim(0, 2, 'x', &mut claims));
        assert_eq!(claims.len(), 1);
        std::thread::scope(|s| {
            s.spawn(move || {
                claims.fill(|&p, first, k| {
                    assert_eq!((p, first, k), ('x', 3, 2));
                    [1, 2].into_iter()
                })
            });
        });
        assert_eq!(b.push(2, 30), Some(5)); // range 3 is `b`'s range 2
        assert_eq!(tiles.finish(), Some(vec![0, 3, 5, 6, 6]));
        assert_eq!(v, vec![99, 20, 21, 22, 1, 2, 30]);

        // A range left short, or one run past its end (onto its neighbour's positions,
        // which then fills in full): no items, nothing read. Past the buffer: refused.
        for overrun in [false, true] {
            let tiling = Tiling::new(vec![1, 1], None, "t").unwrap();
            let mut v: Vec<u64> = Vec::new();
            let mut tiles = tiling.over(&mut v, "t").unwrap();
            let mut cursors = tiles.cursors();
            assert_eq!(cursors.push(0, 5), Some(0));
            if overrun {
                assert_eq!(cursors.push(0, 6), Some(1));
                assert_eq!(cursors.push(1, 7), Some(1));
                assert_eq!(cursors.push(1, 8), None, "past the buffer");
                let mut claims = cursors.claims(1);
                assert!(!cursors.claim(0, 1, (), &mut claims), "past the buffer");
            }
            assert!(tiles.finish().is_none());
            assert!(v.is_empty());
        }
        // Orders that are not permutations.
        for bad in [vec![0u32, 0], vec![0], vec![0, 2]] {
            assert!(Tiling::new(vec![1, 1], Some(bad), "t").is_err());
        }

        // Many threads, each with its own ranges; an unfilled claim is zeroed, not skipped.
        let ranges = if cfg!(miri) { 40 } else { 4_000 };
        let sizes: Vec<u32> = (0..ranges).map(|r| (r % 5) as u32).collect();
        let order: Vec<u32> = (0..ranges as u32).rev().collect();
        let tiling = Tiling::new(sizes.clone(), Some(order.clone()), "t").unwrap();
        let mut v: Vec<u64> = Vec::new();
        let mut tiles = tiling.over(&mut v, "t").unwrap();
        let mut parts = Vec::new();
        let mut rest = tiles.cursors();
        for _ in 0..3 {
            let (part, tail) = rest.split_at(ranges / 4);
            parts.push(part);
            rest = tail;
        }
        parts.push(rest);
        parts.into_par_iter().enumerate().for_each(|(p, mut cursors)| {
            for r in 0..cursors.len() {
                let global = (p * (ranges / 4) + r) as u64;
                let size = sizes[global as usize] as usize;
                if global % 7 == 0 && size > 0 {
                    let mut claims = cursors.claims(1);
                    assert!(cursors.claim(r, size, (), &mut claims));
                    drop(claims);
                } else {
                    for _ in 0..size {
                        cursors.push(r, global + 1).unwrap();
                    }
                }
            }
        });
        let offsets = tiles.finish().unwrap();
        assert_eq!(v.len() as i64, *offsets.last().unwrap());
        for (q, &r) in order.iter().enumerate() {
            let want = if r % 7 == 0 { 0 } else { r as u64 + 1 };
            let place = offsets[q] as usize..offsets[q + 1] as usize;
            assert!(v[place].iter().all(|&x| x == want), "range {r}");
        }
    }

    /// An `ExactSizeIterator` whose `len()` is `claimed` while it yields `items` values: a
    /// safe trait, so `len()` may say anything.
    struct Lying {
        claimed: usize,
        items: std::ops::Range<u64>,
    }

    impl Iterator for Lying {
        type Item = u64;
        fn next(&mut self) -> Option<u64> {
            self.items.next()
        }
    }

    impl ExactSizeIterator for Lying {
        fn len(&self) -> usize {
            self.claimed
        }
    }

    #[test]
    fn claims_stay_sound_whatever_the_iterator_says() {
        // Two ranges of 3 positions; a claim of the first range's 3, filled by an iterator
        // that yields `items` values while `len()` says 3. Its neighbour range (and the
        // buffer's end, right after it) must be untouched, and a short run never leaves a
        // claimed position unwritten.
        for items in [0u64, 2, 3, 5, 1000] {
            let tiling = Tiling::new(vec![3, 3], None, "t").unwrap();
            let mut v: Vec<u64> = Vec::new();
            let mut tiles = tiling.over(&mut v, "t").unwrap();
            let mut cursors = tiles.cursors();
            let mut claims = cursors.claims(1);
            assert!(cursors.claim(0, 3, (), &mut claims));
            for value in [7, 8, 9] {
                cursors.push(1, value).unwrap();
            }
            let filled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                claims.fill(|_, _, k| Lying { claimed: k, items: 1..items + 1 })
            }));
            assert_eq!(filled.is_ok(), items >= 3, "{items} items");
            assert_eq!(tiles.finish(), Some(vec![0, 3, 6]));
            let head = if items >= 3 { vec![1, 2, 3] } else { vec![0, 0, 0] };
            assert_eq!(v, [head, vec![7, 8, 9]].concat(), "{items} items");
        }
    }
}

/// A raw pointer to one buffer shared by tasks that each write a disjoint range of it
/// (the gather's output columns). Users must keep the buffer alive and the ranges
/// disjoint and in bounds for the whole parallel section; `T: Send` because values of
/// `T` are written from other threads.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T: Send>(pub(crate) *mut T);

// SAFETY: the pointer is only dereferenced for disjoint ranges (see the type's docs), so
// sharing it is sharing `&mut` access to disjoint parts of one buffer of `T: Send`.
unsafe impl<T: Send> Send for SyncPtr<T> {}
unsafe impl<T: Send> Sync for SyncPtr<T> {}

impl<T: Send> SyncPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
