//! What a subcommand ends with: an [`Outcome`] when it ran to the end, or a
//! [`UsageError`] (exit status 2) for arguments it refused.

/// A problem with the arguments that clap's parser cannot see (a world size
/// of 0, `--min-bytes` above `--max-bytes`): reported like clap's own errors,
/// with exit status 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A [`UsageError`] saying `msg`.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// What a subcommand reports when it ran to the end: whether everything it checked passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Everything passed.
    Passed,
    /// Something ran but failed (wrong values, failed cases); already reported.
    Failed,
}

/// Prints `text` on stdout, an error where it cannot be written: a closed
/// pipe (`chorus ... | head`) ends the output, not the program with a
/// panic as `print!` would (`main` turns a broken pipe into success).
pub fn print_out(text: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_fmt(text).and_then(|_| out.flush()).map_err(|e| anyhow::Error::new(e).context("writing to stdout"))
}
