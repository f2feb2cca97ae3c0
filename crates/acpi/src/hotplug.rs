//! The DSDT's event and CPU hotplug devices, driving kumo's GED register block
//! (`kumo_devices::acpi_ged`, whose offsets and bits the constants below repeat):
//!
//! - `\_SB.GED0` (`ACPI0013`): its `_CRS` is one edge-triggered, active-high interrupt; its
//!   `_EVT` (Linux's evged runs it on each interrupt) reads the pending events (reading clears
//!   them) and runs `\_SB.CPUS.CSCN` for a CPU event, `Notify (\_SB.PWRB, 0x80)` for the power
//!   button.
//! - `\_SB.PWRB` (`PNP0C0C`): the power button.
//! - `\_SB.CPUS` (`ACPI0010`, the processor container): the CPU register block (`CSEL` selects a
//!   vCPU, `CPEN`/`CINS`/`CRMV`/`CEJF` are its status bits), `CSTS(i)` for a `_STA`, `CEJ0(i)`
//!   for an `_EJ0`, `CSCN` notifying each vCPU with an insert (Device Check, 1) or remove
//!   (Eject Request, 3) pending and acknowledging it, and one `Cxxx` device (`ACPI0007`) per
//!   possible vCPU with `_UID` (its MADT processor UID), `_STA`, `_MAT` and `_EJ0`.

use acpi_tables::aml::{self, FieldAccessType, FieldEntry, FieldLockRule, FieldUpdateRule, OpRegionSpace, Path};
use acpi_tables::Aml;

/// Where the GED's registers are and how it interrupts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ged {
    /// Guest-physical base of the register block.
    pub mmio_base: u64,
    /// The GSI it raises (edge-triggered, active high).
    pub gsi: u32,
}

const REG_CPU_BLOCK: u64 = 0x10;
const EVENT_CPU_HOTPLUG: u8 = 1 << 0;
const EVENT_POWER_BUTTON: u8 = 1 << 1;
/// Notify values (ACPI 6.5 table 5.166).
const NOTIFY_DEVICE_CHECK: u8 = 1;
const NOTIFY_EJECT_REQUEST: u8 = 3;
const NOTIFY_POWER_BUTTON: u8 = 0x80;

fn cpu_name(i: u32) -> String {
    format!("C{i:03X}")
}

/// MADT Processor Local APIC entry of vCPU `i` (APIC ID = UID = `i`), enabled: `_MAT`'s buffer,
/// which Linux reads for a CPU it hot-adds.
fn mat(i: u32) -> Vec<u8> {
    vec![0, 8, i as u8, i as u8, 1, 0, 0, 0]
}

fn ged_device(ged: &Ged) -> Vec<u8> {
    let irq = aml::Interrupt::new(true, true, false, false, ged.gsi);
    let crs = aml::ResourceTemplate::new(vec![&irq]);
    let (hid, zero) = ("ACPI0013", aml::ZERO);
    let (evt_bit, pwr_bit) = (EVENT_CPU_HOTPLUG, EVENT_POWER_BUTTON);
    let region = aml::OpRegion::new("GREG".into(), OpRegionSpace::SystemMemory, &ged.mmio_base, &4u8);
    let field = aml::Field::new(
        "GREG".into(),
        FieldAccessType::DWord,
        FieldLockRule::NoLock,
        FieldUpdateRule::Preserve,
        vec![FieldEntry::Named(*b"GEVT", 32)],
    );
    let local0 = aml::Local(0);
    let gevt = Path::new("GEVT");
    let read = aml::Store::new(&local0, &gevt);
    let cpu_test = aml::And::new(&aml::ZERO, &local0, &evt_bit);
    let scan = aml::MethodCall::new("\\_SB_.CPUS.CSCN".into(), vec![]);
    let on_cpu = aml::If::new(&cpu_test, vec![&scan]);
    let pwr_test = aml::And::new(&aml::ZERO, &local0, &pwr_bit);
    let pwrb = Path::new("\\_SB_.PWRB");
    let notify_pwr = aml::Notify::new(&pwrb, &NOTIFY_POWER_BUTTON);
    let on_pwr = aml::If::new(&pwr_test, vec![&notify_pwr]);
    let evt = aml::Method::new("_EVT".into(), 1, true, vec![&read, &on_cpu, &on_pwr]);
    let hid_name = aml::Name::new("_HID".into(), &hid);
    let uid = aml::Name::new("_UID".into(), &zero);
    let crs_name = aml::Name::new("_CRS".into(), &crs);
    let dev = aml::Device::new("GED0".into(), vec![&hid_name, &uid, &crs_name, &region, &field, &evt]);
    let mut v = Vec::new();
    dev.to_aml_bytes(&mut v);
    v
}

