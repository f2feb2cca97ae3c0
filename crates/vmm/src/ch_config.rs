//! Cloud Hypervisor's `VmConfig` (`vm.create`, checked field by field in
//! `kumo_api::ch`) to kumo's own [`VmConfig`], and back for `vm.info` of a VM kumo built
//! otherwise (docs/ch-compat.md).

use std::path::PathBuf;

use kumo_api::ch::{ChCpus, ChDisk, ChMemory, ChNet, ChPayload, ChVmConfig};

use crate::config::{DiskSpec, NetSpec, Payload, TapFds, VmConfig};

/// CH's memory size when `memory` is absent.
const CH_DEFAULT_MEMORY: u64 = 512 << 20;

fn refused(field: &str, why: &str) -> String {
    format!("vm.create: field `{field}` is not supported by kumo: {why}")
}

/// The VM CH's config describes, as `kumo run` would boot it; the reason it cannot otherwise.
pub fn from_ch(c: &ChVmConfig) -> Result<VmConfig, String> {
    let boot = c.cpus.as_ref().map_or(1, |c| c.boot_vcpus);
    let max = c.cpus.as_ref().and_then(|c| c.max_vcpus).unwrap_or(boot);
    if boot == 0 || max < boot {
        return Err(format!("vm.create: cpus: boot_vcpus {boot} must be at least 1 and at most max_vcpus {max}"));
    }
    if max > boot {
        // kumo's vm.resize gives back vCPUs the guest ejected; it cannot boot some offline.
        return Err(refused("cpus.max_vcpus", &format!("{max} above boot_vcpus {boot} (kumo boots every vCPU)")));
    }
    let kernel =
        c.payload.as_ref().and_then(|p| p.kernel.clone()).or_else(|| c.kernel.as_ref().map(|k| k.path.clone()));
    let kernel = kernel.ok_or("vm.create: no kernel: give payload.kernel (or kernel.path)")?;
    let cmdline =
        c.payload.as_ref().and_then(|p| p.cmdline.clone()).or_else(|| c.cmdline.as_ref().map(|a| a.args.clone()));
    let initrd =
        c.payload.as_ref().and_then(|p| p.initramfs.clone()).or_else(|| c.initramfs.as_ref().map(|i| i.path.clone()));
    let payload = Payload::Kernel { path: PathBuf::from(kernel), initrd: initrd.map(PathBuf::from), cmdline };
    let mut v = VmConfig::new(payload);
    v.cpus = boot;
    v.memory = c.memory.as_ref().map_or(CH_DEFAULT_MEMORY, |m| m.size);
    // CH's `shared=false` is its default and says nothing: kumo chooses (private, or the memfd
    // for a vhost-user NIC, which CH would refuse).
    v.shared_memory = c.memory.as_ref().filter(|m| m.shared).map(|_| true);
    v.disks = c.disks.iter().flatten().enumerate().map(|(i, d)| disk(i, d)).collect::<Result<_, _>>()?;
    v.net = c.net.iter().flatten().enumerate().map(|(i, n)| nic(i, n)).collect::<Result<_, _>>()?;
    Ok(v)
}

/// The `i`-th disk.
pub fn disk(i: usize, d: &ChDisk) -> Result<DiskSpec, String> {
    let path = d.path.as_ref().ok_or_else(|| format!("vm.create: disks[{i}] has no path"))?;
    let mut s = DiskSpec::new(path);
    s.id.clone_from(&d.id);
    s.readonly = d.readonly;
    s.direct = d.direct;
    s.serial = d.serial.clone().unwrap_or_default();
    s.queues = d.num_queues;
    if let Some(q) = d.queue_size {
        s.queue_size = q;
    }
    Ok(s)
}

