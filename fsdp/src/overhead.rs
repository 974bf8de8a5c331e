//! FSDP's host overhead: the time its hooks take on the caller's thread,
//! as wall time and as the thread's own CPU time. The two differ by the time
//! the thread did not run inside a hook — blocked on a lock or a wait, or
//! descheduled while other threads (other ranks, stream executors) had the
//! cores — so a report can tell FSDP's own work from waiting.

use std::time::{Duration, Instant};

/// An FSDP entry point whose host time is counted in [`HostOverhead`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    /// [`Fsdp::add_group`](crate::Fsdp::add_group) and [`Fsdp::add_group_with`](crate::Fsdp::add_group_with).
    AddGroup,
    /// [`Fsdp::unshard`](crate::Fsdp::unshard) (explicit or prefetch).
    Unshard,
    /// [`Fsdp::wait_unshard`](crate::Fsdp::wait_unshard).
    WaitUnshard,
    /// [`Fsdp::pre_forward`](crate::Fsdp::pre_forward).
    PreForward,
    /// [`Fsdp::post_forward`](crate::Fsdp::post_forward).
    PostForward,
    /// [`Fsdp::pre_backward`](crate::Fsdp::pre_backward).
    PreBackward,
    /// [`Fsdp::post_backward`](crate::Fsdp::post_backward).
    PostBackward,
    /// [`Fsdp::finalize_backward`](crate::Fsdp::finalize_backward).
    FinalizeBackward,
}

impl Hook {
    /// Every hook, in the order of a step.
    pub const ALL: [Hook; 8] = [
        Hook::AddGroup,
        Hook::Unshard,
        Hook::WaitUnshard,
        Hook::PreForward,
        Hook::PostForward,
        Hook::PreBackward,
        Hook::PostBackward,
        Hook::FinalizeBackward,
    ];

    /// The hook's name, as reports print it.
    pub fn name(self) -> &'static str {
        match self {
            Hook::AddGroup => "add_group",
            Hook::Unshard => "unshard",
            Hook::WaitUnshard => "wait_unshard",
            Hook::PreForward => "pre_forward",
            Hook::PostForward => "post_forward",
            Hook::PreBackward => "pre_backward",
            Hook::PostBackward => "post_backward",
            Hook::FinalizeBackward => "finalize_backward",
        }
    }
}

/// Host time in one hook: the sum over its calls, and how many.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HookTime {
    /// Total wall time.
    pub total: Duration,
    /// The calling thread's CPU time in the hook (`CLOCK_THREAD_CPUTIME_ID`;
    /// zero where the platform has no per-thread clock): FSDP's own work.
    /// `total - cpu` is time the thread waited or was descheduled.
    pub cpu: Duration,
    /// Number of calls.
    pub calls: usize,
}

/// Host time spent inside FSDP's hooks (they only enqueue, so this is
/// FSDP's overhead), in total and per hook, so a slow step can be traced
/// to the hook that took the time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostOverhead {
    /// Total wall time in hooks.
    pub total: Duration,
    /// The calling thread's CPU time in hooks (see [`HookTime::cpu`]).
    pub cpu: Duration,
    /// Number of hook calls.
    pub calls: usize,
    /// The same per hook, indexed as [`Hook::ALL`].
    pub by_hook: [HookTime; Hook::ALL.len()],
}

impl HostOverhead {
    /// The time spent since `earlier` (a reading of the same [`Fsdp`](crate::Fsdp)).
    pub fn since(&self, earlier: &HostOverhead) -> HostOverhead {
        let mut by_hook = self.by_hook;
        for (h, e) in by_hook.iter_mut().zip(&earlier.by_hook) {
            h.total = h.total.saturating_sub(e.total);
            h.cpu = h.cpu.saturating_sub(e.cpu);
            h.calls = h.calls.saturating_sub(e.calls);
        }
        HostOverhead {
            total: self.total.saturating_sub(earlier.total),
            cpu: self.cpu.saturating_sub(earlier.cpu),
            calls: self.calls.saturating_sub(earlier.calls),
            by_hook,
        }
    }

    /// The time in `hook`.
    pub fn hook(&self, hook: Hook) -> HookTime {
        self.by_hook[hook as usize]
    }

    /// Adds a hook call that started at `t0` and ends now.
    pub(crate) fn note(&mut self, hook: Hook, t0: HookStart) {
        let wall = t0.wall.elapsed();
        // A clock that cannot be read counts no CPU time rather than a wrong one.
        let cpu = match (t0.cpu, thread_cpu_time()) {
            (Some(a), Some(b)) => b.saturating_sub(a).min(wall),
            _ => Duration::ZERO,
        };
        self.total += wall;
        self.cpu += cpu;
        self.calls += 1;
        let h = &mut self.by_hook[hook as usize];
        h.total += wall;
        h.cpu += cpu;
        h.calls += 1;
    }
}

/// When a hook call started: wall clock and the thread's CPU clock.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HookStart {
    wall: Instant,
    cpu: Option<Duration>,
}

impl HookStart {
    pub(crate) fn now() -> HookStart {
        HookStart { cpu: thread_cpu_time(), wall: Instant::now() }
    }
}

/// The calling thread's CPU time so far, where the platform has the clock.
#[cfg(unix)]
pub(crate) fn thread_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32))
}

/// The calling thread's CPU time so far, where the platform has the clock.
#[cfg(not(unix))]
pub(crate) fn thread_cpu_time() -> Option<Duration> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_counts_work_and_not_sleep() {
        let mut o = HostOverhead::default();
        let t0 = HookStart::now();
        std::thread::sleep(Duration::from_millis(30));
        o.note(Hook::PreForward, t0);
        let slept = o.hook(Hook::PreForward);
        assert!(slept.total >= Duration::from_millis(30));
        assert!(slept.cpu < Duration::from_millis(15), "sleeping took {:?} of CPU", slept.cpu);

        let t0 = HookStart::now();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        o.note(Hook::PostBackward, t0);
        let busy = o.hook(Hook::PostBackward);
        // On a loaded machine the thread may be descheduled for part of the
        // spin, so only a little CPU time is certain, and never more than wall.
        if cfg!(unix) {
            assert!(busy.cpu > Duration::ZERO && busy.cpu <= busy.total, "{busy:?}");
        }
        assert_eq!(o.calls, 2);
        assert_eq!(o.cpu, slept.cpu + busy.cpu);
        assert_eq!(o.since(&o), HostOverhead::default());
    }
}
