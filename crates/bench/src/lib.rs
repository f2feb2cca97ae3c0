//! kumo-bench owns kumo's benchmarks, out of the `kumo` binary (plotters
//! and the bench's progress bars are linked only here): `boot` (start-up and IPI round trips),
//! `migrate` (live migration against raw loopback TCP and QEMU), `net` (the NIC's interrupt
//! paths against veth), `ipi` (synchronisation on each interrupt path, seed 003), `handover`
//! (NIC handover between VMs, seed 001), `numa` (a memory-bound kernel, bare metal vs VMs),
//! `lend` (lending CPUs and memory between running VMs, issue 13), `disk` (virtio-blk against
//! QEMU's and the host's own I/O, issue 21); `qemu` (runs kumo's guests
//! under QEMU) is kumo-testkit's, shared with tests/qemu_e2e.rs. Benchmarks drive a `kumo`
//! binary as child processes ([`kumo_binary`], kumo-testkit's `Kid`) and write their results
//! into one output directory.

pub mod boot;
pub mod disk;
pub mod handover;
pub mod ipi;
pub mod lend;
pub mod migrate;
pub mod net;
pub mod numa;
pub mod report;
pub use kumo_testkit::qemu;

use std::path::{Path, PathBuf};

/// The font the plots draw with (`scripts/setup.sh` installs fonts-dejavu-core).
pub(crate) const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers [`FONT`] as plotters' "sans-serif" (plotters has no font of its own here).
pub fn register_plot_font() -> Result<(), String> {
    use plotters::style::FontStyle;
    let font = std::fs::read(FONT).map_err(|e| format!("no font at {FONT} ({e}); install fonts-dejavu-core"))?;
    plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| format!("{FONT} is not a usable font"))
}

/// A plotters drawing error as the benches report it (`.map_err(plot_err)`).
pub(crate) fn plot_err<E: std::error::Error + Send + Sync>(err: plotters::drawing::DrawingAreaErrorKind<E>) -> String {
    format!("cannot draw: {err}")
}

/// Test helper: `plot` draws a non-empty PNG into a temporary directory (skips, saying why,
/// without the font).
#[cfg(test)]
pub(crate) fn check_plot(name: &str, plot: impl FnOnce(&Path) -> Result<(), String>) {
    if !Path::new(FONT).exists() {
        eprintln!("skipping the {name} plot test: no font at {FONT}");
        return;
    }
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix(std::env::temp_dir().join(format!("kumo-{name}-plot-")))
        .expect("tempdir");
    let p = dir.as_path().join(format!("{name}.png"));
    plot(&p).expect("plot");
    assert!(std::fs::metadata(&p).expect("png").len() > 0);
}

pub use kumo_testkit::{kumo_binary, try_free_port as free_port};

/// Creates the output directory and returns `dir/name`.
pub fn out_file(dir: &Path, name: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir.join(name))
}
