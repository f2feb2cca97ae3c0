//! kumo's fuzz targets: every parser and device model a guest or a peer reaches, driven by
//! `arbitrary` (structure-aware inputs) from a seeded PRNG, on the stable toolchain. Each
//! target runs a bounded number of cases in `cargo test -p kumo-fuzz` and as many as asked in
//! `kumo-fuzz TARGET --cases N`; a failure names the seed and the case index that replay it
//! (`kumo-fuzz TARGET --seed S --case I`). docs/fuzzing.md lists the targets and what each
//! asserts.

pub mod json;
pub mod targets;

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use arbitrary::Unstructured;

/// One case's input; `Err` from `arbitrary` means the input ran out (the case just ends).
pub type Input<'a> = Unstructured<'a>;
pub type CaseResult = arbitrary::Result<()>;

/// A fuzz target: a name, what it covers, how many cases `cargo test` runs, the largest input
/// a case is given, and the case itself (which panics when an invariant breaks).
pub struct Target {
    pub name: &'static str,
    pub about: &'static str,
    pub test_cases: u64,
    pub max_input: usize,
    pub run: fn(&mut Input<'_>) -> CaseResult,
}

/// Every target, in one place.
pub fn targets() -> &'static [Target] {
    targets::ALL
}

pub fn target(name: &str) -> Option<&'static Target> {
    targets().iter().find(|t| t.name == name)
}

/// splitmix64: a case's bytes depend only on (seed, case index), so any case replays alone.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// The bytes of case `index` under `seed`: a length skewed towards short inputs (most bugs
/// need few operations; long ones still come up), then random bytes.
pub fn case_bytes(seed: u64, index: u64, max_input: usize) -> Vec<u8> {
    let mut rng = Rng(seed ^ index.wrapping_mul(0xd134_2543_de82_ef95));
    let r = rng.next_u64();
    let cap = match r % 4 {
        0 => 64,
        1 => 512,
        _ => max_input,
    }
    .min(max_input)
    .max(1);
    let len = (rng.next_u64() % cap as u64) as usize + 1;
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Panics seen in any thread since the hook was installed (a target's device may run threads).
static PANICS: AtomicU64 = AtomicU64::new(0);
static HOOK: Once = Once::new();

fn count_panics() {
    HOOK.call_once(|| {
        let prev = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            prev(info);
        }));
    });
}

/// What a run found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub target: &'static str,
    pub seed: u64,
    pub case: u64,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: case {} of seed {:#x} failed: {}\n  replay: kumo-fuzz {} --seed {:#x} --case {}",
            self.target, self.case, self.seed, self.message, self.target, self.seed, self.case
        )
    }
}

/// Runs case `index` of `t` under `seed`; a panic (in this thread or one the case started) is
/// a failure.
pub fn run_case(t: &Target, seed: u64, index: u64) -> Result<(), Failure> {
    count_panics();
    let bytes = case_bytes(seed, index, t.max_input);
    let before = PANICS.load(Ordering::SeqCst);
    let r = panic::catch_unwind(AssertUnwindSafe(|| {
        let mut u = Unstructured::new(&bytes);
        let _ = (t.run)(&mut u);
    }));
    let fail = |message: String| Failure { target: t.name, seed, case: index, message };
    match r {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(fail(msg))
        }
        Ok(()) if PANICS.load(Ordering::SeqCst) != before => Err(fail("a thread the case started panicked".into())),
        Ok(()) => Ok(()),
    }
}

/// Runs `cases` cases of `t` from `seed`; stops at the first failure.
pub fn run(t: &Target, seed: u64, cases: u64) -> Result<u64, Failure> {
    for i in 0..cases {
        run_case(t, seed, i)?;
    }
    Ok(cases)
}

/// The seed `cargo test` uses (fixed, so the suite is reproducible).
pub const TEST_SEED: u64 = 0x6b75_6d6f_667a_7a31;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// One at a time: a panic anywhere in the process counts against the case running (a
    /// target's device threads are watched that way).
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs a target's bounded number of cases from the fixed test seed.
    fn fuzz(name: &str) {
        let _g = serial();
        let t = target(name).expect("a target of that name");
        if let Err(f) = run(t, TEST_SEED, t.test_cases) {
            panic!("{f}");
        }
    }

    macro_rules! targets {
        ($($test:ident => $name:literal),* $(,)?) => {
            $(#[test]
            fn $test() {
                fuzz($name);
            })*

            #[test]
            fn every_target_has_a_test() {
                let mut tested = vec![$($name),*];
                let mut all: Vec<_> = targets().iter().map(|t| t.name).collect();
                tested.sort();
                all.sort();
                assert_eq!(tested, all);
            }
        };
    }

    targets! {
        x86_decode => "x86-decode",
        apic => "apic",
        serial_port => "serial",
        restore => "restore",
        mailbox => "mailbox",
        vhost_user => "vhost-user",
        http => "http",
        migration_stream => "migration-stream",
        virtio_net => "virtio-net",
        virtio_blk => "virtio-blk",
        pci => "pci",
        vcpu_restore => "vcpu-restore",
    }

    #[test]
    fn cases_replay_from_seed_and_index() {
        assert_eq!(case_bytes(1, 7, 100), case_bytes(1, 7, 100));
        assert_ne!(case_bytes(1, 7, 100), case_bytes(1, 8, 100));
        assert!(case_bytes(2, 3, 10).len() <= 10);
    }

    #[test]
    fn a_panicking_case_names_its_seed_and_index() {
        let _g = serial();
        let t = Target {
            name: "boom",
            about: "",
            test_cases: 1,
            max_input: 16,
            run: |u| {
                if u.arbitrary::<u8>()? == 0 {
                    panic!("zero");
                }
                Ok(())
            },
        };
        let f = (0..).find_map(|i| run_case(&t, 5, i).err()).unwrap();
        assert_eq!(f.message, "zero");
        assert!(f.to_string().contains(&format!("--seed 0x5 --case {}", f.case)), "{f}");
        assert_eq!(run_case(&t, 5, f.case).unwrap_err(), f);
    }

    #[test]
    fn target_names_are_unique() {
        let mut names: Vec<_> = targets().iter().map(|t| t.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), targets().len());
    }
}
