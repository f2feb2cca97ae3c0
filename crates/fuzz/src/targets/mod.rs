//! The targets, one module per surface; [`ALL`] lists them.

pub mod apic;
pub mod mailbox;
pub mod nic;
pub mod restore;
pub mod serial;
pub mod vhost_user;
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
        test_cases: 3_000,
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
];
