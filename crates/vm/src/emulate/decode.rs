//! The one x86 instruction decoder of kumo (64-bit mode, the subset kumo needs): prefixes,
//! ModRM/SIB and effective addresses; [`decode`] for the instructions the emulation assists
//! carry out, and [`describe`] to name an instruction this project's nested KVM is known not to
//! emulate, so an emulation failure reads "STAC at RIP …" rather than a bare internal error.
//! Pure: no KVM, no guest memory.

/// A segment override that matters in 64-bit mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seg {
    Fs,
    Gs,
}

/// Legacy and REX prefixes of one instruction (64-bit mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefixes {
    /// The REX byte (0 if none). Only a REX immediately before the opcode counts.
    pub rex: u8,
    pub lock: bool,
    pub opsize: bool,
    pub addr32: bool,
    /// 0xf2 or 0xf3, the last one seen.
    pub rep: Option<u8>,
    pub seg: Option<Seg>,
    /// Bytes the prefixes take.
    pub len: usize,
}

/// Reads the prefixes at the start of `b` (at most 14, so an instruction stays ≤ 15 bytes).
pub fn decode_prefixes(b: &[u8]) -> Prefixes {
    let mut p = Prefixes::default();
    for (i, &x) in b.iter().enumerate().take(14) {
        match x {
            0xf0 => p.lock = true,
            0xf2 | 0xf3 => p.rep = Some(x),
            0x66 => p.opsize = true,
            0x67 => p.addr32 = true,
            0x64 => p.seg = Some(Seg::Fs),
            0x65 => p.seg = Some(Seg::Gs),
            // CS/SS/DS/ES overrides are ignored in 64-bit mode.
            0x2e | 0x36 | 0x3e | 0x26 => {}
            0x40..=0x4f => {
                p.rex = x;
                p.len = i + 1;
                continue;
            }
            _ => break,
        }
        p.rex = 0; // a legacy prefix after a REX cancels the REX
        p.len = i + 1;
    }
    p
}

/// A memory operand from a ModRM (and SIB) byte, 64-bit mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemOperand {
    /// Base register number (0 = RAX … 15 = R15).
    pub base: Option<u8>,
    /// Index register and scale (1, 2, 4, 8).
    pub index: Option<(u8, u8)>,
    pub disp: i32,
    /// RIP-relative: the address is the next instruction's RIP + disp.
    pub rip_relative: bool,
    /// Address-size override (0x67): the address is truncated to 32 bits.
    pub addr32: bool,
    pub seg: Option<Seg>,
}

/// The r/m operand of a ModRM byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rm {
    Reg(u8),
    Mem(MemOperand),
}

/// A decoded ModRM byte with its SIB and displacement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModRm {
    /// The reg field, extended by REX.R (for opcode extensions like `/2`, the raw 3 bits are
    /// in `reg & 7`).
    pub reg: u8,
    pub rm: Rm,
    /// Bytes taken by ModRM, SIB and displacement.
    pub len: usize,
}

/// Decodes the ModRM at the start of `b` (64-bit mode, with the instruction's prefixes).
/// `None` if `b` is too short.
pub fn decode_modrm(b: &[u8], p: &Prefixes) -> Option<ModRm> {
    let modrm = *b.first()?;
    let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    let rex_r = (p.rex >> 2) & 1;
    let rex_x = (p.rex >> 1) & 1;
    let rex_b = p.rex & 1;
    let reg = reg | rex_r << 3;
    if md == 3 {
        return Some(ModRm { reg, rm: Rm::Reg(rm | rex_b << 3), len: 1 });
    }
    let mut len = 1;
    let mut m = MemOperand { base: None, index: None, disp: 0, rip_relative: false, addr32: p.addr32, seg: p.seg };
    let mut disp_len = match md {
        1 => 1,
        2 => 4,
        _ => 0,
    };
    if rm == 4 {
        let sib = *b.get(1)?;
        len += 1;
        let (ss, idx, base) = (sib >> 6, (sib >> 3) & 7 | rex_x << 3, sib & 7);
        if idx != 4 {
            m.index = Some((idx, 1 << ss));
        }
        if base == 5 && md == 0 {
            disp_len = 4; // no base, disp32
        } else {
            m.base = Some(base | rex_b << 3);
        }
    } else if rm == 5 && md == 0 {
        m.rip_relative = true;
        disp_len = 4;
    } else {
        m.base = Some(rm | rex_b << 3);
    }
    let d = b.get(len..len + disp_len)?;
    m.disp = match disp_len {
        1 => d[0] as i8 as i32,
        4 => i32::from_le_bytes([d[0], d[1], d[2], d[3]]),
        _ => 0,
    };
    Some(ModRm { reg, rm: Rm::Mem(m), len: len + disp_len })
}

