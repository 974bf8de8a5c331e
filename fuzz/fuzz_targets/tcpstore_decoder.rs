//! The TCPStore request decoder on arbitrary bytes: it never panics, and it
//! decodes (to a request that re-encodes to the bytes it took), asks for
//! more bytes than it has, or rejects.
#![no_main]

use chorus_collectives::bootstrap::tcp::protocol::{decode_request, encode_request, Decoded, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let small = Limits { max_key_len: 8, max_value_len: 16, max_keys: 3, max_request_len: 64 };
    for limits in [Limits::default(), small] {
        match decode_request(data, &limits) {
            Decoded::Request { request, len } => {
                assert!(len <= data.len());
                let mut again = Vec::new();
                encode_request(&request, &mut again);
                assert_eq!(again, data[..len]);
            }
            Decoded::Incomplete { needed } => assert!(needed > data.len() && needed <= limits.max_request_len),
            Decoded::Invalid(_) => {}
        }
    }
});
