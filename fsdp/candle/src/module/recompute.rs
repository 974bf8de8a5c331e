//! [`Recompute`]: which groups of an [`FsdpModel`](super::FsdpModel) recompute their
//! stages in backward, as the command line and `config.toml` write it.

/// Which groups recompute their stages in backward (activation
/// checkpointing) and which keep their forward graphs (FSDP2 recomputes
/// only the blocks the user wraps in checkpointing). Written `true`, `false`
/// or a comma-separated list of the groups that recompute (`blocks.0,blocks.1`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every group recomputes (the least memory).
    #[default]
    All,
    /// No group recomputes (the least compute).
    Nothing,
    /// The named groups recompute; the others keep their graphs.
    Groups(Vec<String>),
}

impl Recompute {
    /// Whether the group named `group` recomputes.
    pub fn applies_to(&self, group: &str) -> bool {
        match self {
            Recompute::All => true,
            Recompute::Nothing => false,
            Recompute::Groups(names) => names.iter().any(|n| n == group),
        }
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "true" => Ok(Recompute::All),
            "false" => Ok(Recompute::Nothing),
            list => {
                let names: Vec<String> = list.split(',').map(|n| n.trim().to_string()).collect();
                if names.iter().any(|n| n.is_empty()) {
                    return Err(format!("`{list}`: expected true, false or a comma-separated list of group names"));
                }
                Ok(Recompute::Groups(names))
            }
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::All => f.write_str("true"),
            Recompute::Nothing => f.write_str("false"),
            Recompute::Groups(names) => f.write_str(&names.join(",")),
        }
    }
}
