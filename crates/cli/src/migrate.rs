//! `kumo migrate` (source side, through the VM's API) and `kumo run --incoming` (destination).

use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use kumo_api::{ApiClient, MigrateRequest};
use kumo_migration_engine::{receive, Address, Listener};
use kumo_vmm::migration::config_from_description;
use kumo_vmm::RunningVm;
use serde_json::Value;

#[derive(clap::Args)]
pub struct MigrateArgs {
    /// Destination: tcp:HOST:PORT or unix:PATH of a `kumo run --incoming`.
    #[arg(long, value_name = "ADDR")]
    to: Option<String>,
    /// serial, overlap, zerocopy or local (same host, unix:PATH).
    #[arg(long, default_value = "overlap")]
    engine: String,
    /// Stop pre-copy once the rest fits this downtime (ms).
    #[arg(long, value_name = "MS")]
    downtime_ms: Option<u64>,
    /// Do not apply Xen's stop rule (needs --downtime-ms).
    #[arg(long)]
    no_xen: bool,
    /// Parallel connections (overlap, zerocopy).
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Only watch the guest dirty memory and predict the migration (dirty-page model).
    #[arg(long)]
    dry_run: bool,
    /// How long the dry run watches (ms).
    #[arg(long, default_value_t = 2000)]
    estimate_ms: u64,
    /// Make --downtime-ms a promise: fail (the VM runs on here) rather than exceed it.
    #[arg(long, requires = "downtime_ms")]
    strict: bool,
    /// Give up when the destination takes no data or does not answer for this long (ms); the
    /// VM then runs on here.
    #[arg(long, value_name = "MS")]
    progress_timeout_ms: Option<u64>,
    /// Print the final report as JSON.
    #[arg(long)]
    json: bool,
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
        engine: Some(a.engine.clone()),
        downtime_ms: a.downtime_ms,
        xen: a.no_xen.then_some(false),
        connections: Some(a.connections),
        dry_run: a.dry_run,
        estimate_ms: Some(a.estimate_ms),
        progress_timeout_ms: a.progress_timeout_ms,
        strict: a.strict.then_some(true),
    };
    // The migration call blocks until the end; progress comes from polling its status.
    let client = ApiClient::new(&socket).with_timeout(Duration::from_secs(24 * 3600));
    client.ping().map_err(|e| e.to_string())?;
    let worker = {
        let c = client.clone();
        let r = req.clone();
        std::thread::spawn(move || c.migrate(&r))
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} round {prefix:>2} [{bar:30}] {pos}/{len} pages  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    if a.dry_run {
        bar.set_message(format!("watching the guest dirty memory for {} ms", a.estimate_ms));
    }
    let poller = ApiClient::new(&socket).with_timeout(Duration::from_secs(5));
    let mut seen = 0;
    while !worker.is_finished() {
        if let Ok(st) = poller.migration_status() {
            let events = st["events"].as_array().cloned().unwrap_or_default();
            for e in events.iter().skip(seen) {
                render(&bar, e);
            }
            seen = events.len();
        }
        bar.tick();
        std::thread::sleep(Duration::from_millis(100));
    }
    let result = worker.join().map_err(|_| "migration thread panicked".to_string())?;
    bar.finish_and_clear();
    let report = result.map_err(|e| e.to_string())?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        print_report(&report);
    }
    Ok(0)
}

