//! Names the instructions this project's nested KVM is known not to emulate, so an emulation
//! failure can be reported as "STAC at RIP …" rather than a bare internal error.

/// Skips legacy and REX prefixes; returns (prefixes seen, rest).
fn strip_prefixes(b: &[u8]) -> (Vec<u8>, &[u8]) {
    let mut p = Vec::new();
    let mut i = 0;
    while i < b.len()
        && matches!(b[i], 0xf0 | 0xf2 | 0xf3 | 0x2e | 0x36 | 0x3e | 0x26 | 0x64 | 0x65 | 0x66 | 0x67 | 0x40..=0x4f)
    {
        p.push(b[i]);
        i += 1;
    }
    (p, &b[i..])
}

/// A name for the instruction starting at `bytes`, if it is one kumo knows to be trouble.
pub fn describe(bytes: &[u8]) -> Option<&'static str> {
    let (prefixes, b) = strip_prefixes(bytes);
    let reg = |modrm: u8| (modrm >> 3) & 7;
    match b {
        [0xcc, ..] => Some("INT3"),
        [0x9b, ..] => Some("FWAIT"),
        [0x0f, 0x01, 0xca, ..] => Some("CLAC"),
        [0x0f, 0x01, 0xcb, ..] => Some("STAC"),
        [0x0f, 0x01, 0xf9, ..] => Some("RDTSCP"),
        [0x0f, 0x01, 0xd0, ..] => Some("XGETBV"),
        [0x0f, 0x01, 0xd1, ..] => Some("XSETBV"),
        [0x0f, 0xb8, ..] if prefixes.contains(&0xf3) => Some("POPCNT"),
        [0x0f, 0xc7, m, ..] if reg(*m) == 1 && prefixes.iter().any(|p| (0x48..=0x4f).contains(p)) => Some("CMPXCHG16B"),
        [0x0f, 0xae, m, ..] if *m < 0xc0 => match reg(*m) {
            2 => Some("LDMXCSR"),
            3 => Some("STMXCSR"),
            4 => Some("XSAVE"),
            5 => Some("XRSTOR"),
            _ => None,
        },
        [0x0f, 0xc7, m, ..] if *m < 0xc0 && reg(*m) == 3 => Some("XRSTORS"),
        // SSE integer code, e.g. the kernel's BLAKE2s with SSSE3 (see DEFAULT_LINUX_CMDLINE).
        [0x0f, 0x6e | 0x7e, ..] if prefixes.contains(&0x66) => Some("MOVD/MOVQ (SSE)"),
        [0x0f, 0x38, 0x00, ..] if prefixes.contains(&0x66) => Some("PSHUFB (SSSE3)"),
        _ => None,
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_known_troublemakers() {
        assert_eq!(describe(&[0xcc]), Some("INT3"));
        assert_eq!(describe(&[0x0f, 0x01, 0xcb, 0x90]), Some("STAC"));
        assert_eq!(describe(&[0x0f, 0x01, 0xca]), Some("CLAC"));
        assert_eq!(describe(&[0x0f, 0xae, 0x2f]), Some("XRSTOR")); // xrstor (%rdi)
        assert_eq!(describe(&[0x48, 0x0f, 0xae, 0x2f]), Some("XRSTOR")); // xrstor64
        assert_eq!(describe(&[0x0f, 0xae, 0x17]), Some("LDMXCSR"));
        assert_eq!(describe(&[0xf3, 0x48, 0x0f, 0xb8, 0xc0]), Some("POPCNT"));
        assert_eq!(describe(&[0xf0, 0x48, 0x0f, 0xc7, 0x0e]), Some("CMPXCHG16B"));
        assert_eq!(describe(&[0x0f, 0x01, 0xf9]), Some("RDTSCP"));
        assert_eq!(describe(&[0x9b]), Some("FWAIT"));
        assert_eq!(describe(&[0x66, 0x44, 0x0f, 0x6e, 0xf9]), Some("MOVD/MOVQ (SSE)")); // movd %ecx,%xmm15
        assert_eq!(describe(&[0x66, 0x0f, 0x38, 0x00, 0xc1]), Some("PSHUFB (SSSE3)"));
        assert_eq!(describe(&[0x0f, 0x6e, 0xc1]), None); // MMX movd
        assert_eq!(describe(&[0x0f, 0xae, 0xf0]), None); // mfence, register form
        assert_eq!(describe(&[0x90]), None);
        assert_eq!(describe(&[]), None);
        assert_eq!(hex(&[0x0f, 0x01, 0xcb]), "0f 01 cb");
    }
}
