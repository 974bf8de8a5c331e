//! The Python of the tests checked against PyTorch, shared by every crate's
//! tests (`#[path = "../../ci/torch_python.rs"] mod torch_python;`).
//!
//! Those tests are `#[ignore = "needs PyTorch (ci/python-env.sh)"]`: a plain
//! `cargo test` reports them as ignored, and `ci/test.sh` runs them with
//! `--ignored` after `source ci/python-env.sh`, which makes the venv and sets
//! `CHORUS_PYTHON`. Run that way, a missing Python fails the test: it never
//! passes without having run.
#![allow(dead_code)] // each test file uses what it needs

use std::process::{Command, Stdio};

/// `$CHORUS_PYTHON`, once `import {modules}` works with it; panics, saying
/// what to do, when it is unset or cannot import them.
pub fn torch_python(modules: &str) -> String {
    let python = match std::env::var("CHORUS_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => panic!(
            "CHORUS_PYTHON is not set: this test needs PyTorch; run `source ci/python-env.sh` \
             (it makes the venv and sets CHORUS_PYTHON), then the test with --ignored"
        ),
    };
    let probe = Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match probe {
        Ok(o) if o.status.success() => python,
        Ok(o) => panic!(
            "CHORUS_PYTHON={python} cannot `import {modules}` ({}): {}; run `source ci/python-env.sh`",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("CHORUS_PYTHON={python} cannot be run: {e}; run `source ci/python-env.sh`"),
    }
}
