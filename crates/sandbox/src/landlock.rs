//! Landlock: the paths a kumo process may open (docs/security.md, "Sandbox").
//!
//! Applied by the main thread before it creates any thread, so every thread inherits it (the
//! host kernel's Landlock restricts the calling thread and what it creates later). The rules
//! are what the process was told to use at start, plus the operator's `--landlock-path`
//! additions for paths that arrive later through the API (snapshot targets, restores).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use landlock::{
    path_beneath_rules, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetError, RulesetStatus, ABI,
};

/// How a path may be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathAccess {
    /// Read files, list directories.
    Read,
    /// Everything: create, write, remove, make sockets.
    ReadWrite,
}

/// One path and what may be done beneath it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathRule {
    pub path: PathBuf,
    pub access: PathAccess,
}

impl PathRule {
    pub fn new(path: impl Into<PathBuf>, access: PathAccess) -> Self {
        PathRule { path: path.into(), access }
    }
}

impl FromStr for PathRule {
    type Err = String;
    /// `PATH:ro` or `PATH:rw` (`PATH` alone: read-only).
    fn from_str(s: &str) -> Result<Self, String> {
        let (path, access) = match s.rsplit_once(':') {
            Some((p, "rw")) => (p, PathAccess::ReadWrite),
            Some((p, "ro")) => (p, PathAccess::Read),
            _ => (s, PathAccess::Read),
        };
        if path.is_empty() {
            return Err(format!("{s:?}: expected PATH[:ro|:rw]"));
        }
        Ok(PathRule::new(path, access))
    }
}

/// What the host kernel enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforced {
    Fully,
    Partially,
    /// The kernel has no Landlock (or it is disabled): nothing is restricted.
    Not,
}

/// What every VMM needs besides its own files: KVM, taps, the host's topology and memory
/// facts (/sys, /proc), devices std and the log read (/dev/null, /dev/urandom).
pub fn system_rules() -> Vec<PathRule> {
    let rw = ["/dev/kvm", "/dev/net/tun", "/dev/null", "/dev/hugepages"];
    let ro = ["/sys", "/proc", "/dev/urandom", "/dev/random"];
    let mut v: Vec<_> = rw.iter().map(|p| PathRule::new(*p, PathAccess::ReadWrite)).collect();
    v.extend(ro.iter().map(|p| PathRule::new(*p, PathAccess::Read)));
    v
}

/// Restricts the calling thread, and every thread it creates from now on, to `rules` (paths
/// that do not exist are skipped). Where the kernel has no Landlock this says so and restricts
/// nothing.
pub fn restrict(rules: &[PathRule]) -> Result<Enforced, String> {
    let abi = ABI::V5;
    let fail = |e: RulesetError| format!("landlock: {e}");
    let by = |a: PathAccess| rules.iter().filter(move |r| r.access == a).map(|r| r.path.as_path());
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .map_err(fail)?
        .create()
        .map_err(fail)?
        .add_rules(path_beneath_rules(by(PathAccess::Read), AccessFs::from_read(abi)))
        .map_err(fail)?
        .add_rules(path_beneath_rules(by(PathAccess::ReadWrite), AccessFs::from_all(abi)))
        .map_err(fail)?
        .restrict_self()
        .map_err(fail)?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => Enforced::Fully,
        RulesetStatus::PartiallyEnforced => Enforced::Partially,
        RulesetStatus::NotEnforced => Enforced::Not,
    })
}

/// The directory a file is in, for rules on files that are created, replaced or removed
/// (sockets, logs): their directory must allow it.
pub fn parent_dir(p: &Path) -> PathBuf {
    let abs = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    abs.parent().map_or_else(|| PathBuf::from("/"), Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_with_their_access() {
        assert_eq!("/a/b:rw".parse::<PathRule>().unwrap(), PathRule::new("/a/b", PathAccess::ReadWrite));
        assert_eq!("/a/b:ro".parse::<PathRule>().unwrap(), PathRule::new("/a/b", PathAccess::Read));
        assert_eq!("/a/b".parse::<PathRule>().unwrap(), PathRule::new("/a/b", PathAccess::Read));
        assert!(":rw".parse::<PathRule>().is_err());
    }

    #[test]
    fn a_restricted_child_opens_only_what_it_was_given() {
        // Landlock stays on the thread that applied it: do it in a thread of its own.
        let dir = std::env::temp_dir().join(format!("kumo-landlock-{}", std::process::id()));
        let allowed = dir.join("allowed");
        let other = dir.join("other");
        std::fs::create_dir_all(&allowed).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("f"), b"x").unwrap();
        let (a, o) = (allowed.clone(), other.clone());
        let r = std::thread::spawn(move || {
            let e = restrict(&[PathRule::new(&a, PathAccess::ReadWrite)]).unwrap();
            (e, std::fs::write(a.join("f"), b"y").is_ok(), std::fs::read(o.join("f")).is_ok())
        })
        .join()
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        match r.0 {
            Enforced::Not => eprintln!("landlock: not in this kernel; nothing to check"),
            _ => assert_eq!((r.1, r.2), (true, false), "writes where allowed, reads nothing else"),
        }
    }
}
