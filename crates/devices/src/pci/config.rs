//! A function's 4 KiB configuration space: a type 0 header, BARs and a capability list, with
//! per-bit masks saying what a guest may write (read-only by default) and which bits it clears
//! by writing ones (status).

use serde::{Deserialize, Serialize};

use super::{BarKind, BarMove, BarSpec, PciError, NUM_BARS};

/// Dwords in a configuration space (4 KiB, the PCIe extended space).
pub const CONFIG_DWORDS: usize = 1024;
/// Where capabilities start (the type 0 header is 64 bytes).
pub const FIRST_CAP: usize = 0x40;

const COMMAND_REG: usize = 1;
const BAR0_REG: usize = 4;
const STATUS_CAP_LIST: u32 = 1 << (16 + 4);
/// Command bits a guest may set: I/O and memory decode, bus master, parity and SERR, INTx off.
const COMMAND_WRITABLE: u32 = 0x0547;
/// Status bits a guest clears by writing ones (parity and abort errors).
const STATUS_W1C: u32 = 0xf900 << 16;

/// The identity a function shows in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    /// Base class, subclass, programming interface.
    pub class: (u8, u8, u8),
    pub revision: u8,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
}

/// A configuration space as a function shows it.
#[derive(Debug, Clone)]
pub struct PciConfig {
    regs: Vec<u32>,
    writable: Vec<u32>,
    w1c: Vec<u32>,
    bars: [Option<BarSpec>; NUM_BARS],
    /// Where each BAR is decoded now (the last address reported or placed): sizing writes do
    /// not move it.
    mapped: [Option<u64>; NUM_BARS],
    next_cap: usize,
    last_cap: Option<usize>,
}

/// What a snapshot keeps of a configuration space: its registers, and where the BARs decode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciConfigState {
    pub regs: Vec<u32>,
    pub mapped: Vec<Option<u64>>,
}

impl PciConfig {
    /// A type 0 header with these ids; interrupt pin INTA#, line unset.
    pub fn new(ids: PciIds) -> Self {
        let mut c = PciConfig {
            regs: vec![0; CONFIG_DWORDS],
            writable: vec![0; CONFIG_DWORDS],
            w1c: vec![0; CONFIG_DWORDS],
            bars: [None; NUM_BARS],
            mapped: [None; NUM_BARS],
            next_cap: FIRST_CAP,
            last_cap: None,
        };
        c.regs[0] = u32::from(ids.vendor) | u32::from(ids.device) << 16;
        c.writable[COMMAND_REG] = COMMAND_WRITABLE;
        c.w1c[COMMAND_REG] = STATUS_W1C;
        let (base, sub, prog) = ids.class;
        c.regs[2] = u32::from(ids.revision) | u32::from(prog) << 8 | u32::from(sub) << 16 | u32::from(base) << 24;
        // Cache line size and latency timer are plain storage; header type 0, single function.
        c.writable[3] = 0x0000_ffff;
        c.regs[11] = u32::from(ids.subsystem_vendor) | u32::from(ids.subsystem) << 16;
        // Interrupt line is the guest's scratch byte; pin 1 = INTA#.
        c.regs[15] = 1 << 8;
        c.writable[15] = 0xff;
        c
    }

