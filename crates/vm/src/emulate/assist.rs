//! Emulation assists: instructions this project's nested KVM stops on with "emulation failure"
//! (KVM_EXIT_INTERNAL_ERROR, suberror KVM_INTERNAL_ERROR_EMULATION) that kumo can carry out in
//! the VMM and then let the vCPU continue (see `/work/shared/NESTED-KVM.md`):
//!
//! | instruction | what kumo does |
//! |---|---|
//! | `INT3` (`cc`) | RIP += 1, injects #BP (a trap: the handler sees the RIP after the INT3) |
//! | `FWAIT` (`9b`) | RIP += 1 (no x87 exception is ever pending: kumo's guests and Linux run with CR0.NE and masked x87 exceptions) |
//! | `LDMXCSR m32` (`0f ae /2`) | reads the operand from guest memory into MXCSR (vCPU XSAVE area, offset 24) |
//! | `STMXCSR m32` (`0f ae /3`) | writes MXCSR to guest memory |
//! | `CLAC` / `STAC` (`0f 01 ca/cb`) | clears / sets RFLAGS.AC, if the guest enabled SMAP (CR4.SMAP); otherwise declined |
//! | `POPCNT r, r/m` (`f3 0f b8 /r`, 16/32/64-bit) | counts, writes the register, sets ZF, clears OF/SF/AF/CF/PF |
//! | `RDTSCP` (`0f 01 f9`) | EDX:EAX = the vCPU's TSC (MSR 0x10), ECX = TSC_AUX (MSR 0xc0000103) |
//!
//! The guest sees SMAP, POPCNT and RDTSCP in CPUID although kumo masks them (the nested host
//! leaks them), so Linux patches these instructions in at boot.
//!
//! The decoding is `super::decode`'s (the one x86 decoder); the semantics here are pure and
//! unit-tested; the vCPU side (`crate::vcpu`) implements [`AssistCpu`] with KVM ioctls.
//! Anything kumo cannot do correctly (a memory operand that does not translate or is not RAM, a
//! 16/32-bit code segment with a memory operand, LOCK prefixes) is declined, and the emulation
//! failure is reported as before.

use kvm_bindings::{kvm_regs, kvm_sregs};

pub use super::decode::{decode, Insn, MemOperand, Rm, Seg};

/// The instructions kumo assists with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AssistKind {
    Int3,
    Fwait,
    Ldmxcsr,
    Stmxcsr,
    Clac,
    Stac,
    Popcnt,
    Rdtscp,
}

impl AssistKind {
    pub const ALL: [AssistKind; 8] = [
        AssistKind::Int3,
        AssistKind::Fwait,
        AssistKind::Ldmxcsr,
        AssistKind::Stmxcsr,
        AssistKind::Clac,
        AssistKind::Stac,
        AssistKind::Popcnt,
        AssistKind::Rdtscp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AssistKind::Int3 => "INT3",
            AssistKind::Fwait => "FWAIT",
            AssistKind::Ldmxcsr => "LDMXCSR",
            AssistKind::Stmxcsr => "STMXCSR",
            AssistKind::Clac => "CLAC",
            AssistKind::Stac => "STAC",
            AssistKind::Popcnt => "POPCNT",
            AssistKind::Rdtscp => "RDTSCP",
        }
    }

    fn index(self) -> usize {
        AssistKind::ALL.iter().position(|k| *k == self).expect("in ALL")
    }
}

/// How many assists of each kind a vCPU (or a VM, summed) performed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AssistCounts([u64; AssistKind::ALL.len()]);

impl AssistCounts {
    pub fn add(&mut self, k: AssistKind) {
        self.0[k.index()] += 1;
    }

    pub fn get(&self, k: AssistKind) -> u64 {
        self.0[k.index()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub fn merge(&mut self, other: &AssistCounts) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a += b;
        }
    }

    /// `INT3=12 LDMXCSR=3` (kinds that fired only), or `none`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = AssistKind::ALL
            .iter()
            .filter(|k| self.get(**k) > 0)
            .map(|k| format!("{}={}", k.name(), self.get(*k)))
            .collect();
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(" ")
        }
    }
}

/// Exception vectors an assist may raise.
pub const VEC_UD: u8 = 6;
pub const VEC_BP: u8 = 3;
pub const VEC_NM: u8 = 7;
pub const VEC_GP: u8 = 13;

