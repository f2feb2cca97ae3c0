//! The x86 decoder (`kumo_vm::emulate::decode`) and the emulation assists carried out on its
//! result (`assist::execute`): the bytes come from guest memory at the guest's RIP, the
//! registers and page tables are the guest's.

use std::collections::HashMap;

use iced_x86::Mnemonic;
use kumo_vm::emulate::assist::{self, AssistCpu, Done, Exception, Insn, MemOperand, Rm, VEC_BP};
use kumo_vm::emulate::decode::{decode_modrm, decode_prefixes, describe};
use kvm_bindings::{kvm_regs, kvm_sregs};

use crate::{CaseResult, Input};

/// Bytes that make the decoder's interesting paths likely: prefixes, REX, the escape and the
/// opcodes kumo assists with.
const BYTES: &[u8] = &[
    0x0f, 0x0f, 0x01, 0xae, 0xb8, 0xca, 0xcb, 0xf9, 0xcc, 0x9b, 0xf0, 0xf2, 0xf3, 0x66, 0x67, 0x64, 0x65, 0x2e, 0x26,
    0x40, 0x41, 0x44, 0x48, 0x4c, 0x4f, 0x14, 0x15, 0x24, 0x25, 0x55, 0x17, 0x54, 0x94, 0xc0, 0xc7,
];

const PREFIXES: &[u8] =
    &[0x66, 0x67, 0xf2, 0xf3, 0x64, 0x65, 0x2e, 0x3e, 0xf0, 0x40, 0x41, 0x42, 0x44, 0x48, 0x4d, 0x4f];

/// Instruction bytes: mostly an assisted instruction's form (prefixes, opcode, a ModRM with the
/// right /digit, SIB and displacement bytes), sometimes bytes near the decoder's paths.
fn instruction_bytes(u: &mut Input<'_>) -> arbitrary::Result<Vec<u8>> {
    if u.ratio(1, 4)? {
        let n = u.int_in_range(0..=20)?;
        return (0..n)
            .map(|_| if u.ratio(2, 3)? { Ok(BYTES[u.choose_index(BYTES.len())?]) } else { u.arbitrary() })
            .collect();
    }
    let mut v: Vec<u8> = Vec::new();
    for _ in 0..u.int_in_range(0..=3)? {
        v.push(PREFIXES[u.choose_index(PREFIXES.len())?]);
    }
    match u.int_in_range(0..=4)? {
        0 => v.push([0xcc, 0x9b][u.choose_index(2)?]),
        1 => v.extend([0x0f, 0x01, [0xca, 0xcb, 0xf9][u.choose_index(3)?]]),
        2 => {
            // POPCNT: F3 before any REX.
            if !v.contains(&0xf3) {
                v.insert(0, 0xf3);
            }
            v.extend([0x0f, 0xb8, u.arbitrary()?]);
        }
        _ => {
            let modrm: u8 = u.arbitrary()?;
            let digit = [2u8, 3][u.choose_index(2)?];
            v.extend([0x0f, 0xae, (modrm & !0x38) | digit << 3]);
        }
    }
    for _ in 0..u.int_in_range(0..=6)? {
        v.push(u.arbitrary()?);
    }
    Ok(v)
}

fn check_mem(m: &MemOperand) {
    assert!(m.base.is_none_or(|b| b < 16), "{m:?}");
    assert!(m.index.is_none_or(|(i, s)| i < 16 && [1, 2, 4, 8].contains(&s)), "{m:?}");
    assert!(!(m.rip_relative && m.base.is_some()), "{m:?}");
}

/// What the decoder promises for any bytes.
fn check_decode(b: &[u8], long_mode: bool) -> Option<(Insn, usize)> {
    let p = decode_prefixes(b);
    assert!(p.len <= b.len().min(14), "prefixes of {b:02x?}: {p:?}");
    if let Some(m) = decode_modrm(&b[p.len..], &p) {
        assert!(m.len >= 1 && m.len <= b.len() - p.len, "{b:02x?}: {m:?}");
    }
    let d = assist::decode(b, long_mode);
    if let Some((insn, len)) = d {
        assert!((1..=15).contains(&len) && len <= b.len(), "{b:02x?} decoded as {insn:?} of {len} bytes");
        // Only its own bytes matter: what follows changes nothing.
        assert_eq!(assist::decode(&b[..len], long_mode), d, "{b:02x?}");
        assert!(describe(b).is_some(), "{b:02x?} decodes as {insn:?} but has no name");
        match insn {
            Insn::Ldmxcsr(m) | Insn::Stmxcsr(m) => check_mem(&m),
            Insn::Popcnt { dst, src, size } => {
                assert!(dst < 16 && [2, 4, 8].contains(&size), "{insn:?}");
                match src {
                    Rm::Reg(r) => assert!(r < 16, "{insn:?}"),
                    Rm::Mem(m) => check_mem(&m),
                }
            }
            _ => {}
        }
    }
    let _ = describe(b);
    if let Some((insn, len)) = d {
        oracle(b, long_mode, &insn, len);
    }
    d
}

