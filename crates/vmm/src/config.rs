//! VM configuration: from the command line, a JSON or TOML file, or both (flags win).

use std::path::{Path, PathBuf};

pub use kumo_vm::{parse_size, IrqchipMode};
use serde::{Deserialize, Deserializer, Serialize};

use crate::guest_program::GuestProgram;
pub use crate::placement::{HostPlacement, NumaConfig, NumaDistance, NumaNodeSpec, NumaRequest};
use crate::Error;

/// What the VM boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Payload {
    /// One of kumo's own guest programs, with `key=value` arguments. The name and arguments
    /// travel with the VM (migrations, snapshots, `vm.info`); the program itself is resolved
    /// by whoever builds the config (`kumo run --guest NAME`) and is needed only to boot.
    Guest {
        name: String,
        #[serde(default)]
        args: Vec<String>,
        #[serde(skip)]
        program: Option<GuestProgram>,
    },
    /// A Linux kernel (bzImage or PVH vmlinux).
    Kernel {
        path: PathBuf,
        #[serde(default)]
        initrd: Option<PathBuf>,
        #[serde(default)]
        cmdline: Option<String>,
    },
}

impl Payload {
    /// Guest program `name` with `args`, not resolved yet (no program image).
    pub fn guest(name: &str, args: &[&str]) -> Payload {
        Payload::Guest { name: name.into(), args: args.iter().map(|s| s.to_string()).collect(), program: None }
    }
}

/// The command line for `--kernel` without `--cmdline`: the serial console, no reboot loop, and
/// what this project's nested KVM needs (`/work/shared/NESTED-KVM.md`, docs/linux-boot.md). That
/// host leaks CPU features into the guest's CPUID although kumo masks them, and cannot emulate
/// some instructions in guest ring 0:
/// - `noxsave`: XSAVE leaks, and XRSTOR stops the vCPU in the kernel's FPU set-up; with
///   `noxsave` Linux uses FXSAVE/FXRSTOR, which the host emulates.
/// - `clearcpuid=ssse3`: with SSSE3 in CPUID (kumo leaves it: ring-3 SSE code runs natively),
///   the kernel's BLAKE2s (the random pool) runs SSE code (`movd`, `pshufb`, `paddd`, ...) in
///   ring 0 that the host cannot emulate and kumo has no assist for; without SSSE3 it uses the
///   generic C code.
/// - `cryptomgr.notests`: the crypto self-tests run so slowly when emulated that loading the
///   module-signing certificate times out (60 s) waiting for them.
///
/// The other leaked features seen so far (SMAP's CLAC/STAC, POPCNT) and INT3 from text patching
/// are handled by kumo's emulation assists (`kumo_vm::emulate`), so they need nothing here.
pub const DEFAULT_LINUX_CMDLINE: &str =
    "console=ttyS0 earlyprintk=serial,ttyS0,115200 reboot=k panic=-1 noapic nomodule noxsave clearcpuid=ssse3 cryptomgr.notests";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    #[serde(default = "default_cpus")]
    pub cpus: u32,
    /// Bytes; in files also a string such as "512M".
    #[serde(default = "default_memory", deserialize_with = "kumo_vm::memory::deserialize_size")]
    pub memory: u64,
    #[serde(default)]
    pub irqchip: IrqchipMode,
    pub payload: Payload,
    /// NICs, in PCI slot order (`net0` first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub net: Vec<NetSpec>,
    /// virtio-blk disks, in PCI slot order after the NICs (`disk0` first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskSpec>,
    /// Guest NUMA nodes (`--numa`); none: Linux sees one node (no SRAT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa: Option<NumaConfig>,
    /// KVM paravirtual features (`--pv`, docs/pv-features.md); unset ones follow the vCPUs'
    /// placement. The VMM stores the resolved set here at boot, so a migration stream carries
    /// it and the guest's CPUID does not change on the destination.
    #[serde(default, skip_serializing_if = "kumo_vm::pv::PvRequest::is_default")]
    pub pv: kumo_vm::pv::PvRequest,
    /// This host's settings for the VM (vCPU pins, halt polling): not part of the VM
    /// description, so not carried to a migration's destination or into a snapshot.
    #[serde(skip)]
    pub host: HostPlacement,
    /// Elastic sharing of host CPUs and memory with other VMs (`--elastic`, docs/elastic.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<crate::elastic::ElasticConfig>,
    /// The debug exit port (ports 0x501–0x502, `--debug-exit`): how kumo's guests end the VM
    /// with an exit code and mark timings; `kumo run --guest` turns it on, a Linux kernel does
    /// without. Carried to a migration's destination; a stream or snapshot without it comes
    /// from before it was optional, when every VM had the port.
    #[serde(default = "every_vm_had_it")]
    pub debug_exit: bool,
    /// Memory zones (`--memory-zone`): one virtio-mem device each (docs/elastic.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory_zones: Vec<crate::virtio_mem::ZoneSpec>,
    /// Guest RAM's kind as asked: `Some(true)` the shareable memfd (`--shared-memory`: local
    /// migration, a vhost-user backend), `Some(false)` private anonymous memory advised huge
    /// (`--private-memory`, [`kumo_vm::Memory::private`]), `None` kumo's choice
    /// ([`VmConfig::private_memory`]). An arriving VM's is what it arrives with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_memory: Option<bool>,
}

fn every_vm_had_it() -> bool {
    true
}

/// One virtio-net NIC, on a host tap (`tap=NAME[,mac=52:54:00:..][,queues=N][,irq=PATH][,vcpu=N]`)
/// or served by a vhost-user backend (`vhost-user=PATH[,mac=..][,irq=PATH][,vcpu=N]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetSpec {
    /// An existing tap on the host; empty for a vhost-user NIC.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tap: String,
    /// The unix socket of a vhost-user-net backend that serves this NIC's queues (instead of a
    /// tap). In files `vhost_user` (or `vhost-user`).
    #[serde(default, alias = "vhost-user", skip_serializing_if = "Option::is_none")]
    pub vhost_user: Option<std::path::PathBuf>,
    /// `aa:bb:cc:dd:ee:ff`; default: 52:54:00 and three bytes derived from the tap's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Queue pairs.
    #[serde(default = "one")]
    pub queues: u16,
    /// The interrupt path of its queues (seed 000).
    #[serde(default)]
    pub irq: kumo_vm::interrupt_paths::IrqPath,
    /// How long the NIC's thread keeps polling for work after each event, µs (0: it sleeps at
    /// once). Host-side tuning: not carried by a migration or snapshot.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub poll_us: u32,
    /// Offer the tap's checksum and segmentation offloads to the driver (`offload=on|off`,
    /// default on): a Linux driver then moves 64 KiB TCP and UDP super-frames instead of one
    /// frame per MTU. A vhost-user NIC offers what its backend does.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub offload: bool,
    /// Whether the tap comes as descriptors a client passed (CH's `fds`) rather than by name.
    /// Never in config files: descriptors live in this process only.
    #[serde(skip)]
    pub fds: TapFds,
}

