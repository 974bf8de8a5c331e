//! What the UCX linked in (statically, by `ucx-rs`) does when the process
//! starts, undone or prevented where chorus's build does not need it.
//!
//! - **Memory hooks.** UCX's constructor patches libc's `mmap`, `munmap`,
//!   `mremap`, `madvise`, `brk`, `sbrk`, `shmat` and `shmdt` (UCM's "bistro"
//!   hooks, for the registration caches of RDMA and GPU memory), waiting a
//!   50 ms grace period in a `sched_yield` loop for each: 0.4 s of a core at
//!   every start of every process that links chorus with `ucx` (each
//!   `chorus` command, each rank under `chorus launch`), and a hook on every
//!   allocation after. chorus's UCX has neither RDMA nor GPU transports (TCP,
//!   shared memory, CMA), so an entry of `.init_array` that runs before
//!   UCX's constructor sets `UCX_MEM_MMAP_HOOK_MODE=none` unless the user
//!   set it.
//! - **SIGHUP.** UCX takes SIGHUP at start-up (`UCX_DEBUG_SIGNO`, SIGHUP by
//!   default): the signal then turns UCX's logging up instead of ending the
//!   process, and chorus, which leaves a program's own handler alone, saw a
//!   handler and never answered it, so a `chorus` built with `ucx` kept
//!   running on SIGHUP, its staged outputs and locks in place. Unless the
//!   user chose `UCX_DEBUG_SIGNO`, the signal goes back to the action UCX
//!   found (the default, or an ignore the process inherited) before chorus
//!   installs its own handlers.

use std::sync::Once;

extern "C" {
    /// UCX's `ucs/debug/debug.h`: the action `signum` had before UCX's
    /// handler, set again (UCX warns if it never took `signum`).
    fn ucs_debug_disable_signal(signum: libc::c_int);
}

/// Runs before UCX's constructor: entries of `.init_array.NNNNN` run in
/// priority order before the unnumbered ones, where C's
/// `__attribute__((constructor))` (UCX's `ucs_init`) puts its own.
/// Referenced from [`give_back_sighup`] (and so linked wherever the backend
/// is).
#[used]
#[link_section = ".init_array.00200"]
static MEMORY_HOOKS_OFF: extern "C" fn() = memory_hooks_off;

extern "C" fn memory_hooks_off() {
    const VAR: &std::ffi::CStr = c"UCX_MEM_MMAP_HOOK_MODE";
    // SAFETY: runs in the process's constructors, before `main` and before
    // any thread of the process exists, so nothing reads the environment
    // while it changes; both strings are NUL-terminated.
    unsafe {
        if libc::getenv(VAR.as_ptr()).is_null() {
            libc::setenv(VAR.as_ptr(), c"none".as_ptr(), 0);
        }
    }
}

/// Gives SIGHUP back (once per process) unless `UCX_DEBUG_SIGNO` is set.
pub(crate) fn give_back_sighup() {
    // Keeps the constructor above in every binary that uses the backend.
    std::hint::black_box(&MEMORY_HOOKS_OFF);
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_DEBUG_SIGNO").is_none() {
            // SAFETY: UCX's own API, taking its lock; with `UCX_DEBUG_SIGNO`
            // unset, UCX's start-up set the handler it restores here.
            unsafe { ucs_debug_disable_signal(libc::SIGHUP) }
        }
    });
}