impl MemOperand {
    /// The linear address: `next_rip` is the address of the following instruction (for
    /// RIP-relative operands), `fs_base`/`gs_base` the segment bases for overrides.
    pub fn address(&self, gpr: &[u64; 16], next_rip: u64, fs_base: u64, gs_base: u64) -> u64 {
        let mut ea = if self.rip_relative { next_rip } else { 0 };
        if let Some(b) = self.base {
            ea = ea.wrapping_add(gpr[b as usize]);
        }
        if let Some((i, s)) = self.index {
            ea = ea.wrapping_add(gpr[i as usize].wrapping_mul(s as u64));
        }
        ea = ea.wrapping_add(self.disp as i64 as u64);
        if self.addr32 {
            ea &= 0xffff_ffff;
        }
        match self.seg {
            Some(Seg::Fs) => ea.wrapping_add(fs_base),
            Some(Seg::Gs) => ea.wrapping_add(gs_base),
            None => ea,
        }
    }
}

/// An instruction kumo can assist with, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insn {
    Int3,
    Fwait,
    Ldmxcsr(MemOperand),
    Stmxcsr(MemOperand),
    Clac,
    Stac,
    /// POPCNT: destination register, source, operand size in bytes (2, 4, 8).
    Popcnt {
        dst: u8,
        src: Rm,
        size: u8,
    },
    Rdtscp,
}

/// Decodes the instruction at the start of `b`; `long_mode` is true for a 64-bit code segment.
/// Returns the instruction and its length, or `None` if it is not one kumo assists with (or `b`
/// is cut short). Outside 64-bit mode only the operand-less instructions without prefixes are
/// taken (there 0x40–0x4f are INC/DEC, not REX).
pub fn decode(b: &[u8], long_mode: bool) -> Option<(Insn, usize)> {
    if !long_mode {
        return match b {
            [0xcc, ..] => Some((Insn::Int3, 1)),
            [0x9b, ..] => Some((Insn::Fwait, 1)),
            [0x0f, 0x01, 0xca, ..] => Some((Insn::Clac, 3)),
            [0x0f, 0x01, 0xcb, ..] => Some((Insn::Stac, 3)),
            [0x0f, 0x01, 0xf9, ..] => Some((Insn::Rdtscp, 3)),
            _ => None,
        };
    }
    let p = decode_prefixes(b);
    let op = &b[p.len..];
    if p.lock {
        return None; // #UD for all of these; leave it to KVM's report
    }
    let insn = match op {
        [0xcc, ..] if p.len == 0 => (Insn::Int3, 1),
        [0x9b, ..] if p.len == 0 => (Insn::Fwait, 1),
        [0x0f, 0x01, 0xca, ..] if p.len == 0 => (Insn::Clac, 3),
        [0x0f, 0x01, 0xcb, ..] if p.len == 0 => (Insn::Stac, 3),
        [0x0f, 0x01, 0xf9, ..] if p.len == 0 => (Insn::Rdtscp, 3),
        [0x0f, 0xb8, rest @ ..] if p.rep == Some(0xf3) => {
            let m = decode_modrm(rest, &p)?;
            let size = if p.rex & 8 != 0 {
                8
            } else if p.opsize {
                2
            } else {
                4
            };
            (Insn::Popcnt { dst: m.reg, src: m.rm, size }, 2 + m.len)
        }
        // 66/f2/f3 0f ae /2,/3 are other instructions (or #UD).
        [0x0f, 0xae, rest @ ..] if !p.opsize && p.rep.is_none() => {
            let m = decode_modrm(rest, &p)?;
            let Rm::Mem(mem) = m.rm else { return None };
            let insn = match m.reg & 7 {
                2 => Insn::Ldmxcsr(mem),
                3 => Insn::Stmxcsr(mem),
                _ => return None,
            };
            (insn, 2 + m.len)
        }
        _ => return None,
    };
    let len = p.len + insn.1;
    (len <= 15).then_some((insn.0, len))
}