/// The `i`-th NIC.
pub fn nic(i: usize, n: &ChNet) -> Result<NetSpec, String> {
    if !n.tap_fds.is_empty() {
        return nic_on_fds(i, n);
    }
    // CH counts queues, kumo queue pairs (CH's default 2 is one pair).
    let queues = n.num_queues.map_or(1, |q| (q / 2).max(1));
    let (tap, vhost_user) = match (n.vhost_user, &n.vhost_socket, &n.tap) {
        (true, Some(sock), _) => (String::new(), Some(PathBuf::from(sock))),
        (true, None, _) => return Err(format!("vm.create: net[{i}]: vhost_user needs vhost_socket")),
        (false, _, Some(tap)) if !tap.is_empty() => (tap.clone(), None),
        (false, ..) => return Err(refused(&format!("net[{i}].tap"), "none given: kumo opens an existing tap by name")),
    };
    Ok(NetSpec {
        tap,
        vhost_user,
        mac: n.mac.clone(),
        queues,
        irq: Default::default(),
        poll_us: 0,
        // A vhost-user backend offers its own.
        offload: n.vhost_user || offload(n),
        fds: TapFds::ByName,
    })
}

/// CH's `offload_tso` and `offload_csum` (both default on): kumo's offloads are on only if
/// neither is off.
fn offload(n: &ChNet) -> bool {
    n.offload_tso.unwrap_or(true) && n.offload_csum.unwrap_or(true)
}

/// The `i`-th NIC, on the tap whose descriptors came with the request: one per queue pair.
fn nic_on_fds(i: usize, n: &ChNet) -> Result<NetSpec, String> {
    let bad = |why: String| format!("net[{i}]: {why}");
    if n.vhost_user {
        return Err(bad("a vhost-user NIC takes no tap descriptors (`fds`)".into()));
    }
    let tap = tap_of_fds(&n.tap_fds).map_err(bad)?;
    if let Some(named) = n.tap.as_deref().filter(|t| !t.is_empty() && **t != tap) {
        return Err(bad(format!("`tap` {named} is not the tap its descriptors are of ({tap})")));
    }
    let pairs = n.tap_fds.len();
    if let Some(q) = n.num_queues.filter(|&q| usize::from(q) != 2 * pairs) {
        return Err(bad(format!(
            "num_queues {q} needs {} tap descriptors (one per queue pair) but {pairs} came",
            (q / 2).max(1)
        )));
    }
    let queues = u16::try_from(pairs).map_err(|_| bad(format!("{pairs} tap descriptors")))?;
    let fds = TapFds::Passed(n.tap_fds.clone());
    let mac = n.mac.clone();
    let offload = offload(n);
    Ok(NetSpec { tap, vhost_user: None, mac, queues, irq: Default::default(), poll_us: 0, offload, fds })
}

/// The name of the one tap `fds` are queues of, each checked as kumo can drive it
/// (`Tap::inspect`); a descriptor that is not a tap's is refused.
pub fn tap_of_fds(fds: &kumo_api::Fds) -> Result<String, String> {
    use kumo_devices::virtio::net::tap::Tap;
    Tap::inspect_all(fds.iter()).map(|info| info.name).map_err(|e| e.to_string())
}

