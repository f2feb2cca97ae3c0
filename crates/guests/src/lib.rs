//! kumo-guests: kumo's own freestanding guest programs, built from `guests/` by build.rs with the
//! host gcc, and their manifests (name, summary, parameters) read from each ELF's
//! `.kumo_manifest` section, so the C source is the one place a guest's parameters are declared.

mod elf;
mod manifest;
pub mod memtouch;
pub mod net;
pub mod numa;
pub mod numabench;
pub mod sync;
pub mod worker;

pub use manifest::{Manifest, Param, ParamKind};

include!(concat!(env!("OUT_DIR"), "/built.rs"));

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GuestError {
    #[error("unknown guest `{0}`; built guests: {1}")]
    Unknown(String, String),
    #[error("guest {guest}: {msg}")]
    Param { guest: String, msg: String },
    #[error("guest {0}: bad manifest: {1}")]
    Manifest(String, String),
    #[error("guest {0}: bad ELF: {1}")]
    Elf(String, String),
}

/// A built guest program.
#[derive(Debug, Clone)]
pub struct Guest {
    pub manifest: Manifest,
    pub elf: &'static [u8],
}

/// All built guests, in build order.
pub fn all() -> Result<Vec<Guest>, GuestError> {
    BUILT.iter().map(|(name, elf)| load(name, elf)).collect()
}