fn power_button() -> Vec<u8> {
    let hid = aml::EISAName::new("PNP0C0C");
    let zero = aml::ZERO;
    let names = [aml::Name::new("_HID".into(), &hid), aml::Name::new("_UID".into(), &zero)];
    let mut v = Vec::new();
    aml::Device::new("PWRB".into(), names.iter().map(|n| n as &dyn Aml).collect()).to_aml_bytes(&mut v);
    v
}

/// `Cxxx`: one possible vCPU.
fn cpu_device(i: u32) -> Vec<u8> {
    let (hid, uid) = ("ACPI0007", i);
    let hid_name = aml::Name::new("_HID".into(), &hid);
    let uid_name = aml::Name::new("_UID".into(), &uid);
    let sta_call = aml::MethodCall::new("CSTS".into(), vec![&uid]);
    let sta_ret = aml::Return::new(&sta_call);
    let sta = aml::Method::new("_STA".into(), 0, false, vec![&sta_ret]);
    let buf = aml::BufferData::new(mat(i));
    let mat_ret = aml::Return::new(&buf);
    let mat_m = aml::Method::new("_MAT".into(), 0, false, vec![&mat_ret]);
    let ej_call = aml::MethodCall::new("CEJ0".into(), vec![&uid]);
    let ej0 = aml::Method::new("_EJ0".into(), 1, false, vec![&ej_call]);
    let mut v = Vec::new();
    aml::Device::new(cpu_name(i).as_str().into(), vec![&hid_name, &uid_name, &sta, &mat_m, &ej0]).to_aml_bytes(&mut v);
    v
}

/// `CSCN`: for each vCPU, select it, then notify and acknowledge a pending insert or remove.
fn scan_method(cpus: u32) -> Vec<u8> {
    let (one, sel) = (aml::ONE, Path::new("CSEL"));
    let (cins, crmv) = (Path::new("CINS"), Path::new("CRMV"));
    let (dc, er) = (NOTIFY_DEVICE_CHECK, NOTIFY_EJECT_REQUEST);
    let acquire = aml::Acquire::new("CLCK".into(), 0xffff);
    let release = aml::Release::new("CLCK".into());
    let ins_test = aml::Equal::new(&cins, &one);
    let rmv_test = aml::Equal::new(&crmv, &one);
    let ack_ins = aml::Store::new(&cins, &one);
    let ack_rmv = aml::Store::new(&crmv, &one);
    let names: Vec<Path> = (0..cpus).map(|i| Path::new(&cpu_name(i))).collect();
    let ids: Vec<u32> = (0..cpus).collect();
    let selects: Vec<aml::Store> = ids.iter().map(|i| aml::Store::new(&sel, i)).collect();
    let ins: Vec<aml::Notify> = names.iter().map(|n| aml::Notify::new(n, &dc)).collect();
    let rmv: Vec<aml::Notify> = names.iter().map(|n| aml::Notify::new(n, &er)).collect();
    let on_ins: Vec<aml::If> = ins.iter().map(|n| aml::If::new(&ins_test, vec![n, &ack_ins])).collect();
    let on_rmv: Vec<aml::If> = rmv.iter().map(|n| aml::If::new(&rmv_test, vec![n, &ack_rmv])).collect();
    let mut body: Vec<&dyn Aml> = vec![&acquire];
    for i in 0..cpus as usize {
        body.extend([&selects[i] as &dyn Aml, &on_ins[i], &on_rmv[i]]);
    }
    body.push(&release);
    let mut v = Vec::new();
    aml::Method::new("CSCN".into(), 0, true, body).to_aml_bytes(&mut v);
    v
}

