//! The `rccl` feature where RCCL is not installed (no distribution here
//! packages it): using the backend is a typed error that names the library
//! files tried and `CHORUS_RCCL_LIB`, never a panic or a link failure.
//!
//! The tests need RCCL to be absent, which a plain `cargo test` cannot
//! know: they are `#[ignore]`d (reported as not run), run by ci/test.sh with
//! `--include-ignored`, and fail where RCCL is installed.
#![cfg(feature = "rccl")]

use chorus_collectives::rccl;
use chorus_collectives::CommError;
use chorus_devices::DeviceError;

/// These tests show what a machine without RCCL reports: where RCCL is
/// installed they cannot, and fail rather than pass unchecked.
fn require_missing_rccl() {
    assert!(
        !rccl::is_available(),
        "RCCL is installed here ({:?}): the missing-library path cannot be shown; run these tests where RCCL is not \
         installed (ci/test.sh does)",
        rccl::library_path()
    );
}

fn expect_missing(e: CommError) -> String {
    match &e {
        CommError::Device(DeviceError::LibraryUnavailable {
            library: "librccl",
            tried,
            variable: "CHORUS_RCCL_LIB",
        }) => {
            assert!(tried.contains("librccl.so"), "{tried}");
            assert!(tried.contains("librccl.so.1"), "{tried}");
        }
        other => panic!("expected LibraryUnavailable for librccl, got {other:?}"),
    }
    let message = e.to_string();
    assert!(message.contains("librccl.so") && message.contains("CHORUS_RCCL_LIB"), "{message}");
    message
}

#[test]
#[ignore = "needs a machine without RCCL (ci/test.sh runs it with --include-ignored)"]
fn a_missing_rccl_is_a_typed_error_naming_the_library_and_the_variable() {
    require_missing_rccl();
    let message = expect_missing(rccl::version().unwrap_err());
    println!("as expected: {message}");
    expect_missing(rccl::unique_id().unwrap_err());
    assert!(!rccl::is_available());
}

/// Run by the test below in a child process whose `CHORUS_RCCL_LIB` points nowhere.
#[test]
#[ignore = "run by the_variable_is_tried_first, in a child process"]
fn child_reports_the_error() {
    println!("CHILD-ERROR: {}", rccl::version().unwrap_err());
}

#[test]
#[ignore = "needs a machine without RCCL (ci/test.sh runs it with --include-ignored)"]
fn the_variable_is_tried_first_and_reported_with_its_value() {
    require_missing_rccl();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_reports_the_error", "--ignored", "--nocapture"])
        .env("CHORUS_RCCL_LIB", "/nonexistent/librccl.so")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.starts_with("CHILD-ERROR: ")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("tried CHORUS_RCCL_LIB=/nonexistent/librccl.so ("), "{line}");
    assert!(line.contains("librccl.so, librccl.so.1"), "{line}");
}
