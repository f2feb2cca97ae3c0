//! The userspace interrupt controllers of `--irqchip user` (`kumo_devices::apic`): two local
//! APICs (xAPIC page, x2APIC and base MSRs, acceptance, EOI, LVT, timer), the IOAPIC and the
//! 8259 pair, driven by arbitrary guest accesses, with IPIs and level EOIs routed between them
//! as the VMM does.

use std::sync::Arc;

use arbitrary::Arbitrary;
use kumo_devices::apic::{
    ApicEvent, DeliveryMode, IoApic, Ipi, LapicState, LocalApic, Lvt, ManualClock, Pic, APIC_BASE_MSR, BASE_ENABLE,
    BASE_X2APIC, DEFAULT_APIC_BASE, TSC_DEADLINE_MSR,
};
use kumo_devices::Persist;

use crate::{CaseResult, Input};

#[derive(Debug, Arbitrary)]
enum Op {
    MmioRead {
        cpu: bool,
        off: u16,
        len: u8,
    },
    MmioWrite {
        cpu: bool,
        off: u16,
        val: u32,
        len: u8,
    },
    /// A register write at a 16-byte boundary (most writes that matter).
    RegWrite {
        cpu: bool,
        reg: u8,
        val: u32,
    },
    MsrRead {
        cpu: bool,
        msr: Msr,
    },
    MsrWrite {
        cpu: bool,
        msr: Msr,
        val: u64,
    },
    Base {
        cpu: bool,
        en: bool,
        x2: bool,
    },
    Accept {
        cpu: bool,
        vector: u8,
        level: bool,
    },
    Ack {
        cpu: bool,
    },
    Eoi {
        cpu: bool,
    },
    Msi {
        address: u64,
        data: u32,
    },
    FireLvt {
        cpu: bool,
        lvt: u8,
    },
    Advance {
        ns: u32,
    },
    Expire {
        cpu: bool,
    },
    Cr8 {
        cpu: bool,
        v: u8,
    },
    SaveRestore {
        cpu: bool,
    },
    IoapicRead {
        off: u8,
        len: u8,
    },
    IoapicWrite {
        off: u8,
        val: u32,
        len: u8,
    },
    IoapicIrq {
        pin: u8,
        high: bool,
    },
    PicRead {
        port: u8,
    },
    PicWrite {
        port: u8,
        v: u8,
    },
    PicIrq {
        irq: u8,
        high: bool,
    },
    PicAck,
}

#[derive(Debug, Arbitrary)]
enum Msr {
    Base,
    Deadline,
    X2apic(u8),
    Any(u32),
}

impl Msr {
    fn index(&self) -> u32 {
        match self {
            Msr::Base => APIC_BASE_MSR,
            Msr::Deadline => TSC_DEADLINE_MSR,
            Msr::X2apic(r) => 0x800 + *r as u32,
            Msr::Any(m) => *m,
        }
    }
}

const LVT_WRITABLE: [u32; 6] = [0x0007_00FF, 0x0001_07FF, 0x0001_07FF, 0x0001_A7FF, 0x0001_A7FF, 0x0001_00FF];
const PIC_PORTS: [u16; 7] = [0x20, 0x21, 0xA0, 0xA1, 0x4D0, 0x4D1, 0x80];

/// The VM: what `kumo_vm::uapic` wires together.
struct Chips {
    clock: Arc<ManualClock>,
    lapics: [LocalApic; 2],
    ioapic: IoApic,
    pic: Pic,
}

/// The register semantics a saved LAPIC state must keep, whatever the guest did.
pub fn check_lapic(s: &LapicState) {
    assert_eq!(s.svr & !0x3FF, 0, "SVR {:#x}", s.svr);
    for (i, (v, w)) in s.lvt.iter().zip(LVT_WRITABLE).enumerate() {
        assert_eq!(v & !w, 0, "LVT {i} {v:#x}");
    }
    for (name, set) in [("IRR", &s.irr), ("ISR", &s.isr)] {
        assert_eq!(set.word(0) & 0xFFFF, 0, "{name} holds an illegal vector: {set:?}");
    }
    assert_eq!(s.dfr | 0x0FFF_FFFF, s.dfr, "DFR {:#x}", s.dfr);
    assert_eq!(s.timer.divide & !0b1011, 0, "divide {:#x}", s.timer.divide);
    let reserved = !(0x000F_FFFF_FFFF_F000 | 1 << 8 | BASE_X2APIC | BASE_ENABLE);
    assert_eq!(s.base & reserved, 0, "base {:#x}", s.base);
    assert!(s.base & BASE_ENABLE != 0 || s.base & BASE_X2APIC == 0, "base {:#x}", s.base);
}