/// A name for the instruction starting at `bytes`, if it is one kumo knows to be trouble.
pub fn describe(bytes: &[u8]) -> Option<&'static str> {
    let p = decode_prefixes(bytes);
    let b = &bytes[p.len..];
    let reg = |modrm: u8| (modrm >> 3) & 7;
    match b {
        [0xcc, ..] => Some("INT3"),
        [0x9b, ..] => Some("FWAIT"),
        [0x0f, 0x01, 0xca, ..] => Some("CLAC"),
        [0x0f, 0x01, 0xcb, ..] => Some("STAC"),
        [0x0f, 0x01, 0xf9, ..] => Some("RDTSCP"),
        [0x0f, 0x01, 0xd0, ..] => Some("XGETBV"),
        [0x0f, 0x01, 0xd1, ..] => Some("XSETBV"),
        [0x0f, 0xb8, ..] if p.rep == Some(0xf3) => Some("POPCNT"),
        [0x0f, 0xc7, m, ..] if reg(*m) == 1 && p.rex & 8 != 0 => Some("CMPXCHG16B"),
        [0x0f, 0xae, m, ..] if *m < 0xc0 => match reg(*m) {
            2 => Some("LDMXCSR"),
            3 => Some("STMXCSR"),
            4 => Some("XSAVE"),
            5 => Some("XRSTOR"),
            _ => None,
        },
        [0x0f, 0xc7, m, ..] if *m < 0xc0 && reg(*m) == 3 => Some("XRSTORS"),
        // SSE integer code, e.g. the kernel's BLAKE2s with SSSE3 (see DEFAULT_LINUX_CMDLINE).
        [0x0f, 0x6e | 0x7e, ..] if p.opsize => Some("MOVD/MOVQ (SSE)"),
        [0x0f, 0x38, 0x00, ..] if p.opsize => Some("PSHUFB (SSSE3)"),
        _ => None,
    }
}

/// Where an instruction reads or writes memory, for naming the address of a faulting access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Its ModRM memory operand; `len` is the whole instruction's (for RIP-relative operands).
    Operand { mem: MemOperand, len: usize },
    /// A string instruction: the addresses in these registers (RSI = 6, RDI = 7).
    Regs(&'static [u8]),
}

