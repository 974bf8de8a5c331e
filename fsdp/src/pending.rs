//! Values FSDP computes on the device for the host (the gradient norm, a
//! mean over the ranks), read when the host wants them: each one's copy to
//! the host is enqueued behind the work that makes it, so reading it waits
//! for that work only and a loop that reads late never waits for the device.

use chorus_devices::Readback;

use crate::{FsdpError, Result};

/// How the host makes the value of the elements copied back.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Finish {
    /// √(a + b) of two f32 parts of a squared norm, summed in f64.
    Norm,
    /// One f32 sum over the ranks, divided by their number.
    Mean {
        /// Ranks summed over.
        world: usize,
    },
}

/// A value computed on the device on its way to the host
/// ([`Fsdp::clip_grad_norm_async`](crate::Fsdp::clip_grad_norm_async),
/// [`Fsdp::mean_over_ranks_async`](crate::Fsdp::mean_over_ranks_async)).
#[derive(Debug)]
#[must_use = "the value is read with `read`; drop it if it is not needed"]
pub struct PendingValue {
    copy: Readback,
    finish: Finish,
}

impl PendingValue {
    pub(crate) fn new(copy: Readback, finish: Finish) -> PendingValue {
        PendingValue { copy, finish }
    }

    /// Whether the value has reached the host (reading it will not block). Never blocks.
    pub fn is_ready(&self) -> bool {
        self.copy.is_ready()
    }

    /// The value; blocks until it has reached the host (or the stream's
    /// deadline passes, an error), and returns the stream's failure if the
    /// work that makes it failed.
    pub fn read(self) -> Result<f64> {
        let finish = self.finish;
        let v = self.copy.wait_typed::<f32>()?;
        match (finish, v.as_slice()) {
            (Finish::Norm, [a, b]) => Ok((*a as f64 + *b as f64).sqrt()),
            (Finish::Mean { world }, [sum]) => Ok(*sum as f64 / world as f64),
            (_, other) => {
                Err(FsdpError::InvalidArgument(format!("a pending value came back as {} elements", other.len())))
            }
        }
    }
}