fn render(bar: &ProgressBar, e: &Value) {
    match e["event"].as_str() {
        Some("started") => {
            bar.set_length(e["touched_pages"].as_u64().unwrap_or(0));
            bar.set_prefix("0");
            bar.set_message(format!(
                "{} engine, {} connection(s)",
                e["engine"].as_str().unwrap_or("?"),
                e["connections"]
            ));
        }
        Some("round") => {
            let dirty = e["dirty_pages"].as_u64().unwrap_or(0);
            bar.set_prefix(format!("{}", e["round"].as_u64().unwrap_or(0) + 1));
            bar.set_length(dirty);
            bar.set_position(0);
            let dt =
                e["estimated_downtime_ms"].as_f64().map(|d| format!(", est. downtime {d:.1} ms")).unwrap_or_default();
            bar.set_message(format!("{:.0} MB/s, {dirty} pages left{dt}", e["mb_per_s"].as_f64().unwrap_or(0.0)));
        }
        Some("not_converging") => {
            let target = e["target_ms"].as_f64().map(|t| format!(" (target {t:.0} ms)")).unwrap_or_default();
            bar.println(format!(
                "not converging: the guest dirties memory faster than it is sent; estimated downtime {:.1} ms{target}; vCPUs throttled {}%",
                e["estimated_downtime_ms"].as_f64().unwrap_or(0.0),
                e["throttle_percent"]
            ));
        }
        Some("stop_and_copy") => {
            bar.set_message(format!("stop-and-copy ({}): {} pages", e["reason"].as_str().unwrap_or(""), e["pages"]))
        }
        _ => {}
    }
}

fn print_report(r: &Value) {
    if r["dry_run"].as_bool() == Some(true) {
        let p = &r["predicted"];
        println!(
            "dirty-page model: M = {:.0} pages, tau = {:.3} s ({} observations)",
            r["m"].as_f64().unwrap_or(0.0),
            r["tau_s"].as_f64().unwrap_or(0.0),
            r["observations"].as_array().map_or(0, |a| a.len())
        );
        println!(
            "predicted at {:.0} pages/s: {} rounds, {} pages, {:.2} s total, {:.1} ms downtime",
            r["bandwidth_pages_per_s"].as_f64().unwrap_or(0.0),
            p["rounds"].as_array().map_or(0, |a| a.len()),
            p["total_pages"],
            p["total_secs"].as_f64().unwrap_or(0.0),
            p["downtime_secs"].as_f64().unwrap_or(0.0) * 1e3
        );
        return;
    }
    println!(
        "migrated to {} with {} ({} conn): {:.1} ms total, {:.1} ms downtime, {} pages, {:.1} MB/s, stop: {}",
        r["to"].as_str().unwrap_or("?"),
        r["engine"].as_str().unwrap_or("?"),
        r["connections"],
        r["total_ms"].as_f64().unwrap_or(0.0),
        r["downtime_ms"].as_f64().unwrap_or(0.0),
        r["total_pages"],
        r["mb_per_s"].as_f64().unwrap_or(0.0),
        r["stop_reason"].as_str().unwrap_or("")
    );
    let est = r["estimated_downtime_ms"].as_f64().map(|e| format!("{e:.1} ms")).unwrap_or_else(|| "none".into());
    let sp = &r["stop_phase"];
    println!(
        "downtime {:.1} ms, estimated {est}: pause {:.1} ms, {} pages {:.1} ms, state {:.1} ms, destination reply {:.1} ms",
        r["downtime_ms"].as_f64().unwrap_or(0.0),
        sp["pause_ms"].as_f64().unwrap_or(0.0),
        sp["pages"],
        sp["pages_ms"].as_f64().unwrap_or(0.0),
        sp["state_ms"].as_f64().unwrap_or(0.0),
        sp["reply_ms"].as_f64().unwrap_or(0.0)
    );
    if let Some(t) = r["max_throttle_percent"].as_u64().filter(|&t| t > 0) {
        println!("vCPUs were throttled up to {t}% to converge");
    }
    println!("{:>5} {:>10} {:>10} {:>12}", "round", "pages", "ms", "dirty after");
    for x in r["rounds"].as_array().into_iter().flatten() {
        let n = |k: &str| x[k].as_u64().unwrap_or(0);
        println!(
            "{:>5} {:>10} {:>10.1} {:>12}",
            n("round"),
            n("pages"),
            x["ms"].as_f64().unwrap_or(0.0),
            n("dirty_after")
        );
    }
    println!("sender CPU: {:.1} ms", r["sender_cpu_ms"].as_f64().unwrap_or(0.0));
    let m = &r["model"];
    if m["fitted"].as_bool() == Some(true) {
        println!(
            "dirty-page model: M = {:.0}, tau = {:.3} s; predicted {} pages / {:.2} s vs measured {} pages / {:.2} s",
            m["m"].as_f64().unwrap_or(0.0),
            m["tau_s"].as_f64().unwrap_or(0.0),
            m["predicted"]["total_pages"],
            m["predicted"]["total_secs"].as_f64().unwrap_or(0.0),
            r["total_pages"],
            r["rounds"]
                .as_array()
                .map_or(0.0, |a| a.iter().map(|x| x["ms"].as_f64().unwrap_or(0.0)).sum::<f64>() / 1e3)
        );
    }
}

