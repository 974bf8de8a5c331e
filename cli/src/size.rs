//! Byte sizes on the command line (`1K`, `16M`, `256M`, `1G`, or plain
//! bytes), and the check of the memory a command needs against what the
//! machine has.

/// Parses a byte size: a whole number with an optional binary suffix
/// `K`, `M`, `G` or `T` (powers of 1024, as nccl-tests reads them), in
/// either case, optionally followed by `B` or `iB` (`16MiB`, `1kb`).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower.strip_suffix("ib").or_else(|| lower.strip_suffix('b')).unwrap_or(&lower);
    let (digits, shift) = match body.chars().last() {
        Some('k') => (&body[..body.len() - 1], 10),
        Some('m') => (&body[..body.len() - 1], 20),
        Some('g') => (&body[..body.len() - 1], 30),
        Some('t') => (&body[..body.len() - 1], 40),
        _ => (body, 0),
    };
    let bad = || format!("`{text}` is not a byte size (examples: 1024, 1K, 16M, 256M, 1G)");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("`{text}` is too large"))
}

/// Parses a byte size of at least one byte (for `--min-bytes`/`--max-bytes`).
pub fn parse_nonzero_bytes(text: &str) -> Result<u64, String> {
    match parse_bytes(text)? {
        0 => Err("the size must be at least 1 byte".into()),
        n => Ok(n),
    }
}

/// `1024` → `1K`, `3 << 20` → `3M`; other values in bytes.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, suffix) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// Bytes of memory available to a new program (Linux's `MemAvailable`), if known.
pub fn available_memory() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses, before anything is allocated, a command (`what`) that needs
/// more than nine tenths of the memory available; `hint` says what to make
/// smaller. Where the available memory is unknown, nothing is refused.
pub fn check_memory(needed: u128, what: &str, hint: &str) -> Result<(), String> {
    check_memory_against(needed, available_memory(), what, hint)
}

/// [`check_memory`] against `available` bytes (`None`: unknown, nothing refused).
pub fn check_memory_against(needed: u128, available: Option<u128>, what: &str, hint: &str) -> Result<(), String> {
    let Some(available) = available else { return Ok(()) };
    if needed <= available / 10 * 9 {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / (1u128 << 30) as f64;
    let need = match gib(needed) {
        g if g < 1e6 => format!("about {g:.1} GiB"),
        _ => "more than a million GiB".to_string(),
    };
    Err(format!("{what} needs {need} of memory; {:.1} GiB are available ({hint})", gib(available)))
}

/// The address space this process has mapped now (`/proc/self/status`).
pub fn mapped_now() -> u128 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmSize:")).and_then(|v| v.trim().strip_suffix("kB"));
    kb.and_then(|k| k.trim().parse::<u128>().ok()).map_or(0, |k| k << 10)
}

/// A resource limit's soft value, `None` where unlimited.
pub fn soft_limit(resource: libc::__rlimit_resource_t) -> Option<u128> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the limit into `limit`, which lives for the call.
    let got = unsafe { libc::getrlimit(resource, &mut limit) };
    (got == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur as u128)
}

/// Refuses work that needs `more` bytes of address space beyond what this
/// process has mapped now where the address-space limit (`ulimit -v`)
/// cannot hold them: an allocation that fails aborts the process (Rust's
/// allocation failure), so it is found before the work starts.
pub fn check_address_space(more: u128, what: &str) -> Result<(), String> {
    let Some(limit) = soft_limit(libc::RLIMIT_AS) else { return Ok(()) };
    let now = mapped_now();
    if now.saturating_add(more) <= limit {
        return Ok(());
    }
    let mib = |b: u128| b >> 20;
    Err(format!(
        "{what} needs about {} MiB of address space beyond the {} MiB mapped now; this process may map {} MiB \
         (ulimit -v {}): raise the limit",
        mib(more),
        mib(now),
        mib(limit),
        limit >> 10
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_binary_and_case_insensitive() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("1K"), Ok(1024));
        assert_eq!(parse_bytes("16m"), Ok(16 << 20));
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert_eq!(parse_bytes("16MiB"), Ok(16 << 20));
        assert_eq!(parse_bytes("4kb"), Ok(4096));
        assert_eq!(parse_bytes(" 8 "), Ok(8));
    }

    #[test]
    fn junk_is_refused_with_a_message() {
        for bad in ["", "K", "1.5M", "-1", "12Q", "M16", "1KK"] {
            let e = parse_bytes(bad).unwrap_err();
            assert!(e.contains("byte size"), "{bad}: {e}");
        }
        assert!(parse_bytes("99999999999T").unwrap_err().contains("too large"));
        assert!(parse_nonzero_bytes("0").is_err());
    }

    #[test]
    fn formatting_round_trips() {
        for b in [1, 1000, 1024, 3 << 20, 1 << 30, 5 << 40] {
            assert_eq!(parse_bytes(&format_bytes(b)), Ok(b));
        }
        assert_eq!(format_bytes(16 << 20), "16M");
    }
}
