//! `kumo migrate` (source side, through the VM's API) and `kumo run --incoming` (destination).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kumo_api::{
    ApiClient, DryRunReport, Event, MigrateRequest, MigrationEngine, MigrationResult, MigrationState, SendReport,
};
use kumo_vmm::migration::Incoming;
use kumo_vmm::RunningVm;

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// Destination: tcp:HOST:PORT or unix:PATH of a `kumo run --incoming`.
    #[arg(long, value_name = "ADDR")]
    to: Option<String>,
    /// How pages travel (docs/migration.md, "Engines") [default: zerocopy, or overlap with
    /// --tls-dir].
    #[arg(long, value_enum)]
    engine: Option<MigrationEngine>,
    /// Stop pre-copy once the rest fits this downtime (ms) [default, with neither this nor
    /// --xen/--no-xen: 50 ms, beside Xen's rule].
    #[arg(long, value_name = "MS")]
    downtime_ms: Option<u64>,
    /// Do not apply Xen's stop rule: the downtime target alone (--downtime-ms, or 50 ms).
    #[arg(long)]
    no_xen: bool,
    /// Apply Xen's stop rule: alone, without the default 50 ms target, unless --downtime-ms.
    #[arg(long, conflicts_with = "no_xen")]
    xen: bool,
    /// Parallel connections (overlap, zerocopy) [default: 4; 1 for serial and local].
    #[arg(long)]
    connections: Option<usize>,
    /// Cap on the page data sent per second, e.g. 100M (100 MiB/s); at least 1 MB/s.
    #[arg(long, value_name = "SIZE", value_parser = kumo_vmm::config::parse_size)]
    max_bandwidth: Option<u64>,
    /// Only watch the guest dirty memory and predict the migration (dirty-page model).
    #[arg(long)]
    dry_run: bool,
    /// How long the dry run watches (ms).
    #[arg(long, default_value_t = 2000)]
    estimate_ms: u64,
    /// With --dry-run: measure this host's loopback TCP (64 MiB sent to itself) and predict at
    /// that bandwidth, instead of assuming 1 GB/s.
    #[arg(long, requires = "dry_run")]
    measure_link: bool,
    /// Make --downtime-ms a promise: fail (the VM runs on here) rather than exceed it.
    #[arg(long, requires = "downtime_ms")]
    strict: bool,
    /// Give up when the destination takes no data or does not answer for this long (ms); the
    /// VM then runs on here.
    #[arg(long, value_name = "MS")]
    progress_timeout_ms: Option<u64>,
    /// Print the migration's events as JSON lines on stdout as they happen, the report last.
    #[arg(long)]
    json: bool,
    /// Mutual TLS to a tcp: destination (not with --engine zerocopy): DIR holds ca.pem,
    /// cert.pem and key.pem; the destination's certificate must be signed by ca.pem and name
    /// the host of --to (or --tls-server-name).
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// The name the destination's certificate must carry, instead of the host of --to.
    #[arg(long, value_name = "NAME", requires = "tls_dir")]
    tls_server_name: Option<String>,
}

/// A path for the VMM's process (which resolves it): absolute, UTF-8.
pub fn path_arg(p: &std::path::Path) -> Result<String, String> {
    let abs = std::path::absolute(p).map_err(|e| format!("{}: {e}", p.display()))?;
    abs.to_str().map(String::from).ok_or_else(|| format!("{} is not UTF-8", abs.display()))
}

/// Set by SIGINT while `kumo migrate` runs: the poll loop turns it into a cancel request.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C cancels the migration instead of killing the CLI (which would leave it running);
/// a second Ctrl-C kills as usual (SA_RESETHAND).
fn catch_sigint() {
    // SAFETY: a zeroed sigaction with a handler that only stores an atomic (async-signal-safe).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESETHAND;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut()) != 0 {
            tracing::warn!("cannot catch Ctrl-C: {}", std::io::Error::last_os_error());
        }
    }
}

