//! Memory: allocation that can fail, huge-page hints, and shared writes. Every `unsafe`
//! block of the packing code lives in this module, behind safe functions.
//!
//! - [`Slots`]: one buffer that many threads fill at disjoint positions (the counting
//!   sort, the replay, the shuffle). Stores are relaxed atomics — a plain `mov` on x86-64
//!   and aarch64, so they cost what a raw pointer write costs — and every index is
//!   bounds-checked. A bug that made two writers share a slot would give a wrong value,
//!   never undefined behaviour, and the phases check their counts to turn it into an
//!   error.
//! - [`try_zeroed`] and [`try_with_capacity`]: a large allocation that fails returns
//!   [`Error::OutOfMemory`] (a Python `MemoryError`) instead of aborting the process.
//!   Zeroed buffers come from `calloc`, so pages nobody writes cost nothing.
//! - [`fill_zeros`] and [`prefault`]: a buffer's page faults paid on idle threads.

use std::alloc::Layout;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// A machine word that has an atomic twin of the same size and alignment.
pub(crate) trait Word: Copy + Send + Sync + 'static {
    type Atomic: Sync;
    fn store(cell: &Self::Atomic, value: Self);
    fn load(cell: &Self::Atomic) -> Self;
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

    /// Writes `values` at `start..`, with one bounds check for the whole run.
    #[inline(always)]
    pub(crate) fn set_run(&self, start: usize, values: impl ExactSizeIterator<Item = T>) {
        let cells = &self.cells[start..start + values.len()];
        for (cell, value) in cells.iter().zip(values) {
            T::store(cell, value);
        }
    }
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
        try_reserve(v, (v.len() / 2).max(64), what)?;
    }
    v.push(value);
    Ok(())
}

/// Extends an empty vector to its capacity with zeros, in parallel: its page faults (and
/// the kernel's zeroing) are paid by whichever threads are idle rather than later by a
/// sequential writer, and memory reused from the heap (warm pages) costs only the stores.
pub(crate) fn fill_zeros<T: Word + Default>(v: &mut Vec<T>) {
    use rayon::prelude::*;
    v.clear();
    let spare = v.spare_capacity_mut();
    let n = spare.len();
    spare.par_chunks_mut(1 << 16).for_each(|chunk| {
        for item in chunk {
            item.write(T::default());
        }
    });
    // SAFETY: the loop above wrote every item of the spare capacity, `0..n` of the buffer.
    unsafe { v.set_len(n) };
}

/// Faults in every page of a zeroed buffer, in parallel, leaving its contents unchanged:
/// for a buffer written at random slots later, by a sequential writer.
pub(crate) fn prefault<T: Word>(buffer: &mut [T]) {
    use rayon::prelude::*;
    const PAGE: usize = 4096;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    let pages = buffer.len().div_ceil(step);
    let slots = Slots::new(buffer);
    (0..pages).into_par_iter().with_min_len(512).for_each(|page| {
        // Write back what is there: a real store (an atomic store is never elided as dead),
        // so the page is faulted in now even where it holds zero.
        let i = page * step;
        slots.set(i, slots.get(i));
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
            slots.set_run(0, [5u32, 6].into_iter());
        }
        assert_eq!(&buffer[..2], &[5, 6]);
        let mut seen = buffer[2..].to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n - 2);
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
    fn prefault_keeps_contents() {
        let mut v: Vec<u64> = (0..if cfg!(miri) { 3_000 } else { 100_000 }).collect();
        prefault(&mut v);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
    }

    #[test]
    fn fill_zeros_fills_the_capacity() {
        let mut v: Vec<u64> = (0..if cfg!(miri) { 3_000 } else { 300_000 }).collect();
        v.truncate(10);
        fill_zeros(&mut v);
        assert_eq!(v.len(), 300_000);
        assert!(v.iter().all(|&x| x == 0));
    }
}
