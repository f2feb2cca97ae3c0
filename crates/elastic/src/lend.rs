//! `kumo lend` and `kumo return`: one step over two running VMs that either completes on both
//! or changes nothing. The lender releases first (its guest confirms, kumo parks its vCPUs and
//! discards its pages), then the borrower acquires (its guest confirms its new vCPUs work and
//! its new memory is in use). If the borrower fails (its guest does not confirm in time, it
//! died), the lender takes everything back; if the lender fails, it has changed nothing.

use std::time::Instant;

use kumo_api::{AcquireRequest, Acquired, ApiClient, MemoryGrant, ReleaseRequest, Released};

/// One side of a lend: a VM's elastic API.
pub trait Peer {
    /// How the VM is named in the other VM's record (its API socket).
    fn name(&self) -> String;
    fn release(&self, req: &ReleaseRequest) -> Result<Released, String>;
    fn acquire(&self, req: &AcquireRequest) -> Result<Acquired, String>;
}

impl Peer for ApiClient {
    fn name(&self) -> String {
        let p = self.path();
        std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string()
    }
    fn release(&self, req: &ReleaseRequest) -> Result<Released, String> {
        ApiClient::release(self, req).map_err(|e| e.to_string())
    }
    fn acquire(&self, req: &AcquireRequest) -> Result<Acquired, String> {
        ApiClient::acquire(self, req).map_err(|e| e.to_string())
    }
}

/// How long a client waits for one side of a lend: each side may wait `timeout_ms` for its
/// guest more than once (a step, then its rollback), plus slack for the VMM.
pub fn client_timeout(timeout_ms: u64) -> std::time::Duration {
    std::time::Duration::from_millis(timeout_ms.saturating_mul(3)) + std::time::Duration::from_secs(10)
}

/// What to move.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LendRequest {
    pub cpus: u32,
    pub memory_bytes: u64,
    /// The lender's guest node to take memory from (default: the one holding the most).
    pub node: Option<u32>,
    /// How long each guest has to confirm.
    pub timeout_ms: u64,
    /// A return: the lender gives back only what it borrowed from the borrower, and the
    /// borrower holds it as its own again.
    pub returning: bool,
}

/// A completed lend: `vm.lend`'s answer, a kumo-api type.
pub use kumo_api::LendReport;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LendError {
    #[error("nothing to lend: give --cpus and/or --memory")]
    Empty,
    #[error("{from} gave nothing up ({why}); nothing changed")]
    Release { from: String, why: String },
    #[error("{to} could not take it ({why}); {from} has it back, nothing changed")]
    RolledBack { from: String, to: String, why: String },
    #[error("{to} could not take it and {from} could not take it back ({why}): host CPUs {cpus:?} and {bytes} bytes of memory are held by neither VM")]
    Lost { from: String, to: String, why: String, cpus: Vec<u32>, bytes: u64 },
}

