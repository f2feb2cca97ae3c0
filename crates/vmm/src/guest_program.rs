//! A kumo guest program as the VMM sees it: a static ELF image and its command line
//! ([`GuestProgram`]), loaded at 1 MiB and started with kumo's boot information. The VMM links
//! no guest programs and knows none by name: whoever builds a `Payload::Guest` resolves its name
//! into a `GuestProgram` (the `kumo` CLI does, through kumo-guests, for `--guest NAME`), and the
//! program that embeds the VMM registers a [`GuestCheck`] ([`set_guest_check`]) with which the
//! VMM checks the guest a VM names when it arrives by migration or from a snapshot (its program
//! then comes with its memory, and only its name and arguments with its description).

use std::sync::{Arc, OnceLock};

use crate::Error;

/// A guest program's ELF image and command line: what the VMM loads for a `Payload::Guest`.
#[derive(Clone, PartialEq, Eq)]
pub struct GuestProgram {
    pub elf: Arc<[u8]>,
    /// At most 3839 bytes (the boot information's field).
    pub cmdline: String,
}

impl std::fmt::Debug for GuestProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestProgram").field("elf_bytes", &self.elf.len()).field("cmdline", &self.cmdline).finish()
    }
}

/// Checks that guest program `name` exists, runs on `cpus` vCPUs and takes `args`; the error
/// is one line (e.g. ``unknown guest `nope`; built guests: …``).
pub type GuestCheck = fn(name: &str, args: &[String], cpus: u32) -> Result<(), String>;

static CHECK: OnceLock<GuestCheck> = OnceLock::new();

/// Registers the process's guest check, once (a second call changes nothing). Without one, a
/// guest arriving by migration or restore is taken by its name alone.
pub fn set_guest_check(check: GuestCheck) {
    let _ = CHECK.set(check);
}

/// The registered check of guest `name` with `args` on `cpus` vCPUs.
pub(crate) fn check(name: &str, args: &[String], cpus: u32) -> Result<(), Error> {
    match CHECK.get() {
        Some(check) => check(name, args, cpus).map_err(Error::Guest),
        None => Ok(()),
    }
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o.checked_add(8)?)?.try_into().ok()?))
}

/// End (highest `p_paddr + p_memsz`) of an ELF64 image's PT_LOAD segments: where the guest's
/// free memory starts. linux-loader's `kernel_end` leaves out segments with no file bytes (a
/// `.bss` of its own), which kumo's guests have.
pub fn image_end(elf: &[u8]) -> Result<u64, String> {
    let bad = || "truncated or malformed ELF".to_string();
    if elf.get(..4) != Some(b"\x7fELF") {
        return Err("not an ELF image".into());
    }
    let phoff = usize::try_from(u64_at(elf, 0x20).ok_or_else(bad)?).map_err(|_| bad())?;
    let phentsize = usize::from(u16_at(elf, 0x36).ok_or_else(bad)?);
    let phnum = usize::from(u16_at(elf, 0x38).ok_or_else(bad)?);
    let mut end = 0u64;
    for i in 0..phnum {
        let h = phoff.checked_add(i.checked_mul(phentsize).ok_or_else(bad)?).ok_or_else(bad)?;
        if u32_at(elf, h).ok_or_else(bad)? == 1 {
            let paddr = u64_at(elf, h.checked_add(0x18).ok_or_else(bad)?).ok_or_else(bad)?;
            let memsz = u64_at(elf, h.checked_add(0x28).ok_or_else(bad)?).ok_or_else(bad)?;
            end = end.max(paddr.checked_add(memsz).ok_or_else(bad)?);
        }
    }
    if end == 0 {
        return Err("no loadable segment".into());
    }
    Ok(end)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An ELF64 header and program headers: `(type, paddr, filesz, memsz)` each.
    fn elf(segments: &[(u32, u64, u64, u64)]) -> Vec<u8> {
        let mut e = vec![0u8; 0x40];
        e[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        e[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        e[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        e[0x38..0x3a].copy_from_slice(&(segments.len() as u16).to_le_bytes());
        for &(kind, paddr, filesz, memsz) in segments {
            let mut h = vec![0u8; 0x38];
            h[..4].copy_from_slice(&kind.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&paddr.to_le_bytes());
            h[0x20..0x28].copy_from_slice(&filesz.to_le_bytes());
            h[0x28..0x30].copy_from_slice(&memsz.to_le_bytes());
            e.extend(h);
        }
        e
    }

    #[test]
    fn the_image_ends_after_the_last_loaded_byte_bss_included() {
        // Text, then a segment that is all .bss (no file bytes), then a note (not loaded).
        let e = elf(&[(1, 0x10_0000, 0x2000, 0x2000), (1, 0x10_3000, 0, 0x4_0000), (4, 0x90_0000, 0x10, 0x10)]);
        assert_eq!(image_end(&e), Ok(0x14_3000));
        assert_eq!(image_end(b"nope"), Err("not an ELF image".into()));
        assert!(image_end(&elf(&[(4, 0, 1, 1)])).unwrap_err().contains("no loadable segment"));
        let mut cut = elf(&[(1, 0x10_0000, 1, 1)]);
        cut.truncate(0x50);
        assert!(image_end(&cut).unwrap_err().contains("truncated"));
        let wrap = elf(&[(1, u64::MAX, 1, 2)]);
        assert!(image_end(&wrap).unwrap_err().contains("malformed"));
    }

    /// The check this crate's tests register, in the manner of kumo-guests': `hello` (1..=64
    /// vCPUs, no arguments), `smp` (2..=64), `memtouch` (1..=64, `pages=N`).
    pub(crate) fn test_guests() {
        set_guest_check(|name, args, cpus| {
            let min = match name {
                "hello" | "memtouch" => 1,
                "smp" => 2,
                _ => return Err(format!("unknown guest `{name}`; built guests: hello, memtouch, smp")),
            };
            if !(min..=64).contains(&cpus) {
                return Err(format!("guest {name}: runs on {min}..=64 vCPUs, not {cpus}"));
            }
            for a in args {
                match a.split_once('=') {
                    Some(("pages", v)) if name == "memtouch" && v.parse::<u64>().is_ok() => {}
                    _ => return Err(format!("guest {name}: bad argument `{a}` (pages=N)")),
                }
            }
            Ok(())
        });
    }

    #[test]
    fn the_registered_check_decides() {
        test_guests();
        assert!(check("memtouch", &["pages=3".into()], 2).is_ok());
        let e = check("memtouch", &["pages=x".into()], 2).unwrap_err().to_string();
        assert!(e.contains("pages"), "{e}");
        let e = check("smp", &[], 1).unwrap_err().to_string();
        assert_eq!(e, "guest smp: runs on 2..=64 vCPUs, not 1");
        let p = GuestProgram { elf: Arc::from(&b"\x7fELF"[..]), cmdline: "a=1".into() };
        assert_eq!(format!("{p:?}"), r#"GuestProgram { elf_bytes: 4, cmdline: "a=1" }"#);
    }
}
