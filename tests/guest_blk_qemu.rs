//! End to end under QEMU: kumo's guest disk driver (guests/src/blk/) and `blkbench` on QEMU's
//! virtio-blk-pci (modern only) over a raw image. The guest writes its pattern through the
//! disk and checks it back; after the VM stops, the host reads the same pattern from the image
//! file; a second boot on the image read-only checks it again and leaves the file unchanged.
//! The guest driver uses only the PCI and virtio specs, so the same program runs on kumo's disk.
//!
//! Needs QEMU and /dev/kvm; skips, saying why, when one is missing. Outcomes only: no durations
//! are asserted, and every wait is a safety net far above need.

use kumo_testkit::qemu::{self, QemuSpec, QemuVm};
use kumo_testkit::sv;
use std::path::Path;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);
const IMAGE_MIB: u64 = 32;

/// blkbench's pattern: word `i` of sector `s`.
fn word(sector: u64, i: u64, seed: u64) -> u64 {
    ((sector << 6) | i).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed
}

fn run(image: &Path, readonly: bool, args: &[String]) -> (u32, String) {
    let drive = format!(
        "file={},if=none,id=d0,format=raw,cache=none,aio=threads{}",
        image.display(),
        if readonly { ",readonly=on" } else { "" }
    );
    let extra = sv(&["-drive", &drive, "-device", "virtio-blk-pci,drive=d0,disable-legacy=on"]);
    let spec = QemuSpec { extra_args: extra, ..QemuSpec::new("blkbench", 128, args) };
    let mut vm = QemuVm::spawn(&spec, None).unwrap_or_else(|e| panic!("{e}"));
    let code = vm.wait_exit(LIMIT).unwrap_or_else(|e| panic!("{e}"));
    (code, vm.serial())
}

#[test]
fn blkbench_writes_its_pattern_through_qemu_virtio_blk() {
    let test = "blkbench_writes_its_pattern_through_qemu_virtio_blk";
    if !qemu::usable_or_skip(test) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kumo-guest-blk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(IMAGE_MIB << 20).unwrap();

    let (code, out) = run(&image, false, &sv(&["size_mib=16", "ms=100", "seed=9"]));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("blkbench: done errors=0 verify_failures=0"), "{out}");
    for t in ["seq4k_read", "rand4k_read", "rand4k_write", "rand64k_write"] {
        assert!(out.contains(&format!("blkbench: {t} qd=32 ops=")), "{t}: {out}");
    }
    // The host reads the guest's pattern from the file: the whole 16 MiB region.
    let img = std::fs::read(&image).unwrap();
    let bad = (0..(16u64 << 11))
        .flat_map(|s| (0..64).map(move |i| (s, i)))
        .filter(|&(s, i)| {
            let at = (s * 512 + i * 8) as usize;
            u64::from_le_bytes(img[at..at + 8].try_into().unwrap()) != word(s, i, 9)
        })
        .count();
    assert_eq!(bad, 0, "words of the image that are not the guest's pattern");
    assert!(img[16 << 20..].iter().all(|&b| b == 0), "nothing written past the region");

    // Read-only: the pattern checks out again and the file is unchanged.
    let (code, out) = run(&image, true, &sv(&["size_mib=16", "ms=100", "seed=9", "readonly=1"]));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("blkbench: done errors=0 verify_failures=0"), "{out}");
    assert!(!out.contains("_write"), "{out}");
    assert!(std::fs::read(&image).unwrap() == img, "a read-only disk's image is unchanged");
    // Another seed's pattern is not there: the check is real.
    let (code, out) = run(&image, true, &sv(&["size_mib=1", "ms=10", "seed=10", "readonly=1"]));
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("verify_failures="), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
