//! The LAPIC timer's counting, with time given by the caller (ns of the APIC's [`super::Clock`]).
//!
//! The timer counts at the APIC bus clock divided by the divide configuration register. Like
//! KVM, kumo's bus clock is 1 GHz: one tick is `divisor` ns. Periodic periods shorter than
//! [`MIN_PERIOD_NS`] are stretched to it (KVM does the same), so a guest cannot make kumo's
//! host timer fire at nanosecond intervals.

use serde::{Deserialize, Serialize};

/// One APIC bus cycle.
pub const BUS_CYCLE_NS: u64 = 1;
/// The shortest periodic period kumo arms (KVM's `min_timer_period_us` default, 200 µs).
pub const MIN_PERIOD_NS: u64 = 200_000;

/// LVT timer bits 17–18.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimerMode {
    OneShot,
    Periodic,
    TscDeadline,
}

/// The divisor a divide configuration register value selects (bits 0, 1 and 3):
/// 0b0000 → 2, 0b0001 → 4, …, 0b1010 → 128, 0b1011 → 1.
pub fn divisor(reg: u32) -> u64 {
    let v = (reg & 3) | ((reg >> 1) & 4);
    1 << ((v + 1) & 7)
}

#[derive(Debug, Clone, Default)]
pub(super) struct Timer {
    pub initial: u32,
    pub divide: u32,
    /// When the count was loaded (one-shot) or the current period began (periodic).
    pub start_ns: u64,
    /// Counting (one-shot, periodic) or a deadline set (TSC deadline).
    pub armed: bool,
    /// The guest TSC value written to IA32_TSC_DEADLINE; 0 = none.
    pub tsc_deadline: u64,
    /// That deadline on the clock.
    pub deadline_ns: u64,
}

impl Timer {
    fn tick_ns(&self) -> u64 {
        divisor(self.divide) * BUS_CYCLE_NS
    }

    fn period_ns(&self, mode: TimerMode) -> u64 {
        let ns = self.initial as u64 * self.tick_ns();
        if mode == TimerMode::Periodic {
            ns.max(MIN_PERIOD_NS)
        } else {
            ns
        }
    }

    pub fn stop(&mut self) {
        self.armed = false;
        self.initial = 0;
        self.tsc_deadline = 0;
    }

    pub fn next_deadline(&self, mode: TimerMode) -> Option<u64> {
        if !self.armed {
            return None;
        }
        Some(match mode {
            TimerMode::TscDeadline => self.deadline_ns,
            _ => self.start_ns.saturating_add(self.period_ns(mode)),
        })
    }

    pub fn current_count(&self, mode: TimerMode, now: u64) -> u32 {
        if !self.armed || mode == TimerMode::TscDeadline {
            return 0;
        }
        let mut elapsed = now.saturating_sub(self.start_ns);
        if mode == TimerMode::Periodic {
            elapsed %= self.period_ns(mode).max(1);
        }
        let ticks = elapsed / self.tick_ns();
        self.initial.saturating_sub(ticks.min(u32::MAX as u64) as u32)
    }

    /// Whether the timer reached its deadline at `now`; one-shot and TSC-deadline timers stop,
    /// a periodic timer starts the period `now` is in (periods the host missed are not
    /// raised one by one: they coalesce into this one interrupt).
    pub fn expire(&mut self, mode: TimerMode, now: u64) -> bool {
        match self.next_deadline(mode) {
            Some(d) if now >= d => {}
            _ => return false,
        }
        match mode {
            TimerMode::OneShot => self.armed = false,
            TimerMode::Periodic => {
                let p = self.period_ns(mode).max(1);
                self.start_ns += (now - self.start_ns) / p * p;
            }
            TimerMode::TscDeadline => {
                self.armed = false;
                self.tsc_deadline = 0;
            }
        }
        true
    }

    /// Time since the count was loaded (one-shot) or since the current period began
    /// (periodic, so it stays below a period however long the host left it alone).
    pub fn phase_ns(&self, mode: TimerMode, now: u64) -> u64 {
        let elapsed = now.saturating_sub(self.start_ns);
        if mode == TimerMode::Periodic && self.armed {
            elapsed % self.period_ns(mode).max(1)
        } else {
            elapsed
        }
    }

    pub fn write_initial(&mut self, mode: TimerMode, value: u32, now: u64) {
        if mode == TimerMode::TscDeadline {
            return;
        }
        self.initial = value;
        self.start_ns = now;
        self.armed = value != 0;
    }

    /// A new divisor applies from now on: the count keeps its value and goes on at the new rate.
    pub fn write_divide(&mut self, mode: TimerMode, value: u32, now: u64) {
        let count = self.current_count(mode, now);
        self.divide = value & 0b1011;
        if self.armed && mode != TimerMode::TscDeadline {
            let done = (self.initial - count.min(self.initial)) as u64;
            self.start_ns = now.saturating_sub(done * self.tick_ns());
        }
    }

    pub fn write_tsc_deadline(&mut self, value: u64, now_ns: u64, now_tsc: u64, tsc_hz: u64) {
        self.tsc_deadline = value;
        self.armed = value != 0;
        self.deadline_ns = tsc_deadline_ns(value, now_ns, now_tsc, tsc_hz);
    }
}

/// When the guest's TSC reaches `deadline`, on the clock; a deadline already past is now.
pub(super) fn tsc_deadline_ns(deadline: u64, now_ns: u64, now_tsc: u64, tsc_hz: u64) -> u64 {
    let delta = deadline.saturating_sub(now_tsc) as u128 * 1_000_000_000 / tsc_hz.max(1) as u128;
    now_ns.saturating_add(delta.min(u64::MAX as u128) as u64)
}
