//! Just enough ELF64 reading to find a section by name.

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?)).ok()
}

/// The contents of section `name` of a little-endian ELF64 image.
pub fn section<'a>(elf: &'a [u8], name: &str) -> Result<&'a [u8], String> {
    let bad = || "truncated or malformed ELF".to_string();
    if elf.get(..4) != Some(b"\x7fELF") || elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return Err("not a little-endian ELF64 image".into());
    }
    let shoff = u64_at(elf, 0x28).ok_or_else(bad)?;
    let shentsize = u16_at(elf, 0x3a).ok_or_else(bad)? as usize;
    let shnum = u16_at(elf, 0x3c).ok_or_else(bad)? as usize;
    let shstrndx = u16_at(elf, 0x3e).ok_or_else(bad)? as usize;
    let sh = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
    let strtab_hdr = sh(shstrndx).ok_or_else(bad)?;
    let strtab = u64_at(elf, strtab_hdr + 0x18).ok_or_else(bad)?;
    for i in 0..shnum {
        let h = sh(i).ok_or_else(bad)?;
        let name_off = strtab.checked_add(u32_at(elf, h).ok_or_else(bad)? as usize).ok_or_else(bad)?;
        let sname = elf.get(name_off..).ok_or_else(bad)?;
        let end = sname.iter().position(|&c| c == 0).ok_or_else(bad)?;
        if &sname[..end] == name.as_bytes() {
            let off = u64_at(elf, h + 0x18).ok_or_else(bad)?;
            let size = u64_at(elf, h + 0x20).ok_or_else(bad)?;
            return elf.get(off..off.checked_add(size).ok_or_else(bad)?).ok_or_else(bad);
        }
    }
    Err(format!("no {name} section"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_elf_and_truncated_input() {
        assert!(section(b"hello", ".x").unwrap_err().contains("not a little-endian ELF64"));
        let mut h = vec![0x7f, b'E', b'L', b'F', 2, 1];
        h.resize(0x40, 0);
        h[0x28] = 0xff; // section headers beyond the end
        h[0x3c] = 1;
        assert!(section(&h, ".x").unwrap_err().contains("truncated"));
    }

    #[test]
    fn finds_sections_of_a_built_guest() {
        let (_, elf) = crate::BUILT[0];
        assert!(section(elf, ".kumo_manifest").unwrap().starts_with(b"name=hello"));
        assert!(section(elf, ".nope").unwrap_err().contains("no .nope"));
    }
}
