//! The VM config and the migration stream's typed VM description (`kumo_migration::format::
//! VmDescription`), both ways: [`describe`] on the source (and for a snapshot file), and
//! [`config_from_description`] on a destination (and for a restore). What is this host's own
//! (pins, host nodes, halt polling) is not described; what the guest sees is, field by field.

use kumo_migration::format::{self as wire, VmDescription};
use kumo_vm::interrupt_paths::IrqPath;
use kumo_vm::layout::ram_regions;
use kumo_vm::pv::PvRequest;
use kumo_vm::IrqchipMode;

use crate::config::{DiskSpec, NetSpec, NumaConfig, NumaDistance, NumaNodeSpec, Payload, TapFds};
use crate::host_resources::HostResources;
use crate::VmConfig;

/// The description of VM `c` whose RAM is `regions`. An elastic VM is never described: it
/// does not migrate (refused before a migration or snapshot starts).
pub fn describe(c: &VmConfig, regions: Vec<(u64, u64)>) -> VmDescription {
    let irqchip = match c.irqchip {
        IrqchipMode::Kernel => wire::Irqchip::Kernel,
        IrqchipMode::Split => wire::Irqchip::Split,
        IrqchipMode::User => wire::Irqchip::User,
    };
    let payload = match &c.payload {
        Payload::Guest { name, args, .. } => wire::PayloadDescription::Guest { name: name.clone(), args: args.clone() },
        Payload::Kernel { path, initrd, cmdline } => {
            wire::PayloadDescription::Kernel { path: path.clone(), initrd: initrd.clone(), cmdline: cmdline.clone() }
        }
    };
    let mut d = VmDescription::new(c.cpus, irqchip, payload, regions);
    d.memory_bytes = c.memory;
    d.debug_exit = c.debug_exit;
    d.private_memory = c.private_memory();
    d.nets = c.net.iter().map(describe_nic).collect();
    // Sizes are the open images' (the source fills them in, `SourceVm::description`).
    d.disks = c
        .disks
        .iter()
        .enumerate()
        .map(|(i, k)| wire::DiskDescription {
            id: k.id_at(i),
            size: 0,
            readonly: k.readonly,
            serial: k.serial.clone(),
            queues: k.queues_for(c.cpus),
            queue_size: k.queue_size,
            direct: k.direct,
            source_path: k.path.clone(),
        })
        .collect();
    d.numa = c.numa.as_ref().map(|n| wire::NumaDescription {
        nodes: n
            .nodes
            .iter()
            .map(|n| wire::NumaNodeDescription { id: n.id, cpus: n.cpus.clone(), memory: n.memory })
            .collect(),
        distances: n
            .distances
            .iter()
            .map(|x| wire::NumaDistanceDescription { src: x.src, dst: x.dst, value: x.value })
            .collect(),
    });
    let p = c.pv;
    d.pv = wire::PvDescription {
        steal_time: p.steal_time,
        pv_unhalt: p.pv_unhalt,
        tlb_flush: p.tlb_flush,
        poll_control: p.poll_control,
        pv_ipi: p.pv_ipi,
        realtime: p.realtime,
    };
    d
}

/// A NIC as the guest sees it; its MAC written out (a default one derives from the source's
/// tap name, which the destination does not have).
fn describe_nic(n: &NetSpec) -> wire::NicDescription {
    let mac = match n.mac() {
        Ok(m) => m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
        // A running VM's MACs were checked when it booted; the destination refuses this one.
        Err(_) => n.mac.clone().unwrap_or_default(),
    };
    wire::NicDescription {
        mac,
        queues: n.queues,
        irq: match n.irq {
            IrqPath::Direct => wire::NicIrqPath::Direct,
            IrqPath::Dedicated { vcpu } => wire::NicIrqPath::Dedicated { vcpu },
            IrqPath::Shared => wire::NicIrqPath::Shared,
        },
        source_backend: match (&n.vhost_user, &n.fds) {
            (Some(p), _) => wire::SourceBackend::VhostUser(p.clone()),
            (None, TapFds::ByName) => wire::SourceBackend::Tap(n.tap.clone()),
            (None, TapFds::Passed(_) | TapFds::OnSource) => wire::SourceBackend::TapFds(n.tap.clone()),
        },
        offload: n.offload,
    }
}