pub fn run(a: MigrateArgs, socket: Option<PathBuf>) -> Result<i32, String> {
    let socket = socket.ok_or("kumo migrate needs --api-socket PATH of the running VM")?;
    let to = match (&a.to, a.dry_run) {
        (Some(t), _) => t.clone(),
        (None, true) => "tcp:127.0.0.1:0".into(), // not contacted by a dry run
        (None, false) => return Err("kumo migrate needs --to ADDR (or --dry-run)".into()),
    };
    let req = MigrateRequest {
        to,
        engine: a.engine,
        downtime_ms: a.downtime_ms,
        xen: if a.no_xen { Some(false) } else { a.xen.then_some(true) },
        connections: a.connections,
        dry_run: a.dry_run,
        estimate_ms: Some(a.estimate_ms),
        measure_link: a.measure_link,
        progress_timeout_ms: a.progress_timeout_ms,
        strict: a.strict.then_some(true),
        max_bandwidth: a.max_bandwidth,
        tls_dir: a.tls_dir.as_deref().map(path_arg).transpose()?,
        tls_server_name: a.tls_server_name.clone(),
    };
    // The migration call blocks until the end; progress comes from polling its status.
    let client = ApiClient::new(&socket).with_timeout(Duration::from_secs(24 * 3600));
    client.ping().map_err(|e| e.to_string())?;
    catch_sigint();
    // The answer comes back on a channel, so the end is seen at once, not at the next poll.
    let (done_tx, done) = std::sync::mpsc::channel();
    {
        let c = client.clone();
        let r = req.clone();
        // A send fails only once this side stopped waiting: nothing is left to tell.
        std::thread::spawn(move || {
            let _ = done_tx.send(c.send_migration(&r));
        });
    }
    let mut out = Output::new(a.json);
    if a.dry_run {
        out.note(&format!("watching the guest dirty memory for {} ms", a.estimate_ms));
    }
    let poller = ApiClient::new(&socket).with_timeout(Duration::from_secs(5));
    let mut seen = 0;
    let mut cancel_sent = false;
    let result = loop {
        if INTERRUPTED.load(Ordering::SeqCst) && !cancel_sent {
            cancel_sent = true;
            match poller.cancel_migration() {
                Ok(()) => out.note("cancelling the migration (the VM runs on here)…"),
                Err(e) => out.note(&format!("cannot cancel: {e}")),
            }
        }
        if let Ok(st) = poller.migration_status() {
            for e in st.events.iter().skip(seen) {
                out.event(e);
            }
            seen = seen.max(st.events.len());
        }
        out.tick();
        match done.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => break r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err("migration thread panicked".into());
            }
        }
    };
    // The answer is the final status: its events complete what polling saw (the source may
    // already be gone). A failed migration's source runs on and still answers.
    let status = match result {
        Ok(st) => st,
        Err(e) => match poller.migration_status() {
            Ok(st) if st.state != MigrationState::Running => {
                for ev in st.events.iter().skip(seen) {
                    out.event(ev);
                }
                out.finish();
                return Err(match st.state {
                    MigrationState::Cancelled => "migration cancelled; the VM runs on at the source".into(),
                    _ => e.to_string(),
                });
            }
            _ => {
                out.finish();
                return Err(e.to_string());
            }
        },
    };
    for ev in status.events.iter().skip(seen) {
        out.event(ev);
    }
    out.finish();
    match status.report {
        Some(MigrationResult::Migrated(r)) if a.json => println!("{}", json_line(&*r)),
        Some(MigrationResult::DryRun(r)) if a.json => println!("{}", json_line(&r)),
        Some(MigrationResult::Migrated(r)) => print_report(&r),
        Some(MigrationResult::DryRun(r)) => print_dry_run(&r),
        None => return Err("the VM answered no migration report".into()),
    }
    Ok(0)
}

fn json_line<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\": \"cannot encode: {e}\"}}"))
}

/// Where progress goes: JSON lines on stdout (`--json`), a progress bar on a terminal, or
/// plain lines on stderr.
enum Output {
    Json,
    Bar(ProgressBar),
    Lines { last_progress: Option<Instant> },
}

