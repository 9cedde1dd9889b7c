//! Large zeroed buffers backed by transparent huge pages where the OS allows it.
//!
//! Packing 10^7 sequences touches a few hundred MB of fresh output once; with 4 KiB pages
//! the page faults and their zeroing cost about as much as the packing itself.

/// `vec![0; n]` (lazily zeroed by the OS), advised to use huge pages when it is large.
pub(crate) fn zeroed<T: Copy + Default + Zeroable>(n: usize) -> Vec<T> {
    let v = T::zeroed_vec(n);
    advise_huge(v.as_ptr() as *const u8, std::mem::size_of_val(v.as_slice()));
    v
}

/// Types whose `vec![0; n]` comes from `calloc` (so nothing is touched up front).
pub(crate) trait Zeroable: Sized {
    fn zeroed_vec(n: usize) -> Vec<Self>;
}

macro_rules! zeroable {
    ($($t:ty),*) => {$(
        impl Zeroable for $t {
            fn zeroed_vec(n: usize) -> Vec<Self> { vec![0; n] }
        }
    )*};
}
zeroable!(u32, i32, i64, usize);

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
