//! `--guest NAME`: kumo's own guest programs (kumo-guests, built from `guests/`) for the VMM,
//! which links none. A VM booting one gets its ELF image and command line
//! ([`kumo_vmm::GuestProgram`]); a VM arriving with one is checked by [`check`], which `main`
//! registers with the VMM.

use std::sync::Arc;

use kumo_vmm::{GuestProgram, Payload, VmConfig};

/// Gives a guest payload its program: the built guest's ELF and the command line of its
/// arguments (checked against the guest's manifest). Other payloads are left alone.
pub fn resolve(config: &mut VmConfig) -> Result<(), String> {
    if let Payload::Guest { name, args, program } = &mut config.payload {
        let guest = kumo_guests::find(name).map_err(|e| e.to_string())?;
        let cmdline = guest.command_line(args).map_err(|e| e.to_string())?;
        *program = Some(GuestProgram { elf: Arc::from(guest.elf), cmdline });
    }
    Ok(())
}

/// The VMM's check of a guest a VM names (`kumo_vmm::guest_program::GuestCheck`): it is built
/// here, runs on `cpus` vCPUs and takes `args`.
pub fn check(name: &str, args: &[String], cpus: u32) -> Result<(), String> {
    let guest = kumo_guests::find(name).map_err(|e| e.to_string())?;
    guest.check_cpus(cpus).map_err(|e| e.to_string())?;
    guest.command_line(args).map(drop).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_payload_gets_its_elf_and_command_line() {
        let mut c = VmConfig::new(Payload::guest("memtouch", &["pages=10"]));
        resolve(&mut c).unwrap();
        let Payload::Guest { program: Some(p), .. } = &c.payload else { panic!("not resolved: {c:?}") };
        assert_eq!((&p.elf[..4], p.cmdline.as_str()), (&b"\x7fELF"[..], "pages=10"));
        let mut bad = VmConfig::new(Payload::guest("memtouch", &["pagez=1"]));
        assert!(resolve(&mut bad).unwrap_err().contains("unknown parameter `pagez`"));
        let mut k = VmConfig::new(Payload::Kernel { path: "/k".into(), initrd: None, cmdline: None });
        resolve(&mut k).unwrap();
        assert!(check("nope", &[], 1).unwrap_err().contains("unknown guest `nope`"));
        assert_eq!(check("smp", &[], 1).unwrap_err(), "guest smp: runs on 2..=64 vCPUs, not 1");
        check("memtouch", &["pages=3".into()], 2).unwrap();
    }
}
