//! Raw-code guests for this crate's KVM tests: a 1-vCPU VM running bytes placed at 1 MiB in
//! long mode, with the exit port on the bus.

use std::sync::{Arc, Mutex};

use kumo_devices::{Buses, DebugPort};
use vm_memory::{Bytes, GuestAddress};

use crate::boot::{write_gdt, write_page_tables, Entry};
use crate::vcpu::{Vcpu, VcpuRun};
use crate::vm::{kvm_available, IrqchipMode, Vm};
use crate::Result;

pub const CODE: u64 = 0x10_0000;
const MEM: u64 = 32 << 20;

pub struct RawGuest {
    pub vm: Vm,
    pub vcpu: Vcpu,
    pub buses: Buses,
}

impl RawGuest {
    /// `code` at 1 MiB, `data` at their addresses; `None` (with a message) without /dev/kvm.
    pub fn new(code: &[u8], data: &[(u64, &[u8])]) -> Option<RawGuest> {
        Self::with_irqchip(IrqchipMode::Kernel, code, data)
    }

    /// The same with the interrupt controllers of `mode`.
    pub fn with_irqchip(mode: IrqchipMode, code: &[u8], data: &[(u64, &[u8])]) -> Option<RawGuest> {
        if !kvm_available() {
            eprintln!("skipping: /dev/kvm not available");
            return None;
        }
        let vm = Vm::new(1, MEM, mode).unwrap();
        write_gdt(&vm.memory.guest, 1).unwrap();
        write_page_tables(&vm.memory.guest, MEM).unwrap();
        vm.memory.guest.write_slice(code, GuestAddress(CODE)).unwrap();
        for (addr, bytes) in data {
            vm.memory.guest.write_slice(bytes, GuestAddress(*addr)).unwrap();
        }
        let vcpu = vm.create_vcpu(0).unwrap();
        vcpu.configure(&vm.kvm, 1, Some(Entry::KumoGuest { rip: CODE }), &crate::pv::PvSet::SHARED).unwrap();
        let mut buses = Buses::default();
        buses.pio.insert(kumo_devices::EXIT_PORT.into(), 2, Arc::new(Mutex::new(DebugPort))).unwrap();
        Some(RawGuest { vm, vcpu, buses })
    }

    /// Runs until something other than a handled exit happens.
    pub fn run(&mut self) -> Result<VcpuRun> {
        for _ in 0..1000 {
            match self.vcpu.run(&self.buses) {
                Ok(VcpuRun::Continue) => continue,
                other => return other,
            }
        }
        panic!("guest code neither exited nor failed");
    }
}