/// The memory access of the common data-moving and arithmetic instructions at the start of `b`
/// (64-bit mode; a best effort for error messages, `None` for anything else).
pub fn memory_access(b: &[u8]) -> Option<Access> {
    let p = decode_prefixes(b);
    let op = b.get(p.len..)?;
    let imm32 = if p.opsize { 2 } else { 4 };
    // (bytes of opcode, immediate bytes) of instructions with a ModRM; `None` for the others.
    let (oplen, imm) = match op {
        [0xa4 | 0xa5, ..] => return Some(Access::Regs(&[6, 7])), // MOVS
        [0xaa | 0xab, ..] => return Some(Access::Regs(&[7])),    // STOS
        [0xac | 0xad, ..] => return Some(Access::Regs(&[6])),    // LODS
        [x, ..] if *x < 0x40 && x & 7 < 4 => (1, 0),             // ADD … CMP r/m
        [0x84..=0x8b | 0x8f | 0xd0..=0xd3 | 0xfe | 0xff, ..] => (1, 0),
        [0x80 | 0x83 | 0xc0 | 0xc1 | 0xc6 | 0x6b, ..] => (1, 1),
        [0x81 | 0xc7 | 0x69, ..] => (1, imm32),
        [0xf6, m, ..] => (1, usize::from((m >> 3) & 7 < 2)),
        [0xf7, m, ..] => (1, if (m >> 3) & 7 < 2 { imm32 } else { 0 }),
        [0x0f, x, ..]
            if matches!(x, 0x10..=0x17 | 0x28..=0x2f | 0x40..=0x4f | 0x6f | 0x7e | 0x7f | 0x90..=0x9f)
                || matches!(x, 0xa3 | 0xab | 0xaf | 0xb0 | 0xb1 | 0xb3 | 0xb6 | 0xb7 | 0xbb | 0xbe | 0xbf)
                || matches!(x, 0xc0 | 0xc1 | 0xc3 | 0xd6 | 0xe7) =>
        {
            (2, 0)
        }
        _ => return None,
    };
    let m = decode_modrm(op.get(oplen..)?, &p)?;
    let Rm::Mem(mem) = m.rm else { return None };
    Some(Access::Operand { mem, len: p.len + oplen + m.len + imm })
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(b: &[u8]) -> MemOperand {
        match decode(b, true) {
            Some((Insn::Ldmxcsr(m) | Insn::Stmxcsr(m), _)) => m,
            other => panic!("{b:02x?} decoded as {other:?}"),
        }
    }

    #[test]
    fn memory_accesses_of_common_instructions() {
        let op = |b: &[u8]| match memory_access(b) {
            Some(Access::Operand { mem, len }) => (mem, len),
            other => panic!("{b:02x?}: {other:?}"),
        };
        // mov %rax,(%rdx): 48 89 02
        let (m, len) = op(&[0x48, 0x89, 0x02]);
        assert_eq!((m.base, m.disp, len), (Some(2), 0, 3));
        // movq $1,0x10(%rbx): 48 c7 43 10 01 00 00 00
        let (m, len) = op(&[0x48, 0xc7, 0x43, 0x10, 1, 0, 0, 0]);
        assert_eq!((m.base, m.disp, len), (Some(3), 0x10, 8));
        // addl $1,0x8(%rip): 83 05 08 00 00 00 01 — next RIP counts the immediate
        let (m, len) = op(&[0x83, 0x05, 8, 0, 0, 0, 1]);
        assert_eq!((m.rip_relative, m.address(&[0; 16], 0x1000 + len as u64, 0, 0)), (true, 0x100f));
        // movzbl (%rsi),%eax: 0f b6 06
        assert_eq!(op(&[0x0f, 0xb6, 0x06]).0.base, Some(6));
        // testb $1,(%rdi): f6 07 01
        assert_eq!(op(&[0xf6, 0x07, 1]).1, 3);
        assert_eq!(memory_access(&[0xf3, 0x48, 0xab]), Some(Access::Regs(&[7])), "rep stosq");
        assert_eq!(memory_access(&[0x48, 0x89, 0xc2]), None, "register to register");
        assert_eq!(memory_access(&[0x0f, 0x0b]), None, "ud2");
        assert_eq!(memory_access(&[0x89]), None, "cut short");
    }

    #[test]
    fn prefixes() {
        assert_eq!(decode_prefixes(&[0x90]), Prefixes::default());
        let p = decode_prefixes(&[0x65, 0x48, 0x0f]);
        assert_eq!((p.seg, p.rex, p.len), (Some(Seg::Gs), 0x48, 2));
        // A legacy prefix after REX cancels it.
        let p = decode_prefixes(&[0x41, 0x67, 0x0f]);
        assert_eq!((p.rex, p.addr32, p.len), (0, true, 2));
        let p = decode_prefixes(&[0xf0, 0xf3, 0x66, 0x2e, 0x0f]);
        assert_eq!((p.lock, p.rep, p.opsize, p.seg, p.len), (true, Some(0xf3), true, None, 4));
    }

    #[test]
    fn modrm_vectors() {
        // Test vectors checked against GNU as / objdump encodings.
        let p = Prefixes::default();
        // (%rdi): 0x17 = mod 00 reg 2 rm 7
        assert_eq!(
            decode_modrm(&[0x17], &p).unwrap(),
            ModRm {
                reg: 2,
                rm: Rm::Mem(MemOperand {
                    base: Some(7),
                    index: None,
                    disp: 0,
                    rip_relative: false,
                    addr32: false,
                    seg: None
                }),
                len: 1
            }
        );
        // register form: 0xc0 = mod 11 reg 0 rm 0
        assert_eq!(decode_modrm(&[0xc0], &p).unwrap(), ModRm { reg: 0, rm: Rm::Reg(0), len: 1 });
        // -0x4(%rbp): 0x55 0xfc = mod 01 reg 2 rm 5, disp8 -4
        let m = decode_modrm(&[0x55, 0xfc], &p).unwrap();
        assert_eq!(
            (m.len, m.rm),
            (
                2,
                Rm::Mem(MemOperand {
                    base: Some(5),
                    index: None,
                    disp: -4,
                    rip_relative: false,
                    addr32: false,
                    seg: None
                })
            )
        );
        // 0x12345678(%rip): 0x15 + disp32
        let m = decode_modrm(&[0x15, 0x78, 0x56, 0x34, 0x12], &p).unwrap();
        assert_eq!(
            (m.len, m.rm),
            (
                5,
                Rm::Mem(MemOperand {
                    base: None,
                    index: None,
                    disp: 0x12345678,
                    rip_relative: true,
                    addr32: false,
                    seg: None
                })
            )
        );
        // (%rsp): 0x14 0x24 — SIB with no index, base rsp
        let m = decode_modrm(&[0x14, 0x24], &p).unwrap();
        assert_eq!(
            (m.len, m.rm),
            (
                2,
                Rm::Mem(MemOperand {
                    base: Some(4),
                    index: None,
                    disp: 0,
                    rip_relative: false,
                    addr32: false,
                    seg: None
                })
            )
        );
        // 0x10(%rax,%rcx,8): 0x54 0xc8 0x10
        let m = decode_modrm(&[0x54, 0xc8, 0x10], &p).unwrap();
        assert_eq!(
            (m.len, m.rm),
            (
                3,
                Rm::Mem(MemOperand {
                    base: Some(0),
                    index: Some((1, 8)),
                    disp: 0x10,
                    rip_relative: false,
                    addr32: false,
                    seg: None
                })
            )
        );
        // absolute 0x1000 via SIB (no base, no index): 0x14 0x25 + disp32
        let m = decode_modrm(&[0x14, 0x25, 0x00, 0x10, 0, 0], &p).unwrap();
        assert_eq!(
            (m.len, m.rm),
            (
                6,
                Rm::Mem(MemOperand {
                    base: None,
                    index: None,
                    disp: 0x1000,
                    rip_relative: false,
                    addr32: false,
                    seg: None
                })
            )
        );
        // 0x100(%rbp) with mod 10: 0x95 + disp32
        let m = decode_modrm(&[0x95, 0x00, 0x01, 0, 0], &p).unwrap();
        assert_eq!(m.len, 5);
        // truncated input
        assert_eq!(decode_modrm(&[0x15, 0x78], &p), None);
        assert_eq!(decode_modrm(&[0x14], &p), None);
        assert_eq!(decode_modrm(&[], &p), None);
    }

    #[test]
    fn modrm_with_rex() {
        // ldmxcsr (%r13): 41 0f ae 55 00 — REX.B with rm 5 needs mod 01 disp8 0 (r13 is not RIP).
        let (i, len) = decode(&[0x41, 0x0f, 0xae, 0x55, 0x00], true).unwrap();
        assert_eq!(len, 5);
        assert_eq!(
            i,
            Insn::Ldmxcsr(MemOperand {
                base: Some(13),
                index: None,
                disp: 0,
                rip_relative: false,
                addr32: false,
                seg: None
            })
        );
        // ldmxcsr (%r12): 41 0f ae 14 24 — SIB, base r12, no index
        assert_eq!(mem(&[0x41, 0x0f, 0xae, 0x14, 0x24]).base, Some(12));
        // ldmxcsr (%rax,%r12,2): 42 0f ae 14 60 — REX.X makes index 4 → r12 (a real index)
        let m = mem(&[0x42, 0x0f, 0xae, 0x14, 0x60]);
        assert_eq!((m.base, m.index), (Some(0), Some((12, 2))));
        // stmxcsr 0x8(%r15): 41 0f ae 5f 08
        assert!(matches!(decode(&[0x41, 0x0f, 0xae, 0x5f, 0x08], true), Some((Insn::Stmxcsr(_), 5))));
        // REX.R on an opcode extension: reg & 7 still selects /2.
        assert!(matches!(decode(&[0x44, 0x0f, 0xae, 0x17], true), Some((Insn::Ldmxcsr(_), 4))));
    }

    #[test]
    fn decodes_assisted_instructions() {
        assert_eq!(decode(&[0xcc, 0x90], true), Some((Insn::Int3, 1)));
        assert_eq!(decode(&[0x9b], true), Some((Insn::Fwait, 1)));
        assert_eq!(decode(&[0x0f, 0x01, 0xca], true), Some((Insn::Clac, 3)));
        assert_eq!(decode(&[0x0f, 0x01, 0xcb], false), Some((Insn::Stac, 3)));
        // ldmxcsr 0x1234(%rip): 0f ae 15 34 12 00 00 (7 bytes)
        assert!(
            matches!(decode(&[0x0f, 0xae, 0x15, 0x34, 0x12, 0, 0], true), Some((Insn::Ldmxcsr(m), 7)) if m.rip_relative && m.disp == 0x1234)
        );
        // gs-relative: 65 0f ae 14 25 <disp32>
        let m = mem(&[0x65, 0x0f, 0xae, 0x14, 0x25, 0x40, 0, 0, 0]);
        assert_eq!((m.seg, m.base, m.disp), (Some(Seg::Gs), None, 0x40));
        assert_eq!(decode(&[0x65, 0x0f, 0xae, 0x14, 0x25, 0x40, 0, 0, 0], true).unwrap().1, 9);
        // Not ours: register forms (lfence/mfence/sfence), xsave/xrstor, fxsave, prefixed forms,
        // LOCK, memory forms outside 64-bit mode, truncated bytes.
        for b in [
            &[0x0f, 0xae, 0xe8][..],
            &[0x0f, 0xae, 0xf0],
            &[0x0f, 0xae, 0x2f],
            &[0x0f, 0xae, 0x07],
            &[0x66, 0x0f, 0xae, 0x17],
            &[0xf3, 0x0f, 0xae, 0x17],
            &[0xf0, 0x0f, 0xae, 0x17],
            &[0x48, 0xcc],
            &[0x90],
            &[0x0f, 0xae],
            &[0x0f, 0xae, 0x15, 0x34],
            &[],
        ] {
            assert_eq!(decode(b, true), None, "{b:02x?}");
        }
        assert_eq!(decode(&[0x0f, 0xae, 0x17], false), None);
        assert_eq!(decode(&[0x40, 0xcc], false), None);
        // 15 bytes at most.
        let mut long = vec![0x3e; 11];
        long.extend_from_slice(&[0x0f, 0xae, 0x55, 0x00]);
        assert_eq!(decode(&long, true).map(|d| d.1), Some(15));
        let mut too_long = vec![0x3e; 12];
        too_long.extend_from_slice(&[0x0f, 0xae, 0x55, 0x00]);
        assert_eq!(decode(&too_long, true), None);
    }

    #[test]
    fn effective_addresses() {
        let mut g = [0u64; 16];
        g[0] = 0x1000; // rax
        g[1] = 0x10; // rcx
        g[12] = 0xffff_ffff_ffff_fff0; // r12
        let m = mem(&[0x0f, 0xae, 0x54, 0xc8, 0x10]); // 0x10(%rax,%rcx,8)
        assert_eq!(m.address(&g, 0, 0, 0), 0x1000 + 0x80 + 0x10);
        let m = mem(&[0x0f, 0xae, 0x15, 0xf0, 0xff, 0xff, 0xff]); // -0x10(%rip)
        assert_eq!(m.address(&g, 0xffff_ffff_8100_0007, 0, 0), 0xffff_ffff_80ff_fff7);
        let m = mem(&[0x41, 0x0f, 0xae, 0x54, 0x24, 0x20]); // 0x20(%r12): wraps
        assert_eq!(m.address(&g, 0, 0, 0), 0x10);
        let m = mem(&[0x67, 0x41, 0x0f, 0xae, 0x54, 0x24, 0x20]); // addr32: 0x20(%r12d)
        assert_eq!(m.address(&g, 0, 0, 0), 0x10);
        g[12] = 0x1_0000_0000;
        assert_eq!(m.address(&g, 0, 0, 0), 0x20);
        let m = mem(&[0x64, 0x0f, 0xae, 0x10]); // %fs:(%rax)
        assert_eq!(m.address(&g, 0, 0x7000_0000, 0x9000_0000), 0x7000_1000);
        let m = mem(&[0x65, 0x0f, 0xae, 0x10]); // %gs:(%rax)
        assert_eq!(m.address(&g, 0, 0x7000_0000, 0x9000_0000), 0x9000_1000);
    }

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