/// Moves `req` from `from` to `to`, or rolls back.
pub fn lend(from: &dyn Peer, to: &dyn Peer, req: &LendRequest) -> Result<LendReport, LendError> {
    if req.cpus == 0 && req.memory_bytes == 0 {
        return Err(LendError::Empty);
    }
    let t0 = Instant::now();
    let released = from
        .release(&ReleaseRequest {
            cpus: req.cpus,
            host_cpus: Vec::new(),
            memory_bytes: req.memory_bytes,
            node: req.node,
            to: req.returning.then(|| to.name()),
            timeout_ms: req.timeout_ms,
        })
        .map_err(|why| LendError::Release { from: from.name(), why })?;
    let take = AcquireRequest {
        host_cpus: released.host_cpus.clone(),
        memory: released.memory,
        from: (!req.returning).then(|| from.name()),
        timeout_ms: req.timeout_ms,
    };
    match to.acquire(&take) {
        Ok(acquired) => Ok(LendReport { released, acquired, total_ms: t0.elapsed().as_secs_f64() * 1e3 }),
        Err(why) => {
            // The lender holds it again as it did before: its own, or still borrowed.
            let back = AcquireRequest {
                host_cpus: released.host_cpus.clone(),
                memory: released.memory,
                from: released.lender.clone(),
                timeout_ms: req.timeout_ms,
            };
            match from.acquire(&back) {
                Ok(_) => Err(LendError::RolledBack { from: from.name(), to: to.name(), why }),
                Err(back) => Err(LendError::Lost {
                    from: from.name(),
                    to: to.name(),
                    why: format!("{why}; {back}"),
                    cpus: released.host_cpus,
                    bytes: released.memory.map_or(0, |m: MemoryGrant| m.bytes),
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A VM holding host CPUs and bytes, whose guest may refuse.
    struct Fake {
        name: &'static str,
        cpus: RefCell<Vec<(u32, Option<String>)>>,
        bytes: RefCell<u64>,
        refuse_acquire: bool,
        dead: bool,
        log: RefCell<Vec<String>>,
    }

    fn fake(name: &'static str, cpus: &[u32], bytes: u64) -> Fake {
        Fake {
            name,
            cpus: RefCell::new(cpus.iter().map(|&c| (c, None)).collect()),
            bytes: RefCell::new(bytes),
            refuse_acquire: false,
            dead: false,
            log: RefCell::new(Vec::new()),
        }
    }

    impl Peer for Fake {
        fn name(&self) -> String {
            self.name.into()
        }
        fn release(&self, r: &ReleaseRequest) -> Result<Released, String> {
            if self.dead {
                return Err("connection refused".into());
            }
            let mut cpus = self.cpus.borrow_mut();
            let mine: Vec<usize> = (0..cpus.len()).filter(|&i| cpus[i].1 == r.to).collect();
            if mine.len() < r.cpus as usize || *self.bytes.borrow() < r.memory_bytes {
                return Err("not enough".into());
            }
            let lender = r.to.clone();
            let host_cpus: Vec<u32> = mine[..r.cpus as usize].iter().rev().map(|&i| cpus.remove(i).0).collect();
            *self.bytes.borrow_mut() -= r.memory_bytes;
            self.log.borrow_mut().push(format!("release {host_cpus:?} {}", r.memory_bytes));
            let memory =
                (r.memory_bytes > 0).then_some(MemoryGrant { bytes: r.memory_bytes, node: 0, host_node: None });
            Ok(Released { host_cpus, memory, lender, guest_ms: 0.0, total_ms: 0.0 })
        }
        fn acquire(&self, r: &AcquireRequest) -> Result<Acquired, String> {
            if self.dead || self.refuse_acquire {
                return Err("guest did not confirm".into());
            }
            self.cpus.borrow_mut().extend(r.host_cpus.iter().map(|&c| (c, r.from.clone())));
            *self.bytes.borrow_mut() += r.memory.map_or(0, |m| m.bytes);
            self.log.borrow_mut().push(format!("acquire {:?} from {:?}", r.host_cpus, r.from));
            Ok(Acquired { vcpus: vec![2; r.host_cpus.len()], node: Some(0), guest_ms: 0.0, total_ms: 0.0 })
        }
    }

    fn req(cpus: u32, bytes: u64, returning: bool) -> LendRequest {
        LendRequest { cpus, memory_bytes: bytes, node: None, timeout_ms: 100, returning }
    }

    #[test]
    fn lend_then_return_moves_both_ways() {
        let (a, b) = (fake("a", &[1], 256), fake("b", &[0], 0));
        let r = lend(&a, &b, &req(1, 128, false)).unwrap();
        assert_eq!(r.released.host_cpus, [1]);
        assert_eq!(*b.cpus.borrow(), [(0, None), (1, Some("a".into()))]);
        assert_eq!((*a.bytes.borrow(), *b.bytes.borrow()), (128, 128));
        // B returns only what it borrowed from A, and A holds it as its own again.
        lend(&b, &a, &req(1, 128, true)).unwrap();
        assert_eq!(*b.cpus.borrow(), [(0, None)]);
        assert_eq!(*a.cpus.borrow(), [(1, None)]);
        assert_eq!((*a.bytes.borrow(), *b.bytes.borrow()), (256, 0));
        // Nothing more was borrowed: a second return changes nothing.
        assert!(matches!(lend(&b, &a, &req(1, 0, true)), Err(LendError::Release { .. })));
        assert_eq!(*b.cpus.borrow(), [(0, None)]);
    }

    #[test]
    fn a_borrower_that_fails_rolls_the_lend_back() {
        let a = fake("a", &[1], 256);
        let b = Fake { refuse_acquire: true, ..fake("b", &[0], 0) };
        let e = lend(&a, &b, &req(1, 128, false)).unwrap_err();
        assert!(matches!(e, LendError::RolledBack { .. }), "{e}");
        assert!(e.to_string().contains("nothing changed"));
        assert_eq!(*a.cpus.borrow(), [(1, None)]);
        assert_eq!(*a.bytes.borrow(), 256);
        let dead = Fake { dead: true, ..fake("c", &[], 0) };
        assert!(matches!(lend(&a, &dead, &req(1, 0, false)), Err(LendError::RolledBack { .. })));
        assert_eq!(*a.cpus.borrow(), [(1, None)]);
    }

    #[test]
    fn a_lender_that_fails_changes_nothing_and_empty_requests_are_refused() {
        let a = Fake { dead: true, ..fake("a", &[1], 0) };
        let b = fake("b", &[0], 0);
        assert!(matches!(lend(&a, &b, &req(1, 0, false)), Err(LendError::Release { .. })));
        assert!(b.log.borrow().is_empty());
        assert_eq!(lend(&b, &b, &req(0, 0, false)), Err(LendError::Empty));
    }
}
