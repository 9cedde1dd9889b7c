//! Integer types accepted as sequence lengths, read in place (no conversion copy).

/// A sequence length as stored by the caller. `to_u64` is `None` for negative values.
pub trait Length: Copy + Send + Sync + 'static {
    fn to_u64(self) -> Option<u64>;
    /// The value as written, for error messages.
    fn to_i128(self) -> i128;
}

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl Length for $t {
            #[inline(always)]
            fn to_u64(self) -> Option<u64> { Some(self as u64) }
            #[inline(always)]
            fn to_i128(self) -> i128 { self as i128 }
        }
    )*};
}
macro_rules! signed {
    ($($t:ty),*) => {$(
        impl Length for $t {
            #[inline(always)]
            fn to_u64(self) -> Option<u64> { if self < 0 { None } else { Some(self as u64) } }
            #[inline(always)]
            fn to_i128(self) -> i128 { self as i128 }
        }
    )*};
}
unsigned!(u8, u16, u32, u64);
signed!(i8, i16, i32, i64);