/// Waits for one incoming migration on `addr` and returns the VM, running. With `memory` or
/// `cpus` the destination is prepared: it accepts only a VM of that shape, and guest memory of
/// that size is allocated and faulted in first, so the transfer does not pay for first-touch
/// page faults (expensive on nested hosts). Both are checked against this host before that.
pub fn incoming(addr: &str, memory: Option<u64>, cpus: Option<u32>) -> Result<RunningVm, String> {
    let addr: Address = addr.parse()?;
    let host = kumo_vm::layout::HostLimits::probe().map_err(|e| e.to_string())?;
    if let Some(n) = cpus {
        kumo_vm::layout::check_vcpus(n, host.kvm_max_vcpus).map_err(|e| e.to_string())?;
    }
    if let Some(size) = memory {
        kumo_vm::memory::check_size(size, &host.memory).map_err(|e| e.to_string())?;
    }
    let mut reserved = match memory {
        Some(size) => {
            let t = std::time::Instant::now();
            let m = kumo_vm::Memory::new(size).map_err(|e| e.to_string())?;
            for &(gpa, len) in m.layout.ram() {
                kumo_vm::memory::populate(&m.guest, gpa, len).map_err(|e| e.to_string())?;
            }
            eprintln!("kumo: prepared {} MiB of guest memory in {:.0} ms", size >> 20, t.elapsed().as_secs_f64() * 1e3);
            Some(m.memfd)
        }
        None => None,
    };
    // Listen only once the memory is ready: a source that connected earlier would wait for
    // the handshake while memory is faulted in, and give up.
    let listener = Listener::bind(&addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    eprintln!("kumo: waiting for a migration on {}", listener.local_addr());
    let (vm, rr) = receive(&listener, kumo_migration_engine::PROGRESS_TIMEOUT, |desc, memfd| {
        let config = config_from_description(desc)?;
        let human = kumo_vm::memory::human_size;
        if let Some(size) = memory.filter(|&m| m != config.memory) {
            return Err(format!(
                "this destination is prepared for {} of memory; the VM has {}",
                human(size),
                human(config.memory)
            ));
        }
        if let Some(n) = cpus.filter(|&n| n != config.cpus) {
            return Err(format!("this destination is prepared for {n} vCPUs; the VM has {}", config.cpus));
        }
        // Memory shared by a local migration wins; otherwise the prepared memory, if any.
        let memfd = memfd.or_else(|| reserved.take());
        RunningVm::incoming(config, Box::new(std::io::stdout()), memfd).map_err(|e| e.to_string())
    })
    .map_err(|e| format!("incoming migration failed: {e}"))?;
    eprintln!(
        "kumo: migration received: {} pages over {} connection(s) in {:.1} ms, receiver CPU {:.1} ms, restore {:.1} ms{}",
        rr.pages,
        rr.connections,
        rr.total_ms,
        rr.receiver_cpu_ms,
        rr.restore_ms,
        if rr.shared_memory { " (memory shared, not copied)" } else { "" }
    );
    Ok(vm)
}