    /// The dword at index `reg` (0..1024); beyond the space, all ones.
    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(u32::MAX)
    }

    /// Byte `offset` of the space, `len` (1, 2 or 4) bytes, little-endian; a bad access reads
    /// all ones.
    pub fn read(&self, offset: usize, len: usize) -> u32 {
        let shift = (offset % 4) * 8;
        if !matches!(len, 1 | 2 | 4) || offset % 4 + len > 4 {
            return u32::MAX;
        }
        let v = self.read_reg(offset / 4) >> shift;
        if len == 4 {
            v
        } else {
            v & ((1u32 << (len * 8)) - 1)
        }
    }

    /// A guest's write of `data` (1, 2 or 4 bytes) at byte `byte` (0..4) of dword `reg`: only
    /// writable bits change, ones in write-1-to-clear bits clear them. Accesses that are
    /// oversized or cross the dword are ignored. Returns the BAR the write moved, if any.
    pub fn write(&mut self, reg: usize, byte: usize, data: &[u8]) -> Option<BarMove> {
        if reg >= CONFIG_DWORDS || !matches!(data.len(), 1 | 2 | 4) || byte + data.len() > 4 {
            tracing::debug!(reg, byte, len = data.len(), "ignored PCI config write");
            return None;
        }
        let mut value = 0u32;
        let mut mask = 0u32;
        for (i, b) in data.iter().enumerate() {
            value |= u32::from(*b) << ((byte + i) * 8);
            mask |= 0xff << ((byte + i) * 8);
        }
        let w = self.writable[reg] & mask;
        let c = self.w1c[reg] & mask & value;
        self.regs[reg] = (self.regs[reg] & !w & !c) | (value & w);
        self.bar_of_reg(reg).and_then(|bar| self.check_move(bar))
    }

    /// Sets bits of a register without the masks (a device's own state: a capability's field).
    pub fn set_reg(&mut self, reg: usize, value: u32) {
        if let Some(r) = self.regs.get_mut(reg) {
            *r = value;
        }
    }

    /// Lets a guest write `mask`'s bits of dword `reg` (a capability's control bits).
    pub fn set_writable(&mut self, reg: usize, mask: u32) {
        if let Some(r) = self.writable.get_mut(reg) {
            *r = mask;
        }
    }

    /// The INTx pin (1 = INTA#, the default; 0 for a function that raises only MSI-X).
    pub fn set_interrupt_pin(&mut self, pin: u8) {
        self.regs[15] = (self.regs[15] & !0xff00) | u32::from(pin.min(4)) << 8;
    }

    /// Declares BAR `index` (a 64-bit BAR takes `index + 1` too). Sizes are powers of two, at
    /// least 16 bytes for memory and 4 for I/O; I/O BARs are at most 64 KiB.
    pub fn add_bar(&mut self, index: usize, spec: BarSpec) -> Result<(), PciError> {
        let wide = spec.kind == BarKind::Mem64;
        let min = if spec.kind == BarKind::Io { 4 } else { 16 };
        if index >= NUM_BARS || (wide && index + 1 >= NUM_BARS) {
            return Err(PciError::BadBar { index, msg: "index out of range" });
        }
        if !spec.size.is_power_of_two() || spec.size < min {
            return Err(PciError::BadBar { index, msg: "size is not a power of two of at least the minimum" });
        }
        if (spec.kind == BarKind::Io && spec.size > 0x1_0000) || (spec.kind == BarKind::Mem32 && spec.size > 1 << 31) {
            return Err(PciError::BadBar { index, msg: "too large for its kind" });
        }
        let taken =
            |i: usize| self.bars[i].is_some() || (i > 0 && self.bars[i - 1].is_some_and(|b| b.kind == BarKind::Mem64));
        if taken(index) || (wide && taken(index + 1)) {
            return Err(PciError::BadBar { index, msg: "already declared" });
        }
        let addr_mask = !(spec.size - 1);
        let flags = spec.flags();
        self.regs[BAR0_REG + index] = flags;
        self.writable[BAR0_REG + index] = addr_mask as u32 & !spec.flag_bits();
        if wide {
            self.regs[BAR0_REG + index + 1] = 0;
            self.writable[BAR0_REG + index + 1] = (addr_mask >> 32) as u32;
        }
        self.bars[index] = Some(spec);
        Ok(())
    }

    /// BAR `index`'s declaration.
    pub fn bar(&self, index: usize) -> Option<BarSpec> {
        self.bars.get(index).copied().flatten()
    }

    /// The declared BARs with their index.
    pub fn bars(&self) -> impl Iterator<Item = (usize, BarSpec)> + '_ {
        self.bars.iter().enumerate().filter_map(|(i, b)| b.map(|b| (i, b)))
    }

    /// The address BAR `index` decodes at, as its registers hold it now.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let spec = self.bar(index)?;
        let lo = u64::from(self.regs[BAR0_REG + index] & !spec.flag_bits());
        let hi = if spec.kind == BarKind::Mem64 { u64::from(self.regs[BAR0_REG + index + 1]) } else { 0 };
        Some(lo | hi << 32)
    }

    /// Where BAR `index` is decoded (placed by the VMM or last moved by the guest).
    pub fn bar_mapped(&self, index: usize) -> Option<u64> {
        self.mapped.get(index).copied().flatten()
    }

    /// Places BAR `index` at `addr` (the VMM's allocation, before the guest runs). The address
    /// must be aligned to the BAR's size.
    pub fn set_bar_address(&mut self, index: usize, addr: u64) -> Result<(), PciError> {
        let spec = self.bar(index).ok_or(PciError::BadBar { index, msg: "not declared" })?;
        if !addr.is_multiple_of(spec.size) || (spec.kind != BarKind::Mem64 && addr > u64::from(u32::MAX)) {
            return Err(PciError::BadBar { index, msg: "address unaligned or out of the BAR's reach" });
        }
        self.regs[BAR0_REG + index] = addr as u32 | spec.flags();
        if spec.kind == BarKind::Mem64 {
            self.regs[BAR0_REG + index + 1] = (addr >> 32) as u32;
        }
        self.mapped[index] = Some(addr);
        Ok(())
    }

    /// Which declared BAR register `reg` belongs to (either half of a 64-bit one).
    fn bar_of_reg(&self, reg: usize) -> Option<usize> {
        let i = reg.checked_sub(BAR0_REG).filter(|i| *i < NUM_BARS)?;
        match self.bars[i] {
            Some(_) => Some(i),
            None if i > 0 && self.bars[i - 1].is_some_and(|b| b.kind == BarKind::Mem64) => Some(i - 1),
            None => None,
        }
    }

    /// After a write to BAR `index`: a move unless the guest is sizing it (an address half of
    /// all ones reads back the size mask and is never decoded).
    fn check_move(&mut self, index: usize) -> Option<BarMove> {
        let spec = self.bars[index]?;
        let lo_w = self.writable[BAR0_REG + index];
        let sizing = self.regs[BAR0_REG + index] & lo_w == lo_w
            || (spec.kind == BarKind::Mem64 && {
                let hi_w = self.writable[BAR0_REG + index + 1];
                hi_w != 0 && self.regs[BAR0_REG + index + 1] & hi_w == hi_w
            });
        let new = self.bar_address(index)?;
        if sizing || self.mapped[index] == Some(new) {
            return None;
        }
        let old = self.mapped[index].replace(new);
        Some(BarMove { bar: index, kind: spec.kind, size: spec.size, old, new })
    }

    /// Appends a capability: `id`, then `body` (the bytes after the id and next pointer). It is
    /// read-only until [`PciConfig::set_writable`] opens bits of it. Returns its byte offset.
    pub fn add_capability(&mut self, id: u8, body: &[u8]) -> Result<usize, PciError> {
        let offset = self.next_cap;
        let len = (2 + body.len()).next_multiple_of(4);
        if offset + len > 0x100 {
            return Err(PciError::CapabilitySpace);
        }
        let mut bytes = vec![id, 0];
        bytes.extend_from_slice(body);
        bytes.resize(len, 0);
        for (i, chunk) in bytes.chunks(4).enumerate() {
            self.regs[offset / 4 + i] = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        match self.last_cap {
            None => {
                self.regs[13] = offset as u32;
                self.regs[1] |= STATUS_CAP_LIST;
            }
            Some(prev) => self.regs[prev / 4] |= (offset as u32) << ((prev % 4 + 1) * 8),
        }
        self.last_cap = Some(offset);
        self.next_cap = offset + len;
        Ok(offset)
    }

    pub fn state(&self) -> PciConfigState {
        PciConfigState { regs: self.regs.clone(), mapped: self.mapped.to_vec() }
    }

    /// Puts back a saved state: the guest-writable bits come from it, the rest (ids, BAR
    /// flags, capabilities) stay as this device declares them.
    pub fn restore(&mut self, s: &PciConfigState) -> Result<(), PciError> {
        if s.regs.len() != CONFIG_DWORDS || s.mapped.len() != NUM_BARS {
            return Err(PciError::BadState("configuration space of the wrong size"));
        }
        for (i, m) in s.mapped.iter().enumerate() {
            match (m, self.bars[i]) {
                (Some(_), None) => return Err(PciError::BadState("a placed BAR this device does not declare")),
                // Where the BAR's registers could put it: aligned to its size, within its reach.
                (Some(a), Some(b))
                    if !a.is_multiple_of(b.size) || (b.kind != BarKind::Mem64 && *a > u64::from(u32::MAX)) =>
                {
                    return Err(PciError::BadState("a BAR placed where its registers cannot put it"))
                }
                _ => {}
            }
        }
        for i in 0..CONFIG_DWORDS {
            let w = self.writable[i] | self.w1c[i];
            self.regs[i] = (self.regs[i] & !w) | (s.regs[i] & w);
        }
        self.mapped.copy_from_slice(&s.mapped);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::pci::tests::nic_ids as ids;

    #[test]
    fn header_fields_are_read_only_where_they_should_be() {
        let mut c = PciConfig::new(ids());
        assert_eq!(c.read_reg(0), 0x1041_1af4);
        assert_eq!(c.read(0x0a, 2), 0x0200, "class code");
        assert_eq!(c.read(0x0e, 1), 0, "header type 0, single function");
        assert_eq!(c.read_reg(11), 0x1100_1af4);
        c.write(0, 0, &[0, 0, 0, 0]);
        assert_eq!(c.read_reg(0), 0x1041_1af4, "ids stay");
        c.write(1, 0, &[0xff, 0xff]);
        assert_eq!(c.read(4, 2), 0x0547, "command: only its defined bits");
        c.write(15, 0, &[0x0b]);
        assert_eq!(c.read(0x3c, 2), 0x010b, "line is writable, pin is not");
        c.set_interrupt_pin(0);
        assert_eq!(c.read(0x3c, 2), 0x000b, "an MSI-X only function");
        assert_eq!(c.read(0x3d, 4), u32::MAX, "a read crossing the dword");
        assert_eq!(c.read_reg(2000), u32::MAX);
    }

    #[test]
    fn status_error_bits_clear_on_writing_ones() {
        let mut c = PciConfig::new(ids());
        c.set_reg(1, 0x8100_0006);
        c.write(1, 2, &[0x00, 0x80]);
        assert_eq!(c.read_reg(1), 0x0100_0006, "bit 15 cleared, bit 8 kept, command untouched");
    }

    #[test]
    fn garbage_writes_are_ignored() {
        let mut c = PciConfig::new(ids());
        let before = c.state();
        assert_eq!(c.write(1, 3, &[1, 2]), None, "crosses the dword");
        assert_eq!(c.write(1, 0, &[1, 2, 3, 4, 5, 6, 7, 8]), None, "oversized");
        assert_eq!(c.write(1, 0, &[1, 2, 3]), None, "three bytes");
        assert_eq!(c.write(5000, 0, &[1]), None, "beyond the space");
        assert_eq!(c.state(), before);
    }

    #[test]
    fn capabilities_chain() {
        let mut c = PciConfig::new(ids());
        let a = c.add_capability(0x09, &[4, 0xaa]).unwrap();
        let b = c.add_capability(0x11, &[0; 10]).unwrap();
        assert_eq!((a, b), (0x40, 0x44));
        assert_ne!(c.read_reg(1) & STATUS_CAP_LIST, 0);
        assert_eq!(c.read(0x34, 1), 0x40);
        assert_eq!(c.read(0x40, 4), 0xaa04_4409, "id, next, body");
        assert_eq!(c.read(0x44, 2), 0x0011, "last one ends the list");
        c.write(0x10, 0, &[0xff; 4]);
        assert_eq!(c.read(0x40, 4), 0xaa04_4409, "read-only by default");
        assert!(matches!(c.add_capability(1, &[0; 250]), Err(PciError::CapabilitySpace)));
    }

    /// Found by kumo-fuzz (target `restore`): a restore placed a BAR at an address its
    /// registers cannot hold (unaligned, or above 4 GiB for a 32-bit BAR).
    #[test]
    fn a_bar_placed_where_its_registers_cannot_put_it_is_refused() {
        let mut c = PciConfig::new(ids());
        c.add_bar(0, BarSpec::mem32(0x4000)).unwrap();
        c.set_bar_address(0, 0xc000_0000).unwrap();
        let good = c.state();
        for addr in [0xc000_0010, 0x1_0000_0000] {
            let mut bad = good.clone();
            bad.mapped[0] = Some(addr);
            let e = c.restore(&bad).unwrap_err().to_string();
            assert!(e.contains("cannot put it"), "{e}");
            assert_eq!(c.state(), good, "a refused state changes nothing");
        }
        c.restore(&good).unwrap();
    }
}
