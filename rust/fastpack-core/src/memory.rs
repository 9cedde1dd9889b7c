//! Large zeroed buffers backed by transparent huge pages where the OS allows it.
//!
//! Packing 10^7 sequences touches a few hundred MB of fresh output once; with 4 KiB pages
//! the page faults and their zeroing cost about as much as the packing itself.

/// `vec![0; n]` (lazily zeroed by the OS), advised to use huge pages when it is large.
///
/// A buffer of 1 MiB or more is requested at no less than glibc's largest mmap threshold
/// (32 MiB) and truncated: it then always comes from a fresh mapping, whose pages cost
/// nothing until written, instead of from reused heap memory that `calloc` must clear
/// (a plan's `starts` is mostly never written). Only address space is spent.
pub(crate) fn zeroed<T: Copy + Default + Zeroable>(n: usize) -> Vec<T> {
    const MMAP_ALWAYS: usize = (32 << 20) + 4096;
    let size = std::mem::size_of::<T>();
    let bytes = n * size;
    let mut v = if (1 << 20..MMAP_ALWAYS).contains(&bytes) {
        T::zeroed_vec(MMAP_ALWAYS.div_ceil(size))
    } else {
        T::zeroed_vec(n)
    };
    v.truncate(n);
    advise_huge(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice()));
    v
}

/// An empty vector with room for `capacity` items, advised to use huge pages when large:
/// for arrays indexed at random (per-pack state), where 4 KiB pages cost a TLB miss per
/// access.
pub(crate) fn with_capacity<T>(capacity: usize) -> Vec<T> {
    let v = Vec::with_capacity(capacity);
    advise_huge(v.as_ptr() as *const u8, capacity * std::mem::size_of::<T>());
    v
}

/// Room for `n` items that the caller will write every one of before reading any (and
/// then declare with `set_len(n)`): unlike [`zeroed`], reused heap memory is not cleared
/// first. Advised to use huge pages when large.
pub(crate) fn unwritten<T>(n: usize) -> Vec<T> {
    with_capacity(n)
}

/// Touches every page of a buffer's spare capacity (see [`unwritten`]), in parallel, so that
/// its page faults (and the kernel's zeroing) are paid by whichever threads are idle rather
/// than later by a sequential writer.
pub(crate) fn prefault_unwritten<T: Zeroable + Send>(v: &mut Vec<T>) {
    use rayon::prelude::*;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    v.spare_capacity_mut().par_chunks_mut(step * 512).for_each(|chunk| {
        for item in chunk.iter_mut().step_by(step) {
            item.write(T::ZERO);
        }
    });
}

/// [`prefault_unwritten`] for a zeroed buffer: writes each page's first (zero) item again.
pub(crate) fn prefault_zeroed<T: Zeroable + Send>(v: &mut [T]) {
    use rayon::prelude::*;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    v.par_chunks_mut(step * 512).for_each(|chunk| {
        for item in chunk.iter_mut().step_by(step) {
            // SAFETY: a valid, aligned item. Volatile: a real store, so the page is faulted
            // in now rather than the write being dropped as a no-op.
            unsafe { std::ptr::write_volatile(item, T::ZERO) };
        }
    });
}

const PAGE: usize = 4096;

/// Types whose `vec![0; n]` comes from `calloc` (so nothing is touched up front).
pub(crate) trait Zeroable: Sized + Copy {
    const ZERO: Self;
    fn zeroed_vec(n: usize) -> Vec<Self>;
}

macro_rules! zeroable {
    ($($t:ty),*) => {$(
        impl Zeroable for $t {
            const ZERO: Self = 0;
            fn zeroed_vec(n: usize) -> Vec<Self> { vec![0; n] }
        }
    )*};
}
zeroable!(u32, u64, i32, i64, usize);

#[cfg(target_os = "linux")]
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

#[cfg(not(target_os = "linux"))]
fn advise_huge(_ptr: *const u8, _bytes: usize) {}