/// Where a tap NIC's queues come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TapFds {
    /// Tap `tap`, opened by name.
    #[default]
    ByName,
    /// These descriptors, one per queue pair, all of tap `tap` (kept for every boot).
    Passed(kumo_api::Fds),
    /// A restored or arriving NIC whose tap came as descriptors on its source: `tap` is that
    /// tap's name there, not one to open here; its operator must give it a tap.
    OnSource,
}

fn one() -> u16 {
    1
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// The longest `poll-us` a NIC takes: a window, not a core given away.
pub const MAX_NIC_POLL_US: u32 = 1000;

/// One virtio-blk disk on a raw image file
/// (`path=FILE[,id=ID][,readonly=on][,serial=STR][,queues=N][,queue_size=N][,direct=on]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    pub path: PathBuf,
    /// `disk<i>` when not given (the i-th disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default)]
    pub readonly: bool,
    /// GET_ID's answer (at most 20 bytes).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub serial: String,
    /// Request queues; default one per vCPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<u16>,
    #[serde(default = "default_queue_size")]
    pub queue_size: u16,
    /// O_DIRECT: the host's page cache bypassed.
    #[serde(default)]
    pub direct: bool,
}

fn default_queue_size() -> u16 {
    kumo_devices::virtio::block::QUEUE_SIZE
}

impl DiskSpec {
    /// A read-write disk on `path` with the defaults.
    pub fn new(path: impl Into<PathBuf>) -> DiskSpec {
        DiskSpec {
            path: path.into(),
            id: None,
            readonly: false,
            serial: String::new(),
            queues: None,
            queue_size: default_queue_size(),
            direct: false,
        }
    }

    /// Parses the `--disk` syntax.
    pub fn parse(s: &str) -> Result<DiskSpec, Error> {
        let bad = |m: String| Error::Config(format!("--disk {s}: {m}"));
        let mut d = DiskSpec::new("");
        let mut path = None;
        let on_off = |k: &str, v: &str| match v {
            "on" | "true" | "1" | "yes" => Ok(true),
            "off" | "false" | "0" | "no" => Ok(false),
            _ => Err(bad(format!("{k}=`{v}`: on or off"))),
        };
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            match k {
                "path" => path = Some(PathBuf::from(v)),
                "id" => d.id = Some(v.to_string()),
                "readonly" => d.readonly = on_off(k, v)?,
                "serial" => d.serial = v.to_string(),
                "queues" => d.queues = Some(v.parse().map_err(|_| bad(format!("queues `{v}` is not a number")))?),
                "queue_size" | "queue-size" => {
                    d.queue_size = v.parse().map_err(|_| bad(format!("queue_size `{v}` is not a number")))?
                }
                "direct" => d.direct = on_off(k, v)?,
                _ => {
                    return Err(bad(format!(
                        "unknown key `{k}` (path, id, readonly, serial, queues, queue_size, direct)"
                    )))
                }
            }
        }
        match path {
            Some(p) if !p.as_os_str().is_empty() => d.path = p,
            _ => return Err(bad("path=FILE is required".into())),
        }
        Ok(d)
    }

    /// The disk's id: its own, else `disk<index>`.
    pub fn id_at(&self, index: usize) -> String {
        self.id.clone().unwrap_or_else(|| format!("disk{index}"))
    }

    /// Its request queues on a VM of `cpus` vCPUs: as given, else one per vCPU.
    pub fn queues_for(&self, cpus: u32) -> u16 {
        self.queues.unwrap_or_else(|| cpus.clamp(1, u32::from(kumo_devices::virtio::block::MAX_QUEUES)) as u16)
    }

    /// What the device model's config says (queue counts and sizes are checked there too).
    pub fn block_config(&self, cpus: u32) -> kumo_devices::virtio::block::BlockConfig {
        kumo_devices::virtio::block::BlockConfig {
            serial: self.serial.clone(),
            queues: self.queues_for(cpus),
            queue_size: self.queue_size,
            backend: Default::default(),
        }
    }

    /// Checks what can be checked without opening the image.
    pub fn validate(&self, index: usize, cpus: u32) -> Result<(), Error> {
        let id = self.id_at(index);
        let bad = |m: String| Error::Config(format!("disk {id} ({}): {m}", self.path.display()));
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(bad(format!("id `{id}`: letters, digits, - and _ only")));
        }
        let cfg = self.block_config(cpus);
        use kumo_devices::virtio::block::{MAX_QUEUES, MAX_QUEUE_SIZE};
        if cfg.queues == 0 || cfg.queues > MAX_QUEUES {
            return Err(bad(format!("queues={} is not 1..={MAX_QUEUES}", cfg.queues)));
        }
        if !cfg.queue_size.is_power_of_two() || !(2..=MAX_QUEUE_SIZE).contains(&cfg.queue_size) {
            return Err(bad(format!("queue_size={}: a power of two from 2 to {MAX_QUEUE_SIZE}", cfg.queue_size)));
        }
        if self.serial.len() > 20 {
            return Err(bad(format!("serial `{}` is longer than 20 bytes", self.serial)));
        }
        Ok(())
    }
}

