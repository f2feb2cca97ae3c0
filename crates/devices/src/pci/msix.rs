//! MSI-X as a device embeds it: the capability in its config space, the vector table and the
//! pending bit array in its BARs, per-vector and function masking.
//!
//! A vector is deliverable when MSI-X is enabled, the function is not masked, its own mask bit
//! is clear and its address lies in the local APICs' window (0xFEEx_xxxx). Whenever that
//! changes, or its message does, [`MsixRouting::update`] is told, for that vector alone: the VMM
//! points the vector's GSI at the new message (or stops delivering it) and leaves the other
//! vectors' routes as they are. A vector that fires while not deliverable sets its pending bit;
//! becoming deliverable delivers it once and clears the bit.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{PciConfig, PciError};

pub const MSIX_CAP_ID: u8 = 0x11;
/// Bytes per table entry: address low, address high, data, vector control.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Most vectors a function has.
pub const MSIX_MAX_VECTORS: u16 = 2048;
const CONTROL_ENABLE: u16 = 1 << 15;
const CONTROL_MASK: u16 = 1 << 14;
const ENTRY_MASKED: u32 = 1;

/// An MSI message: what the guest programmed into a table entry. `kumo_vm::interrupts` routes
/// this same type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MsiMessage {
    pub address: u64,
    pub data: u32,
}

/// Where MSI-X vectors go: implemented by the VMM over its GSI routes and irqfds.
pub trait MsixRouting: Send + Sync {
    /// Vector `vector` now delivers `msg`, or (None) must not be delivered (masked, disabled,
    /// or an address outside the APIC window). Only this vector's route changes.
    fn update(&self, vector: u16, msg: Option<MsiMessage>);
    /// Deliver vector `vector` (signal its irqfd). Only called on a deliverable vector, after
    /// `update` has given its message.
    fn trigger(&self, vector: u16);
}

/// One table entry as the guest sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixEntry {
    pub addr_lo: u32,
    pub addr_hi: u32,
    pub data: u32,
    pub control: u32,
}

impl Default for MsixEntry {
    /// Masked at reset.
    fn default() -> Self {
        MsixEntry { addr_lo: 0, addr_hi: 0, data: 0, control: ENTRY_MASKED }
    }
}

/// What a snapshot keeps of MSI-X.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixState {
    pub enabled: bool,
    pub function_masked: bool,
    pub entries: Vec<MsixEntry>,
    pub pba: Vec<u64>,
}

/// A function's MSI-X: table, PBA, capability and its control bits.
pub struct Msix {
    entries: Vec<MsixEntry>,
    pba: Vec<u64>,
    enabled: bool,
    function_masked: bool,
    /// (BIR, offset) of the table and of the PBA.
    table: (u8, u32),
    pba_at: (u8, u32),
    cap_offset: Option<usize>,
    /// What `routing` was last told, per vector.
    routes: Vec<Option<MsiMessage>>,
    routing: Arc<dyn MsixRouting>,
}

impl Msix {
    /// `vectors` (1..=2048) vectors, the table at `table` (BAR, offset) and the PBA at `pba`;
    /// offsets are 8-byte aligned.
    pub fn new(
        vectors: u16,
        table: (u8, u32),
        pba: (u8, u32),
        routing: Arc<dyn MsixRouting>,
    ) -> Result<Self, PciError> {
        if vectors == 0 || vectors > MSIX_MAX_VECTORS {
            return Err(PciError::Msix("vector count must be 1..=2048"));
        }
        if table.0 > 5 || pba.0 > 5 || !table.1.is_multiple_of(8) || !pba.1.is_multiple_of(8) {
            return Err(PciError::Msix("table and PBA need a BAR index 0..=5 and 8-byte aligned offsets"));
        }
        let n = usize::from(vectors);
        Ok(Msix {
            entries: vec![MsixEntry::default(); n],
            pba: vec![0; n.div_ceil(64)],
            enabled: false,
            function_masked: false,
            table,
            pba_at: pba,
            cap_offset: None,
            routes: vec![None; n],
            routing,
        })
    }

    pub fn vectors(&self) -> u16 {
        self.entries.len() as u16
    }

    /// Bytes the table takes in its BAR.
    pub fn table_len(&self) -> u64 {
        self.entries.len() as u64 * MSIX_ENTRY_SIZE
    }

    /// Bytes the PBA takes in its BAR.
    pub fn pba_len(&self) -> u64 {
        self.pba.len() as u64 * 8
    }

