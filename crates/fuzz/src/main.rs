//! `kumo-fuzz TARGET [--cases N] [--seed S] [--case I]`, `kumo-fuzz list`, `kumo-fuzz all`.

use std::process::ExitCode;

const USAGE: &str = "usage: kumo-fuzz list | kumo-fuzz TARGET|all [--cases N] [--seed S] [--case I]";

fn number(s: Option<String>, what: &str) -> Result<u64, String> {
    let s = s.ok_or_else(|| format!("{what} needs a value"))?;
    let r = match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{what}: not a number: {s}"))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kumo-fuzz: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let name = args.next().ok_or(USAGE)?;
    let (mut cases, mut seed, mut case) = (None, kumo_fuzz::TEST_SEED, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--cases" => cases = Some(number(args.next(), "--cases")?),
            "--seed" => seed = number(args.next(), "--seed")?,
            "--case" => case = Some(number(args.next(), "--case")?),
            _ => return Err(format!("unknown argument {a}\n{USAGE}")),
        }
    }
    if name == "list" {
        for t in kumo_fuzz::targets() {
            println!("{:<16} {} (cargo test: {} cases)", t.name, t.about, t.test_cases);
        }
        return Ok(());
    }
    let chosen: Vec<_> = if name == "all" {
        kumo_fuzz::targets().iter().collect()
    } else {
        vec![kumo_fuzz::target(&name).ok_or_else(|| format!("no target {name} (kumo-fuzz list)"))?]
    };
    for t in chosen {
        let t0 = std::time::Instant::now();
        let n = match case {
            Some(i) => kumo_fuzz::run_case(t, seed, i).map(|()| 1),
            None => kumo_fuzz::run(t, seed, cases.unwrap_or(t.test_cases)),
        }
        .map_err(|f| f.to_string())?;
        println!("{}: {n} cases of seed {seed:#x} passed in {:.1} s", t.name, t0.elapsed().as_secs_f64());
    }
    Ok(())
}