impl NetSpec {
    /// Parses the `--net` syntax.
    pub fn parse(s: &str) -> Result<NetSpec, Error> {
        let bad = |m: String| Error::Config(format!("--net {s}: {m}"));
        let (mut tap, mut mac, mut queues, mut irq, mut vcpu) = (None, None, 1u16, None, None);
        let (mut poll_us, mut offload) = (0u32, None);
        let mut vhost_user = None;
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| bad(format!("`{part}` is not key=value")))?;
            match k {
                "tap" => tap = Some(v.to_string()),
                "vhost-user" | "vhost_user" => {
                    if v.is_empty() {
                        return Err(bad("vhost-user=PATH needs the backend's socket path".into()));
                    }
                    vhost_user = Some(std::path::PathBuf::from(v))
                }
                "mac" => mac = Some(v.to_string()),
                "queues" => queues = v.parse().map_err(|_| bad(format!("queues `{v}` is not a number")))?,
                "irq" => irq = Some(v.to_string()),
                "vcpu" => vcpu = Some(v.parse::<u32>().map_err(|_| bad(format!("vcpu `{v}` is not a number")))?),
                "poll-us" | "poll_us" => {
                    poll_us = v.parse().ok().filter(|&p| p <= MAX_NIC_POLL_US).ok_or_else(|| {
                        bad(format!("poll-us `{v}` is not a number of microseconds up to {MAX_NIC_POLL_US}"))
                    })?
                }
                "offload" => {
                    offload = Some(match v {
                        "on" => true,
                        "off" => false,
                        _ => return Err(bad(format!("offload `{v}` is not on or off"))),
                    })
                }
                _ => {
                    return Err(bad(format!(
                        "unknown key `{k}` (tap, vhost-user, mac, queues, irq, vcpu, poll-us, offload)"
                    )))
                }
            }
        }
        use kumo_vm::interrupt_paths::IrqPath;
        let irq = match (irq.as_deref(), vcpu) {
            (None | Some("direct"), None) => IrqPath::Direct,
            (Some("shared"), None) => IrqPath::Shared,
            (Some("dedicated"), Some(vcpu)) => IrqPath::Dedicated { vcpu },
            (Some("dedicated"), None) => return Err(bad("irq=dedicated needs vcpu=N".into())),
            (None | Some("direct" | "shared"), Some(_)) => {
                return Err(bad("vcpu=N goes with irq=dedicated".into()));
            }
            (Some(p), _) => return Err(bad(format!("unknown irq path `{p}` (direct, dedicated, shared)"))),
        };
        let tap = match (tap, &vhost_user) {
            (Some(_), Some(_)) => return Err(bad("tap= and vhost-user= exclude each other".into())),
            (None, None) => return Err(bad("tap=NAME is required (or vhost-user=PATH)".into())),
            (Some(t), None) if t.is_empty() => return Err(bad("tap=NAME needs a name".into())),
            (t, _) => t.unwrap_or_default(),
        };
        if poll_us > 0 && vhost_user.is_some() {
            return Err(bad("poll-us is for a tap NIC (a vhost-user backend polls, or not, itself)".into()));
        }
        if offload.is_some() && vhost_user.is_some() {
            return Err(bad("offload is for a tap NIC (a vhost-user backend offers its own)".into()));
        }
        let offload = offload.unwrap_or(true);
        let spec = NetSpec { tap, vhost_user, mac, queues, irq, poll_us, offload, fds: TapFds::ByName };
        spec.check_kind().map_err(bad)?;
        spec.mac().map_err(bad)?;
        Ok(spec)
    }

    /// What the NIC is on, for messages: `tap NAME` or `vhost-user PATH`.
    pub fn backend_name(&self) -> String {
        match &self.vhost_user {
            Some(p) => format!("vhost-user {}", p.display()),
            None => format!("tap {}", self.tap),
        }
    }

    /// Exactly one of a tap and a vhost-user socket; a vhost-user NIC has one queue pair.
    fn check_kind(&self) -> Result<(), String> {
        match (&self.vhost_user, self.tap.is_empty()) {
            (Some(_), false) => Err("tap and vhost-user exclude each other".into()),
            (None, true) => Err("a NIC needs a tap or a vhost-user socket".into()),
            (Some(_), true) if self.queues != 1 => {
                Err(format!("queues={}: a vhost-user NIC has one queue pair", self.queues))
            }
            _ => Ok(()),
        }
    }

    /// The NIC's MAC address.
    pub fn mac(&self) -> Result<[u8; 6], String> {
        match &self.mac {
            Some(m) => {
                let mac = kumo_devices::virtio::net::parse_mac(m)?;
                if mac[0] & 1 != 0 {
                    return Err(format!("bad MAC {m}: a multicast address"));
                }
                Ok(mac)
            }
            None => {
                // FNV-1a of the tap's name (or the socket's path): stable across runs and
                // migrations, distinct per tap.
                let name = match &self.vhost_user {
                    Some(p) => p.to_string_lossy().into_owned(),
                    None => self.tap.clone(),
                };
                let h = name
                    .bytes()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
                Ok([0x52, 0x54, 0x00, (h >> 16) as u8, (h >> 8) as u8, h as u8])
            }
        }
    }

    /// Checks what can be checked without the host: queue count, the vCPU of a dedicated path.
    pub fn validate(&self, cpus: u32) -> Result<(), Error> {
        let bad = |m: String| Error::Config(format!("NIC on {}: {m}", self.backend_name()));
        self.check_kind().map_err(bad)?;
        let max = kumo_devices::virtio::net::MAX_PAIRS;
        if self.queues == 0 || self.queues > max {
            return Err(bad(format!("queues={} is not 1..={max}", self.queues)));
        }
        if let kumo_vm::interrupt_paths::IrqPath::Dedicated { vcpu } = self.irq {
            if vcpu >= cpus {
                return Err(bad(format!("irq=dedicated,vcpu={vcpu}: the VM has {cpus} vCPUs")));
            }
        }
        self.mac().map_err(bad)?;
        Ok(())
    }
}

fn default_cpus() -> u32 {
    1
}
fn default_memory() -> u64 {
    256 << 20
}

/// A config file's contents: like `VmConfig`, but everything optional, so flags can complete it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub cpus: Option<u32>,
    #[serde(default, deserialize_with = "opt_size_de")]
    pub memory: Option<u64>,
    pub irqchip: Option<IrqchipMode>,
    pub payload: Option<Payload>,
    #[serde(default)]
    pub net: Vec<NetSpec>,
    #[serde(default)]
    pub disks: Vec<DiskSpec>,
    /// Guest NUMA nodes, or `"mirror"` (as `--numa mirror`).
    #[serde(default)]
    pub numa: Option<NumaRequest>,
    #[serde(default)]
    pub pv: Option<kumo_vm::pv::PvRequest>,
    #[serde(default)]
    pub elastic: Option<crate::elastic::ElasticConfig>,
    #[serde(default)]
    pub debug_exit: Option<bool>,
    #[serde(default)]
    pub memory_zones: Vec<crate::virtio_mem::ZoneSpec>,
    /// `shared_memory = true`: the memfd (`--shared-memory`).
    #[serde(default)]
    pub shared_memory: Option<bool>,
    /// `private_memory = true`: private memory even where kumo would choose the memfd.
    #[serde(default)]
    pub private_memory: Option<bool>,
}

