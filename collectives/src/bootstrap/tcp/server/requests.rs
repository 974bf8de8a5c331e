//! The server's requests: each decoded from a connection's input, applied
//! to the stored state within the budget, and answered.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use super::super::protocol::{
    decode_request, put_bytes, Decoded, Request, CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC,
    WAIT_CANCELED,
};
use super::budget::{extend_to, grown_capacity, wait_cost};
use super::connections::{refused_first_byte, EventLoop};
use super::options::KEEP_BUFFER;
use crate::bootstrap::store::{add_outcome, compare_set_outcome, parse_counter};

impl EventLoop {
    pub(super) fn process_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.process(id);
        }
    }

    /// Decodes and answers the whole requests in a connection's input.
    pub(super) fn process(&mut self, id: u64) {
        let mut consumed = 0;
        loop {
            let Some(conn) = self.conns.get_mut(&id) else { return };
            if !conn.wants_requests() || conn.input.len() < consumed + conn.needed {
                break;
            }
            if !conn.validated {
                if let Some(reason) = refused_first_byte(conn.input[consumed]) {
                    conn.close = Some(reason);
                    break;
                }
            }
            match decode_request(&conn.input[consumed..], &self.options.limits) {
                Decoded::Incomplete { needed } => {
                    conn.needed = needed;
                    break;
                }
                Decoded::Invalid(e) => {
                    conn.close = Some(format!("malformed request: {e}"));
                    break;
                }
                Decoded::Request { request, len } => {
                    consumed += len;
                    conn.needed = 1;
                    self.stats.requests.fetch_add(1, Ordering::Relaxed);
                    let mut woken = Vec::new();
                    match self.handle(id, request, &mut woken) {
                        Ok(bytes) => self.answer(id, &bytes),
                        Err(reason) => {
                            if let Some(conn) = self.conns.get_mut(&id) {
                                conn.close.get_or_insert(reason);
                            }
                        }
                    }
                    for w in woken {
                        self.answer(w, &[STOP_WAITING]);
                    }
                }
            }
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.input.drain(..consumed.min(conn.input.len()));
            if conn.input.is_empty() && conn.input.capacity() > KEEP_BUFFER {
                conn.input = Vec::new();
            }
        }
        self.sync(id);
    }

    /// Queues `bytes` to connection `id`, within the budget (or cuts it).
    pub(super) fn answer(&mut self, id: u64, bytes: &[u8]) {
        let Some(conn) = self.conns.get(&id) else { return };
        if bytes.is_empty() || conn.close.is_some() {
            return;
        }
        let target = grown_capacity(&conn.output, bytes.len(), usize::MAX);
        let extra = target - conn.output.capacity();
        if let Err(reason) = self.make_room(id, extra) {
            self.cut(id, reason);
            return;
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            extend_to(&mut conn.output, target, bytes);
        }
        self.sync(id);
    }

    /// Stores `value` under `key` for connection `id`, within the budget.
    pub(super) fn put(&mut self, id: u64, key: &[u8], value: Vec<u8>) -> std::result::Result<(), String> {
        self.make_room(id, self.state.put_cost(key, &value))?;
        self.state.put(key, value);
        Ok(())
    }

    /// Applies one request; the answer's bytes, or why the connection must close.
    pub(super) fn handle(
        &mut self,
        id: u64,
        request: Request,
        woken: &mut Vec<u64>,
    ) -> std::result::Result<Vec<u8>, String> {
        let Some(conn) = self.conns.get_mut(&id) else { return Ok(Vec::new()) };
        if !conn.validated {
            return match request {
                Request::Validate { magic } if magic == VALIDATION_MAGIC => {
                    conn.validated = true;
                    Ok(Vec::new())
                }
                Request::Validate { magic } => {
                    Err(format!("bad validation number {magic:#x} (expected {VALIDATION_MAGIC:#x})"))
                }
                other => Err(format!("the first request must be VALIDATE, not {}", other.query_type().name())),
            };
        }
        let max_answer = self.options.limits.max_request_len;
        let mut out = Vec::new();
        match request {
            Request::Validate { .. } => return Err("VALIDATE sent twice".into()),
            Request::Ping { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Request::Set { key, value } => {
                self.put(id, &key, value)?;
                self.state.wake_all(&key, woken);
            }
            Request::CompareSet { key, expected, desired } => {
                let current = self.state.data.get(&key).map(Vec::as_slice);
                let (store, answer) = compare_set_outcome(current, &expected, &desired);
                if let Some(v) = store {
                    self.put(id, &key, v)?;
                    // PyTorch's server also wakes waiters when nothing was stored;
                    // waking only on a stored value keeps "woken" meaning "set".
                    self.state.wake_all(&key, woken);
                }
                put_bytes(&mut out, &answer);
            }
            Request::Get { key } => put_bytes(&mut out, self.state.data.get(&key).map_or(&[][..], Vec::as_slice)),
            Request::Add { key, delta } => {
                // PyTorch's server closes the connection here too (std::stoll throws).
                let sum = add_outcome(self.state.data.get(&key).map(Vec::as_slice), delta)
                    .map_err(|e| format!("add {}: {e}", String::from_utf8_lossy(&key)))?;
                self.put(id, &key, sum.to_string().into_bytes())?;
                self.state.wake_all(&key, woken);
                out.extend_from_slice(&sum.to_le_bytes());
            }
            Request::Check { keys } => {
                let ready = keys.iter().all(|k| self.state.present(k));
                out.push(if ready { CHECK_READY } else { CHECK_NOT_READY })
            }
            Request::Wait { keys } => {
                let missing: Vec<Vec<u8>> = keys.into_iter().filter(|k| !self.state.present(k)).collect();
                if missing.is_empty() {
                    out.push(STOP_WAITING);
                } else {
                    self.make_room(id, wait_cost(&missing))?;
                    self.state.register_wait(id, missing);
                }
            }
            Request::GetNumKeys => out.extend_from_slice(&(self.state.data.len() as i64).to_le_bytes()),
            Request::DeleteKey { key } => out.extend_from_slice(&i64::from(self.state.remove(&key)).to_le_bytes()),
            Request::Append { key, value } => {
                self.make_room(id, self.state.append_cost(&key, value.len()))?;
                self.state.append(&key, &value);
                self.state.wake_all(&key, woken);
            }
            Request::MultiGet { keys } => {
                for k in &keys {
                    put_bytes(&mut out, self.state.data.get(k).map_or(&[][..], Vec::as_slice));
                    if out.len() > max_answer {
                        return Err(format!("multi_get answer over {max_answer} bytes"));
                    }
                }
            }
            Request::MultiSet { entries } => {
                for (k, v) in entries {
                    self.put(id, &k, v)?;
                    self.state.wake_all(&k, woken);
                }
            }
            Request::CancelWait => {
                self.state.clear_wait(id);
                out.push(WAIT_CANCELED);
            }
            Request::QueuePush { key, value } => {
                self.make_room(id, self.state.push_cost(&key, &value))?;
                self.state.push(&key, value);
                self.state.wake_one(&key, woken);
            }
            Request::QueuePop { key } => {
                let (len, value) = self.state.pop(&key);
                out.extend_from_slice(&(len as i64).to_le_bytes());
                if let Some(v) = value {
                    put_bytes(&mut out, &v);
                }
            }
            Request::QueueLen { key } => {
                out.extend_from_slice(&(self.state.queues.get(&key).map_or(0, VecDeque::len) as i64).to_le_bytes())
            }
            Request::ListKeys => {
                out.extend_from_slice(&(self.state.data.len() as i64).to_le_bytes());
                for k in self.state.data.keys() {
                    put_bytes(&mut out, k);
                    if out.len() > max_answer {
                        return Err(format!("list_keys answer over {max_answer} bytes"));
                    }
                }
            }
            Request::Barrier { key, world_size } => {
                let arrived = match self.state.data.get(&key) {
                    None => 1,
                    Some(v) => parse_counter(v).and_then(|n| n.checked_add(1)).ok_or_else(|| {
                        format!("barrier {}: the counter is not an integer", String::from_utf8_lossy(&key))
                    })?,
                };
                self.put(id, &key, arrived.to_string().into_bytes())?;
                if arrived >= world_size {
                    self.state.wake_all(&key, woken);
                    out.push(STOP_WAITING);
                } else {
                    let keys = vec![key];
                    self.make_room(id, wait_cost(&keys))?;
                    self.state.register_wait(id, keys);
                }
            }
        }
        self.note();
        Ok(out)
    }
}