/// MXCSR's byte offset in the legacy (FXSAVE) region of an XSAVE area; MXCSR_MASK follows.
pub const XSAVE_MXCSR_OFFSET: usize = 24;
pub const XSAVE_MXCSR_MASK_OFFSET: usize = 28;
/// The MXCSR_MASK to assume when the area holds 0 there (Intel SDM 11.6.6).
pub const MXCSR_MASK_DEFAULT: u32 = 0xffbf;

/// MXCSR from a `kvm_xsave` region (`[u32; 1024]`).
pub fn xsave_mxcsr(region: &[u32]) -> u32 {
    region[XSAVE_MXCSR_OFFSET / 4]
}

/// MXCSR_MASK from a `kvm_xsave` region, with the architectural default for 0.
pub fn xsave_mxcsr_mask(region: &[u32]) -> u32 {
    match region[XSAVE_MXCSR_MASK_OFFSET / 4] {
        0 => MXCSR_MASK_DEFAULT,
        m => m,
    }
}

/// The XSAVE header's XSTATE_BV (which state components the area holds) is at byte 512.
pub const XSAVE_XSTATE_BV_OFFSET: usize = 512;
/// XSTATE_BV bits of the x87 and SSE components.
pub const XSTATE_FP_SSE: u32 = 0b11;

/// Sets MXCSR in a `kvm_xsave` region, and marks the x87 and SSE components present in
/// XSTATE_BV: KVM_SET_XSAVE takes MXCSR only when FP, SSE or YMM is marked, and a vCPU that has
/// not touched them yet reads back with XSTATE_BV 0 (the init optimization), so without this
/// the write is silently dropped. KVM_GET_XSAVE fills unmarked components with their init
/// values, so marking them keeps the state the vCPU had.
pub fn set_xsave_mxcsr(region: &mut [u32], mxcsr: u32) {
    region[XSAVE_MXCSR_OFFSET / 4] = mxcsr;
    region[XSAVE_XSTATE_BV_OFFSET / 4] |= XSTATE_FP_SSE;
}

/// The general registers of `r` indexed by x86 register number (RAX, RCX, RDX, RBX, RSP, RBP,
/// RSI, RDI, R8 … R15).
pub fn gprs(r: &kvm_regs) -> [u64; 16] {
    [r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11, r.r12, r.r13, r.r14, r.r15]
}

/// Writes general register `n` (numbered as in [`gprs`]).
pub fn set_gpr(r: &mut kvm_regs, n: u8, v: u64) {
    let slot = match n & 15 {
        0 => &mut r.rax,
        1 => &mut r.rcx,
        2 => &mut r.rdx,
        3 => &mut r.rbx,
        4 => &mut r.rsp,
        5 => &mut r.rbp,
        6 => &mut r.rsi,
        7 => &mut r.rdi,
        8 => &mut r.r8,
        9 => &mut r.r9,
        10 => &mut r.r10,
        11 => &mut r.r11,
        12 => &mut r.r12,
        13 => &mut r.r13,
        14 => &mut r.r14,
        _ => &mut r.r15,
    };
    *slot = v;
}

/// Writes an operand of `size` bytes to register `n` as x86 does: 32-bit results zero-extend,
/// 16-bit ones keep the upper bits.
pub fn write_gpr_sized(r: &mut kvm_regs, n: u8, size: u8, v: u64) {
    let old = gprs(r)[n as usize & 15];
    let new = match size {
        8 => v,
        4 => v & 0xffff_ffff,
        _ => (old & !0xffff) | (v & 0xffff),
    };
    set_gpr(r, n, new);
}

impl Insn {
    pub fn kind(&self) -> AssistKind {
        match self {
            Insn::Int3 => AssistKind::Int3,
            Insn::Fwait => AssistKind::Fwait,
            Insn::Ldmxcsr(_) => AssistKind::Ldmxcsr,
            Insn::Stmxcsr(_) => AssistKind::Stmxcsr,
            Insn::Clac => AssistKind::Clac,
            Insn::Stac => AssistKind::Stac,
            Insn::Popcnt { .. } => AssistKind::Popcnt,
            Insn::Rdtscp => AssistKind::Rdtscp,
        }
    }
}

