//! The two states of a param group's state machine (FSDP2's
//! `TrainingState` and `ShardedState`): where the group is in the step,
//! and where its parameters are.

/// Where a group is in the training step (FSDP2's `TrainingState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainingState {
    /// Between hooks.
    Idle,
    /// Between pre-forward and post-forward.
    Forward,
    /// Between pre-backward and post-backward.
    PreBackward,
    /// After post-backward, until the root finalizes backward.
    PostBackward,
}

/// Where a group's parameters are (FSDP2's `ShardedState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardedState {
    /// Only the shards exist.
    Sharded,
    /// A copy sharded over the smaller post-forward world exists (reshard-after-forward = K).
    ShardedPostForward,
    /// The unsharded parameters exist.
    Unsharded,
}
