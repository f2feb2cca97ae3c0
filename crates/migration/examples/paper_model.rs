//! Replays the paper's analysis (SEEDS §004, Tables 14 and 16) with the dirty-page model:
//! `cargo run -p kumo-migration --example paper_model`.

use kumo_migration::{predict, DirtyModel, PredictParams, StopPolicy};

fn main() {
    const VM_PAGES: u64 = 524_288; // 2 GB
                                   // (name, first-round seconds, sender CPU share β) from the paper's Tables 9 and 11.
    let setups = [("TCP", 9.63, 0.806), ("RDMA", 4.92, 0.423), ("overlap", 2.86, 0.742)];
    let params = |secs: f64, beta| PredictParams {
        total_pages: VM_PAGES,
        round0_pages: VM_PAGES,
        bandwidth_pages_per_s: VM_PAGES as f64 / secs,
        beta,
        policy: StopPolicy::default(),
    };
    for m in [1.00e5, 2.01e5, 4.02e5] {
        let model = DirtyModel { m, tau: 1.32 };
        println!("M = {m:.3e}, τ = 1.32 s");
        for (name, secs, beta) in setups {
            let p = predict(&model, &params(secs, beta)).expect("valid parameters");
            let first: Vec<String> = p.rounds.iter().take(4).map(|r| format!("{}", r.pages)).collect();
            println!(
                "  {name:8} rounds {:>2}  total {:>9} pages  re-sent {:>9}  {:>6.2} s  downtime {:.4} s  {:?}  [{} …]",
                p.rounds.len(),
                p.total_pages,
                p.resent_pages(),
                p.total_secs,
                p.downtime_secs,
                p.stop,
                first.join(", ")
            );
        }
    }
}