/// The built guest called `name`.
pub fn find(name: &str) -> Result<Guest, GuestError> {
    match BUILT.iter().find(|(n, _)| *n == name) {
        Some((n, elf)) => load(n, elf),
        None => {
            Err(GuestError::Unknown(name.to_string(), BUILT.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")))
        }
    }
}

/// The hosted (Linux) build of a guest program, for a benchmark's bare-metal side: e.g.
/// `numabench`, built from the same C source by build.rs into cargo's output directory.
pub fn host_program(name: &str) -> Result<std::path::PathBuf, GuestError> {
    let known = || HOST_PROGRAMS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
    let (_, path) =
        HOST_PROGRAMS.iter().find(|(n, _)| *n == name).ok_or_else(|| GuestError::Unknown(name.into(), known()))?;
    let path = std::path::PathBuf::from(path);
    if path.is_file() {
        Ok(path)
    } else {
        Err(GuestError::Elf(name.into(), format!("host program {} is gone (rebuild kumo-guests)", path.display())))
    }
}

fn load(name: &str, elf: &'static [u8]) -> Result<Guest, GuestError> {
    let text = elf::section(elf, ".kumo_manifest").map_err(|e| GuestError::Elf(name.into(), e))?;
    let manifest = Manifest::parse(text).map_err(|e| GuestError::Manifest(name.into(), e))?;
    if manifest.name != name {
        return Err(GuestError::Manifest(name.into(), format!("names itself `{}`", manifest.name)));
    }
    Ok(Guest { manifest, elf })
}

impl Guest {
    /// Checks `key=value` arguments against the manifest and returns the guest's command line
    /// (defaults are left to the guest, so the line holds only what the user gave).
    pub fn command_line(&self, args: &[String]) -> Result<String, GuestError> {
        let err = |msg: String| GuestError::Param { guest: self.manifest.name.clone(), msg };
        let mut seen = Vec::new();
        for arg in args {
            let (key, value) = arg.split_once('=').ok_or_else(|| err(format!("argument `{arg}` is not key=value")))?;
            let p = self.manifest.params.iter().find(|p| p.key == key).ok_or_else(|| {
                let known: Vec<_> = self.manifest.params.iter().map(|p| p.key.as_str()).collect();
                err(if known.is_empty() {
                    format!("takes no parameters, got `{key}`")
                } else {
                    format!("unknown parameter `{key}`; it takes: {}", known.join(", "))
                })
            })?;
            p.check(value).map_err(err)?;
            if seen.contains(&key) {
                return Err(err(format!("parameter `{key}` given twice")));
            }
            seen.push(key);
        }
        let line = args.join(" ");
        if line.len() >= 3840 {
            return Err(err("command line longer than 3839 bytes".into()));
        }
        Ok(line)
    }

    /// Checks the vCPU count against what the guest supports.
    pub fn check_cpus(&self, cpus: u32) -> Result<(), GuestError> {
        let m = &self.manifest;
        if cpus < m.min_cpus || cpus > m.max_cpus {
            return Err(GuestError::Param {
                guest: m.name.clone(),
                msg: format!("runs on {}..={} vCPUs, not {cpus}", m.min_cpus, m.max_cpus),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guests_are_built_with_manifests() {
        let names: Vec<_> = all().unwrap().into_iter().map(|g| g.manifest.name).collect();
        assert_eq!(
            names,
            [
                "hello",
                "memtouch",
                "smp",
                "netecho",
                "udpping",
                "udpsink",
                "udpsend",
                "numa",
                "sync",
                "numabench",
                "worker",
                "blkbench"
            ]
        );
        let m = find("memtouch").unwrap().manifest;
        assert!(m.params.iter().any(|p| p.key == "pages" && p.default == "1024"));
        assert!(m
            .params
            .iter()
            .any(|p| p.key == "mode" && p.kind == ParamKind::Choice(vec!["random".into(), "seq".into()])));
        assert_eq!(find("smp").unwrap().manifest.min_cpus, 2);
    }

    #[test]
    fn network_guests_take_addresses_and_interrupt_routing() {
        for name in ["netecho", "udpping", "udpsink", "udpsend"] {
            let g = find(name).unwrap();
            let line = g.command_line(&["ip=10.0.0.5".into(), "wait=poll".into(), "vector=0xd0".into()]).unwrap();
            assert_eq!(line, "ip=10.0.0.5 wait=poll vector=0xd0");
            assert!(g.command_line(&["ip=10.0.0".into()]).unwrap_err().to_string().contains("IPv4"));
            assert!(g.command_line(&["wait=spin".into()]).is_err());
            for key in ["cpu", "sink", "ip1"] {
                assert!(g.manifest.params.iter().any(|p| p.key == key), "{name} lacks {key}");
            }
        }
        assert!(find("udpping").unwrap().command_line(&["peer=10.0.0.1".into(), "count=5".into()]).is_ok());
    }

    #[test]
    fn blkbench_takes_its_region_time_and_seed() {
        let g = find("blkbench").unwrap();
        let line = g.command_line(&["size_mib=32".into(), "ms=200".into(), "seed=7".into(), "readonly=1".into()]);
        assert_eq!(line.unwrap(), "size_mib=32 ms=200 seed=7 readonly=1");
        assert!(g.command_line(&["size_mib=lots".into()]).is_err());
        assert!(g.command_line(&["qd=4".into()]).is_err());
    }

    #[test]
    fn guests_are_x86_64_elf_executables() {
        for g in all().unwrap() {
            assert_eq!(&g.elf[..4], b"\x7fELF");
            assert_eq!(g.elf[4], 2, "64-bit");
            assert_eq!(u16::from_le_bytes([g.elf[18], g.elf[19]]), 62, "x86_64");
        }
    }

    #[test]
    fn unknown_guest_lists_the_built_ones() {
        let e = find("nope").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown guest `nope`; built guests: hello, memtouch, smp, netecho, udpping, udpsink, udpsend, numa, sync, numabench, worker, blkbench"
        );
    }

    #[test]
    fn arguments_are_checked_against_the_manifest() {
        let g = find("memtouch").unwrap();
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(g.command_line(&a(&["pages=10", "mode=seq"])).unwrap(), "pages=10 mode=seq");
        let e = g.command_line(&a(&["pagez=1"])).unwrap_err().to_string();
        assert!(e.contains("unknown parameter `pagez`") && e.contains("pages, mode"), "{e}");
        assert!(g.command_line(&a(&["pages=ten"])).unwrap_err().to_string().contains("number"));
        assert!(g.command_line(&a(&["mode=zigzag"])).unwrap_err().to_string().contains("random, seq"));
        assert!(g.command_line(&a(&["pages"])).unwrap_err().to_string().contains("key=value"));
        assert!(g.command_line(&a(&["pages=1", "pages=2"])).unwrap_err().to_string().contains("twice"));
        let h = find("hello").unwrap();
        assert!(h.command_line(&a(&["x=1"])).unwrap_err().to_string().contains("takes no parameters"));
        assert!(find("smp").unwrap().check_cpus(1).is_err());
        assert!(find("smp").unwrap().check_cpus(2).is_ok());
        assert!(h.check_cpus(65).is_err());
    }
}
