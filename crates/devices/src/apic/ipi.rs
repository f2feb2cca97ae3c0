//! Inter-processor interrupts: what an ICR write asks for, and which APICs it reaches.

use serde::{Deserialize, Serialize};

/// An ICR delivery mode kumo delivers. SMI and the reserved modes (0b011, 0b111) never leave
/// the sender: they are dropped there and logged once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeliveryMode {
    Fixed,
    /// Delivered as fixed to the lowest-numbered matching APIC (the first match in the list
    /// given to [`Ipi::targets`]): no arbitration by priority, which real chipsets may not do
    /// either, and which no guest may rely on.
    LowestPriority,
    Nmi,
    Init,
    /// SIPI: the target starts in real mode at `vector << 12`.
    Startup,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DestMode {
    Physical,
    Logical,
}

/// Whom an IPI is for: the destination field (with its mode) or a shorthand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Destination {
    /// A destination field with its mode: 8 bits in xAPIC mode, 32 in x2APIC mode.
    Field(u32, DestMode),
    SelfOnly,
    AllIncludingSelf,
    AllExcludingSelf,
}

/// An IPI a vCPU's APIC sent, for the VMM to route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ipi {
    pub mode: DeliveryMode,
    pub vector: u8,
    pub level_triggered: bool,
    pub dest: Destination,
    /// The sender's initial APIC id (for the shorthands); `u32::MAX` for an MSI.
    pub source: u32,
}

/// What destination matching needs of one APIC: [`crate::apic::LocalApic::address`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApicAddress {
    /// The initial APIC id: which vCPU this is.
    pub apic_id: u32,
    /// What physical destinations compare with: the ID register's 8 bits in xAPIC mode, the
    /// 32-bit x2APIC id in x2APIC mode.
    pub dest_id: u32,
    pub ldr: u32,
    pub dfr: u32,
    pub x2apic: bool,
    /// IA32_APIC_BASE.EN: a hardware-disabled APIC receives nothing.
    pub enabled: bool,
}

/// Whether `apic` is a destination of `dest` in `mode` (SDM vol. 3 "Determining IPI
/// Destination"): physical compares ids, 0xFF (x2APIC: 0xFFFF_FFFF) is everyone; logical
/// uses the LDR, in the flat model (DFR 0xF…) as a bit mask of 8, in the cluster model (DFR
/// 0x0…; always in x2APIC mode) as a cluster number and a 4- (x2APIC: 16-) bit mask.
pub fn matches(apic: &ApicAddress, dest: u32, mode: DestMode) -> bool {
    if !apic.enabled {
        return false;
    }
    if apic.x2apic {
        if dest == u32::MAX {
            return true;
        }
        return match mode {
            DestMode::Physical => dest == apic.dest_id,
            DestMode::Logical => dest >> 16 == apic.ldr >> 16 && dest & apic.ldr & 0xFFFF != 0,
        };
    }
    let dest = dest & 0xFF;
    if dest == 0xFF {
        return true;
    }
    let logical_id = apic.ldr >> 24;
    match mode {
        DestMode::Physical => dest == apic.dest_id & 0xFF,
        DestMode::Logical if apic.dfr >> 28 == 0xF => dest & logical_id != 0,
        DestMode::Logical => dest >> 4 == logical_id >> 4 && dest & logical_id & 0xF != 0,
    }
}

impl Ipi {
    /// The interrupt an MSI message (a device's, or an IOAPIC redirection entry's) asks for:
    /// destination in address bits 19:12 (and 63:40, the extended destination id, for
    /// x2APIC ids above 255), logical if bit 2; vector, delivery mode and trigger in the data.
    /// `None` for the modes an MSI cannot carry to kumo (SMI, reserved), or a vector 0–15.
    pub fn from_msi(address: u64, data: u32) -> Option<Ipi> {
        let vector = data as u8;
        let mode = match (data >> 8) & 7 {
            0b000 => DeliveryMode::Fixed,
            0b001 => DeliveryMode::LowestPriority,
            0b100 => DeliveryMode::Nmi,
            0b101 => DeliveryMode::Init,
            _ => return None,
        };
        if matches!(mode, DeliveryMode::Fixed | DeliveryMode::LowestPriority) && vector < 16 {
            return None;
        }
        let dest_id = ((address >> 12) & 0xFF) as u32 | ((address >> 32) as u32 & 0xFFFF_FF00);
        let dest_mode = if address & (1 << 2) != 0 { DestMode::Logical } else { DestMode::Physical };
        Some(Ipi {
            mode,
            vector,
            level_triggered: data & (1 << 15) != 0,
            dest: Destination::Field(dest_id, dest_mode),
            source: u32::MAX,
        })
    }

    /// The indexes in `apics` this IPI reaches. A destination no APIC has reaches no one; a
    /// lowest-priority IPI reaches only the first match.
    pub fn targets(&self, apics: &[ApicAddress]) -> Vec<usize> {
        let hit = |a: &ApicAddress| match self.dest {
            Destination::Field(d, m) => matches(a, d, m),
            Destination::SelfOnly => a.apic_id == self.source,
            Destination::AllIncludingSelf => a.enabled,
            Destination::AllExcludingSelf => a.enabled && a.apic_id != self.source,
        };
        let mut out: Vec<usize> = apics.iter().enumerate().filter(|(_, a)| hit(a)).map(|(i, _)| i).collect();
        if self.mode == DeliveryMode::LowestPriority {
            out.truncate(1);
        }
        out
    }
}