/// The VM config `d` describes, still on the source's backends (see [`config_from_description`]).
fn config_of(d: &VmDescription) -> VmConfig {
    let irqchip = match d.irqchip {
        wire::Irqchip::Kernel => IrqchipMode::Kernel,
        wire::Irqchip::Split => IrqchipMode::Split,
        wire::Irqchip::User => IrqchipMode::User,
    };
    let payload = match &d.payload {
        // The program image is the embedding program's to find (`guest_program`): a migrated
        // or restored VM's memory already holds it.
        wire::PayloadDescription::Guest { name, args } => {
            Payload::Guest { name: name.clone(), args: args.clone(), program: None }
        }
        wire::PayloadDescription::Kernel { path, initrd, cmdline } => {
            Payload::Kernel { path: path.clone(), initrd: initrd.clone(), cmdline: cmdline.clone() }
        }
    };
    let net = d
        .nets
        .iter()
        .map(|n| {
            let (tap, vhost_user, fds) = match &n.source_backend {
                wire::SourceBackend::Tap(t) => (t.clone(), None, TapFds::ByName),
                wire::SourceBackend::TapFds(t) => (t.clone(), None, TapFds::OnSource),
                wire::SourceBackend::VhostUser(p) => (String::new(), Some(p.clone()), TapFds::ByName),
            };
            let irq = match n.irq {
                wire::NicIrqPath::Direct => IrqPath::Direct,
                wire::NicIrqPath::Dedicated { vcpu } => IrqPath::Dedicated { vcpu },
                wire::NicIrqPath::Shared => IrqPath::Shared,
            };
            let (mac, queues, offload) = (Some(n.mac.clone()), n.queues, n.offload);
            NetSpec { tap, vhost_user, mac, queues, irq, poll_us: 0, offload, fds }
        })
        .collect();
    let numa = d.numa.as_ref().map(|n| NumaConfig {
        nodes: n
            .nodes
            .iter()
            .map(|n| NumaNodeSpec { id: n.id, cpus: n.cpus.clone(), memory: n.memory, host_node: None, pin: None })
            .collect(),
        distances: n.distances.iter().map(|x| NumaDistance { src: x.src, dst: x.dst, value: x.value }).collect(),
    });
    let p = d.pv;
    VmConfig {
        cpus: d.cpus,
        memory: d.memory_bytes,
        irqchip,
        payload,
        net,
        // Still on the source's paths: `host_resources::resolve` gives each this host's.
        disks: d
            .disks
            .iter()
            .map(|k| DiskSpec {
                path: k.source_path.clone(),
                id: Some(k.id.clone()),
                readonly: k.readonly,
                serial: k.serial.clone(),
                queues: Some(k.queues),
                queue_size: k.queue_size,
                direct: k.direct,
            })
            .collect(),
        numa,
        pv: PvRequest {
            steal_time: p.steal_time,
            pv_unhalt: p.pv_unhalt,
            tlb_flush: p.tlb_flush,
            poll_control: p.poll_control,
            pv_ipi: p.pv_ipi,
            realtime: p.realtime,
        },
        host: Default::default(),
        elastic: None,
        debug_exit: d.debug_exit,
        // A VM with memory zones does not migrate.
        memory_zones: Vec::new(),
        shared_memory: Some(!d.private_memory),
    }
}

