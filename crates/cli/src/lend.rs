//! `kumo lend` and `kumo return` (docs/elastic.md): the coordinator is `kumo_elastic::lend`.

use std::path::PathBuf;

use kumo_api::ApiClient;
use kumo_elastic::lend::{lend, LendRequest};

#[derive(clap::Args, Debug)]
pub struct LendArgs {
    /// API socket of the VM that gives.
    #[arg(long, value_name = "SOCK")]
    from: PathBuf,
    /// API socket of the VM that takes.
    #[arg(long, value_name = "SOCK")]
    to: PathBuf,
    /// How many host CPUs.
    #[arg(long, default_value_t = 0)]
    cpus: u32,
    /// How much memory, whole elastic blocks (e.g. 128M).
    #[arg(long, value_parser = crate::parse_size)]
    memory: Option<u64>,
    /// The giving VM's guest node to take memory from (default: the one holding the most).
    #[arg(long)]
    node: Option<u32>,
    /// How long each guest has to confirm, ms.
    #[arg(long, default_value_t = kumo_api::ELASTIC_TIMEOUT_MS)]
    timeout_ms: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: LendArgs, returning: bool) -> Result<i32, String> {
    let wait = kumo_elastic::lend::client_timeout(a.timeout_ms);
    let from = ApiClient::new(&a.from).with_timeout(wait);
    let to = ApiClient::new(&a.to).with_timeout(wait);
    let req = LendRequest {
        cpus: a.cpus,
        memory_bytes: a.memory.unwrap_or(0),
        node: a.node,
        timeout_ms: a.timeout_ms,
        returning,
    };
    // Between the two VMs' steps the coordinator must not wait behind spinning vCPUs either.
    let _rt = kumo_vmm::placement::realtime_this_thread();
    let r = lend(&from, &to, &req).map_err(|e| e.to_string())?;
    if a.json {
        println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    } else {
        let verb = if returning { "returned" } else { "lent" };
        let mut what = Vec::new();
        if !r.released.host_cpus.is_empty() {
            what.push(format!("host CPUs {:?} (now vCPUs {:?})", r.released.host_cpus, r.acquired.vcpus));
        }
        if let Some(m) = r.released.memory {
            what.push(format!(
                "{} of memory (node {} -> node {})",
                kumo_vm::memory::human_size(m.bytes),
                m.node,
                r.acquired.node.unwrap_or(0)
            ));
        }
        println!(
            "{verb} {} from {} to {} in {:.2} ms (guests confirmed in {:.2} + {:.2} ms)",
            what.join(" and "),
            a.from.display(),
            a.to.display(),
            r.total_ms,
            r.released.guest_ms,
            r.acquired.guest_ms
        );
    }
    Ok(0)
}