fn opt_size_de<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    kumo_vm::memory::deserialize_size(d).map(Some)
}

impl ConfigFile {
    /// Reads a `.json` or `.toml` file (by extension; otherwise JSON is tried, then TOML).
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let json = || serde_json::from_str::<ConfigFile>(&text).map_err(|e| e.to_string());
        let toml = || toml::from_str::<ConfigFile>(&text).map_err(|e| e.to_string());
        let parsed = match ext {
            "json" => json(),
            "toml" => toml(),
            _ => json().or_else(|_| toml()),
        };
        parsed.map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }
}

impl VmConfig {
    /// A VM booting `payload` with the defaults of a config file that says nothing else: one
    /// vCPU, 256 MiB, KVM's irqchip, no NICs, no NUMA nodes, no pins, the default PV features,
    /// the debug exit port for a kumo guest only. Tests write `VmConfig { cpus: 2,
    /// ..VmConfig::new(payload) }`.
    pub fn new(payload: Payload) -> VmConfig {
        VmConfig {
            cpus: default_cpus(),
            memory: default_memory(),
            irqchip: IrqchipMode::default(),
            debug_exit: matches!(payload, Payload::Guest { .. }),
            payload,
            net: Vec::new(),
            disks: Vec::new(),
            numa: None,
            pv: Default::default(),
            host: Default::default(),
            elastic: None,
            memory_zones: Vec::new(),
            shared_memory: None,
        }
    }

    /// Whether guest RAM is private anonymous memory advised huge ([`kumo_vm::Memory::private`])
    /// rather than the shareable memfd. Private unless asked otherwise (`shared_memory`) or the
    /// VM needs the memfd: that is QEMU's and Cloud Hypervisor's default RAM, and it gets 2 MiB
    /// pages whatever the host's shmem policy says (`never` on many hosts, this one too, which
    /// leaves a memfd on 4 KiB pages: half the guest's write rate here, docs/design.md). The
    /// memfd is for what maps guest memory from another process: a vhost-user NIC's backend,
    /// the local migration engine (ask for it with `--shared-memory`), and `--elastic`, whose
    /// lendable areas are cut out of it; and for sizes that are not whole 2 MiB pages.
    pub fn private_memory(&self) -> bool {
        match self.shared_memory {
            Some(shared) => !shared,
            None => !self.has_vhost_user_nic() && self.elastic.is_none() && kumo_vm::Memory::private_fits(self.memory),
        }
    }

    /// Whether a NIC's queues are served by a vhost-user backend, which maps guest memory.
    pub fn has_vhost_user_nic(&self) -> bool {
        self.net.iter().any(|n| n.vhost_user.is_some())
    }

    /// Checks the VM's shape before anything is allocated: vCPUs and memory against kumo's and
    /// this host's limits (`kumo_vm::vm::check_shape`), and a kumo guest's own vCPU range
    /// and arguments (the registered `guest_program::GuestCheck`).
    /// Every path that builds a VM comes through here, incoming migrations included.
    pub fn validate_shape(&self) -> Result<(), Error> {
        self.validate_shape_on(&kumo_vm::vm::HostLimits::probe()?)
    }

    /// [`Self::validate_shape`] against given host limits.
    pub fn validate_shape_on(&self, host: &kumo_vm::vm::HostLimits) -> Result<(), Error> {
        kumo_vm::vm::check_shape(self.cpus, self.memory, host)?;
        if let Payload::Guest { name, args, .. } = &self.payload {
            crate::guest_program::check(name, args, self.cpus)?;
        }
        Ok(())
    }