/// The VM an incoming stream (or a snapshot file) describes, on this host's resources: its
/// memory regions checked against kumo's layout for its size, its NICs and NUMA nodes given the
/// backends and host nodes this host's operator gave (`ours`, see [`crate::host_resources`]),
/// then validated as strictly as a `kumo run` config and its backends checked on this host.
/// Nothing is built or attached before it returns; its error is one line, sent back to the
/// source as the Failed reply.
pub fn config_from_description(d: &VmDescription, ours: &HostResources) -> Result<VmConfig, String> {
    if ram_regions(d.memory_bytes) != d.regions {
        return Err("the stream's memory regions contradict its memory size (kumo's layout)".into());
    }
    let c = crate::host_resources::resolve(config_of(d), ours).map_err(|e| e.to_string())?;
    c.validate_arriving().map_err(|e| e.to_string())?;
    crate::host_resources::check_on_host(&c).map_err(|e| e.to_string())?;
    let sizes: Vec<(String, u64)> = d.disks.iter().map(|k| (k.id.clone(), k.size)).collect();
    crate::host_resources::check_disks(&c, &sizes).map_err(|e| e.to_string())?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskSpec, NumaDistance, NumaNodeSpec};
    use kumo_vm::pv::{PvRequest, PvSet};

    fn vm(cpus: u32, memory: u64, guest: &str) -> VmConfig {
        // An arriving guest is checked by what the embedding program registered.
        crate::guest_program::tests::test_guests();
        VmConfig { cpus, memory, irqchip: IrqchipMode::Kernel, ..VmConfig::new(Payload::guest(guest, &[])) }
    }

    fn desc(c: &VmConfig) -> VmDescription {
        describe(c, ram_regions(c.memory))
    }

    fn ours(net: &[&str], numa: &[&str]) -> HostResources {
        let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        HostResources::parse(&s(net), &s(numa)).unwrap()
    }

    /// A NIC on passed descriptors travels as such: the other side gets no name to reopen.
    #[test]
    fn a_tap_passed_as_descriptors_is_described_as_such() {
        let null = std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let mut nic = NetSpec::parse("tap=vnet3").unwrap();
        nic.fds = TapFds::Passed(kumo_api::Fds::new(vec![null]));
        let c = VmConfig { net: vec![nic], ..vm(1, 64 << 20, "memtouch") };
        let d = desc(&c);
        assert_eq!(d.nets[0].source_backend, wire::SourceBackend::TapFds("vnet3".into()));
        let back = config_of(&d);
        assert_eq!((back.net[0].tap.as_str(), &back.net[0].fds), ("vnet3", &TapFds::OnSource));
        // Described again (a restored VM snapshotted before it got a tap): still no name to use.
        assert_eq!(describe_nic(&back.net[0]).source_backend, wire::SourceBackend::TapFds("vnet3".into()));
    }

    /// What the guest sees survives the trip; what the source's host gave it does not.
    #[test]
    fn a_config_travels_as_its_description() {
        let node = |id, cpus: Vec<u32>, host_node| NumaNodeSpec { id, cpus, memory: 32 << 20, host_node, pin: None };
        let c = VmConfig {
            irqchip: IrqchipMode::Split,
            payload: Payload::Kernel { path: "/k".into(), initrd: None, cmdline: Some("quiet".into()) },
            net: vec![NetSpec::parse("tap=victim,queues=2,irq=dedicated,vcpu=1").unwrap()],
            numa: Some(NumaConfig {
                nodes: vec![node(0, vec![0], Some(5)), node(1, vec![1], None)],
                distances: vec![NumaDistance { src: 0, dst: 1, value: 31 }],
            }),
            pv: PvRequest::from_set(PvSet::DEDICATED),
            host: crate::placement::HostPlacement { pins: vec![Some(3), Some(4)], halt_poll_ns: Some(0) },
            shared_memory: Some(true),
            ..vm(2, 64 << 20, "memtouch")
        };
        let d = desc(&c);
        d.validate().unwrap();
        assert_eq!(d.nets[0].source_backend, wire::SourceBackend::Tap("victim".into()));
        let mac = c.net[0].mac().unwrap();
        let back = config_of(&d);
        assert_eq!(back.net[0].mac().unwrap(), mac, "the default MAC derived from the source's tap stays");
        assert_eq!((back.net[0].queues, back.net[0].irq), (2, IrqPath::Dedicated { vcpu: 1 }));
        assert_eq!((back.cpus, back.memory, back.irqchip), (2, 64 << 20, IrqchipMode::Split));
        assert_eq!(back.payload, c.payload);
        assert_eq!(back.pv, c.pv);
        let numa = back.numa.as_ref().unwrap();
        assert_eq!(numa.nodes.iter().map(|n| n.host_node).collect::<Vec<_>>(), [None, None]);
        assert_eq!(numa.distances, c.numa.as_ref().unwrap().distances);
        assert!(back.host.pins.is_empty() && back.host.halt_poll_ns.is_none(), "host settings stay behind");
        let j = serde_json::to_value(&d).unwrap();
        assert!(!j.to_string().contains("host_node") && !j.to_string().contains("pins"), "{j}");
        assert!(
            !back.private_memory() && !j.to_string().contains("private_memory"),
            "a memfd VM's stream is as before"
        );
        let p = desc(&VmConfig { shared_memory: Some(false), ..c.clone() });
        assert!(p.private_memory && config_of(&p).private_memory(), "private memory is made private again");
    }

    /// A disk travels as what the guest sees; its image here is the operator's, by id, and
    /// must have the size the source's had.
    #[test]
    fn disks_travel_and_take_this_hosts_images() {
        let dir = std::env::temp_dir().join(format!("kumo-desc-disks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (img, small) = (dir.join("a.img"), dir.join("small.img"));
        std::fs::File::create(&img).unwrap().set_len(1 << 20).unwrap();
        std::fs::File::create(&small).unwrap().set_len(4096).unwrap();
        let c = VmConfig {
            disks: vec![DiskSpec::parse("path=/src/root.img,serial=abc,readonly=on").unwrap()],
            ..vm(2, 64 << 20, "memtouch")
        };
        let mut d = desc(&c);
        let k = &d.disks[0];
        assert_eq!((k.id.as_str(), k.readonly, k.serial.as_str(), k.queues), ("disk0", true, "abc", 2));
        assert_eq!(k.source_path, std::path::Path::new("/src/root.img"));
        d.disks[0].size = 1 << 20;
        let with = |s: &str| HostResources::default().with_disks(&[s.to_string()]).unwrap();
        let back = config_from_description(&d, &with(&format!("id=disk0,path={}", img.display()))).unwrap();
        assert_eq!(back.disks[0].path, img);
        assert_eq!(
            (back.disks[0].readonly, back.disks[0].queues, back.disks[0].serial.as_str()),
            (true, Some(2), "abc")
        );
        let e = config_from_description(&d, &HostResources::default()).unwrap_err();
        assert_eq!(
            e,
            "the VM's disk disk0 (image /src/root.img on its source) has no image here: give --disk id=disk0,path=FILE"
        );
        let e = config_from_description(&d, &with(&format!("path={}", small.display()))).unwrap_err();
        assert_eq!(
            e,
            format!("config: disk disk0: image {} is 4096 bytes; the VM's disk was 1048576 bytes", small.display())
        );
        let e = config_from_description(&d, &with("id=disk1,path=/x")).unwrap_err();
        assert_eq!(e, "--disk id=disk1: the VM has no disk disk1 (it has disk0)");
        let e = HostResources::default().with_disks(&["id=disk0,path=/x,readonly=on".into()]).unwrap_err().to_string();
        assert!(e.contains("readonly= comes from the arriving VM"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Stream headers go through the same shape check as a `kumo run` config, whose error the
    /// receiver sends back as a Failed reply.
    #[test]
    fn stream_descriptions_are_shape_checked() {
        let none = HostResources::default();
        let from = |c: &VmConfig| config_from_description(&desc(c), &none);
        assert_eq!(from(&vm(2, 64 << 20, "memtouch")).unwrap().cpus, 2);
        for (c, want) in [
            (vm(1, 1 << 50, "memtouch"), "memory 1 PiB is more than this host can back"),
            (vm(1, 1000 << 40, "memtouch"), "memory 1000 TiB is more than this host can back"),
            (vm(65, 64 << 20, "memtouch"), "runs on 1..=64 vCPUs, not 65"),
            (vm(200, 64 << 20, "memtouch"), "vCPUs"),
            (vm(241, 64 << 20, "memtouch"), "kumo's limit"),
            (vm(1, 64 << 20, "smp"), "runs on 2..=64 vCPUs, not 1"),
            (vm(1, 64 << 20, "nope"), "unknown guest"),
        ] {
            let e = from(&c).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "want `{want}` in `{e}`");
        }
        // Regions that are not kumo's layout for the memory size.
        let mut d = desc(&vm(2, 64 << 20, "memtouch"));
        d.regions = vec![(0, 32 << 20), (1 << 32, 32 << 20)];
        assert!(config_from_description(&d, &none).unwrap_err().contains("contradict"));
    }

    /// Everything in a stream's description is checked as a `kumo run` config is, after its
    /// host resources are resolved: NIC options, NUMA topology, guest arguments, backends.
    #[test]
    fn stream_configs_are_validated_like_cli_configs() {
        let base = vm(2, 64 << 20, "memtouch");
        let from = |c: &VmConfig, o: &HostResources| config_from_description(&desc(c), o);
        from(&base, &ours(&[], &[])).unwrap();
        let nic = |s: &str| NetSpec::parse(s).unwrap();
        let with_net = |specs: Vec<NetSpec>| VmConfig { net: specs, ..base.clone() };
        let node = |id, cpus: Vec<u32>| NumaNodeSpec { id, cpus, memory: 32 << 20, host_node: None, pin: None };
        let two = NumaConfig { nodes: vec![node(0, vec![0]), node(1, vec![1])], distances: vec![] };
        let bad_two = NumaConfig { nodes: vec![node(0, vec![0, 1]), node(1, vec![1])], distances: vec![] };
        let with_numa = |n: NumaConfig| VmConfig { numa: Some(n), ..base.clone() };
        let queues = |q| NetSpec { queues: q, ..nic("tap=t") };
        let cases = [
            (VmConfig { payload: Payload::guest("memtouch", &["pages=x"]), ..base.clone() }, ours(&[], &[]), "pages"),
            (with_net(vec![queues(17)]), ours(&["tap=mine"], &[]), "queues=17 is not 1..=16"),
            (with_net(vec![queues(0)]), ours(&["tap=mine"], &[]), "queues=0"),
            (
                with_net(vec![NetSpec { irq: IrqPath::Dedicated { vcpu: 9 }, ..nic("tap=t") }]),
                ours(&["tap=mine"], &[]),
                "irq=dedicated,vcpu=9: the VM has 2 vCPUs",
            ),
            (
                with_net(vec![NetSpec { mac: Some("01:00:5e:00:00:01".into()), ..nic("tap=t") }]),
                ours(&["tap=mine"], &[]),
                "multicast",
            ),
            (
                with_net(vec![nic("tap=t"), nic("tap=u")]),
                ours(&["tap=same", "tap=same"], &[]),
                "tap same is given to two NICs",
            ),
            (with_net(vec![nic("tap=t")]), ours(&[], &[]), "give --net id=net0,tap=NAME"),
            (with_numa(bad_two), ours(&[], &[]), "cpu 1 is in two NUMA nodes"),
            (with_numa(two.clone()), ours(&[], &["node=0,host-node=4095", "node=1"]), "host node 4095"),
            (with_numa(two), ours(&[], &["node=0"]), "the VM's NUMA node 1 has no --numa here"),
            (
                with_net(vec![nic("tap=t")]),
                ours(&["tap=kumo-h2-nosuch"], &[]),
                "net0: no network interface named kumo-h2-nosuch",
            ),
            (with_net(vec![nic("tap=t")]), ours(&["tap=lo"], &[]), "net0: lo is a network interface but not a tap"),
            (
                with_net(vec![nic("vhost-user=/theirs")]),
                ours(&["vhost-user=/nonexistent/h2.sock"], &[]),
                "net0: vhost-user /nonexistent/h2.sock",
            ),
        ];
        for (c, o, want) in cases {
            let e = from(&c, &o).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{c:?}: want `{want}` in `{e}`");
        }
    }
}