/// What an assist needs from the vCPU beyond its registers.
pub trait AssistCpu {
    /// Reads guest-virtual memory; false if any byte does not translate or is not RAM.
    fn read_virt(&mut self, gva: u64, buf: &mut [u8]) -> bool;
    /// Writes guest-virtual memory; false if any byte does not translate writably or is not RAM.
    fn write_virt(&mut self, gva: u64, buf: &[u8]) -> bool;
    /// MXCSR and MXCSR_MASK.
    fn mxcsr(&mut self) -> crate::Result<(u32, u32)>;
    fn set_mxcsr(&mut self, mxcsr: u32) -> crate::Result<()>;
    /// Reads an MSR of the vCPU; `None` if KVM refuses it.
    fn rdmsr(&mut self, index: u32) -> crate::Result<Option<u64>>;
}

pub const MSR_IA32_TSC: u32 = 0x10;
pub const MSR_TSC_AUX: u32 = 0xc000_0103;

/// An exception the assist raises in the guest (delivered after the registers are written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exception {
    pub vector: u8,
    pub error_code: Option<u32>,
}

/// What an assist did: the caller writes `regs` back, then injects `exception` if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub kind: AssistKind,
    pub exception: Option<Exception>,
}

use crate::x86::{CR0_EM, CR0_TS, CR4_OSFXSR, CR4_SMAP, CR4_TSD, RFLAGS_AC, RFLAGS_ARITH, RFLAGS_ZF};