/// CH's view of a VM kumo built from its own config (`kumo run`, a restore, a migration).
pub fn to_ch(v: &VmConfig) -> ChVmConfig {
    let payload = match &v.payload {
        Payload::Kernel { path, initrd, cmdline } => Some(ChPayload {
            kernel: Some(path.display().to_string()),
            cmdline: cmdline.clone(),
            initramfs: initrd.as_ref().map(|p| p.display().to_string()),
            ..Default::default()
        }),
        // A kumo guest program has no file CH could name.
        Payload::Guest { .. } => None,
    };
    ChVmConfig {
        cpus: Some(ChCpus { boot_vcpus: v.cpus, max_vcpus: Some(v.cpus), ..Default::default() }),
        memory: Some(ChMemory { size: v.memory, shared: !v.private_memory(), ..Default::default() }),
        payload,
        disks: Some(
            v.disks
                .iter()
                .enumerate()
                .map(|(i, d)| ChDisk {
                    path: Some(d.path.display().to_string()),
                    readonly: d.readonly,
                    direct: d.direct,
                    num_queues: Some(d.queues_for(v.cpus)),
                    queue_size: Some(d.queue_size),
                    id: Some(d.id_at(i)),
                    serial: (!d.serial.is_empty()).then(|| d.serial.clone()),
                    ..Default::default()
                })
                .collect(),
        ),
        net: Some(
            v.net
                .iter()
                .map(|n| ChNet {
                    tap: (!n.tap.is_empty()).then(|| n.tap.clone()),
                    mac: n.mac().ok().map(|m| m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")),
                    num_queues: Some(n.queues * 2),
                    vhost_user: n.vhost_user.is_some(),
                    vhost_socket: n.vhost_user.as_ref().map(|p| p.display().to_string()),
                    fds: match &n.fds {
                        TapFds::Passed(f) => Some(f.raw()),
                        _ => None,
                    },
                    tap_fds: match &n.fds {
                        TapFds::Passed(f) => f.clone(),
                        _ => Default::default(),
                    },
                    offload_tso: n.vhost_user.is_none().then_some(n.offload),
                    offload_csum: n.vhost_user.is_none().then_some(n.offload),
                    ..Default::default()
                })
                .collect(),
        ),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(j: &str) -> ChVmConfig {
        let c: ChVmConfig = serde_json::from_str(j).unwrap();
        c.check().unwrap();
        c
    }

    #[test]
    fn both_forms_become_the_same_kumo_config() {
        let new = ch(r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":268435456},
            "payload":{"kernel":"/k","cmdline":"console=ttyS0","initramfs":"/i"},
            "disks":[{"path":"/d.img","readonly":true,"num_queues":2}],
            "net":[{"tap":"tap0","mac":"52:54:00:00:00:01","num_queues":4}]}"#);
        let old = ch(r#"{"cpus":{"boot_vcpus":2,"max_vcpus":2},"memory":{"size":268435456},
            "kernel":{"path":"/k"},"cmdline":{"args":"console=ttyS0"},"initramfs":{"path":"/i"},
            "disks":[{"path":"/d.img","readonly":true,"num_queues":2}],
            "net":[{"tap":"tap0","mac":"52:54:00:00:00:01","num_queues":4,"ip":"10.0.0.1"}]}"#);
        let (a, b) = (from_ch(&new).unwrap(), from_ch(&old).unwrap());
        assert_eq!(a, b);
        assert_eq!((a.cpus, a.memory, a.debug_exit), (2, 256 << 20, false));
        let Payload::Kernel { path, initrd, cmdline } = &a.payload else { panic!("not a kernel") };
        assert_eq!(
            (path.to_str(), initrd.as_deref().and_then(|p| p.to_str()), cmdline.as_deref()),
            (Some("/k"), Some("/i"), Some("console=ttyS0"))
        );
        assert_eq!((a.disks[0].readonly, a.disks[0].queues), (true, Some(2)));
        assert_eq!((a.net[0].tap.as_str(), a.net[0].queues), ("tap0", 2));
        // And back: what vm.info shows of a VM kumo built itself.
        let back = to_ch(&a);
        assert_eq!(from_ch(&back).unwrap().net[0].mac.as_deref(), Some("52:54:00:00:00:01"));
        assert_eq!(back.payload.unwrap().kernel.as_deref(), Some("/k"));
    }

    #[test]
    fn offloads_follow_chs_flags() {
        let nic = |extra: &str| {
            let j = format!(r#"{{"payload":{{"kernel":"/k"}},"net":[{{"tap":"t0"{extra}}}]}}"#);
            from_ch(&ch(&j)).unwrap().net[0].offload
        };
        assert!(nic(""));
        assert!(nic(r#","offload_tso":true,"offload_csum":true,"offload_ufo":false"#));
        assert!(!nic(r#","offload_tso":false"#));
        assert!(!nic(r#","offload_csum":false"#));
        // And back: vm.info shows them as kumo set them.
        let mut v = from_ch(&ch(r#"{"payload":{"kernel":"/k"},"net":[{"tap":"t0","offload_csum":false}]}"#)).unwrap();
        let back = to_ch(&v);
        let n = &back.net.as_ref().unwrap()[0];
        assert_eq!((n.offload_tso, n.offload_csum), (Some(false), Some(false)));
        v.net[0].offload = true;
        assert_eq!(to_ch(&v).net.unwrap()[0].offload_tso, Some(true));
    }

    #[test]
    fn vhost_user_nics_and_refusals() {
        let v = from_ch(&ch(r#"{"payload":{"kernel":"/k"},"net":[{"vhost_user":true,"vhost_socket":"/s"}]}"#)).unwrap();
        assert_eq!((v.net[0].vhost_user.as_deref(), v.memory), (Some(std::path::Path::new("/s")), 512 << 20));
        let e = from_ch(&ch(r#"{"payload":{"kernel":"/k"},"cpus":{"boot_vcpus":1,"max_vcpus":4}}"#)).unwrap_err();
        assert!(e.contains("`cpus.max_vcpus`"), "{e}");
        let e = from_ch(&ch(r#"{"payload":{"kernel":"/k"},"net":[{"mac":"52:54:00:00:00:01"}]}"#)).unwrap_err();
        assert!(e.contains("`net[0].tap`"), "{e}");
    }

    /// A tap queue opened as libvirt opens one; None (skipping) without tun or the right.
    fn client_tap(name: &str, multi: bool) -> Option<std::os::fd::OwnedFd> {
        use std::os::fd::AsRawFd;
        #[repr(C)]
        struct IfReq {
            name: [u8; 16],
            flags: libc::c_short,
            _pad: [u8; 22],
        }
        let f = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun").ok()?;
        let flags = 0x0002 | 0x1000 | 0x4000 | if multi { 0x0100 } else { 0 };
        let mut req = IfReq { name: [0; 16], flags, _pad: [0; 22] };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF on a tun fd this test owns, with one `struct ifreq`.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), 0x4004_54ca as _, &mut req as *mut IfReq) };
        (r == 0).then(|| f.into())
    }

    #[test]
    fn a_nic_on_passed_descriptors_is_their_taps() {
        let with = |fds: Vec<std::os::fd::OwnedFd>, j: &str| {
            let mut n: ChNet = serde_json::from_str(j).unwrap();
            n.tap_fds = kumo_api::Fds::new(fds);
            n
        };
        let null = || std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let e = nic(0, &with(vec![null()], "{}")).unwrap_err();
        assert!(e.starts_with("net[0]: file descriptor") && e.contains("is not a tap's"), "{e}");
        let e = nic(1, &with(vec![null()], r#"{"vhost_user": true, "vhost_socket": "/s"}"#)).unwrap_err();
        assert!(e.contains("vhost-user NIC takes no tap descriptors"), "{e}");
        let name = format!("kc{}", std::process::id());
        let Some(a) = client_tap(&name, true) else {
            eprintln!("skipping the rest: cannot open a tap");
            return;
        };
        let b = client_tap(&name, true).unwrap();
        let n = with(vec![a, b], r#"{"mac": "52:54:00:00:00:09", "num_queues": 4}"#);
        let spec = nic(0, &n).unwrap();
        assert_eq!((spec.tap.as_str(), spec.queues, &spec.fds), (name.as_str(), 2, &TapFds::Passed(n.tap_fds.clone())));
        let shown = to_ch(&VmConfig { net: vec![spec], ..VmConfig::new(Payload::guest("hello", &[])) });
        assert_eq!(shown.net.unwrap()[0].fds, Some(n.tap_fds.raw()), "vm.info shows the numbers");
        // Queues that are not one pair per descriptor, a name that is not theirs.
        let mut wrong = n.clone();
        wrong.num_queues = Some(2);
        assert!(nic(0, &wrong).unwrap_err().contains("num_queues 2 needs 1 tap descriptors"));
        wrong.num_queues = None;
        wrong.tap = Some("other".into());
        assert!(nic(0, &wrong).unwrap_err().contains("`tap` other is not the tap its descriptors are of"));
    }
}