    /// (BAR, offset) of the table and of the PBA, for the device's BAR dispatch.
    pub fn table_location(&self) -> (u8, u32) {
        self.table
    }

    pub fn pba_location(&self) -> (u8, u32) {
        self.pba_at
    }

    /// Adds the capability to `config`, its enable and function-mask bits writable.
    pub fn add_capability(&mut self, config: &mut PciConfig) -> Result<usize, PciError> {
        let control = (self.vectors() - 1).to_le_bytes();
        let t = (self.table.1 | u32::from(self.table.0)).to_le_bytes();
        let p = (self.pba_at.1 | u32::from(self.pba_at.0)).to_le_bytes();
        let body = [control[0], control[1], t[0], t[1], t[2], t[3], p[0], p[1], p[2], p[3]];
        let off = config.add_capability(MSIX_CAP_ID, &body)?;
        config.set_writable(off / 4, u32::from(CONTROL_ENABLE | CONTROL_MASK) << 16);
        self.cap_offset = Some(off);
        Ok(off)
    }

    /// After any write to `config`: takes up the enable and function-mask bits the guest wrote.
    pub fn config_written(&mut self, config: &PciConfig) {
        let Some(off) = self.cap_offset else { return };
        let control = config.read(off + 2, 2) as u16;
        let (enabled, masked) = (control & CONTROL_ENABLE != 0, control & CONTROL_MASK != 0);
        if (enabled, masked) != (self.enabled, self.function_masked) {
            self.enabled = enabled;
            self.function_masked = masked;
            tracing::debug!(enabled, masked, "MSI-X control");
            self.sync_all();
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn function_masked(&self) -> bool {
        self.function_masked
    }

    pub fn entry(&self, vector: u16) -> Option<MsixEntry> {
        self.entries.get(usize::from(vector)).copied()
    }

    pub fn is_pending(&self, vector: u16) -> bool {
        let v = usize::from(vector);
        self.pba.get(v / 64).is_some_and(|w| w & (1 << (v % 64)) != 0)
    }

    /// The message vector `vector` delivers now, if it is deliverable.
    pub fn message(&self, vector: u16) -> Option<MsiMessage> {
        let e = self.entries.get(usize::from(vector))?;
        let ok = self.enabled
            && !self.function_masked
            && e.control & ENTRY_MASKED == 0
            && e.addr_lo & 0xfff0_0000 == 0xfee0_0000;
        ok.then(|| MsiMessage { address: u64::from(e.addr_hi) << 32 | u64::from(e.addr_lo), data: e.data })
    }

    /// The device raises `vector`: delivered now (true), or left pending while masked. With
    /// MSI-X disabled, or for a vector beyond the table, nothing happens.
    pub fn fire(&mut self, vector: u16) -> bool {
        let v = usize::from(vector);
        if !self.enabled || v >= self.entries.len() {
            return false;
        }
        if self.message(vector).is_some() {
            self.routing.trigger(vector);
            true
        } else {
            self.pba[v / 64] |= 1 << (v % 64);
            false
        }
    }

    /// Tells `routing` about `vector` if its message changed; delivers a pending vector that
    /// became deliverable.
    fn sync(&mut self, v: usize) {
        let vector = v as u16;
        let msg = self.message(vector);
        if msg != self.routes[v] {
            self.routes[v] = msg;
            self.routing.update(vector, msg);
        }
        if msg.is_some() && self.is_pending(vector) {
            self.pba[v / 64] &= !(1 << (v % 64));
            self.routing.trigger(vector);
        }
    }

    fn sync_all(&mut self) {
        for v in 0..self.entries.len() {
            self.sync(v);
        }
    }

    /// Splits a table access into (vector, dword in the entry, dwords); None for an access the
    /// table does not take (unaligned, not 4 or 8 bytes, beyond the table).
    fn table_access(&self, offset: u64, len: usize) -> Option<(usize, usize, usize)> {
        if !matches!(len, 4 | 8) || !offset.is_multiple_of(len as u64) || offset >= self.table_len() {
            return None;
        }
        Some(((offset / MSIX_ENTRY_SIZE) as usize, (offset % MSIX_ENTRY_SIZE / 4) as usize, len / 4))
    }

    /// A read at `offset` inside the table; a bad access reads all ones.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        let Some((v, dw, n)) = self.table_access(offset, data.len()) else { return };
        let e = self.entries[v];
        let words = [e.addr_lo, e.addr_hi, e.data, e.control];
        for i in 0..n {
            data[i * 4..i * 4 + 4].copy_from_slice(&words[dw + i].to_le_bytes());
        }
    }

    /// A write at `offset` inside the table; a bad access is ignored.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) {
        let Some((v, dw, n)) = self.table_access(offset, data.len()) else {
            tracing::debug!(offset, len = data.len(), "ignored MSI-X table write");
            return;
        };
        for i in 0..n {
            let w = u32::from_le_bytes([data[i * 4], data[i * 4 + 1], data[i * 4 + 2], data[i * 4 + 3]]);
            let e = &mut self.entries[v];
            match dw + i {
                0 => e.addr_lo = w,
                1 => e.addr_hi = w,
                2 => e.data = w,
                // Only the mask bit of vector control is defined.
                _ => e.control = w & ENTRY_MASKED,
            }
        }
        self.sync(v);
    }

