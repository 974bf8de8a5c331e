//! Send and receive: a send's header (count and dtype) and data go to the
//! receiver, which compares the header with its own receive and answers
//! `ok` or the mismatch; the send waits for the answer.

use std::sync::Arc;

use super::exec::{missing, Exec, Prepared, Req};
use super::member::Core;
use super::region::{Region, Scratch};
use super::wire::Kind;
use crate::{CommError, Result};

/// A send's header as the receiver compares it.
fn p2p_header(c: &Prepared) -> String {
    format!("{} x {}", c.count, c.dtype)
}

/// A send of a group, posted before the group's other calls: its header
/// and data are on their way; [`finish_send`] waits for the receiver's answer.
pub(crate) struct PostedSend<'a> {
    reqs: Vec<Req<'a>>,
    ack: Arc<Scratch>,
    seq: u64,
    peer: usize,
}

pub(crate) fn post_send<'a>(core: &'a Core, c: &Prepared) -> Result<PostedSend<'a>> {
    let x = Exec::new(core, c.p2p_no, "send");
    let data = c.send.as_ref().ok_or_else(|| missing("send"))?;
    let ack = Scratch::new(1024);
    let reqs = vec![
        x.send(c.root, Kind::P2pHeader, Region::bytes(p2p_header(c).into_bytes()))?,
        x.send(c.root, Kind::P2pData, Region::user(data, 0, data.bytes())?)?,
        x.recv_upto(c.root, Kind::P2pAck, Region::scratch(&ack, 0, 1024)?)?,
    ];
    Ok(PostedSend { reqs, ack, seq: c.p2p_no, peer: c.root })
}

pub(crate) fn finish_send(core: &Core, p: PostedSend<'_>) -> Result<()> {
    let x = Exec::new(core, p.seq, "send");
    let lens = x.wait(p.reqs)?;
    let answer = Region::scratch(&p.ack, 0, lens[2].min(1024))?;
    // SAFETY: the answer's receive has completed (waited for above).
    let answer = String::from_utf8_lossy(unsafe { answer.as_slice() }).into_owned();
    if answer == "ok" {
        Ok(())
    } else {
        Err(CommError::Mismatch { seq: 0, details: format!("{answer} (send #{} to rank {})", p.seq, p.peer) })
    }
}

pub(crate) fn receive(core: &Core, c: &Prepared) -> Result<()> {
    let x = Exec::new(core, c.p2p_no, "recv");
    let buf = c.recv.as_ref().ok_or_else(|| missing("recv"))?;
    let header = Scratch::new(256);
    let lens = x.wait(vec![x.recv_upto(c.root, Kind::P2pHeader, Region::scratch(&header, 0, 256)?)?])?;
    let theirs = Region::scratch(&header, 0, lens[0].min(256))?;
    // SAFETY: the header's receive has completed (waited for above).
    let theirs = String::from_utf8_lossy(unsafe { theirs.as_slice() }).into_owned();
    let mine = p2p_header(c);
    if theirs != mine {
        let details = format!("rank {} sent {theirs} to rank {}, which posted a recv of {mine}", c.root, core.rank);
        x.wait(vec![x.send(c.root, Kind::P2pAck, Region::bytes(details.clone().into_bytes()))?])?;
        return Err(CommError::Mismatch { seq: 0, details });
    }
    x.wait(vec![x.recv(c.root, Kind::P2pData, Region::user(buf, 0, buf.bytes())?)?])?;
    x.wait(vec![x.send(c.root, Kind::P2pAck, Region::bytes(b"ok".to_vec()))?]).map(|_| ())
}
