//! The cpu device's caching allocator: freed blocks are reused, the user's
//! memory statistics do not see the cache, `Device::alloc` still returns
//! zeros, `Stream::alloc`'s unspecified contents are poisoned under the
//! sanitizer, and `empty_cache` and the limit bound what is kept.

use crate::common;

use anyhow::Result;
use chorus_devices::cpu::{CacheStats, CpuConfig, CpuDevice};
use chorus_devices::{Buffer, DType, Device, MemorySpace, MemoryStats, Scalar, Stream, StreamExt};

use common::{stream, TEST_TIMEOUT};

fn stats(in_use: usize, peak: usize, live: usize) -> MemoryStats {
    MemoryStats { bytes_in_use: in_use, peak_bytes: peak, live_allocations: live }
}

#[test]
fn a_freed_block_is_reused_and_device_alloc_still_returns_zeros() -> Result<()> {
    let dev = common::device();
    let s = stream(&dev)?;
    let a = dev.alloc(DType::F32, 1000)?;
    s.fill(a.view(), Scalar::Float(7.0))?;
    s.synchronize()?;
    drop(a);
    let c = dev.cache_stats(MemorySpace::Device);
    // 4000 bytes round up to the 4096-byte class, now cached.
    assert_eq!((c.reserved_bytes, c.cached_bytes, c.hits, c.misses), (4096, 4096, 0, 1));

    // The same class again: the cached block, zeroed as `Device::alloc` promises.
    let b = dev.alloc(DType::F32, 1010)?;
    let c = dev.cache_stats(MemorySpace::Device);
    assert_eq!((c.reserved_bytes, c.cached_bytes, c.hits, c.misses), (4096, 0, 1, 1));
    assert_eq!(s.read_vec::<f32>(b.view())?, vec![0.0; 1010]);
    // The user's counters see the bytes asked for, not the block.
    assert_eq!(dev.memory_stats(), stats(4040, 4040, 1));
    Ok(())
}

#[test]
fn a_block_is_reused_only_after_the_work_that_used_it_has_run() -> Result<()> {
    let dev = common::device();
    let s = stream(&dev)?;
    let gate = common::Gate::close(&s)?;
    let a = s.alloc(DType::F32, 256)?;
    s.fill(a.view(), Scalar::Float(3.0))?;
    let rb = s.copy_to_host(a.view())?;
    // The handle is gone but the queued work holds the memory: not reusable yet.
    drop(a);
    assert_eq!(dev.memory_stats().bytes_in_use, 0);
    let b = dev.alloc(DType::F32, 256)?;
    assert_eq!(dev.cache_stats(MemorySpace::Device).hits, 0);
    gate.open();
    assert_eq!(rb.wait_typed::<f32>()?, vec![3.0; 256]);
    s.synchronize()?;
    drop(b);
    let _c = dev.alloc(DType::F32, 256)?;
    assert_eq!(dev.cache_stats(MemorySpace::Device).hits, 1);
    Ok(())
}

#[test]
fn stream_alloc_under_the_sanitizer_reads_as_nan_not_as_stale_data() -> Result<()> {
    let dev = common::device();
    let s = stream(&dev)?;
    let a = s.alloc(DType::F32, 64)?;
    s.fill(a.view(), Scalar::Float(1.5))?;
    s.synchronize()?;
    drop(a);
    for dtype in [DType::F32, DType::BF16] {
        let b = s.alloc(dtype, 64)?;
        let host = s.copy_to_host(b.view())?.wait()?;
        assert!(host.iter().all(|&x| x == 0xFF), "{dtype}: {:?}", &host[..8]);
    }
    assert_eq!(s.read_vec::<f32>(s.alloc(DType::F32, 4)?.view())?.iter().filter(|x| x.is_nan()).count(), 4);
    Ok(())
}

#[test]
fn empty_cache_and_the_limit_bound_what_is_kept() -> Result<()> {
    let dev = CpuDevice::new(CpuConfig::default().with_timeout(TEST_TIMEOUT).with_cache_limit(8192));
    let bufs: Vec<_> = (0..3).map(|_| dev.alloc(DType::U8, 4096)).collect::<Result<_, _>>()?;
    let host = dev.alloc_host(DType::U8, 512, true)?;
    assert_eq!(dev.cache_stats(MemorySpace::Device).reserved_bytes, 3 * 4096);
    drop(bufs);
    // Two blocks fit under the limit, the third went back to the system.
    let c = dev.cache_stats(MemorySpace::Device);
    assert_eq!((c.reserved_bytes, c.cached_bytes, c.peak_reserved_bytes), (8192, 8192, 3 * 4096));
    drop(host);
    assert_eq!(dev.cache_stats(MemorySpace::Host).cached_bytes, 512);
    dev.empty_cache();
    for space in [MemorySpace::Device, MemorySpace::Host] {
        let c = dev.cache_stats(space);
        assert_eq!((c.reserved_bytes, c.cached_bytes), (0, 0), "{space:?}");
    }
    assert_eq!(dev.memory_stats(), stats(0, 3 * 4096, 0));

    // A limit of zero keeps nothing.
    let dev = CpuDevice::new(CpuConfig::default().with_timeout(TEST_TIMEOUT).with_cache_limit(0));
    drop(dev.alloc(DType::F64, 100)?);
    assert_eq!(
        dev.cache_stats(MemorySpace::Device),
        CacheStats { misses: 1, peak_reserved_bytes: 1024, peak_in_use_bytes: 1024, ..CacheStats::default() }
    );
    Ok(())
}
