//! The process's resident memory as the kernel counts it: what a run
//! reports beside FSDP's own count (every rank's device memory), so that
//! memory FSDP does not see — candle's tensors, loading buffers, what the
//! allocator keeps — shows as the difference.

/// The process's peak resident set size in bytes since it started
/// (`VmHWM` of `/proc/self/status`); `None` where the system has no such
/// file (not Linux) or it cannot be read.
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    resident_field(&status, "VmHWM:")
}

/// The process's resident set size now (`VmRSS`), as [`peak_resident_bytes`].
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    resident_field(&status, "VmRSS:")
}

/// The value of `field` (a line `VmHWM:   1234 kB`) in bytes.
fn resident_field(status: &str, field: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(field))?;
    let mut words = line[field.len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_in_bytes_and_odd_lines_refused() {
        let status = "Name:\tchorus\nVmHWM:\t  6600000 kB\nVmRSS:\t 12 kB\nVmSwap: 7 MB\n";
        assert_eq!(resident_field(status, "VmHWM:"), Some(6_600_000 * 1024));
        assert_eq!(resident_field(status, "VmRSS:"), Some(12 * 1024));
        assert_eq!(resident_field(status, "VmSwap:"), None, "a unit other than kB");
        assert_eq!(resident_field(status, "VmPeak:"), None, "an absent field");
    }

    /// One snapshot of the status file: the kernel reports `VmHWM` as at
    /// least that read's `VmRSS` (two reads race with other threads'
    /// allocations, as in an earlier form of this test).
    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_a_peak_at_least_its_current_size() {
        let status = std::fs::read_to_string("/proc/self/status").expect("Linux has /proc/self/status");
        let (Some(peak), Some(now)) = (resident_field(&status, "VmHWM:"), resident_field(&status, "VmRSS:")) else {
            panic!("no VmHWM or VmRSS in /proc/self/status: {status}");
        };
        assert!(peak >= now && now > 0, "peak {peak}, now {now}");
        assert!(peak_resident_bytes().is_some_and(|p| p >= peak), "the peak never falls");
    }
}
