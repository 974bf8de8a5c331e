//! What goes on the wire: the 64-bit tags of UCP's tag matching and the
//! few small messages the backend exchanges besides the data.
//!
//! A tag is `kind (3 bits) | communicator id (16) | sequence number (29) |
//! sender's world rank (16)`. A receive names all of it (mask all ones), so
//! a message can only land in the call, communicator and step it was sent
//! for; messages with equal tags from one sender are matched in the order
//! they were sent (UCP's ordering), which is how the steps of one
//! collective are told apart. Control messages are received with a mask on
//! the kind alone.

use crate::CommError;

/// What a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub(crate) enum Kind {
    /// A step of a collective's data.
    Data = 0,
    /// A collective's opening message to the next rank: its fingerprint.
    Hello = 1,
    /// A send's header: dtype and count.
    P2pHeader = 2,
    /// A send's data.
    P2pData = 3,
    /// The receiver's answer to a send: `ok` or the mismatch.
    P2pAck = 4,
    /// An abort (or a failure) reported to every rank of the job.
    Control = 5,
}

const KIND_SHIFT: u32 = 61;
const COMM_SHIFT: u32 = 45;
const SEQ_SHIFT: u32 = 16;
const SEQ_MASK: u64 = (1 << 29) - 1;

/// The largest world (ranks are 16 bits of the tag).
pub(crate) const MAX_RANKS: usize = 1 << 16;
/// Communicator ids per job (16 bits of the tag).
pub(crate) const MAX_COMMS: u64 = 1 << 16;

/// The tag of a message of `kind` on communicator `comm`, call `seq`, from world rank `src`.
pub(crate) fn tag(kind: Kind, comm: u16, seq: u64, src: usize) -> u64 {
    ((kind as u64) << KIND_SHIFT)
        | (u64::from(comm) << COMM_SHIFT)
        | ((seq & SEQ_MASK) << SEQ_SHIFT)
        | (src as u64 & 0xffff)
}

/// The tag and mask that match every control message.
pub(crate) fn control_match() -> (u64, u64) {
    ((Kind::Control as u64) << KIND_SHIFT, 0b111 << KIND_SHIFT)
}

/// An error as a control message: every rank that receives it fails its
/// pending and later calls with the same kind of error.
pub(crate) fn encode_failure(from: usize, e: &CommError) -> Vec<u8> {
    let (code, seq, text) = match e {
        CommError::Mismatch { seq, details } => (b'M', *seq, details.clone()),
        CommError::Timeout { op, seq, waited, .. } => (b'T', *seq, format!("{op} timed out after {waited:?}")),
        CommError::Aborted { reason } => (b'A', 0, reason.clone()),
        other => (b'A', 0, format!("rank {from} failed: {other}")),
    };
    let mut out = Vec::with_capacity(16 + text.len());
    out.push(code);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(from as u32).to_le_bytes());
    let text = text.as_bytes();
    out.extend_from_slice(&text[..text.len().min(super::engine::CONTROL_BYTES - 16)]);
    out
}

/// The notice of a rank that has finished and is about to close its
/// endpoints (the failure header with code `L`, no text).
pub(crate) fn encode_leaving(from: usize) -> Vec<u8> {
    let mut out = vec![b'L'];
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&(from as u32).to_le_bytes());
    out
}

/// What a control message says.
#[derive(Debug)]
pub(crate) enum Control {
    /// The job failed with this error.
    Failure(CommError),
    /// This world rank has finished and is leaving.
    Leaving(usize),
}

/// A control message, read.
pub(crate) fn decode_control(bytes: &[u8], timeout: std::time::Duration) -> Control {
    if bytes.len() >= 13 && bytes[0] == b'L' {
        let mut from = [0u8; 4];
        from.copy_from_slice(&bytes[9..13]);
        return Control::Leaving(u32::from_le_bytes(from) as usize);
    }
    Control::Failure(decode_failure(bytes, timeout))
}

/// The error a control message carries, as this rank reports it.
pub(crate) fn decode_failure(bytes: &[u8], timeout: std::time::Duration) -> CommError {
    if bytes.len() < 13 {
        return CommError::Aborted { reason: format!("a peer reported a failure: {}", String::from_utf8_lossy(bytes)) };
    }
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&bytes[1..9]);
    let seq = u64::from_le_bytes(seq);
    let mut from = [0u8; 4];
    from.copy_from_slice(&bytes[9..13]);
    let from = u32::from_le_bytes(from);
    let text = String::from_utf8_lossy(&bytes[13..]).into_owned();
    match bytes[0] {
        b'M' => CommError::Mismatch { seq, details: text },
        b'T' => CommError::Timeout {
            op: format!("(reported by world rank {from}) {text}"),
            seq,
            waited: timeout,
            missing: vec![],
        },
        _ => CommError::Aborted { reason: text },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tags_keep_their_fields_apart() {
        let t = tag(Kind::P2pAck, 0xffff, (1 << 29) + 5, 0xffff);
        assert_eq!(t >> KIND_SHIFT, Kind::P2pAck as u64);
        assert_eq!((t >> COMM_SHIFT) & 0xffff, 0xffff);
        assert_eq!((t >> SEQ_SHIFT) & SEQ_MASK, 5);
        assert_eq!(t & 0xffff, 0xffff);
        let (ctag, cmask) = control_match();
        assert_eq!(tag(Kind::Control, 7, 9, 3) & cmask, ctag);
        assert_ne!(tag(Kind::Data, 7, 9, 3) & cmask, ctag);
    }

    #[test]
    fn failures_survive_the_wire() {
        let m = CommError::Mismatch { seq: 42, details: "rank 0 called a; rank 1 called b".into() };
        match decode_failure(&encode_failure(3, &m), Duration::from_secs(1)) {
            CommError::Mismatch { seq: 42, details } => assert!(details.contains("rank 0 called a")),
            other => panic!("{other:?}"),
        }
        let t = CommError::Timeout { op: "all_reduce".into(), seq: 7, waited: Duration::from_secs(2), missing: vec![] };
        assert!(matches!(
            decode_failure(&encode_failure(1, &t), Duration::from_secs(2)),
            CommError::Timeout { seq: 7, .. }
        ));
        let a = CommError::Aborted { reason: "rank 0 called abort".into() };
        assert!(matches!(decode_failure(&encode_failure(0, &a), Duration::ZERO), CommError::Aborted { .. }));
        assert!(matches!(decode_control(&encode_leaving(70_000), Duration::ZERO), Control::Leaving(70_000)));
        assert!(matches!(decode_control(&encode_failure(2, &a), Duration::ZERO), Control::Failure(_)));
        assert!(matches!(decode_failure(b"x", Duration::ZERO), CommError::Aborted { .. }));
    }
}