    /// A read at `offset` inside the PBA (read-only); a bad access reads all ones.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        data.fill(0xff);
        let len = data.len();
        if !matches!(len, 4 | 8) || !offset.is_multiple_of(len as u64) || offset >= self.pba_len() {
            return;
        }
        let bytes = self.pba[(offset / 8) as usize].to_le_bytes();
        let at = (offset % 8) as usize;
        data.copy_from_slice(&bytes[at..at + len]);
    }

    /// A device's BAR read: answered here (true) if it falls in the table or the PBA.
    pub fn read_bar(&self, bar: usize, offset: u64, data: &mut [u8]) -> bool {
        if let Some(o) = Self::inside(self.table, self.table_len(), bar, offset) {
            self.read_table(o, data);
        } else if let Some(o) = Self::inside(self.pba_at, self.pba_len(), bar, offset) {
            self.read_pba(o, data);
        } else {
            return false;
        }
        true
    }

    /// A device's BAR write: taken here (true) if it falls in the table or the PBA (read-only).
    pub fn write_bar(&mut self, bar: usize, offset: u64, data: &[u8]) -> bool {
        if let Some(o) = Self::inside(self.table, self.table_len(), bar, offset) {
            self.write_table(o, data);
            true
        } else {
            Self::inside(self.pba_at, self.pba_len(), bar, offset).is_some()
        }
    }

    /// `offset` relative to a structure at `at` of `len` bytes, if it lies there.
    fn inside(at: (u8, u32), len: u64, bar: usize, offset: u64) -> Option<u64> {
        let rel = offset.checked_sub(u64::from(at.1))?;
        (bar == usize::from(at.0) && rel < len).then_some(rel)
    }

    pub fn state(&self) -> MsixState {
        MsixState {
            enabled: self.enabled,
            function_masked: self.function_masked,
            entries: self.entries.clone(),
            pba: self.pba.clone(),
        }
    }

    /// Whether [`Msix::restore`] would take `s` (a table and PBA of this function's size).
    pub fn check_state(&self, s: &MsixState) -> Result<(), PciError> {
        if s.entries.len() != self.entries.len() || s.pba.len() != self.pba.len() {
            return Err(PciError::BadState("MSI-X table of another size"));
        }
        Ok(())
    }

    /// Puts back a saved state and tells `routing` every vector's message (on a destination,
    /// that builds the routes). The config space's control bits are restored with the config
    /// space itself.
    pub fn restore(&mut self, s: &MsixState) -> Result<(), PciError> {
        self.check_state(s)?;
        self.enabled = s.enabled;
        self.function_masked = s.function_masked;
        self.entries.clone_from(&s.entries);
        for e in &mut self.entries {
            e.control &= ENTRY_MASKED;
        }
        self.pba.clone_from(&s.pba);
        let n = self.entries.len();
        if let Some(last) = self.pba.last_mut() {
            if !n.is_multiple_of(64) {
                *last &= (1 << (n % 64)) - 1;
            }
        }
        for v in 0..n {
            let msg = self.message(v as u16);
            self.routes[v] = msg;
            self.routing.update(v as u16, msg);
            self.sync(v);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::pci::PciIds;

    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Ev {
        Update(u16, Option<MsiMessage>),
        Trigger(u16),
    }

    #[derive(Default)]
    pub(crate) struct Log(pub Mutex<Vec<Ev>>);
    impl MsixRouting for Log {
        fn update(&self, vector: u16, msg: Option<MsiMessage>) {
            self.0.lock().unwrap().push(Ev::Update(vector, msg));
        }
        fn trigger(&self, vector: u16) {
            self.0.lock().unwrap().push(Ev::Trigger(vector));
        }
    }
    impl Log {
        pub fn take(&self) -> Vec<Ev> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    fn ids() -> PciIds {
        PciIds { vendor: 1, device: 2, class: (2, 0, 0), revision: 0, subsystem_vendor: 0, subsystem: 0 }
    }

    fn setup(vectors: u16) -> (PciConfig, Msix, Arc<Log>) {
        let log = Arc::new(Log::default());
        let mut m = Msix::new(vectors, (1, 0), (1, 0x800), log.clone()).unwrap();
        let mut c = PciConfig::new(ids());
        assert_eq!(m.add_capability(&mut c).unwrap(), 0x40);
        (c, m, log)
    }

    fn control(c: &mut PciConfig, m: &mut Msix, v: u16) {
        c.write(0x10, 2, &v.to_le_bytes());
        m.config_written(c);
    }

    fn program(m: &mut Msix, v: u16, addr: u64, data: u32, masked: bool) {
        let o = u64::from(v) * 16;
        m.write_table(o, &addr.to_le_bytes());
        m.write_table(o + 8, &data.to_le_bytes());
        m.write_table(o + 12, &u32::from(masked).to_le_bytes());
    }

    const APIC: u64 = 0xfee0_0000;

    #[test]
    fn capability_layout() {
        let (c, m, _) = setup(3);
        assert_eq!(c.read(0x40, 4), 0x0002_0011, "id, end of list, table size 3");
        assert_eq!(c.read(0x44, 4), 1, "table in BAR 1 at 0");
        assert_eq!(c.read(0x48, 4), 0x801, "PBA in BAR 1 at 0x800");
        assert_eq!((m.table_len(), m.pba_len()), (48, 8));
        assert!(Msix::new(0, (0, 0), (0, 0), Arc::new(Log::default())).is_err());
        assert!(Msix::new(1, (0, 4), (0, 0), Arc::new(Log::default())).is_err());
        assert!(Msix::new(1, (6, 0), (0, 0), Arc::new(Log::default())).is_err());
    }

    #[test]
    fn table_size_is_read_only_and_control_bits_are_taken_up() {
        let (mut c, mut m, _) = setup(3);
        control(&mut c, &mut m, 0xffff);
        assert_eq!(c.read(0x42, 2), 0xc002);
        assert!(m.enabled() && m.function_masked());
        control(&mut c, &mut m, 0);
        assert!(!m.enabled() && !m.function_masked());
    }

    #[test]
    fn masked_vectors_pend_and_deliver_on_unmask() {
        let (mut c, mut m, log) = setup(3);
        program(&mut m, 0, APIC, 0x41, true);
        program(&mut m, 1, APIC | 0x1000, 0x42, false);
        assert!(!m.fire(1), "MSI-X disabled: nothing");
        assert!(!m.is_pending(1));
        assert_eq!(log.take(), vec![]);
        control(&mut c, &mut m, 0x8000);
        let msg1 = MsiMessage { address: APIC | 0x1000, data: 0x42 };
        assert_eq!(log.take(), vec![Ev::Update(1, Some(msg1))], "only the unmasked vector");
        assert!(m.fire(1));
        assert!(!m.fire(0));
        assert!(m.is_pending(0));
        let mut pba = [0u8; 8];
        m.read_pba(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 1);
        assert_eq!(log.take(), vec![Ev::Trigger(1)]);
        // Unmasking vector 0 gives its route, then delivers it once.
        m.write_table(12, &0u32.to_le_bytes());
        let msg0 = MsiMessage { address: APIC, data: 0x41 };
        assert_eq!(log.take(), vec![Ev::Update(0, Some(msg0)), Ev::Trigger(0)]);
        assert!(!m.is_pending(0));
        // Masking it again stops its delivery and nothing else.
        m.write_table(12, &1u32.to_le_bytes());
        assert_eq!(log.take(), vec![Ev::Update(0, None)]);
    }

    #[test]
    fn retargeting_one_vector_touches_only_it() {
        let (mut c, mut m, log) = setup(3);
        control(&mut c, &mut m, 0x8000);
        for v in 0..3 {
            program(&mut m, v, APIC, 0x40 + u32::from(v), false);
        }
        log.take();
        // Move vector 2 to APIC id 1: address low only.
        m.write_table(32, &((APIC | 1 << 12) as u32).to_le_bytes());
        assert_eq!(log.take(), vec![Ev::Update(2, Some(MsiMessage { address: APIC | 1 << 12, data: 0x42 }))]);
        // Rewriting the same values reports nothing.
        m.write_table(32, &((APIC | 1 << 12) as u32).to_le_bytes());
        assert_eq!(log.take(), vec![]);
        let mut e = [0u8; 8];
        m.read_table(32, &mut e);
        assert_eq!(u64::from_le_bytes(e), APIC | 1 << 12);
        m.read_table(40, &mut e);
        assert_eq!(u64::from_le_bytes(e), 0x42);
    }

    #[test]
    fn function_mask_pends_all_and_unmasking_delivers_them() {
        let (mut c, mut m, log) = setup(3);
        control(&mut c, &mut m, 0x8000);
        program(&mut m, 0, APIC, 0x41, false);
        program(&mut m, 2, APIC, 0x43, false);
        log.take();
        control(&mut c, &mut m, 0xc000);
        assert_eq!(log.take(), vec![Ev::Update(0, None), Ev::Update(2, None)]);
        assert!(!m.fire(0));
        assert!(!m.fire(2));
        assert!(!m.fire(1));
        assert!(m.is_pending(0) && m.is_pending(1) && m.is_pending(2));
        control(&mut c, &mut m, 0x8000);
        let got = log.take();
        assert_eq!(
            got,
            vec![
                Ev::Update(0, Some(MsiMessage { address: APIC, data: 0x41 })),
                Ev::Trigger(0),
                Ev::Update(2, Some(MsiMessage { address: APIC, data: 0x43 })),
                Ev::Trigger(2),
            ]
        );
        assert!(m.is_pending(1), "vector 1 is still masked by its own bit");
    }

    #[test]
    fn garbage_in_the_table_never_panics_and_never_delivers() {
        let (mut c, mut m, log) = setup(3);
        control(&mut c, &mut m, 0x8000);
        // Not an APIC address: treated as masked.
        program(&mut m, 0, 0xdead_b000, 0x41, false);
        assert_eq!(m.message(0), None);
        assert!(!m.fire(0));
        assert!(m.is_pending(0));
        // Beyond the table, unaligned, odd sizes: ignored.
        let before = m.state();
        m.write_table(48, &[0; 4]);
        m.write_table(u64::MAX - 3, &[0; 4]);
        m.write_table(2, &[0; 4]);
        m.write_table(4, &[0; 8]);
        m.write_table(0, &[0; 2]);
        m.write_table(0, &[0; 16]);
        m.write_table(12, &0xffff_fffeu32.to_le_bytes());
        assert_eq!(m.state(), before, "reserved control bits stay clear");
        let mut b = [0u8; 4];
        m.read_table(48, &mut b);
        assert_eq!(b, [0xff; 4]);
        m.read_pba(8, &mut b);
        assert_eq!(b, [0xff; 4]);
        m.read_pba(4, &mut b);
        assert_eq!(b, [0; 4], "high half of the PBA's only qword");
        assert!(!m.fire(999));
        assert_eq!(log.take(), vec![]);
        // A valid address delivers the pending interrupt.
        program(&mut m, 0, APIC, 0x41, false);
        assert_eq!(log.take().last(), Some(&Ev::Trigger(0)));
    }

    #[test]
    fn state_round_trips_and_rebuilds_routes() {
        let (mut c, mut m, _) = setup(70);
        control(&mut c, &mut m, 0x8000);
        program(&mut m, 3, APIC, 0x55, false);
        program(&mut m, 65, APIC | 0x2000, 0x66, true);
        m.fire(65);
        let json = serde_json::to_string(&m.state()).unwrap();
        let (_, mut m2, log2) = setup(70);
        m2.restore(&serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(m2.state(), m.state());
        assert!(m2.is_pending(65));
        let got = log2.take();
        assert_eq!(got.len(), 70, "every vector told once");
        assert_eq!(got[3], Ev::Update(3, Some(MsiMessage { address: APIC, data: 0x55 })));
        assert_eq!(got[65], Ev::Update(65, None));
        let (_, mut small, _) = setup(3);
        assert!(small.restore(&m.state()).is_err());
    }
}