/// iced-x86, an independent x86 decoder, must see the same instruction with the same length.
fn oracle(b: &[u8], long_mode: bool, insn: &Insn, len: usize) {
    let mut dec = iced_x86::Decoder::new(if long_mode { 64 } else { 32 }, b, iced_x86::DecoderOptions::NONE);
    let i = dec.decode();
    let want = match insn {
        Insn::Int3 => Mnemonic::Int3,
        Insn::Fwait => Mnemonic::Wait,
        Insn::Ldmxcsr(_) => Mnemonic::Ldmxcsr,
        Insn::Stmxcsr(_) => Mnemonic::Stmxcsr,
        Insn::Clac => Mnemonic::Clac,
        Insn::Stac => Mnemonic::Stac,
        Insn::Popcnt { .. } => Mnemonic::Popcnt,
        Insn::Rdtscp => Mnemonic::Rdtscp,
    };
    assert_eq!(i.mnemonic(), want, "{b:02x?}: kumo decodes {insn:?}, iced-x86 {:?}", i.code());
    assert_eq!(i.len(), len, "{b:02x?}: kumo decodes {insn:?} of {len} bytes, iced-x86 {:?} of {}", i.code(), i.len());
    if let Insn::Popcnt { dst, size, .. } = insn {
        assert_eq!(i.op0_register().size(), *size as usize, "{b:02x?}: {:?}", i.code());
        assert_eq!(gpr_number(i.op0_register()), Some(*dst), "{b:02x?}: {:?}", i.code());
    }
}

fn gpr_number(r: iced_x86::Register) -> Option<u8> {
    let full = r.full_register();
    let n = full as u32;
    (full.is_gpr64()).then(|| (n - iced_x86::Register::RAX as u32) as u8)
}

/// The effective address kumo computes is the one iced-x86 computes from the same registers.
fn oracle_address(b: &[u8], m: &MemOperand, r: &kvm_regs, s: &kvm_sregs, len: usize) {
    let mut dec = iced_x86::Decoder::with_ip(64, b, r.rip, iced_x86::DecoderOptions::NONE);
    let i = dec.decode();
    let g = assist::gprs(r);
    let value = |reg: iced_x86::Register, _: usize, _: usize| -> Option<u64> {
        use iced_x86::Register as R;
        Some(match reg {
            R::FS => s.fs.base,
            R::GS => s.gs.base,
            R::ES | R::CS | R::SS | R::DS => 0,
            R::RIP => r.rip.wrapping_add(len as u64),
            R::EIP => r.rip.wrapping_add(len as u64) & 0xffff_ffff,
            other => {
                let v = g[gpr_number(other)? as usize];
                if other.size() == 4 {
                    v & 0xffff_ffff
                } else {
                    v
                }
            }
        })
    };
    let Some(want) = i.virtual_address(0, 0, value) else { return };
    let got = m.address(&g, r.rip.wrapping_add(len as u64), s.fs.base, s.gs.base);
    assert_eq!(got, want, "{b:02x?} ({:?}): kumo's address {got:#x}, iced-x86's {want:#x}", i.code());
}

/// A guest-virtual address space of 4 KiB pages, some read-only, and MXCSR.
struct Fake {
    pages: HashMap<u64, (bool, [u8; 64])>,
    mxcsr: u32,
    mask: u32,
    tsc: Option<u64>,
}

impl Fake {
    fn page(&self, gva: u64, write: bool) -> bool {
        self.pages.get(&(gva >> 12)).is_some_and(|p| !write || p.0)
    }
}

impl AssistCpu for Fake {
    fn read_virt(&mut self, gva: u64, buf: &mut [u8]) -> bool {
        for (i, b) in buf.iter_mut().enumerate() {
            let a = gva.wrapping_add(i as u64);
            match self.pages.get(&(a >> 12)) {
                Some(p) => *b = p.1[(a & 63) as usize],
                None => return false,
            }
        }
        true
    }
    fn write_virt(&mut self, gva: u64, buf: &[u8]) -> bool {
        if (0..buf.len() as u64).any(|i| !self.page(gva.wrapping_add(i), true)) {
            return false;
        }
        for (i, b) in buf.iter().enumerate() {
            let a = gva.wrapping_add(i as u64);
            if let Some(p) = self.pages.get_mut(&(a >> 12)) {
                p.1[(a & 63) as usize] = *b;
            }
        }
        true
    }
    fn mxcsr(&mut self) -> kumo_vm::Result<(u32, u32)> {
        Ok((self.mxcsr, self.mask))
    }
    fn set_mxcsr(&mut self, mxcsr: u32) -> kumo_vm::Result<()> {
        self.mxcsr = mxcsr;
        Ok(())
    }
    fn rdmsr(&mut self, _index: u32) -> kumo_vm::Result<Option<u64>> {
        Ok(self.tsc)
    }
}

