//! PyTorch's TCPStore over TCP: the wire format ([`protocol`]), a client
//! ([`TcpStore`]) and a server ([`TcpStoreServer`]) that interoperate with
//! PyTorch's own (`torch.distributed.TCPStore`, torchrun's agent store).

mod client;
pub mod protocol;
mod server;

pub use client::{ClientOptions, TcpStore};
pub use server::{LogFn, ServerOptions, ServerStats, TcpStoreServer, ENTRY_OVERHEAD, UNVALIDATED_INPUT};
