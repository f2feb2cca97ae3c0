//! Elastic, exclusive sharing of host CPUs and memory between running VMs (seed 002, part 2).
//!
//! Every VM is built at full size on paper, but VMs agree which host CPUs and which memory
//! each really uses, never overlapping, and move them in milliseconds with the guest's
//! cooperation:
//! - [`mailbox`]: the guest channel, one page of guest memory plus an interrupt and a doorbell
//!   port (guests/include/elastic.h is its C side);
//! - [`lend`]: `kumo lend` / `kumo return`, one step over two VMs that completes on both or
//!   changes nothing;
//! - [`record`]: the check that no host CPU and no memory was ever held by two VMs at once,
//!   from the VMs' own records of their changes.
//!
//! The VM side (parking vCPUs, re-pinning, discarding pages) is `kumo_vmm::elastic`.

pub mod lend;
pub mod mailbox;
pub mod record;
