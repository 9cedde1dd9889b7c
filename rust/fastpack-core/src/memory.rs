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

/// Touches every page of a buffer's spare capacity (a [`with_capacity`] buffer the caller
/// will write whole), in parallel, so that its page faults (and the kernel's zeroing) are
/// paid by whichever threads are idle rather than later by a sequential writer.
pub(crate) fn prefault_unwritten<T: Zeroable + Send>(v: &mut Vec<T>) {
    let spare = v.spare_capacity_mut();
    touch_pages(SyncPtr(spare.as_mut_ptr() as *mut T), spare.len());
}

/// [`prefault_unwritten`] for a zeroed buffer: writes each page's first (zero) item again.
pub(crate) fn prefault_zeroed<T: Zeroable + Send>(v: &mut [T]) {
    touch_pages(SyncPtr(v.as_mut_ptr()), v.len());
}

/// Writes zero to the first item of every page of `len` items at `ptr`, in parallel.
fn touch_pages<T: Zeroable>(ptr: SyncPtr<T>, len: usize) {
    use rayon::prelude::*;
    let step = (PAGE / std::mem::size_of::<T>()).max(1);
    (0..len.div_ceil(step)).into_par_iter().with_min_len(512).for_each(|page| {
        // SAFETY: in bounds of the caller's buffer, which it holds mutably. Volatile: a
        // real store, so the page is faulted in now even where it already holds zero.
        unsafe { std::ptr::write_volatile(ptr.get().add(page * step), T::ZERO) };
    });
}

/// A raw pointer shared by threads that write disjoint items of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub(crate) *mut T);

// SAFETY: users write disjoint indices only, into buffers that outlive the parallel work.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
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