    /// Checks what can be checked before touching KVM: the shape and the payload.
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_common()?;
        match &self.payload {
            Payload::Guest { name, program: None, .. } => {
                return Err(Error::Config(format!(
                    "guest {name}: no program image given (`kumo run --guest` resolves it)"
                )));
            }
            Payload::Guest { .. } => {}
            Payload::Kernel { path, initrd, .. } => {
                for (what, p) in
                    std::iter::once(("kernel", Some(path))).chain(std::iter::once(("initrd", initrd.as_ref())))
                {
                    if let Some(p) = p {
                        if !p.is_file() {
                            return Err(Error::Config(format!(
                                "{what} {} does not exist or is not a file",
                                p.display()
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// What [`Self::validate`] checks of a VM that boots here and of one that arrives (a
    /// migration's or a snapshot's, after its host resources are resolved): the shape, the NICs,
    /// the NUMA nodes (their host nodes exist), elastic sharing.
    fn validate_common(&self) -> Result<(), Error> {
        self.validate_shape()?;
        self.validate_net()?;
        self.validate_disks()?;
        self.validate_numa()?;
        self.validate_elastic()?;
        self.validate_zones()
    }

    /// Checks the memory zones: each one's sizes and node, ids unique, not with `--elastic`
    /// (one mechanism per VM).
    pub fn validate_zones(&self) -> Result<(), Error> {
        let nodes = self.numa.as_ref().map_or(1, |n| n.nodes.len() as u32);
        for (i, z) in self.memory_zones.iter().enumerate() {
            z.validate(i, nodes)?;
            if self.memory_zones[..i].iter().enumerate().any(|(j, o)| o.id_at(j) == z.id_at(i)) {
                return Err(Error::Config(format!("memory zone id {} is given twice", z.id_at(i))));
            }
        }
        if !self.memory_zones.is_empty() && self.elastic.is_some() {
            return Err(Error::Config(
                "--memory-zone and --elastic do not mix: a VM lends memory through virtio-mem or its kumo guest's mailbox".into(),
            ));
        }
        Ok(())
    }

    /// Checks an arriving VM (a migration stream's or a snapshot's config, its host resources
    /// resolved) as strictly as a `kumo run` config, except that a kernel is not loaded again
    /// (its path is the source's): [`Self::validate`] without the payload's files. Elastic VMs do
    /// not migrate.
    pub fn validate_arriving(&self) -> Result<(), Error> {
        if self.elastic.is_some() {
            return Err(Error::Config("an elastic VM cannot arrive by migration or restore".into()));
        }
        if !self.memory_zones.is_empty() {
            return Err(Error::Config(
                "a VM with memory zones (virtio-mem) cannot arrive by migration or restore".into(),
            ));
        }
        self.validate_common()
    }

    /// Checks the NICs: each on its own tap, within PCI's 31 device numbers.
    pub fn validate_net(&self) -> Result<(), Error> {
        if self.net.len() > 30 {
            return Err(Error::Config(format!("{} NICs: at most 30 fit on PCI bus 0", self.net.len())));
        }
        for (i, n) in self.net.iter().enumerate() {
            n.validate(self.cpus)?;
            if !n.tap.is_empty() && self.net[..i].iter().any(|m| m.tap == n.tap) {
                return Err(Error::Config(format!("tap {} is given to two NICs", n.tap)));
            }
            if let Some(p) = &n.vhost_user {
                if self.shared_memory == Some(false) {
                    return Err(Error::Config(format!(
                        "the NIC on vhost-user socket {} needs guest memory its backend can map: \
                         this VM's memory is private (kumo's default, or --private-memory) and \
                         cannot be shared; --shared-memory gives a VM memory that can",
                        p.display()
                    )));
                }
                if self.net[..i].iter().any(|m| m.vhost_user.as_ref() == Some(p)) {
                    return Err(Error::Config(format!("vhost-user socket {} is given to two NICs", p.display())));
                }
            }
        }
        Ok(())
    }

    /// Checks the disks: ids unique, each image given once, NICs and disks within PCI's slots.
    pub fn validate_disks(&self) -> Result<(), Error> {
        if self.net.len() + self.disks.len() > 30 {
            return Err(Error::Config(format!(
                "{} NICs and {} disks: at most 30 fit on PCI bus 0",
                self.net.len(),
                self.disks.len()
            )));
        }
        for (i, d) in self.disks.iter().enumerate() {
            d.validate(i, self.cpus)?;
            let id = d.id_at(i);
            if self.disks[..i].iter().enumerate().any(|(j, e)| e.id_at(j) == id) {
                return Err(Error::Config(format!("disk id {id} is given twice")));
            }
            if self.disks[..i].iter().any(|e| e.path == d.path) {
                return Err(Error::Config(format!("disk image {} is given to two disks", d.path.display())));
            }
        }
        Ok(())
    }

    /// Checks `--elastic` against the rest: a kumo guest (only they speak the channel), vCPU
    /// pins of its own, room for the areas. Any irqchip: the channel's interrupt goes through
    /// `kumo_vm::interrupts`, which reaches kumo's LAPICs with `--irqchip user` too.
    pub fn validate_elastic(&self) -> Result<(), Error> {
        let Some(e) = &self.elastic else { return Ok(()) };
        e.validate(self.cpus)?;
        let bad = |m: &str| Err(Error::Config(format!("--elastic: {m}")));
        if !matches!(self.payload, Payload::Guest { .. }) {
            return bad("needs a kumo guest that speaks the elastic channel (e.g. --guest worker)");
        }
        if self.host.pins.iter().any(Option::is_some) || self.numa.as_ref().is_some_and(|n| n.pins_vcpus()) {
            return bad("pins the vCPUs itself (cpus=); drop --cpus …,pin= and --numa …,pin=");
        }
        // Its areas are memory slots of their own, which all-private RAM does not cut out.
        if self.shared_memory == Some(false) {
            return bad("its lendable memory is private anonymous memory already: drop --private-memory");
        }
        // A released block is fenced off (PROT_NONE): a device writing guest memory where the
        // guest tells it could be pointed into one.
        if !self.net.is_empty() || !self.disks.is_empty() {
            return bad(
                "has no NICs (--net) or disks (--disk): a released block must be out of every device's reach too",
            );
        }
        let topo = self.numa_topology()?;
        let layout = kumo_vm::layout::MemoryLayout::new(self.memory);
        crate::elastic::plan_areas(e, &layout, self.numa.as_ref().zip(topo.as_ref()))?;
        Ok(())
    }

    /// Checks the guest NUMA nodes, if any: the topology and that each host node exists.
    pub fn validate_numa(&self) -> Result<(), Error> {
        self.validate_numa_on(Path::new(crate::placement::HOST_NODE_SYSFS))
    }

    /// [`Self::validate_numa`] with the host's nodes listed under `sysfs`.
    pub fn validate_numa_on(&self, sysfs: &Path) -> Result<(), Error> {
        if let Some(n) = &self.numa {
            n.topology(self.cpus, self.memory)?;
            n.check_host_nodes(sysfs)?;
        }
        Ok(())
    }

    /// The guest NUMA topology for the ACPI tables, or None without `numa`.
    pub fn numa_topology(&self) -> Result<Option<kumo_acpi::NumaTopology>, Error> {
        self.numa.as_ref().map(|n| n.topology(self.cpus, self.memory)).transpose()
    }

    /// A short description of the payload, e.g. `guest:memtouch`.
    pub fn payload_name(&self) -> String {
        match &self.payload {
            Payload::Guest { name, .. } => format!("guest:{name}"),
            Payload::Kernel { path, .. } => format!("kernel:{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kumo-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn toml_and_json_files() {
        let t = ConfigFile::load(&write(
            "a.toml",
            "cpus = 2\nmemory = \"512M\"\n[payload.guest]\nname = \"memtouch\"\nargs = [\"pages=10\"]\n",
        ))
        .unwrap();
        assert_eq!(t.cpus, Some(2));
        assert_eq!(t.memory, Some(512 << 20));
        assert_eq!(t.payload, Some(Payload::guest("memtouch", &["pages=10"])));
        let j = ConfigFile::load(&write(
            "b.json",
            r#"{"memory": 67108864, "irqchip": "split", "payload": {"kernel": {"path": "/k"}}}"#,
        ))
        .unwrap();
        assert_eq!(j.memory, Some(64 << 20));
        assert_eq!(j.irqchip, Some(IrqchipMode::Split));
        assert!(matches!(j.payload, Some(Payload::Kernel { .. })));
        let u = ConfigFile::load(&write("c.toml", "irqchip = \"user\"\n")).unwrap();
        assert_eq!(u.irqchip, Some(IrqchipMode::User));
    }

    fn base() -> VmConfig {
        VmConfig { memory: 64 << 20, ..VmConfig::new(Payload::guest("hello", &[])) }
    }

    #[test]
    fn net_poll_us_is_bounded_and_for_taps_only() {
        assert_eq!(NetSpec::parse("tap=t0").unwrap().poll_us, 0);
        assert_eq!(NetSpec::parse("tap=t0,poll-us=50").unwrap().poll_us, 50);
        assert!(NetSpec::parse("tap=t0").unwrap().offload, "offloads are on by default");
        assert!(!NetSpec::parse("tap=t0,offload=off").unwrap().offload);
        assert!(NetSpec::parse("tap=t0,offload=on").unwrap().offload);
        for (bad, why) in [
            ("tap=t0,offload=yes", "offload `yes` is not on or off"),
            ("vhost-user=/a.sock,offload=off", "offload is for a tap NIC"),
        ] {
            let e = NetSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        for (spec, want) in [
            ("tap=t0,poll-us=1001", "poll-us `1001` is not a number of microseconds up to 1000"),
            ("tap=t0,poll-us=x", "poll-us `x` is not a number"),
            ("vhost-user=/a.sock,poll-us=10", "poll-us is for a tap NIC"),
        ] {
            let e = NetSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{spec}: {e}");
        }
        // Host-side tuning: a config file without it reads as 0, and 0 is not written.
        let json = serde_json::to_string(&NetSpec::parse("tap=t0").unwrap()).unwrap();
        assert!(!json.contains("poll"), "{json}");
    }

    #[test]
    fn net_vhost_user_parses_and_bad_input_is_one_line() {
        let n = NetSpec::parse("vhost-user=/run/nb.sock,mac=52:54:00:aa:bb:cc").unwrap();
        assert_eq!(n.vhost_user.as_deref(), Some(Path::new("/run/nb.sock")));
        assert_eq!(n.tap, "");
        assert_eq!(n.mac().unwrap(), [0x52, 0x54, 0, 0xaa, 0xbb, 0xcc]);
        assert_eq!(n.backend_name(), "vhost-user /run/nb.sock");
        let d = NetSpec::parse("vhost-user=/run/nb.sock,irq=dedicated,vcpu=1").unwrap();
        assert_eq!(d.irq, kumo_vm::interrupt_paths::IrqPath::Dedicated { vcpu: 1 });
        // The default MAC is derived from the path: stable, unicast, distinct per socket.
        let m = NetSpec::parse("vhost-user=/a.sock").unwrap().mac().unwrap();
        assert_eq!(m, NetSpec::parse("vhost-user=/a.sock").unwrap().mac().unwrap());
        assert_ne!(m, NetSpec::parse("vhost-user=/b.sock").unwrap().mac().unwrap());
        assert_eq!(m[..3], [0x52, 0x54, 0]);
        for (arg, want) in [
            ("vhost-user=", "needs the backend's socket path"),
            ("vhost-user=/s,tap=t0", "exclude each other"),
            ("mac=52:54:00:00:00:01", "tap=NAME is required (or vhost-user=PATH)"),
            ("vhost-user=/s,queues=2", "one queue pair"),
            ("vhost-user=/s,mac=01:00:00:00:00:01", "multicast"),
            ("vhost-user=/s,sock=/t", "unknown key `sock`"),
        ] {
            let e = NetSpec::parse(arg).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{arg}: {e}");
        }
        // In config files, with either spelling; the same socket twice is refused.
        let f = ConfigFile::load(&write(
            "vu.toml",
            "[[net]]\nvhost_user = \"/run/a.sock\"\n[[net]]\n\"vhost-user\" = \"/run/b.sock\"\nmac = \"52:54:00:00:00:02\"\n",
        ))
        .unwrap();
        assert_eq!(f.net[0].vhost_user.as_deref(), Some(Path::new("/run/a.sock")));
        assert_eq!(f.net[1].vhost_user.as_deref(), Some(Path::new("/run/b.sock")));
        let mut c = VmConfig { net: f.net.clone(), ..base() };
        c.validate_net().unwrap();
        c.net[1].vhost_user = c.net[0].vhost_user.clone();
        let e = c.validate_net().unwrap_err().to_string();
        assert!(e.contains("given to two NICs"), "{e}");
        // A backend maps guest memory: private memory cannot be given to it.
        let p = VmConfig { net: f.net.clone(), shared_memory: Some(false), ..base() };
        let e = p.validate_net().unwrap_err().to_string();
        assert!(e.contains("/run/a.sock") && e.contains("--shared-memory") && !e.contains('\n'), "{e}");
        let taps = VmConfig { net: vec![NetSpec::parse("tap=t0").unwrap()], shared_memory: Some(false), ..base() };
        taps.validate_net().unwrap();
        // Unasked, a backend's VM gets the memfd, a tap's private memory.
        assert!(!VmConfig { net: f.net.clone(), ..base() }.private_memory());
        assert!(VmConfig { net: taps.net.clone(), ..base() }.private_memory());
        // An elastic VM's areas are slots of their own: not cut out of all-private RAM.
        let elastic = VmConfig {
            cpus: 2,
            payload: Payload::guest("worker", &[]),
            elastic: Some(crate::elastic::ElasticConfig::parse("cpus=1").unwrap()),
            ..base()
        };
        elastic.validate_elastic().unwrap();
        assert!(!elastic.private_memory(), "an elastic VM's areas are cut out of the memfd");
        let e = VmConfig { shared_memory: Some(false), ..elastic }.validate_elastic().unwrap_err().to_string();
        assert!(e.contains("--elastic") && e.contains("--private-memory"), "{e}");
        let e = ConfigFile::load(&write("vu2.json", r#"{"net": [{"mac": "52:54:00:00:00:02"}]}"#))
            .map(|f| VmConfig { net: f.net, ..base() }.validate_net())
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a tap or a vhost-user socket"), "{e}");
        // A tap NIC's config reads and writes as before (no vhost_user key).
        let t = NetSpec::parse("tap=t0").unwrap();
        let j = serde_json::to_value(&t).unwrap();
        assert!(j.get("vhost_user").is_none(), "{j}");
        assert_eq!(serde_json::from_value::<NetSpec>(j).unwrap(), t);
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let e = ConfigFile::load(&write("c.toml", "cpus = \"many\"\n")).unwrap_err().to_string();
        assert!(e.contains("c.toml"), "{e}");
        let e = ConfigFile::load(&write("d.json", r#"{"cpu": 1}"#)).unwrap_err().to_string();
        assert!(e.contains("unknown field"), "{e}");
        let e = ConfigFile::load(&write("e.json", r#"{"memory": "lots"}"#)).unwrap_err().to_string();
        assert!(e.contains("not a size"), "{e}");
        let e = ConfigFile::load(Path::new("/nonexistent/kumo.toml")).unwrap_err().to_string();
        assert!(e.contains("cannot read /nonexistent/kumo.toml"), "{e}");
    }

    #[test]
    fn validation() {
        crate::guest_program::tests::test_guests();
        // A guest resolved by its caller (an empty image: nothing is loaded here).
        let guest = |name: &str, args: &[&str]| match Payload::guest(name, args) {
            Payload::Guest { name, args, .. } => {
                let program = crate::GuestProgram { elf: std::sync::Arc::from(&[][..]), cmdline: args.join(" ") };
                Payload::Guest { name, args, program: Some(program) }
            }
            k => k,
        };
        let ok = VmConfig { memory: 64 << 20, ..VmConfig::new(guest("hello", &[])) };
        ok.validate().unwrap();
        assert!(ok.debug_exit, "a kumo guest's VM has the debug exit port");
        let e = VmConfig { payload: Payload::guest("hello", &[]), ..ok.clone() }.validate().unwrap_err().to_string();
        assert!(e.contains("guest hello: no program image given"), "{e}");
        assert!(VmConfig { cpus: 0, ..ok.clone() }.validate().unwrap_err().to_string().contains("at least 1"));
        assert!(VmConfig { cpus: 9999, ..ok.clone() }.validate().unwrap_err().to_string().contains("kumo's limit"));
        assert!(VmConfig { memory: 1000, ..ok.clone() }.validate().unwrap_err().to_string().contains("4 KiB"));
        assert!(VmConfig { payload: guest("nope", &[]), ..ok.clone() }
            .validate()
            .unwrap_err()
            .to_string()
            .contains("unknown guest"));
        assert!(VmConfig { payload: guest("smp", &[]), ..ok.clone() }
            .validate()
            .unwrap_err()
            .to_string()
            .contains("vCPUs"));
        assert!(VmConfig { payload: guest("memtouch", &["pages=x"]), ..ok.clone() }.validate().is_err());
        let k = Payload::Kernel { path: "/no/such/bzImage".into(), initrd: None, cmdline: None };
        assert!(VmConfig { payload: k, ..ok.clone() }
            .validate()
            .unwrap_err()
            .to_string()
            .contains("/no/such/bzImage does not exist"));
        let e = VmConfig { memory: 1000 << 40, ..ok }.validate().unwrap_err().to_string();
        assert!(e.contains("memory 1000 TiB is more than this host can back"), "{e}");
    }

    #[test]
    fn disk_specs_parse_check_and_read_from_files() {
        let d = DiskSpec::parse("path=/i.img,id=root,readonly=on,serial=s1,queues=2,queue_size=128,direct=on").unwrap();
        assert_eq!(
            d,
            DiskSpec {
                path: "/i.img".into(),
                id: Some("root".into()),
                readonly: true,
                serial: "s1".into(),
                queues: Some(2),
                queue_size: 128,
                direct: true
            }
        );
        let plain = DiskSpec::parse("path=/i.img").unwrap();
        assert_eq!((plain.id_at(3), plain.queues_for(4), plain.readonly), ("disk3".to_string(), 4, false));
        for (arg, want) in [
            ("path=/i.img,cache=none", "--disk path=/i.img,cache=none: unknown key `cache` (path, id, readonly, serial, queues, queue_size, direct)"),
            ("readonly=on", "--disk readonly=on: path=FILE is required"),
            ("path=/i.img,readonly=yes please", "--disk path=/i.img,readonly=yes please: readonly=`yes please`: on or off"),
            ("path=/i.img,queues=x", "--disk path=/i.img,queues=x: queues `x` is not a number"),
            ("path", "--disk path: `path` is not key=value"),
        ] {
            assert_eq!(DiskSpec::parse(arg).unwrap_err().to_string(), format!("config: {want}"));
        }
        let vm =
            |disks: &[&str]| VmConfig { disks: disks.iter().map(|s| DiskSpec::parse(s).unwrap()).collect(), ..base() };
        vm(&["path=/a", "path=/b,id=data"]).validate_disks().unwrap();
        for (disks, want) in [
            (&["path=/a", "path=/a"][..], "disk image /a is given to two disks"),
            (&["path=/a,id=x", "path=/b,id=x"][..], "disk id x is given twice"),
            (&["path=/a,queues=0"][..], "disk disk0 (/a): queues=0 is not 1..=64"),
            (&["path=/a,queue_size=100"][..], "disk disk0 (/a): queue_size=100: a power of two from 2 to 1024"),
            (&["path=/a,id=a b"][..], "disk a b (/a): id `a b`: letters, digits, - and _ only"),
            (
                &["path=/a,serial=123456789012345678901"][..],
                "disk disk0 (/a): serial `123456789012345678901` is longer than 20 bytes",
            ),
        ] {
            assert_eq!(vm(disks).validate_disks().unwrap_err().to_string(), format!("config: {want}"));
        }
        let f: ConfigFile = toml::from_str("disks = [{ path = \"/a\", readonly = true }]").unwrap();
        assert_eq!(f.disks, [DiskSpec { readonly: true, ..DiskSpec::new("/a") }]);
        assert!(toml::from_str::<ConfigFile>("disks = [{ path = \"/a\", cache = 1 }]").is_err());
        assert!(VmConfig::new(Payload::guest("hello", &[])).disks.is_empty());
    }

    #[test]
    fn shape_table() {
        use kumo_vm::memory::HostMemory;
        crate::guest_program::tests::test_guests();
        use kumo_vm::vm::HostLimits;
        let host = HostLimits { memory: HostMemory { total: 24 << 30 }, kvm_max_vcpus: Some(128) };
        let guest = |name: &str| Payload::guest(name, &[]);
        let kernel = Payload::Kernel { path: "/k".into(), initrd: None, cmdline: None };
        let vm = |cpus, memory, payload: Payload| VmConfig { cpus, memory, ..VmConfig::new(payload) };
        for ok in [
            vm(1, 8 << 20, guest("hello")),
            vm(64, 1 << 30, guest("memtouch")),
            vm(2, 256 << 20, guest("smp")),
            vm(128, 20 << 30, kernel.clone()),
        ] {
            ok.validate_shape_on(&host).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
        let bad = [
            (vm(0, 256 << 20, guest("hello")), "cpus must be at least 1"),
            (vm(65, 256 << 20, guest("memtouch")), "runs on 1..=64 vCPUs, not 65"),
            (vm(200, 256 << 20, guest("memtouch")), "KVM limit of 128"),
            (vm(241, 256 << 20, kernel.clone()), "exceeds kumo's limit of 240"),
            (vm(1, 256 << 20, guest("smp")), "runs on 2..=64 vCPUs, not 1"),
            (vm(1, 4 << 20, guest("hello")), "at least 8 MiB"),
            (vm(1, (8 << 20) + 1, guest("hello")), "multiple of 4 KiB"),
            (
                vm(1, 1 << 40, kernel.clone()),
                "memory 1 TiB is more than this host can back (22.8 GiB usable of 24 GiB)",
            ),
            (vm(1, 1 << 50, guest("memtouch")), "memory 1 PiB is more than this host can back"),
            (vm(1, 256 << 20, guest("nope")), "unknown guest `nope`"),
        ];
        for (c, want) in bad {
            let e = c.validate_shape_on(&host).unwrap_err().to_string();
            assert!(e.contains(want) && !e.contains('\n'), "{c:?}: want `{want}` in `{e}`");
        }
    }

    #[test]
    fn numa_in_files_and_streams() {
        let t = ConfigFile::load(&write(
            "n.toml",
            "cpus = 2\nmemory = \"512M\"\n[[numa.nodes]]\nid = 0\ncpus = [0]\nmemory = \"256M\"\nhost_node = 0\n\
             [[numa.nodes]]\nid = 1\ncpus = [1]\nmemory = 268435456\n\
             [[numa.distances]]\nsrc = 0\ndst = 1\nvalue = 21\n",
        ))
        .unwrap();
        let Some(NumaRequest::Nodes(numa)) = t.numa else { panic!("not nodes: {:?}", t.numa) };
        assert_eq!(
            numa.nodes[0],
            NumaNodeSpec { id: 0, cpus: vec![0], memory: 256 << 20, host_node: Some(0), pin: None }
        );
        assert_eq!(numa.nodes[1].memory, 256 << 20);
        assert_eq!(numa.distances, vec![NumaDistance { src: 0, dst: 1, value: 21 }]);
        let c =
            VmConfig { cpus: 2, memory: 512 << 20, numa: Some(numa), ..VmConfig::new(Payload::guest("memtouch", &[])) };
        // A config travels in migration streams and snapshots: the topology survives the trip
        // (the host node, this host's, does not), and a config without NUMA nodes reads and
        // writes as before.
        let back: VmConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        let mut here = c.clone();
        here.numa.as_mut().unwrap().nodes[0].host_node = None;
        assert_eq!(back, here);
        assert_eq!(back.numa_topology().unwrap().unwrap().nodes[1].memory, vec![(256 << 20, 256 << 20)]);
        let plain = VmConfig { numa: None, ..c.clone() };
        assert!(!serde_json::to_string(&plain).unwrap().contains("numa"));
        let old: VmConfig =
            serde_json::from_str(r#"{"cpus": 1, "memory": 67108864, "payload": {"guest": {"name": "hello"}}}"#)
                .unwrap();
        assert_eq!(old.numa, None);
        // Host nodes are looked up under the given sysfs root.
        let root = std::env::temp_dir().join(format!("kumo-cfg-sysfs-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let e = c.validate_numa_on(&root).unwrap_err().to_string();
        assert!(e.contains("NUMA node 0: host node 0 does not exist"), "{e}");
        std::fs::create_dir_all(root.join("node0")).unwrap();
        c.validate_numa_on(&root).unwrap();
        let e = VmConfig { memory: 1 << 30, ..c }.validate_numa_on(&root).unwrap_err().to_string();
        assert!(e.contains("sums to 512 MiB, not the VM's memory of 1 GiB"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// The debug exit port travels with the VM; a stream or snapshot from before it was
    /// optional keeps the port every VM then had.
    #[test]
    fn debug_exit_travels_and_old_streams_keep_the_port() {
        let k = VmConfig::new(Payload::Kernel { path: "/k".into(), initrd: None, cmdline: None });
        assert!(!k.debug_exit);
        let v = serde_json::to_value(&k).unwrap();
        assert_eq!(v["debug_exit"], false);
        assert_eq!(serde_json::from_value::<VmConfig>(v).unwrap(), k);
        let old: VmConfig = serde_json::from_str(r#"{"payload": {"kernel": {"path": "/k"}}}"#).unwrap();
        assert!(old.debug_exit);
        assert_eq!(ConfigFile::load(&write("x.toml", "debug_exit = true\n")).unwrap().debug_exit, Some(true));
    }

    /// A config file can say `mirror` as `--numa mirror` does, in TOML and JSON; the CLI then
    /// plans it with `placement::place` exactly as the flag.
    #[test]
    fn numa_mirror_in_files() {
        let t = ConfigFile::load(&write("m.toml", "cpus = 4\nmemory = \"4G\"\nnuma = \"mirror\"\n")).unwrap();
        assert_eq!(t.numa, Some(NumaRequest::Mirror));
        let j = ConfigFile::load(&write("m.json", r#"{"cpus": 2, "numa": "mirror"}"#)).unwrap();
        assert_eq!(j.numa, Some(NumaRequest::Mirror));
        let e = ConfigFile::load(&write("m2.toml", "numa = \"mirrored\"\n")).unwrap_err().to_string();
        assert!(e.contains("m2.toml") && e.contains(r#"expected "mirror" or a table of nodes"#), "{e}");
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs-2node");
        let host = || crate::placement::HostTopology::read(&fixture);
        let (numa, pins) = crate::placement::place(4, 4 << 30, vec![], t.numa, host).unwrap();
        let nodes = numa.unwrap().nodes;
        assert_eq!(
            nodes.iter().map(|n| (n.cpus.clone(), n.host_node)).collect::<Vec<_>>(),
            [(vec![0, 1], Some(0)), (vec![2, 3], Some(1))]
        );
        assert_eq!(pins, [Some(0), Some(1), Some(8), Some(9)]);
    }

    #[test]
    fn absurd_sizes_in_files_are_refused() {
        let e = ConfigFile::load(&write("f.toml", "memory = \"99999999999T\"\n")).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        assert_eq!(ConfigFile::load(&write("g.toml", "memory = \"1.5G\"\n")).unwrap().memory, Some(3 << 29));
    }

    /// The PV choice travels in migration streams and snapshots; a config without one reads
    /// and writes as before (no `pv` key).
    #[test]
    fn pv_travels_and_old_configs_read_as_before() {
        use kumo_vm::pv::{PvRequest, PvSet};
        let c = VmConfig { memory: 64 << 20, ..VmConfig::new(Payload::guest("hello", &[])) };
        let v = serde_json::to_value(&c).unwrap();
        assert!(v.get("pv").is_none(), "{v}");
        assert_eq!(serde_json::from_value::<VmConfig>(v).unwrap(), c);
        let c = VmConfig { pv: PvRequest::from_set(PvSet::DEDICATED), ..c };
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["pv"]["realtime"], true);
        assert_eq!(serde_json::from_value::<VmConfig>(v).unwrap(), c);
    }
}
