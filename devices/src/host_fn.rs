//! The host-function rule, made checkable: no device API call from inside a
//! host function.
//!
//! CUDA runs a host function (`cuLaunchHostFunc`) on a driver thread in
//! stream order and forbids any CUDA call inside it (the driver answers
//! `CUDA_ERROR_NOT_PERMITTED`, or deadlocks); HIP has the same rule. A call
//! reached indirectly — a drop of a handle, a failure check that polls a
//! communicator — is just as forbidden. So every device marks the thread
//! while a host function (and everything it drops) runs, and every device API
//! entry point checks the mark first and refuses with
//! [`DeviceError::InHostFunction`] naming the operation: the cpu device the
//! same way as the GPU devices, so the rule is enforced in CI without a GPU.
//! On the cpu device every job an executor runs counts as a host function.
//!
//! Vendor libraries built on a device (NCCL, RCCL) call [`check`] before
//! their own calls, since those call the driver too.

use std::cell::Cell;

use crate::{DeviceError, Result};

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Marks the current thread as running a host function until dropped.
/// Nestable. Devices create it around each host function they run.
#[derive(Debug)]
pub struct HostFnScope {
    // Not Send: the mark belongs to this thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl HostFnScope {
    /// Enters a host function on this thread.
    pub fn enter() -> HostFnScope {
        DEPTH.with(|d| d.set(d.get().saturating_add(1)));
        HostFnScope { _not_send: std::marker::PhantomData }
    }
}

impl Drop for HostFnScope {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    }
}

/// Whether the current thread is inside a host function.
pub fn in_host_fn() -> bool {
    DEPTH.with(|d| d.get() > 0)
}

/// `Ok` outside host functions; inside one, [`DeviceError::InHostFunction`] for `op`.
pub fn check(op: &str) -> Result<()> {
    if in_host_fn() {
        return Err(DeviceError::InHostFunction { op: op.to_string() });
    }
    Ok(())
}

/// Runs `f` as a host function: with the thread marked, and with a panic
/// caught (it must not unwind into a driver thread; its message is
/// returned). Everything `f` drops is dropped inside the mark.
pub(crate) fn run<R>(f: impl FnOnce() -> R) -> std::result::Result<R, String> {
    let _scope = HostFnScope::enter();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_nests_and_ends_with_its_scope() {
        assert!(check("x").is_ok());
        {
            let _a = HostFnScope::enter();
            {
                let _b = HostFnScope::enter();
                assert!(in_host_fn());
            }
            let e = check("cuStreamQuery").unwrap_err();
            assert!(matches!(e, DeviceError::InHostFunction { ref op } if op == "cuStreamQuery"), "{e}");
        }
        assert!(!in_host_fn());
    }

    #[test]
    fn run_marks_the_closure_and_what_it_drops() {
        struct Probe(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Probe {
            fn drop(&mut self) {
                self.0.store(in_host_fn(), std::sync::atomic::Ordering::SeqCst);
            }
        }
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = Probe(seen.clone());
        assert!(run(move || drop(probe)).is_ok());
        assert!(seen.load(std::sync::atomic::Ordering::SeqCst));
        assert!(!in_host_fn());
        assert_eq!(run(|| panic!("boom")).unwrap_err(), "boom", "a panic is caught");
        assert!(!in_host_fn(), "the mark ends after a panic too");
    }
}