fn regs(u: &mut Input<'_>) -> arbitrary::Result<kvm_regs> {
    let mut small = || -> arbitrary::Result<u64> {
        // Addresses near the pages the fake maps, or anything.
        Ok(if u.ratio(3, 4)? { u.int_in_range(0..=0x3fff)? } else { u.arbitrary()? })
    };
    Ok(kvm_regs {
        rax: small()?,
        rbx: small()?,
        rcx: small()?,
        rdx: small()?,
        rsi: small()?,
        rdi: small()?,
        rsp: small()?,
        rbp: small()?,
        r8: small()?,
        r12: small()?,
        r13: small()?,
        r15: small()?,
        rip: small()?,
        rflags: u.arbitrary::<u64>()? | 2,
        ..Default::default()
    })
}

fn sregs(u: &mut Input<'_>) -> arbitrary::Result<kvm_sregs> {
    let mut s = kvm_sregs { cr0: u.arbitrary()?, cr4: u.arbitrary()?, ..Default::default() };
    s.cs.l = u.arbitrary::<bool>()? as u8;
    s.cs.selector = u.arbitrary()?;
    s.fs.base = if u.arbitrary()? { u.int_in_range(0..=0x3000)? } else { u.arbitrary()? };
    s.gs.base = u.arbitrary()?;
    Ok(s)
}

/// Registers an assist may write, by instruction.
fn others_unchanged(insn: &Insn, before: &kvm_regs, after: &kvm_regs) {
    let mut a = *after;
    let b = before;
    a.rip = b.rip;
    a.rflags = b.rflags;
    match insn {
        Insn::Popcnt { dst, .. } => assist::set_gpr(&mut a, *dst, assist::gprs(b)[*dst as usize]),
        Insn::Rdtscp => (a.rax, a.rcx, a.rdx) = (b.rax, b.rcx, b.rdx),
        _ => {}
    }
    assert_eq!(assist::gprs(&a), assist::gprs(b), "{insn:?} changed registers it does not write");
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let bytes = instruction_bytes(u)?;
    let long_mode = u.ratio(7, 8)?;
    let Some((insn, len)) = check_decode(&bytes, long_mode) else { return Ok(()) };
    let mut pages = HashMap::new();
    for _ in 0..u.int_in_range(0..=4)? {
        pages.insert(u.int_in_range(0..=3)?, (u.arbitrary()?, u.arbitrary()?));
    }
    let mask = if u.arbitrary()? { 0xffbf } else { u.arbitrary()? };
    let mut cpu = Fake { pages, mxcsr: 0x1f80 & mask, mask, tsc: u.arbitrary()? };
    let mut r = regs(u)?;
    let mut s = sregs(u)?;
    s.cs.l = long_mode as u8;
    if let (Insn::Ldmxcsr(m) | Insn::Stmxcsr(m), true) = (&insn, long_mode) {
        oracle_address(&bytes, m, &r, &s, len);
    }
    let before = r;
    let mxcsr_before = cpu.mxcsr;
    let done = assist::execute(&mut cpu, insn, len, &mut r, &s).expect("the fake vCPU never fails");
    match done {
        None => assert_eq!(format!("{r:?}"), format!("{before:?}"), "a declined {insn:?} changed registers"),
        Some(Done { kind, exception }) => {
            assert_eq!(kind, insn.kind());
            others_unchanged(&insn, &before, &r);
            let next = before.rip.wrapping_add(len as u64);
            match exception {
                // Traps and completed instructions move past it; faults stay on it.
                None | Some(Exception { vector: VEC_BP, .. }) => assert_eq!(r.rip, next, "{insn:?}"),
                Some(e) => {
                    assert_eq!(r.rip, before.rip, "{insn:?} faulted with {e:?} but moved RIP");
                    assert_eq!(cpu.mxcsr, mxcsr_before, "{insn:?} faulted but changed MXCSR");
                }
            }
            // Only RFLAGS bits an instruction defines change (and bit 1 stays set).
            let changed = r.rflags ^ before.rflags;
            assert_eq!(changed & !0x4_08d5, 0, "{insn:?} changed RFLAGS {changed:#x}");
            assert_eq!(cpu.mxcsr & !cpu.mask, 0, "{insn:?} loaded reserved MXCSR bits {:#x}", cpu.mxcsr);
        }
    }
    Ok(())
}