impl Output {
    fn new(json: bool) -> Output {
        if json {
            return Output::Json;
        }
        if !std::io::stderr().is_terminal() {
            return Output::Lines { last_progress: None };
        }
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{spinner} round {prefix:>2} [{bar:30}] {pos}/{len} pages  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Output::Bar(bar)
    }

    /// A message of kumo's own (not an event).
    fn note(&self, msg: &str) {
        match self {
            Output::Bar(bar) => bar.println(format!("kumo: {msg}")),
            _ => note!("kumo: {msg}"),
        }
    }

    fn tick(&self) {
        if let Output::Bar(bar) = self {
            bar.tick();
        }
    }

    fn finish(&self) {
        if let Output::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }

    fn event(&mut self, e: &Event) {
        match self {
            Output::Json => println!("{}", json_line(e)),
            Output::Bar(bar) => render(bar, e),
            Output::Lines { last_progress } => {
                // Progress comes ~10 times a second: one line a second is enough in a log.
                if let Event::Progress { .. } = e {
                    if last_progress.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
                        return;
                    }
                    *last_progress = Some(Instant::now());
                }
                if let Some(line) = describe(e) {
                    note!("kumo: {line}");
                }
            }
        }
    }
}

fn opt_ms(label: &str, v: Option<f64>) -> String {
    v.map(|d| format!(", {label} {d:.1} ms")).unwrap_or_default()
}

/// One line for an event, for logs.
fn describe(e: &Event) -> Option<String> {
    Some(match e {
        Event::Started { engine, connections, total_pages, touched_pages } => format!(
            "migration started: {engine} engine, {connections} connection(s), {touched_pages} of {total_pages} pages to send in round 0"
        ),
        Event::Progress { round, round_pages, pages_sent, mb_per_s, eta_ms, estimated_downtime_ms, .. } => format!(
            "round {round}: {pages_sent}/{round_pages} pages, {mb_per_s:.0} MB/s{}{}",
            opt_ms("ETA", *eta_ms),
            opt_ms("est. downtime", *estimated_downtime_ms)
        ),
        Event::Round { round, pages_sent, ms, dirty_pages, mb_per_s, estimated_downtime_ms, .. } => format!(
            "round {round} done: {pages_sent} pages in {ms:.1} ms, {dirty_pages} dirty, {mb_per_s:.0} MB/s{}",
            opt_ms("est. downtime", *estimated_downtime_ms)
        ),
        Event::NotConverging { .. } => not_converging(e)?,
        Event::StopAndCopy { reason, pages } => format!("stop-and-copy ({reason}): {pages} pages"),
        Event::Completed { total_ms, downtime_ms } => {
            format!("migration completed in {total_ms:.1} ms, downtime {downtime_ms:.1} ms")
        }
        Event::Failed { error } => format!("migration failed: {error}"),
        Event::Cancelled => "migration cancelled; the VM runs on at the source".into(),
    })
}

fn not_converging(e: &Event) -> Option<String> {
    let Event::NotConverging { estimated_downtime_ms, target_ms, throttle_percent, .. } = e else { return None };
    let target = target_ms.map(|t| format!(" (target {t:.0} ms)")).unwrap_or_default();
    Some(format!(
        "not converging: the guest dirties memory faster than it is sent; estimated downtime {estimated_downtime_ms:.1} ms{target}; vCPUs throttled {throttle_percent}%"
    ))
}