fn check_ioapic(io: &IoApic) {
    let s = io.state();
    assert!(s.id <= 0xF && s.ioregsel <= 0xFF, "{s:?}");
    assert_eq!(s.asserted >> 24, 0, "{s:?}");
    for (pin, e) in s.redir.iter().enumerate() {
        assert_eq!(e & !(0xFF00_0000_0001_AFFF | 1 << 14), 0, "pin {pin}: {e:#x}");
        assert!(e & (1 << 14) == 0 || e & (1 << 15) != 0, "pin {pin}: Remote IRR on an edge entry {e:#x}");
    }
}

/// The 8259 state's fields (they are private: read through its serialized form).
pub fn check_pic(p: &Pic) {
    let v = serde_json::to_value(p.save().expect("saves")).expect("serializes");
    for chip in ["master", "slave"] {
        let c = &v[chip];
        let step = c["init_step"].as_u64().expect("init_step");
        assert!([0, 2, 3, 4].contains(&step), "{chip}: init step {step}");
        assert_eq!(c["base"].as_u64().expect("base") & 7, 0, "{chip}: {c}");
    }
}

impl Chips {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::new(2_000_000_000));
        let lapic = |id, bsp| LocalApic::new(id, bsp, clock.clone());
        Chips { lapics: [lapic(0, true), lapic(1, false)], ioapic: IoApic::new(), pic: Pic::new(), clock }
    }

    fn route(&mut self, ipi: Ipi) {
        let addrs: Vec<_> = self.lapics.iter().map(|l| l.address()).collect();
        for i in ipi.targets(&addrs) {
            self.lapics[i].deliver(&ipi);
        }
    }

    fn event(&mut self, e: Option<ApicEvent>) {
        match e {
            Some(ApicEvent::Ipi(ipi)) => self.route(ipi),
            Some(ApicEvent::LevelEoi(v)) => {
                for ipi in self.ioapic.eoi(v) {
                    self.route(ipi);
                }
            }
            _ => {}
        }
    }

    fn apply(&mut self, op: Op) {
        let l = |cpu: bool| cpu as usize;
        match op {
            Op::MmioRead { cpu, off, len } => {
                let mut d = vec![0u8; 1 + len as usize % 8];
                self.lapics[l(cpu)].read_mmio(off as u64 & 0xFFF, &mut d);
            }
            Op::MmioWrite { cpu, off, val, len } => {
                let d = &val.to_le_bytes()[..1 + len as usize % 4];
                let e = self.lapics[l(cpu)].write_mmio(off as u64 & 0xFFF, d);
                self.event(e);
            }
            Op::RegWrite { cpu, reg, val } => {
                let e = self.lapics[l(cpu)].write_mmio((reg as u64 & 0x3F) << 4, &val.to_le_bytes());
                self.event(e);
            }
            Op::MsrRead { cpu, msr } => {
                let _ = self.lapics[l(cpu)].read_msr(msr.index());
            }
            Op::MsrWrite { cpu, msr, val } => self.msr_write(l(cpu), msr.index(), val),
            Op::Base { cpu, en, x2 } => {
                let v = DEFAULT_APIC_BASE | if en { BASE_ENABLE } else { 0 } | if x2 { BASE_X2APIC } else { 0 };
                self.msr_write(l(cpu), APIC_BASE_MSR, v | if cpu { 0 } else { 1 << 8 });
            }
            Op::Accept { cpu, vector, level } => {
                self.lapics[l(cpu)].accept(vector, level);
            }
            Op::Ack { cpu } => {
                let a = &mut self.lapics[l(cpu)];
                let pending = a.pending_vector();
                let got = a.ack();
                assert_eq!(got, pending);
                if let Some(v) = got {
                    let s = a.save().expect("saves");
                    assert!(s.isr.contains(v) && v >> 4 > 0, "acked {v}: {s:?}");
                }
            }
            Op::Eoi { cpu } => {
                let e = self.lapics[l(cpu)].eoi();
                self.event(e);
            }
            Op::Msi { address, data } => {
                if let Some(ipi) = Ipi::from_msi(address, data) {
                    assert!(
                        !matches!(ipi.mode, DeliveryMode::Fixed | DeliveryMode::LowestPriority) || ipi.vector >= 16
                    );
                    self.route(ipi);
                }
            }
            Op::FireLvt { cpu, lvt } => {
                let lvt = [Lvt::Timer, Lvt::Thermal, Lvt::Perf, Lvt::Lint0, Lvt::Lint1, Lvt::Error][lvt as usize % 6];
                self.lapics[l(cpu)].fire_lvt(lvt);
            }
            Op::Advance { ns } => self.clock.advance(ns as u64 * 64),
            Op::Expire { cpu } => {
                self.lapics[l(cpu)].expire();
            }
            Op::Cr8 { cpu, v } => {
                let a = &mut self.lapics[l(cpu)];
                a.set_cr8(v as u64);
                assert_eq!(a.cr8(), v as u64 & 0xF);
            }
            Op::SaveRestore { cpu } => self.save_restore(l(cpu)),
            Op::IoapicRead { off, len } => {
                let mut d = vec![0u8; 1 + len as usize % 8];
                self.ioapic.read_mmio(off as u64 & 0x1F, &mut d);
            }
            Op::IoapicWrite { off, val, len } => {
                let d = &val.to_le_bytes()[..1 + len as usize % 4];
                if let Some(ipi) = self.ioapic.write_mmio(off as u64 & 0x1F, d) {
                    self.route(ipi);
                }
            }
            Op::IoapicIrq { pin, high } => {
                if let Some(ipi) = self.ioapic.set_irq(pin as usize % 26, high) {
                    self.route(ipi);
                }
            }
            Op::PicRead { port } => {
                self.pic.read_port(PIC_PORTS[port as usize % PIC_PORTS.len()]);
            }
            Op::PicWrite { port, v } => self.pic.write_port(PIC_PORTS[port as usize % PIC_PORTS.len()], v),
            Op::PicIrq { irq, high } => self.pic.set_irq(irq as u32 % 17, high),
            Op::PicAck => {
                let intr = self.pic.intr();
                let v = self.pic.ack();
                if !intr {
                    assert_eq!(v & 7, 7, "a spurious INTA answers IRQ 7 or 15, not {v:#x}");
                }
            }
        }
    }

    /// An x2APIC or base MSR write the guest makes: refused writes change nothing (#GP).
    fn msr_write(&mut self, cpu: usize, msr: u32, val: u64) {
        let before = self.lapics[cpu].save().expect("saves");
        match self.lapics[cpu].write_msr(msr, val) {
            Ok(e) => self.event(e),
            Err(e) => {
                assert_eq!(e.msr, msr);
                assert_eq!(
                    self.lapics[cpu].save().expect("saves"),
                    before,
                    "refused write of MSR {msr:#x} changed state"
                );
            }
        }
    }

    /// A snapshot in the middle: a fresh APIC restored from the state saves the same state.
    fn save_restore(&mut self, cpu: usize) {
        let s = self.lapics[cpu].save().expect("saves");
        let mut fresh = LocalApic::new(cpu as u32, cpu == 0, self.clock.clone());
        fresh.restore(&s).expect("a saved state restores");
        assert_eq!(fresh.save().expect("saves"), s, "restore then save changed the state");
        self.lapics[cpu] = fresh;
        let io = self.ioapic.save().expect("saves");
        let mut io2 = IoApic::new();
        io2.restore(&io).expect("restores");
        assert_eq!(io2, self.ioapic);
    }

    fn check(&self) {
        for a in &self.lapics {
            let s = a.save().expect("saves");
            check_lapic(&s);
            if let Some(v) = a.pending_vector() {
                assert!(s.irr.contains(v) && v >> 4 > a.ppr() >> 4, "pending {v} with PPR {:#x}", a.ppr());
            }
        }
        check_ioapic(&self.ioapic);
        check_pic(&self.pic);
    }
}

pub fn run(u: &mut Input<'_>) -> CaseResult {
    let mut c = Chips::new();
    // Start from a programmed APIC as often as from reset: software-enabled, x2APIC or not.
    if u.arbitrary()? {
        for cpu in [0, 1] {
            c.lapics[cpu].write_mmio(0xF0, &0x1FFu32.to_le_bytes());
        }
    }
    while !u.is_empty() {
        let op: Op = u.arbitrary()?;
        c.apply(op);
        c.check();
    }
    Ok(())
}