/// Carries out `insn` (of `len` bytes at `regs.rip`): updates `regs` (RIP and flags) and guest
/// state through `cpu`. `Ok(None)` declines (the caller reports the emulation failure).
pub fn execute(
    cpu: &mut impl AssistCpu,
    insn: Insn,
    len: usize,
    regs: &mut kvm_regs,
    sregs: &kvm_sregs,
) -> crate::Result<Option<Done>> {
    let next = regs.rip.wrapping_add(len as u64);
    let fault = |vector, error_code| Some(Exception { vector, error_code });
    let cpl = sregs.cs.selector & 3;
    let exception = match insn {
        // A trap: the saved RIP is the next instruction's.
        Insn::Int3 => fault(VEC_BP, None),
        Insn::Fwait => None,
        // A guest that did not turn SMAP on is not one that knows it has it (kumo's CPUID says it
        // has not), so kumo does not decide for it: the failure is reported.
        Insn::Clac | Insn::Stac if sregs.cr4 & CR4_SMAP == 0 => return Ok(None),
        Insn::Clac | Insn::Stac if cpl != 0 => {
            // #UD at the instruction itself (a fault: RIP stays).
            return Ok(Some(Done { kind: insn.kind(), exception: fault(VEC_UD, None) }));
        }
        Insn::Clac => {
            regs.rflags &= !RFLAGS_AC;
            None
        }
        Insn::Stac => {
            regs.rflags |= RFLAGS_AC;
            None
        }
        Insn::Popcnt { dst, src, size } => {
            let v = match src {
                Rm::Reg(n) => gprs(regs)[n as usize],
                Rm::Mem(m) => {
                    let addr = m.address(&gprs(regs), next, sregs.fs.base, sregs.gs.base);
                    let mut b = [0u8; 8];
                    if !cpu.read_virt(addr, &mut b[..size as usize]) {
                        return Ok(None);
                    }
                    u64::from_le_bytes(b)
                }
            };
            let v = if size == 8 { v } else { v & ((1u64 << (size * 8)) - 1) };
            write_gpr_sized(regs, dst, size, v.count_ones() as u64);
            regs.rflags &= !RFLAGS_ARITH;
            if v == 0 {
                regs.rflags |= RFLAGS_ZF;
            }
            None
        }
        Insn::Rdtscp => {
            if sregs.cr4 & CR4_TSD != 0 && cpl != 0 {
                return Ok(Some(Done { kind: insn.kind(), exception: fault(VEC_GP, Some(0)) }));
            }
            let (Some(tsc), Some(aux)) = (cpu.rdmsr(MSR_IA32_TSC)?, cpu.rdmsr(MSR_TSC_AUX)?) else {
                return Ok(None);
            };
            regs.rax = tsc & 0xffff_ffff;
            regs.rdx = tsc >> 32;
            regs.rcx = aux & 0xffff_ffff;
            None
        }
        Insn::Ldmxcsr(m) | Insn::Stmxcsr(m) => {
            // Faults leave RIP at the instruction.
            if sregs.cr0 & CR0_EM != 0 || sregs.cr4 & CR4_OSFXSR == 0 {
                return Ok(Some(Done { kind: insn.kind(), exception: fault(VEC_UD, None) }));
            }
            if sregs.cr0 & CR0_TS != 0 {
                return Ok(Some(Done { kind: insn.kind(), exception: fault(VEC_NM, None) }));
            }
            let addr = m.address(&gprs(regs), next, sregs.fs.base, sregs.gs.base);
            if let Insn::Ldmxcsr(_) = insn {
                let mut v = [0u8; 4];
                if !cpu.read_virt(addr, &mut v) {
                    return Ok(None);
                }
                let v = u32::from_le_bytes(v);
                let (_, mask) = cpu.mxcsr()?;
                if v & !mask != 0 {
                    return Ok(Some(Done { kind: insn.kind(), exception: fault(VEC_GP, Some(0)) }));
                }
                cpu.set_mxcsr(v)?;
            } else {
                let (v, _) = cpu.mxcsr()?;
                if !cpu.write_virt(addr, &v.to_le_bytes()) {
                    return Ok(None);
                }
            }
            None
        }
    };
    regs.rip = next;
    Ok(Some(Done { kind: insn.kind(), exception }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mxcsr_offsets_in_xsave_region() {
        let mut region = [0u32; 1024];
        let bytes = |r: &[u32]| r.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        region[128] = 0x4; // YMM only
        set_xsave_mxcsr(&mut region, 0x1f80);
        assert_eq!(&bytes(&region)[24..28], &0x1f80u32.to_le_bytes());
        assert_eq!(&bytes(&region)[512..520], &[0x7, 0, 0, 0, 0, 0, 0, 0], "XSTATE_BV gains FP and SSE");
        assert_eq!(xsave_mxcsr(&region), 0x1f80);
        assert_eq!(xsave_mxcsr_mask(&region), MXCSR_MASK_DEFAULT);
        region[7] = 0xffff;
        assert_eq!(xsave_mxcsr_mask(&region), 0xffff);
        assert_eq!(bytes(&region)[28..32], [0xff, 0xff, 0, 0]);
    }

    #[test]
    fn counts() {
        let mut c = AssistCounts::default();
        assert_eq!(c.summary(), "none");
        c.add(AssistKind::Int3);
        c.add(AssistKind::Int3);
        c.add(AssistKind::Ldmxcsr);
        let mut d = AssistCounts::default();
        d.add(AssistKind::Fwait);
        c.merge(&d);
        assert_eq!(c.summary(), "INT3=2 FWAIT=1 LDMXCSR=1");
        assert_eq!((c.total(), c.get(AssistKind::Stmxcsr)), (4, 0));
    }

    /// A fake vCPU: a flat page-granular guest-virtual memory and MXCSR.
    struct Fake {
        mem: HashMap<u64, u8>,
        mxcsr: u32,
        mask: u32,
    }

    impl AssistCpu for Fake {
        fn read_virt(&mut self, gva: u64, buf: &mut [u8]) -> bool {
            for (i, b) in buf.iter_mut().enumerate() {
                match self.mem.get(&(gva + i as u64)) {
                    Some(v) => *b = *v,
                    None => return false,
                }
            }
            true
        }
        fn write_virt(&mut self, gva: u64, buf: &[u8]) -> bool {
            if (0..buf.len() as u64).any(|i| !self.mem.contains_key(&(gva + i))) {
                return false;
            }
            for (i, b) in buf.iter().enumerate() {
                self.mem.insert(gva + i as u64, *b);
            }
            true
        }
        fn mxcsr(&mut self) -> crate::Result<(u32, u32)> {
            Ok((self.mxcsr, self.mask))
        }
        fn set_mxcsr(&mut self, mxcsr: u32) -> crate::Result<()> {
            self.mxcsr = mxcsr;
            Ok(())
        }
        fn rdmsr(&mut self, index: u32) -> crate::Result<Option<u64>> {
            Ok(match index {
                MSR_IA32_TSC => Some(0x1234_5678_9abc_def0),
                MSR_TSC_AUX => Some(3),
                _ => None,
            })
        }
    }

    fn sregs64() -> kvm_sregs {
        let mut s = kvm_sregs { cr0: 0x8005_0033, cr4: 0x6a0 | CR4_OSFXSR | CR4_SMAP, ..Default::default() };
        s.cs.l = 1;
        s.cs.selector = 0x10;
        s
    }

    fn run(cpu: &mut Fake, code: &[u8], regs: &mut kvm_regs, sregs: &kvm_sregs) -> Option<Done> {
        let (insn, len) = decode(code, sregs.cs.l == 1).expect("decodes");
        execute(cpu, insn, len, regs, sregs).unwrap()
    }

    #[test]
    fn executes() {
        let mut cpu = Fake { mem: (0x2000..0x2010).map(|a| (a, 0)).collect(), mxcsr: 0x1f80, mask: 0xffff };
        cpu.mem.insert(0x2004, 0xa0); // 0x9fa0 at 0x2004 (little endian 0x1fa0 | 0x8000)
        cpu.mem.insert(0x2005, 0x9f);
        let s = sregs64();
        let mut r = kvm_regs { rip: 0x1000, rdi: 0x2000, rflags: 0x2, ..Default::default() };

        // ldmxcsr 4(%rdi)
        let d = run(&mut cpu, &[0x0f, 0xae, 0x57, 0x04], &mut r, &s).unwrap();
        assert_eq!((d.kind, d.exception, r.rip, cpu.mxcsr), (AssistKind::Ldmxcsr, None, 0x1004, 0x9fa0));
        // stmxcsr 8(%rdi)
        let d = run(&mut cpu, &[0x0f, 0xae, 0x5f, 0x08], &mut r, &s).unwrap();
        assert_eq!((d.kind, r.rip), (AssistKind::Stmxcsr, 0x1008));
        assert_eq!((cpu.mem[&0x2008], cpu.mem[&0x2009], cpu.mem[&0x200a]), (0xa0, 0x9f, 0));
        // reserved MXCSR bits: #GP(0), RIP stays
        cpu.mem.insert(0x200e, 0x01); // value 0x0001_0000 at 0x200c
        let d = run(&mut cpu, &[0x0f, 0xae, 0x57, 0x0c], &mut r, &s).unwrap();
        assert_eq!(
            (d.exception, r.rip, cpu.mxcsr),
            (Some(Exception { vector: VEC_GP, error_code: Some(0) }), 0x1008, 0x9fa0)
        );
        // unmapped operand: declined, nothing changed
        r.rdi = 0x9000;
        assert_eq!(run(&mut cpu, &[0x0f, 0xae, 0x57, 0x04], &mut r, &s), None);
        assert_eq!(run(&mut cpu, &[0x0f, 0xae, 0x5f, 0x04], &mut r, &s), None);
        assert_eq!(r.rip, 0x1008);
        // CR0.TS: #NM; no OSFXSR: #UD
        let mut ts = s;
        ts.cr0 |= CR0_TS;
        assert_eq!(run(&mut cpu, &[0x0f, 0xae, 0x57, 0x04], &mut r, &ts).unwrap().exception.unwrap().vector, VEC_NM);
        let mut nofx = s;
        nofx.cr4 &= !CR4_OSFXSR;
        assert_eq!(run(&mut cpu, &[0x0f, 0xae, 0x57, 0x04], &mut r, &nofx).unwrap().exception.unwrap().vector, VEC_UD);
        assert_eq!(r.rip, 0x1008);

        // int3: trap, RIP after it
        let d = run(&mut cpu, &[0xcc], &mut r, &s).unwrap();
        assert_eq!((d.exception, r.rip), (Some(Exception { vector: VEC_BP, error_code: None }), 0x1009));
        // fwait: skipped
        let d = run(&mut cpu, &[0x9b], &mut r, &s).unwrap();
        assert_eq!((d.kind, d.exception, r.rip), (AssistKind::Fwait, None, 0x100a));
        // stac / clac
        run(&mut cpu, &[0x0f, 0x01, 0xcb], &mut r, &s).unwrap();
        assert_eq!((r.rflags & RFLAGS_AC, r.rip), (RFLAGS_AC, 0x100d));
        run(&mut cpu, &[0x0f, 0x01, 0xca], &mut r, &s).unwrap();
        assert_eq!((r.rflags, r.rip), (0x2, 0x1010));
        // ... but #UD outside ring 0
        let mut user = s;
        user.cs.selector = 0x33;
        let d = run(&mut cpu, &[0x0f, 0x01, 0xcb], &mut r, &user).unwrap();
        assert_eq!((d.exception.unwrap().vector, r.rflags, r.rip), (VEC_UD, 0x2, 0x1010));
        // ... and declined when the guest did not enable SMAP
        let mut nosmap = s;
        nosmap.cr4 &= !CR4_SMAP;
        assert_eq!(run(&mut cpu, &[0x0f, 0x01, 0xcb], &mut r, &nosmap), None);
        assert_eq!((r.rflags, r.rip), (0x2, 0x1010));

        // rdtscp
        r.rcx = u64::MAX;
        let d = run(&mut cpu, &[0x0f, 0x01, 0xf9], &mut r, &s).unwrap();
        assert_eq!((d.kind, r.rax, r.rdx, r.rcx, r.rip), (AssistKind::Rdtscp, 0x9abc_def0, 0x1234_5678, 3, 0x1013));
        let mut tsd = user;
        tsd.cr4 |= CR4_TSD;
        let d = run(&mut cpu, &[0x0f, 0x01, 0xf9], &mut r, &tsd).unwrap();
        assert_eq!((d.exception, r.rip), (Some(Exception { vector: VEC_GP, error_code: Some(0) }), 0x1013));
    }

    #[test]
    fn popcnt() {
        let mut cpu = Fake { mem: (0x2000..0x2010).map(|a| (a, 0xff)).collect(), mxcsr: 0x1f80, mask: 0xffff };
        let s = sregs64();
        let mut r = kvm_regs {
            rip: 0x1000,
            rdi: 0xf0f0_0000_0000_0007,
            rax: u64::MAX,
            rflags: 0x2 | RFLAGS_ZF | 1,
            ..Default::default()
        };
        // popcnt %rdi,%rax: f3 48 0f b8 c7 (what Linux's hweight64 is patched to)
        assert_eq!(
            decode(&[0xf3, 0x48, 0x0f, 0xb8, 0xc7], true),
            Some((Insn::Popcnt { dst: 0, src: Rm::Reg(7), size: 8 }, 5))
        );
        run(&mut cpu, &[0xf3, 0x48, 0x0f, 0xb8, 0xc7], &mut r, &s).unwrap();
        assert_eq!((r.rax, r.rflags, r.rip), (11, 0x2, 0x1005));
        // popcnt %edi,%eax: f3 0f b8 c7 — 32-bit: upper source bits ignored, result zero-extends
        r.rax = u64::MAX;
        run(&mut cpu, &[0xf3, 0x0f, 0xb8, 0xc7], &mut r, &s).unwrap();
        assert_eq!((r.rax, r.rip), (3, 0x1009));
        // popcnt %di,%ax: 66 f3 0f b8 c7 — 16-bit: upper destination bits kept
        r.rax = 0xaaaa_0000_0000_ffff;
        run(&mut cpu, &[0x66, 0xf3, 0x0f, 0xb8, 0xc7], &mut r, &s).unwrap();
        assert_eq!((r.rax, r.rip), (0xaaaa_0000_0000_0003, 0x100e));
        // popcnt (%rsi),%r9 with a zero source: ZF
        r.rsi = 0x2000;
        for a in 0x2000..0x2008 {
            cpu.mem.insert(a, 0);
        }
        let (i, len) = decode(&[0xf3, 0x4c, 0x0f, 0xb8, 0x0e], true).unwrap();
        assert_eq!(
            (i, len),
            (
                Insn::Popcnt {
                    dst: 9,
                    src: Rm::Mem(MemOperand {
                        base: Some(6),
                        index: None,
                        disp: 0,
                        rip_relative: false,
                        addr32: false,
                        seg: None
                    }),
                    size: 8
                },
                5
            )
        );
        r.r9 = 77;
        run(&mut cpu, &[0xf3, 0x4c, 0x0f, 0xb8, 0x0e], &mut r, &s).unwrap();
        assert_eq!((r.r9, r.rflags), (0, 0x2 | RFLAGS_ZF));
        // 0x8(%rsi): 0xffff… bytes → 32 bits set with a 32-bit operand
        run(&mut cpu, &[0xf3, 0x0f, 0xb8, 0x46, 0x08], &mut r, &s).unwrap();
        assert_eq!((r.rax, r.rflags), (32, 0x2));
        // unmapped memory source: declined
        r.rsi = 0x9000;
        assert_eq!(run(&mut cpu, &[0xf3, 0x0f, 0xb8, 0x06], &mut r, &s), None);
        // f2 0f b8 is not POPCNT
        assert_eq!(decode(&[0xf2, 0x0f, 0xb8, 0xc7], true), None);
        assert_eq!(decode(&[0x0f, 0xb8, 0xc7], true), None);
    }
}

/// Assists on the real KVM, with tiny raw-code guests (skipped without /dev/kvm). Whether this
/// host's KVM fails on these instructions or runs them itself, the guest must see x86 semantics.
#[cfg(test)]
mod kvm_tests {
    use kumo_devices::DeviceEvent;

    use super::{AssistCounts, AssistKind};
    use crate::testing::CODE;
    use crate::VcpuRun;

    /// Runs ring-0 code at 1 MiB (with `data` written at its addresses) until it writes the exit
    /// port; returns the exit code and the assists that fired.
    fn run(code: &[u8], data: &[(u64, &[u8])]) -> Option<(u32, AssistCounts)> {
        let mut g = crate::testing::RawGuest::new(code, data)?;
        match g.run().unwrap() {
            VcpuRun::Device(DeviceEvent::GuestExit(c)) => Some((c, g.vcpu.assist_counts())),
            other => panic!("guest ended with {other:?}"),
        }
    }

    /// `mov $0x501,%dx; out %eax,(%dx)`
    const EXIT_EAX: [u8; 5] = [0x66, 0xba, 0x01, 0x05, 0xef];

    #[test]
    fn int3_is_delivered_as_breakpoint_trap_to_the_idt_handler() {
        // IDT at 0x200010 with vector 3 → handler at 1 MiB + 0x100 (64-bit interrupt gate, CS
        // 0x08); `lidt` operand at 0x200000.
        let mut idtr = Vec::new();
        idtr.extend_from_slice(&0xffu16.to_le_bytes());
        idtr.extend_from_slice(&0x20_0010u64.to_le_bytes());
        let handler = CODE + 0x100;
        let mut gate = Vec::new();
        gate.extend_from_slice(&(handler as u16).to_le_bytes());
        gate.extend_from_slice(&0x08u16.to_le_bytes());
        gate.extend_from_slice(&[0, 0x8e]);
        gate.extend_from_slice(&((handler >> 16) as u16).to_le_bytes());
        gate.extend_from_slice(&((handler >> 32) as u32).to_le_bytes());
        gate.extend_from_slice(&[0; 4]);

        let mut code = vec![
            0x48, 0xc7, 0xc4, 0x00, 0x00, 0x30, 0x00, // mov $0x300000,%rsp
            0x0f, 0x01, 0x1c, 0x25, 0x00, 0x00, 0x20, 0x00, // lidt 0x200000
            0xcc, // int3 (offset 15)
            0xb8, 99, 0, 0, 0, // mov $99,%eax: only reached if no #BP was delivered
        ];
        code.extend_from_slice(&EXIT_EAX);
        code.resize(0x100, 0x90);
        code.extend_from_slice(&[
            0x48, 0x8b, 0x04, 0x24, // mov (%rsp),%rax: the saved RIP
            0x2d, 0x00, 0x00, 0x10, 0x00, // sub $0x100000,%eax
        ]);
        code.extend_from_slice(&EXIT_EAX);
        let Some((exit, counts)) = run(&code, &[(0x20_0000, &idtr), (0x20_0010 + 3 * 16, &gate)]) else {
            return;
        };
        assert_eq!(exit, 16, "the #BP handler must run with the saved RIP just after the INT3");
        eprintln!("assists: {}", counts.summary());
    }

    #[test]
    fn fwait_ldmxcsr_stmxcsr_round_trip() {
        let mut code = vec![
            0x9b, // fwait
            0x0f, 0xae, 0x14, 0x25, 0x00, 0x01, 0x20, 0x00, // ldmxcsr 0x200100
            0x0f, 0xae, 0x1c, 0x25, 0x04, 0x01, 0x20, 0x00, // stmxcsr 0x200104
            0x8b, 0x04, 0x25, 0x04, 0x01, 0x20, 0x00, // mov 0x200104,%eax
        ];
        code.extend_from_slice(&EXIT_EAX);
        let Some((exit, counts)) = run(&code, &[(0x20_0100, &0x1fa0u32.to_le_bytes())]) else {
            return;
        };
        eprintln!("assists: {}", counts.summary());
        assert_eq!(exit, 0x1fa0, "MXCSR must come back as loaded");
        assert!(counts.get(AssistKind::Int3) == 0);
    }
}
