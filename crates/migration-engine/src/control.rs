//! How an operator steers a running migration: cancelling it, and capping its bandwidth.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RUNNING: u8 = 0;
const CANCELLED: u8 = 1;
const COMMITTED: u8 = 2;

/// Shared between a migration and whoever may cancel it (the API, Ctrl-C in `kumo migrate`).
/// The engine checks it between batches and in its waits. A cancel and the engine's commit
/// (the VM's final state going out) race through one atomic, so exactly one of them wins: once
/// the destination may run the VM, a cancel can no longer be honoured.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicU8>);

/// Why a cancel was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CancelError {
    #[error("too late to cancel: the VM's final state has gone to the destination, which may be running it")]
    Committed,
}

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the migration to stop. Ok also when a cancel was already asked for.
    pub fn cancel(&self) -> Result<(), CancelError> {
        match self.0.compare_exchange(RUNNING, CANCELLED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(CANCELLED) => Ok(()),
            Err(_) => Err(CancelError::Committed),
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire) == CANCELLED
    }

    /// Whether the engine has passed its point of no return (the VM's final state may be at
    /// the destination).
    pub fn is_committed(&self) -> bool {
        self.0.load(Ordering::Acquire) == COMMITTED
    }

    /// The engine's point of no return: false if a cancel came first (the engine then backs
    /// out), true if from now on every cancel is refused.
    pub fn commit(&self) -> bool {
        match self.0.compare_exchange(RUNNING, COMMITTED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(v) => v == COMMITTED,
        }
    }
}

// Options that carry a token compare equal whatever its state: it is a handle, not a setting.
impl PartialEq for CancelToken {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A monotonic clock, injectable so the bucket is tested without real time.
pub trait Clock {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
}

/// The real monotonic clock.
pub struct SystemClock(Instant);

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock(Instant::now())
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// A token bucket over bytes: `rate` bytes per second on average, at most `burst` at once.
/// Taking more than the bucket holds runs it into debt, and the taker waits the debt off
/// before sending, so the long-run rate never exceeds `rate` whatever the batch sizes.
pub struct TokenBucket<C: Clock> {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Duration,
    clock: C,
}

impl<C: Clock> TokenBucket<C> {
    /// A full bucket. `rate` must be positive.
    pub fn new(rate_bytes_per_s: u64, burst_bytes: u64, clock: C) -> Self {
        let last = clock.now();
        TokenBucket {
            rate: rate_bytes_per_s.max(1) as f64,
            burst: burst_bytes as f64,
            tokens: burst_bytes as f64,
            last,
            clock,
        }
    }

    fn refill(&mut self) {
        let now = self.clock.now();
        let dt = now.saturating_sub(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
    }

    /// Takes `bytes` and says how long to wait before sending them (zero: send now).
    pub fn take(&mut self, bytes: u64) -> Duration {
        self.refill();
        self.tokens -= bytes as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    #[derive(Clone, Default)]
    struct FakeClock(Rc<Cell<Duration>>);
    impl Clock for FakeClock {
        fn now(&self) -> Duration {
            self.0.get()
        }
    }
    impl FakeClock {
        fn advance(&self, d: Duration) {
            self.0.set(self.0.get() + d);
        }
    }

    const MB: u64 = 1_000_000;

    #[test]
    fn a_full_bucket_sends_its_burst_at_once_then_waits_at_the_rate() {
        let clock = FakeClock::default();
        let mut b = TokenBucket::new(10 * MB, 4 * MB, clock.clone());
        assert_eq!(b.take(4 * MB), Duration::ZERO);
        // Empty: 5 MB more at 10 MB/s is half a second of debt.
        assert_eq!(b.take(5 * MB), Duration::from_millis(500));
        // The taker waits it off; then the bucket is even and the next MB costs 100 ms.
        clock.advance(Duration::from_millis(500));
        assert_eq!(b.take(MB), Duration::from_millis(100));
    }

    #[test]
    fn idle_time_refills_up_to_the_burst_only() {
        let clock = FakeClock::default();
        let mut b = TokenBucket::new(10 * MB, 4 * MB, clock.clone());
        assert_eq!(b.take(4 * MB), Duration::ZERO);
        clock.advance(Duration::from_secs(60)); // a minute idle earns 4 MB, not 600 MB
        assert_eq!(b.take(4 * MB), Duration::ZERO);
        assert_eq!(b.take(MB), Duration::from_millis(100));
    }

    #[test]
    fn the_long_run_rate_is_the_cap() {
        // Send 100 batches of 4 MiB, waiting as told: the clock must show at least
        // (total - burst) / rate, and not more than one batch's worth above it.
        let clock = FakeClock::default();
        let (rate, burst, batch) = (25 * MB, 4 * MB, 4u64 << 20);
        let mut b = TokenBucket::new(rate, burst, clock.clone());
        for _ in 0..100 {
            let w = b.take(batch);
            clock.advance(w);
        }
        let total = 100 * batch;
        let floor = (total - burst) as f64 / rate as f64;
        let t = clock.now().as_secs_f64();
        assert!(t >= floor - 1e-6 && t <= floor + batch as f64 / rate as f64, "{t} vs {floor}");
    }

    #[test]
    fn cancel_and_commit_exclude_each_other() {
        let t = CancelToken::new();
        assert!(!t.is_cancelled());
        t.cancel().unwrap();
        t.cancel().unwrap(); // twice is fine
        assert!(t.is_cancelled());
        assert!(!t.commit(), "a cancelled migration must not commit");

        let t = CancelToken::new();
        assert!(t.commit());
        assert!(t.commit());
        assert_eq!(t.cancel(), Err(CancelError::Committed));
        assert!(!t.is_cancelled());
    }
}