/// `\_SB.CPUS`: the register block, its methods and the vCPUs.
fn cpus_device(cpus: u32, ged: &Ged) -> Vec<u8> {
    let hid = "ACPI0010";
    let cid = aml::EISAName::new("PNP0A05");
    let hid_name = aml::Name::new("_HID".into(), &hid);
    let cid_name = aml::Name::new("_CID".into(), &cid);
    let mutex = aml::Mutex::new("CLCK".into(), 0);
    let base = ged.mmio_base + REG_CPU_BLOCK;
    let region = aml::OpRegion::new("CREG".into(), OpRegionSpace::SystemMemory, &base, &8u8);
    let select = aml::Field::new(
        "CREG".into(),
        FieldAccessType::DWord,
        FieldLockRule::NoLock,
        FieldUpdateRule::Preserve,
        vec![FieldEntry::Named(*b"CSEL", 32)],
    );
    // Write as zeros: setting one bit writes only that bit (the others are commands too).
    let status = aml::Field::new(
        "CREG".into(),
        FieldAccessType::Byte,
        FieldLockRule::NoLock,
        FieldUpdateRule::WriteAsZeroes,
        vec![
            FieldEntry::Reserved(32),
            FieldEntry::Named(*b"CPEN", 1),
            FieldEntry::Named(*b"CINS", 1),
            FieldEntry::Named(*b"CRMV", 1),
            FieldEntry::Named(*b"CEJF", 1),
            FieldEntry::Reserved(4),
        ],
    );
    let (sel, arg0, local0, one) = (Path::new("CSEL"), aml::Arg(0), aml::Local(0), aml::ONE);
    let acquire = aml::Acquire::new("CLCK".into(), 0xffff);
    let release = aml::Release::new("CLCK".into());
    let select_arg = aml::Store::new(&sel, &arg0);
    // CSTS(i): 0xF (present, enabled, shown, functioning) if enabled, else 0.
    let (zero, all) = (aml::ZERO, 0xfu8);
    let clear = aml::Store::new(&local0, &zero);
    let cpen = Path::new("CPEN");
    let enabled = aml::Equal::new(&cpen, &one);
    let set = aml::Store::new(&local0, &all);
    let if_enabled = aml::If::new(&enabled, vec![&set]);
    let ret = aml::Return::new(&local0);
    let csts =
        aml::Method::new("CSTS".into(), 1, true, vec![&acquire, &select_arg, &clear, &if_enabled, &release, &ret]);
    // CEJ0(i): eject vCPU i.
    let cejf = Path::new("CEJF");
    let eject = aml::Store::new(&cejf, &one);
    let cej0 = aml::Method::new("CEJ0".into(), 1, true, vec![&acquire, &select_arg, &eject, &release]);
    let mut v = Vec::new();
    for a in [&hid_name as &dyn Aml, &cid_name, &mutex, &region, &select, &status, &csts, &cej0] {
        a.to_aml_bytes(&mut v);
    }
    v.extend(scan_method(cpus));
    for i in 0..cpus {
        v.extend(cpu_device(i));
    }
    let mut out = Vec::new();
    aml::Device::new("CPUS".into(), vec![&Raw(v)]).to_aml_bytes(&mut out);
    out
}

/// Already encoded AML.
struct Raw(Vec<u8>);

impl Aml for Raw {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(&self.0);
    }
}

/// The objects to put in `\_SB_`: the GED, the power button and the CPUs.
pub(crate) fn devices(cpus: u32, ged: &Ged) -> Vec<u8> {
    let mut v = ged_device(ged);
    v.extend(power_button());
    v.extend(cpus_device(cpus, ged));
    v
}

/// Wraps already encoded AML for a parent's children list.
pub(crate) fn raw(v: Vec<u8>) -> impl Aml {
    Raw(v)
}