fn render(bar: &ProgressBar, e: &Event) {
    match e {
        Event::Started { engine, connections, touched_pages, .. } => {
            bar.set_length(*touched_pages);
            bar.set_prefix("0");
            bar.set_message(format!("{engine} engine, {connections} connection(s)"));
        }
        Event::Progress { round, round_pages, pages_sent, mb_per_s, eta_ms, estimated_downtime_ms, .. } => {
            bar.set_prefix(round.to_string());
            bar.set_length(*round_pages);
            bar.set_position(*pages_sent);
            let eta = eta_ms.map(|t| format!(", ETA {:.1} s", t / 1e3)).unwrap_or_default();
            bar.set_message(format!("{mb_per_s:.0} MB/s{eta}{}", opt_ms("est. downtime", *estimated_downtime_ms)));
        }
        Event::Round { round, dirty_pages, mb_per_s, estimated_downtime_ms, .. } => {
            bar.set_prefix((round + 1).to_string());
            bar.set_length(*dirty_pages);
            bar.set_position(0);
            bar.set_message(format!(
                "{mb_per_s:.0} MB/s, {dirty_pages} pages left{}",
                opt_ms("est. downtime", *estimated_downtime_ms)
            ));
        }
        Event::NotConverging { .. } => {
            if let Some(l) = not_converging(e) {
                bar.println(l);
            }
        }
        Event::StopAndCopy { reason, pages } => bar.set_message(format!("stop-and-copy ({reason}): {pages} pages")),
        Event::Cancelled => bar.println("migration cancelled; the VM runs on at the source"),
        Event::Completed { .. } | Event::Failed { .. } => {}
    }
}

fn print_dry_run(r: &DryRunReport) {
    let p = &r.predicted;
    println!("dirty-page model: M = {:.0} pages, tau = {:.3} s ({} observations)", r.m, r.tau_s, r.observations.len());
    println!(
        "predicted at {:.0} pages/s: {} rounds, {} pages, {:.2} s total, {:.1} ms downtime",
        r.bandwidth_pages_per_s,
        p.rounds.len(),
        p.total_pages,
        p.total_secs,
        p.downtime_secs * 1e3
    );
}

fn print_report(s: &SendReport) {
    let r = &s.report;
    println!(
        "migrated to {} with {} ({} conn): {:.1} ms total, {:.1} ms downtime, {} pages ({} zero), {:.1} MB/s, stop: {}",
        s.to,
        r.engine,
        r.connections,
        r.total_ms,
        r.downtime_ms,
        r.total_pages,
        r.zero_pages,
        r.mb_per_s,
        r.stop_reason
    );
    let est = r.estimated_downtime_ms.map(|e| format!("{e:.1} ms")).unwrap_or_else(|| "none".into());
    let sp = &r.stop_phase;
    println!(
        "downtime {:.1} ms, estimated {est}: pause {:.1} ms, {} pages {:.1} ms, state {:.1} ms, destination reply {:.1} ms",
        r.downtime_ms, sp.pause_ms, sp.pages, sp.pages_ms, sp.state_ms, sp.reply_ms
    );
    if r.max_throttle_percent > 0 {
        println!("vCPUs were throttled up to {}% to converge", r.max_throttle_percent);
    }
    println!("{:>5} {:>10} {:>10} {:>10} {:>12}", "round", "pages", "zero", "ms", "dirty after");
    for x in &r.rounds {
        println!("{:>5} {:>10} {:>10} {:>10.1} {:>12}", x.round, x.pages, x.zero_pages, x.ms, x.dirty_after);
    }
    println!("sender CPU: {:.1} ms", r.sender_cpu_ms);
    let m = &s.model;
    if let (true, Some(mm), Some(tau), Some(p)) = (m.fitted, m.m, m.tau_s, &m.predicted) {
        println!(
            "dirty-page model: M = {mm:.0}, tau = {tau:.3} s; predicted {} pages / {:.2} s vs measured {} pages / {:.2} s",
            p.total_pages,
            p.total_secs,
            r.total_pages,
            r.rounds.iter().map(|x| x.ms).sum::<f64>() / 1e3
        );
    }
    if s.arrived_paused {
        println!("the VM was paused here and arrives paused: resume it at the destination");
    }
}

/// `kumo run --incoming`: waits for one incoming migration and returns the VM, running, its
/// console on `serial`. The destination side lives beside the source side in
/// `kumo_vmm::migration` ([`Incoming`]).
pub fn incoming(inc: &Incoming, serial: Box<dyn std::io::Write + Send>) -> Result<RunningVm, String> {
    inc.receive(&|line| note!("kumo: {line}"), serial).map(|(vm, _)| vm)
}
