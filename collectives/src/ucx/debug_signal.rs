//! SIGHUP given back by UCX. The UCX linked in (statically, by `ucx-rs`)
//! takes SIGHUP when the process starts (`UCX_DEBUG_SIGNO`, SIGHUP by
//! default): the signal then turns UCX's logging up instead of ending the
//! process, and chorus, which leaves a program's own handler alone, saw a
//! handler and never answered it, so a `chorus` built with `ucx` kept
//! running on SIGHUP, its staged outputs and locks in place. Unless the
//! user chose `UCX_DEBUG_SIGNO`, the signal goes back to the action UCX
//! found (the default, or an ignore the process inherited) before chorus
//! installs its own handlers.

use std::sync::Once;

extern "C" {
    /// UCX's `ucs/debug/debug.h`: the action `signum` had before UCX's
    /// handler, set again (UCX warns if it never took `signum`).
    fn ucs_debug_disable_signal(signum: libc::c_int);
}

/// Gives SIGHUP back (once per process) unless `UCX_DEBUG_SIGNO` is set.
pub(crate) fn give_back_sighup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_DEBUG_SIGNO").is_none() {
            // SAFETY: UCX's own API, taking its lock; with `UCX_DEBUG_SIGNO`
            // unset, UCX's start-up set the handler it restores here.
            unsafe { ucs_debug_disable_signal(libc::SIGHUP) }
        }
    });
}
