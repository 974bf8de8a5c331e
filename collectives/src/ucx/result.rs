//! UCX's status codes as chorus errors.

use ucx_rs::sys;

use crate::CommError;

/// `Ok` for `UCS_OK`, otherwise a [`CommError::Backend`] naming the call and
/// UCX's own message.
pub(crate) fn status_error(status: sys::ucs_status_t, call: &str) -> Result<(), CommError> {
    if status == sys::ucs_status_t_UCS_OK {
        Ok(())
    } else {
        Err(error(status, call))
    }
}

/// The error of a failed call or request.
pub(crate) fn error(status: sys::ucs_status_t, call: &str) -> CommError {
    CommError::Backend {
        library: "ucx",
        code: i64::from(status),
        message: format!("{call}: {}", ucx_rs::status_string(status)),
    }
}

/// A `*_nbx` call's result: completed in place (`Ok(None)`), a request to
/// wait for (`Ok(Some)`), or failed in place (`Err(status)`).
pub(crate) fn status_ptr(ptr: sys::ucs_status_ptr_t) -> Result<Option<sys::ucs_status_ptr_t>, sys::ucs_status_t> {
    ucx_rs::decode_status_ptr(ptr)
}
