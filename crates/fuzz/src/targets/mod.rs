//! The targets, one module per surface; [`ALL`] lists them.

pub mod apic;
pub mod http;
pub mod mailbox;
pub mod migration;
pub mod nic;
pub mod pci;
pub mod restore;
pub mod serial;
pub mod vcpu;
pub mod vhost_user;
pub mod virtio_blk;
pub mod virtio_net;
pub mod x86;

use crate::Target;

pub static ALL: &[Target] = &[
    Target {
        name: "x86-decode",
        about: "x86 decoder and emulation assists (guest instruction bytes, registers, page tables)",
        test_cases: 20_000,
        max_input: 256,
        run: x86::run,
    },
    Target {
        name: "apic",
        about: "userspace LAPIC (MMIO, MSRs, timer, IPIs), IOAPIC and 8259 PIC registers",
        test_cases: 1_500,
        max_input: 2048,
        run: apic::run,
    },
    Target {
        name: "serial",
        about: "COM1 16550A: port accesses, console input, restore of saved and mutated states",
        test_cases: 3_000,
        max_input: 1024,
        run: serial::run,
    },
    Target {
        name: "restore",
        about:
            "state restore of LAPIC, IOAPIC, PIC, the virtio-net PCI function; Snapshot JSON; config_from_description",
        test_cases: 3_000,
        max_input: 1024,
        run: restore::run,
    },
    Target {
        name: "mailbox",
        about: "elastic mailbox as the VMM reads it: guest-written answer fields, the release-answer check, layouts",
        test_cases: 5_000,
        max_input: 1024,
        run: mailbox::run,
    },
    Target {
        name: "vhost-user",
        about: "net-backend's vhost-user requests (relay and daemon) over a socketpair, with fds",
        test_cases: 300,
        max_input: 1024,
        run: vhost_user::run,
    },
    Target {
        name: "http",
        about: "the control API's HTTP server: route-table requests with arbitrary changes, to a live server",
        test_cases: 1_000,
        max_input: 512,
        run: http::run,
    },
    Target {
        name: "migration-stream",
        about: "migration stream and header as a destination reads them, and a source's reply reader",
        test_cases: 5_000,
        max_input: 1024,
        run: migration::run,
    },
    Target {
        name: "virtio-net",
        about: "virtio-net rings behind its PCI function: arbitrary descriptors, avail entries, control commands",
        test_cases: 1_000,
        max_input: 1024,
        run: virtio_net::run,
    },
    Target {
        name: "virtio-blk",
        about: "virtio-blk request chains on a raw image (both I/O backends): types, sectors, segments, status buffers",
        test_cases: 1_000,
        max_input: 1024,
        run: virtio_blk::run,
    },
    Target {
        name: "pci",
        about: "PCI config mechanism #1, ECAM, the NIC's BAR and MSI-X table, vectors firing",
        test_cases: 2_000,
        max_input: 1024,
        run: pci::run,
    },
    Target {
        name: "vcpu-restore",
        about: "KVM vCPU and VM-wide state restore from mutated saved states (skipped without /dev/kvm)",
        test_cases: 300,
        max_input: 512,
        run: vcpu::run,
    },
];
