//! The thread-per-lane runner: a launch runs the kernel once per thread of
//! every block, each an OS thread with its block and thread indices set, so
//! `__syncthreads` is a real barrier and the tiled matmul and the tree
//! reductions run as written.

use crate::host_build::HostKernels;

/// A launch's grid and block, `((x, y), (x, y))`.
pub type Launch = ((u32, u32), (u32, u32));

/// A grid-stride launch: 3 blocks of 4 threads.
pub const ELEMENTWISE: Launch = ((3, 1), (4, 1));
/// A reduction in one thread: the cpu device's left-to-right order.
pub const SEQUENTIAL: Launch = ((1, 1), (1, 1));
/// A reduction as a tree over 64 threads.
pub const TREE: Launch = ((1, 1), (64, 1));

type Dims = unsafe extern "C" fn(u32, u32, u32, u32);

impl HostKernels {
    /// Runs `body` (one kernel call) as every thread of every block of a launch.
    pub fn launch(&self, (grid, block): Launch, body: impl Fn() + Sync) {
        let _one = self.launch_lock.lock().unwrap_or_else(|p| p.into_inner());
        let dims: Dims = self.get("chorus_host_dims");
        let enter: Dims = self.get("chorus_host_enter");
        // SAFETY: plain setters of the prelude's statics.
        unsafe { dims(grid.0, grid.1, block.0, block.1) };
        for by in 0..grid.1 {
            for bx in 0..grid.0 {
                std::thread::scope(|s| {
                    for ty in 0..block.1 {
                        for tx in 0..block.0 {
                            let body = &body;
                            s.spawn(move || {
                                // SAFETY: sets this thread's indices.
                                unsafe { enter(bx, by, tx, ty) };
                                body();
                            });
                        }
                    }
                });
            }
        }
    }
}
