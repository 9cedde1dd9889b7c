//! The core's one error type. Every message names the argument, the bad value and what
//! would be accepted, so the Python layer can pass it through unchanged.

/// Why a plan could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument is out of its accepted range.
    #[error("{arg}: {message}")]
    InvalidArgument { arg: &'static str, message: String },
    /// Sequences longer than the cap under `overlong="error"`.
    #[error(
        "lengths: {count} sequence(s) longer than {cap} tokens{reserve_note} (first at index {first_index}, \
         length {first_length}); pass overlong=\"truncate\", \"split\" or \"drop\", or raise the cap"
    )]
    Overlong { count: u64, first_index: u64, first_length: u64, cap: u64, reserve_note: String },
    /// A size that does not fit the plan's integer types.
    #[error("{arg}: {message}")]
    Overflow { arg: &'static str, message: String },
    /// A large allocation failed: the process lives on (Python raises `MemoryError`).
    #[error("out of memory: could not allocate {bytes} bytes for {what}")]
    OutOfMemory { what: &'static str, bytes: u64 },
}

impl Error {
    pub(crate) fn invalid(arg: &'static str, message: impl Into<String>) -> Self {
        Error::InvalidArgument { arg, message: message.into() }
    }
    pub(crate) fn overflow(arg: &'static str, message: impl Into<String>) -> Self {
        Error::Overflow { arg, message: message.into() }
    }
    pub(crate) fn out_of_memory(what: &'static str, bytes: impl TryInto<u64>) -> Self {
        Error::OutOfMemory { what, bytes: bytes.try_into().unwrap_or(u64::MAX) }
    }
    /// The input differs between two passes over it: another thread wrote to it.
    pub(crate) fn input_changed(arg: &'static str) -> Self {
        Error::invalid(
            arg,
            "the array changed while fastpack read it (another thread wrote to it); pass an \
             array nothing writes to during the call",
        )
    }
}

pub type Result<T> = std::result::Result<T, Error>;
