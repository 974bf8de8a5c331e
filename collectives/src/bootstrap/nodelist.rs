//! Slurm's hostlist grammar (`SLURM_JOB_NODELIST`): `gpu[01-04,07],cpu3`
//! names gpu01, gpu02, gpu03, gpu04, gpu07 and cpu3.
//!
//! A list is comma-separated items; an item is literal text and bracket
//! groups, each group a comma-separated list of numbers and ranges `a-b`.
//! An item with several groups (`rack[1-2]-n[01-02]`) names every
//! combination, first group slowest. A range keeps the width of its lower
//! bound, so `[08-11]` gives 08, 09, 10, 11 and `[8-11]` gives 8, 9, 10, 11.

/// Why a node list does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node list {list:?}: {reason}")]
pub struct NodeListError {
    /// The list as given.
    pub list: String,
    /// What is wrong.
    pub reason: String,
}

/// More hosts than this in one list is taken as a mistake (Slurm's largest
/// machines have tens of thousands of nodes).
pub const MAX_HOSTS: usize = 1 << 20;

/// Every host of `list`, in order.
pub fn expand(list: &str) -> Result<Vec<String>, NodeListError> {
    let err = |reason: String| NodeListError { list: list.to_string(), reason };
    if list.trim().is_empty() {
        return Err(err("empty".into()));
    }
    let mut hosts = Vec::new();
    for item in split_top_level(list).map_err(err)? {
        let item = item.trim();
        if item.is_empty() {
            return Err(err("an empty host name between commas".into()));
        }
        expand_item(item, &mut hosts).map_err(err)?;
    }
    Ok(hosts)
}

/// The first host of `list` (where rank 0 of a Slurm job runs).
pub fn first_host(list: &str) -> Result<String, NodeListError> {
    let err = |reason: String| NodeListError { list: list.to_string(), reason };
    let items = split_top_level(list).map_err(err)?;
    let first = items.first().map(|s| s.trim()).filter(|s| !s.is_empty()).ok_or_else(|| err("empty".into()))?;
    let mut hosts = Vec::new();
    expand_item(first, &mut hosts).map_err(err)?;
    hosts.into_iter().next().ok_or_else(|| err("names no host".into()))
}

/// Splits at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("nested '[' at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("unmatched ']' at byte {i}")),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// One item's hosts: literal pieces and bracket groups, every combination.
fn expand_item(item: &str, hosts: &mut Vec<String>) -> Result<(), String> {
    let mut prefixes = vec![String::new()];
    let mut rest = item;
    while !rest.is_empty() {
        let (literal, after) = match rest.find('[') {
            Some(open) => (&rest[..open], Some(&rest[open + 1..])),
            None => (rest, None),
        };
        for p in &mut prefixes {
            p.push_str(literal);
        }
        let Some(after) = after else { break };
        let close = after.find(']').ok_or_else(|| format!("unclosed '[' in {item:?}"))?;
        let values = expand_group(&after[..close])?;
        if prefixes.len().saturating_mul(values.len()) > MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        prefixes = prefixes.iter().flat_map(|p| values.iter().map(move |v| format!("{p}{v}"))).collect();
        rest = &after[close + 1..];
    }
    if hosts.len().saturating_add(prefixes.len()) > MAX_HOSTS {
        return Err(format!("more than {MAX_HOSTS} hosts"));
    }
    hosts.extend(prefixes);
    Ok(())
}

/// The numbers of one bracket group, zero-padded to each range's lower bound.
fn expand_group(group: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in group.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let number = |s: &str| -> Result<u64, String> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{part:?} in [{group}] is not a number or a range"));
            }
            s.parse().map_err(|_| format!("{s:?} in [{group}] is too large"))
        };
        let (a, b) = (number(lo)?, number(hi)?);
        if a > b {
            return Err(format!("range {part:?} in [{group}] goes backwards"));
        }
        if (b - a) as usize >= MAX_HOSTS || out.len() + (b - a) as usize >= MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn brackets_expand_keeping_zero_padding() {
        assert_eq!(hosts("gpu[01-04,07],cpu3"), ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]);
        assert_eq!(hosts("n[08-11]"), ["n08", "n09", "n10", "n11"]);
        assert_eq!(hosts("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(hosts("node001"), ["node001"]);
        assert_eq!(hosts("a,b , c"), ["a", "b", "c"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(hosts("rack[1-2]-n[01-02]"), ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]);
        assert_eq!(hosts("x[3]y"), ["x3y"]);
        assert_eq!(first_host("gpu[01-04,07],cpu3").unwrap(), "gpu01");
        assert_eq!(first_host("login,gpu[1-2]").unwrap(), "login");
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_list() {
        for bad in [
            "",
            "gpu[01-04",
            "gpu01-04]",
            "gpu[04-01]",
            "gpu[a-b]",
            "gpu[1,,2]",
            "a,,b",
            "n[[1]]",
            "n[1-99999999999]",
            "n[-3]",
        ] {
            let e = expand(bad).expect_err(bad);
            assert_eq!(e.list, bad);
        }
        assert!(first_host("").is_err());
    }
}
